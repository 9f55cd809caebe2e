"""The in-process llama.cpp engine on the bundled models."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path

import llama_cpp
import msgspec
import pytest

from engines.base import (
    EngineOverloaded,
    Generation,
    Message,
    PromptTooLong,
    SamplingParams,
)
from engines.bundled import SMOLLM2, model_file
from engines.llama_cpp import LlamaCppEngine
from engines.settings import LlamaCppSettings
from gateway.config import GatewayConfig
from tests.support import engine_idle, streamed, tokens_after_cancel

QUESTION = (Message("user", "What is the capital of France? Answer in one word."),)
STORY = (Message("user", "Write a long story about a dragon and a knight."),)


async def test_generates_with_chat_template(small_engine: LlamaCppEngine) -> None:
    generation = await small_engine.generate(QUESTION, SamplingParams(max_tokens=24, temperature=0))
    sample = generation.samples[0]
    assert "Paris" in sample.text
    assert sample.finish_reason in ("stop", "length")
    assert 0 < sample.completion_tokens <= 24
    # The chat template wraps the question in role markers, so the prompt is longer.
    assert generation.prompt_tokens > 10
    assert sample.timings.first_token_s is not None
    assert sample.timings.total_s >= sample.timings.first_token_s


async def test_base_model_answers_through_completion_template(
    large_engine: LlamaCppEngine,
) -> None:
    question = (Message("user", "What is the capital of Italy?"),)
    generation = await large_engine.generate(question, SamplingParams(max_tokens=16, temperature=0))
    sample = generation.samples[0]
    assert sample.text == "Rome"
    assert sample.finish_reason == "stop"  # the template's stop cut off the next "Question:"


async def _continues_its_own_text(engine: LlamaCppEngine) -> None:
    params = SamplingParams(max_tokens=12, temperature=0)
    whole = (await engine.generate(STORY, params)).text
    words = whole.split(" ")
    assert len(words) > 3
    head = " ".join(words[:3])
    rest = (await engine.generate((*STORY, Message("assistant", head)), params)).text
    assert (head + rest).startswith(whole[: len(head) + 8])


async def test_trailing_assistant_turn_is_continued(
    small_engine: LlamaCppEngine, large_engine: LlamaCppEngine
) -> None:
    """A conversation ending in an assistant turn continues that text (a prefill),
    through the chat template (small) and the completion template (large) alike:
    greedy decoding of an answer in two pieces gives the text it gives in one."""
    await _continues_its_own_text(small_engine)
    await _continues_its_own_text(large_engine)


async def test_max_tokens_ends_with_length(small_engine: LlamaCppEngine) -> None:
    generation = await small_engine.generate(STORY, SamplingParams(max_tokens=5, temperature=0))
    assert generation.samples[0].finish_reason == "length"
    assert generation.samples[0].completion_tokens == 5


async def test_stop_sequence_is_cut_and_not_returned(small_engine: LlamaCppEngine) -> None:
    free = await small_engine.generate(STORY, SamplingParams(max_tokens=40, temperature=0))
    words = free.samples[0].text.split()
    stop = " " + words[3]
    generation = await small_engine.generate(
        STORY, SamplingParams(max_tokens=40, temperature=0, stop=(stop,))
    )
    sample = generation.samples[0]
    assert sample.finish_reason == "stop"
    assert stop not in sample.text
    assert free.samples[0].text.startswith(sample.text)


async def test_logprobs_match_llama_cpp_full_logits(
    small_engine: LlamaCppEngine, models_dir: Path
) -> None:
    """Our per-step log-softmax equals llama.cpp's own logits_all=True path."""
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    prompt = "The three primary colours are"
    generation = await small_engine.generate(prompt, params)
    sample = generation.samples[0]
    assert len(sample.logprobs) == sample.completion_tokens == 8
    for token in sample.logprobs:
        assert token.logprob <= 0
        tops = [t.logprob for t in token.top]
        assert tops == sorted(tops, reverse=True)
        # Greedy decoding picks the most likely token.
        assert token.top[0].token == token.token
        assert math.isclose(token.top[0].logprob, token.logprob)

    reference = llama_cpp.Llama(
        model_path=str(model_file(SMOLLM2, models_dir)),
        n_ctx=512,
        logits_all=True,
        verbose=False,
    )
    try:
        full = reference.create_completion(prompt, max_tokens=8, temperature=0, logprobs=1)
    finally:
        reference.close()
    assert not isinstance(full, Iterator)  # not streamed: one whole response
    choice = full["choices"][0]
    assert choice["logprobs"] is not None
    expected = choice["logprobs"]["token_logprobs"]
    assert choice["text"] == sample.text
    assert [t.logprob for t in sample.logprobs] == pytest.approx(expected, abs=1e-3)


