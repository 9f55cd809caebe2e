"""Whether learning from the shadow checks pays: a router, the loop's calibrator and the
verifier's calibration refitted from checks drawn on a stream's first part
(gateway.checks.refit, as the gateway refits them), against the shipped ones on the
stream's later part, graded against gold answers.

The stream is bench/shadow_stream.py's (held-out ARC-Challenge and GSM8K questions
with the small engine's greedy answer and the loop replayed on the trace bank; held-out
QQP and PAWS pairs through the shipped verifier). Per seed, the questions are put in a
random order (and each on one of its replayed branch orders); the first ``--first-share``
of them is the traffic the checks are drawn from, at ``--share`` per shortcut as
ShadowChecks draws them; the rest is the later traffic everything is graded on.

- Router: small_route and large_route checks (agreement of the small engine's answer
  with the loop's) refit the router (refit.router_outcomes, refit.refit_router: kNN
  over the shipped examples and the first N checked, threshold from the checks' own
  cross-validated scores). Graded on the later questions with gold answers: small =
  the small engine's greedy answer right, large = the loop right (the mean over the 8
  replayed branch orders): APGR (router.metrics), accuracy and large share at each
  router's own threshold, and the refitted router's accuracy at the shipped router's
  large share. For reference, the same refit on gold labels of the same N questions
  (which live traffic does not have).
- Calibrator: the early_stop checks (the loop's P at its stop, and whether running on
  to the budget kept the answer) recalibrate the bundled calibrator
  (refit.calibrator_labels, refit.recalibrate); the loop is replayed on the later
  questions routed to it with each calibrator: ECE (10 bins) of P at the stops against
  agreement with the budget answer (early stops) and against gold (every stop), the
  loop's accuracy and mean tokens.
- Verifier: the semantic_hit checks of the first part of the pairs (at
  ``--verifier-share``; QQP's and PAWS's apart and together) give, through
  refit.verifier_labels and refit.verifier_calibration, the operating point for each of
  ``--bounds`` (cache.calibration.OperatingPoints), beside the shipped calibration's; on
  the later pairs, the share of the semantic hits each serves that are wrong (pairs not
  labelled duplicates) and the hit rate it keeps. "Off" where no operating point shows
  the bound: semantic hits are turned off.

    .venv/bin/python bench/shadow_learning.py [--seeds 40] [--share 0.5] [--first-share 0.7]
        [--n 25 50 100 200 350] [--verifier-share 1.0] [--bounds 0.02 0.05 0.1]
        [--json bench/out/shadow_learning.json] [--plot docs/img/shadow_learning.png]
        [--rebuild]

The intervals over seeds are over random orders of one pool of questions: they say how
much the figures move with which questions come first, not what another pool would show.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from cache.calibration import NEVER, OperatingPoints, read_calibration
from evaluator.agreement import compare
from evaluator.calibration import (
    Calibrator,
    calibrator_file,
    expected_calibration_error,
    read_calibrator,
)
from evaluator.policy import LoopSettings
from evaluator.runs import Run
from gateway.checks import refit
from gateway.checks.estimates import wilson
from gateway.checks.record import CheckRecord
from gateway.config import load_config
from router.metrics import evaluate
from router.model_file import RouterModel, read_router
from router.outcomes import Outcome
from router.router import router_file
from router.scorers import scorer_for
from router.settings import RouterSettings

sys.path.insert(0, str(Path(__file__).resolve().parent))
import shadow_stream  # a bench helper beside this script
from shadow_stream import Entry, Stream, entries, record_of

Floats = npt.NDArray[np.float64]
ROUTING = ("small_route", "large_route")
# The verifier is calibrated on each kind of pair's checks apart, and on both together.
VERIFIER_SOURCES = ("all", "qqp", "paws")


# --- the stream, split -----------------------------------------------------------------


class Split:
    """One seed's order of the stream: the first part's questions and pairs (the traffic
    checks are drawn from) and the later part's (graded)."""

    def __init__(self, stream: Stream, seed: int, first_share: float) -> None:
        rng = np.random.default_rng(seed)
        order = rng.permutation(len(stream.questions))
        cut = round(first_share * len(order))
        self.first, self.later = order[:cut].tolist(), order[cut:].tolist()
        self.orders = rng.integers(0, shadow_stream.ORDERS, size=len(order)).tolist()
        pairs = rng.permutation(len(stream.pairs))
        pair_cut = round(first_share * len(pairs))
        self.first_pairs, self.later_pairs = pairs[:pair_cut].tolist(), pairs[pair_cut:].tolist()
        self.rng = rng

    def first_entries(self, stream: Stream) -> list[Entry]:
        return entries([("q", i, self.orders[i]) for i in self.first], stream)


