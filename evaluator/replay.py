"""Stopping policies replayed over a trace bank, one question at a time.

A trace bank (`satisfice evaluator bank`) holds, per labelled question, N samples drawn
independently with their token logprobs. Any policy that draws samples one after the
other, or in rounds, and stops on what it has seen can be replayed on it exactly:
branch i of a question is its sample i, a round of k branches takes the next k samples.

Here: a question prepared once (its answers, trace confidences, token costs, the
branches DeepConf's filter cuts, memoised tallies), and the policies, each a function
from a question to the answer it stops with and what that cost. The loop's own rule
(``loop_rule``) takes evaluator.policy's decisions round after round, as
evaluator.loop does. evaluator.replay_report sweeps them over a whole bank.

With ``prune_below`` set, a branch stops at the first token where its sliding-window
group confidence (once a window is full) falls below the cut-off, as evaluator.loop
stops it: its tokens count to that point and it does not vote; ``tally``'s own filter
then leaves out finished branches whose lowest group confidence is below the cut-off.
As in the loop, the answer is the last round's, or the most probable round's when the
last has none.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec
import numpy as np

from evaluator.answers import extract, is_correct
from evaluator.calibration import Calibrator
from evaluator.policy import LoopSettings, Verdict, stop_reason, tally, weighed
from evaluator.runs import Run, RunSample
from evaluator.signals import (
    LowConfidenceWatch,
    MissingSignal,
    Signals,
    SignalSettings,
    TraceConfidence,
    beta_stop,
    compute_signals,
    majority,
    trace_confidence,
)

# Large enough that only confidence and max_rounds stop the loop in replay.
NO_BUDGET = 10**9
# Random branch orders per question that a replay averages over.
DEFAULT_ORDERS = 8


# --- one question, prepared once -------------------------------------------------------


class Branch(msgspec.Struct, frozen=True, kw_only=True):
    """A sample as the loop sees it: whole, or stopped mid-generation by the filter."""

    sample: RunSample
    answer: str | None
    trace: TraceConfidence
    tokens: int  # what generating it cost
    stopped: bool = False  # cut mid-generation: it does not vote


class GreedyPass(msgspec.Struct, frozen=True, kw_only=True):
    """The large engine's greedy answer to a question, which a greedy-first loop starts
    from, and its calibrated P(greedy right)."""

    branch: Branch
    probability: float


class Question:
    """A run with everything the policies read computed once: extracted answers, trace
    confidences, token costs, the branches cut at each cut-off, and memoised tallies."""

    def __init__(
        self, index: int, run: Run, settings: SignalSettings, cutoffs: Sequence[float]
    ) -> None:
        self.index = index  # the run's position in the bank
        self.run = run
        self.settings = settings
        self.calibrator: Calibrator | None = None
        self.whole = [_branch(run, s, settings) for s in run.samples]
        self.answers = [b.answer for b in self.whole]
        self.tokens = [b.tokens for b in self.whole]
        self._texts: dict[str | None, str] = {}
        for branch in self.whole:
            self._texts.setdefault(branch.answer, branch.sample.text)
        self.cut: dict[float | None, list[Branch]] = {None: self.whole}
        for cutoff in cutoffs:
            self.cut[cutoff] = [self._pruned(b, cutoff) for b in self.whole]
        self._grades: dict[str | None, bool] = {}
        self._tallies: dict[tuple[int, float | None], Verdict | None] = {}
        self._probabilities: dict[tuple[int, str | None], float] = {}
        self.greedy: GreedyPass | None = None
        self._with_greedy: dict[tuple[int, float], Verdict] = {}

    def start_from(self, greedy: RunSample, probability: float) -> None:
        """Give the question the greedy pass a greedy-first loop starts from, with its
        P(greedy right) from a greedy calibrator."""
        branch = _branch(self.run, greedy, self.settings)
        self.greedy = GreedyPass(branch=branch, probability=probability)
        self._texts.setdefault(branch.answer, greedy.text)
        self._with_greedy.clear()

    def _pruned(self, branch: Branch, cutoff: float) -> Branch:
        end = stop_point(branch.sample, cutoff, self.settings)
        if end is None or end >= branch.tokens:
            return branch
        return msgspec.structs.replace(branch, tokens=end, stopped=True)

    def correct(self, answer: str | None) -> bool:
        """Grading depends only on the extracted answer, so one text that gave it will do."""
        if answer is None:
            return False
        if answer not in self._grades:
            self._grades[answer] = is_correct(self.run.question, self._texts[answer])
        return self._grades[answer]

    def verdict(self, n: int, cutoff: float | None = None) -> Verdict | None:
        """The loop's tally of the first ``n`` branches under the cut-off (None: no
        filter); None when every one of them was stopped mid-generation."""
        key = (n, cutoff)
        if key not in self._tallies:
            voting = [b for b in self.cut[cutoff][:n] if not b.stopped]
            verdict = None
            if voting:
                verdict = tally(
                    self.run.kind,
                    [b.sample for b in voting],
                    [b.answer for b in voting],
                    prune_below=cutoff,
                    traces=[b.trace for b in voting],
                    settings=self.settings,
                )
                # What tally does with a calibrator, but a round whose branches all
                # came back empty (no answer, no logprobs) gets P = 0, not an error.
                p = self._calibrated(verdict.signals)
                verdict = msgspec.structs.replace(verdict, probability=p)
            self._tallies[key] = verdict
        return self._tallies[key]

    def whole_verdict(self, n: int) -> Verdict:
        """The unfiltered tally of the first ``n`` branches (never None)."""
        verdict = self.verdict(n)
        assert verdict is not None
        return verdict

    def greedy_verdict(self, n: int, weight: float) -> Verdict:
        """The tally of the greedy pass and the first ``n`` whole branches, the greedy
        branch's vote weighing ``weight`` times its own confidence (0: left out), as
        evaluator.loop's greedy-first rounds tally."""
        if weight == 0.0:
            return self.whole_verdict(n)
        key = (n, weight)
        if key not in self._with_greedy:
            assert self.greedy is not None, "start_from gives the greedy pass first"
            greedy = self.greedy.branch
            own = weighed(greedy.trace, weight)
            verdict = tally(
                self.run.kind,
                [greedy.sample, *(b.sample for b in self.whole[:n])],
                [greedy.answer, *self.answers[:n]],
                traces=[own, *(b.trace for b in self.whole[:n])],
                settings=self.settings,
            )
            p = self._calibrated(verdict.signals)
            self._with_greedy[key] = msgspec.structs.replace(verdict, probability=p)
        return self._with_greedy[key]

    def probability(self, n: int, answer: str | None) -> float:
        """Calibrated P(correct) of ``answer`` given the first ``n`` whole samples, for
        policies that choose their answer by another rule than the loop's tally."""
        key = (n, answer)
        if key not in self._probabilities:
            signals = compute_signals(
                self.run.kind,
                [b.sample for b in self.whole[:n]],
                candidate=answer,
                answers=self.answers[:n],
                settings=self.settings,
            )
            self._probabilities[key] = self._calibrated(signals)
        return self._probabilities[key]

    def _calibrated(self, signals: Signals) -> float:
        if self.calibrator is None:
            return signals.vote_share
        try:
            return self.calibrator.probability(signals)
        except MissingSignal:
            return 0.0 if signals.answer is None else signals.vote_share


