"""Time to ready: ``satisfice serve`` on the embedded default, from its start until
``/readyz`` answers 200, side by side for two source trees.

``--baseline DIR`` is another checkout of the project (e.g. ``git worktree add
/tmp/before REV``); its packages come first on the child's PYTHONPATH, so both run in
this environment with the same models and libraries. Runs alternate (this tree,
baseline, ...) and each pair gives a ratio, so the machine's drift cancels out of it.

    .venv/bin/python bench/startup.py --baseline /tmp/before [--rounds 7] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def time_to_ready(tree: Path, timeout_s: float = 300) -> float:
    """Seconds from starting ``satisfice serve`` from ``tree`` to its first ready answer."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(tree)}
    started = time.monotonic()
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port)],
        cwd=tree,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while time.monotonic() - started < timeout_s:
            if process.poll() is not None:
                raise RuntimeError(f"serve from {tree} exited with {process.returncode}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                    return time.monotonic() - started
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"serve from {tree} not ready after {timeout_s} s")
    finally:
        process.terminate()
        process.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True, help="another checkout")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    trees = {"this": ROOT, "baseline": args.baseline.resolve()}
    seconds: dict[str, list[float]] = {name: [] for name in trees}
    for round_ in range(args.rounds):
        order = list(trees) if round_ % 2 == 0 else list(trees)[::-1]
        for name in order:
            seconds[name].append(time_to_ready(trees[name]))
        print(f"round {round_ + 1}: {json.dumps(seconds)}", file=sys.stderr)
    pairs = zip(seconds["this"], seconds["baseline"], strict=True)
    report = {
        "median_s": {name: round(statistics.median(v), 2) for name, v in seconds.items()},
        "added_s_median": round(statistics.median(a - b for a, b in pairs), 2),
        "runs_s": seconds,
    }
    print(json.dumps(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
