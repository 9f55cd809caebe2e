"""POST /v1/responses as clients meet it: the official openai client's
``responses.create`` against a real gateway (answers, streams, refusals), a function
call through the bundled Qwen (slow), and the renderer on scripted answers, each body
and stream event checked against the SDK's own models, strictly."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, Iterator
from typing import Any

import httpx
import msgspec
import openai
import pydantic
import pytest
from openai.types.responses import (
    Response,
    ResponseFunctionToolCall,
    ResponseStreamEvent,
)

from engines.base import EngineError, ToolCallDelta
from gateway.api import render
from gateway.api.responses_render import stream, whole
from gateway.api.responses_wire import ResponsesRequest
from gateway.pipeline.outcome import (
    Answering,
    Decision,
    Event,
    Finished,
    Reasoning,
    TextDelta,
    ToolCallPart,
)
from tests.support import QWEN_TOOLS, start_gateway, stop

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def client(gateway_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0)


def _create(client: openai.OpenAI, **asked: Any) -> Any:
    """The response (or with stream, its events) of a request written as a dict: the
    SDK's overloads type each field more narrowly than these tests need."""
    return client.responses.create(**asked)


# -- answers -------------------------------------------------------------------------


def test_a_string_input_is_answered_as_the_chat_request_it_asks(client: openai.OpenAI) -> None:
    # The large engine's few-shot template answers in a line.
    response = _create(client, model="large", input=QUESTION, max_output_tokens=24, temperature=0)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.model == "large" and response.status == "completed"
    assert response.error is None and response.incomplete_details is None
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.status == "completed"
    assert [part.type for part in message.content] == ["output_text"]
    assert response.output_text == "Paris"
    # Nothing is kept, whatever OpenAI's default.
    assert response.model_extra["store"] is False
    usage = response.usage
    assert usage.input_tokens > 0 and usage.output_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    chat = client.chat.completions.create(
        model="large",
        messages=[{"role": "user", "content": QUESTION}],
        max_completion_tokens=24,
        temperature=0,
    )
    assert response.output_text == chat.choices[0].message.content


def test_instructions_and_items_are_the_chat_messages(client: openai.OpenAI) -> None:
    """Instructions are the first (system) message, parts are joined as a chat
    request's, and an earlier answer sent back (output_text) is the assistant's turn."""
    response = _create(
        client,
        model="small",
        instructions="Answer in one short sentence.",
        input=[
            {"role": "user", "content": "Hello!"},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Hi! How can I help?"}],
            },
            {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
        ],
        max_output_tokens=24,
        temperature=0,
        metadata={"ticket": "42"},
    )
    assert response.instructions == "Answer in one short sentence."
    assert response.metadata == {"ticket": "42"}
    chat = client.chat.completions.create(
        model="small",
        messages=[
            {"role": "system", "content": "Answer in one short sentence."},
            {"role": "user", "content": "Hello!"},
            {"role": "assistant", "content": "Hi! How can I help?"},
            {"role": "user", "content": QUESTION},
        ],
        max_completion_tokens=24,
        temperature=0,
    )
    assert response.output_text == chat.choices[0].message.content


def test_a_stream_says_what_the_plain_answer_says(client: openai.OpenAI) -> None:
    asked = {"model": "small", "input": "Name three colours.", "max_output_tokens": 24}
    plain = _create(client, **asked, temperature=0)
    events = list(_create(client, **asked, temperature=0, stream=True))
    types = [event.type for event in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{plain.status}",  # completed, or incomplete at max_output_tokens
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == plain.output_text
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == deltas
    ended = events[-1].response
    assert ended.status == plain.status and ended.output_text == deltas
    assert ended.id == events[0].response.id and ended.usage == plain.usage


def test_the_sdks_stream_helper_builds_the_same_response(client: openai.OpenAI) -> None:
    """``responses.stream`` puts the response together from the events' items and
    indices, and checks it against response.completed's."""
    with client.responses.stream(
        model="large", input=QUESTION, max_output_tokens=24, temperature=0
    ) as events:
        texts = [event.delta for event in events if event.type == "response.output_text.delta"]
        final = events.get_final_response()
    assert "".join(texts) == final.output_text == "Paris"


def test_a_stream_is_named_server_sent_events(gateway_url: str) -> None:
    """Each event's SSE name is its type, as the SDK's event stream reads them."""
    body = {"model": "small", "input": "Hi", "max_output_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{gateway_url}/v1/responses", json=body, timeout=60) as sent:
        assert sent.headers["content-type"].startswith("text/event-stream")
        assert sent.headers["x-satisfice-engine"] == "small"  # decided before the answer
        text = "".join(sent.iter_text())
    blocks = [block for block in text.split("\n\n") if block]
    for block in blocks:
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data.removeprefix("data: "))["type"] == name.removeprefix("event: ")


