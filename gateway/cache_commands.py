"""`satisfice cache eval`: how a cache configuration would do on labelled prompt pairs."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated

import msgspec
import numpy as np
import numpy.typing as npt

from cache import create_store
from cache.entry import Namespace, normalise
from cache.memory_store import MemoryStore
from cache.semantic_cache import CacheStats, Hit, SemanticCache
from cache.settings import CacheSettings, MemoryStoreSettings
from cache.warmup import DryRun, WarmupReport, dry_run, parse_queries, warm
from gateway.config import GatewayConfig, load_config
from router.embedder import Embedder, Embedding, Vectors

PRECISION_TARGET = 0.99


class Pair(msgspec.Struct, frozen=True):
    a: str
    b: str
    label: Annotated[int, msgspec.Meta(ge=0, le=1)]


def read_pairs(path: str) -> list[Pair]:
    decoder = msgspec.json.Decoder(Pair)
    pairs = []
    for number, line in enumerate(Path(path).read_bytes().splitlines(), start=1):
        if line.strip():
            try:
                pairs.append(decoder.decode(line))
            except msgspec.DecodeError as exc:
                raise SystemExit(f"{path}:{number}: {exc}") from exc
    return pairs


class Sweep(msgspec.Struct, frozen=True):
    """Per query: the similarity of what the cache would serve (guards applied), and
    whether serving it would be right."""

    similarity: npt.NDArray[np.float64]  # -1 where nothing passes the guards
    correct: npt.NDArray[np.bool_]

    def at(self, threshold: float) -> dict[str, float]:
        hits = self.similarity >= threshold
        count = int(hits.sum())
        right = int((hits & self.correct).sum())
        return {
            "threshold": threshold,
            "hit_rate": count / len(hits),
            "precision": right / count if count else 1.0,
            "false_hit_rate": (count - right) / len(hits),
        }

    def best_at_precision(self, target: float) -> dict[str, float] | None:
        """The lowest threshold (most hits) whose precision still reaches ``target``."""
        best = None
        for threshold in np.unique(self.similarity[self.similarity >= 0])[::-1]:
            point = self.at(float(threshold))
            if point["precision"] < target:
                break
            best = point
        return best


def sweep(pairs: list[Pair], settings: CacheSettings, embedder: Embedder) -> Sweep:
    warm = list(dict.fromkeys(p.a for p in pairs))
    print(f"embedding {len(warm)} cached and {len(pairs)} queried prompts ...", file=sys.stderr)
    cached_vectors = embedder.encode(warm)
    query_vectors = embedder.encode([p.b for p in pairs])
    return asyncio.run(_sweep(pairs, warm, cached_vectors, query_vectors, settings, embedder))


async def _sweep(
    pairs: list[Pair],
    warm: list[str],
    cached_vectors: Vectors,
    query_vectors: Vectors,
    settings: CacheSettings,
    embedder: Embedder,
) -> Sweep:
    # Threshold 0 returns the first candidate every guard accepts; any threshold's
    # outcome follows from its similarity.
    store = MemoryStoreSettings(max_entries=len(warm) + 1, snapshot=None)
    everything = msgspec.structs.replace(
        settings, similarity_threshold=0.0, ttl_s=None, write_confidence=0.0, store=store
    )
    cache = SemanticCache(everything, MemoryStore(store))
    namespace = Namespace(model="eval", embedding=embedder.fingerprint)
    await cache.start()
    try:
        entries = [
            cache.entry(
                namespace,
                prompt,
                Embedding(vector, embedder.fingerprint),
                response="",
                model="",
                tier="",
                confidence=1.0,
            )
            for prompt, vector in zip(warm, cached_vectors, strict=True)
        ]
        await cache.put(entries)
        similarity = np.full(len(pairs), -1.0)
        correct = np.zeros(len(pairs), dtype=bool)
        for i, (pair, vector) in enumerate(zip(pairs, query_vectors, strict=True)):
            embedding = Embedding(vector, embedder.fingerprint)

            async def known(embedding: Embedding = embedding) -> Embedding:
                return embedding

            found, _ = await cache.lookup(namespace, pair.b, known)
            if isinstance(found, Hit):
                similarity[i] = found.similarity
                correct[i] = pair.label == 1 and normalise(found.entry.prompt) == normalise(pair.a)
        return Sweep(similarity, correct)
    finally:
        await cache.close()


def cache_eval(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    settings = config.cache or CacheSettings()
    embedder = Embedder(config.embedder)
    embedder.load()
    pairs = read_pairs(args.pairs)
    result = sweep(pairs, settings, embedder)
    threshold = args.threshold if args.threshold is not None else settings.similarity_threshold
    report: dict[str, object] = {"pairs": len(pairs), **result.at(threshold)}
    best = result.best_at_precision(PRECISION_TARGET)
    report["best_hit_rate_at_99_precision"] = None if best is None else best["hit_rate"]
    report["best_threshold_at_99_precision"] = None if best is None else best["threshold"]
    if args.plot:
        _plot(result, Path(args.pairs).name, args.plot)
    print(json.dumps(report) if args.json else "\n".join(f"{k}: {v}" for k, v in report.items()))
    return 0


def _plot(result: Sweep, title: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    thresholds = np.linspace(0.5, 1.0, 101)
    points = [result.at(float(t)) for t in thresholds]
    figure, axes = plt.subplots(figsize=(7, 4.5))
    axes.plot(thresholds, [p["precision"] for p in points], label="precision")
    axes.plot(thresholds, [p["hit_rate"] for p in points], label="hit rate")
    axes.plot(thresholds, [p["false_hit_rate"] for p in points], label="false-hit rate")
    axes.axhline(PRECISION_TARGET, color="grey", linestyle=":", linewidth=0.8)
    axes.set_xlabel("similarity threshold")
    axes.set_title(title)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


@contextlib.asynccontextmanager
async def _configured_cache(config: GatewayConfig, *, writes: bool) -> AsyncIterator[SemanticCache]:
    """The cache the config describes, started (its index rebuilt) and closed after."""
    if config.cache is None:
        raise SystemExit("this config has no cache section")
    store = config.cache.store
    if writes and isinstance(store, MemoryStoreSettings) and store.snapshot is None:
        raise SystemExit(
            "the memory store keeps nothing after this command ends: set "
            "cache.store.snapshot, use the redis store, or POST the file to a running "
            "gateway's /admin/cache/warmup"
        )
    cache = SemanticCache(config.cache, create_store(config.cache))
    await cache.start()
    try:
        yield cache
    finally:
        await cache.close()


def cache_warmup(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    config = load_config(args.config)
    data = Path(args.file).read_bytes()
    queries = Path(args.queries).read_bytes() if args.queries else None
    embedder = Embedder(config.embedder)

    async def run() -> object:
        await embedder.start()
        try:
            if args.dry_run:
                if queries is None:
                    raise SystemExit("--dry-run needs --queries FILE")
                return await _dry_run(config, embedder, data, queries, args.namespace)
            async with _configured_cache(config, writes=True) as cache:
                with tqdm(total=len(data.splitlines()), unit="line", file=sys.stderr) as bar:
                    return await warm(
                        cache,
                        data,
                        tenant=args.namespace,
                        embed_many=embedder.embed_many,
                        embedding_model=embedder.fingerprint,
                        progress=bar.update,
                    )
        finally:
            await embedder.close()

    report = asyncio.run(run())
    print(msgspec.json.encode(report).decode())
    return 1 if isinstance(report, WarmupReport) and report.bad else 0


async def _dry_run(
    config: GatewayConfig, embedder: Embedder, data: bytes, queries: bytes, tenant: str
) -> DryRun:
    """Warm a scratch in-process cache with the file, then ask it the queries."""
    settings = config.cache or CacheSettings()
    scratch = MemoryStoreSettings(max_entries=len(data.splitlines()) + 1, snapshot=None)
    cache = SemanticCache(msgspec.structs.replace(settings, store=scratch), MemoryStore(scratch))
    await cache.start()
    try:
        await warm(
            cache,
            data,
            tenant=tenant,
            embed_many=embedder.embed_many,
            embedding_model=embedder.fingerprint,
        )
        try:
            asked = parse_queries(queries)
        except ValueError as exc:
            raise SystemExit(f"--queries: {exc}") from exc
        return await dry_run(
            cache,
            asked,
            tenant=tenant,
            embed_many=embedder.embed_many,
            embedding_model=embedder.fingerprint,
        )
    finally:
        await cache.close()


def cache_stats(args: argparse.Namespace) -> int:
    config = load_config(args.config)

    async def run() -> CacheStats:
        async with _configured_cache(config, writes=False) as cache:
            return await cache.stats()

    print(msgspec.json.encode(asyncio.run(run())).decode())
    return 0


def cache_invalidate(args: argparse.Namespace) -> int:
    config = load_config(args.config)

    async def run() -> int:
        async with _configured_cache(config, writes=True) as cache:
            if args.id is not None:
                return int(await cache.delete(args.id))
            return await cache.invalidate(None if args.all else args.namespace)

    print(json.dumps({"deleted": asyncio.run(run())}))
    return 0


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    cache = commands.add_parser("cache", help="evaluate and manage the semantic cache")
    sub = cache.add_subparsers(dest="cache_command", required=True)
    ev = sub.add_parser("eval", help="warm with every a, query with every b, report hits")
    ev.add_argument("--pairs", required=True, help='JSONL of {"a", "b", "label"} lines')
    ev.add_argument("--threshold", type=float, help="default: the config's")
    ev.add_argument("--config")
    ev.add_argument("--json", action="store_true")
    ev.add_argument("--plot", help="write precision and hit rate against the threshold here")
    ev.set_defaults(run=cache_eval)

    warmup = sub.add_parser("warmup", help="load known answers from JSONL into the cache")
    warmup.add_argument("file", help='JSONL of {"prompt", "response", ...} lines')
    warmup.add_argument("--namespace", default="default", help="the tenant they belong to")
    warmup.add_argument("--config")
    warmup.add_argument("--dry-run", action="store_true",
                        help="store nothing; report the hit rate --queries would get")  # fmt: skip
    warmup.add_argument("--queries", help='JSONL of {"prompt", ...} lines, for --dry-run')
    warmup.set_defaults(run=cache_warmup)

    stats = sub.add_parser("stats", help="entries, namespaces and store memory")
    stats.add_argument("--config")
    stats.set_defaults(run=cache_stats)

    invalidate = sub.add_parser("invalidate", help="drop entries")
    what = invalidate.add_mutually_exclusive_group(required=True)
    what.add_argument("--namespace", help='a tenant, "tenant:model", or a full namespace key')
    what.add_argument("--id", type=int, help="one entry")
    what.add_argument("--all", action="store_true", help="every entry")
    invalidate.add_argument("--config")
    invalidate.set_defaults(run=cache_invalidate)
