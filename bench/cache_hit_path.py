"""The cache at scale: warm-up throughput, hit latency through HTTP, memory per entry.

One run, on 127.0.0.1 with a real Redis and a real `satisfice serve` process:
  1. warm-up throughput: `warm()` (what `satisfice cache warmup` and the admin
     endpoint run) against the embedder's raw batched throughput on the same
     prompts, interleaved, as a ratio;
  2. ENTRIES distinct Quora questions warmed into Redis (a fresh key prefix), with
     their vectors computed once beforehand and kept in bench/out; Redis memory
     before and after, and the change stream's share of it;
  3. a gateway on that prefix (index rebuilt from Redis at start) and one on an
     empty prefix: the difference in RSS is the process's memory for the entries;
  4. hit latency, with one client, with CLIENTS clients in a closed loop (each sends
     its next request when its last one answers: the saturation throughput), and with
     CLIENTS clients offering half that throughput: exact hits (warmed prompts, cased
     differently) and semantic hits (warmed prompts reworded: "..., please?"). Requests
     carry `Cache-Control: only-if-cached`, so a miss answers 504 and never generates.
The load generator runs in a fresh process and shares the machine's cores.

    .venv/bin/python bench/cache_hit_path.py [--entries 100000] [--clients 32] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import TypedDict

import httpx
import msgspec
import numpy as np
import redis

from cache.redis_store import RedisStore
from cache.semantic_cache import SemanticCache
from cache.settings import CacheSettings, RedisStoreSettings
from cache.warmup import BATCH, warm
from router.embedder import (
    Embedder,
    EmbedderSettings,
    Vectors,
    bundled_model_dir,
    model_fingerprint,
)

ROOT = Path(__file__).resolve().parent.parent

DATA = ROOT.parent / "shared" / "data"
# A miss answers 504 at once instead of generating: this measures the hit path only.
ONLY_CACHED = {"cache-control": "only-if-cached"}
REDIS_URL = "redis://127.0.0.1:6379/0"


def questions(limit: int) -> list[str]:
    """Distinct Quora questions, in file order."""
    archive = DATA / "gptcache_qqp" / "similiar_qqp_full.json.gz"  # a gzipped tar
    raw = subprocess.run(["tar", "xzOf", str(archive)], capture_output=True, check=True).stdout
    seen: dict[str, None] = {}
    for pair in json.loads(raw):
        for text in (pair["text_a"], pair["text_b"]):
            if isinstance(text, str) and 12 <= len(text.strip()) <= 300:
                seen.setdefault(text.strip(), None)
        if len(seen) >= limit:
            break
    return list(seen)[:limit]


def embeddings(prompts: list[str], path: Path) -> Vectors:
    if path.exists():
        vectors: Vectors = np.load(path)
        if len(vectors) == len(prompts):
            return vectors
    embedder = Embedder(EmbedderSettings(threads=os.cpu_count() or 1, max_batch=256))
    embedder.load()
    print(f"embedding {len(prompts)} prompts (kept in {path}) ...", file=sys.stderr)
    vectors = embedder.encode(prompts)
    np.save(path, vectors)
    return vectors


def fingerprint_of_bundled() -> str:
    """The bundled embedder's fingerprint, without loading the model."""
    name = EmbedderSettings().model
    return model_fingerprint(name, bundled_model_dir(name))


def warm_lines(prompts: list[str]) -> bytes:
    return b"\n".join(
        msgspec.json.encode({"prompt": p, "response": f"cached answer {i}", "model": "small"})
        for i, p in enumerate(prompts)
    )


def reworded(prompt: str) -> str:
    # Embeds above 0.92 for nearly every question and changes nothing a guard checks.
    return prompt.rstrip("?").rstrip() + ", please?"


async def open_cache(prefix: str) -> SemanticCache:
    store = RedisStoreSettings(url=REDIS_URL, key_prefix=prefix)
    cache = SemanticCache(CacheSettings(store=store), RedisStore(store))
    await cache.start()
    return cache


