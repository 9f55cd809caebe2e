"""The reasoning loop on the bundled models: its stop rules, deadline and fallbacks,
pruning, cancellation and the small model's draft."""

from __future__ import annotations

import asyncio
import contextlib
import time

import msgspec
import pytest

from engines.base import Message
from engines.llama_cpp import LlamaCppEngine
from evaluator.calibration import Calibrator, calibrator_file, for_every_kind, read_calibrator
from evaluator.loop import Fallback, FallbackSettings, LoopResult, ReasoningLoop
from evaluator.policy import LoopSettings
from evaluator.shown import Thinking
from evaluator.signals import SignalSettings

QUESTION = [Message("user", "What is the capital of Spain?")]


def doubtful() -> Calibrator:
    """A real calibrator that gives every answer P = 0.5, so only rounds, tokens and
    time can stop the loop."""
    return Calibrator(
        features=["vote_share"],
        signals=SignalSettings(),
        mean=[0.0],
        scale=[1.0],
        weights=[0.0],
        bias=0.0,
    )


async def run(loop: ReasoningLoop, **options: object) -> tuple[list[Thinking], LoopResult]:
    notes: list[Thinking] = []
    result = None
    async for event in loop.run(QUESTION, **options):  # type: ignore[arg-type]
        if isinstance(event, Thinking):
            notes.append(event)
        else:
            result = event
    assert result is not None
    return notes, result


async def test_stops_when_confident(large_engine: LlamaCppEngine) -> None:
    loop = ReasoningLoop(large_engine, LoopSettings(threshold=0.1, calibrator=None), None)
    notes, result = await run(loop, deadline=None)
    assert result.trace.stop == "confident" and result.trace.fallback == "none"
    assert len(result.trace.rounds) == 1 and len(result.trace.rounds[0].branches) == 4
    assert result.text.strip()
    assert result.trace.tokens == sum(b.tokens for b in result.trace.rounds[0].branches) > 0
    assert result.completion_tokens == result.trace.tokens
    # One note before any work, one per round; between them, the first branch as it
    # was generated, which is the round's first branch in full.
    said = [n for n in notes if n.kind == "note"]
    assert len(said) == 2 and "4 branches" in said[0].text
    shown = "".join(n.text for n in notes if n.kind == "thought")
    assert shown.startswith("Round 1, branch 1 of 4:\n") and len(shown) > len("Round 1")
    assert [n.kind for n in notes][-1] == "note" and notes[0].kind == "note"


async def test_runs_out_of_rounds_then_tokens(large_engine: LlamaCppEngine) -> None:
    settings = LoopSettings(branches=2, max_rounds=3, calibrator=None)
    _, result = await run(ReasoningLoop(large_engine, settings, doubtful()), deadline=None)
    assert result.trace.stop == "max_rounds" and len(result.trace.rounds) == 3
    assert result.trace.confidence == pytest.approx(0.5)
    assert result.trace.fallback == "none"  # its own answer, at its limits

    per_round = result.trace.rounds[0].tokens
    budget = LoopSettings(branches=2, max_rounds=10, token_budget=max(1, per_round + 1))
    _, result = await run(ReasoningLoop(large_engine, budget, doubtful()), deadline=None)
    assert result.trace.stop == "token_budget"
    assert len(result.trace.rounds) < 10


@pytest.mark.slow  # five passes on the large engine: 17-21 s on 2 cores under load
async def test_greedy_first_is_one_pass_at_temperature_0_then_samples(
    large_engine: LlamaCppEngine,
) -> None:
    greedy = LoopSettings(greedy_first=True, round_tokens=8, calibrator=None)
    # greedy_stop 0: the greedy pass alone, the same answer every time.
    loop = ReasoningLoop(large_engine, greedy, None, greedy_calibrators=for_every_kind(doubtful()))
    _, first = await run(loop, deadline=None)
    _, again = await run(loop, deadline=None)
    (only,) = first.trace.rounds
    assert only.greedy and len(only.branches) == 1 and first.trace.stop == "greedy"
    assert first.text.strip() and first.text == again.text
    assert first.trace.tokens == only.branches[0].tokens > 0
    # P(greedy right) 0.5 short of greedy_stop: a sampling round of 2 branches follows.
    unsure = msgspec.structs.replace(greedy, greedy_stop=0.9, branches=2, max_rounds=1)
    loop = ReasoningLoop(
        large_engine, unsure, doubtful(), greedy_calibrators=for_every_kind(doubtful())
    )
    _, result = await run(loop, deadline=None)
    assert [len(r.branches) for r in result.trace.rounds] == [1, 2]
    assert result.trace.rounds[0].probability == pytest.approx(0.5)
    assert result.trace.stop == "max_rounds"
    assert result.trace.tokens == sum(r.tokens for r in result.trace.rounds)