async def test_n_samples_are_independent_and_seeded(small_engine: LlamaCppEngine) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, n=3, seed=7)
    first = await small_engine.generate(STORY, params)
    again = await small_engine.generate(STORY, params)
    assert [s.index for s in first.samples] == [0, 1, 2]
    assert [s.text for s in first.samples] == [s.text for s in again.samples]
    assert len({s.text for s in first.samples}) > 1
    assert first.completion_tokens == sum(s.completion_tokens for s in first.samples)


async def test_stream_deltas_add_up_to_the_generation(small_engine: LlamaCppEngine) -> None:
    params = SamplingParams(max_tokens=20, temperature=0.8, seed=1, n=2, logprobs=True)
    texts, counted, final = await streamed(small_engine, STORY, params)
    assert [texts[i] for i in range(2)] == [s.text for s in final.samples]
    assert [counted[i] for i in range(2)] == [len(s.logprobs) for s in final.samples]


async def test_deadline_returns_what_exists(small_engine: LlamaCppEngine) -> None:
    started = time.monotonic()
    deadline = started + 0.3
    generation = await small_engine.generate(
        STORY, SamplingParams(max_tokens=1000, temperature=0.8, seed=2), deadline
    )
    elapsed = time.monotonic() - started
    sample = generation.samples[0]
    assert sample.finish_reason == "deadline"
    assert sample.text
    assert elapsed < 0.3 + 0.2


async def test_cancellation_stops_within_one_token(small_engine: LlamaCppEngine) -> None:
    params = SamplingParams(max_tokens=500, seed=3)
    assert await tokens_after_cancel(small_engine, STORY, params, after_deltas=5) <= 1


# Slow: loads a model of its own; overload stays covered by test_api's 429, test_shedding
# and the admission of every FanOutEngine (test_engine_scripted).
@pytest.mark.slow
async def test_full_queue_raises_overload(models_dir: Path) -> None:
    settings = LlamaCppSettings(model=SMOLLM2, concurrency=1, queue_size=1, retry_after_s=2)
    engine = LlamaCppEngine("tiny-queue", settings, models_dir)
    await engine.start()
    try:
        params = SamplingParams(max_tokens=40, temperature=0)
        results = await asyncio.gather(
            *(engine.generate(STORY, params) for _ in range(3)), return_exceptions=True
        )
        overloaded = [r for r in results if isinstance(r, EngineOverloaded)]
        assert len(overloaded) == 1
        assert overloaded[0].retry_after_s == 2
        assert sum(isinstance(r, Generation) for r in results) == 2
    finally:
        await engine.close()


async def test_prompt_longer_than_context_is_refused(small_engine: LlamaCppEngine) -> None:
    huge = (Message("user", "word " * 5000),)
    with pytest.raises(PromptTooLong) as caught:
        await small_engine.generate(huge, SamplingParams(max_tokens=4))
    assert caught.value.context_tokens == 2048


async def test_deadline_while_queued_returns_empty_sample(small_engine: LlamaCppEngine) -> None:
    """With the only slot busy, a request whose deadline passes in the queue still
    gets an answer: empty, marked "deadline", without waiting for the slot."""
    await engine_idle(small_engine)
    busy = asyncio.create_task(small_engine.generate(STORY, SamplingParams(max_tokens=300)))
    while not small_engine.busy_slots:  # noqa: ASYNC110
        await asyncio.sleep(0.001)
    started = time.monotonic()
    generation = await small_engine.generate(QUESTION, SamplingParams(), started + 0.2)
    waited = time.monotonic() - started
    busy.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await busy
    sample = generation.samples[0]
    assert (sample.text, sample.finish_reason, sample.completion_tokens) == ("", "deadline", 0)
    assert sample.timings.queue_s >= 0.2 and waited < 0.2 + 0.1