def branch_orders(run: Run, samples: int, orders: int, seed: int) -> list[Run]:
    """The run's first ``samples`` samples in ``orders`` seeded random orders, or as
    stored when ``orders`` is 0.

    In random orders each position is a fair draw, and several orders average out
    which draws come first. (Banks from before `satisfice evaluator bank` seeded each
    question on its own drew sample i of every question with the same seed; replayed
    in stored order they would measure those seeds, not a policy.)
    """
    kept = run.samples[:samples]
    if orders == 0:
        return [msgspec.structs.replace(run, samples=kept)]
    rng = np.random.default_rng(seed)
    return [
        msgspec.structs.replace(run, samples=tuple(kept[i] for i in rng.permutation(samples)))
        for _ in range(orders)
    ]


def _branch(run: Run, sample: RunSample, settings: SignalSettings) -> Branch:
    tokens = sample.completion_tokens
    return Branch(
        sample=sample,
        answer=extract(run.kind, sample.text),
        trace=trace_confidence(sample.logprobs, settings),
        tokens=len(sample.logprobs) if tokens is None else tokens,
    )


def stop_point(sample: RunSample, cutoff: float, settings: SignalSettings) -> int | None:
    """Tokens generated when DeepConf's filter would stop this sample: at the first token
    whose window of ``group_window`` token confidences (once full) averages below
    ``cutoff``; None when it never does. Tokens without alternatives have no confidence
    and do not fill the window."""
    watch = LowConfidenceWatch(cutoff, settings)
    for position, token in enumerate(sample.logprobs):
        if watch.feed(token):
            return position + 1
    return None


