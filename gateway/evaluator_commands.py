"""`satisfice evaluator bank`: sample an engine k times per labelled question, with token
logprobs, into a runs file (the trace bank stopping policies are replayed over).

`satisfice evaluator fit`: fit the calibrator that turns signals into P(correct), on
labelled runs, and say how well it does on runs it did not see."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any, BinaryIO

import msgspec
import numpy as np

from engines import create_engine
from engines.base import Generation, Message, SamplingParams
from evaluator.answers import LabelledQuestion, read_questions
from evaluator.calibration import (
    ISOTONIC_MIN_LABELS,
    cross_validate,
    fit,
    measure,
    write_calibrator,
)
from evaluator.runs import Run, RunAlternative, RunSample, RunToken, read_runs
from evaluator.signals import DEFAULT_FEATURES, FEATURES, MissingSignal, SignalSettings
from evaluator.training import training_set
from gateway.config import load_config

# Signals that are probabilities as they stand: their held-out metrics, uncalibrated,
# are what the calibrator has to beat.
_RAW_PROBABILITIES = ("vote_share", "majority_probability")


def evaluator_bank(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    if args.engine not in config.engines:
        raise SystemExit(f"no engine {args.engine!r} in the config: {', '.join(config.engines)}")
    questions = read_questions(args.dataset)[: args.limit or None]
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        n=args.samples,
        seed=args.seed,
        logprobs=True,
        top_logprobs=args.top_logprobs,
    )
    models_dir = Path(config.models_dir).expanduser()
    engine = create_engine(args.engine, config.engines[args.engine], models_dir)
    encoder = msgspec.json.Encoder()

    async def run(out: BinaryIO) -> None:
        await engine.start()
        started, tokens = time.perf_counter(), 0
        try:
            for number, question in enumerate(questions, start=1):
                # Seeds of their own per question: with one seed list for all, sample i
                # would draw the same random numbers in every question.
                own = msgspec.structs.replace(params, seed=args.seed + (number - 1) * args.samples)
                generation = await engine.generate((Message("user", question.prompt),), own)
                tokens += generation.completion_tokens
                out.write(encoder.encode(_run(question, number, generation)) + b"\n")
                out.flush()
                if number % 10 == 0 or number == len(questions):
                    rate = tokens / (time.perf_counter() - started)
                    print(f"{number}/{len(questions)}, {rate:.1f} tokens/s", file=sys.stderr)
        finally:
            await engine.close()

    # Each run is written as soon as it is known: a long bank that stops keeps them.
    with Path(args.out).open("wb") as out:
        asyncio.run(run(out))
    print(f"wrote {args.out}: {len(questions)} runs of {args.samples} samples")
    return 0


def _run(question: LabelledQuestion, number: int, generation: Generation) -> Run:
    return Run(
        id=f"{question.source or 'question'}-{number}",
        kind=question.kind,
        answers=question.answers,
        prompt=question.prompt,
        source=question.source,
        samples=tuple(
            RunSample(
                text=sample.text,
                logprobs=tuple(
                    RunToken(
                        t.token, t.logprob, tuple(RunAlternative(a.token, a.logprob) for a in t.top)
                    )
                    for t in sample.logprobs
                ),
                completion_tokens=sample.completion_tokens,
            )
            for sample in generation.samples
        ),
    )


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
    readable = data.readable(features)
    if len(readable.signals) < len(data.signals):
        left_out = len(data.signals) - len(readable.signals)
        print(f"left out {left_out} rows whose samples lack a signal of {features}",
              file=sys.stderr)  # fmt: skip
    if not readable.signals:
        try:
            data.rows(features)
        except MissingSignal as exc:
            raise MissingSignal(f"{exc}; choose other signals with --features") from None
    data = readable
    rows = data.rows(features)
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
    evaluator = commands.add_parser("evaluator", help="build a trace bank; fit the calibrator")
    sub = evaluator.add_subparsers(dest="evaluator_command", required=True)

    bank = sub.add_parser("bank", help="sample an engine k times per question, with logprobs")
    bank.add_argument("--dataset", required=True, help="LabelledQuestion JSONL")
    bank.add_argument("--out", required=True, help="runs JSONL to write")
    bank.add_argument("--engine", default="large", help="an engine of the config")
    bank.add_argument("--samples", type=int, default=16, help="samples per question")
    bank.add_argument("--max-tokens", type=int, default=64)
    bank.add_argument("--temperature", type=float, default=0.7)
    bank.add_argument("--top-logprobs", type=int, default=5, help="alternatives per token")
    bank.add_argument("--seed", type=int, default=0)
    bank.add_argument("--limit", type=int, default=0, help="first N questions only")
    bank.add_argument("--config")
    bank.set_defaults(run=evaluator_bank)

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
