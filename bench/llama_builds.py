"""Builds of llama.cpp side by side: tokens/s of each bundled model under each build.

A build is a folder holding an installed ``llama_cpp`` package (``pip install --target
DIR llama-cpp-python``, with the CMAKE_ARGS to compare), or ``venv`` for this
environment's own. ``NAME=DIR`` names it; ``NAME=DIR:no-extra-bufts`` loads the models
without llama.cpp's extra buffer types (the repacked weights that its AMX and AVX
matrix kernels read), which is the runtime way around AMX.

One process can load one libllama, so every measurement is a child process running
``bench/engine_speed.py --plain`` (greedy decoding, the median of ``--runs`` runs after a
warm-up) against one build. Each round runs every build once, in an order rotated
round by round, and each build's speed is reported as its median over rounds and as
the median of its per-round ratio to the first build, so the machine's drift between
rounds cancels out of the ratio. Each build's libggml-cpu is also disassembled to
count AMX tile instructions, the ones that kill a process with SIGILL on a host that
advertises AMX without letting a process use it.

    .venv/bin/python bench/llama_builds.py --build before=DIR --build after=DIR \\
        [--rounds 7] [--runs 3] [--tokens 128] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

from engines.native_check import amx_instructions, library_path

ENGINE_SPEED = Path(__file__).resolve().parent / "engine_speed.py"


class Build(NamedTuple):
    name: str
    folder: Path | None  # None: this environment's llama_cpp
    extra_bufts: bool

    @classmethod
    def parse(cls, text: str) -> Build:
        name, _, rest = text.partition("=")
        folder, _, option = rest.partition(":")
        if not name or not folder or option not in ("", "no-extra-bufts"):
            raise argparse.ArgumentTypeError(f"expected NAME=DIR[:no-extra-bufts], got {text!r}")
        path = None if folder == "venv" else Path(folder).resolve()
        if path is not None and not (path / "llama_cpp").is_dir():
            raise argparse.ArgumentTypeError(f"{folder} holds no llama_cpp package")
        return cls(name, path, option != "no-extra-bufts")

    def library(self) -> Path:
        """The build's ggml CPU library (found, not loaded: this process runs no model)."""
        if self.folder is not None:
            return self.folder / "llama_cpp" / "lib" / "libggml-cpu.so"
        library = library_path()
        assert library is not None, "llama_cpp is not installed"
        return library


def measure(build: Build, runs: int, tokens: int) -> dict[str, float]:
    """tokens/s of each bundled model under ``build``, from one child process."""
    env = dict(os.environ)
    if build.folder is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(build.folder), env.get("PYTHONPATH")])
        )
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "engines.json"
        command = [
            sys.executable,
            str(ENGINE_SPEED),
            "--plain",
            "--rounds",
            str(runs),
            "--tokens",
            str(tokens),
            "--json",
            str(out),
        ]
        if not build.extra_bufts:
            command.append("--no-extra-bufts")
        subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
        rows = json.loads(out.read_text())
    return {row["model"]: row["tokens_per_s"]["plain"] for row in rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", type=Build.parse, action="append", required=True)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--runs", type=int, default=3, help="timed runs per child (median)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    builds: list[Build] = args.build
    speeds: dict[str, list[dict[str, float]]] = {build.name: [] for build in builds}
    for round_ in range(args.rounds):
        shift = round_ % len(builds)
        for build in builds[shift:] + builds[:shift]:
            speeds[build.name].append(measure(build, args.runs, args.tokens))
        print(f"round {round_ + 1}/{args.rounds}: {json.dumps(speeds)}", file=sys.stderr)
    first = builds[0].name
    models = list(speeds[first][0])
    report = []
    for build in builds:
        rounds = speeds[build.name]
        row: dict[str, object] = {
            "build": build.name,
            "folder": str(build.folder or "venv"),
            "extra_bufts": build.extra_bufts,
            "amx_instructions": amx_instructions(build.library()),
        }
        for model in models:
            ratios = [
                mine[model] / base[model] for mine, base in zip(rounds, speeds[first], strict=True)
            ]
            row[model] = {
                "tokens_per_s": round(statistics.median(r[model] for r in rounds), 1),
                f"ratio_to_{first}": round(statistics.median(ratios), 4),
            }
        report.append(row)
        print(json.dumps(row))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
