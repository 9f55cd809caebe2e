"""Whether the shadow checks' intervals are honest: over repeated replays of a request
stream, how often each shortcut's 95% interval (gateway.checks.estimates.LiveEstimates:
Hájek's rate, Wilson's interval on Kish's n_eff) covers the disagreement rate measured
directly on that stream, where every request was also answered by the path it skipped.

The stream is bench/shadow_stream.py's: held-out ARC-Challenge and GSM8K questions routed
by the bundled router (small_route; the loop: early_stop and large_route), each label
the comparator's verdict on banked answers, and held-out QQP/PAWS pairs served as
semantic hits by the shipped verifier (labelled by the pair's duplicate label, a proxy
for "the engine would answer the same").

Each run draws a stream (``--questions`` questions and ``--pairs`` pair lookups, a random
subset in a random order, each question on one of its 8 replayed branch orders), takes
each shortcut's direct disagreement rate on it, draws each shortcut of each request for
a check with its probability (independently per shortcut, as ShadowChecks.settled does),
feeds the drawn checks' CheckRecords to LiveEstimates and asks whether its 95% interval
covers the direct rate. Scenarios: one share for everything (``--shares``), and `mixed`:
shares that differ by tenant (ARC-Challenge and QQP one tenant, GSM8K and PAWS the other)
and by shortcut, and change halfway through the stream (a reload), read per tenant and
pooled over tenants (where the weights carry the estimate), beside the unweighted share
of the same checks for contrast.

    .venv/bin/python bench/shadow_estimates.py [--runs 4000] [--shares 0.05 0.1 0.25]
        [--questions 400] [--pairs 200] [--seed 0] [--json bench/out/shadow_estimates.json]
        [--plot docs/img/shadow_coverage.png] [--rebuild]

Coverage is counted over the runs whose checks decided at least one case of a shortcut
(`none` says in how many runs none did). The target is the rate on the run's own stream
(a finite population): with a large share checked, intervals that ignore the finite
population correction are wider than they need be. The `pool` column is the rate over
the whole pool, what an endless stream of this traffic would show.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gateway.checks.estimates import Estimate, LiveEstimates, wilson
from gateway.checks.record import CheckRecord
from gateway.config.shadow import Shortcut

sys.path.insert(0, str(Path(__file__).resolve().parent))
import shadow_stream  # a bench helper beside this script
from shadow_stream import Entry, record_of, tenant_of

SHORTCUTS: tuple[Shortcut, ...] = ("small_route", "early_stop", "large_route", "semantic_hit")
ALL = "all tenants"
DEFAULT = "default"
UNWEIGHTED = "mixed, unweighted"


# Share of a tenant's shortcut drawn at a point of the stream.
ShareOf = Callable[[str, Shortcut, float], float]


def uniform(share: float) -> ShareOf:
    return lambda tenant, shortcut, position: share


# mixed: tenant "arc" (ARC-Challenge questions, QQP pairs) checked sparsely, tenant
# "gsm" (GSM8K, PAWS) densely; each shortcut its own share; arc's shares triple halfway.
MIXED: dict[str, dict[Shortcut, float]] = {
    "arc": {"small_route": 0.05, "early_stop": 0.1, "large_route": 0.05, "semantic_hit": 0.1},
    "gsm": {"small_route": 0.5, "early_stop": 0.4, "large_route": 0.25, "semantic_hit": 0.3},
}


def mixed(tenant: str, shortcut: Shortcut, position: float) -> float:
    share = MIXED[tenant][shortcut]
    return min(1.0, 3 * share) if tenant == "arc" and position >= 0.5 else share


def entries_of(
    stream: shadow_stream.Stream,
    questions: Sequence[int],
    orders: Sequence[int],
    pairs: Sequence[int],
    rng: np.random.Generator,
) -> list[Entry]:
    """The shortcuts a drawn stream takes, its requests in a random order."""
    requests: list[tuple[str, int, int]] = [
        ("q", q, o) for q, o in zip(questions, orders, strict=True)
    ]
    requests += [("p", p, 0) for p in pairs]
    order = rng.permutation(len(requests))
    return shadow_stream.entries([requests[i] for i in order], stream)


def keys_of(entry: Entry, by_tenant: bool) -> list[tuple[str, str]]:
    """Where an entry is counted: under "default" when every tenant is checked alike;
    under its tenant and pooled over tenants when shares differ by tenant."""
    if not by_tenant:
        return [(DEFAULT, entry.shortcut)]
    return [(entry.tenant, entry.shortcut), (ALL, entry.shortcut)]


def direct_rates(entries: Sequence[Entry], by_tenant: bool) -> dict[tuple[str, str], float]:
    """Each key's share disagreeing among decided entries: the rate with every request
    checked."""
    counts: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for e in entries:
        if e.agree is None:
            continue
        for key in keys_of(e, by_tenant):
            counts[key][0] += not e.agree
            counts[key][1] += 1
    return {key: bad / n for key, (bad, n) in counts.items()}


class Tally:
    """Coverage bookkeeping of one (scenario, tenant, shortcut) over runs."""

    def __init__(self) -> None:
        self.runs = 0
        self.estimated = 0  # runs with at least one decided check
        self.covered = 0
        self.covered_pool = 0
        self.stream: list[int] = []
        self.checked: list[int] = []
        self.n_eff: list[float] = []
        self.direct: list[float] = []
        self.width: list[float] = []
        self.error: list[float] = []  # estimate less the direct rate

    def add(
        self, stream_size: int, direct: float | None, estimate: Estimate | None, pool: float
    ) -> None:
        self.runs += 1
        self.stream.append(stream_size)
        if direct is not None:
            self.direct.append(direct)
        if estimate is None or estimate.low is None or estimate.high is None or direct is None:
            self.checked.append(0)
            return
        self.estimated += 1
        self.checked.append(estimate.n)
        self.n_eff.append(estimate.n_eff)
        self.width.append(estimate.high - estimate.low)
        assert estimate.rate is not None
        self.error.append(estimate.rate - direct)
        self.covered += estimate.low <= direct <= estimate.high
        self.covered_pool += estimate.low <= pool <= estimate.high

    def summary(self, pool: float) -> dict[str, Any]:
        nan = float("nan")
        share = self.covered / self.estimated if self.estimated else nan
        low, high = wilson(share, self.estimated) if self.estimated else (nan, nan)
        return {
            "runs": self.runs,
            "mean_stream": float(np.mean(self.stream)),
            "mean_checked": float(np.mean(self.checked)),
            "mean_n_eff": float(np.mean(self.n_eff)) if self.n_eff else 0.0,
            "direct_rate": float(np.mean(self.direct)) if self.direct else nan,
            "pool_rate": pool,
            "mean_width": float(np.mean(self.width)) if self.width else nan,
            # The estimator's bias on these streams: its mean error against the direct rate.
            "mean_error": float(np.mean(self.error)) if self.error else nan,
            "runs_without_estimate": self.runs - self.estimated,
            "coverage": share,
            "coverage_95ci": [low, high],
            "coverage_of_pool_rate": self.covered_pool / self.estimated if self.estimated else nan,
        }


def pool_rates(stream: shadow_stream.Stream) -> dict[tuple[str, str], float]:
    """Each (tenant, shortcut)'s disagreement over the whole pool, each question on each
    of its branch orders alike: what an endless stream of this traffic would show."""
    sums: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])

    def note(tenant: str, shortcut: str, labels: Sequence[bool | None], orders: int) -> None:
        decided = [label for label in labels if label is not None]
        for key in ((tenant, shortcut), (ALL, shortcut), (DEFAULT, shortcut)):
            sums[key][0] += sum(not x for x in decided) / orders
            sums[key][1] += len(decided) / orders

    for item in stream.questions:
        tenant, orders = tenant_of(item.source), len(item.loop)
        if item.route == "small":
            note(tenant, "small_route", item.small_vs_loop, orders)
            continue
        note(tenant, "large_route", item.loop_vs_small, orders)
        early = [lab for o, lab in enumerate(item.loop_vs_budget) if item.early(o)]
        note(tenant, "early_stop", early, orders)
    for pair in stream.hits():
        note(tenant_of(pair.source), "semantic_hit", [pair.duplicate], 1)
    return {key: bad / n for key, (bad, n) in sums.items() if n}


def simulate(
    stream: shadow_stream.Stream,
    runs: int,
    shares: Sequence[float],
    questions: int,
    pairs: int,
    seed: int,
) -> dict[str, dict[tuple[str, str], Tally]]:
    scenarios: dict[str, ShareOf] = {f"p={s:g}": uniform(s) for s in shares}
    scenarios["mixed"] = mixed
    tallies: dict[str, dict[tuple[str, str], Tally]] = {
        name: defaultdict(Tally) for name in [*scenarios, UNWEIGHTED]
    }
    pool = pool_rates(stream)
    n_questions = min(questions, len(stream.questions))
    n_pairs = min(pairs, len(stream.pairs))
    for run in range(runs):
        rng = np.random.default_rng([seed, run])
        drawn_q = rng.choice(len(stream.questions), size=n_questions, replace=False).tolist()
        orders = rng.integers(0, shadow_stream.ORDERS, size=n_questions).tolist()
        drawn_p = rng.choice(len(stream.pairs), size=n_pairs, replace=False).tolist()
        entries = entries_of(stream, drawn_q, orders, drawn_p, rng)
        for name, share_of in scenarios.items():
            by_tenant = name == "mixed"
            direct = direct_rates(entries, by_tenant)
            sizes: dict[tuple[str, str], int] = defaultdict(int)
            records: list[CheckRecord] = []
            unweighted: list[CheckRecord] = []
            for e in entries:
                keys = keys_of(e, by_tenant)
                for key in keys:
                    sizes[key] += 1
                p = share_of(e.tenant, e.shortcut, e.position)
                if p > 0 and rng.random() < p:
                    records.extend(record_of(e, p, tenant) for tenant, _ in keys)
                    if by_tenant:
                        unweighted.append(record_of(e, 1.0, ALL))
            _tally(tallies[name], sizes, direct, LiveEstimates.fold(records), pool)
            if by_tenant:
                pooled = {k: v for k, v in sizes.items() if k[0] == ALL}
                _tally(tallies[UNWEIGHTED], pooled, direct, LiveEstimates.fold(unweighted), pool)
    return tallies


def _tally(
    tallies: dict[tuple[str, str], Tally],
    sizes: dict[tuple[str, str], int],
    direct: dict[tuple[str, str], float],
    live: LiveEstimates,
    pool: dict[tuple[str, str], float],
) -> None:
    estimates: dict[tuple[str, str], Estimate] = {
        (x.tenant, x.shortcut): x for x in live.snapshot()
    }
    for key, size in sizes.items():
        tallies[key].add(size, direct.get(key), estimates.get(key), pool.get(key, float("nan")))


def report(
    stream: shadow_stream.Stream, tallies: dict[str, dict[tuple[str, str], Tally]]
) -> dict[str, Any]:
    pool = pool_rates(stream)
    order = {s: i for i, s in enumerate(SHORTCUTS)}
    return {
        name: {
            f"{tenant}/{shortcut}": tally.summary(pool.get((tenant, shortcut), float("nan")))
            for (tenant, shortcut), tally in sorted(
                by_key.items(),
                key=lambda kv: (kv[0][0], order[kv[0][1]]),  # type: ignore[index]
            )
        }
        for name, by_key in tallies.items()
    }


def render(figures: dict[str, Any]) -> str:
    lines = [
        f"{'scenario':18} {'tenant/shortcut':26} {'stream':>6} {'checked':>7} {'n_eff':>6} "
        f"{'direct':>7} {'pool':>6} {'error':>6} {'width':>6} {'none':>5} "
        f"{'coverage (95% CI)':>22} "
        f"{'of pool':>7}"
    ]
    for name, rows in figures.items():
        for key, row in rows.items():
            low, high = row["coverage_95ci"]
            lines.append(
                f"{name:18} {key:26} {row['mean_stream']:6.1f} {row['mean_checked']:7.1f} "
                f"{row['mean_n_eff']:6.1f} {row['direct_rate']:7.1%} {row['pool_rate']:6.1%} "
                f"{row['mean_error']:+6.1%} "
                f"{row['mean_width']:6.3f} {row['runs_without_estimate']:5d} "
                f"{row['coverage']:8.1%} ({low:.1%}-{high:.1%}) "
                f"{row['coverage_of_pool_rate']:7.1%}"
            )
    return "\n".join(lines)


def plot(figures: dict[str, Any], path: Path) -> None:
    """Coverage against the share checked, per shortcut, with each one's 95% interval;
    the mixed scenario's pooled rows at the right."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in figures if n.startswith("p=")] + ["mixed"]
    figure, ax = plt.subplots(figsize=(8, 4.2))
    width = 0.8 / len(SHORTCUTS)
    for k, shortcut in enumerate(SHORTCUTS):
        xs, ys, lows, highs = [], [], [], []
        for i, name in enumerate(names):
            tenant = ALL if name == "mixed" else DEFAULT
            row = figures[name].get(f"{tenant}/{shortcut}")
            if row is None or row["coverage"] != row["coverage"]:
                continue
            low, high = row["coverage_95ci"]
            xs.append(i + (k - (len(SHORTCUTS) - 1) / 2) * width)
            ys.append(row["coverage"])
            lows.append(row["coverage"] - low)
            highs.append(high - row["coverage"])
        ax.errorbar(xs, ys, yerr=[lows, highs], fmt="o", capsize=3, label=shortcut)
    ax.axhline(0.95, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xticks(range(len(names)), [n.replace("mixed", "mixed (pooled)") for n in names])
    ax.set_ylabel("share of runs whose 95% interval\ncovers the stream's direct rate")
    lowest = min((r["coverage_95ci"][0] for n in names for r in figures[n].values()
                  if r["coverage"] == r["coverage"]), default=0.85)  # fmt: skip
    ax.set_ylim(min(0.85, lowest - 0.01), 1.0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("Shadow-check intervals against the rate with every request checked", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=4000)
    parser.add_argument("--shares", type=float, nargs="+", default=[0.05, 0.1, 0.25])
    parser.add_argument("--questions", type=int, default=400, help="questions per run")
    parser.add_argument("--pairs", type=int, default=200, help="pair lookups per run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", type=Path, default=shadow_stream.DATA)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path, help="coverage per shortcut and share (PNG)")
    parser.add_argument(
        "--stream-as-built",
        action="store_true",
        help="the stream kept in bench/out, even if the banks have grown since",
    )
    parser.add_argument("--rebuild", action="store_true", help="build the stream again")
    args = parser.parse_args(argv)
    stream, _ = shadow_stream.load(
        rebuild=args.rebuild, as_built=args.stream_as_built, data=args.data
    )
    started = time.perf_counter()
    tallies = simulate(stream, args.runs, args.shares, args.questions, args.pairs, args.seed)
    figures = report(stream, tallies)
    print(describe(stream))
    print(render(figures))
    print(f"{args.runs} runs in {time.perf_counter() - started:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({"stream": describe_json(stream), **figures}, indent=1))
    if args.plot:
        plot(figures, args.plot)
    return 0


def describe_json(stream: shadow_stream.Stream) -> dict[str, Any]:
    small = sum(q.route == "small" for q in stream.questions)
    return {
        "questions": len(stream.questions),
        "by_source": {
            s: sum(q.source == s for q in stream.questions) for s in shadow_stream.SOURCES
        },
        "routed_small": small,
        "routed_loop": len(stream.questions) - small,
        "router_threshold": stream.router_threshold,
        "pairs": len(stream.pairs),
        "semantic_hits": len(stream.hits()),
        "operating_point": stream.operating_point,
        "max_false_hit_rate": stream.max_false_hit_rate,
        "pool_rates": {f"{t}/{s}": r for (t, s), r in sorted(pool_rates(stream).items())},
    }


def describe(stream: shadow_stream.Stream) -> str:
    d = describe_json(stream)
    return (
        f"stream pool: {d['questions']} questions {d['by_source']} ({d['routed_small']} small, "
        f"{d['routed_loop']} loop at threshold {d['router_threshold']:.3f}); {d['pairs']} "
        f"pairs, {d['semantic_hits']} semantic hits at operating point "
        f"{d['operating_point']:.3f} (max_false_hit_rate {d['max_false_hit_rate']})"
    )


if __name__ == "__main__":
    raise SystemExit(main())
