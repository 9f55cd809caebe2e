"""Run ``n`` independent samples of one prompt and merge them into one stream.

Backends implement a single sample; this module gives every backend the same
``stream``/``generate`` behaviour for ``n > 1``, the same cancellation (closing the
merged stream cancels every sample) and the same ``Generation`` at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator

import msgspec

from engines.admission import Admission
from engines.base import (
    Delta,
    EngineOverloaded,
    Feature,
    Generation,
    Prompt,
    Sample,
    SamplingParams,
    Timings,
)


def remaining(deadline: float | None) -> float | None:
    """Seconds left until a ``time.monotonic()`` deadline (the event loop's own clock,
    which uvloop keeps differently, is never compared with it)."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class SampleDone(msgspec.Struct, frozen=True):
    """The end of one sample's stream: the sample and what its prompt cost."""

    sample: Sample
    prompt_tokens: int


def expired(index: int, waited_s: float) -> SampleDone:
    """The empty sample of a request whose deadline passed while it was queued."""
    timings = Timings(queue_s=waited_s, first_token_s=None, total_s=waited_s)
    sample = Sample(
        index=index, text="", finish_reason="deadline", completion_tokens=0, timings=timings
    )
    return SampleDone(sample, prompt_tokens=0)


class EngineCounters(msgspec.Struct, kw_only=True):
    """Running totals since start, for metrics."""

    # Of every sample that finished (a sample cancelled mid-way is not counted); the
    # prompt once per sample, as the backend processes it once per sample.
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # Calls refused with EngineOverloaded: this engine's queue was full, or the
    # server behind it said so.
    overloads: int = 0


class FanOutEngine(ABC):
    """Base for backends that generate one sample at a time."""

    name: str
    model: str
    timeout_s: float | None
    counters: EngineCounters
    # Plain text only, unless a backend says more (engines.base.Engine.features).
    features: frozenset[Feature] = frozenset()
    _admission: Admission

    @property
    def waiting(self) -> int:
        """Samples waiting for a generation slot now."""
        return self._admission.waiting

    def refusal(self) -> EngineOverloaded | None:
        """What a new request would be refused with now (every slot busy, the queue
        full); None: it would be taken."""
        return self._admission.refusal() if self._admission.full else None

    @abstractmethod
    def _sample(
        self,
        prompt: Prompt,
        params: SamplingParams,
        index: int,
        deadline: float | None,
        queue_s: float,
    ) -> AsyncGenerator[Delta | SampleDone]:
        """Stream one sample; ``params.seed`` is already this sample's own seed.

        It is called holding one admission slot, and must release it
        (``self._admission.release()``) once the backend's resources are free again.
        """

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def _admit(self, deadline: float | None) -> bool:
        """Wait for a generation slot; False if the deadline came first."""
        try:
            async with asyncio.timeout(remaining(deadline)):
                await self._admission.acquire()
        except TimeoutError:
            return False
        return True

    def _deadline(self, deadline: float | None) -> float | None:
        if self.timeout_s is None:
            return deadline
        own = time.monotonic() + self.timeout_s
        return own if deadline is None else min(own, deadline)

    async def stream(
        self, prompt: Prompt, params: SamplingParams, deadline: float | None = None
    ) -> AsyncGenerator[Delta | Generation]:
        deadline = self._deadline(deadline)
        merged: asyncio.Queue[Delta | SampleDone | Exception] = asyncio.Queue()

        async def pump(index: int) -> None:
            # Seeded requests stay reproducible while their n samples still differ.
            seed = None if params.seed is None else params.seed + index
            own = msgspec.structs.replace(params, seed=seed)
            try:
                queued = time.monotonic()
                admitted = await self._admit(deadline)
                queue_s = time.monotonic() - queued
                if not admitted:
                    merged.put_nowait(expired(index, queue_s))
                    return
                sample = self._sample(prompt, own, index, deadline, queue_s)
                async with contextlib.aclosing(sample) as it:
                    async for item in it:
                        merged.put_nowait(item)
            except Exception as exc:  # handed to the consumer, which re-raises it
                merged.put_nowait(exc)

        tasks = [asyncio.create_task(pump(i)) for i in range(params.n)]
        try:
            async with contextlib.aclosing(self._merged(merged, params.n)) as items:
                async for item in items:
                    if isinstance(item, Generation):
                        generation = item
                        break
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            # Let every sample release its slot before the caller goes on.
            await asyncio.gather(*tasks, return_exceptions=True)
        yield generation

    async def _merged(
        self, merged: asyncio.Queue[Delta | SampleDone | Exception], n: int
    ) -> AsyncGenerator[Delta | Generation]:
        """The deltas of ``n`` samples as they come on ``merged``, then their Generation;
        an exception put there is raised to the caller."""
        done: list[SampleDone] = []
        while len(done) < n:
            item = await merged.get()
            if isinstance(item, Exception):
                if isinstance(item, EngineOverloaded):
                    self.counters.overloads += 1
                raise item
            if isinstance(item, SampleDone):
                done.append(item)
                self.counters.prompt_tokens += item.prompt_tokens
                self.counters.completion_tokens += item.sample.completion_tokens
            else:
                yield item
        done.sort(key=lambda d: d.sample.index)
        yield Generation(
            engine=self.name,
            model=self.model,
            prompt_tokens=max(d.prompt_tokens for d in done),
            samples=tuple(d.sample for d in done),
        )

    async def generate(
        self, prompt: Prompt, params: SamplingParams, deadline: float | None = None
    ) -> Generation:
        async with contextlib.aclosing(self.stream(prompt, params, deadline)) as it:
            async for item in it:
                if isinstance(item, Generation):
                    return item
        raise AssertionError("stream ended without a Generation")
