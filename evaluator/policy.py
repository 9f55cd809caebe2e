"""The reasoning loop's decisions, as pure functions of what its branches said.

Two questions, answered the same way live (evaluator.loop) and in replay over the
trace bank (evaluator.replay), so that the bank's figures are the loop's own:

* which answer the branches so far give, and how likely it is right (``tally``): a
  confidence-weighted vote over the branches that survive DeepConf's filter, whose
  signals the calibrator turns into P(correct);
* whether to go on (``stop_reason``): confident enough, out of rounds, out of tokens,
  or out of time for another round at the speed measured so far.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Annotated, Literal

import msgspec

from evaluator.answers import AnswerKind
from evaluator.calibration import Calibrator
from evaluator.signals import (
    DEFAULT_SETTINGS,
    MissingSignal,
    Probe,
    Signals,
    SignalSettings,
    Trace,
    TraceConfidence,
    compute_signals,
    probe_streak,
    trace_confidence,
)

Probability = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
Positive = Annotated[int, msgspec.Meta(ge=1)]


class LoopSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What SREs tune about the loop on the large engine (docs/architecture.md,
    "Configuration")."""

    # Stop as soon as the calibrated P(correct) of the leading answer reaches this.
    threshold: Probability = 0.9
    # Branches generated concurrently per round; ``hard_branches`` from
    # ``hard_difficulty`` up (the router's score), where one round rarely settles it.
    branches: Positive = 4
    # Branches per round from hard_difficulty up; null: always `branches`.
    hard_branches: Positive | None = None
    # The router's difficulty score from which hard_branches apply.
    hard_difficulty: Probability = 0.9
    # Most rounds the loop runs before it answers with what it has (with greedy_first,
    # sampling rounds: the greedy pass is not counted).
    max_rounds: Positive = 4
    # Most tokens one branch may generate in one round.
    round_tokens: Positive = 64
    # Most tokens a request may spend over all rounds, probes and the greedy pass
    # included.
    token_budget: Positive = 1024
    # Stop when a round raised P(correct) by less than this: more of the same samples
    # are not changing the evaluator's mind. null: only the rules above stop.
    min_gain: Probability | None = None
    # Sampling temperature of the branches: they vote, so they must differ.
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] = 0.7
    # DeepConf's filter: a branch whose lowest group confidence falls below this is
    # stopped (mid-generation once it has a full window) and left out of the vote.
    # null keeps every branch.
    prune_below: float | None = None
    # "bundled": the calibrator fitted for the bundled large model
    # (evaluator/data/default.calibrator); or a file from `satisfice evaluator fit`;
    # null: the raw vote share stands in for P(correct).
    calibrator: str | None = "bundled"
    # For reasoning models: a branch that round_tokens cut off goes on in the next
    # round (its text sent back as the start of the assistant's turn), and after each
    # round it is asked for its answer so far -- a probe of at most 20 tokens, counted
    # in the budget; it votes that answer, and stops once its last probe_agreement
    # (the calibrator's signal settings) probes agree (Dynasor-CoT). Needs an engine
    # that continues an assistant turn: llama_cpp, or openai_http with api: completions.
    probes: bool = False
    # Easy questions answered by the small engine go to the loop after all when the
    # calibrator gives that answer less than this; null never escalates.
    escalate_below: Probability | None = None
    # Stream a provisional first answer from the small engine while the loop thinks
    # (in reasoning_content, marked; the loop's answer then confirms or replaces it).
    # Off by default: on a 2-core host the small engine takes CPU from the loop's
    # branches (docs/benchmarks.md, "Answer while thinking").
    first_answer: bool = False
    # Start with one branch at temperature 0 (the large engine's greedy answer, with
    # logprobs), whatever `branches` says; sampling rounds follow only when it is
    # unlikely to be right (greedy_stop). Not combined with probes: the greedy pass
    # would go on at `temperature` in the next round.
    greedy_first: bool = False
    # With greedy_first: stop after the greedy pass when P(greedy right) reaches this
    # (an unanswered pass has P 0, so 0 stops after it whatever it said). The vote's
    # `threshold` does not apply to that pass alone.
    greedy_stop: Probability = 0.0
    # With greedy_first: the greedy pass's vote in every later round weighs this times
    # its own confidence; 0 leaves it out of the vote.
    greedy_weight: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0
    # With greedy_first: P(greedy right) from "bundled", the calibrators fitted for the
    # bundled large model's greedy answers by answer kind (evaluator/data/greedy_*.
    # calibrator: choice and number; another kind's pass always stops), or one file
    # from `satisfice evaluator fit` for every kind; null: its one-branch vote share
    # (1 for an answer) stands in.
    greedy_calibrator: str | None = "bundled"

    def __post_init__(self) -> None:
        if self.greedy_first and self.probes:
            raise ValueError("greedy_first and probes cannot be combined")

    def sampling(self) -> LoopSettings:
        """These settings without the greedy pass: the sampling rounds alone, which a
        trace bank of samples replays (evaluator.replay.loop_rule)."""
        return msgspec.structs.replace(self, greedy_first=False)

    def greedy_calibrator_in_use(self) -> str | None:
        """The greedy calibrator the loop reads: none without greedy_first."""
        return self.greedy_calibrator if self.greedy_first else None

    def branches_for(self, difficulty: float | None) -> int:
        hard = difficulty is not None and difficulty >= self.hard_difficulty
        return self.hard_branches if hard and self.hard_branches is not None else self.branches


