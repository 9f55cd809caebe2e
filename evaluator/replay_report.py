"""A trace bank replayed under every stopping policy: accuracy against tokens spent.

Policies, each a curve of (accuracy, mean completion tokens per question) points:

- fixed-k plain majority (evaluator.signals.majority), k = 1..N: the baseline; fixed N
  is the reference accuracy and cost;
- fixed-k weighted vote (evaluator.policy.tally: DeepConf's confidence-weighted vote);
- Adaptive-Consistency's Beta stopping after each sample (signals.beta_stop), swept
  over its threshold;
- ESC (Li et al. 2024, arXiv 2401.10480): windows of w samples, stop at the first
  unanimous window, answer the majority of all drawn;
- each signal alone as the stop rule, rounds of ``branches``: stop when the loop's
  candidate's signal reaches a threshold, swept over quantiles of its values;
- the loop's own rule (evaluator.policy.tally and stop_reason) with the calibrated
  P(correct), swept over its threshold, without and with DeepConf's filter;
- two proposals, each the loop's rule at its default threshold plus one more stop:
  once the vote is settled (Adaptive-Consistency's Beta criterion on the tally's vote
  counts), or once a round no longer raises P(correct).

P(correct) is honest: each question's comes from a calibrator fitted, with
evaluator.calibration.fit on evaluator.training rows, on the other folds of questions
only, unless a calibrator is given to use for all of them.

Samples are replayed in several seeded random orders per question, averaged, so that
which of a question's draws come first is averaged out rather than fixed by the order
the bank stored them in (banks written before `satisfice evaluator bank` seeded each
question on its own also share seeds by position across questions).

The bank has no answer probes (its answers are a few tokens, with no reasoning to
probe), so no probe tokens are counted anywhere. The report is JSON-ready builtins;
``render`` writes its tables (docs/benchmarks.md) and ``plot`` its figure.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
from msgspec.structs import replace

from evaluator.calibration import ISOTONIC_MIN_LABELS, Calibrator, fit, measure, roc_auc
from evaluator.policy import LoopSettings
from evaluator.replay import (
    NO_BUDGET,
    Policy,
    Question,
    beta,
    branch_orders,
    esc,
    fixed_plain,
    fixed_weighted,
    loop_rule,
    signal_alone,
)
from evaluator.runs import Run
from evaluator.signals import (
    DEFAULT_FEATURES,
    DEFAULT_SETTINGS,
    FeatureName,
    MissingSignal,
    Signals,
    majority,
    trace_confidence,
)
from evaluator.training import training_set

# What `make default-calibrator` fits on: 1 and 2, and the loop's cumulative branch counts.
DEFAULT_KS = (1, 2, 4, 8, 12, 16)
# Below 0.5 the loop stops on an answer that is more likely wrong than right. The sweep
# goes there because on a weak model more samples often do not make it likelier: the
# rule (fewest tokens at fixed k = N's accuracy) chose 0.4 for the bundled 1.5B.
LOOP_THRESHOLDS = (0.2, 0.3, 0.35, 0.4, 0.45, 0.5, 0.55, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99)
BETA_THRESHOLDS = (0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 0.97, 0.99)
ESC_WINDOWS = (2, 4, 8)
# Adaptive-Consistency's P(the leader stays ahead) for the proposed "settled vote" stop.
SETTLED_THRESHOLDS = (0.8, 0.9, 0.95, 0.99)
# LoopSettings.min_gain: rises in P(correct) from one round to the next below which
# the loop stops.
MIN_GAINS = (0.0, 0.01, 0.02, 0.05)
SIGNAL_QUANTILES = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
# Each signal that a branch's samples give, as a stop rule alone: not the question's
# kind (fixed before any sample) nor probes (the bank has none).
STOP_SIGNALS = tuple(f for f in DEFAULT_FEATURES if not f.startswith("kind_"))
# DeepConf's filter is tried at these percentiles of every sample's lowest group
# confidence in the bank.
PRUNE_PERCENTILES = (10, 25)
NO_PROBES = "none: the bank's answers are a few tokens, with no reasoning to probe"

_OPTION_LINE = re.compile(r"^[A-E]\. ", re.MULTILINE)


# --- points and curves -----------------------------------------------------------------


class Point(msgspec.Struct, frozen=True, kw_only=True):
    setting: str
    value: float
    accuracy: float
    correct: int
    mean_tokens: float
    mean_branches: float
    # Of the calibrated P(correct) at the stopping point, held out unless a fixed
    # calibrator file was given; None where one class is empty.
    ece: float | None
    brier: float | None
    roc_auc: float | None
    answer_change: float  # share of questions answered otherwise than fixed-N majority


class Curve(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    points: list[Point]
    saved: float | None  # tokens saved at the reference accuracy; None if never reached
    saved_at: str | None
    saved_within_1pt: float | None  # ... at the reference accuracy less one point
    saved_within_1pt_at: str | None


def point(
    questions: Sequence[Question],
    policy: Policy,
    setting: str,
    value: float,
    reference: Sequence[str | None],
) -> Point:
    outcomes = [policy(q) for q in questions]
    labels = [o.correct for o in outcomes]
    metrics = measure([o.probability for o in outcomes], labels)
    both = 0 < sum(labels) < len(labels)
    return Point(
        setting=setting,
        value=value,
        accuracy=sum(labels) / len(labels),
        correct=sum(labels),
        mean_tokens=float(np.mean([o.tokens for o in outcomes])),
        mean_branches=float(np.mean([o.branches for o in outcomes])),
        ece=metrics.ece,
        brier=metrics.brier,
        roc_auc=metrics.roc_auc if both else None,
        answer_change=float(
            np.mean([o.answer != r for o, r in zip(outcomes, reference, strict=True)])
        ),
    )


def cheapest_as_accurate(points: Iterable[Point], reference: Point, slack: int = 0) -> Point | None:
    """The point with the fewest mean tokens among those at least as accurate as the
    reference, less ``slack`` questions: how the loop's settings are chosen."""
    eligible = [p for p in points if p.correct >= reference.correct - slack]
    return min(eligible, key=lambda p: p.mean_tokens) if eligible else None


