"""A fallback tier: another engine answers while an engine is unavailable.

``FailoverEngine`` stands in for an engine that has ``fallback`` set. A request the
primary cannot serve (its breaker is open, its server unreachable or broken off)
goes to the fallback engine instead, as long as nothing of the answer has reached
the client yet: a stream fails over only before its first delta, a plain
``generate`` at any point, since its caller has seen nothing until it returns.
Overload (429) and refused requests are the primary's answer and are not failed over.

The answer then says which engine gave it: the ``Generation`` is the fallback's own,
and a stream's first ``Delta`` carries the fallback's name in ``engine``, for response
headers that leave before the Generation exists.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator

import msgspec

from engines.base import (
    Delta,
    Engine,
    EngineOverloaded,
    EngineUnavailable,
    Feature,
    Generation,
    Prompt,
    SamplingParams,
    asked_features,
)

log = logging.getLogger("satisfice.engines")


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

    @property
    def features(self) -> frozenset[Feature]:
        return self.primary.features

    def refusal(self) -> EngineOverloaded | None:
        # The primary's: a full primary refuses with 429, which is not failed over.
        return self.primary.refusal()

    def _fail_over(self, exc: EngineUnavailable) -> None:
        self.failovers += 1
        log.warning("engine %r unavailable (%s): %r answers", self.name, exc.message,
                    self.fallback.name)  # fmt: skip

    async def stream(
        self, prompt: Prompt, params: SamplingParams, deadline: float | None = None
    ) -> AsyncGenerator[Delta | Generation]:
        events = self.primary.stream(prompt, params, deadline)
        try:
            first = await anext(events)
        except EngineUnavailable as exc:
            await events.aclose()
            if not set(asked_features(params)) <= self.fallback.features:
                raise  # the fallback would answer in plain text what asks for more
            self._fail_over(exc)
            events = self.fallback.stream(prompt, params, deadline)
            first = await anext(events)
            if isinstance(first, Delta) and first.engine is None:
                first = msgspec.structs.replace(first, engine=self.fallback.name)
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
        try:
            return await self.primary.generate(prompt, params, deadline)
        except EngineUnavailable as exc:
            self._fail_over(exc)
        return await self.fallback.generate(prompt, params, deadline)
