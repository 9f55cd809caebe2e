"""Who may import whom, read from the source (docs/architecture.md, "Rooms" and "Floors
inside gateway/"): each room imports only the rooms its row allows, inside gateway/
each floor only the floors below it or its own, and no modules import each other in
a circle.

Every import counts, wherever it is written: at the top of a module, inside a function
(a deferred import still needs the room it names) and under ``if TYPE_CHECKING:`` (the
types of a higher floor are knowledge of it). Relative imports are resolved.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROOMS = ("engines", "router", "cache", "evaluator", "gateway")

# What each room may import of the other rooms, as module prefixes (its own room it may
# always import). The cache may use the router's embedding and vector index types only.
MAY_IMPORT: dict[str, tuple[str, ...]] = {
    "engines": (),
    "router": (),
    "cache": ("router.embedder", "router.index"),
    "evaluator": ("engines",),
    "gateway": ROOMS,
}
# The shared lowest-level helpers, which live in engines/ (the lowest room), import
# nothing of ours and which every room may import (README, "Develop").
SHARED_HELPERS = ("engines.jsonl", "engines.breaker")

# The floors inside gateway/, low to high, each as its module prefixes. The package's
# own __init__ runs before any module under it, so it is on the lowest floor.
FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("config", ("gateway.config",)),
    ("pipeline", ("gateway.pipeline",)),
    ("checks", ("gateway.checks",)),
    ("ops", ("gateway.ops",)),
    ("runtime", ("gateway.runtime", "gateway.reload")),
    ("api", ("gateway.api",)),
    ("cli", ("gateway.cli",)),
)


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


@functools.cache
def _modules() -> dict[str, Path]:
    """Every module of the rooms by dotted name (a package by its own name)."""
    modules = {}
    for room in ROOMS:
        for path in sorted((ROOT / room).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _ours(name: str) -> str | None:
    """The module of ours that an imported name lives in (the longest prefix that is
    one), or None for another distribution's name."""
    modules = _modules()
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _imported(module: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    if isinstance(node, ast.Import):
        return {ours for alias in node.names if (ours := _ours(alias.name)) is not None}
    source = node.module or ""
    if node.level:
        path = _modules()[module]
        package = module.split(".")
        if path.name != "__init__.py":
            package = package[:-1]
        base = ".".join(package[: len(package) - (node.level - 1)])
        source = f"{base}.{source}" if source else base
    found: set[str] = set()
    for alias in node.names:
        # `from package import module` imports the module; `from module import name`
        # the module.
        target = _ours(f"{source}.{alias.name}")
        if target != f"{source}.{alias.name}":
            target = _ours(source)
        if target is not None:
            found.add(target)
    return found


@functools.cache
def _graph() -> dict[str, frozenset[str]]:
    """Each module of ours and the modules of ours it imports."""
    graph = {}
    for module, path in _modules().items():
        imports: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                imports |= _imported(module, node)
        imports.discard(module)
        graph[module] = frozenset(imports)
    return graph


def _edges() -> list[tuple[str, str]]:
    return [(source, target) for source, targets in _graph().items() for target in sorted(targets)]


def _floor(module: str) -> int | None:
    if module == "gateway":
        return 0
    for level, (_, prefixes) in enumerate(FLOORS):
        if any(_within(module, prefix) for prefix in prefixes):
            return level
    return None


def test_the_source_is_read() -> None:
    graph = _graph()
    for room in ROOMS:
        assert any(_within(module, room) for module in graph), f"no modules in {room}/"
    assert "gateway.runtime" in graph["gateway.api.app"]
    assert "gateway.api.render" in graph["gateway.api.routes"]  # from gateway.api import render


def test_each_room_imports_only_the_rooms_its_row_allows() -> None:
    wrong = []
    for source, target in _edges():
        room = source.split(".")[0]
        if target.split(".")[0] == room or target.startswith(SHARED_HELPERS):
            continue
        if not any(_within(target, allowed) for allowed in MAY_IMPORT[room]):
            allowed = ", ".join(MAY_IMPORT[room]) or "nothing"
            wrong.append(f"{source} -> {target} ({room}/ may import {allowed})")
    assert not wrong, "imports across rooms that the rooms' table forbids:\n" + "\n".join(wrong)


def test_the_shared_helpers_import_nothing_of_ours() -> None:
    for helper in SHARED_HELPERS:
        assert helper in _graph(), f"{helper} is no module: update SHARED_HELPERS"
        assert not _graph()[helper], f"{helper} imports {sorted(_graph()[helper])}"


def test_every_module_inside_gateway_has_a_floor() -> None:
    lost = [m for m in _graph() if _within(m, "gateway") and _floor(m) is None]
    assert not lost, f"modules on no floor (add them to FLOORS): {lost}"


def test_inside_gateway_no_floor_imports_a_higher_one() -> None:
    upward = []
    for source, target in _edges():
        low, high = _floor(source), _floor(target)
        if low is None or high is None or high <= low:
            continue
        upward.append(f"{source} -> {target} ({FLOORS[low][0]} imports {FLOORS[high][0]})")
    assert not upward, "imports from a lower floor to a higher one:\n" + "\n".join(upward)


def _cycle(graph: dict[str, frozenset[str]]) -> list[str] | None:
    """One circle of imports, as the path around it, or None when there is none."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path = [start]
        on_path = {start}
        pending = [iter(sorted(graph[start]))]
        while pending:
            following = next(pending[-1], None)
            if following is None:
                pending.pop()
                finished = path.pop()
                on_path.discard(finished)
                done.add(finished)
                continue
            if following in on_path:
                return [*path[path.index(following) :], following]
            if following not in done:
                path.append(following)
                on_path.add(following)
                pending.append(iter(sorted(graph[following])))
    return None


def test_a_circle_is_found_and_told_as_its_path() -> None:
    line = {"a": frozenset({"b"}), "b": frozenset({"c"}), "c": frozenset()}
    assert _cycle(line) is None
    diamond = {**line, "a": frozenset({"b", "c"}), "b": frozenset({"c"})}
    assert _cycle(diamond) is None
    circle = {**line, "c": frozenset({"b"}), "d": frozenset({"a"})}
    assert _cycle(circle) == ["b", "c", "b"]


def test_no_modules_import_each_other_in_a_circle() -> None:
    cycle = _cycle(_graph())
    assert cycle is None, "an import cycle: " + " -> ".join(cycle or [])
