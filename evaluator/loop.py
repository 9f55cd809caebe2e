"""The early-exit reasoning loop on the large engine (docs/architecture.md, "The
request's way through the code", step 5b).

Each round starts k branches at once, each an independent sample of the answer with
token logprobs. A branch whose sliding-window confidence falls below DeepConf's
cut-off is stopped mid-generation. After the round, every branch so far votes, weighed
by its confidence (evaluator.policy.tally), and the calibrator says how likely the
leading answer is right. The loop stops when that is likely enough, or when rounds,
tokens or time run out; when the deadline leaves no time for another round, the
configured fallback answers: the best answer so far, the small model's answer, or
an error. Every step is recorded in the ``LoopTrace`` the response carries.

The loop is an async generator of ``Thinking`` (progress to show the client as
reasoning) and, last, one ``LoopResult``. Closing it, or cancelling the task that
iterates it, stops every branch in flight within a token.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import math
import random
import time
from collections.abc import AsyncGenerator, Mapping, Sequence
from typing import Literal

import msgspec

from engines.base import (
    Engine,
    EngineError,
    EngineOverloaded,
    FinishReason,
    Generation,
    Message,
    SamplingParams,
    TokenLogprob,
    last_user_turn,
)
from engines.fanout import remaining
from evaluator.answers import AnswerKind, extract, infer_kind
from evaluator.calibration import Calibrator
from evaluator.policy import (
    LoopSettings,
    StopReason,
    Verdict,
    signal_settings,
    stop_reason,
    tally,
    weighed,
)
from evaluator.shown import Shown, Thinking
from evaluator.signals import (
    PROBE_MAX_TOKENS,
    PROBE_STOP,
    PROBE_SUFFIX,
    LowConfidenceWatch,
    Probe,
    probes_agree,
    read_probe,
    trace_confidence,
)

Fallback = Literal["best", "small", "error"]
# Why the loop ended: a policy reason, or the engine refusing more work mid-loop.
EndReason = StopReason | Literal["overloaded"]


class FallbackSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What answers when the deadline leaves no time for another round."""

    # best: the best answer so far, flagged with its confidence; small: the small
    # engine's answer; error: 504 deadline_exceeded.
    policy: Fallback = "best"
    # Start the small engine with the loop, so that its answer is ready at the
    # deadline (it costs a small-model call per hard request).
    hedge: bool = False


DEFAULT_FALLBACK = FallbackSettings()


class BranchTrace(msgspec.Struct, frozen=True, kw_only=True):
    answer: str | None  # its vote, None if it had none
    tokens: int  # over every round it ran, probes not included
    finish_reason: FinishReason | Literal["pruned", "probed"]
    probes: int = 0
    confidence: float | None  # its lowest group confidence, which the vote weighs


class RoundTrace(msgspec.Struct, frozen=True, kw_only=True):
    round: int
    branches: list[BranchTrace]
    answer: str | None  # the vote's answer over all rounds so far
    probability: float  # its calibrated P(correct)
    tokens: int  # generated in this round
    seconds: float
    # The greedy_first pass: one branch at temperature 0, its answer alone, and its
    # probability P(greedy right) from the greedy calibrator.
    greedy: bool = False


FirstAnswerVerdict = Literal["confirmed", "replaced", "unfinished", "withdrawn"]


class FirstAnswerTrace(msgspec.Struct, frozen=True, kw_only=True):
    """The small engine's provisional first answer, and what the loop made of it."""

    # confirmed: the loop's answer is the same (as the question's kind reads both);
    # replaced: it differs; unfinished: the loop answered before the first answer was
    # whole, and it was stopped; withdrawn: the loop had no answer in time (an error).
    verdict: FirstAnswerVerdict
    answer: str | None  # as the question's kind reads it; None: unfinished or unread
    tokens: int  # the small engine generated
    whole_ms: float | None  # when it was whole, from the loop's start