class Verdict(msgspec.Struct, frozen=True, kw_only=True):
    """The loop's answer after a round: what it is, how sure, and on what evidence."""

    answer: str | None  # normalised, as evaluator.answers extracts it
    text: str  # the most confident branch's own text for that answer
    probability: float  # calibrated P(correct), or the vote share without a calibrator
    signals: Signals
    kept: int  # branches that voted
    pruned: int  # branches DeepConf's filter left out


def branch_confidence(trace: TraceConfidence) -> float | None:
    """The value DeepConf's filter compares and its vote weighs: the lowest group
    confidence (its C_least), which catches a branch that lost its way anywhere."""
    return trace.lowest_group


def weighed(trace: TraceConfidence, weight: float) -> TraceConfidence:
    """``trace`` with its vote weight (its lowest group confidence, as
    ``branch_confidence`` reads it) times ``weight``: the greedy_first pass's vote."""
    if weight == 1.0 or trace.lowest_group is None:
        return trace
    return msgspec.structs.replace(trace, lowest_group=weight * trace.lowest_group)


def tally(
    kind: AnswerKind,
    branches: Sequence[Trace],
    answers: Sequence[str | None],
    *,
    calibrator: Calibrator | None = None,
    prune_below: float | None = None,
    traces: Sequence[TraceConfidence] | None = None,
    settings: SignalSettings | None = None,
    probes: Sequence[Sequence[Probe]] | None = None,
) -> Verdict:
    """The confidence-weighted vote of ``branches`` (DeepConf's weighted majority over
    the branches its filter keeps) and that answer's P(correct).

    ``answers`` are the branches' extracted answers, ``traces`` their confidences when
    the caller has them already. A branch without logprobs weighs 1 and is never
    filtered; if the filter would leave nothing, every branch votes. Signals are
    computed with the calibrator's settings (``settings`` when there is none).
    ``probes`` are each branch's probes, oldest first: the answer's probe streak is
    the longest run of agreeing probes at the end of any branch that gives it.
    """
    if not branches:
        raise ValueError("a tally of no branches")
    if settings is None:
        settings = signal_settings(calibrator)
    if traces is None:
        traces = [trace_confidence(b.logprobs, settings) for b in branches]
    scores = [branch_confidence(t) for t in traces]
    keep = _kept(scores, prune_below)
    candidate = _weighted_majority(scores, answers, keep)
    signals = _vote_signals(kind, branches, answers, keep, candidate, probes, settings)
    return Verdict(
        answer=candidate,
        text=branches[_most_confident(scores, answers, keep, candidate)].text,
        probability=_probability(candidate, signals, calibrator),
        signals=signals,
        kept=len(keep),
        pruned=len(branches) - len(keep),
    )


def _kept(scores: Sequence[float | None], prune_below: float | None) -> list[int]:
    """The branches DeepConf's filter keeps: every one when it would keep none."""
    kept = [
        i
        for i, score in enumerate(scores)
        if prune_below is None or score is None or score >= prune_below
    ]
    return kept or list(range(len(scores)))