def tokens_saved(
    points: Iterable[Point], reference: Point, slack: int = 0
) -> tuple[float | None, str | None]:
    """1 - the cheapest_as_accurate point's mean tokens / the reference's; (None, None)
    when no point is as accurate."""
    cheapest = cheapest_as_accurate(points, reference, slack)
    if cheapest is None:
        return None, None
    return 1.0 - cheapest.mean_tokens / reference.mean_tokens, cheapest.setting


def curve(name: str, points: list[Point], reference: Point, questions: int) -> Curve:
    # One point of accuracy, in questions; never less than one question.
    slack = max(1, round(questions / 100))
    saved, saved_at = tokens_saved(points, reference)
    within, within_at = tokens_saved(points, reference, slack)
    return Curve(
        name=name,
        points=points,
        saved=saved,
        saved_at=saved_at,
        saved_within_1pt=within,
        saved_within_1pt_at=within_at,
    )


# --- the run ---------------------------------------------------------------------------


def _readable(signals: Signals, features: Sequence[FeatureName] = DEFAULT_FEATURES) -> bool:
    try:
        signals.features(features)
    except MissingSignal:
        return False
    return True


def cross_fit(
    questions: Sequence[Question],
    ks: Sequence[int],
    folds: int,
    seed: int,
    features: Sequence[FeatureName] = DEFAULT_FEATURES,
    isotonic_min: int = ISOTONIC_MIN_LABELS,
) -> dict[str, Any]:
    """Give each question a calibrator fitted on the other folds' questions only: its
    rows come from the same branch orders as the replay's, and every order of one
    question falls in the same fold. ``features`` and ``isotonic_min`` as in
    ``satisfice evaluator fit``, so that settings are chosen with the calibrator that
    will ship."""
    runs = sorted({q.index for q in questions})
    if not 2 <= folds <= len(runs):
        raise ValueError(f"folds must be within 2..{len(runs)} (one question each at least)")
    settings = questions[0].settings
    data = training_set([q.run for q in questions], ks, settings)
    # A row whose k branches all came back empty has no token signals to fit on.
    usable = [i for i, signals in enumerate(data.signals) if _readable(signals, features)]
    rows = np.array([data.signals[i].features(features) for i in usable])
    labels = np.array([data.labels[i] for i in usable], dtype=np.float64)
    groups = np.array([questions[data.groups[i]].index for i in usable])
    order = np.random.default_rng(seed).permutation(runs)
    for fold in np.array_split(order, folds):
        test = np.isin(groups, fold)
        model = fit(
            rows[~test],
            labels[~test],
            features,
            signals=settings,
            isotonic_min=isotonic_min,
            seed=seed,
        )
        for q in questions:
            if q.index in fold:
                q.calibrator = model
    return {
        "kind": "cross-fitted",
        "features": list(features),
        "isotonic_min": isotonic_min,
        "folds": folds,
        "k": list(ks),
        "rows": len(labels),
        "rows_without_signals": len(data.signals) - len(usable),
    }


