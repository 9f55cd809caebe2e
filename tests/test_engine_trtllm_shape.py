"""The OpenAI HTTP engine against trtllm-serve's wire shape, replayed on 127.0.0.1.

There is no GPU here, so no trtllm-serve either: a small HTTP/1.1 server answers the
engine's real requests with the bodies in tests/data/trtllm/, built field by field after
TensorRT-LLM's protocol models (see the README there), framed as uvicorn frames
trtllm-serve's StreamingResponse (one chunk per SSE event). It records what the engine
sends, so the requests are checked against the fields trtllm-serve accepts: its request
models forbid unknown fields and answer 400 to any.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Any

import pytest

from engines.base import (
    Delta,
    EngineError,
    EngineUnavailable,
    Generation,
    Message,
    PromptTooLong,
    SamplingParams,
    ToolCall,
)
from engines.openai_http import OpenAIHTTPEngine
from engines.settings import OpenAIHTTPSettings

DATA = Path(__file__).resolve().parent / "data" / "trtllm"
MODEL = "Qwen/Qwen2.5-7B-Instruct"
ARITHMETIC = (Message("user", "What is 2+2?"),)
STORY = (Message("user", "Tell me a story in one sentence."),)

# Top-level fields of trtllm-serve's ChatCompletionRequest (openai_protocol.py); the model
# has extra="forbid", so a field outside this set is a 400. max_tokens is the validation
# alias of max_completion_tokens.
TRTLLM_CHAT_REQUEST_FIELDS = {
    "messages", "prompt_token_ids", "prompt_token_ids_b64", "model", "frequency_penalty",
    "logit_bias", "logprobs", "top_logprobs", "max_tokens", "max_completion_tokens", "n",
    "presence_penalty", "response_format", "seed", "stop", "stream", "stream_options",
    "temperature", "top_p", "tools", "tool_choice", "parallel_tool_calls", "user",
    "reasoning_effort", "thinking", "thinking_token_budget", "prompt_ignore_length",
    "best_of", "use_beam_search", "top_k", "top_p_min", "min_p", "repetition_penalty",
    "length_penalty", "early_stopping", "stop_token_ids", "include_stop_str_in_output",
    "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
    "truncate_prompt_tokens", "lora_request", "echo", "add_generation_prompt",
    "add_special_tokens", "documents", "chat_template", "chat_template_kwargs",
    "injected_chat_template_kwargs", "media_io_kwargs", "disaggregated_params",
    "conversation_params", "cache_salt", "priority", "agent_hierarchy", "mm_processor_kwargs",
}  # fmt: skip
STREAM_OPTIONS_FIELDS = {"include_usage", "continuous_usage_stats"}

# The response models, field by field. Non-streaming bodies are model_dump(): every field,
# None included. Stream chunks are model_dump_json(exclude_none=True), except the final
# usage chunk, which is dumped whole.
RESPONSE_FIELDS = {
    "id", "object", "created", "model", "choices", "usage", "prompt_token_ids",
    "prompt_token_ids_b64",
}  # fmt: skip
CHOICE_FIELDS = {
    "index", "message", "logprobs", "finish_reason", "stop_reason", "mm_embedding_handle",
    "disaggregated_params", "avg_decoded_tokens_per_iter",
}  # fmt: skip
MESSAGE_FIELDS = {"role", "content", "reasoning_content", "reasoning", "tool_calls"}
CHUNK_FIELDS = {"id", "object", "created", "model", "choices", "usage"}
STREAM_CHOICE_FIELDS = {
    "index", "delta", "logprobs", "finish_reason", "stop_reason", "avg_decoded_tokens_per_iter",
}  # fmt: skip
DELTA_FIELDS = {"role", "content", "reasoning_content", "reasoning", "tool_calls"}
LOGPROB_FIELDS = {"token", "logprob", "bytes", "top_logprobs"}
USAGE_FIELDS = {"prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details"}
ERROR_FIELDS = {"object", "message", "type", "param", "code"}
FINISH_REASONS = {"stop", "length", "timeout", "cancelled", "tool_calls"}


def load(name: str) -> Any:
    return json.loads((DATA / name).read_text(encoding="utf-8"))


def sse_events(name: str) -> list[str]:
    """The events of an SSE sample, each with its blank-line terminator."""
    text = (DATA / name).read_text(encoding="utf-8")
    events = re.findall(r"data: .*?\n\n", text, flags=re.DOTALL)
    assert "".join(events) == text, f"{name} holds something other than data: events"
    return events


def sse_chunks(name: str) -> list[dict[str, Any]]:
    return [json.loads(e[5:]) for e in sse_events(name) if e.strip() != "data: [DONE]"]


# --- the replay server ---------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    sample: str
    status: int = 200
    # Close the connection after this many events, as uvicorn does when trtllm-serve's
    # stream generator raises mid-answer.
    cut_after: int | None = None


@dataclass(frozen=True)
class Recorded:
    method: str
    path: str
    body: dict[str, Any]


@dataclass
class ReplayServer:
    respond: Callable[[dict[str, Any]], Reply] = lambda _: Reply("chat_stream_stop.sse")
    requests: list[Recorded] = field(default_factory=list)
    url: str = ""

    async def __aenter__(self) -> ReplayServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/v1"
        return self

    async def __aexit__(self, *_: object) -> None:
        self._server.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:  # keep-alive: the engine's pool reuses connections
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
                request_line, *header_lines = head.split("\r\n")
                method, path, _ = request_line.split(" ", 2)
                fields = (line.split(":", 1) for line in header_lines if line)
                headers = {name.strip().lower(): value.strip() for name, value in fields}
                raw = await reader.readexactly(int(headers.get("content-length", "0")))
                body = json.loads(raw) if raw else {}
                self.requests.append(Recorded(method, path, body))
                if not await self._reply(writer, self.respond(body)):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _reply(self, writer: asyncio.StreamWriter, reply: Reply) -> bool:
        """Write one response; False when the connection was cut."""
        if reply.sample.endswith(".json"):
            payload = (DATA / reply.sample).read_bytes()
            writer.write(
                f"HTTP/1.1 {reply.status} {HTTPStatus(reply.status).phrase}\r\n"
                "content-type: application/json\r\n"
                f"content-length: {len(payload)}\r\n\r\n".encode()
                + payload
            )
            await writer.drain()
            return True
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        for sent, event in enumerate(sse_events(reply.sample)):
            if sent == reply.cut_after:
                await writer.drain()
                return False
            data = event.encode()
            writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True


@pytest.fixture
async def replay() -> AsyncIterator[ReplayServer]:
    async with ReplayServer() as server:
        yield server


def engine_for(server: ReplayServer, **overrides: Any) -> OpenAIHTTPEngine:
    settings = OpenAIHTTPSettings(base_url=server.url, model=MODEL, connect_retries=0, **overrides)
    return OpenAIHTTPEngine("large", settings)


async def generate(server: ReplayServer, prompt: Any, params: SamplingParams) -> Generation:
    engine = engine_for(server, concurrency=max(params.n, 1))
    try:
        return await engine.generate(prompt, params)
    finally:
        await engine.close()


def assert_accepted_by_trtllm(body: dict[str, Any]) -> None:
    assert set(body) <= TRTLLM_CHAT_REQUEST_FIELDS, set(body) - TRTLLM_CHAT_REQUEST_FIELDS
    assert set(body["stream_options"]) <= STREAM_OPTIONS_FIELDS
    assert body["stream"] is True  # trtllm-serve refuses stream_options without it
    if body.get("top_logprobs") is not None:
        assert body["logprobs"] is True  # trtllm-serve's check_logprobs


# --- the samples are what trtllm-serve's models produce ------------------------------


def iter_logprobs(entries: list[dict[str, Any]], nested: bool) -> Iterator[dict[str, Any]]:
    for entry in entries:
        yield entry
        if nested and entry.get("top_logprobs"):
            yield from iter_logprobs(entry["top_logprobs"], nested=False)


@pytest.mark.parametrize("name", ["chat_logprobs.json", "chat_n2.json"])
def test_non_streaming_samples_carry_every_field_of_the_response_models(name: str) -> None:
    body = load(name)
    assert set(body) == RESPONSE_FIELDS and body["object"] == "chat.completion"
    assert set(body["usage"]) == USAGE_FIELDS
    completion = 0
    for index, choice in enumerate(body["choices"]):
        assert set(choice) == CHOICE_FIELDS and choice["index"] == index
        assert set(choice["message"]) == MESSAGE_FIELDS
        assert choice["finish_reason"] in FINISH_REASONS
        if choice["logprobs"] is not None:
            for entry in iter_logprobs(choice["logprobs"]["content"], nested=True):
                assert set(entry) == LOGPROB_FIELDS
                assert entry["bytes"] == list(entry["token"].encode("utf-8", "replace"))
            completion += len(choice["logprobs"]["content"])
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    if completion:  # one logprob entry per generated token
        assert completion == usage["completion_tokens"]


@pytest.mark.parametrize(
    "name", ["chat_stream_logprobs.sse", "chat_stream_stop.sse", "chat_stream_length.sse"]
)
def test_stream_samples_are_framed_and_dumped_as_trtllm_serve_does(name: str) -> None:
    events = sse_events(name)
    # chat_stream_generator yields the role chunk with a space before its blank line.
    assert events[0].endswith("} \n\n") and all(e.endswith("}\n\n") for e in events[1:-1])
    assert events[-1] == "data: [DONE]\n\n"
    *chunks, usage_chunk = sse_chunks(name)
    assert chunks[0]["choices"] == [{"index": 0, "delta": {"role": "assistant"}}]
    for chunk in chunks:
        assert set(chunk) == CHUNK_FIELDS - {"usage"}  # exclude_none drops usage
        assert chunk["object"] == "chat.completion.chunk" and chunk["id"] == chunks[0]["id"]
        for choice in chunk["choices"]:
            assert set(choice) <= STREAM_CHOICE_FIELDS and set(choice["delta"]) <= DELTA_FIELDS
            assert None not in choice.values() and None not in choice["delta"].values()
            for entry in iter_logprobs((choice.get("logprobs") or {}).get("content", []), True):
                assert set(entry) <= LOGPROB_FIELDS and entry["token"] is not None
    finishes = [c["finish_reason"] for ch in chunks for c in ch["choices"] if "finish_reason" in c]
    assert len(finishes) == 1 and finishes[0] in FINISH_REASONS
    assert "finish_reason" in chunks[-1]["choices"][0]
    # The usage chunk comes last, dumped without exclude_none, with no choices.
    assert set(usage_chunk) == CHUNK_FIELDS and usage_chunk["choices"] == []
    assert set(usage_chunk["usage"]) == USAGE_FIELDS


@pytest.mark.parametrize(
    "name",
    ["error_prompt_too_long.json", "error_max_seq_len.json", "error_context_length_exceeded.json"],
)
def test_error_samples_are_the_error_response_model(name: str) -> None:
    body = load(name)
    assert set(body) == ERROR_FIELDS and body["object"] == "error"
    assert body["type"] == "BadRequestError" and body["param"] is None


def test_streams_assemble_to_the_non_streaming_answers() -> None:
    """The samples tell one story: a stream and the JSON of the same request agree."""
    answer = load("chat_logprobs.json")["choices"][0]
    chunks = sse_chunks("chat_stream_logprobs.sse")[1:-1]
    text = "".join(c["choices"][0]["delta"]["content"] for c in chunks)
    streamed = [e for c in chunks for e in c["choices"][0]["logprobs"]["content"]]
    assert text == answer["message"]["content"]
    assert [(e["token"], e["logprob"]) for e in streamed] == [
        (e["token"], e["logprob"]) for e in answer["logprobs"]["content"]
    ]
    streams = ["chat_stream_stop.sse", "chat_stream_length.sse"]
    for choice, name in zip(load("chat_n2.json")["choices"], streams, strict=True):
        deltas = [c["choices"][0]["delta"]["content"] for c in sse_chunks(name)[1:-1]]
        assert "".join(deltas) == choice["message"]["content"]


# --- the engine against the replayed server ------------------------------------------


async def test_logprobs_and_top_alternatives_map_into_token_logprobs(
    replay: ReplayServer,
) -> None:
    replay.respond = lambda _: Reply("chat_stream_logprobs.sse")
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=True, top_logprobs=2)
    generation = await generate(replay, ARITHMETIC, params)

    expected = load("chat_logprobs.json")
    choice = expected["choices"][0]
    (sample,) = generation.samples
    assert sample.text == choice["message"]["content"] == "The answer is 4 \U0001f642"
    assert sample.finish_reason == "stop"
    assert sample.completion_tokens == expected["usage"]["completion_tokens"] == 7
    assert generation.prompt_tokens == expected["usage"]["prompt_tokens"]
    assert [(t.token, t.logprob) for t in sample.logprobs] == [
        (e["token"], e["logprob"]) for e in choice["logprobs"]["content"]
    ]
    assert [[(a.token, a.logprob) for a in t.top] for t in sample.logprobs] == [
        [(a["token"], a["logprob"]) for a in e["top_logprobs"]]
        for e in choice["logprobs"]["content"]
    ]
    # A token whose text the detokenizer holds back (half of a UTF-8 character) still
    # arrives with its logprob, in a chunk with empty content.
    assert sample.logprobs[5].token == " \ufffd" and sample.logprobs[5].top[0].token == "."

    (request,) = replay.requests
    assert (request.method, request.path) == ("POST", "/v1/chat/completions")
    assert_accepted_by_trtllm(request.body)
    body = request.body
    assert body["model"] == MODEL and body["messages"] == [
        {"role": "user", "content": "What is 2+2?"}
    ]
    assert (body["logprobs"], body["top_logprobs"]) == (True, 2)
    assert (body["max_tokens"], body["temperature"]) == (16, 0.0)
    assert body["stream_options"] == {"include_usage": True}
    assert "n" not in body and "seed" not in body and "stop" not in body


async def test_stream_deltas_assemble_to_the_text_with_usage_counted(
    replay: ReplayServer,
) -> None:
    replay.respond = lambda _: Reply("chat_stream_stop.sse")
    engine = engine_for(replay)
    deltas: list[Delta] = []
    final: Generation | None = None
    params = SamplingParams(max_tokens=8, temperature=0.8, stop=("\n\n",), seed=7)
    try:
        async for event in engine.stream(STORY, params):
            if isinstance(event, Delta):
                deltas.append(event)
            else:
                final = event
    finally:
        await engine.close()
    assert final is not None
    (sample,) = final.samples
    assert [d.text for d in deltas] == ["A", " fox", " found", " a", " key", "."]
    assert "".join(d.text for d in deltas) == sample.text == "A fox found a key."
    assert sample.finish_reason == "stop" and sample.logprobs == ()
    usage = sse_chunks("chat_stream_stop.sse")[-1]["usage"]
    assert (final.prompt_tokens, sample.completion_tokens) == (35, 6)
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (35, 6)
    assert sample.timings.first_token_s is not None

    (request,) = replay.requests
    assert_accepted_by_trtllm(request.body)
    assert request.body["stop"] == ["\n\n"] and request.body["seed"] == 7


async def test_tools_and_tool_turns_are_fields_trtllm_serve_takes(replay: ReplayServer) -> None:
    tools = '[{"type": "function", "function": {"name": "add", "parameters": {}}}]'
    conversation = (
        *ARITHMETIC,
        Message("assistant", "", tool_calls=(ToolCall("call_1", "add", '{"a": 2, "b": 2}'),)),
        Message("tool", "4", tool_call_id="call_1"),
    )
    params = SamplingParams(
        max_tokens=8, tools=tools, tool_choice='"auto"', response_format='{"type": "json_object"}'
    )
    await generate(replay, conversation, params)
    (request,) = replay.requests
    assert_accepted_by_trtllm(request.body)
    assert {"tools", "tool_choice", "response_format"} <= set(request.body)
    # trtllm-serve's messages are OpenAI's message params: these keys, no others.
    assert [set(m) for m in request.body["messages"]] == [
        {"role", "content"},
        {"role", "content", "tool_calls"},
        {"role", "content", "tool_call_id"},
    ]


async def test_finish_reason_length_maps(replay: ReplayServer) -> None:
    replay.respond = lambda _: Reply("chat_stream_length.sse")
    generation = await generate(replay, STORY, SamplingParams(max_tokens=8, temperature=0.8))
    (sample,) = generation.samples
    assert sample.finish_reason == "length"
    assert sample.text == "Once upon a time, in a small" and sample.completion_tokens == 8


async def test_n2_is_two_seeded_requests_that_make_the_native_n2_answer(
    replay: ReplayServer,
) -> None:
    """The engine fans n out itself: one n=1 request per sample, seeds seed and seed+1.
    Together they give what trtllm-serve answers to one request with n=2."""
    by_seed = {7: "chat_stream_stop.sse", 8: "chat_stream_length.sse"}
    replay.respond = lambda body: Reply(by_seed[body["seed"]])
    params = SamplingParams(max_tokens=8, temperature=0.8, stop=("\n\n",), n=2, seed=7)
    generation = await generate(replay, STORY, params)

    native = load("chat_n2.json")
    assert [s.text for s in generation.samples] == [
        c["message"]["content"] for c in native["choices"]
    ]
    assert [s.finish_reason for s in generation.samples] == [
        c["finish_reason"] for c in native["choices"]
    ]
    assert generation.completion_tokens == native["usage"]["completion_tokens"] == 14
    assert generation.prompt_tokens == native["usage"]["prompt_tokens"]

    assert sorted(r.body["seed"] for r in replay.requests) == [7, 8]
    for request in replay.requests:
        assert_accepted_by_trtllm(request.body)
        assert "n" not in request.body  # trtllm-serve's default n is 1
        assert request.body["stop"] == ["\n\n"] and request.body["max_tokens"] == 8


@pytest.mark.parametrize(
    ("name", "prompt_tokens", "limit"),
    [
        ("error_prompt_too_long.json", 9000, 8192),
        ("error_max_seq_len.json", 9000, 8192),
        ("error_context_length_exceeded.json", 40000, 32768),
    ],
)
async def test_too_long_prompt_is_prompt_too_long(
    replay: ReplayServer, name: str, prompt_tokens: int, limit: int
) -> None:
    replay.respond = lambda _: Reply(name, status=400)
    with pytest.raises(PromptTooLong) as caught:
        await generate(replay, ARITHMETIC, SamplingParams(max_tokens=16))
    assert (caught.value.prompt_tokens, caught.value.context_tokens) == (prompt_tokens, limit)
    assert caught.value.message == (
        f"prompt is {prompt_tokens} tokens; the model's context holds {limit}"
    )
    assert len(replay.requests) == 1  # a refusal is not retried


async def test_refused_request_is_an_engine_error_with_the_servers_reason(
    replay: ReplayServer,
) -> None:
    """trtllm-serve's validation errors are {"error": str}, not its ErrorResponse."""
    replay.respond = lambda _: Reply("error_validation.json", status=400)
    with pytest.raises(EngineError) as caught:
        await generate(replay, ARITHMETIC, SamplingParams(max_tokens=16))
    assert type(caught.value) is EngineError
    assert caught.value.message.startswith("server refused the request (400): ")
    assert "extra_forbidden" in caught.value.message and "service_tier" in caught.value.message


async def test_stream_cut_mid_answer_is_engine_unavailable(replay: ReplayServer) -> None:
    replay.respond = lambda _: Reply("chat_stream_logprobs.sse", cut_after=3)
    engine = engine_for(replay)
    texts: list[str] = []
    try:
        with pytest.raises(EngineUnavailable, match="closed the connection mid-answer"):
            async for event in engine.stream(ARITHMETIC, SamplingParams(max_tokens=16)):
                if isinstance(event, Delta):
                    texts.append(event.text)
    finally:
        await engine.close()
    assert texts == ["The", " answer"]