async def warmup_ratio(embedder: Embedder, prompts: list[str], rounds: int) -> dict[str, float]:
    """Prompts per second: raw batched embedding vs the whole warm-up, interleaved."""
    raw_s, warm_s = [], []
    data = warm_lines(prompts)
    for _ in range(rounds):
        started = time.perf_counter()
        for start in range(0, len(prompts), BATCH):
            await embedder.embed_many(prompts[start : start + BATCH])
        raw_s.append(time.perf_counter() - started)

        cache = await open_cache(f"bench-warm-{uuid.uuid4().hex[:8]}")
        started = time.perf_counter()
        await warm(
            cache, data, tenant="bench", embed_many=embedder.embed_many,
            embedding_model=embedder.fingerprint,
        )  # fmt: skip
        warm_s.append(time.perf_counter() - started)
        await cache.invalidate(None)
        await cache.close()
    raw = len(prompts) / statistics.median(raw_s)
    warmed = len(prompts) / statistics.median(warm_s)
    return {"raw_per_s": raw, "warmup_per_s": warmed, "ratio": warmed / raw}


def redis_used_bytes() -> int:
    return int(redis.Redis.from_url(REDIS_URL).info("memory")["used_memory"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


class Gateway:
    def __init__(self, prefix: str, directory: Path) -> None:
        self.port = free_port()
        config = directory / f"{prefix}.yaml"
        config.write_text(
            "engines:\n  small: {backend: llama_cpp, model: smollm2-135m-instruct}\n"
            f"cache:\n  store: {{kind: redis, url: '{REDIS_URL}', key_prefix: {prefix}}}\n"
        )
        self.started = time.perf_counter()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config),
             "--port", str(self.port)],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> float:
        while True:
            if self.process.poll() is not None:
                raise RuntimeError("gateway exited")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200:
                    return time.perf_counter() - self.started
            except httpx.TransportError:
                pass
            time.sleep(0.2)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


class LoadResult(TypedDict):
    clients: int
    requests: int
    offered_per_s: float | None
    per_s: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    sources: dict[str, int]  # responses by x-satisfice-cache, or by status without one


async def load(
    url: str, prompts: list[str], clients: int, requests: int, rate: float | None = None
) -> LoadResult:
    """``clients`` workers on their own connections until ``requests`` have been sent.
    Closed loop (each sends its next request when its last one answers) without a
    ``rate``; with one, each worker keeps to its share of ``rate`` requests/s, so the
    latency is the service time at that load rather than the queue of a saturated one."""
    latencies: list[float] = []
    sources: dict[str, int] = {}
    queue = iter(range(requests))
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=30) as http:

        async def worker(offset: float) -> None:
            interval = clients / rate if rate else 0.0
            next_at = time.perf_counter() + offset * interval
            for i in queue:
                if interval:
                    await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
                    next_at += interval
                body = {"model": "small", "messages": [
                    {"role": "user", "content": prompts[i % len(prompts)]}]}  # fmt: skip
                started = time.perf_counter()
                response = await http.post("/v1/chat/completions", json=body, headers=ONLY_CACHED)
                latencies.append((time.perf_counter() - started) * 1000)
                source = response.headers.get("x-satisfice-cache", str(response.status_code))
                sources[source] = sources.get(source, 0) + 1

        started = time.perf_counter()
        await asyncio.gather(*(worker(n / clients) for n in range(clients)))
        elapsed = time.perf_counter() - started
    latencies.sort()
    return {
        "clients": clients,
        "requests": requests,
        "offered_per_s": rate,
        "per_s": requests / elapsed,
        "p50_ms": latencies[len(latencies) // 2],
        "p90_ms": latencies[int(len(latencies) * 0.9)],
        "p99_ms": latencies[int(len(latencies) * 0.99)],
        "sources": sources,
    }


def _run_load(
    url: str, prompts: list[str], clients: int, requests: int, rate: float | None
) -> LoadResult:
    return asyncio.run(load(url, prompts, clients, requests, rate))


def load_in_fresh_process(
    url: str, prompts: list[str], clients: int, requests: int, rate: float | None = None
) -> LoadResult:
    """The load generator in a new process, as a product backend would be: this one
    has loaded torch and holds the vectors, and measured up to 5x slower clients."""
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=spawn) as pool:
        return pool.submit(_run_load, url, prompts, clients, requests, rate).result()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--warmup-sample", type=int, default=2000, help="0: skip that part")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, object] = {"entries": args.entries, "clients": args.clients}

    prompts = questions(args.entries)
    assert len(prompts) == args.entries, f"only {len(prompts)} distinct questions"
    await warmup_throughput(report, prompts, args.warmup_sample)
    prefix = f"bench-hits-{uuid.uuid4().hex[:8]}"
    added = await warm_into_redis(report, prompts, prefix, out)
    full = gateways_memory(report, prefix, out, added)
    try:
        report["latency"] = hit_latency(full.url, prompts, args.clients, args.requests)
        report["rss_mib_after_load"] = rss_mib(full.process.pid)
    finally:
        full.stop()
        cleanup = await open_cache(prefix)
        await cleanup.invalidate(None)
        await cleanup.close()
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)


