"""A backend whose model is a script: each sample replays given tokens with given
log-probabilities.

It is a real ``Engine``, built on the same ``FanOutEngine`` as the llama.cpp and HTTP
backends, so admission and its bounded queue, ``params.n`` samples with their own
seeds, merged streams, counters, the deadline and cancellation behave as theirs do;
only the model is replaced. Like the in-process engine it checks the deadline before
every token, stops at ``max_tokens`` ("length"), at a stop sequence (held back while
it may still be one) or at the end of its script (the model's end of answer,
"stop"), gives logprobs only when asked and as many alternatives as asked, and a
closed stream stops it before its next token.

What a sample says is chosen per sample, deterministically: from a list of scripts
by the sample's number (the samples this engine started before it), or by a
function of the ``ScriptCall`` (its number, its index among the request's n samples,
the prompt and its own sampling settings, seed included). Tests use it to say, for
example, that the first branch of each round answers 42 with confident tokens and
the second 41 with doubtful ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncGenerator, Callable, Sequence

import msgspec

from engines.admission import Admission
from engines.base import (
    Delta,
    FinishReason,
    Prompt,
    Sample,
    SamplingParams,
    Timings,
    TokenLogprob,
    TopLogprob,
)
from engines.fanout import EngineCounters, FanOutEngine, SampleDone
from engines.stops import StopMatcher


class Script(msgspec.Struct, frozen=True, kw_only=True):
    """One sample as the model would generate it if nothing stopped it: its tokens in
    order, each with its log-probability and its top alternatives (the token itself
    among them, most likely first), then the end of the answer."""

    tokens: tuple[TokenLogprob, ...]
    # How long each token takes to generate (a wait on the event loop).
    seconds_per_token: float = 0.0

    @property
    def text(self) -> str:
        return "".join(token.token for token in self.tokens)

    def __add__(self, other: Script) -> Script:
        """This script's tokens, then ``other``'s, at this script's pace."""
        return msgspec.structs.replace(self, tokens=self.tokens + other.tokens)


_PIECES = re.compile(r"\s*\S+|\s+")


def script(
    text: str | Sequence[str],
    *,
    logprob: float = 0.0,
    alternatives: Sequence[float] = (),
    seconds_per_token: float = 0.0,
) -> Script:
    """A script of ``text``, cut into tokens at word starts (a word and the spaces
    before it), or of the given token pieces, every token chosen with ``logprob``
    and listed in its top alternatives with others of these log-probabilities."""
    pieces = _PIECES.findall(text) if isinstance(text, str) else list(text)
    tokens = []
    for piece in pieces:
        others = (TopLogprob(f"<alt{j}>", lp) for j, lp in enumerate(alternatives, 1))
        top = sorted((TopLogprob(piece, logprob), *others), key=lambda t: -t.logprob)
        tokens.append(TokenLogprob(piece, logprob, tuple(top)))
    return Script(tokens=tuple(tokens), seconds_per_token=seconds_per_token)


class ScriptCall(msgspec.Struct, frozen=True, kw_only=True):
    """One sample the engine was asked for, as the script chooser sees it."""

    number: int  # samples this engine started before this one
    index: int  # its index among the request's n samples
    prompt: Prompt
    params: SamplingParams  # this sample's own, its seed included
    started: float  # time.monotonic() when it got its slot


Scripts = Sequence[Script] | Callable[[ScriptCall], Script]