def chance_level(runs: Sequence[Run]) -> float:
    """What guessing scores: one option in n for a choice, the commoner gold answer for
    yes/no, and about nothing for a number or free text."""
    kind = runs[0].kind
    if kind == "choice":
        options = [len(_OPTION_LINE.findall(r.prompt)) for r in runs]
        return float(np.mean([1 / n for n in options if n])) if any(options) else float("nan")
    if kind == "yesno":
        yes = np.mean([r.answers[0].strip().lower() in ("yes", "true") for r in runs])
        return float(max(yes, 1 - yes))
    return 0.0


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval for a share (95% by default)."""
    if n == 0:
        return float("nan"), float("nan")
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def by_source(questions: Sequence[Question], samples: int) -> list[dict[str, Any]]:
    """Accuracy per source; a vote's over every branch order (ties break by order)."""
    sources: dict[str, list[Question]] = {}
    for q in questions:
        sources.setdefault(q.run.source or q.run.kind, []).append(q)
    table = []
    for name, group in sources.items():
        runs = {q.index: q.run for q in group}
        n = len(runs)
        plain = float(np.mean([q.correct(majority(q.answers)) for q in group]))
        low, high = wilson(round(plain * n), n)
        # Whether P(correct) tells right from wrong within a source, not only sources
        # apart: the vote of all N branches, each question's held-out P.
        verdicts = [q.whole_verdict(samples) for q in group]
        right = [q.correct(v.answer) for q, v in zip(group, verdicts, strict=True)]
        p = [v.probability for v in verdicts]
        table.append(
            {
                "source": name,
                "kind": group[0].run.kind,
                "questions": n,
                "per_sample": float(np.mean([[q.correct(a) for a in q.answers] for q in group])),
                f"majority_at_{samples}": plain,
                f"majority_at_{samples}_95ci": [low, high],
                f"weighted_at_{samples}": float(np.mean(right)),
                f"mean_p_at_{samples}": float(np.mean(p)),
                f"auroc_at_{samples}": roc_auc(p, right),
                "chance": chance_level(list(runs.values())),
            }
        )
    return table


# One point of a sweep: its label, the value swept, and the policy at that value.
Setting = tuple[str, float, Policy]
# The curve whose last point (fixed k = N majority) every other is measured against.
REFERENCE = "fixed-k majority"


def policies(
    questions: Sequence[Question],
    samples: int,
    branches: int,
    rounds: int,
    cutoffs: dict[str, float],
) -> dict[str, list[Setting]]:
    """Every curve's settings, by curve name, in the report's order: fixed k up to
    ``samples``, stopping rules in up to ``rounds`` rounds of ``branches``. Each signal
    alone is swept over quantiles of its values in these questions, which need their
    calibrators already."""
    every_k = range(1, samples + 1)
    sweeps: dict[str, list[Setting]] = {
        REFERENCE: [(f"k={k}", k, fixed_plain(k)) for k in every_k],
        "fixed-k weighted vote": [(f"k={k}", k, fixed_weighted(k)) for k in every_k],
        "Beta stopping": [(f"t={t}", t, beta(t, samples)) for t in BETA_THRESHOLDS],
        "ESC windows": [(f"w={w}", w, esc(w, samples)) for w in ESC_WINDOWS if w <= samples],
    }
    for name in STOP_SIGNALS:
        values = [
            v
            for q in questions
            for r in range(1, rounds + 1)
            if (v := getattr(q.whole_verdict(r * branches).signals, name)) is not None
        ]
        if values:
            thresholds = sorted({float(np.quantile(values, x)) for x in SIGNAL_QUANTILES})
            sweeps[f"{name} alone"] = [
                (f">={t:.4g}", t, signal_alone(name, t, branches, rounds)) for t in thresholds
            ]
    base = LoopSettings(branches=branches, max_rounds=rounds, token_budget=NO_BUDGET)
    for label, cutoff in [("no filter", None), *cutoffs.items()]:
        title = "loop rule" + ("" if cutoff is None else f", prune_below {label}={cutoff:.3g}")
        sweeps[title] = [
            (f"t={t}", t, loop_rule(replace(base, threshold=t, prune_below=cutoff), rounds))
            for t in LOOP_THRESHOLDS
        ]
    sweeps[f"loop rule t={base.threshold} + settled vote (proposed)"] = [
        (f"AC>={b}", b, loop_rule(base, rounds, stable=b)) for b in SETTLED_THRESHOLDS
    ]
    sweeps[f"loop rule t={base.threshold} + min_gain"] = [
        (f"min_gain={d}", d, loop_rule(replace(base, min_gain=d), rounds)) for d in MIN_GAINS
    ]
    return sweeps


