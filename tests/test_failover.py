"""A failover keeps the engine contract: the answer names the engine that gave it (a
stream's first delta already), and a full primary is refused as the primary, before
any work for the request. Engines are scripted, times a virtual clock's."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator
from typing import cast

import pytest

from engines.base import (
    Delta,
    EngineOverloaded,
    EngineUnavailable,
    Feature,
    Generation,
    Prompt,
    SamplingParams,
)
from engines.failover import FailoverEngine
from engines.scripted import ScriptedEngine, script
from gateway.pipeline.pipeline import Embedded
from router.embedder import Embedder
from tests.support import VirtualClock

ANSWER = script("The answer is 42.")
SLOW = script("one two three four", seconds_per_token=1.0)


class Unreachable:
    """An engine whose server cannot be reached: every call fails as unavailable."""

    model = "remote-model"
    features: frozenset[Feature] = frozenset()

    def __init__(self, name: str = "remote") -> None:
        self.name = name

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def refusal(self) -> EngineOverloaded | None:
        return None

    async def stream(
        self, prompt: Prompt, params: SamplingParams, deadline: float | None = None
    ) -> AsyncGenerator[Delta | Generation]:
        raise EngineUnavailable(self.name, "cannot connect")
        yield  # an async generator, as the contract's stream is

    async def generate(
        self, prompt: Prompt, params: SamplingParams, deadline: float | None = None
    ) -> Generation:
        raise EngineUnavailable(self.name, "cannot connect")


async def _events(engine: FailoverEngine) -> list[Delta | Generation]:
    return [event async for event in engine.stream("What is 6 x 7?", SamplingParams())]


def test_a_stand_in_names_itself_on_its_first_delta_and_its_generation() -> None:
    engine = FailoverEngine(Unreachable(), ScriptedEngine([ANSWER], name="small"))
    events = VirtualClock().run(_events(engine))
    first, *rest, generation = events
    assert isinstance(first, Delta) and first.engine == "small"
    assert all(isinstance(e, Delta) and e.engine is None for e in rest)
    assert isinstance(generation, Generation) and generation.engine == "small"
    assert "".join(e.text for e in events if isinstance(e, Delta)) == ANSWER.text
    assert engine.failovers == 1

    whole = VirtualClock().run(engine.generate("What is 6 x 7?", SamplingParams()))
    assert whole.engine == "small" and engine.failovers == 2


def test_a_primary_that_answers_is_named_by_its_generation_alone() -> None:
    engine = FailoverEngine(ScriptedEngine([ANSWER], name="remote"), ScriptedEngine([ANSWER]))
    events = VirtualClock().run(_events(engine))
    assert all(e.engine is None for e in events if isinstance(e, Delta))
    assert isinstance(events[-1], Generation) and events[-1].engine == "remote"
    assert engine.failovers == 0


def test_a_failover_is_as_full_as_its_primary() -> None:
    """Overload is the primary's answer, not failed over: a primary with every slot busy
    and no room to wait makes the failover refuse too, however idle its fallback."""
    primary = ScriptedEngine([SLOW], name="remote", concurrency=1, queue_size=0)
    fallback = ScriptedEngine([ANSWER], name="small")
    engine = FailoverEngine(primary, fallback)

    async def main() -> None:
        assert engine.refusal() is None
        busy = primary.stream("another client", SamplingParams())
        async with contextlib.aclosing(busy):
            await anext(busy)
            refusal = engine.refusal()
            assert isinstance(refusal, EngineOverloaded) and refusal.engine == "remote"
            assert fallback.refusal() is None
        assert engine.refusal() is None

    VirtualClock().run(main())


class _NoEmbedder:
    async def embed(self, text: str) -> object:
        raise AssertionError("embedded for a request every engine would refuse")


def test_a_request_only_a_full_failover_could_answer_is_refused_before_its_embedding() -> None:
    primary = ScriptedEngine([SLOW], name="remote", concurrency=1, queue_size=0)
    engine = FailoverEngine(primary, ScriptedEngine([ANSWER], name="small"))
    embedder = cast(Embedder, _NoEmbedder())  # it must not run

    async def main() -> None:
        busy = primary.stream("another client", SamplingParams())
        async with contextlib.aclosing(busy):
            await anext(busy)
            with pytest.raises(EngineOverloaded) as refused:
                await Embedded(embedder, "What is 6 x 7?", [engine]).get()
            assert refused.value.retry_after_s == 1.0

    VirtualClock().run(main())
