"""`satisfice router fit | calibrate | eval` and `satisfice eval collect`: the commands
SREs run on their own outcome data to build, tune and check a router."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

import msgspec
import numpy as np
import numpy.typing as npt

from engines import create_engine
from engines.base import Message, SamplingParams
from gateway.config import GatewayConfig, load_config
from router import calibrate
from router.embedder import Embedder, EmbedderSettings, Vectors
from router.model_file import read_router, write_router
from router.outcomes import Outcome, read_outcomes
from router.router import router_file
from router.scorers import Kind, fit, scorer_for
from router.settings import RouterSettings


def _router_settings(config: GatewayConfig) -> RouterSettings:
    return config.router if config.router is not None else RouterSettings()


def _embed(settings: EmbedderSettings, prompts: Sequence[str]) -> tuple[Vectors, str]:
    embedder = Embedder(settings)
    embedder.load()
    print(f"embedding {len(prompts)} prompts ...", file=sys.stderr)
    return embedder.encode(prompts), embedder.fingerprint


def _load_outcomes(path: str, skip_bad: bool) -> list[Outcome]:
    loaded = read_outcomes(path, skip_bad=skip_bad)
    for problem in loaded.skipped:
        print(f"skipped {problem}", file=sys.stderr)
    if loaded.skipped:
        print(f"skipped {len(loaded.skipped)} malformed lines", file=sys.stderr)
    return loaded.outcomes


def router_fit(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    outcomes = _load_outcomes(args.outcomes, args.skip_bad)
    vectors, fingerprint = _embed(config.embedder, [o.prompt for o in outcomes])
    model = fit(
        args.kind,
        outcomes,
        vectors,
        embedding=fingerprint,
        k=args.k,
        trained_on=f"{Path(args.outcomes).name} ({len(outcomes)} outcomes)",
    )
    # Default threshold: send the large model the share of prompts that needed it.
    needed = float(np.mean([o.large > o.small for o in outcomes]))
    scores = scorer_for(model).score(vectors, [o.prompt for o in outcomes])
    threshold = calibrate.for_large_fraction(scores, needed).threshold
    model = msgspec.structs.replace(model, threshold=threshold)
    write_router(model, args.out)
    print(f"wrote {args.out}: {args.kind}, {len(outcomes)} outcomes, threshold {threshold:.4f}")
    return 0


def _prompts(path: str) -> list[str]:
    """Prompts from JSONL lines with a "prompt" key (outcome and question files qualify)."""
    prompts = []
    for number, line in enumerate(Path(path).read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            prompts.append(msgspec.json.decode(line, type=_PromptLine).prompt)
        except msgspec.DecodeError as exc:
            raise SystemExit(f"{path}:{number}: {exc}") from exc
    return prompts


class _PromptLine(msgspec.Struct):
    prompt: str


def router_calibrate(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    settings = _router_settings(config)
    path = args.router or router_file(settings)
    embedder = Embedder(config.embedder)
    embedder.load()
    model = read_router(path, embedding=embedder.fingerprint)
    if args.target_quality is not None:
        if not args.outcomes:
            raise SystemExit("--target-quality needs --outcomes FILE to measure quality")
        outcomes = _load_outcomes(args.outcomes, args.skip_bad)
        prompts = [o.prompt for o in outcomes]
        scores = scorer_for(model).score(embedder.encode(prompts), prompts)
        result = calibrate.for_quality(scores, outcomes, args.target_quality)
    else:
        prompts = _prompts(args.prompts)
        scores = scorer_for(model).score(embedder.encode(prompts), prompts)
        result = calibrate.for_large_fraction(scores, args.large_fraction)
    print(json.dumps(msgspec.to_builtins(result)))
    return 0


def cross_validated_scores(
    kind: Kind, outcomes: Sequence[Outcome], vectors: Vectors, folds: int, seed: int, k: int
) -> npt.NDArray[np.float64]:
    """Each prompt scored by a router fitted on the other folds only."""
    order = np.random.default_rng(seed).permutation(len(outcomes))
    scores = np.zeros(len(outcomes))
    for held_out in np.array_split(order, folds):
        train = np.setdiff1d(order, held_out)
        model = fit(kind, [outcomes[i] for i in train], vectors[train], embedding="cv", k=k)
        prompts = [outcomes[i].prompt for i in held_out]
        scores[held_out] = scorer_for(model).score(vectors[held_out], prompts)
    return scores


def router_eval(args: argparse.Namespace) -> int:
    from router.metrics import RoutingReport, evaluate

    config = load_config(args.config)
    outcomes = _load_outcomes(args.outcomes, args.skip_bad)
    vectors, _ = _embed(config.embedder, [o.prompt for o in outcomes])
    small = np.array([o.small for o in outcomes])
    large = np.array([o.large for o in outcomes])
    reports: dict[str, RoutingReport] = {}
    summaries = []
    for kind in args.kind:
        scores = cross_validated_scores(kind, outcomes, vectors, args.folds, args.seed, args.k)
        report = reports[kind] = evaluate(scores, small, large)
        summaries.append(
            {"outcomes": len(outcomes), "kind": kind, "folds": args.folds}
            | {name: getattr(report, name) for name in _SUMMARY}
        )
    if args.plot:
        from router.plots import plot_quality_curve

        plot_quality_curve(reports, args.plot, title=Path(args.outcomes).name)
    for summary in summaries:
        print(
            json.dumps(summary) if args.json else "\n".join(f"{k}: {v}" for k, v in summary.items())
        )
    return 0


_SUMMARY = (
    "cpt50",
    "cpt80",
    "apgr",
    "auc",
    "roc_auc",
    "random_apgr",
    "small_accuracy",
    "large_accuracy",
)


def eval_collect(args: argparse.Namespace) -> int:
    from evaluator.answers import is_correct, read_questions

    config = load_config(args.config)
    questions = read_questions(args.dataset)[: args.limit or None]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)

    models_dir = Path(config.models_dir).expanduser()
    small = create_engine(args.small, config.engines[args.small], models_dir)
    large = create_engine(args.large, config.engines[args.large], models_dir)

    async def run(out: BinaryIO) -> None:
        await asyncio.gather(small.start(), large.start())
        try:
            for number, question in enumerate(questions, start=1):
                prompt = (Message("user", question.prompt),)
                answers = await asyncio.gather(
                    small.generate(prompt, params), large.generate(prompt, params)
                )
                line = {
                    "prompt": question.prompt,
                    "small_correct": is_correct(question, answers[0].text),
                    "large_correct": is_correct(question, answers[1].text),
                    "source": question.source,
                    "small_output": answers[0].text,
                    "large_output": answers[1].text,
                }
                out.write(msgspec.json.encode(line) + b"\n")
                if number % 50 == 0 or number == len(questions):
                    print(f"{number}/{len(questions)}", file=sys.stderr)
        finally:
            await asyncio.gather(small.close(), large.close())

    # Each outcome is written as soon as it is known: a long run that stops keeps them.
    with Path(args.out).open("wb") as out:
        asyncio.run(run(out))
    print(f"wrote {args.out}: {len(questions)} outcomes")
    return 0


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    router = commands.add_parser("router", help="fit, calibrate and evaluate the router")
    sub = router.add_subparsers(dest="router_command", required=True)

    def common(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--config", help="config whose embedder to use (default: embedded)")
        parser.add_argument("--skip-bad", action="store_true", help="skip malformed outcome lines")

    fit_ = sub.add_parser("fit", help="build a router model file from outcome data")
    fit_.add_argument("--outcomes", required=True)
    fit_.add_argument("--out", required=True)
    fit_.add_argument("--kind", choices=["knn", "logistic"], default="logistic")
    fit_.add_argument("--k", type=int, default=100, help="neighbours for knn")
    common(fit_)
    fit_.set_defaults(run=router_fit)

    cal = sub.add_parser("calibrate", help="print the threshold for a traffic share or quality")
    cal.add_argument("--router", help="router model file (default: the config's)")
    target = cal.add_mutually_exclusive_group(required=True)
    target.add_argument("--large-fraction", type=float)
    target.add_argument("--target-quality", type=float)
    cal.add_argument("--prompts", help="JSONL with a prompt per line (for --large-fraction)")
    cal.add_argument("--outcomes", help="outcome data (for --target-quality)")
    common(cal)
    cal.set_defaults(run=router_calibrate)

    ev = sub.add_parser("eval", help="cross-validate a router on outcome data")
    ev.add_argument("--outcomes", required=True)
    ev.add_argument("--folds", type=int, default=5)
    ev.add_argument(
        "--kind",
        choices=["knn", "logistic"],
        nargs="+",
        default=["logistic"],
        help="one or more scorers, each cross-validated on the same folds",
    )
    ev.add_argument("--k", type=int, default=100)
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--json", action="store_true")
    ev.add_argument("--plot", help="write quality vs %% large calls to this PNG")
    common(ev)
    ev.set_defaults(run=router_eval)

    evaluation = commands.add_parser("eval", help="measure the configured engines")
    eval_sub = evaluation.add_subparsers(dest="eval_command", required=True)
    collect = eval_sub.add_parser("collect", help="run both engines on a dataset, write outcomes")
    collect.add_argument("--dataset", required=True, help="JSONL of labelled questions")
    collect.add_argument("--out", required=True)
    collect.add_argument("--config")
    collect.add_argument("--small", default="small")
    collect.add_argument("--large", default="large")
    collect.add_argument("--max-tokens", type=int, default=48)
    collect.add_argument("--limit", type=int, default=0)
    collect.set_defaults(run=eval_collect)
