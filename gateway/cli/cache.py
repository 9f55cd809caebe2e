"""`satisfice cache eval | warmup | stats | invalidate`: a shell over cache.pairs,
cache.warmup and cache.standalone."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import msgspec

from cache.calibration import OperatingPoints, write_calibration
from cache.pairs import PRECISION_TARGET, Sweep, plot, read_pairs, sweep
from cache.semantic_cache import CacheStats, SemanticCache
from cache.settings import CacheSettings
from cache.standalone import opened
from cache.store import FloorChange
from cache.verifier import BUNDLED, Verifier
from cache.warmup import DryRun, WarmupReport, dry_run_file, parse_queries, warm
from gateway.config import GatewayConfig, load_config, valid_tenant
from router.embedder import Embedder


def _swept(
    config: GatewayConfig, files: list[str], *, pairwise: bool
) -> tuple[CacheSettings, Sweep]:
    settings = config.cache or CacheSettings()
    embedder = Embedder(config.embedder, Path(config.models_dir))
    embedder.load()
    pairs = [pair for path in files for pair in read_pairs(path)]
    cached = len({p.a for p in pairs})
    print(f"embedding {cached} cached and {len(pairs)} queried prompts ...", file=sys.stderr)
    return settings, sweep(
        pairs,
        settings,
        encode=embedder.encode,
        embedding_model=embedder.fingerprint,
        pairwise=pairwise,
    )


def cache_eval(args: argparse.Namespace) -> int:
    settings, result = _swept(load_config(args.config), [args.pairs], pairwise=args.pairwise)
    report: dict[str, object] = {
        "pairs": len(result.score),
        "view": "pairwise" if args.pairwise else "whole file",
        "decided_by": result.by,
    }
    threshold = result.configured(settings) if args.threshold is None else args.threshold
    if result.by == "verifier" and args.threshold is None:
        report["max_false_hit_rate"] = settings.max_false_hit_rate
    point = result.at(threshold)
    report.update(msgspec.to_builtins(point))
    if result.by == "verifier" and args.threshold is None and args.pairwise:
        # What the bound promises, on pairs the calibration did not see (the pairwise
        # view is the one the calibration takes: every hit judged by a label).
        report["bound_held"] = point.semantic_wrong_share <= settings.max_false_hit_rate
    best = result.best_at_precision(PRECISION_TARGET)
    report["best_hit_rate_at_99_precision"] = None if best is None else best.hit_rate
    report["best_threshold_at_99_precision"] = None if best is None else best.threshold
    if args.plot:
        plot(result, Path(args.pairs).name, args.plot)
    print(json.dumps(report) if args.json else "\n".join(f"{k}: {v}" for k, v in report.items()))
    return 0


def cache_calibrate(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    if config.cache is None or config.cache.verifier is None:
        raise SystemExit("this config has no cache verifier: there is nothing to calibrate")
    verifier = Verifier.load(config.cache.verifier.weights or BUNDLED)
    _, result = _swept(config, args.pairs, pairwise=True)
    names = ", ".join(Path(p).name for p in args.pairs)
    calibration = result.calibration(verifier.fingerprint, names)
    write_calibration(calibration, args.out)
    points = OperatingPoints(calibration)
    report = {
        "out": args.out,
        "queries": calibration.queries,
        "semantic_hits": len(calibration.scores),
        "operating_points": {
            str(bound): points.threshold(bound) for bound in (0.005, 0.01, 0.02, 0.05, 0.1)
        },
        "use": f"cache.verifier.calibration: {args.out}",
    }
    print(json.dumps(report))
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
    embedder = Embedder(config.embedder, Path(config.models_dir))

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


def cache_feedback(args: argparse.Namespace) -> int:
    """What POST /v1/feedback does, on the store directly (e.g. from a review queue)."""
    settings = _settings(load_config(args.config))
    if args.score is not None and not 0.0 <= args.score <= 1.0:
        raise SystemExit(f"--score {args.score} is not a P in [0, 1]")

    async def run() -> FloorChange | None:
        async with opened(settings, writes=True) as cache:
            return await cache.report_false_hit(args.tenant, args.entry_id, args.score)

    updated = asyncio.run(run())
    if updated is None:
        print(f"tenant {args.tenant!r} has no cache entry {args.entry_id}", file=sys.stderr)
        return 1
    print(json.dumps({"entry_id": str(args.entry_id), "hit_floor": updated.floor,
                      "raised": updated.raised}))  # fmt: skip
    return 0


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    cache = commands.add_parser("cache", help="evaluate and manage the semantic cache")
    sub = cache.add_subparsers(dest="cache_command", required=True)
    ev = sub.add_parser("eval", help="warm with every a, query with every b, report hits")
    ev.add_argument("--pairs", required=True, help='JSONL of {"a", "b", "label"} lines')
    ev.add_argument("--threshold", type=float,
                    help="on the score the cache decides by (the verifier's P, or the "
                    "similarity without one); default: the config's operating point")  # fmt: skip
    ev.add_argument("--pairwise", action="store_true",
                    help="each pair alone: its a cached on its own, its b asked (the view "
                    "`cache calibrate` takes; says whether the bound held)")  # fmt: skip
    ev.add_argument("--config")
    ev.add_argument("--json", action="store_true")
    ev.add_argument("--plot", help="write precision and hit rate against the threshold here")
    ev.set_defaults(run=cache_eval)

    cal = sub.add_parser(
        "calibrate", help="the verifier's outcomes on labelled pairs, for its operating points"
    )
    cal.add_argument("--pairs", required=True, action="append",
                     help='JSONL of {"a", "b", "label"} lines (repeatable)')  # fmt: skip
    cal.add_argument("--out", required=True, help="the file cache.verifier.calibration names")
    cal.add_argument("--config")
    cal.set_defaults(run=cache_calibrate)

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

    feedback = sub.add_parser(
        "feedback", help="a semantic hit was wrong: raise its entry's floor (as POST /v1/feedback)"
    )
    feedback.add_argument("--entry-id", type=int, required=True,
                          help="the x-satisfice-cache-entry header of the wrong hit")  # fmt: skip
    feedback.add_argument("--score", type=float,
                          help="its x-satisfice-cache-score; without it, the entry's semantic "
                          "hits stop")  # fmt: skip
    feedback.add_argument("--tenant", default="default", help="the tenant the hit was served to")
    feedback.add_argument("--config")
    feedback.set_defaults(run=cache_feedback)