def replay_bank(
    runs: Sequence[Run],
    *,
    calibrator: Calibrator | None,
    folds: int,
    ks: Sequence[int],
    seed: int,
    branches: int,
    orders: int,
    max_rounds: int | None = None,
    features: Sequence[FeatureName] = DEFAULT_FEATURES,
    isotonic_min: int = ISOTONIC_MIN_LABELS,
) -> dict[str, Any]:
    """The whole report as builtins: every policy's curve, the reference, accuracy per
    source, and how P(correct) was calibrated (``calibrator`` for every question, or
    one cross-fitted per fold of ``folds`` at ``ks`` on ``features``). Stopping rules
    take up to ``max_rounds`` rounds of ``branches`` (as a config's loop would), or as
    many as the samples hold. NaN where a figure is undefined: ``finite`` makes it JSON."""
    samples = min(len(r.samples) for r in runs)
    rounds = samples // branches
    if rounds < 1:
        raise ValueError(f"runs have {samples} samples, fewer than one round of {branches}")
    if max_rounds is not None:
        if max_rounds < 1:
            raise ValueError(f"max_rounds must be at least 1, not {max_rounds}")
        rounds = min(rounds, max_rounds)
    settings = calibrator.signals if calibrator is not None else DEFAULT_SETTINGS
    # Only samples that fill a window can be stopped by the filter; a letter answer's
    # lone partial group would drag the percentiles below anything a long trace reaches.
    lowest = [
        s
        for run in runs
        for sample in run.samples[:samples]
        if len(sample.logprobs) >= settings.group_window
        and (s := trace_confidence(sample.logprobs, settings).lowest_group) is not None
    ]
    cutoffs = (
        {f"p{p}": float(np.percentile(lowest, p)) for p in PRUNE_PERCENTILES} if lowest else {}
    )
    questions = [
        Question(index, shuffled, settings, list(cutoffs.values()))
        for index, run in enumerate(runs)
        for shuffled in branch_orders(run, samples, orders, seed + index)
    ]
    if calibrator is not None:
        for q in questions:
            q.calibrator = calibrator
        calibration: dict[str, Any] = {"kind": "fixed file", "trained_on": calibrator.trained_on}
    else:
        usable = sorted(k for k in ks if k <= samples)
        calibration = cross_fit(questions, usable, folds, seed, features, isotonic_min)

    reference_answers = [majority(q.answers) for q in questions]
    swept = {
        name: [
            point(questions, policy, label, value, reference_answers)
            for label, value, policy in sweep
        ]
        for name, sweep in policies(questions, samples, branches, rounds, cutoffs).items()
    }
    reference = swept[REFERENCE][-1]
    curves = [curve(name, points, reference, len(questions)) for name, points in swept.items()]
    pruned = {
        label: float(np.mean([b.stopped for q in questions for b in q.cut[cutoff]]))
        for label, cutoff in cutoffs.items()
    }
    return {
        "runs": len(runs),
        "samples": samples,
        "orders": orders,
        "branches": branches,
        "rounds": rounds,
        "calibration": calibration,
        "probes": NO_PROBES,
        "probe_tokens": 0,
        "prune_cutoffs": cutoffs,
        "stopped_mid_generation": pruned,
        "reference": msgspec.to_builtins(reference),
        "sources": by_source(questions, samples),
        "curves": msgspec.to_builtins(curves),
    }


# --- output ----------------------------------------------------------------------------


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _num(x: float | None, digits: int = 3) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def operating_point(c: dict[str, Any]) -> dict[str, Any]:
    """The point the summary shows: where the curve matches the reference most cheaply,
    else within one point, else its most accurate point."""
    at = c["saved_at"] or c["saved_within_1pt_at"]
    points: list[dict[str, Any]] = c["points"]
    if at is None:
        return max(points, key=lambda p: (p["correct"], -p["mean_tokens"]))
    return next(p for p in points if p["setting"] == at)


