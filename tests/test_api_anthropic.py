"""Anthropic's Messages API (POST /v1/messages) as its clients meet it: the official
anthropic SDK against a real gateway process with keys, sent as x-api-key; and the
renderers alone, on scripted answers, for what the bundled models cannot be made to
say on cue (tool calls, an error mid-stream)."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncGenerator, Iterator
from typing import Any

import anthropic
import httpx
import msgspec
import pytest

from engines.base import ToolCallDelta
from gateway.api import anthropic as messages_api
from gateway.api.render import Reply
from gateway.ops.keys import hash_key
from gateway.pipeline.outcome import (
    Answering,
    Decision,
    Event,
    Finished,
    Reasoning,
    Refused,
    TextDelta,
    ToolCallPart,
)
from tests.support import BUNDLED_ENGINES, QWEN_TOOLS, start_gateway, stop

KEY, THINKER = (f"sk-{name}-{uuid.uuid4().hex}" for name in ("anthropic", "thinker"))

# Both bundled models and the router; the "thinker" tenant's every routed question is
# hard, and the loop gives it one short round.
CONFIG = f"""
router: {{}}
server:
  max_tokens_cap: 512
loop:
  branches: 2
  max_rounds: 1
  round_tokens: 16
tenants:
  thinker: {{router_threshold: 0.0}}
auth:
  keys:
    anthropic: {{sha256: {hash_key(KEY)}, tenant: anthropic}}
    thinker: {{sha256: {hash_key(THINKER)}, tenant: thinker}}
{BUNDLED_ENGINES}
"""

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Write a long story about a dragon and a knight."}]
# The SDK no longer sends sampling parameters of its own; the API still takes them.
GREEDY: dict[str, Any] = {"extra_body": {"temperature": 0}}


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    started, process = start_gateway(CONFIG, tmp_path_factory.mktemp("anthropic"))
    yield started
    stop(process)


@pytest.fixture(scope="module")
def client(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=120)


def create(client: anthropic.Anthropic, **asked: Any) -> anthropic.types.Message:
    """A message for a request written as a dict (the SDK's overloads type each field
    more narrowly than these tests need)."""
    message: anthropic.types.Message = client.messages.create(**asked)
    return message


def post(url: str, body: dict[str, Any] | bytes, key: str = KEY, **headers: str) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    sent = {"x-api-key": key, "content-type": "application/json", **headers}
    return httpx.post(f"{url}/v1/messages", content=content, headers=sent, timeout=120)


def chat(url: str, body: dict[str, Any]) -> httpx.Response:
    """The same request as a chat completion, to compare with."""
    headers = {"authorization": f"Bearer {KEY}"}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120)


def anthropic_error(response: httpx.Response, status: int) -> dict[str, str]:
    """The error of a refused request, in Anthropic's shape and nothing else."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"}, body
    error: dict[str, str] = body["error"]
    return error