def test_max_output_tokens_leaves_the_response_incomplete(client: openai.OpenAI) -> None:
    asked = {"model": "small", "input": "Write a long story about a dragon.", "temperature": 0}
    response = _create(client, **asked, max_output_tokens=3)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[-1].status == "incomplete" and response.usage.output_tokens == 3
    events = list(_create(client, **asked, max_output_tokens=3, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


def test_json_schema_format_answers_json_of_the_schema(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    response = _create(
        client,
        model="small",
        input=f"{QUESTION} Answer as JSON.",
        text={"format": {"type": "json_schema", "name": "place", "schema": schema, "strict": True}},
        max_output_tokens=64,
        temperature=0,
    )
    assert response.status == "completed", response.incomplete_details
    answer = json.loads(response.output_text)
    assert set(answer) == {"city", "country"} and all(isinstance(v, str) for v in answer.values())
    assert response.text.format.type == "json_schema"


def test_decision_headers_come_as_on_chat_completions(client: openai.OpenAI) -> None:
    raw = client.responses.with_raw_response.create(
        model="auto", input="What is 2+2?", max_output_tokens=4, temperature=0
    )
    assert raw.headers["x-satisfice-route"] in ("small", "large")
    assert raw.headers["x-satisfice-engine"] == raw.headers["x-satisfice-route"]
    assert raw.headers["x-satisfice-cache"] in ("miss", "exact", "semantic", "off")
    assert 0.0 <= float(raw.headers["x-satisfice-difficulty"]) <= 1.0
    assert raw.parse().model == "auto"


def test_a_decision_trace_asked_for_is_in_the_body(gateway_url: str) -> None:
    answered = httpx.post(
        f"{gateway_url}/v1/responses",
        json={"model": "small", "input": "Hi", "max_output_tokens": 4},
        headers={"x-satisfice-trace": "true"},
        timeout=60,
    )
    assert answered.status_code == 200, answered.text
    assert answered.json()["satisfice"]["route"] == "small"


# -- refusals ------------------------------------------------------------------------

HI = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"input": [HI, {"type": "item_reference", "id": "msg_1"}]}, "input[1]"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0]",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
            "input[0].content[0].text",
        ),
        ({"input": [{"content": "hi"}]}, "input[0].role"),
        ({"input": [{"type": "function_call_output", "output": "22"}]}, "input[0].call_id"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"tools": [{"type": "function"}]}, "tools[0].name"),
        ({"tool_choice": {"type": "file_search"}, "tools": []}, "tool_choice"),
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"conversation": "conv_123"}, "conversation"),
        ({"background": True}, "background"),
        ({"max_output_tokens": 100_000}, "max_output_tokens"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"model": "gpt-9"}, "model"),
        ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}],
          "tool_choice": "required"}, "tools[0].parameters"),
    ],
    ids=[
        "item-reference", "input-image", "part-without-text", "message-without-role",
        "output-without-call-id", "unknown-role", "empty-list", "empty-string", "web-search",
        "function-without-name", "tool-choice-built-in", "previous-response-id",
        "conversation", "background", "max-output-tokens-over-cap", "unknown-format",
        "unknown-model", "parameters-not-object",
    ],
)  # fmt: skip
def test_what_cannot_be_answered_is_refused_naming_the_field(
    gateway_url: str, extra: dict[str, Any], param: str
) -> None:
    body = {"model": "small", "input": [HI], "max_output_tokens": 4, **extra}
    refused = httpx.post(f"{gateway_url}/v1/responses", json=body, timeout=60)
    assert refused.status_code in (400, 404), refused.text
    error = refused.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"


def test_the_sdk_raises_the_refusal(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        _create(client, model="small", input="hi", previous_response_id="resp_123")
    assert refused.value.code == "unsupported_parameter"
    assert "keeps no responses" in refused.value.message


def test_the_openapi_schema_documents_the_route(gateway_url: str) -> None:
    schema = httpx.get(f"{gateway_url}/openapi/openapi.json").json()
    answers = schema["paths"]["/v1/responses"]["post"]["responses"]
    assert {"200", "400", "401", "415", "429"} <= set(answers)
    for status, spec in answers.items():
        if int(status) >= 400:
            ref = spec["content"]["application/json"]["schema"]
            assert ref == {"$ref": "#/components/schemas/ErrorResponse"}


# -- function calls, through the bundled Qwen ------------------------------------------

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    url, process = start_gateway(QWEN_TOOLS, tmp_path_factory.mktemp("qwen"))
    try:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    finally:
        stop(process)


@pytest.mark.slow
def test_a_function_call_and_its_output_make_a_conversation(qwen: openai.OpenAI) -> None:
    asked: dict[str, Any] = {
        "model": "qwen",
        "tools": [WEATHER],
        "temperature": 0,
        "max_output_tokens": 96,
    }
    question = {"role": "user", "content": "What is the weather in Paris right now?"}
    first = _create(
        qwen, **asked, input=[question], tool_choice={"type": "function", "name": "get_weather"}
    )
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert isinstance(call, ResponseFunctionToolCall)
    assert call.name == "get_weather" and (call.id or "").startswith("fc_") and call.call_id
    assert "paris" in json.loads(call.arguments)["city"].lower()

    events = list(
        _create(
            qwen, **asked, input=[question], stream=True,
            tool_choice={"type": "function", "name": "get_weather"},
        )
    )  # fmt: skip
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert pieces == done.arguments == call.arguments
    assert events[-1].type == "response.completed"

    # The call sent back with its output, as the SDK's users do: the answer reads it.
    # (Free to call again, the 0.5B model calls the same tool over and over.)
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "31 C, sunny"}
    turn = [question, *first.output, output]
    second = _create(qwen, **asked, input=turn, tool_choice="none")
    assert second.status == "completed", second.output
    assert "31" in second.output_text