def _weighted_majority(
    scores: Sequence[float | None], answers: Sequence[str | None], keep: Sequence[int]
) -> str | None:
    """The answer with the most confidence behind it among the kept branches."""
    weights: dict[str, float] = {}
    for i in keep:
        answer, score = answers[i], scores[i]
        if answer is not None:
            # Token confidence is -mean log-prob of the top-k alternatives: positive,
            # larger when the model was sure. A branch without logprobs weighs 1.
            weight = 1.0 if score is None else max(score, 1e-6)
            weights[answer] = weights.get(answer, 0.0) + weight
    # max keeps the first-seen answer among equal weights, as the plain majority does.
    return max(weights, key=weights.__getitem__) if weights else None


def _vote_signals(
    kind: AnswerKind,
    branches: Sequence[Trace],
    answers: Sequence[str | None],
    keep: Sequence[int],
    candidate: str | None,
    probes: Sequence[Sequence[Probe]] | None,
    settings: SignalSettings,
) -> Signals:
    """The signals of the kept branches' vote for ``candidate``."""
    streak = None
    if probes is not None:
        kept_probes = [probes[i] for i in keep]
        streak = max(kept_probes, key=lambda p: probe_streak(p, candidate), default=[])
    signals = compute_signals(
        kind,
        [branches[i] for i in keep],
        candidate=candidate,
        answers=[answers[i] for i in keep],
        probes=streak,
        settings=settings,
    )
    if probes is None:
        return signals
    # Every probe of the round counts in its cost, not only the streak's own.
    probe_tokens = sum(probe.tokens for branch in probes for probe in branch)
    return msgspec.structs.replace(signals, probe_tokens=probe_tokens)


def _probability(candidate: str | None, signals: Signals, calibrator: Calibrator | None) -> float:
    if candidate is None:
        # Nothing to be right about (every branch came back without an answer).
        return 0.0
    if calibrator is None:
        return signals.vote_share
    try:
        return calibrator.probability(signals)
    except MissingSignal:
        # The engine gave no logprobs (or no alternatives) this time: the vote
        # share is all the evidence there is.
        return signals.vote_share


def _most_confident(
    scores: Sequence[float | None],
    answers: Sequence[str | None],
    keep: Sequence[int],
    candidate: str | None,
) -> int:
    """The kept branch that gives ``candidate`` most confidently (any kept branch
    when none gives it); a branch without logprobs ranks below any that has them."""
    rank_of = [-math.inf if score is None else score for score in scores]
    behind = [i for i in keep if answers[i] == candidate] or list(keep)
    return max(behind, key=rank_of.__getitem__)


# "greedy": a greedy_first loop kept its greedy pass (P(greedy right) reached
# greedy_stop), an early stop whose P is the greedy calibrator's, not the vote's.
StopReason = Literal["confident", "greedy", "max_rounds", "token_budget", "no_gain", "deadline"]


def stop_reason(
    verdict: Verdict | None,
    *,
    rounds: int,
    tokens: int,
    next_round_tokens: float,
    settings: LoopSettings,
    time_left_s: float | None = None,
    next_round_s: float | None = None,
    previous: Verdict | None = None,
) -> StopReason | None:
    """Why the loop stops after ``rounds`` rounds that spent ``tokens``, or None to go on;
    ``verdict`` is None while no branch has answered.

    ``next_round_tokens`` and ``next_round_s`` are what another round is expected to
    cost, from what the rounds so far measured: a round that the budget or the clock
    cannot afford is not started. ``previous`` is the verdict a round earlier.
    """
    if (
        verdict is not None
        and verdict.answer is not None
        and verdict.probability >= settings.threshold
    ):
        return "confident"
    if rounds >= settings.max_rounds:
        return "max_rounds"
    gain = None
    if verdict is not None and previous is not None:
        gain = verdict.probability - previous.probability
    if settings.min_gain is not None and gain is not None and gain < settings.min_gain:
        return "no_gain"
    if tokens + next_round_tokens > settings.token_budget:
        return "token_budget"
    if time_left_s is not None and (
        time_left_s <= 0 or (next_round_s is not None and next_round_s > time_left_s)
    ):
        return "deadline"
    return None


def signal_settings(calibrator: Calibrator | None) -> SignalSettings:
    return calibrator.signals if calibrator is not None else DEFAULT_SETTINGS
