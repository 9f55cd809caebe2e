"""Every way a chat request can end settles it exactly once, with a complete decision.

The pipeline runs here on scripted engines (engines/scripted.py: real engines whose
model is a script) with the bundled embedder and router and a memory cache, so every
exit is reached on purpose and fast: exact and coalesced hits, an engine's answer
plain and streamed, the loop's answer, its deadline fallbacks, refusals, an engine
that refuses, a client that leaves and a turn replaced by a newer one. A small front
door here ends each exchange as the HTTP layer does (gateway.api.chat.ending).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import pytest

from cache import create_store
from cache.semantic_cache import SemanticCache
from engines.base import Message, SamplingParams
from engines.scripted import ScriptedEngine, script
from evaluator.calibration import Calibrator
from evaluator.loop import FallbackSettings, ReasoningLoop
from evaluator.signals import SignalSettings
from gateway.api.chat import ending
from gateway.config import parse_config
from gateway.pipeline.exchange import Exchange, Settled, Settlement
from gateway.pipeline.keeping import WriteBack
from gateway.pipeline.outcome import Event, Reasoning, TextDelta
from gateway.pipeline.pipeline import Pipeline
from gateway.pipeline.request import ChatRequest
from gateway.pipeline.request_policy import CacheControl, Policy, resolve
from router.embedder import Embedder
from router.router import Router

QUESTION = "What is 6 * 7?"
ANSWER = "The answer is 42."
SIGNALS = SignalSettings(top_k=2, group_window=4)
SURE = script(ANSWER, logprob=-0.1, alternatives=(-3.9,))
# P(correct) from the vote share alone: 1.0 for a unanimous round.
BY_SHARE = Calibrator(
    features=["vote_share"], signals=SIGNALS, mean=[0.0], scale=[1.0], weights=[8.0], bias=-4.0
)
CONFIG = parse_config(
    """
router: {model_file: bundled, small_engine: small, large_engine: large}
loop: {calibrator: null, branches: 2, max_rounds: 2, threshold: 0.9}
cache: {store: {kind: memory}, semantic: false}
engines:
  small: {backend: llama_cpp, model: smollm2-135m-instruct}
  large: {backend: llama_cpp, model: smollm2-135m-instruct}
