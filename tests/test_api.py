"""The gateway as clients meet it: the official openai client over real HTTP."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

HELLO: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is 2+2?"}]
STORY: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Write a long story about a dragon and a knight."}
]


@pytest.fixture(scope="module")
def client(gateway_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0)


def test_lists_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["small", "large", "auto"]


def test_chat_completion_with_every_parameter(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model="small",
        messages=[{"role": "system", "content": "Be brief."}, *HELLO],
        max_tokens=8,
        temperature=0.7,
        top_p=0.9,
        stop=["\n\n"],
        n=2,
        seed=11,
        logprobs=True,
        top_logprobs=2,
        user="tenant-a",
    )
    assert completion.object == "chat.completion"
    assert completion.model == "small"
    assert [c.index for c in completion.choices] == [0, 1]
    tokens_with_logprobs = 0
    for choice in completion.choices:
        assert choice.message.role == "assistant"
        assert choice.finish_reason in ("stop", "length")
        assert choice.logprobs is not None and choice.logprobs.content
        assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
        tokens_with_logprobs += len(choice.logprobs.content)
    usage = completion.usage
    assert usage is not None and usage.prompt_tokens > 0
    assert usage.completion_tokens == tokens_with_logprobs
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_same_seed_same_answer(client: openai.OpenAI) -> None:
    answers = {
        client.chat.completions.create(
            model="small", messages=STORY, max_tokens=12, temperature=1.0, seed=42
        )
        .choices[0]
        .message.content
        for _ in range(2)
    }
    assert len(answers) == 1


def test_large_model_answers(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model="large",
        messages=[{"role": "user", "content": "What is the capital of Italy?"}],
        max_tokens=10,
        temperature=0,
    )
    assert completion.choices[0].message.content == "Rome"
    assert completion.choices[0].finish_reason == "stop"


def test_stream_chunks_and_usage(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model="small",
            messages=STORY,
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finishing] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 10


def test_stream_is_well_formed_sse(gateway_url: str) -> None:
    body = {"model": "small", "messages": HELLO, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{gateway_url}/v1/chat/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"


async def test_async_client_stream_and_plain(gateway_url: str) -> None:
    client = openai.AsyncOpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0)
    async with client:
        plain = await client.chat.completions.create(model="small", messages=HELLO, max_tokens=6)
        stream = await client.chat.completions.create(
            model="large", messages=HELLO, max_tokens=6, stream=True
        )
        pieces = [chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices]
    assert plain.choices[0].message.content
    assert "".join(pieces)


async def test_full_queue_answers_429_with_retry_after(gateway_url: str) -> None:
    """The test config gives `small` one slot and one queue place: a third request is shed."""
    body = {"model": "small", "messages": STORY, "max_tokens": 60, "temperature": 0}
    async with httpx.AsyncClient(base_url=gateway_url, timeout=60) as http:
        responses = await asyncio.gather(
            *(http.post("/v1/chat/completions", json=body) for _ in range(4))
        )
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200, 200, 429, 429]
    shed = next(r for r in responses if r.status_code == 429)
    assert shed.headers["retry-after"] == "1"
    assert shed.json()["error"]["code"] == "engine_overloaded"


def test_health_readiness_and_openapi(gateway_url: str) -> None:
    assert httpx.get(f"{gateway_url}/healthz").json() == {"status": "ok"}
    ready = httpx.get(f"{gateway_url}/readyz")
    assert ready.status_code == 200 and ready.json()["ready"] is True
    schema = httpx.get(f"{gateway_url}/openapi/openapi.json").json()
    assert "/v1/chat/completions" in schema["paths"]
    assert "ChatCompletionRequest" in str(schema["components"])


def test_client_disconnect_stops_generation(gateway_url: str) -> None:
    """A client that hangs up mid-stream frees the engine at once.

    `small` has one generation slot. The abandoned stream would run for 512 tokens
    (about 5 s here, greedy); the next request only gets the slot quickly if the
    gateway stopped generating when the client went away.
    """
    body = {"model": "small", "messages": STORY, "max_tokens": 512, "temperature": 0}
    with httpx.stream(
        "POST", f"{gateway_url}/v1/chat/completions", json={**body, "stream": True}
    ) as response:
        for i, _ in enumerate(response.iter_lines()):
            if i == 6:
                break
    started = time.monotonic()
    follow_up = httpx.post(
        f"{gateway_url}/v1/chat/completions",
        json={"model": "small", "messages": HELLO, "max_tokens": 1},
        timeout=30,
    )
    assert follow_up.status_code == 200
    assert time.monotonic() - started < 2.0


def test_auto_routes_by_difficulty_and_says_so(client: openai.OpenAI) -> None:
    assert "auto" in [m.id for m in client.models.list()]
    raw = client.chat.completions.with_raw_response.create(
        model="auto", messages=HELLO, max_tokens=4, temperature=0
    )
    completion = raw.parse()
    assert completion.model == "auto"
    tier = raw.headers["x-satisfice-route"]
    assert tier in ("small", "large")
    assert raw.headers["x-satisfice-engine"] == tier  # the default config names engines by tier
    assert 0.0 <= float(raw.headers["x-satisfice-difficulty"]) <= 1.0


def test_route_explains_without_generating(gateway_url: str) -> None:
    easy = httpx.post(f"{gateway_url}/v1/route", json={"model": "auto", "messages": HELLO})
    assert easy.status_code == 200
    decision = easy.json()
    assert decision["tier"] in ("small", "large")
    assert decision["engine"] == decision["tier"]
    assert 0.0 <= decision["score"] <= 1.0
    assert decision["tier"] == ("large" if decision["score"] >= decision["threshold"] else "small")
    assert decision["embedding_ms"] > 0 and decision["scoring_ms"] > 0
    for neighbour in decision["neighbours"]:
        assert set(neighbour) == {"prompt", "similarity", "label"}
    similarities = [n["similarity"] for n in decision["neighbours"]]
    assert len(similarities) == 5 and similarities == sorted(similarities, reverse=True)
    again = httpx.post(f"{gateway_url}/v1/route", json={"model": "auto", "messages": HELLO})
    assert again.json()["score"] == decision["score"]