def drawn(found: Sequence[Entry], share: float, rng: np.random.Generator) -> list[CheckRecord]:
    """The checks ShadowChecks would draw from ``found`` at ``share``, each as checked."""
    return [record_of(e, share) for e in found if rng.random() < share]


# --- the router ------------------------------------------------------------------------


def routing_figures(
    scores: Floats, threshold: float, small: Floats, large: Floats, at_share: float | None
) -> dict[str, float]:
    """APGR over the later questions, and the routed mix at ``threshold``; with
    ``at_share``, also the accuracy when the top ``at_share`` of scores go large."""
    report = evaluate(scores, small, large)
    routed = scores >= threshold
    out = {
        "apgr": report.apgr,
        "cpt80": report.cpt80,
        "roc_auc": report.roc_auc,
        "large_share": float(routed.mean()),
        "accuracy": float(np.where(routed, large, small).mean()),
    }
    if at_share is not None:
        count = round(at_share * len(scores))
        top = np.zeros(len(scores), dtype=bool)
        top[np.argsort(-scores, kind="stable")[:count]] = True
        out["accuracy_at_shipped_share"] = float(np.where(top, large, small).mean())
    return out


def router_round(
    stream: Stream,
    vectors: npt.NDArray[np.float32],
    base: RouterModel,
    split: Split,
    share: float,
    sizes: Sequence[int],
) -> dict[str, Any]:
    """One seed: the shipped router and routers refitted on the first N checks."""
    found = [e for e in split.first_entries(stream) if e.shortcut in ROUTING]
    records = drawn(found, share, split.rng)
    later = split.later
    prompts = [stream.questions[i].prompt for i in later]
    small = np.array([stream.questions[i].small_correct for i in later], dtype=np.float64)
    large = np.array(
        [np.mean([o.correct for o in stream.questions[i].loop]) for i in later], dtype=np.float64
    )
    later_vectors = vectors[later]
    shipped_scores = scorer_for(base).score(later_vectors, prompts)
    shipped = routing_figures(shipped_scores, base.threshold, small, large, None)
    out: dict[str, Any] = {"shipped": shipped, "refit": {}, "gold_refit": {}, "checks": 0}
    decided = [r for r in records if r.agree is not None]
    out["checks"] = len(decided)
    index_of = {e.prompt: e.index for e in found}
    for n in sizes:
        if n > len(decided):
            continue
        first = decided[:n]
        outcomes = refit.router_outcomes(first)
        rows = [index_of[o.prompt] for o in outcomes]
        model = refit.refit_router(base, outcomes, vectors[rows], embedding=base.embedding,
                                   trained_on=f"{n} checks")  # fmt: skip
        scores = scorer_for(model).score(later_vectors, prompts)
        out["refit"][n] = routing_figures(
            scores, model.threshold, small, large, shipped["large_share"]
        )
        gold = [
            Outcome(
                prompt=stream.questions[i].prompt,
                small_correct=stream.questions[i].small_correct,
                large_correct=float(np.mean([o.correct for o in stream.questions[i].loop])),
            )
            for i in rows
        ]
        gold_model = refit.refit_router(base, gold, vectors[rows], embedding=base.embedding,
                                        trained_on=f"{n} gold")  # fmt: skip
        gold_scores = scorer_for(gold_model).score(later_vectors, prompts)
        out["gold_refit"][n] = routing_figures(
            gold_scores, gold_model.threshold, small, large, shipped["large_share"]
        )
    return out


