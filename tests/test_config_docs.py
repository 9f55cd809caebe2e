"""docs/configuration.md is generated from the typed config and cannot drift from it."""

from __future__ import annotations

import difflib
import re
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Any

import msgspec
import pytest
import yaml

from gateway.cli import main
from gateway.config import ConfigError, GatewayConfig, parse_config
from gateway.config.docs import REGENERATE, Section, field_meaning, render_reference, sections

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = ROOT / "docs" / "configuration.md"


@pytest.fixture(scope="module")
def reference() -> str:
    return render_reference()


def _section_text(reference: str, section: Section) -> str:
    start = reference.index(f'<a id="{section.anchor}"></a>')
    end = reference.find("<a id=", start + 1)
    return reference[start : end if end != -1 else len(reference)]


def _rows(text: str) -> dict[str, list[str]]:
    """The table rows of one section, by key, as cells with ``\\|`` unescaped."""
    rows = {}
    for line in text.splitlines():
        match = re.match(r"\| `([^`]+)` \|", line)
        if match:
            cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            rows[match.group(1)] = cells
    return rows


def test_committed_reference_is_current(reference: str) -> None:
    committed = COMMITTED.read_text(encoding="utf-8")
    if committed != reference:
        diff = "".join(
            list(
                difflib.unified_diff(
                    committed.splitlines(keepends=True),
                    reference.splitlines(keepends=True),
                    "docs/configuration.md (committed)",
                    "render_reference()",
                )
            )[:40]
        )
        pytest.fail(f"docs/configuration.md is out of date: run `{REGENERATE}`\n{diff}")


def _structs_by_msgspec(kind: Any, seen: set[type[msgspec.Struct]]) -> None:
    """Every Struct reachable from ``kind``, walked by msgspec's own type info, to check
    the generator's walk against an independent one."""
    info = msgspec.inspect.type_info(kind)
    stack: list[msgspec.inspect.Type] = [info]
    while stack:
        node = stack.pop()
        if isinstance(node, msgspec.inspect.StructType):
            if node.cls in seen:
                continue
            seen.add(node.cls)
            stack.extend(f.type for f in node.fields)
        elif isinstance(node, msgspec.inspect.UnionType):
            stack.extend(node.types)
        elif isinstance(node, msgspec.inspect.DictType):
            stack.extend([node.key_type, node.value_type])
        elif isinstance(
            node,
            msgspec.inspect.ListType | msgspec.inspect.SetType | msgspec.inspect.VarTupleType,
        ):
            stack.append(node.item_type)
        elif isinstance(node, msgspec.inspect.TupleType):
            stack.extend(node.item_types)


def test_every_reachable_struct_has_a_section() -> None:
    seen: set[type[msgspec.Struct]] = set()
    _structs_by_msgspec(GatewayConfig, seen)
    documented = {section.struct for section in sections()}
    assert documented == seen


def test_every_field_has_a_row(reference: str) -> None:
    for section in sections():
        rows = _rows(_section_text(reference, section))
        for info in msgspec.structs.fields(section.struct):
            assert info.encode_name in rows, f"{section.title}: no row for {info.encode_name}"
        if section.tag is not None:
            assert rows[section.tag[0]][1] == f'"{section.tag[1]}"'


def test_every_field_has_a_meaning() -> None:
    missing = [
        f"{section.struct.__module__}.{section.struct.__qualname__}.{info.name}"
        for section in sections()
        for info in msgspec.structs.fields(section.struct)
        if not field_meaning(section.struct, info.name)
    ]
    assert not missing, (
        "fields without a comment above them, which is their meaning in "
        f"docs/configuration.md: {', '.join(missing)}"
    )


def test_defaults_read_back_as_the_defaults(reference: str) -> None:
    """A default cell, pasted into a config file, decodes to the field's default."""
    for section in sections():
        rows = _rows(_section_text(reference, section))
        for info in msgspec.structs.fields(section.struct):
            cell = rows[info.encode_name][2]
            if info.required:
                assert cell == "required"
                continue
            assert cell.startswith("`") and cell.endswith("`"), cell
            value = msgspec.convert(yaml.safe_load(cell.strip("`").strip()), info.type)
            default = info.default if info.default is not msgspec.NODEFAULT else None
            if default is None and info.default_factory is not msgspec.NODEFAULT:
                default = info.default_factory()
            assert value == default, f"{section.title}.{info.name}: {cell}"