class LoopTrace(msgspec.Struct, frozen=True, kw_only=True):
    """The decision trace of one loop: why it stopped and what answered."""

    kind: AnswerKind  # the kind of answer the question was read as asking for
    rounds: list[RoundTrace]
    stop: EndReason
    # none: the loop's own answer; otherwise the fallback that answered at the deadline.
    fallback: Literal["none", "best", "small", "error"]
    confidence: float  # calibrated P(correct) of the answer given (0 for small/error)
    tokens: int  # every token the loop generated, pruned branches' and probes' included
    probe_tokens: int
    deadline_ms: float | None  # the time the request had
    elapsed_ms: float
    # When the first branch token or first-answer token was shown (interaction
    # latency, from the loop's start); None: nothing but notes was shown.
    first_shown_ms: float | None = None
    # Tokens generated per token of the answer given (None: the answer is not one of
    # the loop's branches, e.g. the small engine's at the deadline).
    thought_to_output: float | None = None
    first_answer: FirstAnswerTrace | None = None  # only when one was asked for


class LoopResult(msgspec.Struct, frozen=True, kw_only=True):
    text: str  # empty when the fallback is an error
    trace: LoopTrace
    prompt_tokens: int
    answer_tokens: int  # the tokens of the answer itself
    engine: str  # the engine whose answer this is

    @property
    def completion_tokens(self) -> int:
        """Every token the answer cost: all branches and probes (the trace's count)."""
        return self.trace.tokens


class _Branch(msgspec.Struct, kw_only=True):
    """One branch as the loop keeps it, over the rounds it has run."""

    text: str
    logprobs: tuple[TokenLogprob, ...]
    tokens: int
    finish_reason: FinishReason | Literal["pruned", "probed"]
    prompt_tokens: int = 0
    # Its vote weighs this times its confidence: greedy_weight for the greedy pass.
    weight: float = 1.0
    # Its probes, oldest first (only with LoopSettings.probes), and the text of the
    # last one's answer.
    probes: list[Probe] = msgspec.field(default_factory=list)
    probe_text: str = ""

    @property
    def reply(self) -> str:
        """What the branch says: its text, or where it is still reasoning, its text
        with the last probe's answer."""
        return self.text + self.probe_text if self.probe_text else self.text


class _Growing:
    """A branch as a round's tokens arrive: its text and logprobs so far, a carried
    branch's earlier ones included, and the watch that prunes it when unsure."""

    def __init__(self, prior: _Branch | None, watch: LowConfidenceWatch | None) -> None:
        self.prior = prior
        self.pieces: list[str] = [] if prior is None else [prior.text]
        self.tokens: list[TokenLogprob] = [] if prior is None else list(prior.logprobs)
        self.watch = watch
        if watch is not None:
            for token in self.tokens:  # the window goes on where the last round left it
                watch.feed(token)

    def branch(self, finish: FinishReason | Literal["pruned"]) -> _Branch:
        prior = self.prior
        return _Branch(
            text="".join(self.pieces),
            logprobs=tuple(self.tokens),
            tokens=len(self.tokens),
            finish_reason=finish,
            prompt_tokens=0 if prior is None else prior.prompt_tokens,
            probes=[] if prior is None else prior.probes,
        )

    def finished(self, generation: Generation) -> _Branch:
        sample = generation.samples[0]
        if self.prior is None:
            # The whole text and every token, as the engine counted them.
            return _Branch(
                text=sample.text,
                logprobs=sample.logprobs,
                tokens=sample.completion_tokens,
                finish_reason=sample.finish_reason,
                prompt_tokens=generation.prompt_tokens,
            )
        return self.branch(sample.finish_reason)


class _Vote(msgspec.Struct, frozen=True):
    """A branch as the vote reads it (evaluator.signals.Trace), and its weight."""

    text: str
    logprobs: tuple[TokenLogprob, ...]
    weight: float = 1.0


