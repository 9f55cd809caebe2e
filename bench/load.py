"""The gateway under load: 64 closed-loop clients, deliberate shedding, overload, soak.

A real `satisfice serve` on 127.0.0.1 (the config below: both bundled models
in-process, the router, the in-process cache; or any gateway with ``--url``) takes a
closed loop of ``--clients`` clients (httpx with keep-alive, one request after
another), capped by a request count and a duration. Mixes:

  - cache-hit: a warmed set of prompts (``POST /admin/cache/warmup``), model "small",
    temperature 0: the cache answers every one;
  - generation: distinct prompts, ``max_tokens=16``, cycling "small", "large" and
    "auto": the engines' bounded queues shed what they cannot hold with 429 and
    Retry-After, which the clients honour (sleep, then the next request);
  - overload: ``--overload-clients`` clients sending generation requests without
    backing off: the 429/503 answers must come back fast, not time out;
  - overload-unembedded: the same with ``x-satisfice-cache: bypass, no-store`` and only
    "small" and "large", so that nothing is embedded before the engine's admission.

Per mix: requests, ok, shed (429/503, counted apart as deliberate), other errors
(anything else, timeouts included: must be 0), p50/p99 latency of the ok and of the
shed answers, throughput, and the latency of a ``GET /healthz`` probe sent four times
a second meanwhile (the floor under any answer at that load). Cache hits are also
measured from one client first, for what 64 add. ``--soak-minutes M`` runs instead a
mixed load (80% cache hits, 20% generation) for M minutes, sampling the gateway
process's RSS every ``--sample-s`` seconds, and reports RSS after the warm-up against
the end, with the kind of memory that moved (``RssAnon``/``RssFile``, and per mapping
from ``/proc/PID/smaps``: the brk heap, 64 MiB malloc arenas, other anonymous maps,
each mapped file) and the cache's entries every 30 s. ``--env KEY=VALUE`` sets a
variable in the started gateway's environment (e.g. ``MALLOC_ARENA_MAX=2``).

    .venv/bin/python bench/load.py [--mix cache-hit generation overload ...] [--clients 64]
        [--requests 20000] [--duration 60] [--json FILE]
    .venv/bin/python bench/load.py --soak-minutes 10 --plot docs/img/soak_rss.png
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import itertools
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
ADMIN_KEY = "load-bench"
MAX_TOKENS = 16
WARM_PROMPTS = 256
GENERATION_MODELS = ("small", "large", "auto")
COLOURS = ("red", "green", "blue", "amber", "violet", "grey", "teal", "white")

# The embedded default's shape (router, in-process cache, both bundled models), with
# shorter engine queues so that 64 clients overflow them: a queue as long as the
# client count would hold every request and shed nothing.
CONFIG = """
server:
  admin_key: {admin_key}
router: {{}}
cache:
  store:
    kind: memory
engines:
  small:
    backend: llama_cpp
    model: smollm2-135m-instruct
    queue_size: {queue_size}
  large:
    backend: llama_cpp
    model: gemma3-270m
    queue_size: {queue_size}
    template:
      stop: ["\\nQuestion:", "\\n\\n"]
