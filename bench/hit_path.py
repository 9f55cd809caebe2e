"""The hit path against this machine's limit: exact and semantic cache hits through real
gateways, each beside a ceiling measured in the same run.

Ceilings, served on the gateway's own server stack (gateway.api.server: uvicorn,
uvloop, httptools, the read limits): ``raw``, an ASGI callable that reads the body and
sends back the very bytes an exact hit gets; ``litestar``, a bare Litestar app that
decodes the same request Struct and returns those bytes. Gateways: the memory store
with the express path and without it (server.express_hits), and the Redis store with
its near cache and without it (near_cache_bytes: 0). Each is warmed with the same
PROMPTS distinct questions; requests ask for them as warmed (an exact hit), with
Cache-Control: only-if-cached, so a miss is a 504, never a generation. With ``--before
DIR`` (a checkout of an earlier commit, e.g. ``git worktree add ../before <commit>``),
the memory and Redis express gateways and the framework path run from that tree too,
in the same rounds, and each is given its ratio to its twin from DIR.

Load: wrk (Debian's `wrk` package: C, one thread, a Lua script cycling through the
bodies), one client and CLIENTS clients on kept-alive connections, DURATION seconds a
run. Targets run in ROUNDS rounds, each in a rotated order, so that a slow spell of the
machine falls on all of them; figures are medians over rounds, and each ratio is the
median of the per-round ratios. Besides requests/s: the CPU time each server process
spent per request (from /proc), which load on the other core disturbs less, and wrk's
own CPU share (well under one core: the generator is not the bottleneck).

Semantic hits (``--semantic``): ENTRIES Quora questions in Redis with their vectors
(computed once, kept in bench/out), a gateway whose index is rebuilt from them, and
requests that reword warmed questions ("..., please?"); the ceiling is the embedder's
own batched throughput on the same prompts (EmbedderSettings' defaults, as the gateway
runs it), measured between the gateway's runs.

    apt-get install wrk
    .venv/bin/python bench/hit_path.py [--rounds 5] [--duration 8] [--semantic]
        [--before DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypedDict

import httpx
import msgspec
import numpy as np
import uvicorn
from cache_hit_path import (
    REDIS_URL,
    embeddings,
    fingerprint_of_bundled,
    open_cache,
    questions,
    reworded,
    rss_mib,
    warm_lines,
)
from litestar import Litestar, Response, post

from cache.warmup import warm
from gateway.api.server import server_config
from gateway.api.wire import ChatCompletionRequest
from gateway.config import ServerSettings
from router.embedder import Embedder, EmbedderSettings, Vectors

ROOT = Path(__file__).resolve().parent.parent
ADMIN_KEY = "bench-admin"
# The name of a target from the earlier tree (--before), after its twin's.
BEFORE = " (before)"
CHAT = "/v1/chat/completions"
ONLY_CACHED = {"Content-Type": "application/json", "Cache-Control": "only-if-cached"}
TICKS = os.sysconf("SC_CLK_TCK")


# -- the ceilings ------------------------------------------------------------------------


def serve_ceiling(kind: str, port: int, body_file: Path, headers_file: Path) -> None:
    """Child process: a ceiling app on the gateway's server stack, until killed."""
    body = body_file.read_bytes()
    names = json.loads(headers_file.read_text())
    headers = [(k.encode(), v.encode()) for k, v in names.items()]
    raw_headers = [*headers, (b"content-length", str(len(body)).encode())]

    async def raw(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": raw_headers})
        await send({"type": "http.response.body", "body": body})

    app: Any = raw if kind == "raw" else bare_litestar(body, names)
    settings = ServerSettings(port=port)
    server = uvicorn.Server(server_config(app, settings, lambda _: None))
    server.run()


def bare_litestar(body: bytes, headers: dict[str, str]) -> Litestar:
    """The framework alone: the request decoded into the gateway's own Struct, the
    cached bytes returned."""

    @post(CHAT, status_code=200)
    async def chat(data: ChatCompletionRequest) -> Response[bytes]:
        return Response(body, media_type="application/json", headers=headers)

    return Litestar([chat], logging_config=None)


# -- processes ---------------------------------------------------------------------------


class Server:
    """A process serving HTTP on a port of its own: a ceiling or a gateway."""

    def __init__(
        self, name: str, command: list[str], port: int, log: Path, tree: Path = ROOT
    ) -> None:
        self.name = name
        self.url = f"http://127.0.0.1:{port}"
        self.port = port
        self._log = log.open("wb")
        # The tree the process's code comes from: this one, or an earlier checkout.
        python_path = {} if tree == ROOT else {"PYTHONPATH": str(tree)}
        self.process = subprocess.Popen(
            command, cwd=tree, stdout=self._log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **python_path},
        )  # fmt: skip

    def wait(self, path: str = "/readyz", timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited; see {self._log.name}")
            try:
                if httpx.get(self.url + path, timeout=1).status_code < 500:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} not ready")

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self._log.close()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gateway(
    name: str,
    cache: str,
    work: Path,
    *,
    express: bool = True,
    runtime: str = "onnx",
    access_log: bool = True,
    tree: Path = ROOT,
) -> Server:
    config = work / f"{name}.yaml"
    server = f"admin_key: {ADMIN_KEY}, express_hits: {str(express).lower()}"
    config.write_text(
        f"server: {{{server}, access_log: {str(access_log).lower()}}}\n"
        "engines:\n  small: {backend: llama_cpp, model: smollm2-135m-instruct}\n"
        f"cache: {cache}\nembedder: {{runtime: {runtime}}}\n"
    )
    port = free_port()
    command = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config)]
    return Server(name, [*command, "--port", str(port)], port, work / f"{name}.log", tree)