def test_types_and_constraints_are_readable(reference: str) -> None:
    by_title = {section.title: section for section in sections()}
    sla = _rows(_section_text(reference, by_title["`sla`"]))
    assert sla["deadline_ms"][1] == "dict[str, int ≥ 1]"
    fallback = _rows(_section_text(reference, by_title["`sla.fallback`"]))
    assert fallback["policy"][1:3] == ['"best" | "small" | "error"', "`best`"]
    loop = _rows(_section_text(reference, by_title["`loop`"]))
    assert loop["threshold"][1:4] == ["float", "`0.9`", "in [0, 1]"]
    assert loop["hard_branches"][1:4] == ["int | null", "`null`", "≥ 1"]
    store = _rows(_section_text(reference, by_title["`cache`"]))["store"]
    assert store[2] == "`{kind: memory}`"
    assert "Also at `tenants.<name>.fallback`." in _section_text(
        reference, by_title["`sla.fallback`"]
    )


class _Commented(msgspec.Struct, kw_only=True):
    # Above, first line
    # and second line.
    a: int = 1
    b: int = 2  # trailing only

    # Separated by a blank line: still directly above c.
    c: int = 3

    d: int = 4
    # pragma words at the start of a comment without a colon are words
    e: Annotated[int, msgspec.Meta(ge=0)] = 5  # pragma: no cover


class _Redefined(_Commented, kw_only=True):
    a: int = 10
    d: int = 40  # d, here


def test_meaning_is_the_comment_directly_above_and_on_the_line() -> None:
    assert field_meaning(_Commented, "a") == "Above, first line and second line."
    assert field_meaning(_Commented, "b") == "trailing only"
    assert field_meaning(_Commented, "c") == "Separated by a blank line: still directly above c."
    assert field_meaning(_Commented, "d") == ""
    assert field_meaning(_Commented, "e") == (
        "pragma words at the start of a comment without a colon are words"
    )
    # A redefinition without a comment keeps the one it redefines.
    assert field_meaning(_Redefined, "a") == "Above, first line and second line."
    assert field_meaning(_Redefined, "d") == "d, here"


def test_every_struct_refuses_unknown_keys() -> None:
    """The reference promises that a key not listed is refused."""
    for section in sections():
        info = msgspec.inspect.type_info(section.struct)
        assert isinstance(info, msgspec.inspect.StructType)
        assert info.forbid_unknown_fields, section.title


ENGINES = """
engines:
  small: {backend: llama_cpp, model: smollm2-135m-instruct}
  large: {backend: llama_cpp, model: gemma3-270m}
"""


@pytest.mark.parametrize(
    "text",
    [
        "engines: {}\n",
        ENGINES + "  auto: {backend: llama_cpp, model: smollm2-135m-instruct}\n",
        ENGINES + "router: {small_engine: tiny}\n",
        ENGINES + "router: {large_engine: huge}\n",
        ENGINES + "sla: {deadline_ms: {huge: 100}}\n",
        ENGINES + "tenants: {acme: {deadline_ms: {huge: 100}}}\n",
        ENGINES + "tenants: {'a:b': {}}\n",
        ENGINES + "auth: {keys: {k: {env: SATISFICE_TEST_UNSET_KEY, tenant: 'a b'}}}\n",
        ENGINES + "loop: {}\n",
        ENGINES + "router: {}\nloop: {greedy_first: true, probes: true}\n",
        ENGINES + "server: {max_tokens_cap: 10, default_max_tokens: 20}\n",
    ],
)
def test_rules_across_sections_are_enforced(text: str) -> None:
    """Each rule the reference's header states is refused when broken."""
    with pytest.raises(ConfigError):
        parse_config(text)
    parse_config(ENGINES + "router: {}\nloop: {}\n")


def _satisfice() -> list[str]:
    script = Path(sys.executable).with_name("satisfice")
    return [str(script)] if script.exists() else [sys.executable, "-m", "gateway.cli"]


def test_command_prints_the_reference(reference: str) -> None:
    done = subprocess.run(
        [*_satisfice(), "config", "docs"], cwd=ROOT, capture_output=True, check=True, timeout=120
    )
    assert done.stdout.decode("utf-8") == reference


def test_command_writes_the_reference(reference: str, tmp_path: Path) -> None:
    out = tmp_path / "configuration.md"
    assert main(["config", "docs", "--out", str(out)]) == 0
    assert out.read_text(encoding="utf-8") == reference
