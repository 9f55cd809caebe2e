"""`satisfice router fit | calibrate | eval`: a shell over router.fitting,
router.calibrate and router.metrics, on the SRE's own outcome data."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import msgspec
import numpy as np

from gateway.config import GatewayConfig, load_config
from router import calibrate
from router.embedder import Embedder, Vectors
from router.fitting import cross_validated_routing, cross_validated_scores, fit_router
from router.model_file import read_router, write_router
from router.outcomes import Outcome, read_outcomes, read_prompts
from router.router import router_file
from router.scorers import scorer_for
from router.settings import RouterSettings

QUALITY_GAP_HELP = (
    "threshold: the fewest large calls recovering this share of the accuracy between "
    "always-small and always-large (default: the share of prompts that needed large)"
)


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not within [0, 1]")
    return value


# What `router eval` prints of each report, in this order.
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


def embed_prompts(config: GatewayConfig, prompts: Sequence[str]) -> tuple[Vectors, str]:
    embedder = Embedder(config.embedder, Path(config.models_dir))
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
    vectors, fingerprint = embed_prompts(config, [o.prompt for o in outcomes])
    model = fit_router(
        args.kind,
        outcomes,
        vectors,
        embedding=fingerprint,
        k=args.k,
        trained_on=f"{Path(args.outcomes).name} ({len(outcomes)} outcomes)",
        quality_gap=args.quality_gap,
    )
    write_router(model, args.out)
    print(
        f"wrote {args.out}: {args.kind}, {len(outcomes)} outcomes, threshold {model.threshold:.4f}"
    )
    return 0


def router_calibrate(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    settings = config.router if config.router is not None else RouterSettings()
    path = args.router or router_file(settings)
    embedder = Embedder(config.embedder, Path(config.models_dir))
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
        if not args.prompts:
            raise SystemExit("--large-fraction needs --prompts FILE to measure the share")
        prompts = read_prompts(args.prompts)
        scores = scorer_for(model).score(embedder.encode(prompts), prompts)
        result = calibrate.for_large_fraction(scores, args.large_fraction)
    print(json.dumps(msgspec.to_builtins(result)))
    return 0


def router_eval(args: argparse.Namespace) -> int:
    from router.metrics import RoutingReport, evaluate

    config = load_config(args.config)
    outcomes = _load_outcomes(args.outcomes, args.skip_bad)
    vectors, _ = embed_prompts(config, [o.prompt for o in outcomes])
    small = np.array([o.small for o in outcomes])
    large = np.array([o.large for o in outcomes])
    reports: dict[str, RoutingReport] = {}
    summaries = []
    for kind in args.kind:
        scores = cross_validated_scores(kind, outcomes, vectors, args.folds, args.seed, args.k)
        report = reports[kind] = evaluate(scores, small, large)
        routed = cross_validated_routing(
            kind, outcomes, vectors, args.folds, args.seed, args.k, args.quality_gap
        )
        summaries.append(
            {"outcomes": len(outcomes), "kind": kind, "folds": args.folds}
            | {name: getattr(report, name) for name in _SUMMARY}
            | {"routed_accuracy": routed.accuracy, "routed_large_share": routed.large_share}
        )
    if args.plot:
        from router.plots import plot_quality_curve

        plot_quality_curve(reports, args.plot, title=Path(args.outcomes).name)
    for summary in summaries:
        print(
            json.dumps(summary) if args.json else "\n".join(f"{k}: {v}" for k, v in summary.items())
        )
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
    fit_.add_argument("--quality-gap", type=_fraction, help=QUALITY_GAP_HELP)
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
    ev.add_argument("--quality-gap", type=_fraction, help=QUALITY_GAP_HELP)
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--json", action="store_true")
    ev.add_argument("--plot", help="write quality vs %% large calls to this PNG")
    common(ev)
    ev.set_defaults(run=router_eval)
