"""A/B of exact hits, this tree against an earlier one, in back-to-back pairs.

bench/hit_path.py's own machinery (its gateways, warm-up, wrk script and load), but
only the three targets that have a twin in --before, and each run of a target is
followed at once by its twin's (their order alternating by round): on a machine whose
speed drifts (a shared VM), a slow spell then falls on both sides of a pair more often
than in hit_path's rotation through all its targets. Ratio: median over pairs of
after/before; CPU: each server's own CPU time per request, before's over after's.

    git worktree add ../before <commit>
    .venv/bin/python bench/hit_path_pairs.py --before ../before [--pairs 16]
        [--duration 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import uuid
from pathlib import Path

import hit_path as hp
from cache_hit_path import questions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True)
    parser.add_argument("--pairs", type=int, default=12)
    parser.add_argument("--duration", type=int, default=3)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompts", type=int, default=1000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    before = args.before.resolve()
    prompts = questions(args.prompts)
    prefix = f"bench-ab-{uuid.uuid4().hex[:8]}"
    near = hp.redis_cache(prefix)
    with tempfile.TemporaryDirectory(prefix="ab-hit-") as scratch:
        work = Path(scratch)
        pairs = {
            "memory, express": (
                hp.gateway("mem-x", "{}", work),
                hp.gateway("mem-x-b", "{}", work, tree=before),
            ),
            "memory, framework path": (
                hp.gateway("mem-f", "{}", work, express=False),
                hp.gateway("mem-f-b", "{}", work, express=False, tree=before),
            ),
            "redis + near cache, express": (
                hp.gateway("redis-x", near, work),
                hp.gateway("redis-x-b", near, work, tree=before),
            ),
        }
        servers = [s for pair in pairs.values() for s in pair]
        report: dict[str, dict[str, object]] = {}
        try:
            for server in servers:
                server.wait()
            for server in servers:  # the first redis one warms Redis for its twin too
                hp.warm_gateway(server, prompts)
            script = hp.wrk_script(hp.exact_bodies(prompts), work / "exact.lua")
            for server in servers:
                hp.load([server], script, 4, 2)
            for clients in args.clients:
                for name, (after, earlier) in pairs.items():
                    runs: dict[str, list[hp.Run]] = {"after": [], "before": []}
                    for i in range(args.pairs):
                        order = [("after", after), ("before", earlier)]
                        for side, server in order if i % 2 == 0 else order[::-1]:
                            runs[side].append(hp.load([server], script, clients, args.duration))
                    pairs_run = list(zip(runs["after"], runs["before"], strict=True))
                    ratios = [a["per_s"] / b["per_s"] for a, b in pairs_run]
                    cpu = [
                        b["server_cpu_ms_per_request"] / a["server_cpu_ms_per_request"]
                        for a, b in pairs_run
                    ]
                    row = {
                        "after_per_s": statistics.median(r["per_s"] for r in runs["after"]),
                        "before_per_s": statistics.median(r["per_s"] for r in runs["before"]),
                        "per_s_ratio": statistics.median(ratios),
                        "after_cpu_ms": statistics.median(
                            r["server_cpu_ms_per_request"] for r in runs["after"]
                        ),
                        "before_cpu_ms": statistics.median(
                            r["server_cpu_ms_per_request"] for r in runs["before"]
                        ),
                        "cpu_ratio_before_over_after": statistics.median(cpu),
                        "per_pair_ratios": [round(r, 3) for r in ratios],
                        "non_2xx": sum(r["non_2xx"] for side in runs.values() for r in side),
                    }
                    report[f"{clients} clients, {name}"] = row
                    print(
                        f"{clients:>3} clients  {name:<28} after {row['after_per_s']:7.0f}/s "
                        f"before {row['before_per_s']:7.0f}/s  ratio {row['per_s_ratio']:.3f}  "
                        f"cpu/req {row['after_cpu_ms']:.4f} vs {row['before_cpu_ms']:.4f} ms "
                        f"(before/after {row['cpu_ratio_before_over_after']:.3f})  "
                        f"pairs {row['per_pair_ratios']}",
                        flush=True,
                    )
        finally:
            for server in servers:
                server.stop()
            asyncio.run(hp.drop(prefix))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