def text_of(message: anthropic.types.Message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


# -- answers --------------------------------------------------------------------------


def test_a_message_answers_as_a_chat_completion_does(url: str, client: anthropic.Anthropic) -> None:
    message = create(client, model="small", max_tokens=24, messages=FRANCE, **GREEDY)
    assert message.id.startswith("msg_") and len(message.id) > 20
    assert (message.type, message.role, message.model) == ("message", "assistant", "small")
    assert [block.type for block in message.content] == ["text"]
    assert message.stop_reason in ("end_turn", "max_tokens") and message.stop_sequence is None
    assert message.usage.input_tokens > 0 and 0 < message.usage.output_tokens <= 24
    same = {"model": "small", "max_tokens": 24, "messages": FRANCE, "temperature": 0}
    completion = chat(url, same).json()
    assert completion["choices"][0]["message"]["content"] == text_of(message) != ""
    assert completion["usage"]["prompt_tokens"] == message.usage.input_tokens

    cut = create(client, model="small", max_tokens=3, messages=STORY, **GREEDY)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3


def test_a_stream_says_what_the_plain_answer_says(client: anthropic.Anthropic) -> None:
    asked: dict[str, Any] = {"model": "small", "max_tokens": 32, "messages": STORY, **GREEDY}
    plain = create(client, **asked)
    with client.messages.stream(**asked) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text_of(plain) != ""
    assert [block.type for block in final.content] == ["text"]
    assert (final.stop_reason, final.usage) == (plain.stop_reason, plain.usage)


def test_a_stream_is_anthropics_sequence_of_events(url: str) -> None:
    body = {"model": "small", "max_tokens": 8, "messages": FRANCE, "stream": True}
    response = post(url, body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    names = []
    for event in response.text.strip().split("\n\n"):
        name_line, data_line = event.split("\n")
        name = name_line.removeprefix("event: ")
        assert json.loads(data_line.removeprefix("data: "))["type"] == name
        names.append(name)
    deltas = len(names) - 5
    assert deltas > 0
    assert names == [
        "message_start", "content_block_start", *["content_block_delta"] * deltas,
        "content_block_stop", "message_delta", "message_stop",
    ]  # fmt: skip


def test_the_system_prompt_is_a_system_message_as_a_string_or_blocks(
    url: str, client: anthropic.Anthropic
) -> None:
    rule = "You answer every question in one word."
    asked: dict[str, Any] = {"model": "small", "max_tokens": 8, "messages": FRANCE, **GREEDY}
    bare = create(client, **asked)
    said = create(client, system=rule, **asked)
    in_blocks = create(client, system=[{"type": "text", "text": rule}], **asked)
    assert said.usage.input_tokens != bare.usage.input_tokens
    assert in_blocks.usage == said.usage and in_blocks.content == said.content
    system = [{"role": "system", "content": rule}, *FRANCE]
    completion = chat(
        url, {"model": "small", "max_tokens": 8, "temperature": 0, "messages": system}
    )
    assert completion.json()["choices"][0]["message"]["content"] == text_of(said)
    assert completion.json()["usage"]["prompt_tokens"] == said.usage.input_tokens


def test_a_stop_sequence_ends_the_answer_before_it(client: anthropic.Anthropic) -> None:
    asked: dict[str, Any] = {"model": "small", "max_tokens": 24, "messages": STORY, **GREEDY}
    whole = text_of(create(client, **asked))
    words = whole.split()
    assert len(words) > 4, whole
    stop_at = " " + words[3]
    stopped = create(client, stop_sequences=[stop_at], **asked)
    assert text_of(stopped) == whole[: whole.index(stop_at)]
    # No engine says which stop ended an answer (see gateway.api.anthropic).
    assert stopped.stop_reason == "end_turn" and stopped.stop_sequence is None


def test_the_decision_is_in_the_same_headers_as_a_chat_completions(url: str) -> None:
    question = f"What is the capital of Spain? ({uuid.uuid4().hex[:6]})"
    messages = [{"role": "user", "content": question}]
    body = {"model": "auto", "max_tokens": 8, "messages": messages, "temperature": 0}
    answered = post(url, body)
    assert answered.status_code == 200, answered.text
    completion = chat(url, body)

    def decision(response: httpx.Response) -> set[str]:
        return {name for name in response.headers if name.startswith("x-satisfice-")}

    assert "x-satisfice-route" in decision(answered) and "x-request-id" in answered.headers
    assert decision(answered) == decision(completion)
    assert answered.headers["x-satisfice-route"] == completion.headers["x-satisfice-route"]
    # Asked for, the decision is in the body too, as on a chat completion (whose loop
    # answers carry the loop's trace in its place).
    traced = post(url, {**body, "model": "small"}, **{"x-satisfice-trace": "1"})
    assert traced.json()["satisfice"]["route"] == "small"


# -- keys -------------------------------------------------------------------------------


def test_the_key_goes_in_x_api_key_or_as_a_bearer_token(url: str) -> None:
    body = {"model": "small", "max_tokens": 2, "messages": FRANCE}
    for key in ("", "sk-unknown"):
        error = anthropic_error(post(url, body, key=key), 401)
        assert error["type"] == "authentication_error"
    assert "x-api-key" in anthropic_error(post(url, body, key=""), 401)["message"]
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url, api_key="sk-wrong", max_retries=0).messages.create(
            model="small", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
    assert post(url, body, key="", authorization=f"Bearer {KEY}").status_code == 200
    # x-api-key is a key anywhere a key is asked for, chat completions included.
    plain = {"model": "small", "max_tokens": 2, "messages": FRANCE}
    assert httpx.post(f"{url}/v1/chat/completions", json=plain, headers={"x-api-key": KEY},
                      timeout=120).status_code == 200  # fmt: skip


# -- refusals, in Anthropic's shape, naming the field -----------------------------------

USER = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(
    ("body", "status", "named"),
    [
        ({"model": "small", "messages": [USER]}, 400, "max_tokens"),
        ({"model": "small", "max_tokens": 0, "messages": [USER]}, 400, "max_tokens"),
        ({"model": "small", "max_tokens": 8, "messages": [{"role": "system", "content": "x"}]},
         400, "messages[0].role"),
        ({"model": "small", "max_tokens": 8, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}},
        ]}]}, 400, "messages[0].content[1]"),
        ({"model": "small", "max_tokens": 8, "messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "document"}]},
        ]}]}, 400, "messages[0].content[0].content[0]"),
        ({"model": "small", "max_tokens": 8, "messages": [{"role": "user", "content": [
            {"type": "tool_use", "id": "t1", "name": "f", "input": {}},
        ]}]}, 400, "messages[0].content[0]"),
        ({"model": "small", "max_tokens": 8, "top_k": 5, "messages": [USER]}, 400, "top_k"),
        ({"model": "small", "max_tokens": 8, "temperature": 1.5, "messages": [USER]}, 400,
         "temperature"),
        ({"model": "small", "max_tokens": 8, "stop_sequences": ["a", "b", "c", "d", "e"],
          "messages": [USER]}, 400, "stop_sequences"),
        ({"model": "small", "max_tokens": 9999, "messages": [USER]}, 400, "max_tokens"),
        ({"model": "small", "max_tokens": 8,
          "messages": [USER, {"role": "assistant", "content": "The answer is"}]}, 400,
         "messages[1].role"),
        ({"model": "small", "max_tokens": 8, "tool_choice": {"type": "tool", "name": "f"},
          "tools": [{"name": "g", "input_schema": {"type": "object"}}], "messages": [USER]},
         400, "tool_choice"),
        ({"model": "claude-opus-4", "max_tokens": 8, "messages": [USER]}, 404, "model"),
        ({"model": "small", "max_tokens": 8, "tools": [{"name": "g", "input_schema":
          {"type": "array"}}], "messages": [USER]}, 400, "tools[0].input_schema"),
    ],
    ids=[
        "no-max-tokens", "max-tokens-0", "system-role", "image", "document-in-result",
        "tool-use-from-user", "top-k", "temperature-1.5", "five-stops", "max-tokens-cap",
        "prefill", "unknown-tool-choice", "unknown-model", "input-schema-not-object",
    ],
)  # fmt: skip
def test_bad_input_is_refused_in_anthropics_shape_naming_the_field(
    url: str, body: dict[str, Any], status: int, named: str
) -> None:
    error = anthropic_error(post(url, body), status)
    assert named in error["message"], error
    expected = "not_found_error" if status == 404 else "invalid_request_error"
    assert error["type"] == expected