# -- the renderer, on scripted answers ------------------------------------------------

_EVENTS: pydantic.TypeAdapter[ResponseStreamEvent] = pydantic.TypeAdapter(ResponseStreamEvent)


def _answering(events: list[Event | Exception]) -> Answering:
    async def answer() -> AsyncGenerator[Event]:
        for event in events:
            if isinstance(event, Exception):
                raise event
            yield event

    return Answering(Decision(tenant="t", model="small"), answer())


def _reply(**given: bool) -> render.Reply:
    return render.Reply(
        id="resp_1", created=int(time.time()), model="small", include_usage=False, trace=False,
        **given,
    )  # fmt: skip


def _request(**given: Any) -> ResponsesRequest:
    return msgspec.convert({"model": "small", "input": "hi", **given}, ResponsesRequest)


THOUGHT: list[Event | Exception] = [
    Reasoning("Paris is "),
    Reasoning("the capital."),
    TextDelta(0, ""),
    TextDelta(0, "Paris"),
    ToolCallPart(0, ToolCallDelta(0, "call_a", "get_weather", '{"city":')),
    ToolCallPart(0, ToolCallDelta(0, None, None, ' "Paris"}')),
    ToolCallPart(0, ToolCallDelta(1, "call_b", "get_time", "{}")),
    Finished(("tool_calls",), 10, 12),
]


async def test_a_whole_response_parses_as_the_sdks_and_shows_reasoning_when_asked() -> None:
    plain = Response.model_validate_json(
        await whole(_request(), _answering(THOUGHT), _reply())
    )  # strict: every field the SDK requires, of its type
    assert [item.type for item in plain.output] == ["message", "function_call", "function_call"]
    assert plain.output_text == "Paris"
    calls = [item for item in plain.output if isinstance(item, ResponseFunctionToolCall)]
    assert [(c.call_id, c.name, c.arguments) for c in calls] == [
        ("call_a", "get_weather", '{"city": "Paris"}'),
        ("call_b", "get_time", "{}"),
    ]
    asked = _request(reasoning={"effort": "low", "summary": "auto"})
    shown = Response.model_validate_json(await whole(asked, _answering(THOUGHT), _reply()))
    reasoning = shown.output[0]
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert reasoning.content is not None
    assert [c.text for c in reasoning.content] == ["Paris is the capital."]
    header = await whole(_request(), _answering(THOUGHT), _reply(reasoning=True))
    assert Response.model_validate_json(header).output[0].type == "reasoning"


async def test_stream_events_parse_as_the_sdks_and_end_with_the_whole_response() -> None:
    events = await _streamed(THOUGHT)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types.count("response.reasoning_text.delta") == 2
    assert types.count("response.output_text.delta") == 1  # the empty piece says nothing
    assert types.count("response.function_call_arguments.delta") == 3
    assert types.count("response.output_item.added") == types.count("response.output_item.done")
    assert events[-1].type == "response.completed"
    final = events[-1].response
    assert [item.type for item in final.output] == [
        "reasoning", "message", "function_call", "function_call"
    ]  # fmt: skip
    done = {e.output_index: e.item for e in events if e.type == "response.output_item.done"}
    assert [done[i] for i in range(4)] == final.output


async def test_an_answer_without_text_still_has_its_message() -> None:
    events = await _streamed([Finished(("stop",), 3, 0)])
    (message,) = events[-1].response.output
    assert message.type == "message" and message.content[0].text == ""


async def test_an_error_after_the_stream_began_is_an_error_event() -> None:
    events = await _streamed([TextDelta(0, "Par"), EngineError("small", "it broke")])
    error = events[-1]
    assert error.type == "error" and error.code == "engine_error"
    assert "it broke" in error.message
    assert [e.sequence_number for e in events] == list(range(len(events)))
    before = await _streamed([EngineError("small", "it broke")])  # the stream still opens
    assert [e.type for e in before] == ["response.created", "response.in_progress", "error"]


async def _streamed(answer: list[Event | Exception]) -> list[Any]:
    sent = b"".join([part async for part in stream(_request(), _answering(answer), _reply(), None)])
    events = []
    for block in sent.decode().split("\n\n"):
        if block:
            name, data = block.split("\n")
            event = _EVENTS.validate_json(data.removeprefix("data: "))
            assert name == f"event: {event.type}"
            events.append(event)
    return events
