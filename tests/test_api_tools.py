"""Tool calls and structured output end to end: the official openai client against a
real gateway whose large engine is the bundled Qwen 0.5B (its chat template renders
tools) and whose small engine, SmolLM2, has no tools. How each meets the router (routed
like any request), the loop (one pass, said in the decision) and the cache (a tool turn
is never cached; a structured answer only under its own format)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletionMessageFunctionToolCall
from prometheus_client.parser import text_string_to_metric_families

from tests.support import start_gateway, stop

# Every routed question is hard (threshold 0): it goes to the large engine, where the
# loop would think if the request let it.
CONFIG = """
router: {threshold: 0.0}
loop: {calibrator: bundled}
cache: {store: {kind: memory}}
engines:
  small: {backend: llama_cpp, model: smollm2-135m-instruct, template: chat}
  large:
    backend: llama_cpp
    model: qwen2.5-coder-0.5b-instruct
    template: chat
    context_tokens: 4096
"""

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
ASK_WEATHER = "What is the weather in Paris right now?"
FORCED = {"type": "function", "function": {"name": "get_weather"}}


def _create(client: openai.OpenAI, **asked: Any) -> Any:
    """The completion (or with stream, the chunks) of a request written as a dict: the
    SDK's overloads type each field more narrowly than these tests need."""
    return client.chat.completions.create(**asked)


def _raw(client: openai.OpenAI, **asked: Any) -> Any:
    """The raw response of such a request: its headers, and ``parse()`` for its body."""
    return client.chat.completions.with_raw_response.create(**asked)


def _only_call(message: Any) -> ChatCompletionMessageFunctionToolCall:
    (call,) = message.tool_calls or []
    assert isinstance(call, ChatCompletionMessageFunctionToolCall)
    return call


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "languages": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    url, process = start_gateway(CONFIG, tmp_path_factory.mktemp("tools"))
    try:
        yield url
    finally:
        stop(process)


@pytest.fixture(scope="module")
def client(gateway: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0)


def _ask(question: str) -> list[Any]:
    return [{"role": "user", "content": question}]


def test_a_forced_tool_call_is_answered_in_openai_shape(client: openai.OpenAI) -> None:
    raw = _raw(
        client,
        model="auto",
        messages=_ask(ASK_WEATHER),
        tools=[WEATHER],
        tool_choice=FORCED,
        temperature=0,
        max_tokens=64,
    )
    completion = raw.parse()
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = _only_call(choice.message)
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    # Routed hard, answered in one pass: the loop votes on text, not on calls.
    assert raw.headers["x-satisfice-route"] == "large"
    assert raw.headers["x-satisfice-single-pass"] == "tools"
    assert raw.headers["x-satisfice-cache"] == "bypass"  # never cached


def test_streamed_tool_calls_join_into_the_whole_answer(client: openai.OpenAI) -> None:
    asked: dict[str, Any] = {
        "model": "large", "messages": _ask(ASK_WEATHER), "tools": [WEATHER],
        "tool_choice": "required", "temperature": 0, "max_tokens": 64,
    }  # fmt: skip
    whole = _create(client, **asked)
    names: list[str] = []
    arguments: list[str] = []
    ids: list[str] = []
    finish = None
    pieces = 0
    for chunk in _create(client, **asked, stream=True):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for part in choice.delta.tool_calls or ():
                assert part.index == 0
                pieces += 1
                if part.id:
                    ids.append(part.id)
                if part.function and part.function.name:
                    names.append(part.function.name)
                if part.function and part.function.arguments:
                    arguments.append(part.function.arguments)
    call = _only_call(whole.choices[0].message)
    assert finish == "tool_calls" and names == [call.function.name] and len(ids) == 1
    assert "".join(arguments) == call.function.arguments
    assert pieces > 1, "the arguments come as they are generated, not in one piece"


def test_a_tool_result_turn_is_answered(client: openai.OpenAI) -> None:
    messages: list[Any] = [
        *_ask(ASK_WEATHER),
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 21}'},
    ]
    # Offered the tool again, the 0.5B calls it again (it does through chat completions
    # and the Responses API alike): "none" asks for the answer in words.
    completion = _create(
        client, model="large", messages=messages, tools=[WEATHER], tool_choice="none",
        temperature=0, max_tokens=48,
    )  # fmt: skip
    choice = completion.choices[0]
    assert choice.finish_reason in ("stop", "length") and not choice.message.tool_calls
    assert "21" in (choice.message.content or "")


