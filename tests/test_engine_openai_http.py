"""The OpenAI-compatible HTTP engine against a real server: llama.cpp's own, on 127.0.0.1.

Tool calls run against it too, where llama-cpp-python can make them (a call that the tool
choice forces); the shapes it never sends (vLLM's and OpenAI's streamed calls, a whole
answer to a streamed request, the legacy function call) are answered by a small HTTP
server below, which also records the bodies the engine sends.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from engines.base import (
    Delta,
    EngineUnavailable,
    Generation,
    Message,
    SamplingParams,
    ToolCall,
    ToolCallDelta,
    asked_features,
)
from engines.openai_http import OpenAIHTTPEngine
from engines.settings import OpenAIHTTPSettings
from gateway.config import ConfigError, parse_config
from tests.support import free_port, llama_server, stop

QUESTION = (Message("user", "What is 2+2?"),)
STORY = (Message("user", "Write a long story about a dragon and a knight."),)


def start_llama_server(models_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    return llama_server(port, models_dir), f"http://127.0.0.1:{port}/v1"


@pytest.fixture(scope="module")
def server_url(models_dir: Path) -> Iterator[str]:
    process, url = start_llama_server(models_dir)
    yield url
    stop(process)


def engine_for(url: str, **overrides: object) -> OpenAIHTTPEngine:
    settings = OpenAIHTTPSettings(base_url=url, model="smollm2", **overrides)  # type: ignore[arg-type]
    return OpenAIHTTPEngine("remote", settings)


async def test_generate_with_logprobs(server_url: str) -> None:
    engine = engine_for(server_url)
    try:
        params = SamplingParams(max_tokens=12, temperature=0, logprobs=True, top_logprobs=2)
        generation = await engine.generate(QUESTION, params)
    finally:
        await engine.close()
    sample = generation.samples[0]
    assert "4" in sample.text
    assert sample.finish_reason in ("stop", "length")
    # llama.cpp's server sends no usage in streams, so prompt tokens stay unknown (0)
    # and completion tokens are counted from the tokens that arrived.
    assert sample.completion_tokens == len(sample.logprobs) > 0
    assert sample.logprobs and all(t.logprob <= 0 for t in sample.logprobs)
    assert all(len(t.top) == 2 for t in sample.logprobs)


async def test_stream_and_n_samples(server_url: str) -> None:
    engine = engine_for(server_url, concurrency=2)
    texts = ["", ""]
    final: Generation | None = None
    try:
        params = SamplingParams(max_tokens=16, temperature=0.9, n=2, seed=5)
        async for event in engine.stream(STORY, params):
            if isinstance(event, Delta):
                texts[event.index] += event.text
            else:
                final = event
    finally:
        await engine.close()
    assert final is not None
    assert texts == [s.text for s in final.samples]
    assert all(s.finish_reason == "length" for s in final.samples)


async def test_completions_api_with_template(server_url: str) -> None:
    engine = engine_for(server_url, api="completions")
    try:
        generation = await engine.generate(
            (Message("user", "What is the capital of France?"),),
            SamplingParams(max_tokens=8, temperature=0),
        )
    finally:
        await engine.close()
    assert generation.samples[0].text.strip()


async def test_deadline_keeps_partial_answer(server_url: str) -> None:
    engine = engine_for(server_url)
    try:
        started = time.monotonic()
        generation = await engine.generate(
            STORY, SamplingParams(max_tokens=1000, temperature=0.8), started + 0.5
        )
    finally:
        await engine.close()
    assert generation.samples[0].finish_reason == "deadline"
    assert time.monotonic() - started < 1.0


async def test_unreachable_server_is_a_clean_error() -> None:
    engine = engine_for(f"http://127.0.0.1:{free_port()}/v1", connect_retries=1)
    try:
        with pytest.raises(EngineUnavailable, match="cannot connect"):
            await engine.generate(QUESTION, SamplingParams(max_tokens=4))
    finally:
        await engine.close()


# Slow: a server of its own; a server killed mid-stream is also in the default
# run, behind a gateway (test_faults).
@pytest.mark.slow
async def test_server_dying_mid_stream_is_a_clean_error(models_dir: Path) -> None:
    process, url = start_llama_server(models_dir)
    engine = engine_for(url, read_timeout_s=30)
    deltas = 0
    try:
        with pytest.raises(EngineUnavailable):
            async with asyncio.timeout(10):  # no hang: far below the read timeout
                async for event in engine.stream(STORY, SamplingParams(max_tokens=1000)):
                    deltas += isinstance(event, Delta)
                    if deltas == 3:
                        process.kill()
    finally:
        await engine.close()
        stop(process)
    assert deltas >= 3


# --- tools and structured output -----------------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
# The JSON text a client sent, as the gateway hands it on (its spacing kept).
TOOLS = json.dumps([WEATHER_TOOL], indent=1)
FORCE_WEATHER = '{"type": "function", "function": {"name": "get_weather"}}'
WEATHER = (Message("user", "What is the weather in Paris?"),)
PARIS_CALL = ToolCall("call_7", "get_weather", '{"city": "Paris"}')
# A turn that only called a tool, and the tool's answer to it.
ANSWERED = (
    *WEATHER,
    Message("assistant", "", tool_calls=(PARIS_CALL,)),
    Message("tool", "18 C and sunny", tool_call_id="call_7"),
)


def calls_of(deltas: list[Delta]) -> list[ToolCallDelta]:
    return [call for delta in deltas for call in delta.tool_calls]


async def drain(
    engine: OpenAIHTTPEngine, prompt: Any, params: SamplingParams
) -> tuple[list[Delta], Generation]:
    deltas: list[Delta] = []
    try:
        async for event in engine.stream(prompt, params):
            if isinstance(event, Delta):
                deltas.append(event)
            else:
                return deltas, event
    finally:
        await engine.close()
    raise AssertionError("stream ended without a Generation")


async def test_forced_tool_call_streams_as_tool_call_deltas(server_url: str) -> None:
    """llama-cpp-python repeats the call's id and name in every piece: the deltas name
    the call once, in its first piece."""
    params = SamplingParams(max_tokens=40, temperature=0, tools=TOOLS, tool_choice=FORCE_WEATHER)
    deltas, generation = await drain(engine_for(server_url), WEATHER, params)
    (sample,) = generation.samples
    assert sample.finish_reason == "tool_calls" and sample.text == ""
    (call,) = sample.tool_calls
    assert call.name == "get_weather" and call.id.startswith("call_")
    assert isinstance(json.loads(call.arguments)["city"], str)
    first, *rest = calls_of(deltas)
    assert (first.index, first.id, first.name) == (0, call.id, "get_weather")
    assert len(rest) > 1 and all((d.index, d.id, d.name) == (0, None, None) for d in rest)
    assert first.arguments + "".join(d.arguments for d in rest) == call.arguments


async def test_tool_turns_and_response_format_reach_the_server(server_url: str) -> None:
    """A conversation with a call and its answer is taken, and the response format is
    passed on as written: llama-cpp-python's json_object with a schema (its own
    extension) holds the answer to that schema."""
    schema = {
        "type": "object",
        "properties": {"celsius": {"type": "integer"}},
        "required": ["celsius"],
    }
    response_format = json.dumps({"type": "json_object", "schema": schema})
    params = SamplingParams(
        max_tokens=40, temperature=0, tools=TOOLS, response_format=response_format
    )
    engine = engine_for(server_url)
    try:
        generation = await engine.generate(ANSWERED, params)
    finally:
        await engine.close()
    (sample,) = generation.samples
    assert sample.finish_reason == "stop" and sample.tool_calls == ()
    assert set(json.loads(sample.text)) == {"celsius"}


def test_features_are_all_three_unless_the_settings_say_less() -> None:
    settings = OpenAIHTTPSettings(base_url="http://127.0.0.1:1/v1", model="m")
    assert OpenAIHTTPEngine("e", settings).features == {"tools", "json_object", "json_schema"}
    fewer = msgspec.structs.replace(settings, features=("json_object",))
    assert OpenAIHTTPEngine("e", fewer).features == {"json_object"}
    completions = msgspec.structs.replace(settings, api="completions")
    assert OpenAIHTTPEngine("e", completions).features == {"json_object", "json_schema"}
    asked = SamplingParams(tools=TOOLS, response_format='{"type": "json_schema"}')
    assert asked_features(asked) == ("tools", "json_schema")


def test_features_in_the_config_file() -> None:
    engines = "engines:\n  remote:\n    backend: openai_http\n    base_url: http://x/v1\n"
    config = parse_config(engines + "    model: m\n    features: [tools, json_object]\n")
    settings = config.engines["remote"]
    assert isinstance(settings, OpenAIHTTPSettings)
    assert settings.features == ("tools", "json_object")
    with pytest.raises(ConfigError, match=r"engines\.remote\.features"):
        parse_config(engines + "    model: m\n    features: [vision]\n")


# The answers of servers other than llama-cpp-python, written after vLLM's chat serving
# (its hermes tool parser, chunks dumped without unset fields) and OpenAI's API
# reference; not captured from a live server.
VLLM_PARALLEL_CALLS: list[dict[str, Any]] = [
    {"delta": {"role": "assistant", "content": ""}},
    {"delta": {"content": "Checking both."}},
    {"delta": {"tool_calls": [{"id": "chatcmpl-tool-a1", "type": "function", "index": 0,
                               "function": {"name": "get_weather"}}]}},
    {"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "'}}]}},
    {"delta": {"tool_calls": [{"index": 0, "function": {"arguments": 'Paris"}'}}]}},
    {"delta": {"tool_calls": [{"id": "chatcmpl-tool-b2", "type": "function", "index": 1,
                               "function": {"name": "get_weather"}}]}},
    {"delta": {"tool_calls": [{"index": 1, "function": {"arguments": '{"city": "Oslo"}'}}]}},
    {"delta": {"content": ""}, "finish_reason": "tool_calls"},
]  # fmt: skip
# OpenAI names a call a tool choice forced, and then says "stop".
OPENAI_FORCED_CALL: list[dict[str, Any]] = [
    {"delta": {"role": "assistant", "content": None, "tool_calls": [
        {"index": 0, "id": "call_Xy", "type": "function",
         "function": {"name": "get_weather", "arguments": ""}}]}},
    {"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"city"'}}]}},
    {"delta": {"tool_calls": [{"index": 0, "function": {"arguments": ': "Paris"}'}}]}},
    {"delta": {}, "finish_reason": "stop"},
]  # fmt: skip
# The legacy functions API: one call, no id, finish "function_call".
LEGACY_FUNCTION_CALL: list[dict[str, Any]] = [
    {"delta": {"role": "assistant", "content": None,
               "function_call": {"name": "get_weather", "arguments": ""}}},
    {"delta": {"function_call": {"arguments": '{"city": "Paris"}'}}},
    {"delta": {}, "finish_reason": "function_call"},
]  # fmt: skip
# A whole answer (vLLM's non-streaming ChatCompletionResponse), sent as JSON to a
# request that asked for a stream.
WHOLE_ANSWER: dict[str, Any] = {
    "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
    "choices": [{"index": 0, "logprobs": None, "finish_reason": "tool_calls",
                 "stop_reason": None, "message": {
        "role": "assistant", "content": None, "reasoning_content": None,
        "tool_calls": [
            {"id": "chatcmpl-tool-a1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "chatcmpl-tool-b2", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
        ]}}],
    "usage": {"prompt_tokens": 180, "completion_tokens": 31, "total_tokens": 211},
}  # fmt: skip


def sse(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
    """A stream of these choices (index 0), as OpenAI-compatible servers frame it."""
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    chunks = [{**base, "choices": [{"index": 0, **choice}]} for choice in choices]
    if usage is not None:
        chunks.append({**base, "choices": [], "usage": usage})
    return b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"


class Recorder:
    """An HTTP/1.1 server that answers every request with one canned body and keeps
    the bodies it was sent, raw."""

    def __init__(self, answer: bytes, content_type: str = "text/event-stream") -> None:
        self.answer = answer
        self.content_type = content_type
        self.bodies: list[bytes] = []
        self.url = ""

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower()
                length = int(head.split("content-length:", 1)[1].split("\r\n", 1)[0])
                self.bodies.append(await reader.readexactly(length))
                writer.write(
                    f"HTTP/1.1 200 OK\r\ncontent-type: {self.content_type}\r\n"
                    f"content-length: {len(self.answer)}\r\n\r\n".encode()
                    + self.answer
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    def sent(self) -> dict[str, Any]:
        (body,) = self.bodies
        decoded: dict[str, Any] = json.loads(body)
        return decoded


@pytest.fixture
async def recorder() -> AsyncIterator[Recorder]:
    recorder = Recorder(sse(VLLM_PARALLEL_CALLS))
    server = await asyncio.start_server(recorder.serve, "127.0.0.1", 0)
    recorder.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"
    try:
        yield recorder
    finally:
        server.close()
        await server.wait_closed()


async def test_body_carries_tools_choice_format_and_tool_turns(recorder: Recorder) -> None:
    response_format = '{"type": "json_schema", "json_schema": {"name": "w", "schema": {}}}'
    params = SamplingParams(
        max_tokens=64, tools=TOOLS, tool_choice='"required"', response_format=response_format,
        parallel_tool_calls=False,
    )  # fmt: skip
    await drain(engine_for(recorder.url), ANSWERED, params)
    body = recorder.sent()
    assert body["tools"] == [WEATHER_TOOL] and body["tool_choice"] == "required"
    assert body["parallel_tool_calls"] is False
    assert body["response_format"] == json.loads(response_format)
    # Spliced in as the client wrote them, not decoded and written again.
    assert TOOLS.encode() in recorder.bodies[0]
    assert response_format.encode() in recorder.bodies[0]
    assert body["messages"] == [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_7",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "content": "18 C and sunny", "tool_call_id": "call_7"},
    ]


async def test_plain_request_sends_none_of_them(recorder: Recorder) -> None:
    await drain(engine_for(recorder.url), WEATHER, SamplingParams(max_tokens=8))
    body = recorder.sent()
    assert not {"tools", "tool_choice", "response_format", "parallel_tool_calls"} & set(body)
    assert body["messages"] == [{"role": "user", "content": "What is the weather in Paris?"}]


async def test_parallel_calls_streamed_by_index(recorder: Recorder) -> None:
    recorder.answer = sse(
        VLLM_PARALLEL_CALLS, usage={"prompt_tokens": 180, "completion_tokens": 31}
    )
    params = SamplingParams(max_tokens=64, tools=TOOLS)
    deltas, generation = await drain(engine_for(recorder.url), WEATHER, params)
    assert calls_of(deltas) == [
        ToolCallDelta(0, "chatcmpl-tool-a1", "get_weather", ""),
        ToolCallDelta(0, None, None, '{"city": "'),
        ToolCallDelta(0, None, None, 'Paris"}'),
        ToolCallDelta(1, "chatcmpl-tool-b2", "get_weather", ""),
        ToolCallDelta(1, None, None, '{"city": "Oslo"}'),
    ]
    (sample,) = generation.samples
    assert sample.text == "Checking both." == "".join(d.text for d in deltas)
    assert sample.finish_reason == "tool_calls"
    assert sample.tool_calls == (
        ToolCall("chatcmpl-tool-a1", "get_weather", '{"city": "Paris"}'),
        ToolCall("chatcmpl-tool-b2", "get_weather", '{"city": "Oslo"}'),
    )
    assert (generation.prompt_tokens, sample.completion_tokens) == (180, 31)
    assert sample.timings.first_token_s is not None


async def test_forced_call_that_finishes_stop_finishes_tool_calls(recorder: Recorder) -> None:
    recorder.answer = sse(OPENAI_FORCED_CALL)
    params = SamplingParams(max_tokens=64, tools=TOOLS, tool_choice=FORCE_WEATHER)
    deltas, generation = await drain(engine_for(recorder.url), WEATHER, params)
    assert [d.id for d in calls_of(deltas)] == ["call_Xy", None, None]
    (sample,) = generation.samples
    assert sample.finish_reason == "tool_calls"
    assert sample.tool_calls == (ToolCall("call_Xy", "get_weather", '{"city": "Paris"}'),)


async def test_legacy_function_call_is_a_tool_call(recorder: Recorder) -> None:
    recorder.answer = sse(LEGACY_FUNCTION_CALL)
    params = SamplingParams(max_tokens=64, tools=TOOLS)
    deltas, generation = await drain(engine_for(recorder.url), WEATHER, params)
    (sample,) = generation.samples
    assert sample.finish_reason == "tool_calls"
    (call,) = sample.tool_calls
    # The server gave no id; a client needs one to answer the call.
    assert call.id.startswith("call_") and len(call.id) > len("call_")
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Paris"}')
    assert calls_of(deltas) == [
        ToolCallDelta(0, call.id, "get_weather", ""),
        ToolCallDelta(0, None, None, '{"city": "Paris"}'),
    ]


async def test_whole_answer_to_a_streamed_request(recorder: Recorder) -> None:
    recorder.answer = json.dumps(WHOLE_ANSWER).encode()
    recorder.content_type = "application/json"
    params = SamplingParams(max_tokens=64, tools=TOOLS)
    deltas, generation = await drain(engine_for(recorder.url), WEATHER, params)
    (sample,) = generation.samples
    assert sample.finish_reason == "tool_calls" and sample.text == ""
    assert sample.tool_calls == (
        ToolCall("chatcmpl-tool-a1", "get_weather", '{"city": "Paris"}'),
        ToolCall("chatcmpl-tool-b2", "get_weather", '{"city": "Oslo"}'),
    )
    assert calls_of(deltas) == [
        ToolCallDelta(0, "chatcmpl-tool-a1", "get_weather", '{"city": "Paris"}'),
        ToolCallDelta(1, "chatcmpl-tool-b2", "get_weather", '{"city": "Oslo"}'),
    ]
    assert (generation.prompt_tokens, sample.completion_tokens) == (180, 31)
