"""How well the loop's P(correct) at its stops is calibrated, on held-out questions, read
against the ECE that a perfectly calibrated P would itself show there.

The embedded default's loop settings and calibrator (as `satisfice serve` runs them),
replayed over a trace bank's samples in several random branch orders per question.
Per source and pooled: accuracy and mean P at the stops, the ECE (10 bins), and the
ECEs a perfectly calibrated P would show there (evaluator.calibration.calibrated_eces:
labels drawn from the P itself, 1,000 draws): their median, and their 95th percentile,
above which an ECE says the P is miscalibrated rather than the sample small. --plot
draws the reliability diagram.

    .venv/bin/python bench/loop_ece.py bench/out/bank_qwen_rest.jsonl \\
        bench/out/bank_qwen_held.jsonl --plot docs/img/loop_ece_qwen.png
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import msgspec
import numpy as np
import numpy.typing as npt

from evaluator.calibration import (
    calibrated_eces,
    calibrator_file,
    expected_calibration_error,
    read_calibrator,
)
from evaluator.replay import DEFAULT_ORDERS, replay_loop
from evaluator.runs import read_runs
from gateway.config import load_config

BINS = 10
POOLED = "all"


class Calibration(msgspec.Struct, frozen=True, kw_only=True):
    """The loop's stops on one group of questions."""

    group: str
    questions: int
    accuracy: float
    mean_p: float
    ece: float
    # What a perfectly calibrated P would show at these stops, over draws of labels
    # from it: the median, and the 95th percentile that an ECE above it exceeds.
    calibrated_median: float
    calibrated_p95: float
    # Per bin of P with any stop: mean P, share right, stops.
    bins: list[tuple[float, float, int]]


def reliability(
    p: npt.NDArray[np.float64], y: npt.NDArray[np.bool_]
) -> list[tuple[float, float, int]]:
    which = np.minimum((p * BINS).astype(np.int64), BINS - 1)
    return [
        (float(p[which == b].mean()), float(y[which == b].mean()), int((which == b).sum()))
        for b in np.unique(which)
    ]


def calibration(
    group: str, p: npt.NDArray[np.float64], y: npt.NDArray[np.bool_],
    questions: npt.NDArray[np.int64], seed: int,
) -> Calibration:  # fmt: skip
    floor = calibrated_eces(p, list(questions), seed, draws=1000)
    return Calibration(
        group=group,
        questions=len(np.unique(questions)),
        accuracy=float(y.mean()),
        mean_p=float(p.mean()),
        ece=expected_calibration_error(p, y, BINS),
        calibrated_median=float(np.median(floor)),
        calibrated_p95=float(np.percentile(floor, 95)),
        bins=reliability(p, y),
    )


def plot(results: Sequence[Calibration], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 6))
    ax.plot([0, 1], [0, 1], color="grey", linewidth=0.8, linestyle="--", label="calibrated")
    for result in results:
        mean_p, right, stops = zip(*result.bins, strict=True)
        share = np.array(stops) / sum(stops)
        # A point's area is its share of the stops: a bin of a few stops says little.
        ax.scatter(mean_p, right, s=10 + 600 * share, alpha=0.7,
                   label=f"{result.group} ({result.questions} questions): ECE {result.ece:.3f}, "
                   f"calibrated P's {result.calibrated_median:.3f}")  # fmt: skip
    ax.set_xlabel("P(correct) at the loop's stop (bin mean)")
    ax.set_ylabel("share right")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_title("The loop's P at its stops, held out (area: share of the stops)", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="held-out trace bank files")
    parser.add_argument("--orders", type=int, default=DEFAULT_ORDERS)
    parser.add_argument("--seed", type=int, default=0, help="of the calibrated P's label draws")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--plot", help="write the reliability diagram here (PNG)")
    args = parser.parse_args(argv)
    if args.orders < 1:
        parser.error("--orders must be at least 1")
    runs = [run for path in args.runs for run in read_runs(path).runs]
    config = load_config()
    if config.loop is None:
        parser.error("the default config has no loop")
    # The sampling rounds: what the bank of samples replays (the default starts
    # with a greedy pass, bench/greedy_first.py).
    settings = config.loop.sampling()
    calibrator = read_calibrator(calibrator_file(settings.calibrator or "bundled"))
    try:
        outcomes = replay_loop(runs, settings, calibrator, args.orders)
    except ValueError as exc:
        parser.error(str(exc))
    p = np.array([o.probability for _, o in outcomes])
    y = np.array([o.correct for _, o in outcomes])
    # A question is its run (the same object in every order's outcome), not its id,
    # which two bank files could both use.
    index = {id(run): i for i, run in enumerate(runs)}
    questions = np.array([index[id(run)] for run, _ in outcomes])
    sources = np.array([run.source or "-" for run, _ in outcomes])
    groups = [*sorted(set(sources)), POOLED] if len(set(sources)) > 1 else [POOLED]
    results = []
    print(f"threshold {settings.threshold}, {settings.branches} branches, {args.orders} orders")
    print(
        "| questions | n | accuracy | mean P | ECE at the stops "
        "| a calibrated P's ECE: median, 95th percentile |"
    )
    print("|---|---|---|---|---|---|")
    for group in groups:
        chosen = np.ones(len(p), bool) if group == POOLED else sources == group
        r = calibration(str(group), p[chosen], y[chosen], questions[chosen], args.seed)
        results.append(r)
        print(
            f"| {r.group} | {r.questions} | {r.accuracy:.1%} | {r.mean_p:.3f} | {r.ece:.3f} "
            f"| {r.calibrated_median:.3f}, {r.calibrated_p95:.3f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(msgspec.to_builtins(results), indent=1) + "\n")
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