# --- the calibrator --------------------------------------------------------------------


def loop_figures(
    stream: Stream,
    questions: Sequence[int],
    settings: LoopSettings,
    calibrator: Calibrator | None,
    runs: dict[str, Run],
) -> dict[str, float]:
    """The loop on ``questions``, each in all its branch orders, with ``calibrator``
    (None: the shipped one, whose replays the stream keeps)."""
    p_all, gold, p_early, agree, tokens = [], [], [], [], []
    for i in questions:
        item = stream.questions[i]
        outcomes = item.loop
        if calibrator is not None:
            # Seeded by the question's place in the stream, as the stream's replays were.
            outcomes = shadow_stream.replay_orders(runs[item.id], i, settings, calibrator)
        for order, outcome in enumerate(outcomes):
            p_all.append(outcome.probability)
            gold.append(outcome.correct)
            tokens.append(outcome.tokens)
            if outcome.stop in shadow_stream.EARLY:
                label = compare(item.prompt, outcome.text, item.budget[order].text).agree
                if label is not None:
                    p_early.append(outcome.probability)
                    agree.append(label)
    return {
        "stops": len(p_all),
        "early_stops": len(p_early),
        "ece_gold": expected_calibration_error(p_all, gold),
        "ece_agreement": expected_calibration_error(p_early, agree) if p_early else float("nan"),
        "mean_p": float(np.mean(p_all)),
        "accuracy": float(np.mean(gold)),
        "agreement": float(np.mean(agree)) if agree else float("nan"),
        "mean_tokens": float(np.mean(tokens)),
    }


def calibrator_round(
    stream: Stream,
    base: Calibrator,
    settings: LoopSettings,
    runs: dict[str, Run],
    split: Split,
    share: float,
) -> dict[str, Any]:
    found = [e for e in split.first_entries(stream) if e.shortcut == "early_stop"]
    records = drawn(found, share, split.rng)
    confidences, labels = refit.calibrator_labels(records, agreement=True)
    later = [i for i in split.later if stream.questions[i].route == "loop"]
    out: dict[str, Any] = {"checks": len(labels), "later_questions": len(later)}
    if len(labels) < refit.MIN_CALIBRATOR_LABELS:
        return out
    new = refit.recalibrate(base, confidences, labels, trained_on=f"{len(labels)} checks")
    out["shipped"] = loop_figures(stream, later, settings, None, runs)
    out["recalibrated"] = loop_figures(stream, later, settings, new, runs)
    return out


# --- the verifier ----------------------------------------------------------------------


def hits_at(stream: Stream, pairs: Sequence[int], threshold: float) -> dict[str, Any]:
    lookups = len(pairs)
    served = [stream.pairs[i] for i in pairs if threshold <= stream.pairs[i].score < np.inf]
    wrong = sum(not p.duplicate for p in served)
    share = wrong / len(served) if served else 0.0
    low, high = wilson(share, len(served)) if served else (0.0, 1.0)
    return {
        "operating_point": threshold,
        "lookups": lookups,
        "hits": len(served),
        "hit_rate": len(served) / lookups if lookups else 0.0,
        "wrong": wrong,
        "wrong_share": share,
        "wrong_95ci": [low, high],
    }