def test_the_sdk_hears_a_refusal_as_its_own_error(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as refused:
        create(client, model="small", max_tokens=8, messages=[USER], extra_body={"top_k": 3})
    assert refused.value.body == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "top_k is not supported: no engine of this gateway is handed it; "
            "leave it out",
        },
    }


def test_tools_for_an_engine_without_them_are_refused_naming_it(url: str) -> None:
    tools = [{"name": "get_weather", "input_schema": {"type": "object"}}]
    body = {"model": "small", "max_tokens": 8, "messages": FRANCE, "tools": tools}
    error = anthropic_error(post(url, body), 400)
    assert "engine 'small'" in error["message"] and "tool" in error["message"]


# -- thinking ---------------------------------------------------------------------------


def test_the_loops_reasoning_is_thinking_when_asked_for_or_streamed(url: str) -> None:
    client = anthropic.Anthropic(base_url=url, api_key=THINKER, max_retries=0, timeout=120)
    asked: dict[str, Any] = {"model": "auto", "max_tokens": 16, **GREEDY}

    def kinds(message: anthropic.types.Message) -> list[str]:
        return [block.type for block in message.content]

    def question() -> list[Any]:  # a new one each time: nothing cached
        return [{"role": "user", "content": f"Is ice cold? ({uuid.uuid4().hex[:6]})"}]

    assert kinds(create(client, messages=question(), **asked)) == ["text"]
    thought = create(
        client, messages=question(), thinking={"type": "enabled", "budget_tokens": 1024},
        **asked,
    )  # fmt: skip
    assert kinds(thought) == ["thinking", "text"]
    assert thought.content[0].type == "thinking" and thought.content[0].thinking
    hidden = create(client, messages=question(), thinking={"type": "disabled"}, **asked)
    assert kinds(hidden) == ["text"]
    with client.messages.stream(messages=question(), **asked) as stream:
        streamed = stream.get_final_message()
    assert kinds(streamed) == ["thinking", "text"]
    # The turn sent back as the SDK gives it, thinking and all, goes on.
    follow = [*question(), {"role": "assistant", "content": thought.content}, *question()]
    assert create(client, messages=follow, **asked).stop_reason is not None


