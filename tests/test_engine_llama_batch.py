"""Samples of one prompt decoded as one batch (``batch_samples``), on the bundled large
model, beside the single-sample path they replace."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from engines.base import Delta, Message, Sample, SamplingParams
from engines.llama_cpp import LlamaCppEngine
from engines.settings import LlamaCppSettings
from evaluator.loop import LoopResult, ReasoningLoop
from evaluator.policy import LoopSettings
from gateway.config import GatewayConfig
from tests.support import streamed, tokens_after_cancel

STORY = (Message("user", "Write a story about a dragon."),)
QUESTION = (Message("user", "What is the capital of Italy?"),)
# A batch's matrix products take k rows at a time, and llama.cpp's CPU kernels round
# a k-row product differently from a one-row one (ggml-org/llama.cpp#4479): a batched
# sample's logprobs drift from the single path's by hundredths, up to ~0.15 on
# Gemma-270M, and where two tokens are nearly tied greedy decoding can part ways (the
# story below does at its tenth token with k = 4). So greedy equality is checked over
# the tokens before any such tie.
LOGPROB_DRIFT = 0.5


@pytest.fixture(scope="module")
async def batched(fast_pair: GatewayConfig, models_dir: Path) -> AsyncIterator[LlamaCppEngine]:
    settings = fast_pair.engines["large"]
    assert isinstance(settings, LlamaCppSettings)
    engine = LlamaCppEngine(
        "large", msgspec.structs.replace(settings, batch_samples=True), models_dir
    )
    await engine.start()
    yield engine
    await engine.close()


def _same_tokens(batched: Sample, alone: Sample) -> None:
    assert batched.text == alone.text
    assert batched.finish_reason == alone.finish_reason
    assert batched.completion_tokens == alone.completion_tokens
    assert [t.token for t in batched.logprobs] == [t.token for t in alone.logprobs]
    for ours, theirs in zip(batched.logprobs, alone.logprobs, strict=True):
        assert math.isclose(ours.logprob, theirs.logprob, abs_tol=LOGPROB_DRIFT)
        assert len(ours.top) == len(theirs.top)
        assert ours.top[0].token == theirs.top[0].token  # greedy: the chosen one


async def test_greedy_batch_gives_the_single_path_tokens(
    large_engine: LlamaCppEngine, batched: LlamaCppEngine
) -> None:
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    # The third batch starts from the cells the first two left (a shared prefix).
    for prompt in (STORY, QUESTION, STORY):
        alone = (await large_engine.generate(prompt, params)).samples[0]
        before = batched.batched_samples
        together = await batched.generate(prompt, msgspec.structs.replace(params, n=4))
        assert batched.batched_samples - before == 4
        assert [s.index for s in together.samples] == [0, 1, 2, 3]
        assert together.prompt_tokens > 0
        for sample in together.samples:
            _same_tokens(sample, alone)
            assert sample.timings.first_token_s is not None


async def test_one_sample_takes_the_single_path(
    large_engine: LlamaCppEngine, batched: LlamaCppEngine
) -> None:
    # 8 tokens: the story's tenth is a near tie between the end of turn and " It", which
    # a prompt evaluated in other chunks (a cached prefix) can tip either way on some
    # CPUs even on the single path, as the batch does above.
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    alone = (await large_engine.generate(STORY, params)).samples[0]
    before = batched.batched_samples
    one = (await batched.generate(STORY, params)).samples[0]
    assert batched.batched_samples == before
    _same_tokens(one, alone)


async def test_calls_at_one_moment_share_a_batch_and_keep_their_own_limits(
    batched: LlamaCppEngine,
) -> None:
    """What the loop does with a round: k calls of one sample each, in one turn."""
    limits = [2, 5, 8]
    before = batched.batched_samples
    generations = await asyncio.gather(
        *(batched.generate(STORY, SamplingParams(max_tokens=m, temperature=0)) for m in limits)
    )
    assert batched.batched_samples - before == len(limits)
    for limit, generation in zip(limits, generations, strict=True):
        sample = generation.samples[0]
        assert sample.finish_reason == "length"
        assert sample.completion_tokens == limit
    # Greedy: each is where the longest one was after that many tokens.
    for generation in generations:
        assert generations[-1].text.startswith(generation.text)


async def test_samples_stream_by_index_and_stop_on_their_own(batched: LlamaCppEngine) -> None:
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=7, n=4, logprobs=True)
    texts, counted, final = await streamed(batched, QUESTION, params)
    for sample in final.samples:
        assert texts[sample.index] == sample.text
        assert counted[sample.index] == len(sample.logprobs)
        # Every token but one that completed a stop sequence (as on the single path).
        assert 0 <= sample.completion_tokens - len(sample.logprobs) <= 1
        assert sample.finish_reason in ("stop", "length")
        assert sample.completion_tokens <= 24
        assert "Question:" not in sample.text  # the template's stop was cut off
    # The short answer ends each sample at its stop, not at the longest sample's end.
    assert any(s.finish_reason == "stop" for s in final.samples)
    assert len({s.completion_tokens for s in final.samples}) > 1 or all(
        s.finish_reason == "stop" for s in final.samples
    )
    # Seeded: the same request gives the same samples.
    again = await batched.generate(QUESTION, params)
    assert [s.text for s in again.samples] == [s.text for s in final.samples]


async def test_cancelling_a_batch_stops_every_sample_within_a_token(
    batched: LlamaCppEngine,
) -> None:
    params = SamplingParams(max_tokens=500, temperature=0.8, seed=3, n=3)
    assert await tokens_after_cancel(batched, STORY, params, after_deltas=6) <= 3


async def test_closing_one_stream_leaves_the_others_of_its_batch_going(
    batched: LlamaCppEngine,
) -> None:
    """The loop prunes a branch by closing its stream mid-round."""
    params = SamplingParams(max_tokens=10, temperature=0)
    before = batched.batched_samples

    async def pruned() -> int:
        count = 0
        async with contextlib.aclosing(batched.stream(STORY, params)) as events:
            async for event in events:
                count += isinstance(event, Delta)
                if count == 2:
                    break
        return count

    kept, cut = await asyncio.gather(batched.generate(STORY, params), pruned())
    assert batched.batched_samples - before == 2
    assert cut == 2
    sample = kept.samples[0]
    assert sample.completion_tokens == 10 and sample.finish_reason == "length"


async def test_deadline_ends_a_batch_with_what_exists(batched: LlamaCppEngine) -> None:
    started = time.monotonic()
    generation = await batched.generate(
        STORY, SamplingParams(max_tokens=1000, temperature=0.8, seed=2, n=3), started + 0.4
    )
    # Room for a slow host: 1,000 tokens of three samples would take over 10 s here.
    assert time.monotonic() - started < 0.4 + 1.0
    # A short story may end at the template's stop first; the others the deadline ends.
    assert {s.finish_reason for s in generation.samples} <= {"deadline", "stop"}
    assert any(s.finish_reason == "deadline" for s in generation.samples)
    assert all(s.completion_tokens < 1000 for s in generation.samples)


async def test_a_loop_round_is_one_batch(batched: LlamaCppEngine) -> None:
    loop = ReasoningLoop(batched, LoopSettings(threshold=0.1, calibrator=None), None)
    before = batched.batched_samples
    result = None
    async for event in loop.run([Message("user", "What is the capital of Spain?")], deadline=None):
        result = event
    assert isinstance(result, LoopResult)
    assert len(result.trace.rounds[0].branches) == 4
    assert batched.batched_samples - before >= 4


async def test_a_batch_stops_reading_its_prompt_at_the_deadline(batched: LlamaCppEngine) -> None:
    """The prompt a batch shares obeys the deadline too, then every sample ends."""
    long = (Message("user", "Stop us. " + "the old stone bridge by the river " * 240),)
    stopped = batched.prompts_stopped
    started = time.monotonic()
    generation = await batched.generate(
        long, SamplingParams(max_tokens=8, n=2, temperature=0.8), started + 0.5
    )
    assert time.monotonic() - started < 0.5 + 0.2
    assert [s.finish_reason for s in generation.samples] == ["deadline", "deadline"]
    assert batched.prompts_stopped == stopped + 2
    after = await batched.generate(QUESTION, SamplingParams(max_tokens=8, n=2, temperature=0))
    assert all("Rome" in s.text for s in after.samples)
