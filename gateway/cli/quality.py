"""`satisfice quality`: how often each shortcut disagreed with the path it skipped, with
95% intervals, read from the outcome store; a shell over gateway.checks."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import msgspec

from cache.store import StoreUnavailable
from gateway.checks.estimates import (
    AGREEMENT_NOTE,
    FEEDBACK_NOTE,
    Calibration,
    Estimate,
    FeedbackShare,
    LiveEstimates,
    Report,
)
from gateway.checks.record import CheckRecord
from gateway.checks.store import FileOutcomes, OutcomeStore, create_outcome_store
from gateway.config import load_config
from gateway.config.shadow import ShadowSettings

_NONE = "-"


def _hours(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of hours")
    return value


def _store(args: argparse.Namespace) -> OutcomeStore:
    if args.outcomes is not None:
        return FileOutcomes(args.outcomes, max_bytes=ShadowSettings().outcomes_max_bytes)
    config = load_config(args.config)
    return create_outcome_store(config.shadow or ShadowSettings(), config.cache)


def quality(args: argparse.Namespace) -> int:
    since = None if args.since is None else time.time() - args.since * 3600
    store = _store(args)

    async def read() -> list[CheckRecord]:
        try:
            return await store.read(since=since, tenant=args.tenant)
        finally:
            await store.close()

    try:
        records = asyncio.run(read())
    except StoreUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    report = LiveEstimates.fold(records, bins=args.bins).report()
    if args.json:
        whole = {
            "store": store.where,
            "since": since,
            "tenant": args.tenant,
            "records": len(records),
            **msgspec.to_builtins(report),
        }
        print(msgspec.json.encode(whole).decode())
        return 0
    window = "" if args.since is None else f" made in the last {args.since:g} hours"
    scope = "" if args.tenant is None else f" of tenant {args.tenant}"
    print(f"{len(records)} check records{scope}{window}, from {store.where}")
    print(render(report))
    return 0


# -- the text report ----------------------------------------------------------------


def render(report: Report) -> str:
    parts = [_estimates(report.estimates), _calibration(report.calibration)]
    parts.append(_feedback(report.feedback))
    if report.ignored:
        parts.append(f"{report.ignored} records left out: their probability is not in (0, 1]")
    parts.append(_sentence(AGREEMENT_NOTE))
    return "\n\n".join(parts)


def _sentence(note: str) -> str:
    return note[0].upper() + note[1:] + "."


def _share(rate: float | None) -> str:
    return _NONE if rate is None else f"{rate:.1%}"


# Below this many effective checks the 95% interval covers a few points less often than
# it says (bench/shadow_estimates.py: 92-94% with one to five checks).
FEW_CHECKS = 10


def _interval(low: float | None, high: float | None) -> str:
    return _NONE if low is None or high is None else f"[{low:.1%}, {high:.1%}]"


def _n(n: int, n_eff: float) -> str:
    # Unequal probabilities of being drawn leave fewer effective checks than checks.
    return str(n) if abs(n - n_eff) < 0.05 else f"{n} (n_eff {n_eff:.1f})"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
             for row in [header, *rows]]  # fmt: skip
    return "\n".join(line.rstrip() for line in lines)


def _estimates(estimates: list[Estimate]) -> str:
    title = (
        "Shortcuts against the path they skipped: the share of compared checks that "
        "disagreed (weighted by 1/probability of being drawn), with its 95% interval"
    )
    if not estimates:
        return f"{title}\n(no checks recorded)"
    header = ["tenant", "shortcut", "disagreement", "95% interval", "compared",
              "undecided", "dropped", "failed", "what a disagreement means"]  # fmt: skip
    rows = [
        [
            e.tenant,
            e.shortcut,
            _share(e.rate),
            _interval(e.low, e.high) + (" *" if 0 < e.n_eff < FEW_CHECKS else ""),
            _n(e.n, e.n_eff),
            str(e.undecided),
            ", ".join(f"{reason} {count}" for reason, count in e.dropped.items()) or "0",
            str(e.failed),
            e.meaning,
        ]
        for e in estimates
    ]
    few = any(0 < e.n_eff < FEW_CHECKS for e in estimates)
    note = (
        f"\n* fewer than {FEW_CHECKS} effective checks: such an interval covers the rate "
        "a little less often than 95% (92-94% with one to five checks, in replay)"
    )
    return f"{title}\n{_table(header, rows)}" + (note if few else "")


def _calibration(calibration: list[Calibration]) -> str:
    title = (
        "Calibration: the evaluator's P(correct) when the shortcut was taken, against "
        "agreement with the skipped path"
    )
    if not calibration:
        return f"{title}\n(no compared checks with a P(correct))"
    blocks = [title]
    for c in calibration:
        ece = _NONE if c.ece is None else f"{c.ece:.3f}"
        gap = _NONE if c.mean_gap is None else f"{c.mean_gap:+.3f}"
        header = ["P(correct)", "compared", "mean P(correct)", "agreement", "95% interval"]
        rows = [
            [
                f"{b.lower:.1f}-{b.upper:.1f}",
                _n(b.n, b.n_eff),
                _NONE if b.mean_confidence is None else f"{b.mean_confidence:.3f}",
                _share(b.agreement),
                _interval(b.low, b.high),
            ]
            for b in c.bins
            if b.n
        ]
        blocks.append(
            f"{c.shortcut}: {c.n} compared; ECE {ece}; mean gap {gap} "
            f"(mean P(correct) - agreement)\n{_table(header, rows)}"
        )
    return "\n".join(blocks)


def _feedback(feedback: list[FeedbackShare]) -> str:
    title = f"Callers' verdicts (POST /v1/feedback). {_sentence(FEEDBACK_NOTE)}"
    if not feedback:
        return f"{title}\n(no verdicts recorded)"
    header = ["tenant", "route", "marked wrong", "95% interval", "verdicts"]
    rows = [
        [f.tenant, f.route, f"{f.rate:.1%} ({f.wrong})", _interval(f.low, f.high), str(f.n)]
        for f in feedback
    ]
    return f"{title}\n{_table(header, rows)}"


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "quality",
        help="how often each shortcut disagreed with the path it skipped, with 95% "
        "intervals, from the shadow checks' outcome store",
    )
    parser.add_argument("--config", help="the gateway's config: it says where the store is "
                        "(default: the embedded default)")  # fmt: skip
    parser.add_argument("--outcomes", help="read this outcome file instead of the config's store")
    parser.add_argument("--tenant", help="this tenant's checks only")
    parser.add_argument("--since", type=_hours, metavar="HOURS",
                        help="checks made in the last HOURS only")  # fmt: skip
    parser.add_argument("--bins", type=int, default=5, choices=range(1, 21), metavar="N",
                        help="equal-width bins of P(correct) (default 5)")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="the report as one JSON object")
    parser.set_defaults(run=quality)