def render(report: dict[str, Any]) -> str:
    ref = report["reference"]
    lines = [
        f"{report['runs']} questions, {report['samples']} samples each, replayed in "
        + (f"{report['orders']} random orders" if report["orders"] else "the bank's order")
        + f"; rounds of {report['branches']} branches, at most {report['rounds']} rounds",
        f"calibration: {report['calibration']}",
        f"probes: {report['probes']}",
        "prune cut-offs (percentiles of lowest group confidence): "
        + ", ".join(f"{k}={v:.3f}" for k, v in report["prune_cutoffs"].items()),
        "branches stopped mid-generation: "
        + ", ".join(f"{k}: {_pct(v)}" for k, v in report["stopped_mid_generation"].items()),
        "",
        f"reference, fixed k={report['samples']} majority: accuracy {_pct(ref['accuracy'])}, "
        f"{ref['mean_tokens']:.1f} tokens per question",
        "",
        "| source | kind | n | per sample | majority@N (95% CI) | weighted@N | chance "
        "| mean P@N | AUROC@N |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    samples = report["samples"]
    for s in report["sources"]:
        low, high = s[f"majority_at_{samples}_95ci"]
        lines.append(
            f"| {s['source']} | {s['kind']} | {s['questions']} | {_pct(s['per_sample'])} | "
            f"{_pct(s[f'majority_at_{samples}'])} ({_pct(low)} to {_pct(high)}) | "
            f"{_pct(s[f'weighted_at_{samples}'])} | {_pct(s['chance'])} | "
            f"{_pct(s[f'mean_p_at_{samples}'])} | {_num(s[f'auroc_at_{samples}'])} |"
        )
    lines += [
        "",
        "| policy | setting | accuracy | tokens/q | branches/q | saved at ref. acc. | "
        "saved within 1 pt | ECE | Brier | AUROC | answer change |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in report["curves"]:
        p = operating_point(c)
        lines.append(
            f"| {c['name']} | {p['setting']} | {_pct(p['accuracy'])} | "
            f"{p['mean_tokens']:.1f} | {p['mean_branches']:.1f} | {_pct(c['saved'])} "
            f"({c['saved_at'] or '-'}) | {_pct(c['saved_within_1pt'])} "
            f"({c['saved_within_1pt_at'] or '-'}) | {_num(p['ece'])} | {_num(p['brier'])} | "
            f"{_num(p['roc_auc'])} | {_pct(p['answer_change'])} |"
        )
    for c in report["curves"]:
        if not c["name"].startswith("loop rule"):
            continue
        lines += [
            "",
            f"{c['name']}:",
            "| threshold | accuracy | tokens/q | branches/q | ECE | Brier | AUROC | "
            "answer change |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for p in c["points"]:
            lines.append(
                f"| {p['setting']} | {_pct(p['accuracy'])} | {p['mean_tokens']:.1f} | "
                f"{p['mean_branches']:.1f} | {_num(p['ece'])} | {_num(p['brier'])} | "
                f"{_num(p['roc_auc'])} | {_pct(p['answer_change'])} |"
            )
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    curves = {c["name"]: c for c in report["curves"]}
    ref = report["reference"]
    # One standard error of the reference accuracy over the bank's questions: how far
    # apart two policies must be before the bank can tell them apart.
    error = 100 * math.sqrt(ref["accuracy"] * (1 - ref["accuracy"]) / report["runs"])
    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 6.5), sharey=True)
    panels = (
        (left, [n for n in curves if not n.endswith(" alone")], "policies"),
        (right, ["fixed-k majority", *(n for n in curves if n.endswith(" alone"))],
         "each signal alone as the stop rule"),
    )  # fmt: skip
    for axes, names, title in panels:
        axes.axhspan(
            100 * ref["accuracy"] - error,
            100 * ref["accuracy"] + error,
            color="red",
            alpha=0.07,
            label="±1 standard error",
        )
        for name in names:
            points = sorted(curves[name]["points"], key=lambda p: p["mean_tokens"])
            reference = name == "fixed-k majority"
            axes.plot(
                [p["mean_tokens"] for p in points],
                [100 * p["accuracy"] for p in points],
                marker=".",
                color="black" if reference else None,
                linewidth=2 if reference else 1,
                label=name,
            )
        axes.axhline(
            100 * ref["accuracy"],
            color="red",
            linestyle="--",
            linewidth=0.8,
            label=f"fixed k={report['samples']} majority",
        )
        axes.plot([ref["mean_tokens"]], [100 * ref["accuracy"]], "o", color="red")
        axes.set_xlabel("mean completion tokens per question")
        axes.set_title(title)
        axes.grid(alpha=0.3)
        axes.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)
    left.set_ylabel("accuracy (%)")
    figure.suptitle(
        f"Stopping policies replayed over the trace bank ({report['runs']} questions, "
        f"{report['samples']} samples each)"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def finite(value: Any) -> Any:
    """NaN is not JSON: it becomes null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value
