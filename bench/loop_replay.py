"""Stopping policies for the reasoning loop, replayed over a trace bank.

Every policy of evaluator.replay_report (fixed-k votes, Adaptive-Consistency's Beta
stopping, ESC, each signal alone, the loop's own rule with and without DeepConf's
filter, and two proposed stops) is swept over the bank's questions; the tables go to
stdout, the report to ``--out-json`` and accuracy against tokens to ``--plot``.

    .venv/bin/python bench/loop_replay.py --runs bench/out/bank.jsonl \\
        --out-json bench/out/loop_replay.json --plot docs/img/loop_replay.png

P(correct) is held out: each question's comes from a calibrator fitted on the other
``--folds`` folds of questions only (on ``--features``, with ``--isotonic-min``, as
``satisfice evaluator fit`` takes them), unless ``--calibrator`` names a file to use
for all of them. Samples are replayed in ``--orders`` seeded random orders per question.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from evaluator.calibration import ISOTONIC_MIN_LABELS, read_calibrator
from evaluator.policy import LoopSettings
from evaluator.replay import DEFAULT_ORDERS
from evaluator.replay_report import DEFAULT_KS, finite, plot, render, replay_bank
from evaluator.runs import read_runs
from evaluator.signals import DEFAULT_FEATURES, FEATURES


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", required=True, help="trace bank: JSONL of labelled runs")
    parser.add_argument(
        "--calibrator",
        help="use this calibrator file for every question (default: cross-fit one per fold)",
    )
    parser.add_argument("--folds", type=int, default=5, help="cross-fitting folds, by question")
    parser.add_argument(
        "--k",
        type=int,
        nargs="+",
        default=list(DEFAULT_KS),
        help="k the fold calibrators are fitted at (default: %(default)s)",
    )
    parser.add_argument(
        "--features",
        nargs="+",
        choices=FEATURES,
        default=list(DEFAULT_FEATURES),
        metavar="SIGNAL",
        help="signals the fold calibrators use (default: all but probe_streak)",
    )
    parser.add_argument(
        "--isotonic-min",
        type=int,
        default=ISOTONIC_MIN_LABELS,
        help="labels a fold calibrator needs before isotonic regression goes on top "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--branches", type=int, default=LoopSettings().branches, help="branches per round"
    )
    parser.add_argument(
        "--max-rounds",
        type=int,
        help="rounds a stopping rule may take (default: as many as the bank's samples hold)",
    )
    parser.add_argument(
        "--orders",
        type=int,
        default=DEFAULT_ORDERS,
        help="random branch orders per question, averaged; 0: the bank's own order "
        "(default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-json", help="write the report as JSON here")
    parser.add_argument("--plot", help="draw accuracy against tokens here (PNG)")
    args = parser.parse_args(argv)

    try:
        runs = read_runs(args.runs).runs
        calibrator = read_calibrator(args.calibrator) if args.calibrator else None
        report = replay_bank(
            runs,
            calibrator=calibrator,
            folds=args.folds,
            ks=args.k,
            seed=args.seed,
            branches=args.branches,
            orders=args.orders,
            max_rounds=args.max_rounds,
            features=args.features,
            isotonic_min=args.isotonic_min,
        )
    except ValueError as exc:  # a bad bank or calibrator, or too few samples or questions
        raise SystemExit(f"error: {exc}") from exc
    report = finite(report)
    print(render(report))
    if args.out_json:
        Path(args.out_json).write_text(json.dumps(report, indent=1) + "\n")
    if args.plot:
        plot(report, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
