"""Faults, all real: an engine server killed and restarted, Redis stopped and
restarted, and SIGTERM while streams are in flight, each against a real gateway
process driven over real HTTP."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import ConfigError, parse_config
from tests.support import free_port, llama_server, spare_redis, start_gateway, stop
from tests.test_api_cache import ask, cache_gateway_config

STORY = [{"role": "user", "content": "Write a long story about a dragon and a knight."}]
HELLO = [{"role": "user", "content": "What is 2+2?"}]
OPEN_S = 3.0


def metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    raise AssertionError(f"no {name}{labels} in /metrics")


def chat(url: str, model: str, **extra: object) -> httpx.Response:
    body = {"model": model, "messages": HELLO, "max_tokens": 8, "temperature": 0, **extra}
    # Not served from the cache: these requests are about the engine behind it.
    headers = {"x-satisfice-cache": "bypass"}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=30)


def sse_text(body: str) -> str:
    """The answer in a whole SSE body, which must end with [DONE]."""
    lines = [line[5:].strip() for line in body.splitlines() if line.startswith("data:")]
    assert lines[-1] == "[DONE]", lines[-1]
    return "".join(
        choice["delta"].get("content") or ""
        for line in lines[:-1]
        for choice in json.loads(line)["choices"]
    )


def engine_config(server: str) -> str:
    # Two engines on one server: `bare` has no fallback, `remote` falls back to the
    # bundled in-process model. The cache is on: a stand-in's answer must not be kept
    # as the asked engine's.
    breaker = f"breaker: {{failures: 3, open_s: {OPEN_S}}}"
    return f"""
cache: {{}}
engines:
  small:
    backend: llama_cpp
    model: smollm2-135m-instruct
    queue_size: 32
  bare:
    backend: openai_http
    base_url: {server}
    model: smollm2
    {breaker}
  remote:
    backend: openai_http
    base_url: {server}
    model: smollm2
    fallback: small
    {breaker}