class _Run:
    """One run of the loop: the question's kind and the run's limits, its branches and
    rounds so far, the votes' verdicts, and the tokens it has spent."""

    def __init__(
        self, *, kind: AnswerKind, k: int, deadline: float | None, max_tokens: int | None
    ) -> None:
        self.started = time.monotonic()
        self.kind = kind
        self.k = k  # branches per round
        self.deadline = deadline
        self.max_tokens = max_tokens  # the client's limit on each branch
        self.branches: list[_Branch] = []
        self.greedy: _Branch | None = None  # the greedy_first pass, once it has run
        self.rounds: list[RoundTrace] = []
        self.verdict: Verdict | None = None
        self.previous: Verdict | None = None  # the verdict a round before
        self.best: Verdict | None = None
        self.spent = 0
        self.probe_spent = 0

    @property
    def sampling_rounds(self) -> int:
        """The rounds so far that sampled (the greedy pass is not one of them)."""
        return len(self.rounds) - (self.greedy is not None)

    def judged(self, verdict: Verdict) -> None:
        """``verdict`` is the run's now, and its best so far if none was more likely."""
        self.verdict = verdict
        if self.best is None or verdict.probability >= self.best.probability:
            self.best = verdict

    def result(
        self,
        end: EndReason,
        text: str,
        used: Literal["none", "best", "small", "error"],
        confidence: float,
        engine: str,
    ) -> LoopResult:
        deadline = self.deadline
        answer_tokens = next((b.tokens for b in self.branches if b.reply == text), 0)
        trace = LoopTrace(
            kind=self.kind,
            rounds=self.rounds,
            stop=end,
            fallback=used,
            confidence=confidence,
            tokens=self.spent,
            probe_tokens=self.probe_spent,
            deadline_ms=None if deadline is None else (deadline - self.started) * 1000,
            elapsed_ms=(time.monotonic() - self.started) * 1000,
            thought_to_output=self.spent / answer_tokens if answer_tokens else None,
        )
        return LoopResult(
            text=text,
            trace=trace,
            prompt_tokens=max((b.prompt_tokens for b in self.branches), default=0),
            answer_tokens=answer_tokens,
            engine=engine,
        )


