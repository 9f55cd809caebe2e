"""The early-exit reasoning loop on the large engine (DESIGN.md, step 5b).

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
import math
import random
import time
from collections.abc import AsyncGenerator, Sequence
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
)
from engines.fanout import remaining
from evaluator.answers import AnswerKind, extract, infer_kind
from evaluator.calibration import Calibrator
from evaluator.policy import LoopSettings, StopReason, Verdict, signal_settings, stop_reason, tally
from evaluator.signals import token_confidence, trace_confidence

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


class Thinking(msgspec.Struct, frozen=True):
    """Progress the client may see while the loop runs (``delta.reasoning_content``)."""

    text: str


class BranchTrace(msgspec.Struct, frozen=True, kw_only=True):
    answer: str | None
    tokens: int
    finish_reason: FinishReason | Literal["pruned"]
    confidence: float | None  # its lowest group confidence, which the vote weighs


class RoundTrace(msgspec.Struct, frozen=True, kw_only=True):
    round: int
    branches: list[BranchTrace]
    answer: str | None  # the vote's answer over all rounds so far
    probability: float  # its calibrated P(correct)
    tokens: int  # generated in this round
    seconds: float


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


class LoopResult(msgspec.Struct, frozen=True, kw_only=True):
    text: str  # empty when the fallback is an error
    trace: LoopTrace
    prompt_tokens: int
    completion_tokens: int  # every token the answer cost (all branches)
    answer_tokens: int  # the tokens of the answer itself
    engine: str  # the engine whose answer this is


class _Branch(msgspec.Struct, kw_only=True):
    """One sample as the loop keeps it: the Trace protocol for the signals."""

    text: str
    logprobs: tuple[TokenLogprob, ...]
    tokens: int
    finish_reason: FinishReason | Literal["pruned"]
    prompt_tokens: int = 0

    @property
    def votes(self) -> bool:
        # A branch cut off by the deadline or pruned holds half an answer.
        return self.finish_reason in ("stop", "length")


class ReasoningLoop:
    """The loop over one engine, with its settings and calibrator."""

    def __init__(
        self,
        engine: Engine,
        settings: LoopSettings,
        calibrator: Calibrator | None,
        *,
        small: Engine | None = None,
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.calibrator = calibrator
        self.small = small
        self._signals = signal_settings(calibrator)

    async def run(
        self,
        messages: Sequence[Message],
        *,
        deadline: float | None,
        fallback: FallbackSettings = DEFAULT_FALLBACK,
        difficulty: float | None = None,
        max_tokens: int | None = None,
    ) -> AsyncGenerator[Thinking | LoopResult]:
        """Think about ``messages`` until confident or out of rounds, tokens or time.

        ``deadline`` is absolute ``time.monotonic()`` seconds; ``max_tokens`` caps each
        branch (the client's own limit on an answer).
        """
        started = time.monotonic()
        settings = self.settings
        k = settings.branches_for(difficulty)
        question = next((m.content for m in reversed(messages) if m.role == "user"), "")
        kind = infer_kind(question)
        hedge: asyncio.Task[Generation] | None = None
        if fallback.policy == "small" and fallback.hedge and self.small is not None:
            hedge = asyncio.create_task(self._small_answer(messages, deadline))
        budget = " ".join(
            [f"up to {settings.max_rounds} rounds of {k} branches"]
            + ([] if deadline is None else [f"{(deadline - started) * 1000:.0f} ms"])
        )
        yield Thinking(f"Thinking ({budget}); the question asks for {_KIND_WORDS[kind]}.\n")

        branches: list[_Branch] = []
        rounds: list[RoundTrace] = []
        verdict: Verdict | None = None
        best: Verdict | None = None
        spent = 0
        end: EndReason | None = None
        try:
            while True:
                if rounds:
                    end = self._stop(verdict, rounds, branches, spent, k, deadline)
                    if end is not None:
                        break
                elif deadline is not None and time.monotonic() >= deadline:
                    end = "deadline"
                    break
                round_started = time.monotonic()
                try:
                    fresh = await self._round(messages, k, deadline, max_tokens)
                except EngineOverloaded:
                    if verdict is None:
                        raise  # nothing to answer with: the client hears 429
                    end = "overloaded"
                    break
                branches.extend(fresh)
                spent += sum(b.tokens for b in fresh)
                voting = [b for b in branches if b.votes]
                answers = [extract(kind, b.text) for b in voting]
                if voting:
                    verdict = tally(
                        kind,
                        voting,
                        answers,
                        calibrator=self.calibrator,
                        prune_below=settings.prune_below,
                    )
                    if best is None or verdict.probability >= best.probability:
                        best = verdict
                rounds.append(
                    RoundTrace(
                        round=len(rounds) + 1,
                        branches=[self._branch_trace(kind, b) for b in fresh],
                        answer=None if verdict is None else verdict.answer,
                        probability=0.0 if verdict is None else verdict.probability,
                        tokens=sum(b.tokens for b in fresh),
                        seconds=time.monotonic() - round_started,
                    )
                )
                yield Thinking(self._round_note(rounds[-1], verdict))
        finally:
            # The hedge answers only at the deadline; otherwise it is stopped now.
            if hedge is not None and end != "deadline":
                hedge.cancel()
                with contextlib.suppress(BaseException):
                    await hedge

        prompt_tokens = max((b.prompt_tokens for b in branches), default=0)

        def result(
            text: str,
            used: Literal["none", "best", "small", "error"],
            confidence: float,
            engine: str,
        ) -> LoopResult:
            trace = LoopTrace(
                kind=kind,
                rounds=rounds,
                stop=end or "deadline",
                fallback=used,
                confidence=confidence,
                tokens=spent,
                probe_tokens=0,
                deadline_ms=None if deadline is None else (deadline - started) * 1000,
                elapsed_ms=(time.monotonic() - started) * 1000,
            )
            own = next((b.tokens for b in branches if b.text == text and b.votes), 0)
            return LoopResult(
                text=text,
                trace=trace,
                prompt_tokens=prompt_tokens,
                completion_tokens=spent,
                answer_tokens=own,
                engine=engine,
            )

        if end != "deadline":
            if best is None or best.answer is None:
                # Every branch ran out of rounds or tokens without an answer: the most
                # likely text is still better than none.
                text = verdict.text if verdict is not None else ""
                yield result(text, "none", 0.0 if verdict is None else verdict.probability,
                             self.engine.name)  # fmt: skip
            else:
                final = verdict if verdict is not None and verdict.answer is not None else best
                yield result(final.text, "none", final.probability, self.engine.name)
            return
        # The deadline: the configured fallback, then the next one that can answer.
        if fallback.policy == "small" and self.small is not None:
            small = await self._settle_small(hedge, messages, deadline)
            if small is not None:
                yield result(small.text, "small", 0.0, small.engine)
                return
        if fallback.policy != "error" and best is not None and best.answer is not None:
            yield result(best.text, "best", best.probability, self.engine.name)
            return
        yield result("", "error", 0.0, self.engine.name)

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
        question = next((m.content for m in reversed(messages) if m.role == "user"), "")
        kind = infer_kind(question)
        # A chat model may answer "Is ice cold?" in prose without a yes or a no; that
        # is still its answer, read as free text.
        answer = extract(kind, sample.text) or extract("text", sample.text)
        verdict = tally(kind, [sample], [answer], calibrator=self.calibrator)
        return generation, verdict.probability if verdict.answer is not None else 0.0

    def _stop(
        self,
        verdict: Verdict | None,
        rounds: list[RoundTrace],
        branches: list[_Branch],
        spent: int,
        k: int,
        deadline: float | None,
    ) -> StopReason | None:
        seconds = sum(r.seconds for r in rounds)
        per_branch = spent / len(branches) if branches else float(self.settings.round_tokens)
        next_tokens = k * per_branch
        # Another round costs what the rounds so far took per token, at their speed.
        next_s = next_tokens * seconds / spent if spent else None
        return stop_reason(
            verdict,
            rounds=len(rounds),
            tokens=spent,
            next_round_tokens=next_tokens,
            settings=self.settings,
            time_left_s=None if deadline is None else deadline - time.monotonic(),
            next_round_s=next_s,
        )

    async def _round(
        self,
        messages: Sequence[Message],
        k: int,
        deadline: float | None,
        max_tokens: int | None,
    ) -> list[_Branch]:
        tokens = self.settings.round_tokens
        params = SamplingParams(
            max_tokens=tokens if max_tokens is None else min(tokens, max_tokens),
            temperature=self.settings.temperature,
            logprobs=True,
            top_logprobs=self._signals.top_k,
        )
        tasks = [asyncio.create_task(self._branch(messages, params, deadline)) for _ in range(k)]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _branch(
        self, messages: Sequence[Message], params: SamplingParams, deadline: float | None
    ) -> _Branch:
        # A seed of its own, so branches differ on backends that would reuse a default.
        own = msgspec.structs.replace(params, seed=random.randrange(2**31))
        cut = self.settings.prune_below
        window = self._signals.group_window
        confidences: list[float] = []
        running = 0.0
        pieces: list[str] = []
        tokens: list[TokenLogprob] = []
        stream = self.engine.stream(messages, own, deadline)
        try:
            # The engine stops at the deadline between two tokens; this bound holds
            # even when one token takes long (a CPU shared with other work).
            async with asyncio.timeout(remaining(deadline)), contextlib.aclosing(stream) as events:
                async for event in events:
                    if isinstance(event, Generation):
                        sample = event.samples[0]
                        return _Branch(
                            text=sample.text,
                            logprobs=sample.logprobs,
                            tokens=sample.completion_tokens,
                            finish_reason=sample.finish_reason,
                            prompt_tokens=event.prompt_tokens,
                        )
                    pieces.append(event.text)
                    tokens.extend(event.logprobs)
                    if cut is None:
                        continue
                    for token in event.logprobs:
                        value = token_confidence(token, self._signals.top_k)
                        if value is None:
                            continue
                        confidences.append(value)
                        running += value
                        if len(confidences) > window:
                            running -= confidences[-window - 1]
                        # DeepConf online: stop a trace once a full window's mean
                        # drops below the cut-off.
                        if len(confidences) >= window and running / window < cut:
                            return _Branch(
                                text="".join(pieces),
                                logprobs=tuple(tokens),
                                tokens=len(tokens),
                                finish_reason="pruned",
                            )
        except TimeoutError:
            return _Branch(
                text="".join(pieces),
                logprobs=tuple(tokens),
                tokens=len(tokens),
                finish_reason="deadline",
            )
        raise EngineError(self.engine.name, "the stream ended without a generation")

    def _branch_trace(self, kind: AnswerKind, branch: _Branch) -> BranchTrace:
        confidence = trace_confidence(branch.logprobs, self._signals).lowest_group
        return BranchTrace(
            answer=extract(kind, branch.text) if branch.votes else None,
            tokens=branch.tokens,
            finish_reason=branch.finish_reason,
            confidence=None if confidence is None or not math.isfinite(confidence) else confidence,
        )

    def _round_note(self, trace: RoundTrace, verdict: Verdict | None) -> str:
        said = ", ".join(repr(b.answer) if b.answer else b.finish_reason for b in trace.branches)
        if verdict is None or verdict.answer is None:
            return f"Round {trace.round}: {said}; no answer yet.\n"
        return (
            f"Round {trace.round}: {said}; leading answer {verdict.answer!r}, "
            f"P(correct) {verdict.probability:.2f} (threshold {self.settings.threshold:.2f}).\n"
        )

    async def _small_answer(
        self, messages: Sequence[Message], deadline: float | None
    ) -> Generation:
        assert self.small is not None
        params = SamplingParams(max_tokens=self.settings.round_tokens, temperature=0.0)
        return await self.small.generate(messages, params, deadline)

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
        return generation if sample.finish_reason == "stop" and sample.text.strip() else None


_KIND_WORDS: dict[AnswerKind, str] = {
    "number": "a number",
    "choice": "a choice among options",
    "yesno": "yes or no",
    "text": "a short answer",
}
