"""A config without a router serves the named models and refuses "auto" clearly."""

from __future__ import annotations

import time

import msgspec
import pytest

from gateway.api.errors import APIError
from gateway.api.validate import chat_request
from gateway.api.wire import ChatCompletionRequest, ChatMessage
from gateway.config import parse_config
from gateway.pipeline.outcome import Finished, Refused, TextDelta
from gateway.pipeline.request_policy import resolve
from gateway.runtime import Runtime
from tests.support import exchange_for

CONFIG = """
engines:
  small:
    backend: llama_cpp
    model: smollm2-135m-instruct
"""


async def test_auto_without_router_is_a_clear_404() -> None:
    config = parse_config(CONFIG)
    runtime = Runtime(config)
    assert config.router is None and runtime.router is None and runtime.embedder is None
    auto = ChatCompletionRequest(model="auto", messages=[ChatMessage("user", "hi")])
    with pytest.raises(APIError) as caught:
        chat_request(auto, runtime.engines, routing=False, limits=config.server)
    assert caught.value.status == 404
    assert caught.value.body.param == "model"
    assert "routing is turned off" in caught.value.body.message
    # The pipeline refuses it too, whoever calls it.
    named = ChatCompletionRequest(model="small", messages=[ChatMessage("user", "hi")])
    request = chat_request(named, runtime.engines, routing=False, limits=config.server)
    policy = resolve(config, "default", arrived=time.monotonic())
    pipeline = runtime.pipeline
    with pytest.raises(Refused) as refused:
        routed = msgspec.structs.replace(request, model="auto")
        await pipeline.run(routed, policy, exchange_for(runtime, routed))
    assert refused.value.kind == "model_not_found"

    await runtime.start()
    try:
        exchange = exchange_for(runtime, request)
        answering = await pipeline.run(request, policy, exchange)
        events = [event async for event in answering.events]
        decision = exchange.decision
    finally:
        await runtime.close()
    assert decision.cache == "off" and decision.route == decision.engine == "small"
    assert decision.difficulty is None
    assert isinstance(events[0], TextDelta) and isinstance(events[-1], Finished)