class ReasoningLoop:
    """The loop over one engine, with its settings and calibrator."""

    def __init__(
        self,
        engine: Engine,
        settings: LoopSettings,
        calibrator: Calibrator | None,
        *,
        small: Engine | None = None,
        greedy_calibrators: Mapping[AnswerKind, Calibrator] | None = None,
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.calibrator = calibrator
        self.small = small
        self._signals = signal_settings(calibrator)
        # P(greedy right) of the greedy_first pass by answer kind; a kind without
        # one: its vote share stands in.
        self.greedy_calibrators = greedy_calibrators or {}

    def use_calibrator(self, calibrator: Calibrator | None) -> None:
        """P(correct) from ``calibrator`` for the runs that start from now on (a policy
        version's); runs under way keep the one they started with."""
        self.calibrator = calibrator
        self._signals = signal_settings(calibrator)

    def tuned(self, settings: LoopSettings) -> ReasoningLoop:
        """This loop with other settings (a tenant's threshold, a reloaded config),
        sharing its engines and calibrator; a run keeps the settings it started with."""
        tuned = copy.copy(self)
        tuned.settings = settings
        return tuned

    async def run(
        self,
        messages: Sequence[Message],
        *,
        deadline: float | None,
        fallback: FallbackSettings = DEFAULT_FALLBACK,
        difficulty: float | None = None,
        max_tokens: int | None = None,
        first_answer: bool = False,
    ) -> AsyncGenerator[Thinking | LoopResult]:
        """Think about ``messages`` until confident or out of rounds, tokens or time.

        ``deadline`` is absolute ``time.monotonic()`` seconds; ``max_tokens`` caps each
        branch (the client's own limit on an answer). What the loop shows comes as it
        happens: the first branch of each round token by token, a note after each
        round; with ``first_answer``, the small engine's answer streams first, marked
        provisional, and the loop's answer then confirms or replaces it.
        """
        run = _Run(
            kind=infer_kind(last_user_turn(messages)),
            k=self.settings.branches_for(difficulty),
            deadline=deadline,
            max_tokens=max_tokens,
        )
        shown = Shown()
        first_answer = first_answer and self.small is not None
        hedged = fallback.policy == "small" and fallback.hedge and self.small is not None
        # The first answer, when asked for, is the hedge too: the same call of the
        # small engine, which the deadline's fallback then need not wait for anew.
        small: asyncio.Task[Generation] | None = None
        if first_answer or hedged:
            small = asyncio.create_task(
                self._small_answer(messages, deadline, shown if first_answer else None)
            )
        yield Thinking(self._opening_note(run))
        end: EndReason | None = None
        try:
            while (end := self._end_before_round(run)) is None:
                round_ = asyncio.create_task(self._next_round(messages, run, shown))
                try:
                    async for thinking in shown.during(round_):
                        yield thinking
                    trace = await round_
                finally:
                    await _stopped(round_)
                if trace is None:
                    end = "overloaded"
                    break
                yield Thinking(self._round_note(trace, run.verdict))
        finally:
            # The small engine's answer serves the deadline's fallback; otherwise the
            # loop has answered (or stopped) and it is stopped now.
            if small is not None and end != "deadline":
                await _stopped(small)
        if end == "deadline":
            result = await self._fallback_answer(run, fallback, small, messages)
        else:
            result = self._own_answer(run, end)
        judged: FirstAnswerTrace | None = None
        if first_answer and small is not None:
            await _stopped(small)  # the fallback may not have needed it
            judged = _judge_first_answer(small, result, run.kind, shown)
        for thinking in shown.ready():
            yield thinking
        if judged is not None:
            yield Thinking(_first_answer_note(judged, result))
        traced = msgspec.structs.replace(
            result.trace, first_shown_ms=shown.first_shown_ms, first_answer=judged
        )
        yield msgspec.structs.replace(result, trace=traced)

    async def draft(
        self,
        engine: Engine,
        messages: Sequence[Message],
        params: SamplingParams,
        deadline: float | None,
    ) -> tuple[Generation, float]:
        """One answer from ``engine`` (the small one) and the calibrator's P(correct) for
        it, which decides whether the loop takes the question over."""
        params = msgspec.structs.replace(
            params, n=1, logprobs=True, top_logprobs=max(params.top_logprobs, self._signals.top_k)
        )
        generation = await engine.generate(messages, params, deadline)
        sample = generation.samples[0]
        if sample.finish_reason not in ("stop", "length"):  # cut off by the deadline
            return generation, 0.0
        question = last_user_turn(messages)
        kind = infer_kind(question)
        # A chat model may answer "Is ice cold?" in prose without a yes or a no; that
        # is still its answer, read as free text.
        answer = extract(kind, sample.text) or extract("text", sample.text)
        verdict = tally(kind, [sample], [answer], calibrator=self.calibrator)
        return generation, verdict.probability if verdict.answer is not None else 0.0

    def _opening_note(self, run: _Run) -> str:
        rounds = f"up to {self.settings.max_rounds} rounds of {run.k} branches"
        if self.settings.greedy_first:
            rounds = f"a greedy pass, then {rounds}"
        budget = " ".join(
            [rounds]
            + ([] if run.deadline is None else [f"{(run.deadline - run.started) * 1000:.0f} ms"])
        )
        return f"Thinking ({budget}); the question asks for {_KIND_WORDS[run.kind]}.\n"

    def _end_before_round(self, run: _Run) -> StopReason | None:
        """Why no further round starts, or None: another one does."""
        if run.greedy is not None and not run.sampling_rounds:
            return self._after_greedy(run)
        if run.rounds:
            return self._stop(run)
        if run.deadline is not None and time.monotonic() >= run.deadline:
            return "deadline"
        return None

    async def _next_round(
        self, messages: Sequence[Message], run: _Run, shown: Shown
    ) -> RoundTrace | None:
        """One round: the open branches a round further and new ones up to k, their
        probes, then every branch's vote. None when the engine refused the round and
        the loop has an answer to give instead."""
        round_started = time.monotonic()
        greedy = self.settings.greedy_first and not run.rounds
        going_on = [b for b in run.branches if self._open(b, run.max_tokens)]
        try:
            ran = await self._round(messages, going_on, run, shown, greedy=greedy)
        except EngineOverloaded:
            if run.best is None:
                raise  # nothing to answer with: the client hears 429
            return None
        tokens = sum(b.tokens for b in ran) - sum(b.tokens for b in going_on)
        carried = {id(b) for b in going_on}
        run.branches = [b for b in run.branches if id(b) not in carried] + ran
        if self.settings.probes:
            probed = await self._probe_open(messages, run.kind, ran, run.deadline, run.max_tokens)
            tokens += probed
            run.probe_spent += probed
        run.spent += tokens
        if greedy:
            self._greedy_vote(run, ran[0])
        else:
            self._vote(run)
        trace = RoundTrace(
            round=len(run.rounds) + 1,
            branches=[self._branch_trace(run.kind, b, run.max_tokens) for b in ran],
            answer=None if run.verdict is None else run.verdict.answer,
            probability=0.0 if run.verdict is None else run.verdict.probability,
            tokens=tokens,
            seconds=time.monotonic() - round_started,
            greedy=greedy,
        )
        run.rounds.append(trace)
        return trace

    def _vote(self, run: _Run) -> None:
        """Every branch so far votes (the greedy pass at greedy_weight, unless that is
        0); the leading answer becomes the run's verdict."""
        voters = [b for b in run.branches if b.weight > 0]
        votes, answers, probes = self._votes(run.kind, voters, run.max_tokens)
        # The greedy pass's verdict is no round before the first sampling round: its P
        # is another calibrator's, so no gain is measured against it.
        run.previous = run.verdict if run.sampling_rounds else None
        if not votes:
            if not run.sampling_rounds:
                # The greedy pass's verdict is no vote's (it stays the best so far).
                run.verdict = None
            return
        traces = [weighed(trace_confidence(v.logprobs, self._signals), v.weight) for v in votes]
        run.judged(
            tally(
                run.kind,
                votes,
                answers,
                calibrator=self.calibrator,
                prune_below=self.settings.prune_below,
                traces=traces,
                probes=probes if self.settings.probes else None,
            )
        )

    def _greedy_vote(self, run: _Run, greedy: _Branch) -> None:
        """The greedy pass alone: its answer and P(greedy right), from the greedy
        calibrator. Its later votes weigh greedy_weight times its confidence."""
        greedy.weight = self.settings.greedy_weight
        run.greedy = greedy
        votes, answers, _ = self._votes(run.kind, [greedy], run.max_tokens)
        if votes:  # not when the deadline cut it or DeepConf's filter stopped it
            calibrator = self.greedy_calibrators.get(run.kind)
            run.judged(tally(run.kind, votes, answers, calibrator=calibrator))

    def _own_answer(self, run: _Run, end: EndReason) -> LoopResult:
        """The loop's own answer, when it stopped before the deadline."""
        verdict, best = run.verdict, run.best
        if best is None or best.answer is None:
            # Every branch ran out of rounds or tokens without an answer: the most
            # likely text is still better than none.
            text = verdict.text if verdict is not None else ""
            probability = 0.0 if verdict is None else verdict.probability
            return run.result(end, text, "none", probability, self.engine.name)
        final = verdict if verdict is not None and verdict.answer is not None else best
        return run.result(end, final.text, "none", final.probability, self.engine.name)

    async def _fallback_answer(
        self,
        run: _Run,
        fallback: FallbackSettings,
        hedge: asyncio.Task[Generation] | None,
        messages: Sequence[Message],
    ) -> LoopResult:
        """The deadline: the configured fallback, then the other one that can answer (the
        best answer so far, the small engine's in the time left); an error only when
        the policy says so or neither has an answer."""
        if fallback.policy == "error":
            return run.result("deadline", "", "error", 0.0, self.engine.name)
        order = ("small", "best") if fallback.policy == "small" else ("best", "small")
        for way in order:
            if way == "best" and run.best is not None and run.best.answer is not None:
                best = run.best
                return run.result("deadline", best.text, "best", best.probability, self.engine.name)
            if way == "small" and self.small is not None:
                small = await self._settle_small(hedge, messages, run.deadline)
                if small is not None:
                    return run.result("deadline", small.text, "small", 0.0, small.engine)
        return run.result("deadline", "", "error", 0.0, self.engine.name)

    def _after_greedy(self, run: _Run) -> StopReason | None:
        """After the greedy pass: confident when P(greedy right) reaches greedy_stop;
        otherwise sampling rounds follow, if the budget and the clock afford one (a
        pass that did not vote, cut by the deadline or pruned, has nothing to stop on)."""
        verdict = run.verdict
        if verdict is not None and verdict.probability >= self.settings.greedy_stop:
            return "greedy"
        return self._stop(run)

    def _stop(self, run: _Run) -> StopReason | None:
        spent, deadline = run.spent, run.deadline
        seconds = sum(r.seconds for r in run.rounds)
        per_branch = (
            spent / len(run.branches) if run.branches else float(self.settings.round_tokens)
        )
        next_tokens = run.k * per_branch
        # Another round costs what the rounds so far took per token, at their speed.
        next_s = next_tokens * seconds / spent if spent else None
        # max_rounds counts sampling rounds, and the vote's threshold is not for the
        # greedy pass's verdict alone.
        rounds = run.sampling_rounds
        return stop_reason(
            run.verdict if rounds else None,
            rounds=rounds,
            tokens=spent,
            next_round_tokens=next_tokens,
            settings=self.settings,
            time_left_s=None if deadline is None else deadline - time.monotonic(),
            next_round_s=next_s,
            previous=run.previous,
        )

    async def _round(
        self,
        messages: Sequence[Message],
        going_on: list[_Branch],
        run: _Run,
        shown: Shown,
        *,
        greedy: bool = False,
    ) -> list[_Branch]:
        """Run the branches still reasoning a round further, and new ones up to k (with
        ``greedy``, the greedy pass alone); the first of them is shown as it is
        generated (the others in the round's note)."""
        k, deadline, max_tokens = (1 if greedy else run.k), run.deadline, run.max_tokens
        params = self._round_params(max_tokens, greedy)
        priors: list[_Branch | None] = [*going_on, *[None] * max(0, k - len(going_on))]
        which = "the greedy pass" if greedy else f"branch 1 of {len(priors)}"
        tasks = [
            asyncio.create_task(
                self._branch(
                    messages,
                    params,
                    deadline,
                    prior,
                    max_tokens,
                    shown if i == 0 else None,
                    f"Round {len(run.rounds) + 1}, {which}:\n",
                )
            )
            for i, prior in enumerate(priors)
        ]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _round_params(self, max_tokens: int | None, greedy: bool) -> SamplingParams:
        tokens = self.settings.round_tokens
        params = SamplingParams(
            max_tokens=tokens if max_tokens is None else min(tokens, max_tokens),
            temperature=self.settings.temperature,
            logprobs=True,
            top_logprobs=self._signals.top_k,
        )
        if not greedy:
            return params
        # The large engine's own answer, with the alternatives that both the vote's
        # signals and P(greedy right)'s read, as long as the client lets a plain request
        # of that engine be: with greedy_stop 0 it is that request's answer.
        top_k = max((c.signals.top_k for c in self.greedy_calibrators.values()), default=0)
        return msgspec.structs.replace(
            params,
            max_tokens=params.max_tokens if max_tokens is None else max_tokens,
            temperature=0.0,
            top_logprobs=max(params.top_logprobs, top_k),
        )

    def _open(self, branch: _Branch, max_tokens: int | None) -> bool:
        """Whether a branch goes on in the next round: with probes on, one that the
        round's budget cut off, unless the client's own limit did."""
        return (
            self.settings.probes
            and branch.finish_reason == "length"
            and (max_tokens is None or branch.tokens < max_tokens)
        )

    def _votes(
        self, kind: AnswerKind, branches: list[_Branch], max_tokens: int | None
    ) -> tuple[list[_Vote], list[str | None], list[list[Probe]]]:
        """The branches that vote, their answers and their probes. A finished branch
        votes its text's answer; one still reasoning its last probe's, if it has one;
        one cut off by the deadline or pruned does not vote."""
        votes: list[_Vote] = []
        answers: list[str | None] = []
        probes: list[list[Probe]] = []
        for branch in branches:
            if branch.finish_reason in ("deadline", "cancelled", "pruned"):
                continue
            if self._open(branch, max_tokens) or branch.finish_reason == "probed":
                if not branch.probes:
                    continue
                answer = branch.probes[-1].answer
            else:
                answer = extract(kind, branch.text)
            votes.append(_Vote(branch.reply, branch.logprobs, branch.weight))
            answers.append(answer)
            probes.append(branch.probes)
        return votes, answers, probes

    async def _probe_open(
        self,
        messages: Sequence[Message],
        kind: AnswerKind,
        branches: list[_Branch],
        deadline: float | None,
        max_tokens: int | None,
    ) -> int:
        """Ask every branch still reasoning for its answer so far (Dynasor-CoT's probe);
        a branch whose last probes agree is done. The tokens the probes cost."""
        going_on = [b for b in branches if self._open(b, max_tokens)]
        tasks = [asyncio.create_task(self._probe(messages, kind, b, deadline)) for b in going_on]
        try:
            probes = await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        cost = 0
        for branch, (probe, text) in zip(going_on, probes, strict=True):
            if probe is None:
                continue
            branch.probes.append(probe)
            branch.probe_text = text
            cost += probe.tokens
            if probes_agree(branch.probes, self._signals.probe_agreement):
                branch.finish_reason = "probed"
        return cost

    async def _probe(
        self,
        messages: Sequence[Message],
        kind: AnswerKind,
        branch: _Branch,
        deadline: float | None,
    ) -> tuple[Probe | None, str]:
        # The probe continues the branch's own text, so a server that caches prefixes
        # reads only the suffix anew.
        prompt = (*messages, Message("assistant", branch.text + PROBE_SUFFIX))
        params = SamplingParams(max_tokens=PROBE_MAX_TOKENS, temperature=0.0, stop=PROBE_STOP)
        generation = await self.engine.generate(prompt, params, deadline)
        sample = generation.samples[0]
        if sample.finish_reason in ("deadline", "cancelled"):
            return None, ""
        # What the probe read beyond the branch's own prompt and text: the suffix.
        suffix = max(0, generation.prompt_tokens - branch.prompt_tokens - branch.tokens)
        probe = read_probe(
            kind,
            sample.text,
            prompt_tokens=suffix,
            completion_tokens=sample.completion_tokens,
            settings=self._signals,
        )
        return probe, PROBE_SUFFIX + sample.text

    async def _branch(
        self,
        messages: Sequence[Message],
        params: SamplingParams,
        deadline: float | None,
        prior: _Branch | None,
        max_tokens: int | None,
        shown: Shown | None = None,
        heading: str = "",
    ) -> _Branch:
        """A new branch, or ``prior`` a round further (its text sent back as the start
        of the assistant's turn, which the engine continues); its tokens go to
        ``shown`` as they come, after ``heading``."""
        prompt, own = self._continuation(messages, params, prior, max_tokens)
        cut = self.settings.prune_below
        growing = _Growing(prior, None if cut is None else LowConfidenceWatch(cut, self._signals))
        # This loop runs once per token, so it keeps to local names.
        pieces, tokens, watch = growing.pieces, growing.tokens, growing.watch
        stream = self.engine.stream(prompt, own, deadline)
        try:
            # The engine stops at the deadline between two tokens; this bound holds
            # even when one token takes long (a CPU shared with other work).
            async with asyncio.timeout(remaining(deadline)), contextlib.aclosing(stream) as events:
                async for event in events:
                    if isinstance(event, Generation):
                        return growing.finished(event)
                    pieces.append(event.text)
                    tokens.extend(event.logprobs)
                    if shown is not None:
                        # The heading comes with the first token: a branch that says
                        # nothing shows nothing.
                        shown.thought(heading + event.text)
                        heading = ""
                    if watch is not None and any(watch.feed(t) for t in event.logprobs):
                        return growing.branch("pruned")  # DeepConf online
        except TimeoutError:
            return growing.branch("deadline")
        finally:
            if shown is not None:
                shown.thought_ends()
        raise EngineError(self.engine.name, "the stream ended without a generation")

    def _continuation(
        self,
        messages: Sequence[Message],
        params: SamplingParams,
        prior: _Branch | None,
        max_tokens: int | None,
    ) -> tuple[Sequence[Message], SamplingParams]:
        """The prompt and sampling of a branch's round: ``prior``'s text continued,
        within what is left of the client's limit."""
        # A seed of its own, so branches differ on backends that would reuse a default.
        own = msgspec.structs.replace(params, seed=random.randrange(2**31))
        if prior is None:
            return messages, own
        if max_tokens is not None:
            own = msgspec.structs.replace(
                own, max_tokens=min(own.max_tokens, max_tokens - prior.tokens)
            )
        return (*messages, Message("assistant", prior.text)), own

    def _branch_trace(
        self, kind: AnswerKind, branch: _Branch, max_tokens: int | None
    ) -> BranchTrace:
        confidence = trace_confidence(branch.logprobs, self._signals).lowest_group
        _, answers, _ = self._votes(kind, [branch], max_tokens)
        return BranchTrace(
            answer=answers[0] if answers else None,
            tokens=branch.tokens,
            finish_reason=branch.finish_reason,
            probes=len(branch.probes),
            confidence=None if confidence is None or not math.isfinite(confidence) else confidence,
        )

    def _round_note(self, trace: RoundTrace, verdict: Verdict | None) -> str:
        said = ", ".join(repr(b.answer) if b.answer else b.finish_reason for b in trace.branches)
        if trace.greedy:
            return (
                f"Round {trace.round}, the greedy pass: {said}; P(greedy right) "
                f"{trace.probability:.2f} (greedy_stop {self.settings.greedy_stop:.2f}).\n"
            )
        if verdict is None or verdict.answer is None:
            return f"Round {trace.round}: {said}; no answer yet.\n"
        return (
            f"Round {trace.round}: {said}; leading answer {verdict.answer!r}, "
            f"P(correct) {verdict.probability:.2f} (threshold {self.settings.threshold:.2f}).\n"
        )

    async def _small_answer(
        self, messages: Sequence[Message], deadline: float | None, shown: Shown | None = None
    ) -> Generation:
        """The small engine's greedy answer; with ``shown``, streamed there as the
        first answer."""
        small = self.small
        assert small is not None
        params = SamplingParams(max_tokens=self.settings.round_tokens, temperature=0.0)
        if shown is None:
            return await small.generate(messages, params, deadline)
        try:
            async with contextlib.aclosing(small.stream(messages, params, deadline)) as events:
                async for event in events:
                    if isinstance(event, Generation):
                        shown.first_answer_whole()
                        return event
                    shown.first_answer(event.text)
        finally:
            shown.first_answer_ends()
        raise EngineError(small.name, "the stream ended without a generation")

    async def _settle_small(
        self,
        hedge: asyncio.Task[Generation] | None,
        messages: Sequence[Message],
        deadline: float | None,
    ) -> Generation | None:
        """The small engine's whole answer by the deadline, or None."""
        try:
            if hedge is None:
                generation = await self._small_answer(messages, deadline)
            else:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                async with asyncio.timeout(left):
                    generation = await hedge
        except (TimeoutError, EngineError):
            if hedge is not None:
                hedge.cancel()
            return None
        sample = generation.samples[0]
        # An answer the token limit cut short is still an answer; one the deadline cut
        # off mid-sentence is not.
        whole = sample.finish_reason in ("stop", "length")
        return generation if whole and sample.text.strip() else None


async def _stopped(task: asyncio.Task[object]) -> None:
    """``task`` cancelled unless already done, and over."""
    task.cancel()
    with contextlib.suppress(BaseException):
        await task


def _judge_first_answer(
    small: asyncio.Task[Generation], result: LoopResult, kind: AnswerKind, shown: Shown
) -> FirstAnswerTrace:
    """What the loop's answer says of the first answer: the same answer, another one,
    or none at all; a first answer stopped before it was whole is unfinished."""
    whole = shown.first_answer_whole_ms
    generation = None if small.cancelled() or small.exception() else small.result()
    sample = None if generation is None else generation.samples[0]
    if sample is None or whole is None or sample.finish_reason not in ("stop", "length"):
        tokens = 0 if sample is None else sample.completion_tokens
        return FirstAnswerTrace(verdict="unfinished", answer=None, tokens=tokens, whole_ms=None)
    first = extract(kind, sample.text)
    if result.trace.fallback == "error":
        verdict: FirstAnswerVerdict = "withdrawn"
    else:
        final = extract(kind, result.text)
        same = first == final if first is not None else sample.text.strip() == result.text.strip()
        verdict = "confirmed" if same else "replaced"
    return FirstAnswerTrace(
        verdict=verdict, answer=first, tokens=sample.completion_tokens, whole_ms=whole
    )


def _first_answer_note(judged: FirstAnswerTrace, result: LoopResult) -> str:
    if judged.verdict == "confirmed":
        return "The loop's answer confirms the first answer.\n"
    if judged.verdict == "replaced":
        final = extract(result.trace.kind, result.text)
        return f"The loop's answer ({final!r}) replaces the first answer ({judged.answer!r}).\n"
    if judged.verdict == "withdrawn":
        return "The first answer is withdrawn: the loop has no answer within the deadline.\n"
    return "The loop answered before the first answer was whole; it was stopped.\n"


_KIND_WORDS: dict[AnswerKind, str] = {
    "number": "a number",
    "choice": "a choice among options",
    "yesno": "yes or no",
    "text": "a short answer",
}
