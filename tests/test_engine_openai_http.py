"""The OpenAI-compatible HTTP engine against a real server: llama.cpp's own, on 127.0.0.1."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engines.base import Delta, EngineUnavailable, Generation, Message, SamplingParams
from engines.openai_http import OpenAIHTTPEngine
from engines.settings import OpenAIHTTPSettings
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