def verifier_round(
    stream: Stream, split: Split, share: float, bounds: Sequence[float], source: str
) -> dict[str, Any]:
    """The semantic-hit checks of the first part's pairs (of ``source``, or "all") as a
    calibration; per bound, the operating point it and the shipped calibration give, on
    the later pairs of the same source."""
    shipped_calibration = read_calibration()

    def of_source(pairs: Sequence[int]) -> list[int]:
        return [i for i in pairs if source in ("all", stream.pairs[i].source)]

    requests: list[shadow_stream.Request] = [("p", i, 0) for i in of_source(split.first_pairs)]
    found = [e for e in entries(requests, stream) if e.shortcut == "semantic_hit"]
    records = drawn(found, share, split.rng)
    scores, wrong = refit.verifier_labels(records)
    calibration = refit.verifier_calibration(shipped_calibration, scores, wrong,
                                             pairs="the stream's first part")  # fmt: skip
    later = of_source(split.later_pairs)
    out: dict[str, Any] = {
        "checks": len(scores),
        "checked_wrong_share": float(np.mean(wrong)) if wrong else float("nan"),
        "shipped_default": hits_at(stream, later, stream.operating_point),
        "bounds": {},
    }
    for bound in bounds:
        point = OperatingPoints(calibration).threshold(bound)
        shipped_point = OperatingPoints(shipped_calibration).threshold(bound)
        out["bounds"][str(bound)] = {
            "shipped": hits_at(stream, later, shipped_point),
            "refit": hits_at(stream, later, point),
        }
    return out


def summarise_verifier(rounds: Sequence[dict[str, Any]], bounds: Sequence[float]) -> dict[str, Any]:
    fields = ("operating_point", "hit_rate", "wrong_share", "hits")
    out: dict[str, Any] = {
        "seeds": len(rounds),
        "checks": mean_ci([r["checks"] for r in rounds]),
        "checked_wrong_share": mean_ci([r["checked_wrong_share"] for r in rounds]),
        "shipped_default": {f: mean_ci([r["shipped_default"][f] for r in rounds]) for f in fields},
        "bounds": {},
    }
    for bound in bounds:
        row: dict[str, Any] = {}
        for name in ("shipped", "refit"):
            at = [r["bounds"][str(bound)][name] for r in rounds]
            on = [x for x in at if x["operating_point"] != NEVER]
            row[name] = {
                "seeds_off": len(at) - len(on),  # no operating point shows the bound
                "seeds_within_bound": sum(x["wrong_share"] <= bound for x in on),
                **{f: mean_ci([x[f] for x in on]) for f in fields},
            }
        out["bounds"][str(bound)] = row
    return out


# --- over seeds ------------------------------------------------------------------------


def mean_ci(values: Sequence[float]) -> dict[str, float]:
    """Mean over seeds and a t-interval of it (normal beyond 30 seeds)."""
    clean = [v for v in values if v == v]
    if not clean:
        return {"mean": float("nan"), "low": float("nan"), "high": float("nan"), "seeds": 0}
    mean = statistics.fmean(clean)
    if len(clean) < 2:
        return {"mean": mean, "low": mean, "high": mean, "seeds": 1}
    from scipy.stats import t

    half = float(t.ppf(0.975, len(clean) - 1)) * statistics.stdev(clean) / len(clean) ** 0.5
    return {"mean": mean, "low": mean - half, "high": mean + half, "seeds": len(clean)}


def summarise_router(rounds: Sequence[dict[str, Any]], sizes: Sequence[int]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "checks_per_seed": mean_ci([r["checks"] for r in rounds]),
        "shipped": {
            key: mean_ci([r["shipped"][key] for r in rounds])
            for key in ("apgr", "cpt80", "roc_auc", "large_share", "accuracy")
        },
        "curve": {},
    }
    for n in sizes:
        have = [r for r in rounds if n in r["refit"]]
        if not have:
            continue
        row: dict[str, Any] = {"seeds": len(have)}
        for name in ("refit", "gold_refit"):
            row[name] = {
                key: mean_ci([r[name][n][key] for r in have])
                for key in (
                    "apgr",
                    "roc_auc",
                    "large_share",
                    "accuracy",
                    "accuracy_at_shipped_share",
                )
            }
            row[name]["apgr_gain"] = mean_ci(
                [r[name][n]["apgr"] - r["shipped"]["apgr"] for r in have]
            )
            row[name]["accuracy_gain_at_shipped_share"] = mean_ci(
                [r[name][n]["accuracy_at_shipped_share"] - r["shipped"]["accuracy"] for r in have]
            )
            row[name]["seeds_better_apgr"] = sum(
                r[name][n]["apgr"] > r["shipped"]["apgr"] for r in have
            )
        out["curve"][str(n)] = row
    return out


