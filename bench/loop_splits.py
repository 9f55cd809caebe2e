"""The loop's whole recipe over many random splits of a trace bank: how much of one
held-out figure is the split.

Per split (by question, each source on its own, as bench/split_runs.py does): fit the
calibrator on the fitting half as `make default-calibrator` does, choose the loop's
threshold on that half as docs/benchmarks.md's rule says (the fewest tokens at fixed
k = N's accuracy, with fold calibrators), then replay the held-out half once with that
calibrator and threshold. What varies between splits is only which questions fall
where, so the spread of the held-out figures is what one split's figure can be
trusted to within.

    .venv/bin/python bench/loop_splits.py bench/out/bank_qwen_arc_challenge.jsonl \\
        bench/out/bank_qwen_gsm8k.jsonl --per-source 240 --splits 20 \\
        --json bench/out/loop_splits.json

--per-source N takes each source's first N questions, as `make default-calibrator`
splits them: the ARC-Challenge bank goes on past its first 240 (held out from
everything), so without it the splits would draw from all 1,172.

This re-reads the report half of every split, so it measures the recipe's noise; it
must not choose anything (settings are chosen on the fitting half of each split).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import msgspec
import numpy as np
from msgspec.structs import replace

from evaluator.calibration import (
    Calibrator,
    calibrated_eces,
    calibrator_file,
    expected_calibration_error,
    read_calibrator,
)
from evaluator.policy import LoopSettings
from evaluator.replay import NO_BUDGET, Policy, Question, branch_orders, fixed_plain, loop_rule
from evaluator.replay_report import (
    LOOP_THRESHOLDS,
    Point,
    cheapest_as_accurate,
    cross_fit,
    point,
)
from evaluator.runs import Run, read_runs, split_by_source, take_per_source
from evaluator.signals import DEFAULT_SETTINGS, FeatureName, majority
from evaluator.training import fit_calibrator

# As `make default-calibrator` fits the shipped calibrator: at these k, logistic only
# (isotonic needs more labels than that), on the shipped calibrator's signals.
KS = (1, 2, 4, 6, 8)
ISOTONIC_MIN = 100_000


class SourceCalibration(msgspec.Struct, frozen=True, kw_only=True):
    """One source's questions of a held-out half: ECE at the loop's stops, and the ECEs
    a perfectly calibrated P would show there (median, 95th percentile)."""

    ece_at_stops: float
    calibrated_median: float
    calibrated_p95: float


class SplitOutcome(msgspec.Struct, frozen=True, kw_only=True):
    seed: int
    threshold: float  # chosen on the fitting half
    fitting_ece_at_stops: float | None  # the chosen loop on the fitting half, fold calibrators
    reference_accuracy: float  # held out: fixed k = N plain majority
    reference_tokens: float
    loop_accuracy: float  # held out: the loop at the chosen threshold
    loop_tokens: float
    tokens_saved: float  # 1 - loop / reference tokens
    ece_at_stops: float | None
    # The ECE that a perfectly calibrated P would show at these stops: the median over
    # draws of labels from the P itself, one draw per question shared by its branch
    # orders (they mostly give the same answer): the measurement's noise floor.
    calibrated_floor: float
    by_source: dict[str, SourceCalibration]  # held out


def prepared(runs: Sequence[Run], samples: int, orders: int, seed: int) -> list[Question]:
    return [
        Question(index, shuffled, DEFAULT_SETTINGS, [])
        for index, run in enumerate(runs)
        for shuffled in branch_orders(run, samples, orders, seed + index)
    ]


def loop_policy(settings: LoopSettings, threshold: float) -> Policy:
    return loop_rule(replace(settings, threshold=threshold), settings.max_rounds)


def choose_threshold(fitting: Sequence[Question], settings: LoopSettings, samples: int) -> Point:
    """The fewest tokens among thresholds at least as accurate as fixed k = samples; the
    most accurate threshold when none is."""
    answers = [majority(q.answers) for q in fitting]
    fixed = point(fitting, fixed_plain(samples), f"k={samples}", samples, answers)
    points = [
        point(fitting, loop_policy(settings, t), f"t={t}", t, answers) for t in LOOP_THRESHOLDS
    ]
    cheapest = cheapest_as_accurate(points, fixed)
    if cheapest is None:
        return max(points, key=lambda p: (p.correct, -p.mean_tokens))
    return cheapest


def one_split(
    runs: Sequence[Run],
    seed: int,
    *,
    features: Sequence[FeatureName],
    share: float,
    branches: int,
    orders: int,
    folds: int,
) -> SplitOutcome:
    fitting_runs, held_runs = split_by_source(runs, share, seed)
    samples = min(len(r.samples) for r in runs)
    settings = LoopSettings(
        branches=branches, max_rounds=samples // branches, token_budget=NO_BUDGET
    )
    calibrator: Calibrator = fit_calibrator(
        fitting_runs, KS, features, isotonic_min=ISOTONIC_MIN, seed=seed
    ).model
    fitting = prepared(fitting_runs, samples, orders, seed)
    cross_fit(fitting, KS, folds, seed, features, ISOTONIC_MIN)
    chosen = choose_threshold(fitting, settings, samples)
    held = prepared(held_runs, samples, orders, seed)
    for q in held:
        q.calibrator = calibrator
    answers = [majority(q.answers) for q in held]
    fixed = point(held, fixed_plain(samples), f"k={samples}", samples, answers)
    stops = loop_policy(settings, chosen.value)
    loop = point(held, stops, chosen.setting, chosen.value, answers)
    outcomes = [stops(q) for q in held]
    probabilities = np.array([o.probability for o in outcomes])
    correct = np.array([o.correct for o in outcomes])
    questions = np.array([q.index for q in held])
    sources = np.array([q.run.source for q in held])
    by_source = {}
    for source in sorted(set(sources)):
        mine = sources == source
        floor = calibrated_eces(probabilities[mine], list(questions[mine]), seed)
        by_source[str(source)] = SourceCalibration(
            ece_at_stops=expected_calibration_error(probabilities[mine], correct[mine]),
            calibrated_median=float(np.median(floor)),
            calibrated_p95=float(np.percentile(floor, 95)),
        )
    return SplitOutcome(
        seed=seed,
        threshold=chosen.value,
        fitting_ece_at_stops=chosen.ece,
        reference_accuracy=fixed.accuracy,
        reference_tokens=fixed.mean_tokens,
        loop_accuracy=loop.accuracy,
        loop_tokens=loop.mean_tokens,
        tokens_saved=1.0 - loop.mean_tokens / fixed.mean_tokens,
        ece_at_stops=loop.ece,
        calibrated_floor=float(np.median(calibrated_eces(probabilities, list(questions), seed))),
        by_source=by_source,
    )


def _ece(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def summary(values: Sequence[float | None]) -> str:
    a = np.array([v for v in values if v is not None])
    if not a.size:  # ECE is undefined where every answer was right, or every one wrong
        return "-"
    q1, median, q3 = np.percentile(a, [25, 50, 75])
    return f"median {median:.3f}, quartiles {q1:.3f}-{q3:.3f}, range {a.min():.3f}-{a.max():.3f}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="trace bank files (JSONL of labelled runs)")
    parser.add_argument("--splits", type=int, default=20, help="random splits, one seed each")
    parser.add_argument("--first-seed", type=int, default=0, help="seed of the first split")
    parser.add_argument("--held-out-share", type=float, default=0.5)
    parser.add_argument("--branches", type=int, default=2, help="branches per round")
    parser.add_argument("--orders", type=int, default=8, help="branch orders per question")
    parser.add_argument("--folds", type=int, default=5, help="fold calibrators, fitting half")
    parser.add_argument("--per-source", type=int, help="each source's first N questions only")
    parser.add_argument("--json", help="write every split's outcome here")
    args = parser.parse_args(argv)
    if args.splits < 1:
        parser.error("--splits must be at least 1")
    if not 0 < args.held_out_share < 1:
        parser.error("--held-out-share must be between 0 and 1")
    if args.per_source is not None and args.per_source < 1:
        parser.error("--per-source must be at least 1")
    runs = [run for path in args.runs for run in read_runs(path).runs]
    if args.per_source is not None:
        runs = take_per_source(runs, args.per_source)
    # read_calibrator refuses a feature this Satisfice does not compute.
    features = cast(list[FeatureName], read_calibrator(calibrator_file("bundled")).features)
    outcomes = []
    print(
        "| split | threshold | fixed k=N | loop | tokens saved "
        "| ECE at stops (fit / held / calibrated P's) |"
    )
    print("|---|---|---|---|---|---|")
    for seed in range(args.first_seed, args.first_seed + args.splits):
        try:
            o = one_split(
                runs,
                seed,
                features=features,
                share=args.held_out_share,
                branches=args.branches,
                orders=args.orders,
                folds=args.folds,
            )
        except ValueError as exc:  # too few questions or samples for the folds or rounds
            raise SystemExit(f"error: {exc}") from exc
        outcomes.append(o)
        print(
            f"| {seed} | {o.threshold} | {o.reference_accuracy:.1%} @ {o.reference_tokens:.0f} "
            f"| {o.loop_accuracy:.1%} @ {o.loop_tokens:.0f} | {o.tokens_saved:.1%} "
            f"| {_ece(o.fitting_ece_at_stops)} / {_ece(o.ece_at_stops)} "
            f"/ {o.calibrated_floor:.3f} |",
            flush=True,
        )
        if args.json:
            Path(args.json).write_text(json.dumps(msgspec.to_builtins(outcomes), indent=1) + "\n")
    gap = [o.loop_accuracy - o.reference_accuracy for o in outcomes]
    print(f"held-out tokens saved: {summary([o.tokens_saved for o in outcomes])}")
    print(f"held-out accuracy, loop less fixed k=N: {summary(gap)}")
    print(f"held-out ECE at stops: {summary([o.ece_at_stops for o in outcomes])}")
    print(f"fitting-half ECE at stops: {summary([o.fitting_ece_at_stops for o in outcomes])}")
    print(f"a calibrated P's ECE there: {summary([o.calibrated_floor for o in outcomes])}")
    for source in sorted({name for o in outcomes for name in o.by_source}):
        mine = [o.by_source[source] for o in outcomes if source in o.by_source]
        above = sum(c.ece_at_stops > c.calibrated_p95 for c in mine)
        print(
            f"{source}, held out: ECE at stops {summary([c.ece_at_stops for c in mine])}; "
            f"a calibrated P's median {summary([c.calibrated_median for c in mine])}; "
            f"above its 95th percentile in {above} of {len(mine)} splits"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