"""


@pytest.mark.parametrize(
    ("fallback", "error"),
    [("nowhere", "'nowhere' is not an engine"), ("remote", "cannot be its own fallback")],
)
def test_fallback_must_name_another_engine(fallback: str, error: str) -> None:
    text = engine_config("http://127.0.0.1:1/v1").replace(
        "fallback: small", f"fallback: {fallback}"
    )
    with pytest.raises(ConfigError, match=f"engines.remote.fallback: .*{error}"):
        parse_config(text)


def recovery_s(url: str, model: str, back: float) -> float:
    """Seconds from ``back`` to the start of the first request ``model`` answered itself
    (answering takes a while on busy cores, and so does a fallback's answer)."""
    while True:
        started = time.monotonic()
        answered = chat(url, model)
        if answered.status_code == 200 and "x-satisfice-failover" not in answered.headers:
            assert answered.headers["x-satisfice-engine"] == model
            return round(started - back, 2)
        assert started - back < OPEN_S + 2, f"{model} did not recover within open_s"
        time.sleep(0.2)


def test_engine_server_killed_and_restarted(tmp_path: Path, models_dir: Path) -> None:
    port = free_port()
    server = llama_server(port, models_dir)
    url, gateway = start_gateway(engine_config(f"http://127.0.0.1:{port}/v1"), tmp_path)
    try:
        for model in ("bare", "remote"):
            answered = chat(url, model)
            assert answered.status_code == 200
            assert answered.headers["x-satisfice-engine"] == model
            assert "x-satisfice-failover" not in answered.headers

        killed_mid_stream(url, server)
        refused_fast_then_by_the_breaker(url)
        answered_by_the_fallback(url)

        # Back on the same port: the gateway recovers by itself within open_s.
        server = llama_server(port, models_dir)
        back = time.monotonic()
        recovered = {model: recovery_s(url, model, back) for model in ("bare", "remote")}
        assert metric(url, "satisfice_engine_breaker_open", engine="bare") == 0
        assert metric(url, "satisfice_engine_breaker_open", engine="remote") == 0
        assert metric(url, "satisfice_engine_breaker_opens_total", engine="bare") >= 1
        print(f"recovered {recovered} s after the server was back (open_s {OPEN_S})")
    finally:
        stop(gateway)
        stop(server)


def killed_mid_stream(url: str, server: subprocess.Popen[bytes]) -> None:
    """Killed mid-stream: the stream ends at once with an error event, no hang."""
    killed_at = None
    events: list[str] = []
    body = {"model": "bare", "messages": STORY, "max_tokens": 400, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as live:
        for line in live.iter_lines():
            if line.startswith("data:"):
                events.append(line)
            if len(events) == 3 and killed_at is None:
                server.kill()
                killed_at = time.monotonic()
    server.wait()
    assert killed_at is not None and time.monotonic() - killed_at < 5
    assert '"error"' in events[-1] and "data: [DONE]" not in events


def refused_fast_then_by_the_breaker(url: str) -> None:
    """Without a fallback: a fast 503 in OpenAI's shape; after 3 failures (the broken
    stream was one) the breaker answers without touching the server."""
    refusals = []
    for _ in range(4):
        asked = time.monotonic()
        refused = chat(url, "bare")
        refusals.append((time.monotonic() - asked, refused.json()["error"]))
        assert refused.status_code == 503 and "retry-after" in refused.headers
    assert all(seconds < 2 for seconds, _ in refusals)
    assert all(e["code"] == "engine_unavailable" for _, e in refusals)
    assert "cannot connect" in refusals[0][1]["message"]
    assert all("circuit open, retry in" in e["message"] for _, e in refusals[2:])
    assert metric(url, "satisfice_engine_breaker_open", engine="bare") == 1
    print(f"\nrefused: connect error {refusals[0][0] * 1000:.0f} ms, "
          f"breaker open {refusals[-1][0] * 1000:.0f} ms")  # fmt: skip


def answered_by_the_fallback(url: str) -> None:
    """With a fallback: answered by the bundled model, and the response says so,
    streamed or not, before and after the remote's breaker opens; the same question
    twice is answered twice: the stand-in's answer was not cached."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    for stream in (False, True, False, True):
        if stream:
            answered = chat(url, "remote", stream=True)
            headers, text = dict(answered.headers), sse_text(answered.text)
        else:
            raw = client.chat.completions.with_raw_response.create(
                model="remote",
                messages=[{"role": "user", "content": "What is 2+2? Only the number."}],
                max_tokens=96,  # a whole answer: one cut short would not be cached
                temperature=0,
            )
            headers, text = dict(raw.headers), raw.parse().choices[0].message.content or ""
        assert headers["x-satisfice-engine"] == "small"
        assert headers["x-satisfice-failover"] == "remote"
        assert text.strip()
    assert metric(url, "satisfice_engine_breaker_open", engine="remote") == 1
    assert metric(url, "satisfice_engine_failovers_total", engine="remote") == 4
    assert metric(url, "satisfice_engine_failovers_total", engine="bare") == 0


# What an entry says. A write-back of an outage's miss may land after Redis is back
# and store the same answer again, with new times, confidence and embedding bits.
ANSWER_FIELDS = (b"id", b"namespace", b"model", b"tier", b"prompt", b"response",
                 b"completion_tokens")  # fmt: skip


def redis_entries(port: int, prefix: str) -> dict[bytes, dict[bytes, bytes | None]]:
    """Every cache entry in this Redis, as stored, by the fields that carry its answer."""
    with redis.Redis(port=port) as client:
        keys = [k for k in client.scan_iter(f"{prefix}:*") if client.type(k) == b"hash"]
        return {
            key: dict(zip(ANSWER_FIELDS, client.hmget(key, ANSWER_FIELDS), strict=True))
            for key in keys
        }


def exact(url: str, question: str, within_s: float = 5.0) -> str:
    """The cached answer, once the cache serves it (write-backs land after the response)."""
    deadline = time.monotonic() + within_s
    while (served := ask(url, question))[1]["x-satisfice-cache"] != "exact":
        assert time.monotonic() < deadline, f"{question!r} not served from the cache"
        time.sleep(0.2)
    return served[0]


# Slow: a Redis and a gateway of its own; the default run keeps Redis killed,
# restarted and paused under the store itself (test_redis_store).
@pytest.mark.slow
def test_redis_stopped_and_restarted(tmp_path: Path) -> None:
    redis_port = free_port()
    server = spare_redis(redis_port, tmp_path)
    prefix = f"faults-{uuid.uuid4().hex[:6]}"
    config = cache_gateway_config(f"redis://127.0.0.1:{redis_port}/0", prefix)
    url, gateway = start_gateway(config, tmp_path)
    questions = ["What colour is the sky on a clear day?", "What colour is grass?"]
    try:
        cached = {}
        for question in questions:
            first, headers = ask(url, question)
            assert headers["x-satisfice-cache"] == "miss"
            cached[question] = exact(url, question)
            assert cached[question] == first
        stored = redis_entries(redis_port, prefix)
        assert len(stored) == len(questions)

        # An operator's stop: Redis saves its data set and exits.
        subprocess.run(["redis-cli", "-p", str(redis_port), "shutdown", "save"],
                       capture_output=True, check=False)  # fmt: skip
        server.wait(timeout=10)
        for question in questions:
            asked = time.monotonic()
            answer, headers = ask(url, question)
            assert answer and headers["x-satisfice-cache"] == "miss"
            # The outage costs the request little beyond the engine's own time (and
            # ask's 0.2 s pause after a miss): no wait for Redis.
            engine_s = float(headers["server-timing"].split("dur=")[1]) / 1000
            assert time.monotonic() - asked - 0.2 - engine_s < 2

        server = spare_redis(redis_port, tmp_path)  # loads the saved data set
        for question, text in cached.items():
            assert exact(url, question).encode() == text.encode()  # byte for byte
        assert redis_entries(redis_port, prefix) == stored  # nothing lost or changed

        _, headers = ask(url, "What is the capital of Portugal?")
        assert headers["x-satisfice-cache"] == "miss"
        exact(url, "What is the capital of Portugal?")  # write-backs resumed
    finally:
        stop(gateway)
        server.kill()
        server.wait()


SIGTERM_CONFIG = """
engines:
  small:
    backend: llama_cpp
    model: smollm2-135m-instruct
    concurrency: 3
    threads: 1
"""


async def _streamed(url: str, begun: asyncio.Event) -> tuple[int, str, bool]:
    """Status, text and whether [DONE] came, of one streamed story; ``begun`` is set
    once its first token has arrived."""
    body = {"model": "small", "messages": STORY, "max_tokens": 16, "temperature": 0,
            "stream": True}  # fmt: skip
    text, done = "", False
    async with (
        httpx.AsyncClient(timeout=60) as http,
        http.stream("POST", f"{url}/v1/chat/completions", json=body) as response,
    ):
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data:"):
                for choice in json.loads(line[5:])["choices"]:
                    text += choice["delta"].get("content") or ""
                if text:
                    begun.set()
    return response.status_code, text, done


async def test_sigterm_drains_in_flight_streams(tmp_path: Path) -> None:
    url, gateway = start_gateway(SIGTERM_CONFIG, tmp_path)
    try:
        begun = [asyncio.Event() for _ in range(3)]
        streams = [asyncio.create_task(_streamed(url, event)) for event in begun]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in begun)), timeout=30)
        signalled = time.monotonic()
        gateway.send_signal(signal.SIGTERM)

        refused = False
        # Promptly, but not by one host's clock: a busy machine may take a while to
        # answer the probe either way, and only an answer (or a refused connection)
        # says anything.
        while not refused and time.monotonic() - signalled < 10:
            try:
                late = await asyncio.to_thread(httpx.get, f"{url}/healthz", timeout=1)
                refused = late.status_code == 503
            except httpx.ConnectError:
                refused = True
            except httpx.TimeoutException:
                pass
            await asyncio.sleep(0.05)
        assert refused, "new connections still served after SIGTERM"

        # Within uvicorn's timeout_graceful_shutdown (30 s, gateway/cli/__init__.py).
        results = await asyncio.wait_for(asyncio.gather(*streams), timeout=30)
        for status, text, done in results:
            assert status == 200 and text.strip() and done
        code = await asyncio.to_thread(gateway.wait, 30)
        print(f"\ndrained {len(results)} streams and exited {code} "
              f"{time.monotonic() - signalled:.2f} s after SIGTERM")  # fmt: skip
        # uvicorn (0.29+) re-raises the signal once it has shut down cleanly, so the
        # process ends by SIGTERM's default action after its graceful shutdown.
        assert code in (0, -signal.SIGTERM)
    finally:
        stop(gateway)
