"""Every thinking path against one greedy pass, replayed on held-out questions.

Questions: the trace bank's ARC-Challenge (the letter only) and GSM8K (worked answers),
held out from everything shipped: the held-out halves of each source's first 240
(bench/split_runs.py's split as `make default-calibrator` makes it) and ARC-Challenge's
932 after them, less any question the bundled router holds among its examples (its
score there would be its own label's). Per arm, accuracy (95% Wilson interval over
questions), completion tokens a question, and the large engine's share of them:

- small greedy, large greedy: bench/banks/greedy_small, greedy_large (one pass each);
- majority of k samples at temperature 0.7, k = 1..8, from the trace bank;
- the sampling loop (the embedded default's loop settings without the greedy pass:
  the default's hard path before greedy-first, with its calibrator), replayed as
  evaluator.replay.replay_loop replays it;
- greedy-first (evaluator.loop's mode; evaluator.replay.greedy_first_rule): the large
  greedy pass, kept when P(greedy right) reaches ``greedy_stop``; otherwise the loop's
  rounds over the bank's samples (up to ``max_rounds``), the greedy branch in every
  tally at ``greedy_weight``;
- auto: the bundled router scores each question (the bundled embedder); below its
  threshold the small engine's greedy pass answers, at or above it a large path: the
  router file's threshold with the sampling loop (the default before greedy-first),
  and with the large path chosen below at the file's threshold and at the one chosen
  below (the default now).

Sample arms average over 8 seeded branch orders per question (evaluator.replay's), so
one lucky order does not decide a question. P(greedy right) is a logistic calibrator
per answer kind on the greedy pass's mean logprob and mean token confidence, fitted on
the fitting halves (there each question's P comes from fold calibrators that never saw
it); `--calibrator-out` writes them, as the loop's `greedy_calibrator: bundled` reads.
Chosen on the fitting halves only, with one greedy pass of `large` as the reference:

- greedy-first's settings, by the project's rule (the fewest tokens that keep the
  reference's accuracy) -- nothing that starts from the greedy pass is cheaper than it,
  so the rule picks greedy itself unless sampling wins outright -- and, reported beside
  it, by the issue's target (the fewest tokens reaching the reference + 3 points within
  twice its tokens, else the most accurate within twice its tokens) and the most
  accurate at any cost;
- the router's threshold for `auto`, by the same rule: the fewest large-path routes
  whose routed accuracy keeps always-large greedy's.

    .venv/bin/python bench/greedy_first.py --json bench/out/greedy_first.json \\
        --plot docs/img/greedy_first.png --calibrator-out evaluator/data
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
from msgspec.structs import replace

from evaluator.answers import AnswerKind, extract, is_correct
from evaluator.calibration import (
    Calibrator,
    calibrator_file,
    fit,
    read_calibrator,
    write_calibrator,
)
from evaluator.calibration import measure as calibration
from evaluator.policy import LoopSettings, tally
from evaluator.replay import (
    DEFAULT_ORDERS,
    Policy,
    Question,
    branch_orders,
    by_majority,
    greedy_first_rule,
    loop_rule,
)
from evaluator.runs import Run, RunSample, split_by_source, take_per_source
from evaluator.signals import MissingSignal, SignalSettings, compute_signals
from gateway.checks.estimates import wilson
from gateway.config import load_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bank_greedy import BANKS, SPLIT_PER_SOURCE, bank_runs, xz_streams

SOURCES = ("arc_challenge", "gsm8k")
# bench/split_runs.py as `make default-calibrator` runs it (--held-out-share 0.5, seed 0).
SPLIT_SHARE, SPLIT_SEED = 0.5, 0
# The greedy answer's own evidence: one pass has no vote to read, only its tokens'.
GREEDY_FEATURES = ("mean_logprob", "mean_confidence")
# 70-120 fitting questions a kind: logistic only, as the shipped calibrator is
# (isotonic needs more).
ISOTONIC_MIN = 100_000
FOLDS = 5
NEVER = math.inf  # a greedy_stop no P reaches: always sample
THRESHOLDS = (0.0, 0.3, 0.4, 0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, NEVER)
WEIGHTS = (0.0, 0.5, 1.0, 2.0, 4.0)
TARGET_GAIN = 0.03  # the issue's: 3 points over greedy large ...
TARGET_TOKENS = 2.0  # ... at no more than twice its tokens


# P(greedy right) by answer kind (evaluator.answers): choice, number, ...
GreedyCalibrators = dict[AnswerKind, Calibrator]


class Greedy(msgspec.Struct, frozen=True, kw_only=True):
    """One greedy pass of a question, graded."""

    sample: RunSample
    answer: str | None
    correct: bool
    tokens: int


class Item:
    """A question with its two greedy passes, its samples in each branch order, and the
    router's score of it."""

    def __init__(
        self,
        index: int,
        run: Run,
        small: Greedy,
        large: Greedy,
        calibrator: Calibrator,
        orders: int,
    ) -> None:
        self.index = index  # position in its source's bank: seeds its branch orders
        self.run = run
        self.source = run.source
        self.small = small
        self.large = large
        self.score = math.nan  # the bundled router's, once scored
        self.orders: list[Question] = []
        for shuffled in branch_orders(run, len(run.samples), orders, index):
            q = Question(index, shuffled, calibrator.signals, [])
            q.calibrator = calibrator
            self.orders.append(q)

    def start_from_greedy(self, probability: float) -> None:
        """The large greedy pass, with its P(greedy right), as greedy-first's start."""
        for q in self.orders:
            q.start_from(self.large.sample, probability)