async def test_models_loading_at_once_leave_stderr_where_it_was(
    fast_pair: GatewayConfig, models_dir: Path
) -> None:
    """llama-cpp-python points the process's stderr at /dev/null while a model loads
    (verbose=False) and back afterwards. Two loads at once would each restore what
    they found, and the later one finds /dev/null: every log line after it is lost."""
    before = os.fstat(2)
    engines = []
    for name in ("small", "large"):
        settings = fast_pair.engines[name]
        assert isinstance(settings, LlamaCppSettings)
        concurrent = msgspec.structs.replace(settings, concurrency=3)
        engines.append(LlamaCppEngine(name, concurrent, models_dir))
    try:
        await asyncio.gather(*(engine.start() for engine in engines))
        after = os.fstat(2)
    finally:
        await asyncio.gather(*(engine.close() for engine in engines))
    assert (after.st_dev, after.st_ino) == (before.st_dev, before.st_ino)


def _long_question(opening: str) -> tuple[Message, ...]:
    """About 1,800 tokens (the small engine's context is 2,048): seconds of reading on
    two cores, in llama.cpp's chunks of 512 tokens."""
    return (Message("user", opening + " " + "the old stone bridge by the river " * 240),)


async def test_a_long_prompt_stops_at_the_deadline(small_engine: LlamaCppEngine) -> None:
    """Reading a prompt obeys the deadline as generation does: llama.cpp stops between
    two nodes of its graph (issue 32: a 3,000-word prompt ran 35 s past a 5 s one)."""
    await engine_idle(small_engine)
    stopped = small_engine.prompts_stopped
    started = time.monotonic()
    generation = await small_engine.generate(
        _long_question("Stop me."), SamplingParams(max_tokens=8), started + 0.5
    )
    elapsed = time.monotonic() - started
    sample = generation.samples[0]
    assert (sample.text, sample.finish_reason, sample.completion_tokens) == ("", "deadline", 0)
    assert elapsed < 0.5 + 0.2
    assert small_engine.prompts_stopped == stopped + 1
    # The context is whole again: a short question after it is answered as before.
    answer = await small_engine.generate(QUESTION, SamplingParams(max_tokens=8, temperature=0))
    assert "Paris" in answer.text


async def test_a_caller_that_leaves_mid_prompt_frees_the_slot(
    small_engine: LlamaCppEngine,
) -> None:
    await engine_idle(small_engine)
    reading = asyncio.create_task(
        small_engine.generate(_long_question("Leave me."), SamplingParams(max_tokens=8))
    )
    await asyncio.sleep(0.5)
    assert small_engine.busy_slots == 1
    reading.cancel()
    left = time.monotonic()
    with contextlib.suppress(asyncio.CancelledError):
        await reading
    await engine_idle(small_engine)
    assert time.monotonic() - left < 0.2


async def test_a_prompt_that_cannot_be_read_in_time_is_refused_at_once(
    small_engine: LlamaCppEngine,
) -> None:
    """Once the engine has measured how fast it reads, a prompt it cannot read before
    the deadline ends at once instead of holding the slot until then."""
    await small_engine.generate(  # a prompt read whole: its speed is measured
        (Message("user", "Count the bridges: " + "one bridge, " * 60),),
        SamplingParams(max_tokens=1),
    )
    refused = small_engine.prompts_refused
    started = time.monotonic()
    generation = await small_engine.generate(
        _long_question("Refuse me."), SamplingParams(max_tokens=8), started + 1.0
    )
    assert time.monotonic() - started < 0.2
    assert generation.samples[0].finish_reason == "deadline"
    assert small_engine.prompts_refused == refused + 1