"""


# --- requests -------------------------------------------------------------------------


def _chat(model: str, prompt: str) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }


def _warm_prompt(i: int) -> str:
    return f"In our product FAQ, what does setting number {i} control?"


class Request(NamedTuple):
    body: dict[str, Any]
    headers: tuple[tuple[str, str], ...] = ()


class Requests:
    """Requests for each mix; generation prompts never repeat within a run."""

    def __init__(self, seed: int) -> None:
        self._random = random.Random(seed)
        self._counter = itertools.count()
        self._run = f"{seed:x}"

    def cache_hit(self) -> Request:
        return Request(_chat("small", _warm_prompt(self._random.randrange(WARM_PROMPTS))))

    def _prompt(self) -> tuple[int, str]:
        n = next(self._counter)
        colour = COLOURS[n % len(COLOURS)]
        return n, f"Write one short sentence about a {colour} kite, number {n} of run {self._run}."

    def generation(self) -> Request:
        n, prompt = self._prompt()
        return Request(_chat(GENERATION_MODELS[n % len(GENERATION_MODELS)], prompt))

    def generation_unembedded(self) -> Request:
        """Generation that needs no embedding: no cache lookup, no routing."""
        n, prompt = self._prompt()
        body = _chat(GENERATION_MODELS[n % 2], prompt)
        return Request(body, (("x-satisfice-cache", "bypass, no-store"),))

    def mixed(self) -> Request:
        return self.cache_hit() if self._random.random() < 0.8 else self.generation()


async def warm_cache(http: httpx.AsyncClient, admin_key: str) -> dict[str, Any]:
    lines = [
        json.dumps({"prompt": _warm_prompt(i), "response": f"Setting {i}.", "model": "small"})
        for i in range(WARM_PROMPTS)
    ]
    response = await http.post(
        "/admin/cache/warmup",
        content="\n".join(lines).encode(),
        headers={"Authorization": f"Bearer {admin_key}"},
    )
    response.raise_for_status()
    report: dict[str, Any] = response.json()
    return report


# --- the closed loop ------------------------------------------------------------------


@dataclass
class Tally:
    clients: int
    ok: list[float] = field(default_factory=list)
    shed: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    statuses: Counter[int] = field(default_factory=Counter)
    cache: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0

    def report(self) -> dict[str, Any]:
        requests = len(self.ok) + len(self.shed) + sum(self.errors.values())
        return {
            "clients": self.clients,
            "requests": requests,
            "ok": len(self.ok),
            "shed": len(self.shed),
            "errors": sum(self.errors.values()),
            "error_kinds": dict(self.errors),
            "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
            "cache": dict(self.cache),
            "ok_p50_ms": _ms(self.ok, 50),
            "ok_p99_ms": _ms(self.ok, 99),
            "shed_p50_ms": _ms(self.shed, 50),
            "shed_p99_ms": _ms(self.shed, 99),
            "seconds": round(self.seconds, 1),
            "ok_per_s": round(len(self.ok) / self.seconds, 1),
            "requests_per_s": round(requests / self.seconds, 1),
        }


def _ms(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1000, 1) if values else None


async def _send(http: httpx.AsyncClient, request: Request, tally: Tally) -> float:
    """One request, tallied; returns how long the server asked the client to wait."""
    started = time.perf_counter()
    try:
        response = await http.post(
            "/v1/chat/completions", json=request.body, headers=list(request.headers)
        )
    except httpx.TimeoutException:
        tally.errors["timeout"] += 1
        return 0.0
    except httpx.HTTPError as exc:
        tally.errors[type(exc).__name__] += 1
        return 0.0
    elapsed = time.perf_counter() - started
    tally.statuses[response.status_code] += 1
    if response.status_code == 200:
        tally.ok.append(elapsed)
        tally.cache[response.headers.get("x-satisfice-cache", "none")] += 1
        return 0.0
    if response.status_code in (429, 503):
        tally.shed.append(elapsed)
        if "retry-after" not in response.headers:
            tally.errors[f"{response.status_code} without Retry-After"] += 1
        return float(response.headers.get("retry-after", "1"))
    code = response.json().get("error", {}).get("code") if response.content else None
    tally.errors[f"{response.status_code} {code}"] += 1
    return 0.0


async def closed_loop(
    http: httpx.AsyncClient,
    clients: int,
    make: Callable[[], Request],
    *,
    requests: int,
    duration_s: float,
    back_off: bool,
) -> Tally:
    """``clients`` clients, each sending its next request when the last one is answered,
    until ``requests`` have been sent or ``duration_s`` has passed."""
    tally = Tally(clients)
    left = requests
    started = time.perf_counter()
    stop_at = started + duration_s

    async def client() -> None:
        nonlocal left
        while left > 0 and time.perf_counter() < stop_at:
            left -= 1
            wait = await _send(http, make(), tally)
            if back_off and wait:
                await asyncio.sleep(min(wait, max(0.0, stop_at - time.perf_counter())))

    await asyncio.gather(*(client() for _ in range(clients)))
    tally.seconds = time.perf_counter() - started
    return tally


async def probe(http: httpx.AsyncClient, latencies: list[float]) -> None:
    """``GET /healthz`` four times a second: how long any answer takes under this load
    (the server's event loop and this client's, on the same cores), the floor for a 429."""
    while True:
        started = time.perf_counter()
        with contextlib.suppress(httpx.HTTPError):
            (await http.get("/healthz")).raise_for_status()
            latencies.append(time.perf_counter() - started)
        await asyncio.sleep(0.25)


# --- the gateway process and its memory -----------------------------------------------


def _descendants(pid: int) -> list[int]:
    pids = [pid]
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        for child in task.read_text().split():
            pids += _descendants(int(child))
    return pids


def rss_mib(pid: int) -> float:
    """Resident memory of the process and its children (psutil if installed)."""
    try:
        psutil: Any = importlib.import_module("psutil")
    except ImportError:
        total = 0
        for p in _descendants(pid):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        return total / 2**20
    process = psutil.Process(pid)
    processes = [process, *process.children(recursive=True)]
    return float(sum(p.memory_info().rss for p in processes)) / 2**20


def memory_detail(pid: int) -> dict[str, float]:
    """RssAnon, RssFile (mapped files: the GGUF weights, shared libraries) and threads,
    summed over the process and its children: which kind of memory moves."""
    detail: dict[str, float] = defaultdict(float)
    for p in _descendants(pid):
        for line in Path(f"/proc/{p}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile", "RssShmem"):
                detail[key.removeprefix("Rss").lower() + "_mib"] += int(value.split()[0]) / 1024
            elif key == "Threads":
                detail["threads"] += int(value)
    return {k: round(v, 1) for k, v in detail.items()}


def smaps_by_kind(pid: int) -> dict[str, float]:
    """Resident MiB per kind of mapping of the process: ``[heap]`` (the main arena's
    brk heap), each mapped file, and anonymous mappings split by size: glibc's
    per-thread malloc arenas are reserved 64 MiB at a time (``anon 64MiB-arena``),
    large allocations are mmapped on their own (``anon other``). A heuristic: the
    kernel merges neighbouring anonymous maps, so the two kinds can blur."""
    kinds: dict[str, float] = defaultdict(float)
    name = ""
    size_kb = 0
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if not head:
            continue
        if "-" in head[0] and not head[0].endswith(":"):
            start, end = (int(x, 16) for x in head[0].split("-"))
            size_kb = (end - start) // 1024
            path = head[5] if len(head) > 5 else ""
            if path:
                name = path
            elif size_kb <= 65536 and start % (64 * 2**20) == 0:
                name = "anon 64MiB-arena"  # an arena heap starts 64 MiB-aligned
            else:
                name = "anon other"
        elif head[0] == "Rss:":
            kinds[name] += int(head[1]) / 1024
    ranked = sorted(kinds.items(), key=lambda kv: -kv[1])
    return {k: round(v, 1) for k, v in ranked if v >= 0.1}


def start_gateway(
    queue_size: int, port: int, log: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    config = Path(tempfile.mkdtemp(prefix="satisfice-load-")) / "satisfice.yaml"
    config.write_text(CONFIG.format(admin_key=ADMIN_KEY, queue_size=queue_size))
    command = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config)]
    with log.open("wb") as out:
        return subprocess.Popen(
            [*command, "--port", str(port)],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )


async def wait_ready(http: httpx.AsyncClient, process: subprocess.Popen[bytes] | None) -> None:
    for _ in range(1200):
        if process is not None and process.poll() is not None:
            raise RuntimeError("gateway exited")
        try:
            if (await http.get("/readyz")).status_code == 200:
                return
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.25)
    raise TimeoutError("gateway not ready")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- runs -----------------------------------------------------------------------------


async def run_mixes(http: httpx.AsyncClient, args: argparse.Namespace) -> dict[str, Any]:
    requests = Requests(args.seed)
    report: dict[str, Any] = {}
    if "cache-hit" in args.mix or args.soak_minutes:
        report["warmup"] = await warm_cache(http, args.admin_key)
    if "cache-hit" in args.mix:
        # The same requests from one client: what 64 add by queueing for the CPU.
        tally = await closed_loop(
            http, 1, requests.cache_hit, requests=200, duration_s=args.duration, back_off=True
        )
        report["cache-hit-1-client"] = tally.report()
    plans: dict[str, tuple[Callable[[], Request], int, bool]] = {
        "cache-hit": (requests.cache_hit, args.clients, True),
        "generation": (requests.generation, args.clients, True),
        "overload": (requests.generation, args.overload_clients, False),
        "overload-unembedded": (requests.generation_unembedded, args.overload_clients, False),
    }
    for mix in args.mix:
        make, clients, back_off = plans[mix]
        overload = mix.startswith("overload")
        await asyncio.sleep(5)  # let the last mix's queues drain
        probes: list[float] = []
        probing = asyncio.create_task(probe(http, probes))
        tally = await closed_loop(
            http,
            clients,
            make,
            requests=args.requests,
            duration_s=args.overload_duration if overload else args.duration,
            back_off=back_off,
        )
        probing.cancel()
        report[mix] = tally.report()
        report[mix]["healthz_p50_ms"] = _ms(probes, 50)
        report[mix]["healthz_p99_ms"] = _ms(probes, 99)
        if overload and tally.ok and tally.shed:
            ok_p50 = float(np.percentile(tally.ok, 50))
            for q in (50, 99):
                ratio = float(np.percentile(tally.shed, q)) / ok_p50
                report[mix][f"shed_p{q}_over_ok_p50"] = round(ratio, 3)
        print(json.dumps({mix: report[mix]}), file=sys.stderr)
    return report


async def run_soak(http: httpx.AsyncClient, args: argparse.Namespace, pid: int) -> dict[str, Any]:
    requests = Requests(args.seed)
    warmup = await warm_cache(http, args.admin_key)
    samples: list[tuple[float, float]] = []
    details: list[dict[str, float]] = []
    smaps: dict[str, dict[str, float]] = {}
    entries: list[tuple[float, int]] = []
    started = time.perf_counter()
    duration = args.soak_minutes * 60

    async def cache_entries() -> int:
        stats = await http.get(
            "/admin/cache/stats", headers={"Authorization": f"Bearer {args.admin_key}"}
        )
        return int(stats.json()["store"]["entries"]) if stats.status_code == 200 else -1

    async def sample() -> None:
        n = 0
        while time.perf_counter() - started < duration:
            t = time.perf_counter() - started
            samples.append((t, rss_mib(pid)))
            details.append({"t": round(t, 1), **memory_detail(pid)})
            if "after_warmup" not in smaps and t >= args.soak_warmup_s:
                smaps["after_warmup"] = smaps_by_kind(pid)
            if n % 6 == 0:
                with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                    entries.append((round(t, 1), await cache_entries()))
            n += 1
            await asyncio.sleep(args.sample_s)

    sampler = asyncio.create_task(sample())
    tally = await closed_loop(
        http, args.clients, requests.mixed, requests=10**9, duration_s=duration, back_off=True
    )
    await sampler
    samples.append((time.perf_counter() - started, rss_mib(pid)))
    details.append({"t": round(samples[-1][0], 1), **memory_detail(pid)})
    smaps["end"] = smaps_by_kind(pid)
    before = smaps.get("after_warmup", {})
    grew = {
        kind: round(smaps["end"].get(kind, 0.0) - before.get(kind, 0.0), 1)
        for kind in set(before) | set(smaps["end"])
    }
    after_warmup = next(rss for t, rss in samples if t >= args.soak_warmup_s)
    end = samples[-1][1]
    stats = await http.get(
        "/admin/cache/stats", headers={"Authorization": f"Bearer {args.admin_key}"}
    )
    report = {
        "warmup": warmup,
        "load": tally.report(),
        "rss_start_mib": round(samples[0][1], 1),
        "rss_after_warmup_mib": round(after_warmup, 1),
        "rss_end_mib": round(end, 1),
        "rss_max_mib": round(max(rss for _, rss in samples), 1),
        "rss_growth_pct": round((end - after_warmup) / after_warmup * 100, 2),
        "warmup_s": args.soak_warmup_s,
        "gateway_env": dict(item.split("=", 1) for item in args.env),
        "memory_after_warmup": next(d for d in details if d["t"] >= args.soak_warmup_s),
        "memory_end": details[-1],
        "smaps_growth_mib": dict(sorted(grew.items(), key=lambda kv: -abs(kv[1]))[:8]),
        "cache_stats": stats.json() if stats.status_code == 200 else None,
        "cache_entries": entries,
        "samples": [(round(t, 1), round(rss, 1)) for t, rss in samples],
        "memory_samples": details,
        "smaps": smaps,
    }
    if args.plot:
        plot_rss(samples, args.soak_warmup_s, report, args.plot)
    return report


def plot_rss(
    samples: list[tuple[float, float]], warmup_s: float, report: dict[str, Any], path: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 3.5))
    axes.plot([t / 60 for t, _ in samples], [rss for _, rss in samples], lw=1.5)
    axes.axvline(warmup_s / 60, color="grey", ls="--", lw=1, label="end of warm-up")
    load = report["load"]
    axes.set_title(
        f"Gateway RSS under mixed load ({load['clients']} clients, "
        f"{load['requests']:,} requests): {report['rss_growth_pct']:+.2f}% after warm-up",
        fontsize=9,
    )
    axes.set_xlabel("minutes")
    axes.set_ylabel("RSS (MiB)")
    axes.set_ylim(0, max(rss for _, rss in samples) * 1.1)
    axes.legend(loc="lower right", fontsize=8)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    process = None
    url = args.url
    if url is None:
        port = _free_port()
        args.log.parent.mkdir(parents=True, exist_ok=True)
        env = dict(item.split("=", 1) for item in args.env)
        process = start_gateway(args.queue_size, port, args.log, env)
        url = f"http://127.0.0.1:{port}"
    pid = process.pid if process is not None else args.pid
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    timeout = httpx.Timeout(args.timeout, connect=10)
    try:
        async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as http:
            await wait_ready(http, process)
            if args.soak_minutes:
                if pid is None:
                    raise SystemExit("--soak-minutes with --url needs --pid of the gateway")
                return {"soak": await run_soak(http, args, pid)}
            report = await run_mixes(http, args)
            if pid is not None:
                report["gateway_rss_mib"] = round(rss_mib(pid), 1)
            return report
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running gateway; default: start one here")
    parser.add_argument("--pid", type=int, help="the --url gateway's process, for its RSS")
    parser.add_argument("--admin-key", default=ADMIN_KEY, help="the --url gateway's admin key")
    parser.add_argument(
        "--mix",
        nargs="+",
        default=["cache-hit", "generation", "overload", "overload-unembedded"],
        choices=["cache-hit", "generation", "overload", "overload-unembedded"],
    )
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests", type=int, default=5000, help="most requests per mix")
    parser.add_argument("--duration", type=float, default=60, help="most seconds per mix")
    parser.add_argument("--overload-clients", type=int, default=256)
    parser.add_argument("--overload-duration", type=float, default=20)
    parser.add_argument("--queue-size", type=int, default=4, help="each engine's queue")
    parser.add_argument("--timeout", type=float, default=120, help="client timeout, seconds")
    parser.add_argument("--soak-minutes", type=float, default=0)
    parser.add_argument("--soak-warmup-s", type=float, default=60)
    parser.add_argument("--sample-s", type=float, default=5)
    parser.add_argument("--plot", type=Path, help="the soak's RSS curve")
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set in the started gateway's environment (repeatable)",
    )
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--log", type=Path, default=ROOT / "bench/out/load_gateway.log")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    report = asyncio.run(main_async(args))
    text = json.dumps(report, indent=2)
    if args.soak_minutes:  # the samples are in --json; the summary is enough here
        detail = ("samples", "memory_samples", "smaps")
        summary = {k: v for k, v in report["soak"].items() if k not in detail}
        print(json.dumps(summary, indent=2))
    else:
        print(text)
    if args.json:
        args.json.write_text(text)


if __name__ == "__main__":
    main()