# --- policies: one outcome per question ------------------------------------------------


class PolicyOutcome(msgspec.Struct, frozen=True):
    answer: str | None
    correct: bool
    tokens: int
    branches: int
    probability: float  # calibrated P(correct) of the answer, at the stopping point


Policy = Callable[[Question], PolicyOutcome]


def by_majority(q: Question, n: int) -> PolicyOutcome:
    answer = majority(q.answers[:n])
    return PolicyOutcome(answer, q.correct(answer), sum(q.tokens[:n]), n, q.probability(n, answer))


def by_verdict(
    q: Question, n: int, verdict: Verdict | None, cutoff: float | None = None
) -> PolicyOutcome:
    tokens = sum(b.tokens for b in q.cut[cutoff][:n])
    if verdict is None:
        return PolicyOutcome(None, False, tokens, n, 0.0)
    return PolicyOutcome(verdict.answer, q.correct(verdict.answer), tokens, n, verdict.probability)


def fixed_plain(k: int) -> Policy:
    return lambda q: by_majority(q, k)


def fixed_weighted(k: int) -> Policy:
    return lambda q: by_verdict(q, k, q.whole_verdict(k))


def beta(threshold: float, samples: int) -> Policy:
    def policy(q: Question) -> PolicyOutcome:
        n = next(
            (n for n in range(1, samples) if beta_stop(q.answers[:n], threshold)),
            samples,
        )
        return by_majority(q, n)

    return policy


def esc(window: int, samples: int) -> Policy:
    """ESC's stop: a window whose answers are all one (its entropy is zero); an
    unanswered sample breaks unanimity."""

    def policy(q: Question) -> PolicyOutcome:
        for end in range(window, samples, window):
            chunk = q.answers[end - window : end]
            if chunk[0] is not None and all(a == chunk[0] for a in chunk):
                return by_majority(q, end)
        return by_majority(q, samples)

    return policy


def signal_alone(name: str, threshold: float, branches: int, rounds: int) -> Policy:
    def policy(q: Question) -> PolicyOutcome:
        n = rounds * branches
        for r in range(1, rounds + 1):
            value = getattr(q.whole_verdict(r * branches).signals, name)
            if value is not None and value >= threshold:
                n = r * branches
                break
        return by_verdict(q, n, q.whole_verdict(n))

    return policy


