"""What this tree's gateway costs per request against another tree's, side by side.

Both trees' ``satisfice serve`` run in this environment, each with one ``openai_http``
engine in front of the same instant OpenAI-compatible backend (``bench/litellm_overhead.py
--serve-backend``), no cache and no router: only the request path itself is measured,
with no model's time to drown it. Requests alternate between the two gateways in blocks
(plain, then streamed), one client, with a short pause before each as a product
backend's requests come. Printed per gateway: the median and p90 time of a request, and
the CPU time its process spent per request (from /proc, over the whole run), with the
ratios to the baseline.

``--baseline DIR`` is another checkout of the project (e.g. ``git worktree add
/tmp/before REV``); its packages come first on its gateway's PYTHONPATH.

    .venv/bin/python bench/proxy_baseline.py --baseline /tmp/before [--blocks 24] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
MODEL = "echo"
PER_BLOCK = 25
PAUSE_S = 0.002


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_s(pid: int) -> float:
    """The user and system CPU time of process ``pid``, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _config(backend_port: int) -> str:
    engine = {
        "backend": "openai_http",
        "base_url": f"http://127.0.0.1:{backend_port}/v1",
        "model": MODEL,
        "concurrency": 8,
        "queue_size": 64,
    }
    return yaml.safe_dump({"server": {"host": "127.0.0.1"}, "engines": {MODEL: engine}})


async def _ready(http: httpx.AsyncClient, url: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the gateway at {url} exited with {process.returncode}")
        try:
            if (await http.get(f"{url}/readyz")).status_code == 200:
                return
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.1)
    raise SystemExit(f"the gateway at {url} was not ready within 120 s")


async def _one(http: httpx.AsyncClient, url: str, stream: bool) -> float:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    await asyncio.sleep(PAUSE_S)
    started = time.perf_counter()
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        await response.aread()
        if response.status_code != 200:
            raise SystemExit(f"{url}: {response.status_code} {response.text}")
    return (time.perf_counter() - started) * 1000


async def measure(
    gateways: dict[str, tuple[str, subprocess.Popen[bytes]]], blocks: int
) -> dict[str, dict[str, float]]:
    times: dict[tuple[str, bool], list[float]] = {
        (name, stream): [] for name in gateways for stream in (False, True)
    }
    async with httpx.AsyncClient(timeout=10) as http:
        for url, process in gateways.values():
            await _ready(http, url, process)
        for url, _ in gateways.values():  # connections and first-call paths warm
            for stream in (False, True):
                await _one(http, url, stream)
        cpu_before = {name: _cpu_s(p.pid) for name, (_, p) in gateways.items()}
        order = list(gateways)
        for block in range(blocks):
            for name in order if block % 2 == 0 else order[::-1]:
                url = gateways[name][0]
                for stream in (False, True):
                    for _ in range(PER_BLOCK):
                        times[(name, stream)].append(await _one(http, url, stream))
        cpu = {name: _cpu_s(p.pid) - cpu_before[name] for name, (_, p) in gateways.items()}
    report: dict[str, dict[str, float]] = {}
    for name in gateways:
        requests = sum(len(times[(name, s)]) for s in (False, True))
        row = {"cpu_ms_per_request": cpu[name] * 1000 / requests}
        for stream, kind in ((False, "plain"), (True, "stream")):
            values = times[(name, stream)]
            row[f"{kind}_p50_ms"] = statistics.median(values)
            row[f"{kind}_p90_ms"] = statistics.quantiles(values, n=10)[-1]
        report[name] = row
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True, help="another checkout")
    parser.add_argument("--blocks", type=int, default=24, help="blocks per gateway and kind")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    baseline = args.baseline.resolve()
    ports = {name: _free_port() for name in ("backend", "this", "baseline")}
    work = Path(tempfile.mkdtemp(prefix="proxy-baseline-"))
    (work / "gateway.yaml").write_text(_config(ports["backend"]))
    print(f"the processes' logs: {work}", file=sys.stderr)
    backend_command = [
        sys.executable, str(ROOT / "bench" / "litellm_overhead.py"),
        "--serve-backend", str(ports["backend"]),
    ]  # fmt: skip

    def logged(name: str) -> int:  # each process's output, kept for when it fails
        return os.open(work / f"{name}.log", os.O_WRONLY | os.O_CREAT, 0o644)

    processes = [
        subprocess.Popen(backend_command, stdout=logged("backend"), stderr=subprocess.STDOUT)
    ]
    gateways: dict[str, tuple[str, subprocess.Popen[bytes]]] = {}
    for name, root in (("this", ROOT), ("baseline", baseline)):
        command = [
            sys.executable, "-m", "gateway.cli", "serve",
            "--config", str(work / "gateway.yaml"), "--port", str(ports[name]),
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(root)}
        process = subprocess.Popen(
            command, cwd=root, env=env, stdout=logged(name), stderr=subprocess.STDOUT
        )
        processes.append(process)
        gateways[name] = (f"http://127.0.0.1:{ports[name]}", process)
    try:
        report = asyncio.run(measure(gateways, args.blocks))
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=30)
    this, base = report["this"], report["baseline"]
    ratios = {f"{key}_ratio": this[key] / base[key] for key in this}
    result = {
        "baseline_tree": str(baseline),
        "requests_per_kind": args.blocks * PER_BLOCK,
        **report,
        "ratios": ratios,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