@pytest.mark.parametrize("policy", ["best", "small", "error"])
async def test_deadline_fallbacks(
    large_engine: LlamaCppEngine, small_engine: LlamaCppEngine, policy: Fallback
) -> None:
    settings = LoopSettings(branches=2, max_rounds=100, token_budget=100_000)
    loop = ReasoningLoop(large_engine, settings, doubtful(), small=small_engine)
    fallback = FallbackSettings(policy=policy, hedge=True)
    started = time.monotonic()
    deadline = started + 2.5
    _, result = await run(loop, deadline=deadline, fallback=fallback)
    finished = time.monotonic()
    trace = result.trace
    assert trace.stop == "deadline"
    assert trace.fallback == policy
    # The loop never overstays: a round it cannot finish is not started, and a round
    # cut by the deadline stops within a token.
    assert finished - deadline < 0.4
    if policy == "error":
        assert result.text == ""
    elif policy == "small":
        assert result.engine == small_engine.name and result.text.strip()
    else:
        assert result.engine == large_engine.name and result.text.strip()
        assert trace.confidence == pytest.approx(0.5)


async def test_a_deadline_already_past_does_no_work(large_engine: LlamaCppEngine) -> None:
    loop = ReasoningLoop(large_engine, LoopSettings(calibrator=None), None)
    _, result = await run(loop, deadline=time.monotonic() - 1)
    assert result.trace.stop == "deadline" and result.trace.rounds == []
    assert result.trace.fallback == "error" and result.trace.tokens == 0


async def test_pruning_stops_low_confidence_branches(large_engine: LlamaCppEngine) -> None:
    # A cut-off above any confidence the model reaches stops every branch after one
    # window, without letting it vote.
    signals = SignalSettings(group_window=2)
    calibrator = Calibrator(
        features=["vote_share"],
        signals=signals,
        mean=[0.0],
        scale=[1.0],
        weights=[0.0],
        bias=0.0,
    )
    settings = LoopSettings(branches=4, max_rounds=1, prune_below=1e9, round_tokens=32)
    loop = ReasoningLoop(large_engine, settings, calibrator)
    question = [Message("user", "Write a long story about a dragon.")]
    result = None
    async for event in loop.run(question, deadline=None):
        if isinstance(event, LoopResult):
            result = event
    assert result is not None
    branches = result.trace.rounds[0].branches
    # A branch can only end sooner by finishing its answer before the loop has seen two
    # tokens: within the first, or with a stop sequence whose tokens are counted but,
    # cut from the text, never shown (" Dragon" then "\n\n" is two tokens, one seen).
    for b in branches:
        assert (b.finish_reason, b.tokens) == ("pruned", 2) or (
            b.finish_reason == "stop" and b.tokens <= 2
        ), b
    assert any(b.finish_reason == "pruned" for b in branches)
    assert all(b.answer is None for b in branches if b.finish_reason == "pruned")


async def test_closing_the_loop_stops_generation(large_engine: LlamaCppEngine) -> None:
    settings = LoopSettings(branches=4, max_rounds=100, token_budget=100_000, round_tokens=200)
    loop = ReasoningLoop(large_engine, settings, doubtful())
    question = [Message("user", "Write a long story about a dragon.")]
    events = loop.run(question, deadline=None)
    first = await anext(events)
    assert isinstance(first, Thinking)
    task = asyncio.ensure_future(anext(events))
    await asyncio.sleep(0.3)  # generating now
    before = large_engine.tokens_generated
    started = time.monotonic()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await events.aclose()
    # Every slot is free again, and no token came after the next one.
    for _ in range(100):
        if not large_engine.busy_slots:
            break
        await asyncio.sleep(0.005)
    assert large_engine.busy_slots == 0
    assert time.monotonic() - started < 0.5
    assert large_engine.tokens_generated - before <= 2


async def test_draft_scores_the_small_answer(
    large_engine: LlamaCppEngine, small_engine: LlamaCppEngine
) -> None:
    loop = ReasoningLoop(large_engine, LoopSettings(), read_calibrator(calibrator_file("bundled")))
    from engines.base import SamplingParams

    generation, probability = await loop.draft(
        small_engine, QUESTION, SamplingParams(max_tokens=32, temperature=0.0), None
    )
    assert generation.engine == small_engine.name and generation.text.strip()
    assert generation.samples[0].logprobs  # the draft asks for what the signals need
    assert 0.0 <= probability <= 1.0


async def test_probes_follow_a_branch_across_rounds(large_engine: LlamaCppEngine) -> None:
    """With probes on, a branch the round's budget cut off goes on next round from its
    own text, and is asked for its answer after each round; probe tokens count."""
    settings = LoopSettings(branches=3, max_rounds=3, round_tokens=4, probes=True)
    loop = ReasoningLoop(large_engine, settings, doubtful())
    # A list that runs on for many tokens: four tokens a round rarely finish it.
    question = [Message("user", "List the numbers from 1 to 100, separated by commas.")]
    result = None
    async for event in loop.run(question, deadline=None):
        if isinstance(event, LoopResult):
            result = event
    assert result is not None
    trace = result.trace
    assert trace.probe_tokens > 0
    assert trace.tokens == sum(r.tokens for r in trace.rounds)
    first = trace.rounds[0].branches
    cut = [b for b in first if b.finish_reason == "length"]
    assert cut and all(b.tokens == 4 and b.probes == 1 for b in cut)
    assert all(b.probes == 0 for b in first if b.finish_reason == "stop")
    # Branches still reasoning in later rounds carry their tokens and probes along.
    later = [b for r in trace.rounds[1:] for b in r.branches if b.probes > 1]
    assert later and all(b.tokens > 4 * (b.probes - 1) for b in later)
    # What they vote is their last probe's answer, and the reply says it.
    assert result.text
