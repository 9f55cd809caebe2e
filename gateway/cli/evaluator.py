"""`satisfice eval collect`, `satisfice evaluator bank | fit`: a shell over
evaluator.collect, evaluator.bank and evaluator.training.

`eval collect` writes the router's outcome records; `evaluator bank` writes runs, the
trace bank stopping policies are replayed over; `evaluator fit` fits the calibrator
that turns signals into P(correct) on labelled runs, and says how well it does on runs
it did not see."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import BinaryIO

import msgspec

from engines import Engine, create_engine
from engines.base import SamplingParams
from engines.settings import LlamaCppSettings
from evaluator.answers import read_questions
from evaluator.bank import bank, banked_so_far
from evaluator.calibration import ISOTONIC_MIN_LABELS, write_calibrator
from evaluator.collect import collect
from evaluator.runs import read_runs
from evaluator.signals import DEFAULT_FEATURES, FEATURES, MissingSignal, SignalSettings
from evaluator.training import fit_calibrator
from gateway.config import GatewayConfig, load_config
from router.outcomes import Outcome


def _engine(config: GatewayConfig, name: str, *, batch: bool = False) -> Engine:
    if name not in config.engines:
        raise SystemExit(f"no engine {name!r} in the config: {', '.join(config.engines)}")
    settings = config.engines[name]
    if batch:
        if not isinstance(settings, LlamaCppSettings):
            raise SystemExit(f"--batch: engine {name!r} is not a llama_cpp engine")
        settings = msgspec.structs.replace(settings, batch_samples=True)
    return create_engine(name, settings, Path(config.models_dir).expanduser())


def eval_collect(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    questions = read_questions(args.dataset)[: args.limit or None]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    small, large = _engine(config, args.small), _engine(config, args.large)
    encoder = msgspec.json.Encoder()

    async def run(out: BinaryIO) -> None:
        await asyncio.gather(small.start(), large.start())
        try:
            number = 0
            async for graded in collect(small, large, questions, params):
                outcome = Outcome(
                    graded.prompt,
                    graded.small_correct,
                    graded.large_correct,
                    source=graded.source,
                    small_output=graded.small_output,
                    large_output=graded.large_output,
                )
                out.write(encoder.encode(outcome) + b"\n")
                number += 1
                if number % 50 == 0 or number == len(questions):
                    print(f"{number}/{len(questions)}", file=sys.stderr)
        finally:
            await asyncio.gather(small.close(), large.close())

    # Each outcome is written as soon as it is known: a long run that stops keeps them.
    with Path(args.out).open("wb") as out:
        asyncio.run(run(out))
    print(f"wrote {args.out}: {len(questions)} outcomes")
    return 0


def evaluator_bank(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    engine = _engine(config, args.engine, batch=args.batch)
    questions = read_questions(args.dataset)[: args.limit or None]
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        n=args.samples,
        seed=args.seed,
        logprobs=True,
        top_logprobs=args.top_logprobs,
    )
    encoder = msgspec.json.Encoder()
    out_path = Path(args.out)
    done = 0
    if args.resume:
        try:
            done = banked_so_far(out_path, questions)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if done:
            print(
                f"{out_path} holds {done} runs; banking from question {done + 1}", file=sys.stderr
            )

    async def run(out: BinaryIO) -> None:
        await engine.start()
        started, tokens, number = time.perf_counter(), 0, done
        try:
            async for banked in bank(engine, questions[done:], params, first=done + 1):
                out.write(encoder.encode(banked) + b"\n")
                out.flush()
                number += 1
                tokens += sum(s.completion_tokens or 0 for s in banked.samples)
                if number % 10 == 0 or number == len(questions):
                    rate = tokens / (time.perf_counter() - started)
                    print(f"{number}/{len(questions)}, {rate:.1f} tokens/s", file=sys.stderr)
        finally:
            await engine.close()

    # Each run is written as soon as it is known: a long bank that stops keeps them,
    # and --resume goes on from them.
    with out_path.open("ab" if args.resume else "wb") as out:
        asyncio.run(run(out))
    print(f"wrote {args.out}: {len(questions)} runs of {args.samples} samples")
    return 0


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
    features = list(args.features)
    try:
        fitted = fit_calibrator(
            loaded.runs,
            args.k,
            features,
            settings,
            folds=args.folds,
            seed=args.seed,
            isotonic_min=args.isotonic_min,
            trained_on=f"{Path(args.runs).name} ({len(loaded.runs)} runs, k={args.k})",
        )
    except MissingSignal as exc:
        raise MissingSignal(f"{exc}; choose other signals with --features") from None
    for k, count in fitted.short.items():
        if count:
            print(f"left out {count} runs with fewer than {k} samples at k={k}", file=sys.stderr)
    if fitted.unreadable:
        print(f"left out {fitted.unreadable} rows whose samples lack a signal of {features}",
              file=sys.stderr)  # fmt: skip
    write_calibrator(fitted.model, args.out)
    report = {
        "runs": len(loaded.runs),
        "rows": fitted.rows,
        "k": args.k,
        "features": features,
        "folds": args.folds,
        "isotonic": bool(fitted.model.isotonic_x),
        "held_out": msgspec.to_builtins(fitted.held_out),
        "uncalibrated": msgspec.to_builtins(fitted.uncalibrated),
        "out": str(args.out),
    }
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key}: {value}")
    return 0


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    evaluation = commands.add_parser("eval", help="measure the configured engines")
    eval_sub = evaluation.add_subparsers(dest="eval_command", required=True)
    collected = eval_sub.add_parser("collect", help="run both engines on a dataset, write outcomes")
    collected.add_argument("--dataset", required=True, help="JSONL of labelled questions")
    collected.add_argument("--out", required=True)
    collected.add_argument("--config")
    collected.add_argument("--small", default="small")
    collected.add_argument("--large", default="large")
    collected.add_argument("--max-tokens", type=int, default=48)
    collected.add_argument("--limit", type=int, default=0)
    collected.set_defaults(run=eval_collect)

    evaluator = commands.add_parser("evaluator", help="build a trace bank; fit the calibrator")
    sub = evaluator.add_subparsers(dest="evaluator_command", required=True)

    banked = sub.add_parser("bank", help="sample an engine k times per question, with logprobs")
    banked.add_argument("--dataset", required=True, help="LabelledQuestion JSONL")
    banked.add_argument("--out", required=True, help="runs JSONL to write")
    banked.add_argument("--engine", default="large", help="an engine of the config")
    banked.add_argument("--samples", type=int, default=16, help="samples per question")
    banked.add_argument("--max-tokens", type=int, default=64)
    banked.add_argument("--temperature", type=float, default=0.7)
    banked.add_argument("--top-logprobs", type=int, default=5, help="alternatives per token")
    banked.add_argument("--seed", type=int, default=0)
    banked.add_argument("--limit", type=int, default=0, help="first N questions only")
    banked.add_argument(
        "--batch", action="store_true", help="a question's samples as one llama.cpp batch"
    )
    banked.add_argument(
        "--resume",
        action="store_true",
        help="keep the runs already in --out (checked against the dataset) and bank the rest",
    )
    banked.add_argument("--config")
    banked.set_defaults(run=evaluator_bank)

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