def summarise(rounds: Sequence[dict[str, Any]], keys: Sequence[str]) -> dict[str, Any]:
    have = [r for r in rounds if keys[0] in r]
    if not have:
        return {"seeds": 0}
    out: dict[str, Any] = {"seeds": len(have)}
    for key in keys:
        fields = [f for f, v in have[0][key].items() if isinstance(v, int | float)]
        out[key] = {f: mean_ci([r[key][f] for r in have]) for f in fields}
    return out


def plot(figures: dict[str, Any], path: Path) -> None:
    """The learning curve: each refit's gain over the shipped router on the same later
    traffic (paired per seed), against the checks it learned from."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    router = figures["router"]
    sizes = [int(n) for n in router["curve"]]
    figure, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    for ax, key, label in (
        (axes[0], "apgr_gain", "APGR on later traffic, less the shipped router's"),
        (
            axes[1],
            "accuracy_gain_at_shipped_share",
            "accuracy (points) at the shipped router's large share, less its accuracy",
        ),
    ):
        scale = 100.0 if key.startswith("accuracy") else 1.0
        ax.axhline(0.0, color="grey", label="shipped router")
        for name, colour, text in (
            ("refit", "C0", "refitted on agreement checks"),
            ("gold_refit", "C1", "refitted on gold labels (not available live)"),
        ):
            rows = [router["curve"][str(n)][name][key] for n in sizes]
            ax.plot(sizes, [scale * r["mean"] for r in rows], "o-", color=colour, label=text)
            ax.fill_between(sizes, [scale * r["low"] for r in rows],
                            [scale * r["high"] for r in rows], color=colour, alpha=0.2)  # fmt: skip
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.set_xlabel("checked routing requests the refit learned from")
        ax.set_title(label, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    s = router["shipped"]
    figure.suptitle(
        f"Router refitted from shadow checks: {router['seeds']} seeds, bands 95% CI of the "
        f"mean gain (shipped: APGR {s['apgr']['mean']:.3f}, {s['large_share']['mean']:.0%} "
        f"large, accuracy {s['accuracy']['mean']:.1%})",
        fontsize=9,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def render(figures: dict[str, Any]) -> str:
    def ci(x: dict[str, float], fmt: str = ".3f") -> str:
        return f"{x['mean']:{fmt}} ({x['low']:{fmt}} to {x['high']:{fmt}})"

    router = figures["router"]
    lines = [f"stream: {figures['stream']}", "", "router (later traffic, gold):"]
    s = router["shipped"]
    lines.append(
        f"  shipped: APGR {ci(s['apgr'])}, ROC AUC {ci(s['roc_auc'])}, "
        f"large {ci(s['large_share'], '.1%')}, "
        f"accuracy {ci(s['accuracy'], '.1%')}"
    )
    for n, row in router["curve"].items():
        for name in ("refit", "gold_refit"):
            r = row[name]
            lines.append(
                f"  N={n:>4} {name:10} APGR {ci(r['apgr'])} gain {ci(r['apgr_gain'])} "
                f"ROC AUC {r['roc_auc']['mean']:.3f} "
                f"better in {r['seeds_better_apgr']}/{row['seeds']}; own threshold: large "
                f"{r['large_share']['mean']:.1%}, accuracy {r['accuracy']['mean']:.1%}; at "
                f"shipped share: accuracy {ci(r['accuracy_at_shipped_share'], '.1%')}"
            )
    lines += ["", "calibrator (later loop traffic, every branch order):"]
    cal = figures["calibrator"]
    for name in ("shipped", "recalibrated"):
        if name in cal:
            c = cal[name]
            lines.append(
                f"  {name:12} ECE gold {ci(c['ece_gold'])}, ECE agreement "
                f"{ci(c['ece_agreement'])}, accuracy {ci(c['accuracy'], '.1%')}, tokens "
                f"{ci(c['mean_tokens'], '.1f')}, early stops {c['early_stops']['mean']:.0f}"
            )
    for source, ver in figures["verifier"].items():
        d = ver["shipped_default"]
        lines += [
            "",
            f"verifier, {source} pairs (later part; {ver['checks']['mean']:.0f} checked hits "
            f"per seed, {ver['checked_wrong_share']['mean']:.1%} of them wrong):",
            f"  shipped default (bound {figures['default_bound']:.0%}): point "
            f"{d['operating_point']['mean']:.3f}, hit rate {ci(d['hit_rate'], '.1%')}, "
            f"wrong {ci(d['wrong_share'], '.2%')}",
        ]
        for bound, row in ver["bounds"].items():
            for name in ("shipped", "refit"):
                r = row[name]
                on = ver["seeds"] - r["seeds_off"]
                text = (
                    "off: no operating point shows the bound"
                    if not on
                    else f"point {r['operating_point']['mean']:.3f}, hit rate "
                    f"{ci(r['hit_rate'], '.1%')}, wrong {ci(r['wrong_share'], '.2%')}, within "
                    f"the bound in {r['seeds_within_bound']}/{on}"
                )
                lines.append(
                    f"  bound {float(bound):.0%} {name:8} {text} (off in {r['seeds_off']})"
                )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=40)
    parser.add_argument("--share", type=float, default=0.5, help="share of shortcuts checked")
    parser.add_argument("--first-share", type=float, default=0.7)
    parser.add_argument("--n", type=int, nargs="+", default=[25, 50, 100, 200, 350])
    parser.add_argument("--verifier-share", type=float, default=1.0)
    parser.add_argument("--bounds", type=float, nargs="+", default=[0.02, 0.05, 0.1])
    parser.add_argument("--data", type=Path, default=shadow_stream.DATA)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    parser.add_argument(
        "--stream-as-built",
        action="store_true",
        help="the stream kept in bench/out, even if the banks have grown since",
    )
    parser.add_argument("--rebuild", action="store_true")
    args = parser.parse_args(argv)
    stream, vectors = shadow_stream.load(
        rebuild=args.rebuild, as_built=args.stream_as_built, data=args.data
    )
    base_router = read_router(router_file(RouterSettings()))
    base_calibrator = read_calibrator(calibrator_file("bundled"))
    loop = load_config().loop
    assert loop is not None, "the default config has a loop"
    settings = loop.sampling()  # what the stream replays (bench/shadow_stream.py)
    runs = {r.id: r for source in shadow_stream.SOURCES for r in shadow_stream.bank_runs(source)}
    started = time.perf_counter()
    routers, calibrators = [], []
    verifiers: dict[str, list[dict[str, Any]]] = {source: [] for source in VERIFIER_SOURCES}
    for seed in range(args.seeds):
        split = Split(stream, seed, args.first_share)
        routers.append(router_round(stream, vectors, base_router, split, args.share, args.n))
        calibrators.append(
            calibrator_round(stream, base_calibrator, settings, runs, split, args.share)
        )
        for source, rounds in verifiers.items():
            if stream.pairs:
                rounds.append(
                    verifier_round(stream, split, args.verifier_share, args.bounds, source)
                )
        print(f"seed {seed + 1}/{args.seeds}", file=sys.stderr, flush=True)
    figures = {
        "stream": {
            "questions": len(stream.questions),
            "routed_loop": sum(q.route == "loop" for q in stream.questions),
            "pairs": len(stream.pairs),
        },
        "share": args.share,
        "first_share": args.first_share,
        "bounds": args.bounds,
        "default_bound": stream.max_false_hit_rate,
        "router": {"seeds": args.seeds, **summarise_router(routers, args.n)},
        "calibrator": summarise(calibrators, ["shipped", "recalibrated"])
        | {"checks": mean_ci([c["checks"] for c in calibrators])},
        "verifier": {
            source: summarise_verifier(rounds, args.bounds)
            for source, rounds in verifiers.items()
            if rounds
        },
    }
    print(render(figures))
    print(f"{args.seeds} seeds in {time.perf_counter() - started:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1, default=float))
    if args.plot:
        plot(figures, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