class Outcome(msgspec.Struct, frozen=True):
    """One arm on one question: right in what share of its branch orders, at what cost."""

    correct: float
    tokens: float
    large_tokens: float  # of them, the large engine's


class Arm(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    accuracy: float
    low: float  # 95% Wilson interval over questions
    high: float
    mean_tokens: float
    mean_large_tokens: float
    n: int


def arm(name: str, outcomes: Sequence[Outcome]) -> Arm:
    n = len(outcomes)
    accuracy = sum(o.correct for o in outcomes) / n
    # A question's orders mostly agree, so they count as one question, not 8: the
    # interval is over questions, each scored by its share of right orders.
    low, high = wilson(accuracy, n)
    return Arm(
        name=name,
        accuracy=accuracy,
        low=low,
        high=high,
        mean_tokens=sum(o.tokens for o in outcomes) / n,
        mean_large_tokens=sum(o.large_tokens for o in outcomes) / n,
        n=n,
    )


# --- reading the banks -----------------------------------------------------------------


def read_greedy_runs(path: Path) -> dict[str, Run]:
    """bench/bank_greedy.py's records as runs (a record is a Run with one sample and
    fields a Run ignores), by question id; a question banked twice is its last record."""
    decoder = msgspec.json.Decoder(Run)
    runs: dict[str, Run] = {}
    for text, _ in xz_streams(path.read_bytes()):
        for line in text.splitlines():
            if line.strip():
                run = decoder.decode(line)
                runs[run.id] = run
    return runs


def graded(run: Run, greedy: Run) -> Greedy:
    sample = greedy.samples[0]
    answer = extract(run.kind, sample.text)
    tokens = sample.completion_tokens
    return Greedy(
        sample=sample,
        answer=answer,
        correct=answer is not None and is_correct(run.question, sample.text),
        tokens=len(sample.logprobs) if tokens is None else tokens,
    )


def halves(runs: Sequence[Run]) -> tuple[list[Run], list[Run]]:
    """(fitting, held out) of one source: the shipped split of its first 240, and all
    after them held out."""
    fitting, held = split_by_source(
        take_per_source(runs, SPLIT_PER_SOURCE), SPLIT_SHARE, SPLIT_SEED
    )
    rest = take_per_source(runs, len(runs), skip=SPLIT_PER_SOURCE)
    held_ids = {r.id for r in held} | {r.id for r in rest}
    fitting_ids = {r.id for r in fitting}
    return [r for r in runs if r.id in fitting_ids], [r for r in runs if r.id in held_ids]


def items_of(
    runs: Sequence[Run],
    positions: dict[str, int],
    small: dict[str, Run],
    large: dict[str, Run],
    calibrator: Calibrator,
    orders: int,
) -> list[Item]:
    """The runs that both greedy banks answered (a greedy bank still being written may
    lack some), each seeded by its position in its source's bank."""
    return [
        Item(
            positions[run.id],
            run,
            graded(run, small[run.id]),
            graded(run, large[run.id]),
            calibrator,
            orders,
        )
        for run in runs
        if run.id in small and run.id in large
    ]


def load(
    banks: Path, sources: Sequence[str], orders: int, calibrator: Calibrator
) -> tuple[list[Item], list[Item]]:
    fitting: list[Item] = []
    held: list[Item] = []
    for source in sources:
        runs = bank_runs(source, banks)
        positions = {run.id: i for i, run in enumerate(runs)}
        small = read_greedy_runs(banks / "greedy_small" / f"{source}.jsonl.xz")
        large = read_greedy_runs(banks / "greedy_large" / f"{source}.jsonl.xz")
        fit_runs, held_runs = halves(runs)
        fitting += items_of(fit_runs, positions, small, large, calibrator, orders)
        held += items_of(held_runs, positions, small, large, calibrator, orders)
    return fitting, held


def routed(fitting: list[Item], held: list[Item]) -> tuple[list[Item], list[Item], float]:
    """Both halves scored by the bundled router, less the questions it holds among its
    examples; and the router file's threshold."""
    from router.embedder import Embedder, EmbedderSettings
    from router.model_file import read_router
    from router.router import router_file
    from router.scorers import scorer_for
    from router.settings import RouterSettings

    model = read_router(router_file(RouterSettings()))
    examples = set(model.prompts)
    kept = [[i for i in half if i.run.prompt not in examples] for half in (fitting, held)]
    everything = [*kept[0], *kept[1]]
    embedder = Embedder(EmbedderSettings(threads=2, max_batch=128))
    embedder.load()
    prompts = [i.run.prompt for i in everything]
    vectors = embedder.encode(prompts).astype(np.float32)
    for item, score in zip(everything, scorer_for(model).score(vectors, prompts), strict=True):
        item.score = float(score)
    return kept[0], kept[1], model.threshold


# --- P(greedy right) -------------------------------------------------------------------


def greedy_rows(items: Sequence[Item], settings: SignalSettings) -> list[list[float] | None]:
    rows: list[list[float] | None] = []
    for item in items:
        signals = compute_signals(item.run.kind, [item.large.sample], settings=settings)
        try:
            rows.append(signals.features(GREEDY_FEATURES))
        except MissingSignal:  # no logprobs: no evidence, so never stop on it
            rows.append(None)
    return rows


def fit_greedy(items: Sequence[Item], settings: SignalSettings, seed: int = 0) -> GreedyCalibrators:
    """One calibrator per answer kind: the same logprob means a sure letter and an
    unsure worked answer (their slopes differ in sign; one shared fit ranked them no
    better than chance)."""
    calibrators: GreedyCalibrators = {}
    for kind in sorted({item.run.kind for item in items}):
        # The loop never asks about a pass without an answer (its P is 0).
        mine = [i for i in items if i.run.kind == kind and i.large.answer is not None]
        rows = greedy_rows(mine, settings)
        keep = [i for i, row in enumerate(rows) if row is not None]
        sources = sorted({mine[i].source for i in keep})
        calibrators[kind] = fit(
            np.array([rows[i] for i in keep]),
            np.array([mine[i].large.correct for i in keep], dtype=np.float64),
            GREEDY_FEATURES,
            signals=settings,
            isotonic_min=ISOTONIC_MIN,
            seed=seed,
            trained_on=(
                "one greedy pass of the bundled large model (qwen2.5-coder-1.5b-instruct), "
                f"{kind} answers: the fitting half of the trace bank's {' and '.join(sources)}, "
                f"{len(keep)} questions (bench/greedy_first.py)"
            ),
        )
    return calibrators


def greedy_probabilities(items: Sequence[Item], calibrators: GreedyCalibrators) -> list[float]:
    """P(greedy right) as evaluator.loop reads it: the one-branch tally of the greedy
    pass under its kind's calibrator (0 without an answer; a kind without a calibrator,
    or a pass without logprobs, gets its vote share)."""
    return [
        tally(
            item.run.kind,
            [item.large.sample],
            [item.large.answer],
            calibrator=calibrators.get(item.run.kind),
        ).probability
        for item in items
    ]


def fold_probabilities(
    items: Sequence[Item], settings: SignalSettings, folds: int, seed: int
) -> list[float]:
    """Each question's P from calibrators fitted on the other folds only."""
    p = [0.0] * len(items)
    order = np.random.default_rng(seed).permutation(len(items))
    for fold in np.array_split(order, folds):
        inside = set(fold.tolist())
        model = fit_greedy([it for i, it in enumerate(items) if i not in inside], settings, seed)
        mine = [items[i] for i in fold]
        for i, value in zip(fold, greedy_probabilities(mine, model), strict=True):
            p[int(i)] = value
    return p


# --- the arms --------------------------------------------------------------------------


def greedy_arm(items: Sequence[Item], engine: str) -> list[Outcome]:
    passes = [item.small if engine == "small" else item.large for item in items]
    large = 1.0 if engine == "large" else 0.0
    return [Outcome(float(g.correct), float(g.tokens), large * g.tokens) for g in passes]


def policy_arm(items: Sequence[Item], policy: Policy) -> list[Outcome]:
    """A large-engine policy on every question, averaged over its branch orders."""
    outcomes = []
    for item in items:
        runs = [policy(q) for q in item.orders]
        correct = float(np.mean([o.correct for o in runs]))
        tokens = float(np.mean([o.tokens for o in runs]))
        outcomes.append(Outcome(correct, tokens, tokens))
    return outcomes


def majority_arm(items: Sequence[Item], k: int) -> list[Outcome]:
    return policy_arm(items, lambda q: by_majority(q, k))


def replayable(items: Sequence[Item], settings: LoopSettings) -> LoopSettings:
    """The settings with max_rounds cut to the rounds the bank holds, as replay_loop cuts."""
    samples = min(len(item.run.samples) for item in items)
    rounds = min(settings.max_rounds, samples // settings.branches)
    if rounds < 1:
        raise ValueError(f"runs have {samples} samples, fewer than a round of {settings.branches}")
    return replace(settings, max_rounds=rounds)


def loop_arm(items: Sequence[Item], settings: LoopSettings) -> list[Outcome]:
    cut = replayable(items, settings)
    return policy_arm(items, loop_rule(cut, cut.max_rounds))


def greedy_first(loop: LoopSettings, t: float, w: float, rounds: int) -> LoopSettings:
    # t may be NEVER (inf), which no P reaches; replace() does not check the bounds.
    return replace(loop, greedy_first=True, greedy_stop=t, greedy_weight=w, max_rounds=rounds)


def greedy_first_arm(items: Sequence[Item], settings: LoopSettings) -> list[Outcome]:
    return policy_arm(items, greedy_first_rule(settings, settings.max_rounds))


def auto_arm(items: Sequence[Item], threshold: float, large: Sequence[Outcome]) -> list[Outcome]:
    """The router at ``threshold``: the small greedy pass below it, the large path's
    outcome (``large``, per item) at or above it."""
    small = greedy_arm(items, "small")
    return [
        path if item.score >= threshold else own
        for item, path, own in zip(items, large, small, strict=True)
    ]


# --- choosing on the fitting half ------------------------------------------------------


class Setting(msgspec.Struct, frozen=True, kw_only=True):
    t: float  # greedy_stop
    w: float  # greedy_weight
    rounds: int  # sampling rounds after the greedy pass, of the loop's branches each
    accuracy: float
    mean_tokens: float

    @property
    def name(self) -> str:
        if self.t == 0.0:
            return "greedy-first, stopping at the greedy pass (one greedy pass)"
        t = "never" if self.t == NEVER else f"{self.t:g}"
        return f"greedy-first (stop {t}, weight {self.w:g}, up to {self.rounds} rounds)"

    def settings(self, loop: LoopSettings) -> LoopSettings:
        return greedy_first(loop, self.t, self.w, self.rounds)


def sweep(items: Sequence[Item], loop: LoopSettings) -> list[Setting]:
    points = []
    for w in WEIGHTS:
        for r in range(1, replayable(items, loop).max_rounds + 1):
            for t in THRESHOLDS:
                a = arm("", greedy_first_arm(items, greedy_first(loop, t, w, r)))
                points.append(
                    Setting(t=t, w=w, rounds=r, accuracy=a.accuracy, mean_tokens=a.mean_tokens)
                )
    return points


def fewest_tokens_at(points: Sequence[Setting], accuracy: float) -> Setting | None:
    # A hair below: accuracies are means over orders, and equal ones may differ in ulps.
    eligible = [p for p in points if p.accuracy >= accuracy - 1e-9]
    return min(eligible, key=lambda p: (p.mean_tokens, -p.accuracy)) if eligible else None


def by_the_rule(points: Sequence[Setting], reference: Arm) -> Setting:
    """docs/benchmarks.md's rule: the fewest tokens that keep the reference's accuracy
    (t = 0, greedy itself, always does)."""
    chosen = fewest_tokens_at(points, reference.accuracy)
    assert chosen is not None, "the sweep holds t = 0, which is the reference"
    return chosen


def by_the_target(points: Sequence[Setting], reference: Arm) -> Setting:
    """The fewest tokens that reach the reference + 3 points within twice its tokens;
    where none does, the most accurate within twice its tokens (then the cheapest)."""
    affordable = [p for p in points if p.mean_tokens <= TARGET_TOKENS * reference.mean_tokens]
    hit = fewest_tokens_at(affordable, reference.accuracy + TARGET_GAIN)
    if hit is not None:
        return hit
    return max(affordable, key=lambda p: (p.accuracy, -p.mean_tokens))


def router_threshold(items: Sequence[Item], large: Sequence[Outcome], reference: float) -> float:
    """The highest threshold (fewest large-path routes) whose routed accuracy keeps
    ``reference``; 0 (everything large) when none below does."""
    for threshold in sorted({item.score for item in items}, reverse=True):
        a = arm("", auto_arm(items, threshold, large))
        if a.accuracy >= reference - 1e-9:
            return threshold
    return 0.0


# --- the whole measurement -------------------------------------------------------------


def measure(
    fitting: Sequence[Item],
    held: Sequence[Item],
    loop: LoopSettings,
    router_file_threshold: float,
    *,
    folds: int = FOLDS,
    seed: int = 0,
) -> tuple[dict[str, Any], GreedyCalibrators]:
    """Choose on ``fitting``, then every arm on ``held``; and the greedy calibrators
    fitted on the whole fitting half."""
    signals = next(iter(fitting)).orders[0].settings
    for item, p in zip(fitting, fold_probabilities(fitting, signals, folds, seed), strict=True):
        item.start_from_greedy(p)
    reference = arm("large greedy", greedy_arm(fitting, "large"))
    points = sweep(fitting, loop)
    rule = by_the_rule(points, reference)
    target = by_the_target(points, reference)
    # The fitting half's most accurate setting at any cost: what greedy-first can give
    # when tokens do not matter, still chosen without a look at the held-out half.
    richest = max(points, key=lambda p: (p.accuracy, -p.mean_tokens))
    threshold = router_threshold(
        fitting, greedy_first_arm(fitting, rule.settings(loop)), reference.accuracy
    )

    greedy_model = fit_greedy(fitting, signals, seed)
    p_held = greedy_probabilities(held, greedy_model)
    for item, p in zip(held, p_held, strict=True):
        item.start_from_greedy(p)

    def arms_on(items: Sequence[Item]) -> dict[str, list[Outcome]]:
        samples = min(len(item.run.samples) for item in items)
        sampling_loop = loop_arm(items, loop)
        chosen = {
            f"{s.name}: {why}": greedy_first_arm(items, s.settings(loop))
            for s, why in (
                (rule, "the rule's choice"),
                (target, "the target's choice"),
                (richest, "most accurate on fitting"),
            )
        }
        default_path = greedy_first_arm(items, rule.settings(loop))
        return {
            "small greedy": greedy_arm(items, "small"),
            "large greedy": greedy_arm(items, "large"),
            **{f"majority of {k} at 0.7": majority_arm(items, k) for k in range(1, samples + 1)},
            f"the sampling loop (stop at {loop.threshold:g}, {loop.branches} a round)": (
                sampling_loop
            ),
            **chosen,
            f"auto, router at {router_file_threshold:.4f}, the sampling loop": (
                auto_arm(items, router_file_threshold, sampling_loop)
            ),
            f"auto, router at {router_file_threshold:.4f}, large path: the rule's choice": (
                auto_arm(items, router_file_threshold, default_path)
            ),
            f"auto, router at {threshold:.4f} (the rule's), large path: the rule's choice": (
                auto_arm(items, threshold, default_path)
            ),
        }

    def report_on(items: Sequence[Item]) -> dict[str, Any]:
        outcomes = arms_on(items)
        large = outcomes["large greedy"]
        return {
            "questions": len(items),
            "arms": [msgspec.to_builtins(arm(name, o)) for name, o in outcomes.items()],
            # Paired on the same questions: far tighter than two arms' intervals.
            "against_large_greedy": {
                name: paired(o, large) for name, o in outcomes.items() if name != "large greedy"
            },
            "routed_large": {
                name: float(np.mean([i.score >= t for i in items]))
                for name, t in (
                    ("router file's threshold", router_file_threshold),
                    ("the rule's threshold", threshold),
                )
            },
            "headroom": headroom(items),
        }

    sources = sorted({item.source for item in held})
    labels = [item.large.correct for item in held]
    report = {
        "sources": sources,
        "fitting_questions": len(fitting),
        "orders": len(held[0].orders),
        "fitting_reference": msgspec.to_builtins(reference),
        "rule_choice": _setting(rule),
        "target_choice": _setting(target),
        "most_accurate_on_fitting": _setting(richest),
        "router_file_threshold": router_file_threshold,
        "router_threshold_by_the_rule": threshold,
        "stopped_at_greedy_held_out": {
            s.name: sum(p >= s.t for p in p_held) / len(held) for s in (rule, target, richest)
        },
        # How well P(greedy right) separates, held out.
        "greedy_p_held_out": {
            kind: msgspec.to_builtins(
                calibration(
                    [p for p, i in zip(p_held, held, strict=True) if i.run.kind == kind],
                    [c for c, i in zip(labels, held, strict=True) if i.run.kind == kind],
                )
            )
            for kind in sorted({i.run.kind for i in held})
        },
        "held_out": {
            "all": report_on(held),
            **{s: report_on([i for i in held if i.source == s]) for s in sources},
        },
        "fitting_sweep": [_setting(p) for p in points],
    }
    return report, greedy_model


def paired(outcomes: Sequence[Outcome], reference: Sequence[Outcome]) -> dict[str, float]:
    """Accuracy less the reference's on the same questions, with its standard error,
    and the ratios of their mean tokens (all, and the large engine's)."""
    gaps = np.array([o.correct - r.correct for o, r in zip(outcomes, reference, strict=True)])
    return {
        "accuracy_gain": float(gaps.mean()),
        "standard_error": float(gaps.std(ddof=1) / math.sqrt(len(gaps))),
        "token_ratio": sum(o.tokens for o in outcomes) / sum(r.tokens for r in reference),
        "large_token_ratio": (
            sum(o.large_tokens for o in outcomes) / sum(r.large_tokens for r in reference)
        ),
    }


def headroom(items: Sequence[Item]) -> dict[str, float]:
    """How the greedy answer and the majority of all samples differ, per question
    (averaged over branch orders): what a loop that starts from greedy can win or lose."""
    samples = min(len(item.run.samples) for item in items)
    majority = [o.correct for o in majority_arm(items, samples)]
    greedy = [item.large.correct for item in items]
    wins = [m for m, g in zip(majority, greedy, strict=True) if not g]
    losses = [1 - m for m, g in zip(majority, greedy, strict=True) if g]
    return {
        "greedy_wrong_majority_right": sum(wins) / len(items),
        "greedy_right_majority_wrong": sum(losses) / len(items),
        "oracle_of_the_two": (sum(greedy) + sum(wins)) / len(items),
    }


def _setting(p: Setting) -> dict[str, Any]:
    return {
        "name": p.name,
        "greedy_stop": None if p.t == NEVER else p.t,
        "greedy_weight": p.w,
        "max_rounds": p.rounds,
        "accuracy": p.accuracy,
        "mean_tokens": p.mean_tokens,
    }


SOURCE_NAMES = {"all": "all", "arc_challenge": "ARC-Challenge", "gsm8k": "GSM8K"}


def render(report: dict[str, Any]) -> str:
    lines = []
    for part, figures in report["held_out"].items():
        lines += [
            f"held out, {SOURCE_NAMES.get(part, part)}: {figures['questions']} questions, "
            f"{report['orders']} branch orders each",
            "",
            "| arm | accuracy (95% CI) | tokens / question | large-model tokens "
            "| against large greedy (paired) |",
            "|---|---|---|---|---|",
        ]
        for a in figures["arms"]:
            gain = figures["against_large_greedy"].get(a["name"])
            versus = "" if gain is None else versus_greedy(gain)
            lines.append(
                f"| {a['name']} | {a['accuracy']:.1%} ({a['low']:.1%}-{a['high']:.1%}) "
                f"| {a['mean_tokens']:.1f} | {a['mean_large_tokens']:.1f} | {versus} |"
            )
        lines += [
            "",
            "routed large: "
            + ", ".join(f"{k} {v:.1%}" for k, v in figures["routed_large"].items()),
            "greedy against the majority of all samples: "
            + ", ".join(f"{k} {v:.1%}" for k, v in figures["headroom"].items()),
            "",
        ]
    ref = report["fitting_reference"]
    lines += [
        f"fitting halves ({report['fitting_questions']} questions): large greedy "
        f"{ref['accuracy']:.1%} at {ref['mean_tokens']:.1f} tokens",
        *(
            f"{why}: {s['name']}, {s['accuracy']:.1%} at {s['mean_tokens']:.1f} tokens"
            for why, s in (
                ("the rule's choice", report["rule_choice"]),
                ("the target's choice", report["target_choice"]),
                ("most accurate", report["most_accurate_on_fitting"]),
            )
        ),
        f"router threshold: the file's {report['router_file_threshold']:.3f}, "
        f"the rule's {report['router_threshold_by_the_rule']:.3f}",
        "held out, answered by the greedy pass alone: "
        + ", ".join(f"{k} {v:.1%}" for k, v in report["stopped_at_greedy_held_out"].items()),
        *(
            f"held out, P(greedy right), {kind}: "
            + ", ".join(f"{k} {v:.3f}" for k, v in metrics.items() if v is not None)
            for kind, metrics in report["greedy_p_held_out"].items()
        ),
    ]
    return "\n".join(lines)


def versus_greedy(gain: dict[str, float]) -> str:
    return (
        f"{100 * gain['accuracy_gain']:+.1f} pts (SE {100 * gain['standard_error']:.1f}), "
        f"{gain['token_ratio']:.2f}x tokens, {gain['large_token_ratio']:.2f}x large"
    )


def plot(report: dict[str, Any], path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    parts = list(report["held_out"].items())
    figure, panels = plt.subplots(1, len(parts), figsize=(6 * len(parts), 6.2))
    axes = np.atleast_1d(panels)
    for panel, (part, figures) in zip(axes, parts, strict=True):
        _panel(panel, figures, SOURCE_NAMES.get(part, part), matplotlib.ticker)
    # One legend for every panel (the arms are the same), below them.
    handles, labels = axes[0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=3, fontsize=8)
    figure.tight_layout(rect=(0, 0.17, 1, 1))
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _panel(axes: Any, figures: dict[str, Any], title: str, ticker: Any) -> None:
    arms = figures["arms"]
    majority = [a for a in arms if a["name"].startswith("majority of")]
    others = [a for a in arms if a not in majority]

    def bars(a: list[dict[str, Any]]) -> list[list[float]]:
        return [
            [100 * (x["accuracy"] - x["low"]) for x in a],
            [100 * (x["high"] - x["accuracy"]) for x in a],
        ]

    axes.errorbar(
        [a["mean_tokens"] for a in majority],
        [100 * a["accuracy"] for a in majority],
        yerr=bars(majority),
        marker=".",
        color="grey",
        capsize=2,
        label="majority of k = 1..8 at 0.7",
    )
    markers: dict[str, tuple[str, int, str]] = {
        "greedy-first": ("D", 10, "none"),
        "auto": ("s", 8, "none"),
    }
    for a in others:
        # Open and larger, so that a setting on top of another point still shows.
        marker, size, fill = markers.get(a["name"].split(" ")[0].rstrip(","), ("o", 6, "full"))
        axes.errorbar(
            [a["mean_tokens"]],
            [100 * a["accuracy"]],
            yerr=bars([a]),
            marker=marker,
            markersize=size,
            fillstyle=fill,
            capsize=3,
            label=a["name"],
        )
    axes.set_xscale("log")
    plain = ticker.FuncFormatter(lambda x, _: f"{x:g}")
    axes.xaxis.set_major_formatter(plain)
    axes.xaxis.set_minor_formatter(plain)
    axes.tick_params(axis="x", which="minor", labelsize=7)
    axes.set_xlabel("mean completion tokens per question, both engines (log)")
    axes.set_ylabel("accuracy (%), 95% Wilson interval")
    axes.set_title(f"{title}: {figures['questions']} held-out questions, replayed")
    axes.grid(alpha=0.3)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--banks", type=Path, default=BANKS, help="default: %(default)s")
    parser.add_argument("--sources", nargs="+", default=list(SOURCES), choices=SOURCES)
    parser.add_argument(
        "--orders",
        type=int,
        default=DEFAULT_ORDERS,
        help="branch orders per question; 0: the bank's own (default: %(default)s)",
    )
    parser.add_argument("--folds", type=int, default=FOLDS, help="greedy P's folds, fitting half")
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--plot", help="draw accuracy against tokens here (PNG)")
    parser.add_argument(
        "--calibrator-out",
        type=Path,
        help="write the greedy calibrators fitted on the fitting halves into this folder, "
        "as greedy_<kind>.calibrator",
    )
    args = parser.parse_args(argv)
    config = load_config()
    if config.loop is None or config.loop.calibrator is None:
        raise SystemExit("error: the embedded default has no loop with a calibrator")
    calibrator = read_calibrator(calibrator_file(config.loop.calibrator))
    # The sampling loop's own settings, whatever greedy-first mode the config is in.
    loop = config.loop.sampling()
    fitting, held = load(args.banks, args.sources, args.orders, calibrator)
    fitting, held, threshold = routed(fitting, held)
    report, greedy_model = measure(fitting, held, loop, threshold, folds=args.folds)
    print(render(report))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    if args.plot:
        plot(report, args.plot)
    if args.calibrator_out:
        for kind, model in greedy_model.items():
            write_calibrator(model, args.calibrator_out / f"greedy_{kind}.calibrator")
    return 0


if __name__ == "__main__":
    sys.exit(main())