def loop_rule(
    settings: LoopSettings,
    rounds: int,
    *,
    stable: float | None = None,
) -> Policy:
    """evaluator.policy's own decisions, round after round, as evaluator.loop takes them.

    One stop that policy.stop_reason does not have, a proposal measured here: with
    ``stable``, stop once the vote is settled, when Adaptive-Consistency's P(the leading
    answer stays ahead) reaches it, however unlikely that answer is to be right."""
    if settings.greedy_first:
        raise ValueError(
            "greedy_first starts from a greedy pass that a bank of samples does not hold: "
            "replay the sampling rounds (LoopSettings.sampling) or greedy_first_rule"
        )

    def policy(q: Question) -> PolicyOutcome:
        cutoff = settings.prune_below
        best: Verdict | None = None
        last: Verdict | None = None
        for r in range(1, rounds + 1):
            n = r * settings.branches
            spent = sum(b.tokens for b in q.cut[cutoff][:n])
            verdict = q.verdict(n, cutoff)
            if verdict is not None and (best is None or verdict.probability >= best.probability):
                best = verdict
            reason = stop_reason(
                verdict,
                rounds=r,
                tokens=spent,
                next_round_tokens=settings.branches * spent / n,
                settings=settings,
                previous=last,
            )
            settled = (
                stable is not None
                and verdict is not None
                and verdict.signals.majority_probability >= stable
            )
            last = verdict
            if reason is not None or settled:
                final = verdict if verdict is not None and verdict.answer is not None else best
                return by_verdict(q, n, final, cutoff)
        raise AssertionError("stop_reason stops at max_rounds")

    return policy


def greedy_first_rule(settings: LoopSettings, rounds: int) -> Policy:
    """evaluator.loop's greedy-first mode, as it takes its decisions: the greedy pass
    (``Question.start_from``) is the answer when P(greedy right) reaches
    ``greedy_stop``; otherwise up to ``rounds`` rounds of the question's branches, each
    tallied with the greedy branch at ``greedy_weight`` and stopped by
    policy.stop_reason, the greedy pass's tokens counted in the budget. (The live loop
    also counts the greedy pass's verdict as a best-so-far; the two differ only where a
    last round has no answer at all.)"""
    if settings.prune_below is not None:
        raise ValueError("greedy-first replay does not prune (prune_below must be null)")

    def policy(q: Question) -> PolicyOutcome:
        greedy = q.greedy
        assert greedy is not None, "start_from gives the greedy pass first"
        first = greedy.branch
        if greedy.probability >= settings.greedy_stop:
            return PolicyOutcome(
                first.answer, q.correct(first.answer), first.tokens, 1, greedy.probability
            )
        best: Verdict | None = None
        last: Verdict | None = None
        for r in range(1, rounds + 1):
            n = r * settings.branches
            spent = first.tokens + sum(q.tokens[:n])
            verdict = q.greedy_verdict(n, settings.greedy_weight)
            if best is None or verdict.probability >= best.probability:
                best = verdict
            reason = stop_reason(
                verdict,
                rounds=r,
                tokens=spent,
                next_round_tokens=settings.branches * spent / (n + 1),
                settings=settings,
                previous=last,
            )
            last = verdict
            if reason is not None:
                final = verdict if verdict.answer is not None else best
                return PolicyOutcome(
                    final.answer, q.correct(final.answer), spent, n + 1, final.probability
                )
        raise AssertionError("stop_reason stops at max_rounds")

    return policy


def replay_loop(
    runs: Sequence[Run], settings: LoopSettings, calibrator: Calibrator, orders: int
) -> list[tuple[Run, PolicyOutcome]]:
    """The loop with these settings and calibrator over each run's samples, in
    ``orders`` random branch orders per run: one outcome per run and order. Rounds
    beyond the samples a run holds cannot be replayed, so ``max_rounds`` is cut to them."""
    samples = min(len(r.samples) for r in runs)
    rounds = min(settings.max_rounds, samples // settings.branches)
    if rounds < 1:
        raise ValueError(f"runs have {samples} samples, fewer than a round of {settings.branches}")
    rule = loop_rule(msgspec.structs.replace(settings, max_rounds=rounds), rounds)
    outcomes = []
    for index, run in enumerate(runs):
        for shuffled in branch_orders(run, samples, orders, index):
            q = Question(index, shuffled, calibrator.signals, [])
            q.calibrator = calibrator
            outcomes.append((run, rule(q)))
    return outcomes
