"""A config without a router serves the named models and refuses "auto" clearly."""

from __future__ import annotations

import pytest

from gateway.auth import OPEN
from gateway.config import parse_config
from gateway.errors import APIError
from gateway.openai_types import ChatCompletionRequest, ChatMessage
from gateway.pipeline import Dispatch, handle
from gateway.runtime import Runtime

CONFIG = """
engines:
  small:
    backend: llama_cpp
    model: smollm2-135m-instruct
"""


async def test_auto_without_router_is_a_clear_404() -> None:
    config = parse_config(CONFIG)
    runtime = Runtime(config)  # engines are built, not loaded: handle never reaches them
    assert config.router is None and runtime.router is None and runtime.embedder is None
    request = ChatCompletionRequest(model="auto", messages=[ChatMessage("user", "hi")])
    with pytest.raises(APIError) as caught:
        await handle(runtime, config, OPEN, request, {})
    assert caught.value.status == 404
    assert caught.value.body.param == "model"
    assert "routing is turned off" in caught.value.body.message
    named = await handle(
        runtime,
        config,
        OPEN,
        ChatCompletionRequest(model="small", messages=[ChatMessage("user", "hi")]),
        {},
    )
    assert isinstance(named, Dispatch) and named.cache == "off"
    assert named.call.engine is runtime.engines["small"] and named.call.decision is None
    named.finished(None)
