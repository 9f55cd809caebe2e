"""`satisfice cache eval | warmup | stats | invalidate`: a shell over cache.pairs,
cache.warmup and cache.standalone."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import msgspec

from cache.pairs import PRECISION_TARGET, plot, read_pairs, sweep
from cache.semantic_cache import CacheStats, SemanticCache
from cache.settings import CacheSettings
from cache.standalone import opened
from cache.warmup import DryRun, WarmupReport, dry_run_file, parse_queries, warm
from gateway.config import GatewayConfig, load_config, valid_tenant
from router.embedder import Embedder


def cache_eval(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    settings = config.cache or CacheSettings()
    embedder = Embedder(config.embedder)
    embedder.load()
    pairs = read_pairs(args.pairs)
    cached = len({p.a for p in pairs})
    print(f"embedding {cached} cached and {len(pairs)} queried prompts ...", file=sys.stderr)
    result = sweep(pairs, settings, encode=embedder.encode, embedding_model=embedder.fingerprint)
    threshold = args.threshold if args.threshold is not None else settings.similarity_threshold
    report: dict[str, object] = {"pairs": len(pairs), **msgspec.to_builtins(result.at(threshold))}
    best = result.best_at_precision(PRECISION_TARGET)
    report["best_hit_rate_at_99_precision"] = None if best is None else best.hit_rate
    report["best_threshold_at_99_precision"] = None if best is None else best.threshold
    if args.plot:
        plot(result, Path(args.pairs).name, args.plot)
    print(json.dumps(report) if args.json else "\n".join(f"{k}: {v}" for k, v in report.items()))
    return 0


def _settings(config: GatewayConfig) -> CacheSettings:
    if config.cache is None:
        raise SystemExit("this config has no cache section")
    return config.cache


def cache_warmup(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    if not valid_tenant(args.namespace):
        raise SystemExit(
            f"--namespace {args.namespace!r} is not a tenant name: 1 to 64 letters, digits, "
            "'_', '-' or '.'"
        )
    config = load_config(args.config)
    data = Path(args.file).read_bytes()
    queries = Path(args.queries).read_bytes() if args.queries else None
    embedder = Embedder(config.embedder)

    async def run() -> DryRun | WarmupReport:
        await embedder.start()
        try:
            if args.dry_run:
                if queries is None:
                    raise SystemExit("--dry-run needs --queries FILE")
                try:
                    asked = parse_queries(queries)
                except ValueError as exc:
                    raise SystemExit(f"--queries: {exc}") from exc
                return await dry_run_file(
                    config.cache or CacheSettings(),
                    data,
                    asked,
                    tenant=args.namespace,
                    embed_many=embedder.embed_many,
                    embedding_model=embedder.fingerprint,
                )
            async with opened(_settings(config), writes=True) as cache:
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


def cache_stats(args: argparse.Namespace) -> int:
    settings = _settings(load_config(args.config))

    async def run() -> CacheStats:
        async with opened(settings) as cache:
            return await cache.stats()

    print(msgspec.json.encode(asyncio.run(run())).decode())
    return 0


def cache_invalidate(args: argparse.Namespace) -> int:
    settings = _settings(load_config(args.config))

    async def drop(cache: SemanticCache) -> int:
        if args.id is not None:
            return int(await cache.delete(args.id))
        return await cache.invalidate(None if args.all else args.namespace)

    async def run() -> int:
        async with opened(settings, writes=True) as cache:
            return await drop(cache)

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