class ScriptedEngine(FanOutEngine):
    """Replays ``scripts``: a list taken in turn by sample number (and round again
    from the start), or a function that picks a sample's script."""

    def __init__(
        self,
        scripts: Scripts,
        *,
        name: str = "scripted",
        model: str = "scripted",
        concurrency: int = 16,
        queue_size: int = 16,
        retry_after_s: float = 1.0,
        timeout_s: float | None = None,
    ) -> None:
        if not callable(scripts) and not scripts:
            raise ValueError("a scripted engine needs at least one script")
        self.name = name
        self.model = model
        self.timeout_s = timeout_s
        self.counters = EngineCounters()
        self._admission = Admission(name, concurrency, queue_size, retry_after_s)
        self._scripts = scripts
        # What the engine was asked for and what each sample came to, in order.
        self.calls: list[ScriptCall] = []
        self.samples: list[Sample] = []
        self.tokens_generated = 0
        self.busy_slots = 0

    def _choose(self, call: ScriptCall) -> Script:
        if callable(self._scripts):
            return self._scripts(call)
        return self._scripts[call.number % len(self._scripts)]

    async def _sample(
        self,
        prompt: Prompt,
        params: SamplingParams,
        index: int,
        deadline: float | None,
        queue_s: float,
    ) -> AsyncGenerator[Delta | SampleDone]:
        call = ScriptCall(
            number=len(self.calls),
            index=index,
            prompt=prompt,
            params=params,
            started=time.monotonic(),
        )
        self.calls.append(call)
        replay = _Replay(self._choose(call), params, index)
        self.busy_slots += 1
        sample: Sample | None = None
        try:
            async with contextlib.aclosing(replay.run(deadline, self)) as deltas:
                async for delta in deltas:
                    yield delta
            sample = replay.sample(queue_s, replay.finish)
        finally:
            if sample is None:  # closed or cancelled before its end
                sample = replay.sample(queue_s, "cancelled")
            self.samples.append(sample)
            self.busy_slots -= 1
            self._admission.release()
        if sample.finish_reason != "cancelled":
            yield SampleDone(sample, prompt_tokens=prompt_tokens(prompt))


class _Replay:
    """One sample of a script, token by token, as the in-process engine generates one."""

    def __init__(self, script: Script, params: SamplingParams, index: int) -> None:
        self._script = script
        self._params = params
        self._index = index
        self._matcher = StopMatcher(params.stop)
        self._pieces: list[str] = []
        self._logprobs: list[TokenLogprob] = []
        self._pending: list[TokenLogprob] = []
        self._started = time.monotonic()
        self._first_token_at: float | None = None
        self.count = 0
        self.finish: FinishReason = "length"

    async def run(self, deadline: float | None, engine: ScriptedEngine) -> AsyncGenerator[Delta]:
        tokens = self._script.tokens
        matched = False
        while self.count < self._params.max_tokens:
            if deadline is not None and time.monotonic() >= deadline:
                self.finish = "deadline"
                break
            if self.count == len(tokens):
                self.finish = "stop"  # the model ended its answer
                break
            # Generating the token; a closed stream is stopped here, before the next.
            await asyncio.sleep(self._script.seconds_per_token)
            token = tokens[self.count]
            if self._first_token_at is None:
                self._first_token_at = time.monotonic()
            self.count += 1
            engine.tokens_generated += 1
            if self._params.logprobs:
                top = token.top[: self._params.top_logprobs]
                self._pending.append(TokenLogprob(token.token, token.logprob, top))
            safe, matched = self._matcher.feed(token.token)
            if delta := self._flush(safe):
                yield delta
            if matched:
                self.finish = "stop"
                break
        # Text held back as a possible stop sequence was not one.
        if not matched and (delta := self._flush(self._matcher.flush(), final=True)):
            yield delta

    def _flush(self, piece: str, final: bool = False) -> Delta | None:
        # Logprobs of tokens whose text is still held back wait for that text.
        if not piece and not (final and self._pending):
            return None
        self._pieces.append(piece)
        self._logprobs.extend(self._pending)
        delta = Delta(self._index, piece, tuple(self._pending))
        self._pending = []
        return delta

    def sample(self, queue_s: float, finish: FinishReason) -> Sample:
        first = self._first_token_at
        return Sample(
            index=self._index,
            text="".join(self._pieces),
            finish_reason=finish,
            completion_tokens=self.count,
            logprobs=tuple(self._logprobs),
            timings=Timings(
                queue_s=queue_s,
                first_token_s=None if first is None else first - self._started,
                total_s=time.monotonic() - self._started,
            ),
        )


def prompt_tokens(prompt: Prompt) -> int:
    """What the prompt costs: a token per word of its text (of every message's)."""
    if isinstance(prompt, str):
        return len(prompt.split())
    return sum(len(message.content.split()) + 1 for message in prompt)
