"""The pipeline as one transport-free call, on the bundled models: what it decides and
what it keeps, read from the typed decision and the cache itself."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import msgspec
import pytest

from engines.base import Message, SamplingParams
from gateway.api.validate import chat_request
from gateway.api.wire import ChatCompletionRequest, ChatMessage
from gateway.config import parse_config
from gateway.pipeline.exchange import Settled
from gateway.pipeline.outcome import Finished, TextDelta
from gateway.pipeline.pipeline import Pipeline, token_confidence
from gateway.pipeline.request import ChatRequest
from gateway.pipeline.request_policy import CacheControl, resolve
from gateway.runtime import Runtime
from tests.support import exchange_for

# A router threshold above any score sends every question to the small engine (which
# ones the shipped router itself sends small changes with each refit); escalation is
# on, but so low that the small engine's answer always stands.
EASY = "What is 2+2?"
CONFIG = """
router: {model_file: bundled, small_engine: small, large_engine: large, threshold: 1.5}
loop: {calibrator: bundled, escalate_below: 0.000001}
cache: {store: {kind: memory}}
engines:
  small: {backend: llama_cpp, model: smollm2-135m-instruct}
  large:
    backend: llama_cpp
    model: gemma3-270m
    template: {preamble: "", stop: ["\\n"]}
"""


@pytest.fixture(scope="module")
async def runtime() -> AsyncIterator[Runtime]:
    runtime = Runtime(parse_config(CONFIG))
    await runtime.start()
    assert runtime.ready, runtime.failure
    yield runtime
    await runtime.close()


def _request(runtime: Runtime, question: str, max_tokens: int = 32) -> ChatRequest:
    wire = ChatCompletionRequest(
        model="auto", messages=[ChatMessage("user", question)], max_tokens=max_tokens, temperature=0
    )
    return chat_request(wire, runtime.engines, routing=True, limits=runtime.config.server)


async def _answer(
    runtime: Runtime, pipeline: Pipeline, request: ChatRequest, control: CacheControl
) -> Settled:
    """The whole answer through the pipeline, settled, its write-back finished."""
    policy = resolve(runtime.config, "default", arrived=time.monotonic(), control=control)
    exchange = exchange_for(runtime, request)
    settled: list[Settled] = []
    came = asyncio.Event()

    def heard(one: Settled) -> None:
        if one.decision is exchange.decision:  # this request's, not an earlier one's
            settled.append(one)
            came.set()

    runtime.settlement.subscribe(heard)
    answering = await pipeline.run(request, policy, exchange)
    events = [event async for event in answering.events]
    assert isinstance(events[0], TextDelta) and isinstance(events[-1], Finished)
    exchange.end(200)
    # A request that leads identical ones settles once its work's task is over.
    await asyncio.wait_for(came.wait(), timeout=5)
    await asyncio.gather(*runtime.background)
    (only,) = settled
    return only


async def test_a_kept_small_answer_is_cached_by_its_calibrated_confidence(
    runtime: Runtime,
) -> None:
    """The evaluator scored the small engine's answer before it let it stand: that
    P(correct), not the answer's mean token probability, is what cache.write_confidence
    is compared with."""
    pipeline = runtime.pipeline
    request = _request(runtime, EASY)
    looked = await _answer(runtime, pipeline, request, CacheControl(lookup=False, store=False))
    decision = looked.decision
    assert decision.route == "small" and decision.escalated_from is None
    assert decision.confidence is not None
    calibrated = decision.confidence
    # The same greedy answer's token probabilities, as the engine gives them.
    small = runtime.engines["small"]
    params = msgspec.structs.replace(request.params, logprobs=True)
    token_mean = token_confidence(await small.generate(request.messages, params))
    assert calibrated < token_mean, "the two scales must differ for this test to tell them"

    cache = runtime.cache
    assert cache is not None
    settings = cache.settings
    cache.settings = msgspec.structs.replace(
        settings, write_confidence=(calibrated + token_mean) / 2
    )
    stored, refused = cache.counters.writes, cache.counters.writes_below_confidence
    try:
        await _answer(runtime, pipeline, request, CacheControl(lookup=False, store=True))
    finally:
        cache.settings = settings
    assert cache.counters.writes == stored  # below the bar by its calibrated P
    assert cache.counters.writes_below_confidence == refused + 1


async def test_a_whole_answer_is_kept_and_then_served_without_routing(runtime: Runtime) -> None:
    pipeline = runtime.pipeline
    # Room for the whole answer: one cut short by max_tokens is not kept, and how long
    # the greedy answer is differs between CPUs (85 tokens on one host, under 64 on
    # another).
    request = _request(runtime, "What colour is the sky?", max_tokens=256)
    first = await _answer(runtime, pipeline, request, CacheControl())
    assert first.decision.cache == "miss" and first.decision.difficulty is not None
    # Asked again: the exact path answers it, with no engine call and no route.
    again = await _answer(runtime, pipeline, request, CacheControl())
    assert again.decision.cache == again.decision.route == "exact"
    assert again.decision.difficulty is None
    assert again.decision.engine == first.decision.engine


def test_a_request_in_engine_terms() -> None:
    config = parse_config(CONFIG)
    runtime = Runtime(config)
    request = _request(runtime, EASY, max_tokens=7)
    assert request.messages == (Message("user", EASY),)
    assert request.params == SamplingParams(max_tokens=7, temperature=0.0)
    assert request.last_user_turn == EASY
    # No temperature: the config's default, which the engine samples at and the cache
    # keys on (there is no second, "as asked" temperature to disagree with it).
    unset = ChatCompletionRequest(model="auto", messages=[ChatMessage("user", EASY)])
    checked = chat_request(unset, runtime.engines, routing=True, limits=config.server)
    assert checked.params.temperature == config.server.default_temperature == 0.0
