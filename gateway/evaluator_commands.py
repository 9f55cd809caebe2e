"""`satisfice evaluator fit`: fit the calibrator that turns signals into P(correct), on
labelled runs, and say how well it does on runs it did not see."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from evaluator.calibration import (
    ISOTONIC_MIN_LABELS,
    cross_validate,
    fit,
    measure,
    training_set,
    write_calibrator,
)
from evaluator.runs import read_runs
from evaluator.signals import DEFAULT_FEATURES, FEATURES, MissingSignal, SignalSettings

# Signals that are probabilities as they stand: their held-out metrics, uncalibrated,
# are what the calibrator has to beat.
_RAW_PROBABILITIES = ("vote_share", "majority_probability")


def evaluator_fit(args: argparse.Namespace) -> int:
    try:
        return _fit(args)
    # Bad runs, a missing signal, bad settings and unfit data are all ValueErrors.
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _fit(args: argparse.Namespace) -> int:
    loaded = read_runs(args.runs, skip_bad=args.skip_bad)
    for problem in loaded.skipped:
        print(f"skipped {problem}", file=sys.stderr)
    # Through convert, so that the settings' bounds are checked as a config file's are.
    settings = msgspec.convert(
        {"group_window": args.group_window, "tail_tokens": args.tail_tokens, "top_k": args.top_k},
        SignalSettings,
    )
    data = training_set(loaded.runs, args.k, settings)
    for k, count in data.short.items():
        if count:
            print(f"left out {count} runs with fewer than {k} samples at k={k}", file=sys.stderr)
    if not data.signals:
        raise ValueError(f"no run has {min(args.k)} samples")
    features = list(args.features)
    try:
        rows = data.rows(features)
    except MissingSignal as exc:
        raise MissingSignal(f"{exc}; choose other signals with --features") from None
    labels = np.array(data.labels, dtype=np.float64)
    options: dict[str, Any] = {"signals": settings, "isotonic_min": args.isotonic_min}
    held_out = cross_validate(
        rows, labels, data.groups, features, folds=args.folds, seed=args.seed, **options
    )
    model = fit(
        rows,
        labels,
        features,
        seed=args.seed,
        trained_on=f"{Path(args.runs).name} ({len(loaded.runs)} runs, k={args.k})",
        **options,
    )
    write_calibrator(model, args.out)
    raw = {name: data.rows([name])[:, 0] for name in _RAW_PROBABILITIES}
    report = {
        "runs": len(loaded.runs),
        "rows": len(labels),
        "k": args.k,
        "features": features,
        "folds": args.folds,
        "isotonic": bool(model.isotonic_x),
        # Pooled over the folds, each row scored by a calibrator that never saw its run.
        "held_out": msgspec.to_builtins(measure(held_out, labels)),
        "uncalibrated": {
            name: msgspec.to_builtins(measure(values, labels)) for name, values in raw.items()
        },
        "out": str(args.out),
    }
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key}: {value}")
    return 0


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    evaluator = commands.add_parser("evaluator", help="fit the evaluator's calibrator")
    sub = evaluator.add_subparsers(dest="evaluator_command", required=True)

    fit_ = sub.add_parser(
        "fit",
        help="fit a calibrator on labelled runs; print held-out ECE, Brier and AUROC",
    )
    fit_.add_argument("--runs", required=True, help="JSONL of labelled runs (evaluator.runs)")
    fit_.add_argument("--out", required=True, help="calibrator file to write")
    fit_.add_argument(
        "--k",
        type=int,
        nargs="+",
        default=[5],
        metavar="K",
        help="score the majority of the first k samples of each run; several k give a "
        "row per run and k (default: 5)",
    )
    fit_.add_argument("--folds", type=int, default=5, help="cross-validation folds (default: 5)")
    fit_.add_argument(
        "--features",
        nargs="+",
        choices=FEATURES,
        default=list(DEFAULT_FEATURES),
        metavar="SIGNAL",
        help=f"signals to calibrate on, in order, of: {', '.join(FEATURES)} "
        "(default: all but probe_streak, which stored runs do not have)",
    )
    fit_.add_argument(
        "--isotonic-min",
        type=int,
        default=ISOTONIC_MIN_LABELS,
        help="labels needed before isotonic regression goes on top (default: %(default)s)",
    )
    defaults = SignalSettings()
    fit_.add_argument(
        "--group-window",
        type=int,
        default=defaults.group_window,
        help="tokens per sliding window of group confidence (default: %(default)s)",
    )
    fit_.add_argument(
        "--tail-tokens",
        type=int,
        default=defaults.tail_tokens,
        help="last tokens that make the tail confidence (default: %(default)s)",
    )
    fit_.add_argument(
        "--top-k",
        type=int,
        default=defaults.top_k,
        help="alternatives per token that token confidence averages (default: %(default)s)",
    )
    fit_.add_argument("--seed", type=int, default=0)
    fit_.add_argument("--skip-bad", action="store_true", help="skip malformed run lines")
    fit_.add_argument("--json", action="store_true")
    fit_.set_defaults(run=evaluator_fit)