async def warmup_throughput(report: dict[str, object], prompts: list[str], sample: int) -> None:
    """1. The warm-up against the embedder's raw throughput, on ``sample`` prompts."""
    embedder = Embedder(EmbedderSettings())
    await embedder.start()
    if sample:
        print("warm-up throughput ...", file=sys.stderr)
        chosen = random.Random(0).sample(prompts, sample)
        report["warmup"] = await warmup_ratio(embedder, chosen, rounds=3)
        print(json.dumps(report["warmup"]), file=sys.stderr)
    await embedder.close()


async def warm_into_redis(
    report: dict[str, object], prompts: list[str], prefix: str, out: Path
) -> int:
    """2. Every prompt warmed into Redis under ``prefix``, and Redis's memory for them;
    the entries added."""
    # This warm-up is about Redis and the index, not the embedder (measured in 1): its
    # vectors are computed once, with every core, and kept for reruns.
    vectors = embeddings(prompts, out / f"qqp_{len(prompts)}_vectors.npy")
    by_prompt = {p: i for i, p in enumerate(prompts)}

    async def known(texts: Sequence[str]) -> Vectors:
        return vectors[[by_prompt[t] for t in texts]]

    print(f"warming {len(prompts)} entries into Redis ({prefix}) ...", file=sys.stderr)
    before = redis_used_bytes()
    cache = await open_cache(prefix)
    started = time.perf_counter()
    warmed = await warm(
        cache, warm_lines(prompts), tenant="default", embed_many=known,
        embedding_model=fingerprint_of_bundled(),
    )  # fmt: skip
    report["warm_s_precomputed_vectors"] = time.perf_counter() - started
    report["warmed"] = warmed.added
    await cache.close()
    report["redis_bytes_per_entry"] = (redis_used_bytes() - before) / warmed.added
    # The change stream keeps the last stream_max_len changes (each Put carries its
    # entry): a bounded cost, apart from the entries' own.
    stream = redis.Redis.from_url(REDIS_URL).memory_usage(f"{prefix}:changes", samples=0)
    report["redis_stream_bytes"] = stream
    report["redis_bytes_per_entry_without_stream"] = (
        redis_used_bytes() - before - (stream or 0)
    ) / warmed.added
    print(json.dumps(report), file=sys.stderr)
    return warmed.added


def gateways_memory(report: dict[str, object], prefix: str, out: Path, added: int) -> Gateway:
    """3. A gateway on an empty prefix and one on the warmed ``prefix``: the process's
    memory for the entries. The second one, ready and still running."""
    empty = Gateway(f"bench-empty-{uuid.uuid4().hex[:8]}", out)
    empty.wait_ready()
    empty_rss = rss_mib(empty.process.pid)
    empty.stop()
    full = Gateway(prefix, out)
    report["ready_s_with_entries"] = full.wait_ready()
    full_rss = rss_mib(full.process.pid)
    report["rss_mib_empty"] = empty_rss
    report["rss_mib_with_entries"] = full_rss
    report["process_mib_per_100k"] = (full_rss - empty_rss) * 100_000 / added
    return full


def hit_latency(
    url: str, prompts: list[str], clients: int, requests: int
) -> dict[str, dict[str, LoadResult]]:
    """4. Exact and semantic hits: one client, ``clients`` saturating the gateway, and
    ``clients`` offering half that throughput."""
    rng = random.Random(1)
    exact = [p.lower() for p in rng.sample(prompts, min(len(prompts), requests))]
    semantic = [reworded(p) for p in rng.sample(prompts, min(len(prompts), requests))]
    phases = {}
    for name, queries in (("exact", exact), ("semantic", semantic)):
        print(f"{name} hits ...", file=sys.stderr)
        load_in_fresh_process(url, queries, 4, 200)  # warm connections and code
        one = load_in_fresh_process(url, queries, 1, min(500, requests))
        saturated = load_in_fresh_process(url, queries, clients, requests)
        # The same clients offering half of what saturated them.
        rate = 0.5 * saturated["per_s"]
        half = load_in_fresh_process(url, queries, clients, requests, rate)
        phases[name] = {"one_client": one, "saturated": saturated, "half_load": half}
        print(json.dumps(phases[name]), file=sys.stderr)
    return phases


if __name__ == "__main__":
    asyncio.run(main())