# -- the renderers alone, on scripted answers ---------------------------------------------

REPLY = Reply(id="msg_test", created=0, model="m", include_usage=False, trace=False)


def scripted(*events: Event | Exception) -> Answering:
    async def run() -> AsyncGenerator[Event]:
        for event in events:
            if isinstance(event, Exception):
                raise event
            yield event

    return Answering(Decision(tenant="t", model="m"), run())


CALL = (
    ToolCallPart(0, ToolCallDelta(0, "toolu_1", "get_weather", '{"city": ')),
    ToolCallPart(0, ToolCallDelta(0, arguments='"Paris"}')),
    Finished(("tool_calls",), prompt_tokens=7, completion_tokens=5),
)


def streamed(answering: Answering) -> list[tuple[str, dict[str, Any]]]:
    async def read() -> bytes:
        parts = messages_api.stream(answering, REPLY, None, None)
        return b"".join([part async for part in parts])

    events = []
    for event in asyncio.run(read()).decode().strip().split("\n\n"):
        name, data = event.split("\n")
        events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


def test_a_tool_call_is_a_tool_use_block_with_its_input_parsed() -> None:
    answering = scripted(TextDelta(0, "Let me look."), *CALL)
    message = msgspec.json.decode(asyncio.run(messages_api.whole(answering, REPLY, None)))
    assert message["content"] == [
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
    ]
    assert message["stop_reason"] == "tool_use"
    assert message["usage"] == {"input_tokens": 7, "output_tokens": 5}


def test_a_streamed_tool_call_is_a_block_of_input_json_deltas() -> None:
    events = streamed(scripted(*CALL))
    assert [name for name, _ in events] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop",
    ]  # fmt: skip
    start, first, second = (data for _, data in events[1:4])
    assert start["content_block"] == {
        "type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {},
    }  # fmt: skip
    pieces = [d["delta"]["partial_json"] for d in (first, second)]
    assert json.loads("".join(pieces)) == {"city": "Paris"}
    assert events[5][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}


def test_blocks_follow_one_another_by_index() -> None:
    answering = scripted(
        Reasoning("hmm"), Reasoning(" yes"), TextDelta(0, "Yes."), *CALL[:2],
        Finished(("tool_calls",), prompt_tokens=1, completion_tokens=1),
    )  # fmt: skip
    starts = [(d["index"], d["content_block"]["type"]) for n, d in streamed(answering)
              if n == "content_block_start"]  # fmt: skip
    assert starts == [(0, "thinking"), (1, "text"), (2, "tool_use")]


