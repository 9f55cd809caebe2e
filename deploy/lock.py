"""Write the exact pins that the container image installs (``make lock``).

``requirements.lock``: the project's runtime dependencies from pyproject.toml, plus
its ``qwen`` extra (the packages of the embedded default's models) and llama.cpp's
server extra (the compose file serves the bundled models with it from the same
image), closed over their own requirements, at the versions installed in this
environment. The project itself, and the dev and bench tools, are left out.

``requirements-gpu.lock`` (with ``--gpu``): what the ``gpu`` extra adds on top:
faiss-gpu, at the first lock's faiss-cpu version, and the CUDA wheels it links to,
resolved by pip against the first lock (which needs PyPI). The GPU image installs both,
with faiss-gpu in place of faiss-cpu. Not faiss-gpu-cu12: its kernels stop at sm_80
(no PTX), so they cannot run on Hopper (H100/H200) or newer; faiss-gpu's reach sm_90.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterable
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
# Served by the engine containers of deploy/compose.yaml (python -m llama_cpp.server).
EXTRA_ROOTS = ("llama-cpp-python[server]",)
# The image's config is the embedded default, whose models these packages carry.
MODEL_EXTRA = "qwen"


def runtime_requirements(pyproject: Path) -> list[Requirement]:
    project = tomllib.loads(pyproject.read_text("utf-8"))["project"]
    models = project["optional-dependencies"][MODEL_EXTRA]
    return [Requirement(line) for line in [*project["dependencies"], *models, *EXTRA_ROOTS]]


def closure(roots: Iterable[Requirement]) -> dict[str, str]:
    """Installed version of every distribution the roots need, by canonical name."""
    pins: dict[str, str] = {}
    seen: set[tuple[str, frozenset[str]]] = set()
    queue = [r for r in roots if r.marker is None or r.marker.evaluate({"extra": ""})]
    while queue:
        requirement = queue.pop()
        name = canonicalize_name(requirement.name)
        key = (name, frozenset(requirement.extras))
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = distribution(requirement.name)
        except PackageNotFoundError:
            sys.exit(f"{requirement} is required but not installed here: run `make` first")
        if not requirement.specifier.contains(dist.version, prereleases=True):
            sys.exit(f"{requirement} is required but {dist.version} is installed")
        pins[name] = dist.version
        extras = {"", *requirement.extras}
        for line in dist.requires or ():
            sub = Requirement(line)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in extras):
                queue.append(sub)
    return pins


def render(pins: dict[str, str], header: str) -> str:
    lines = [f"{name}=={version}" for name, version in sorted(pins.items())]
    return header + "\n".join(lines) + "\n"


def header(what: str) -> str:
    return (
        f"# {what}\n"
        f"# Written by `make lock` (deploy/lock.py) on Python {platform.python_version()},"
        f" {sys.platform}-{platform.machine()}; do not edit by hand.\n"
    )


def gpu_pins(base: str) -> dict[str, str]:
    """faiss-gpu and what it brings beyond ``base``, as pip resolves them."""
    lines = [line for line in base.splitlines() if line[:1].isalnum()]
    pinned = {canonicalize_name(r.name): r for r in map(Requirement, lines)}
    # The same FAISS release on both images: the gpu one swaps the package, not the API.
    faiss_gpu = f"faiss-gpu{pinned[canonicalize_name('faiss-cpu')].specifier}"
    with tempfile.TemporaryDirectory() as scratch:
        constraints = Path(scratch) / "constraints.txt"
        constraints.write_text(base, "utf-8")
        report = Path(scratch) / "report.json"
        subprocess.run(
            [
                sys.executable, "-m", "pip", "install", "--quiet", "--dry-run",
                "--ignore-installed", "--report", str(report),
                "--constraint", str(constraints), faiss_gpu,
            ],
            check=True,
        )  # fmt: skip
        installed = json.loads(report.read_text("utf-8"))["install"]
    resolved = {
        canonicalize_name(item["metadata"]["name"]): item["metadata"]["version"]
        for item in installed
    }
    return {name: version for name, version in resolved.items() if name not in pinned}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "deploy" / "requirements.lock")
    parser.add_argument(
        "--gpu",
        type=Path,
        metavar="FILE",
        help="also write the gpu extra's additions here (resolves against PyPI)",
    )
    args = parser.parse_args()
    pins = closure(runtime_requirements(ROOT / "pyproject.toml"))
    pins.pop("satisfice", None)
    base = render(pins, header("Runtime dependencies of the satisfice image, exact pins."))
    args.out.write_text(base, "utf-8")
    print(f"{args.out}: {len(pins)} pins")
    if args.gpu is not None:
        extra = gpu_pins(base)
        args.gpu.write_text(
            render(extra, header("The gpu image's additions: installed in place of faiss-cpu.")),
            "utf-8",
        )
        print(f"{args.gpu}: {len(extra)} pins")


if __name__ == "__main__":
    main()