def test_tool_turns_are_never_cached(client: openai.OpenAI) -> None:
    question = f"{ASK_WEATHER} ({uuid.uuid4().hex[:6]})"
    for _ in range(2):
        raw = _raw(
            client,
            model="large", messages=_ask(question), tools=[WEATHER],
            tool_choice="required", temperature=0, max_tokens=48,
        )  # fmt: skip
        assert raw.headers["x-satisfice-cache"] == "bypass"


def test_a_json_schema_answer_validates_and_is_cached_under_its_schema_only(
    client: openai.OpenAI, gateway: str
) -> None:
    question = f"Describe a made-up programmer as JSON. ({uuid.uuid4().hex[:6]})"

    def ask(schema: dict[str, Any]) -> tuple[str, str]:
        raw = _raw(
            client,
            model="large",
            messages=_ask(question),
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": schema, "strict": True},
            },
            temperature=0,
            max_tokens=96,
        )
        content = raw.parse().choices[0].message.content or ""
        jsonschema.validate(json.loads(content), schema)
        return content, raw.headers["x-satisfice-cache"]

    writes = _writes(gateway)
    first, served = ask(PERSON)
    assert served == "miss"
    _until(lambda: _writes(gateway) > writes, "the answer's write-back")
    again, served = ask(PERSON)
    assert (again, served) == (first, "exact")
    # Another schema for the same question is another request: never the first answer.
    other = {**PERSON, "required": ["name"], "properties": {"name": {"type": "string"}}}
    _, served = ask(other)
    assert served == "miss"
    # Nor does a plain request get the JSON answer.
    plain = _raw(client, model="large", messages=_ask(question), temperature=0, max_tokens=96)
    assert plain.headers["x-satisfice-cache"] == "miss"


def _writes(gateway: str) -> float:
    text = httpx.get(f"{gateway}/metrics").text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "satisfice_cache_writes_total"
    )


def _until(condition: Callable[[], bool], what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.05)


def test_an_engine_without_tools_is_refused_by_name(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        _create(client, model="small", messages=_ask(ASK_WEATHER), tools=[WEATHER], max_tokens=8)
    error = refused.value.body
    assert isinstance(error, dict)
    assert error["param"] == "tools" and error["code"] == "unsupported"
    assert "'small'" in error["message"] and "tool calls" in error["message"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tool_choice": "auto"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [WEATHER], "functions": [WEATHER["function"]]}, "functions"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": {"type": "mystery"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "has space"}}]},
            "tools[0].function.name",
        ),
        ({"logit_bias": {"1": 5}}, "logit_bias"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "string"}},
                    }
                ],
                "tool_choice": "required",
            },
            "tools[0].function.parameters",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "n",
                        "schema": {
                            "$ref": "#/$defs/n",
                            "$defs": {
                                "n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}}
                            },
                        },
                    },
                }
            },
            "response_format",
        ),  # a recursive schema: no grammar can hold it
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": {"type": "string", "maxLength": 10**9}},
                }
            },
            "response_format",
        ),  # written out, its grammar took 19 GB before it was stopped
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {
                                    "a": {"type": "string", "pattern": "^((a{10}){10}){20}$"}
                                },
                            },
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
        ),  # nested quantifiers multiply
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "n",
                        "schema": {"type": "integer", "minimum": 5, "maximum": 3},
                    },
                }
            },
            "response_format",
        ),  # the engine finds that no answer can follow it
    ],
    ids=[
        "choice-without-tools",
        "unknown-tool",
        "twice",
        "both",
        "format-type",
        "schema-type",
        "bad-name",
        "logit-bias",
        "parameters-not-object",
        "recursive-schema",
        "huge-repetition",
        "nested-quantifiers",
        "empty-range",
    ],
)
def test_bad_tool_and_format_requests_name_the_field(
    gateway: str, extra: dict[str, Any], param: str
) -> None:
    body = {"model": "large", "messages": _ask("hi"), "max_tokens": 4, **extra}
    response = httpx.post(f"{gateway}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_legacy_functions_are_answered_as_tools(client: openai.OpenAI) -> None:
    completion = _create(
        client,
        model="large",
        messages=_ask(ASK_WEATHER),
        functions=[WEATHER["function"]],
        function_call={"name": "get_weather"},
        temperature=0,
        max_tokens=64,
    )
    call = _only_call(completion.choices[0].message)
    assert call.function.name == "get_weather"