def test_an_error_mid_stream_is_an_error_event_in_anthropics_shape() -> None:
    late = Refused("deadline_exceeded", "the deadline passed")
    events = streamed(scripted(TextDelta(0, "Par"), late))
    assert events[-1] == (
        "error",
        {"type": "error", "error": {"type": "api_error", "message": "the deadline passed"}},
    )


def test_an_answer_cut_at_its_deadline_says_it_is_unfinished() -> None:
    cut = scripted(TextDelta(0, "Par"), Finished(("deadline",), 1, 1))
    message = msgspec.json.decode(asyncio.run(messages_api.whole(cut, REPLY, None)))
    assert message["stop_reason"] == "max_tokens"


# -- tools, end to end, on the one bundled model whose template has them -----------------
# Slow: Qwen 0.5B writes a call in 20-80 s on two busy cores.

WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
ASK_WEATHER = {"role": "user", "content": "What is the weather in Paris right now?"}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    started, process = start_gateway(QWEN_TOOLS, tmp_path_factory.mktemp("anthropic-tools"))
    yield started
    stop(process)


@pytest.mark.slow
def test_a_tool_use_streams_and_its_result_is_answered(qwen: str) -> None:
    client = anthropic.Anthropic(base_url=qwen, api_key="unused", max_retries=0, timeout=300)
    asked: dict[str, Any] = {
        "model": "qwen", "max_tokens": 48, "messages": [ASK_WEATHER], "tools": [WEATHER],
        "tool_choice": {"type": "tool", "name": "get_weather"}, **GREEDY,
    }  # fmt: skip
    called = create(client, **asked)
    assert called.stop_reason == "tool_use"
    (use,) = [block for block in called.content if block.type == "tool_use"]
    assert use.name == "get_weather" and isinstance(use.input.get("city"), str)
    with client.messages.stream(**asked) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use"
    (again,) = [block for block in streamed.content if block.type == "tool_use"]
    assert (again.name, again.input) == (use.name, use.input)

    # The turn sent back as the SDK gave it, and the tool's result: the prompt and the
    # answer are those of the same conversation in chat completions' terms.
    weather = '{"temperature_c": 21}'
    result = {"type": "tool_result", "tool_use_id": use.id, "content": weather}
    turns = [ASK_WEATHER, {"role": "assistant", "content": called.content},
             {"role": "user", "content": [result]}]  # fmt: skip
    answered = create(client, **{**asked, "messages": turns, "tool_choice": {"type": "auto"}})
    arguments = json.dumps(use.input)
    same = httpx.post(f"{qwen}/v1/chat/completions", timeout=300, json={
        "model": "qwen", "max_tokens": 48, "temperature": 0, "tool_choice": "auto",
        "tools": [{"type": "function", "function": {
            "name": WEATHER["name"], "description": WEATHER["description"],
            "parameters": WEATHER["input_schema"]}}],
        "messages": [ASK_WEATHER, {"role": "assistant", "content": None, "tool_calls": [
            {"id": use.id, "type": "function",
             "function": {"name": use.name, "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": use.id, "content": weather}],
    }).json()  # fmt: skip
    assert same["usage"]["prompt_tokens"] == answered.usage.input_tokens
    assert (same["choices"][0]["message"]["content"] or "") == text_of(answered)
    assert "21" in text_of(answered)


@pytest.mark.slow
def test_an_output_format_is_json_of_its_schema(qwen: str) -> None:
    client = anthropic.Anthropic(base_url=qwen, api_key="unused", max_retries=0, timeout=300)
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"],
    }
    output = {"format": {"type": "json_schema", "schema": schema}}
    message = create(
        client, model="qwen", max_tokens=48,
        messages=[{"role": "user", "content": "Name a city and its country as JSON."}],
        extra_body={"temperature": 0, "output_config": output},  # older SDKs lack the field
    )  # fmt: skip
    assert set(json.loads(text_of(message))) >= {"city", "country"}
