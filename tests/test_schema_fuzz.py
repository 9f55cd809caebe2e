"""Schemathesis against the gateway's own OpenAPI schema: whatever input the schema
allows (and much that it does not), no 5xx, and every response is what the schema says.

A real `satisfice serve` process answers, with limits that keep generation cheap:
at most 16 tokens and 2 samples, a one-round loop. Both bundled engines, the router
(so "auto" exists), the reasoning loop and the cache (so the admin endpoints have
something to answer) are on.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode, checks
from schemathesis.core.result import Ok
from schemathesis.schemas import APIOperation, BaseSchema

from gateway.api.anthropic_wire import Event as AnthropicEvent
from gateway.api.anthropic_wire import MessageStop
from gateway.api.errors import AnthropicError
from gateway.api.wire import ChatCompletionChunk, ErrorResponse
from tests.support import BUNDLED_ENGINES, start_gateway, stop

# Slow: a gateway of its own and hundreds of requests; the default run keeps the
# schema (test_api_schema) and the error shapes (test_api_errors).
pytestmark = pytest.mark.slow

ADMIN_KEY = "fuzz-admin-key"

FUZZ_CONFIG = f"""
server:
  max_tokens_cap: 16
  default_max_tokens: 8
  max_n: 2
  admin_key: {ADMIN_KEY}
router: {{}}
cache: {{}}
loop:
  branches: 2
  max_rounds: 1
  round_tokens: 8
  token_budget: 16
{BUNDLED_ENGINES}"""

# Every operation of the API: a test below fails when the schema lists one more.
# /metrics is fuzzed once the gateway serves it.
OPERATIONS = [
    pytest.param("POST", "/v1/chat/completions", id="POST /v1/chat/completions"),
    pytest.param("POST", "/v1/messages", id="POST /v1/messages"),
    pytest.param("POST", "/v1/route", id="POST /v1/route"),
    pytest.param("GET", "/v1/models", id="GET /v1/models"),
    pytest.param("GET", "/healthz", id="GET /healthz"),
    pytest.param("GET", "/readyz", id="GET /readyz"),
    pytest.param("GET", "/metrics", id="GET /metrics"),
    pytest.param("GET", "/admin/cache/stats", id="GET /admin/cache/stats"),
    pytest.param("POST", "/admin/cache/invalidate", id="POST /admin/cache/invalidate"),
    pytest.param("POST", "/admin/cache/warmup", id="POST /admin/cache/warmup"),
    pytest.param("POST", "/v1/feedback", id="POST /v1/feedback"),
]
CHECKS = [
    checks.not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_schema_conformance,
]
# A streamed completion (`stream: true`) is text/event-stream, which the schema has no
# way to describe chunk by chunk: its status is checked here, its chunks by `_events`.
STREAM_CHECKS = [checks.not_a_server_error, checks.status_code_conformance]
# Examples per operation: chat completions has by far the most input to explore.
EXAMPLES = {"/v1/chat/completions": 150}
DEFAULT_EXAMPLES = 40
MODELS = ["small", "large", "auto"]
# Schemathesis leaves an operation's parameter, response and schema types open.
Operation = APIOperation[Any, Any, Any, Any]


@pytest.fixture(scope="module")
def fuzz_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    url, process = start_gateway(FUZZ_CONFIG, Path(tmp_path_factory.mktemp("fuzz")))
    try:
        yield url
    finally:
        stop(process)


@pytest.fixture(scope="module")
def api_schema(fuzz_gateway: str) -> BaseSchema:
    # Schemathesis stops reading an event stream after 20 events by default; a whole
    # stream is needed to check how it ends.
    config = schemathesis.Config.from_dict({"max-stream-events": 1000})
    return schemathesis.openapi.from_url(f"{fuzz_gateway}/openapi/openapi.json", config=config)


def _listed(schema: BaseSchema) -> set[tuple[str, str]]:
    listed = set()
    for result in schema.get_all_operations():
        assert isinstance(result, Ok), result  # the gateway's schema describes every operation
        listed.add((result.ok().method.upper(), result.ok().path))
    return listed


def test_every_operation_is_fuzzed(api_schema: BaseSchema) -> None:
    assert _listed(api_schema) <= {tuple(param.values) for param in OPERATIONS}


def _events(body: str) -> list[ChatCompletionChunk | ErrorResponse]:
    """Every event of an SSE body, decoded strictly; the stream must end with [DONE]
    unless an error event ended it."""
    events: list[ChatCompletionChunk | ErrorResponse] = []
    payloads = [block.removeprefix("data: ") for block in body.split("\n\n") if block]
    assert all(not p.startswith("data:") for p in payloads), body
    for payload in payloads[:-1]:
        raw = msgspec.json.decode(payload)
        if "error" in raw:
            events.append(msgspec.convert(raw, ErrorResponse))
        else:
            events.append(msgspec.convert(raw, ChatCompletionChunk))
    last = payloads[-1]
    if last != "[DONE]":
        events.append(msgspec.convert(msgspec.json.decode(last), ErrorResponse))
    return events


def _anthropic_events(body: str) -> list[AnthropicEvent | MessageStop | AnthropicError]:
    """Every event of an Anthropic stream (/v1/messages), decoded strictly: each named
    by its type, and the stream ended by message_stop unless an error event ended it."""
    events = []
    for block in body.strip().split("\n\n"):
        name, data = block.split("\n")
        event = msgspec.json.decode(
            data.removeprefix("data: "), type=AnthropicEvent | MessageStop | AnthropicError
        )
        assert name == "event: " + str(type(event).__struct_config__.tag), block
        events.append(event)
    assert isinstance(events[-1], (MessageStop, AnthropicError)), body
    return events


@pytest.mark.parametrize(("method", "path"), OPERATIONS)
def test_generated_input(api_schema: BaseSchema, fuzz_gateway: str, method: str, path: str) -> None:
    if (method, path) not in _listed(api_schema):
        pytest.skip(f"{method} {path} is not in this gateway's schema")
    operation = api_schema[path][method]
    cases = st.one_of(
        operation.as_strategy(GenerationMode.POSITIVE),
        operation.as_strategy(GenerationMode.NEGATIVE),
    )
    # The schema cannot say which model names exist: left to chance, nearly every
    # request would stop at 404 before reaching an engine. Streaming, too, is made
    # common enough to be seen.
    models = st.sampled_from([*MODELS, None])
    streams = st.sampled_from([True, None])
    statuses: Counter[tuple[int, str]] = Counter()

    @settings(
        max_examples=EXAMPLES.get(path, DEFAULT_EXAMPLES),
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=cases, model=models, stream=streams)
    def run(case: schemathesis.Case[Operation], model: str | None, stream: bool | None) -> None:
        if isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = model or case.body["model"]
            if stream:
                case.body["stream"] = True
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        response = case.call(base_url=fuzz_gateway, headers=headers, timeout=60)
        media_type = response.headers.get("content-type", [""])[0].split(";")[0]
        streamed = media_type == "text/event-stream"
        case.validate_response(response, checks=STREAM_CHECKS if streamed else CHECKS)
        if streamed:
            assert response.status_code == 200
            (_anthropic_events if path == "/v1/messages" else _events)(response.text)
        statuses[response.status_code, media_type] += 1

    run()
    if path == "/v1/chat/completions":
        # The fuzzing reached the engines, in both response forms.
        assert statuses[200, "application/json"] > 0, statuses
        assert statuses[200, "text/event-stream"] > 0, statuses