def redis_cache(prefix: str, near_bytes: int | None = None) -> str:
    near = "" if near_bytes is None else f", near_cache_bytes: {near_bytes}"
    return f"{{store: {{kind: redis, url: '{REDIS_URL}', key_prefix: {prefix}{near}}}}}"


# -- load --------------------------------------------------------------------------------


class Run(TypedDict):
    requests: int
    per_s: float
    non_2xx: int
    socket_errors: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    server_cpu_ms_per_request: float
    wrk_cpu_share: float  # of one core


def lua_string(body: bytes) -> str:
    """A Lua string literal holding exactly these bytes."""
    out = []
    for byte in body:
        char = chr(byte)
        out.append(char if 32 <= byte < 127 and char not in '"\\' else f"\\{byte:03d}")
    return '"' + "".join(out) + '"'


def wrk_script(bodies: list[bytes], path: Path) -> Path:
    lines = ["local bodies = {", *(f"  {lua_string(b)}," for b in bodies), "}"]
    headers = ", ".join(f'["{k}"] = "{v}"' for k, v in ONLY_CACHED.items())
    lines += [
        "local i = 0",
        "request = function()",
        "  i = i % #bodies + 1",
        f'  return wrk.format("POST", "{CHAT}", {{{headers}}}, bodies[i])',
        "end",
        "done = function(summary, latency, requests)",
        "  local e = summary.errors",
        '  io.write(string.format("RESULT {\\"requests\\": %d, \\"duration_us\\": %d, '
        '\\"non_2xx\\": %d, \\"socket_errors\\": %d, \\"p50_us\\": %d, \\"p90_us\\": %d, '
        '\\"p99_us\\": %d}\\n", summary.requests, summary.duration, e.status, '
        "e.connect + e.read + e.write + e.timeout, latency:percentile(50), "
        "latency:percentile(90), latency:percentile(99)))",
        "end",
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def load(target: list[Server], script: Path, clients: int, seconds: int) -> Run:
    """One wrk per server of ``target`` (replicas: the clients split between them), all
    at once; their requests and CPU summed, their latencies averaged."""
    before_cpu = sum(server.cpu_s() for server in target)
    before_children = resource.getrusage(resource.RUSAGE_CHILDREN)
    share = max(1, clients // len(target))
    command = ["wrk", "-t1", f"-c{share}", f"-d{seconds}s", "--timeout", "10s", "-s", str(script)]
    runs = [
        subprocess.Popen([*command, server.url + CHAT], stdout=subprocess.PIPE, text=True)
        for server in target
    ]
    results = []
    for run in runs:
        out, _ = run.communicate()
        line = next(x for x in out.splitlines() if x.startswith("RESULT "))
        results.append(json.loads(line.removeprefix("RESULT ")))
    after_children = resource.getrusage(resource.RUSAGE_CHILDREN)
    server_cpu = sum(server.cpu_s() for server in target) - before_cpu
    wrk_cpu = (after_children.ru_utime - before_children.ru_utime) + (
        after_children.ru_stime - before_children.ru_stime
    )
    seconds_run = max(r["duration_us"] for r in results) / 1e6
    requests = sum(r["requests"] for r in results)
    return {
        "requests": requests,
        "per_s": requests / seconds_run,
        "non_2xx": sum(r["non_2xx"] for r in results),
        "socket_errors": sum(r["socket_errors"] for r in results),
        "p50_ms": statistics.mean(r["p50_us"] for r in results) / 1000,
        "p90_ms": statistics.mean(r["p90_us"] for r in results) / 1000,
        "p99_ms": statistics.mean(r["p99_us"] for r in results) / 1000,
        "server_cpu_ms_per_request": 1000 * server_cpu / max(1, requests),
        "wrk_cpu_share": wrk_cpu / seconds_run,
    }


def rotations(names: list[str], rounds: int) -> Iterator[list[str]]:
    for r in range(rounds):
        shift = r % len(names)
        yield names[shift:] + names[:shift]


def summary(runs: list[Run]) -> dict[str, float]:
    keys = ("per_s", "p50_ms", "p90_ms", "p99_ms", "server_cpu_ms_per_request", "wrk_cpu_share")
    out = {k: statistics.median(float(r[k]) for r in runs) for k in keys}  # type: ignore[literal-required]
    out["non_2xx"] = sum(r["non_2xx"] for r in runs)
    out["socket_errors"] = sum(r["socket_errors"] for r in runs)
    return out


def ratios(
    runs: dict[str, list[Run]], name: str, ceiling: str, key: str, invert: bool = False
) -> float:
    """The median over rounds of name's figure over the ceiling's (the ceiling's over
    name's with ``invert``: for costs, where less is better)."""
    pairs = zip(runs[name], runs[ceiling], strict=True)
    values = [
        (float(c[key]) / float(n[key])) if invert else (float(n[key]) / float(c[key]))  # type: ignore[literal-required]
        for n, c in pairs
    ]
    return statistics.median(values)


# -- exact hits --------------------------------------------------------------------------


def warm_gateway(server: Server, prompts: list[str]) -> None:
    lines = warm_lines(prompts)
    response = httpx.post(
        server.url + "/admin/cache/warmup", content=lines, timeout=600,
        headers={"authorization": f"Bearer {ADMIN_KEY}"},
    )  # fmt: skip
    report = response.json()
    assert report["added"] + report["replaced"] == len(prompts), report


def exact_bodies(prompts: list[str]) -> list[bytes]:
    return [
        msgspec.json.encode({"model": "small", "messages": [{"role": "user", "content": p}]})
        for p in prompts
    ]


def hit_response(server: Server, body: bytes) -> tuple[bytes, dict[str, str]]:
    """An exact hit's body and its headers, as the ceilings are to send them back."""
    response = httpx.post(server.url + CHAT, content=body, headers=ONLY_CACHED)
    assert response.headers["x-satisfice-cache"] == "exact", response.text
    kept = {k: v for k, v in response.headers.items() if k.startswith("x-satisfice-")}
    return response.content, {"content-type": "application/json", **kept}


def exact_hits(args: argparse.Namespace, work: Path, report: dict[str, Any]) -> None:
    prompts = questions(args.prompts)
    prefix = f"bench-hit-path-{uuid.uuid4().hex[:8]}"
    near = redis_cache(prefix)
    gateways = {
        "memory, express": [gateway("memory-express", "{}", work)],
        "memory, framework path": [gateway("memory-framework", "{}", work, express=False)],
        "redis + near cache, express": [gateway("redis-near", near, work)],
        "redis, no near cache": [gateway("redis-plain", redis_cache(prefix, 0), work)],
        "redis + near cache, express, no access log": [
            gateway("redis-near-quiet", near, work, access_log=False)
        ],
        "redis + near cache, express, 2 replicas": [
            gateway(f"redis-near-{i}", near, work) for i in range(2)
        ],
    }
    if args.before is not None:
        before = args.before.resolve()
        gateways["memory, express" + BEFORE] = [
            gateway("memory-express-before", "{}", work, tree=before)
        ]
        gateways["memory, framework path" + BEFORE] = [
            gateway("memory-framework-before", "{}", work, express=False, tree=before)
        ]
        gateways["redis + near cache, express" + BEFORE] = [
            gateway("redis-near-before", near, work, tree=before)
        ]
    targets: dict[str, list[Server]] = {}
    try:
        for replicas in gateways.values():
            for server in replicas:
                server.wait()
        memory = [n for n in gateways if n.startswith("memory")]
        for name in [*memory, "redis + near cache, express"]:
            warm_gateway(gateways[name][0], prompts)  # the last warms Redis for the rest
        bodies = exact_bodies(prompts)
        body, headers = hit_response(gateways["memory, express"][0], bodies[0])
        (work / "body.json").write_bytes(body)
        (work / "headers.json").write_text(json.dumps(headers))
        for kind in ("raw", "litestar"):
            targets[f"ceiling: {kind}"] = [ceiling(kind, work)]
            targets[f"ceiling: {kind}, 2 processes"] = [ceiling(kind, work) for _ in range(2)]
        for replicas in list(targets.values()):
            for server in replicas:
                server.wait("/")
        targets.update(gateways)
        script = wrk_script(bodies, work / "exact.lua")
        for target in targets.values():  # connections, caches and code warm
            load(target, script, 4, 2)
        report["exact"] = measure(targets, script, args)
        report["exact"]["rss_mib"] = {
            name: [rss_mib(s.process.pid) for s in target] for name, target in targets.items()
        }
    finally:
        for target in {**gateways, **targets}.values():
            for server in target:
                server.stop()
        asyncio.run(drop(prefix))


def ceiling(kind: str, work: Path) -> Server:
    port = free_port()
    command = [sys.executable, __file__, "serve-ceiling", kind, str(port),
               str(work / "body.json"), str(work / "headers.json")]  # fmt: skip
    return Server(f"{kind}-{port}", command, port, work / f"{kind}-{port}.log")


def measure(
    targets: dict[str, list[Server]], script: Path, args: argparse.Namespace
) -> dict[str, Any]:
    """Every target at one client and at ``args.clients``, in rotated rounds; figures
    and ratios to the ceilings of as many processes."""
    result: dict[str, Any] = {}
    for clients in (1, args.clients):
        names = [n for n in targets if clients > 1 or len(targets[n]) == 1]
        runs: dict[str, list[Run]] = {name: [] for name in names}
        for order in rotations(names, args.rounds):
            for name in order:
                run = load(targets[name], script, clients, args.duration)
                runs[name].append(run)
                print(f"{clients:>3} clients  {name:<30} {run['per_s']:>9.0f}/s  p50 "
                      f"{run['p50_ms']:6.2f} ms  cpu {run['server_cpu_ms_per_request']:.3f} "
                      f"ms/req  wrk {run['wrk_cpu_share']:.2f}", file=sys.stderr)  # fmt: skip
        figures = {}
        for name in names:
            figures[name] = summary(runs[name])
            if name.startswith("ceiling"):
                continue
            if name + BEFORE in runs:  # this tree's, beside the earlier tree's twin
                figures[name]["per_s_ratio_to_before"] = ratios(runs, name, name + BEFORE, "per_s")
                figures[name]["cpu_ratio_to_before"] = ratios(
                    runs, name, name + BEFORE, "server_cpu_ms_per_request", invert=True
                )
            processes = "" if len(targets[name]) == 1 else f", {len(targets[name])} processes"
            for kind in ("raw", "litestar"):
                ceiling = f"ceiling: {kind}{processes}"
                figures[name][f"per_s_ratio_to_{kind}"] = ratios(runs, name, ceiling, "per_s")
                figures[name][f"cpu_ratio_to_{kind}"] = ratios(
                    runs, name, ceiling, "server_cpu_ms_per_request", invert=True
                )
                figures[name][f"p50_excess_ms_over_{kind}"] = statistics.median(
                    n["p50_ms"] - c["p50_ms"]
                    for n, c in zip(runs[name], runs[ceiling], strict=True)
                )
        result[f"{clients}_clients"] = figures
    return result


async def drop(prefix: str) -> None:
    cache = await open_cache(prefix)
    await cache.invalidate(None)
    await cache.close()


# -- semantic hits -----------------------------------------------------------------------


def semantic_hits(args: argparse.Namespace, work: Path, report: dict[str, Any]) -> None:
    prompts = questions(args.entries)
    prefix = f"bench-semantic-{uuid.uuid4().hex[:8]}"
    vectors = embeddings(prompts, ROOT / "bench" / "out" / f"qqp_{len(prompts)}_vectors.npy")
    asyncio.run(warm_redis(prompts, vectors, prefix))
    server = gateway("semantic", redis_cache(prefix), work, runtime=args.embedder_runtime)
    try:
        started = time.monotonic()
        server.wait()
        report["semantic_ready_s"] = time.monotonic() - started
        rng = random.Random(1)
        candidates = [reworded(p) for p in rng.sample(prompts, 2 * args.semantic_prompts)]
        asked = semantic_hits_only(server, candidates)[: args.semantic_prompts]
        report["semantic_prompts"] = {"probed": len(candidates), "hits": len(asked)}
        bodies = [
            msgspec.json.encode({"model": "small", "messages": [{"role": "user", "content": q}]})
            for q in asked
        ]
        script = wrk_script(bodies, work / "semantic.lua")
        load([server], script, 4, 2)
        embedder = Embedder(EmbedderSettings(runtime=args.embedder_runtime))
        embedder.load()
        embedder.encode(asked[:64])
        result: dict[str, Any] = {}
        for clients in (1, args.clients):
            runs, ceilings = [], []
            for _ in range(args.rounds):
                runs.append(load([server], script, clients, args.duration))
                if clients > 1:
                    ceilings.append(embedder_ceiling(embedder, asked, args.duration))
                print(f"semantic {clients:>3} clients {runs[-1]['per_s']:8.1f}/s p50 "
                      f"{runs[-1]['p50_ms']:.2f} ms  non-2xx {runs[-1]['non_2xx']}"
                      + (f"  embedder {ceilings[-1]:.1f}/s" if ceilings else ""),
                      file=sys.stderr)  # fmt: skip
            figures: dict[str, Any] = summary(runs)
            if ceilings:
                figures["embedder_batched_per_s"] = statistics.median(ceilings)
                figures["ratio_to_embedder"] = statistics.median(
                    r["per_s"] / c for r, c in zip(runs, ceilings, strict=True)
                )
            result[f"{clients}_clients"] = figures
        report["semantic"] = result
        report["semantic_rss_mib"] = rss_mib(server.process.pid)
    finally:
        server.stop()
        asyncio.run(drop(prefix))


def semantic_hits_only(server: Server, prompts: list[str]) -> list[str]:
    """The prompts the gateway answers with a semantic hit (the rest, which the guards or
    the verifier turn down, would measure misses): a hit is not written back, so it is
    a hit again."""
    kept = []
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for prompt in prompts:
            body = {"model": "small", "messages": [{"role": "user", "content": prompt}]}
            response = http.post(CHAT, json=body, headers=ONLY_CACHED)
            if response.headers.get("x-satisfice-cache") == "semantic":
                kept.append(prompt)
    return kept


def embedder_ceiling(embedder: Embedder, prompts: list[str], seconds: float) -> float:
    """Prompts per second the embedder alone encodes, in batches of its max_batch."""
    step, done, i = embedder.settings.max_batch, 0, 0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        batch = prompts[i : i + step] or prompts[:step]
        embedder.encode(batch)
        done, i = done + len(batch), (i + step) % len(prompts)
    return done / (time.perf_counter() - started)


async def warm_redis(prompts: list[str], vectors: Vectors, prefix: str) -> None:
    by_prompt = {p: i for i, p in enumerate(prompts)}

    async def known(texts: list[str]) -> Vectors:
        return np.asarray(vectors[[by_prompt[t] for t in texts]])

    cache = await open_cache(prefix)
    print(f"warming {len(prompts)} entries into Redis ({prefix}) ...", file=sys.stderr)
    await warm(
        cache, warm_lines(prompts), tenant="default", embed_many=known,  # type: ignore[arg-type]
        embedding_model=fingerprint_of_bundled(),
    )  # fmt: skip
    await cache.close()


# -- the plot ----------------------------------------------------------------------------


def plot(report: dict[str, Any], path: Path) -> None:
    """Exact hits per second at saturation and p50 at one client, each target beside the
    ceilings (grey)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    exact = report["exact"]
    fig, (left, right) = plt.subplots(2, 1, figsize=(9, 8), height_ratios=(3, 2))
    for axis, level, key, label in (
        (left, "32_clients", "per_s", "exact hits per second, 32 clients"),
        (right, "1_clients", "p50_ms", "p50 ms, one client"),
    ):
        figures = exact[level]
        names = list(figures)[::-1]
        values = [figures[n][key] for n in names]
        colours = ["0.7" if n.startswith("ceiling") else "tab:blue" for n in names]
        axis.barh(names, values, color=colours)
        for y, value in enumerate(values):
            axis.text(value, y, f" {value:,.0f}" if key == "per_s" else f" {value:.2f}",
                      va="center", fontsize=8)  # fmt: skip
        axis.set_xlabel(label)
        axis.set_xlim(0, max(values) * 1.18)
    fig.suptitle("The hit path on 2 cores, medians of rotated rounds (bench/hit_path.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# -- main --------------------------------------------------------------------------------


def main() -> None:
    if sys.argv[1:2] == ["serve-ceiling"]:
        kind, port, body, headers = sys.argv[2:6]
        serve_ceiling(kind, int(port), Path(body), Path(headers))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--duration", type=int, default=8, help="seconds per run")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=1000, help="distinct exact-hit prompts")
    parser.add_argument("--semantic", action="store_true", help="semantic hits too")
    parser.add_argument("--no-exact", action="store_true")
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--semantic-prompts", type=int, default=2000)
    parser.add_argument(
        "--embedder-runtime", choices=("onnx", "onnx-int8", "torch"), default="onnx"
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--before", type=Path, help="an earlier checkout, measured beside")
    parser.add_argument("--plot", type=Path, help="a PNG of the exact-hit figures")
    parser.add_argument("--from-json", type=Path, help="plot this report; measure nothing")
    args = parser.parse_args()
    if args.from_json is not None:
        if args.plot is not None:
            plot(json.loads(args.from_json.read_text()), args.plot)
        return
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is not installed: apt-get install wrk")
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    with tempfile.TemporaryDirectory(prefix="hit-path-") as scratch:
        work = Path(scratch)
        if not args.no_exact:
            exact_hits(args, work, report)
        if args.semantic:
            semantic_hits(args, work, report)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)
    if args.plot is not None and "exact" in report:
        plot(report, args.plot)


if __name__ == "__main__":
    main()