"""
)


class Gateway:
    """A pipeline on scripted engines, its settlement, and what has settled."""

    def __init__(self, pipeline: Pipeline, settlement: Settlement, cache: SemanticCache) -> None:
        self.pipeline = pipeline
        self.settlement = settlement
        self.cache = cache
        self.settled: list[Settled] = []
        self.events: list[list[Event]] = []  # what each request was sent, in order
        self.background: set[asyncio.Task[None]] = set()
        self._came = asyncio.Event()
        settlement.subscribe(WriteBack(cache, self._in_background))
        settlement.subscribe(self._heard)

    def _heard(self, settled: Settled) -> None:
        self.settled.append(settled)
        self._came.set()

    def _in_background(self, task: asyncio.Task[None]) -> None:
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    def policy(self, **changes: object) -> Policy:
        policy = resolve(CONFIG, "default", arrived=time.monotonic())
        return msgspec.structs.replace(policy, **changes)

    async def ask(
        self,
        request: ChatRequest,
        policy: Policy,
        *,
        leave_after: int | None = None,
    ) -> Exchange:
        """``request`` through a front door as the HTTP layer's: its events read to the
        end (or ``leave_after`` of them, then the client leaves), its exchange ended.
        It arrives now: deadlines count from here."""
        policy = msgspec.structs.replace(policy, arrived=time.monotonic())
        exchange = Exchange(
            self.settlement, tenant="default", model=request.model, key=None, request_id=None
        )
        exchange.admitted(request, policy)
        events: list[Event] = []
        self.events.append(events)
        try:
            answering = await self.pipeline.run(request, policy, exchange)
            async with contextlib.aclosing(answering.events) as stream:
                async for event in stream:
                    if not events and request.stream:
                        exchange.first_byte()
                    events.append(event)
                    if leave_after is not None and len(events) >= leave_after:
                        exchange.end(499, "client_gone")
                        return exchange
        except BaseException as exc:
            status, error = ending(exc)
            if events and request.stream and status != 499:  # in the stream begun
                status = 200
            exchange.end(status, error)
            if not isinstance(exc, Exception):
                raise
            return exchange
        exchange.end(200)
        return exchange

    async def settled_for(self, exchange: Exchange) -> Settled:
        """The one settled event of ``exchange``, once its work is over too."""
        async with asyncio.timeout(10):
            while not exchange.settled:
                self._came.clear()
                await self._came.wait()
        await asyncio.gather(*self.background)
        mine = [s for s in self.settled if s.decision is exchange.decision]
        assert len(mine) == 1, f"settled {len(mine)} times"
        return mine[0]


@pytest.fixture(scope="module")
async def embedder() -> AsyncIterator[tuple[Embedder, Router]]:
    models_dir = await asyncio.to_thread(Path(CONFIG.models_dir).expanduser)
    embedder = Embedder(CONFIG.embedder, models_dir)
    await embedder.start()
    assert CONFIG.router is not None
    router = Router(CONFIG.router, embedder)
    await router.start()
    yield embedder, router
    await embedder.close()


def _gateway(
    parts: tuple[Embedder, Router], small: ScriptedEngine, large: ScriptedEngine
) -> Gateway:
    embedder, router = parts
    assert CONFIG.cache is not None and CONFIG.loop is not None
    cache = SemanticCache(CONFIG.cache, create_store(CONFIG.cache))
    loop = ReasoningLoop(large, CONFIG.loop, BY_SHARE, small=small)
    pipeline = Pipeline(
        engines={"small": small, "large": large},
        engine_timeouts_s={},
        embedder=embedder,
        router=router,
        cache=cache,
        loop=loop,
    )
    return Gateway(pipeline, Settlement(), cache)


def _request(model: str = "small", *, stream: bool = False, text: str = QUESTION) -> ChatRequest:
    return ChatRequest(
        model=model,
        messages=(Message("user", text),),
        params=SamplingParams(max_tokens=32, temperature=0.0),
        include_usage=False,
        stream=stream,
        prompt_tokens=4,
    )


@contextlib.contextmanager
def _every_decision_complete(gateway: Gateway) -> Iterator[None]:
    """After the block: every settled decision names its route, and nothing is left
    to change it (a late change raises)."""
    yield
    for settled in gateway.settled:
        assert settled.decision.route, settled
        assert settled.decision.cache in ("exact", "semantic", "coalesced", "miss", "bypass", "off")


ALL_SMALL = 2.0  # a router threshold above every score: everything is easy
ALL_LARGE = -1.0  # below every score: everything is hard, the loop answers


async def test_an_engine_answer_then_an_exact_hit_each_settle_once(
    embedder: tuple[Embedder, Router],
) -> None:
    gateway = _gateway(
        embedder, ScriptedEngine([SURE], name="small"), ScriptedEngine([SURE], name="large")
    )
    with _every_decision_complete(gateway):
        first = await gateway.settled_for(await gateway.ask(_request(), gateway.policy()))
        again = await gateway.settled_for(await gateway.ask(_request(), gateway.policy()))
    assert (first.status, first.decision.route, first.decision.cache) == (200, "small", "miss")
    assert first.answer is not None and first.answer.texts == (ANSWER,)
    assert first.kept is not None and first.decision.engine_s is not None
    assert (again.status, again.decision.route, again.decision.cache) == (200, "exact", "exact")
    assert again.answer is not None and again.answer.texts == (ANSWER,)
    assert again.kept is None and again.decision.cache_entry is not None
    assert len(gateway.settled) == 2


async def test_a_stream_settles_with_its_first_byte_and_a_client_that_leaves_with_499(
    embedder: tuple[Embedder, Router],
) -> None:
    small = ScriptedEngine([script(ANSWER, seconds_per_token=0.01)], name="small")
    gateway = _gateway(embedder, small, ScriptedEngine([SURE], name="large"))
    policy = gateway.policy(control=CacheControl(lookup=False))
    whole = await gateway.settled_for(await gateway.ask(_request(stream=True), policy))
    assert whole.status == 200 and whole.first_byte_s is not None
    assert whole.answer is not None and whole.answer.finish_reasons == ("stop",)
    left = await gateway.settled_for(
        await gateway.ask(_request(stream=True), policy, leave_after=2)
    )
    assert (left.status, left.error) == (499, "client_gone")
    assert left.answer is not None and left.answer.finish_reasons == ()
    assert left.answer.texts[0] and ANSWER.startswith(left.answer.texts[0])
    assert left.kept is None  # cut off: not the answer
    assert len(gateway.settled) == 2


async def test_refusals_and_an_engine_that_refuses_settle_with_their_status(
    embedder: tuple[Embedder, Router],
) -> None:
    busy = ScriptedEngine([script(ANSWER, seconds_per_token=1.0)], name="small",
                          concurrency=1, queue_size=0)  # fmt: skip
    gateway = _gateway(embedder, busy, ScriptedEngine([SURE], name="large"))
    only_cached = gateway.policy(control=CacheControl(only_cached=True))
    missed = await gateway.settled_for(await gateway.ask(_request(), only_cached))
    assert (missed.status, missed.error, missed.decision.cache) == (504, "cache_miss", "miss")
    assert missed.answer is None
    bypass = gateway.policy(control=CacheControl(lookup=False, store=False))
    holding = asyncio.ensure_future(gateway.ask(_request(stream=True), bypass, leave_after=1))
    await asyncio.sleep(0.1)  # the only slot is taken
    refused = await gateway.settled_for(await gateway.ask(_request(), bypass))
    assert (refused.status, refused.error) == (429, "engine_overloaded")
    assert refused.decision.route == "small"  # decided up to the engine's refusal
    await gateway.settled_for(await holding)
    assert len(gateway.settled) == 3


async def test_identical_requests_settle_each_and_a_leader_that_left_settles_after_its_work(
    embedder: tuple[Embedder, Router],
) -> None:
    small = ScriptedEngine([script(ANSWER, seconds_per_token=0.05)], name="small")
    gateway = _gateway(embedder, small, ScriptedEngine([SURE], name="large"))
    policy = gateway.policy()
    # The leader's client leaves after its first token; the follower still waits.
    leader = asyncio.ensure_future(gateway.ask(_request(stream=True), policy, leave_after=1))
    await asyncio.sleep(0.02)
    follower = asyncio.ensure_future(gateway.ask(_request(stream=True), policy))
    led = await leader
    assert not led.settled  # its work goes on for the follower
    followed = await gateway.settled_for(await follower)
    settled = await gateway.settled_for(led)
    assert (followed.status, followed.decision.route, followed.decision.cache) == (
        200, "coalesced", "coalesced",
    )  # fmt: skip
    assert followed.answer is not None and followed.answer.texts == (ANSWER,)
    assert settled.status == 499 and settled.decision.route == "small"
    assert settled.kept is not None  # the whole answer its work gave is kept
    assert len(small.calls) == 1
    hit = await gateway.settled_for(await gateway.ask(_request(), policy))
    assert hit.decision.cache == "exact"


async def test_the_loops_answer_its_fallback_and_its_deadline_error_settle_once(
    embedder: tuple[Embedder, Router],
) -> None:
    paced = script(ANSWER, logprob=-0.1, alternatives=(-3.9,), seconds_per_token=0.05)
    gateway = _gateway(
        embedder, ScriptedEngine([SURE], name="small"), ScriptedEngine([paced], name="large")
    )
    hard = gateway.policy(router_threshold=ALL_LARGE, control=CacheControl(lookup=False))
    thought = await gateway.settled_for(await gateway.ask(_request("auto"), hard))
    assert (thought.status, thought.decision.route) == (200, "loop")
    assert thought.decision.loop is not None and thought.decision.confidence is not None
    assert thought.kept is not None and thought.kept.tier == "loop"
    # A deadline before the first round ends: the small engine's answer (started with
    # the loop), then an error.
    soon = {"large": 100, "small": 100}
    small_fallback = msgspec.structs.replace(
        hard, deadline_ms=soon, fallback=FallbackSettings(policy="small", hedge=True)
    )
    fell = await gateway.settled_for(await gateway.ask(_request("auto"), small_fallback))
    assert (fell.status, fell.decision.route) == (200, "fallback")
    assert fell.decision.loop is not None and fell.decision.loop.fallback == "small"
    assert fell.kept is None  # a fallback's answer is not what the loop would have said
    error = msgspec.structs.replace(
        hard, deadline_ms=soon, fallback=FallbackSettings(policy="error")
    )
    failed = await gateway.settled_for(await gateway.ask(_request("auto"), error))
    assert (failed.status, failed.error) == (504, "deadline_exceeded")
    assert failed.decision.loop is not None and failed.answer is None
    assert len(gateway.settled) == 3


async def test_a_turn_replaced_by_a_newer_one_settles_with_409(
    embedder: tuple[Embedder, Router],
) -> None:
    slow = script(ANSWER, logprob=-0.1, alternatives=(-3.9,), seconds_per_token=0.2)
    gateway = _gateway(
        embedder, ScriptedEngine([SURE], name="small"), ScriptedEngine([slow], name="large")
    )
    turn = gateway.policy(
        router_threshold=ALL_LARGE, control=CacheControl(lookup=False), conversation="c1"
    )
    first = asyncio.ensure_future(gateway.ask(_request("auto", stream=True), turn))
    await asyncio.sleep(0.3)  # thinking
    newer = _request("auto", text="And 6 * 8?")
    second = await gateway.settled_for(await gateway.ask(newer, turn))
    replaced = await gateway.settled_for(await first)
    assert (replaced.status, replaced.error) == (200, "superseded")  # in the stream begun
    assert replaced.decision.route == "loop" and replaced.kept is None
    assert second.status == 200 and second.decision.superseded_ms is not None
    assert len(gateway.settled) == 2


async def test_a_settled_decision_no_longer_changes(embedder: tuple[Embedder, Router]) -> None:
    gateway = _gateway(
        embedder, ScriptedEngine([SURE], name="small"), ScriptedEngine([SURE], name="large")
    )
    exchange = await gateway.ask(_request(), gateway.policy())
    settled = await gateway.settled_for(exchange)
    with pytest.raises(RuntimeError, match="settled"):
        exchange.decide(route="large")
    exchange.end(500)  # a second end is no second settlement
    assert gateway.settled == [settled]


async def test_a_streamed_loop_shows_a_first_answer_but_serves_and_keeps_its_own(
    embedder: tuple[Embedder, Router],
) -> None:
    paced = script(ANSWER, logprob=-0.1, alternatives=(-3.9,), seconds_per_token=0.05)
    small = ScriptedEngine([script("It is 41.", seconds_per_token=0.01)], name="small")
    gateway = _gateway(embedder, small, ScriptedEngine([paced], name="large"))
    hard = gateway.policy(router_threshold=ALL_LARGE, control=CacheControl(lookup=False))
    assert hard.loop is not None
    first_answer = msgspec.structs.replace(
        hard, loop=msgspec.structs.replace(hard.loop, first_answer=True)
    )
    settled = await gateway.settled_for(
        await gateway.ask(_request("auto", stream=True), first_answer)
    )
    events = gateway.events[-1]
    shown = "".join(e.text for e in events if isinstance(e, Reasoning) and e.kind == "first_answer")
    assert "It is 41." in shown
    # The client's answer text and the cache's are the loop's alone.
    assert [e.text for e in events if isinstance(e, TextDelta)] == [ANSWER]
    assert settled.answer is not None and settled.answer.texts == (ANSWER,)
    assert settled.kept is not None and settled.kept.answer.text == ANSWER
    loop = settled.decision.loop
    assert loop is not None and loop.first_answer is not None
    assert loop.first_answer.verdict == "replaced"
    assert settled.first_meaningful_s is not None and settled.first_byte_s is not None
    assert settled.first_byte_s <= settled.first_meaningful_s < settled.seconds
    # A plain request asks for no first answer: there is no one to show it to.
    plain = await gateway.settled_for(await gateway.ask(_request("auto"), first_answer))
    assert plain.decision.loop is not None and plain.decision.loop.first_answer is None
    assert plain.first_meaningful_s is None
