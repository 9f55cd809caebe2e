"""A fallback tier: another engine answers while an engine is unavailable.

``FailoverEngine`` stands in for an engine that has ``fallback`` set. A request the
primary cannot serve (its breaker is open, its server unreachable or broken off)
goes to the fallback engine instead, as long as nothing of the answer has reached
the client yet: a stream fails over only before its first delta, a plain
``generate`` at any point, since its caller has seen nothing until it returns.
Overload (429) and refused requests are the primary's answer and are not failed over.

The ``Generation`` then names the fallback engine, and ``failed_over()`` tells the
task that consumed the stream which engine answered instead of which, for response
headers that leave before the Generation exists.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator
from contextvars import ContextVar

import msgspec

from engines.base import Delta, Engine, EngineUnavailable, Generation, Prompt, SamplingParams

log = logging.getLogger("satisfice.engines")


class Failover(msgspec.Struct, frozen=True):
    """The engine that was asked, the one that answered, and why."""

    source: str
    target: str
    reason: str


# Set in the task that iterates a FailoverEngine's stream (an async generator runs in
# its consumer's context), so the gateway can read it once the first event is in.
_failover: ContextVar[Failover | None] = ContextVar("satisfice_failover", default=None)


def failed_over() -> Failover | None:
    """The failover of this task's latest call to a FailoverEngine, if it failed over."""
    return _failover.get()


class FailoverEngine:
    def __init__(self, primary: Engine, fallback: Engine) -> None:
        self.name = primary.name
        self.model = primary.model
        self.primary = primary
        self.fallback = fallback
        # Requests the fallback answered since start, for metrics.
        self.failovers = 0

    async def start(self) -> None:
        # The fallback is an engine of its own, started and closed as such.
        await self.primary.start()

    async def close(self) -> None:
        await self.primary.close()

    def _fail_over(self, exc: EngineUnavailable) -> None:
        self.failovers += 1
        _failover.set(Failover(self.name, self.fallback.name, exc.message))
        log.warning("engine %r unavailable (%s): %r answers", self.name, exc.message,
                    self.fallback.name)  # fmt: skip

    async def stream(
        self, prompt: Prompt, params: SamplingParams, deadline: float | None = None
    ) -> AsyncGenerator[Delta | Generation]:
        _failover.set(None)
        events = self.primary.stream(prompt, params, deadline)
        try:
            first = await anext(events)
        except EngineUnavailable as exc:
            await events.aclose()
            self._fail_over(exc)
            events = self.fallback.stream(prompt, params, deadline)
            first = await anext(events)
        except BaseException:
            await events.aclose()
            raise
        async with contextlib.aclosing(events):
            yield first
            async for event in events:
                yield event

    async def generate(
        self, prompt: Prompt, params: SamplingParams, deadline: float | None = None
    ) -> Generation:
        _failover.set(None)
        try:
            return await self.primary.generate(prompt, params, deadline)
        except EngineUnavailable as exc:
            self._fail_over(exc)
        return await self.fallback.generate(prompt, params, deadline)
