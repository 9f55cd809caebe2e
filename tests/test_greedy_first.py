"""bench/greedy_first.py on a slice of the banks: every arm is computed from the banked
answers, greedy-first's two ends are large greedy and the shipped loop after a greedy
pass, `auto` takes each question's route, and the settings are chosen on the fitting
half."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import numpy as np
import pytest
from msgspec.structs import replace

from engines.base import Message, TokenLogprob, TopLogprob
from engines.scripted import Script, ScriptCall, ScriptedEngine
from evaluator.answers import AnswerKind, extract, is_correct
from evaluator.calibration import (
    Calibrator,
    calibrator_file,
    read_calibrator,
    read_greedy_calibrators,
)
from evaluator.loop import LoopResult, ReasoningLoop
from evaluator.policy import LoopSettings
from evaluator.replay import greedy_first_rule as greedy_replay
from evaluator.replay import replay_loop
from evaluator.runs import RunSample
from evaluator.signals import majority
from gateway.config import load_config
from tests.support import ROOT, bench_script

greedy_first = bench_script("greedy_first")
# msgspec resolves a Struct's annotations through its module in sys.modules.
sys.modules.setdefault("greedy_first", greedy_first)

BANKS = ROOT / "bench" / "banks"
pytestmark = pytest.mark.skipif(
    not (BANKS / "greedy_large" / "arc_challenge.jsonl.xz").exists(),
    reason="no ARC-Challenge greedy bank under bench/banks",
)
N = 40
# (items, the shipped loop settings); the bench module is untyped here.
Slice = tuple[Any, Any]
ORDERS = 2


@pytest.fixture(scope="module")
def slice_() -> Slice:
    config = load_config()
    assert config.loop is not None
    calibrator = read_calibrator(calibrator_file("bundled"))
    runs = greedy_first.bank_runs("arc_challenge")[:N]
    positions = {run.id: i for i, run in enumerate(runs)}
    small = greedy_first.read_greedy_runs(BANKS / "greedy_small" / "arc_challenge.jsonl.xz")
    large = greedy_first.read_greedy_runs(BANKS / "greedy_large" / "arc_challenge.jsonl.xz")
    items = greedy_first.items_of(runs, positions, small, large, calibrator, ORDERS)
    assert len(items) == N
    for item in items:
        item.start_from_greedy(0.5)
    return items, replace(config.loop, greedy_first=False)


def test_the_greedy_and_majority_arms_are_the_banked_answers(slice_: Slice) -> None:
    items, _ = slice_
    large = greedy_first.read_greedy_runs(BANKS / "greedy_large" / "arc_challenge.jsonl.xz")
    right = [is_correct(i.run.question, large[i.run.id].samples[0].text) for i in items]
    arm = greedy_first.arm("large greedy", greedy_first.greedy_arm(items, "large"))
    assert arm.accuracy == sum(right) / N and arm.n == N
    assert arm.low < arm.accuracy < arm.high
    tokens = [large[i.run.id].samples[0].completion_tokens for i in items]
    assert arm.mean_tokens == pytest.approx(np.mean(tokens))
    assert arm.mean_large_tokens == arm.mean_tokens
    small = greedy_first.arm("small greedy", greedy_first.greedy_arm(items, "small"))
    assert small.mean_large_tokens == 0
    # Majority of all 8, in each branch order (a tie goes to the answer seen first).
    eight = greedy_first.arm("k=8", greedy_first.majority_arm(items, 8))
    by_hand = []
    for i in items:
        for q in i.orders:
            samples = q.run.samples
            answer = majority([extract(i.run.kind, s.text) for s in samples])
            texts = [s.text for s in samples if extract(i.run.kind, s.text) == answer]
            by_hand.append(answer is not None and is_correct(i.run.question, texts[0]))
    assert eight.accuracy == pytest.approx(sum(by_hand) / (N * ORDERS))


def test_the_loop_arm_is_replay_loop_and_greedy_first_spans_greedy_to_the_loop(
    slice_: Slice,
) -> None:
    items, settings = slice_
    calibrator = items[0].orders[0].calibrator
    theirs = replay_loop([i.run for i in items], settings, calibrator, ORDERS)
    ours = greedy_first.loop_arm(items, settings)
    for q, o in enumerate(ours):
        mine = [outcome for _, outcome in theirs[q * ORDERS : (q + 1) * ORDERS]]
        assert o.correct == pytest.approx(np.mean([m.correct for m in mine]))
        assert o.tokens == pytest.approx(np.mean([m.tokens for m in mine]))
    rounds = settings.max_rounds
    # Stop 0: every question stops at the greedy pass (P = 0.5 here).
    at_once = greedy_first.greedy_first_arm(items, greedy_first.greedy_first(settings, 0, 0, 4))
    assert at_once == greedy_first.greedy_arm(items, "large")
    # Never stopping at greedy with it out of the vote: the shipped loop, after a greedy
    # pass whose tokens count in the budget.
    never = greedy_first.NEVER
    always = greedy_first.greedy_first_arm(
        items, greedy_first.greedy_first(settings, never, 0.0, rounds)
    )
    for a, o, i in zip(always, ours, items, strict=True):
        assert a.correct == pytest.approx(o.correct)
        assert a.tokens == pytest.approx(o.tokens + i.large.tokens)
    # A heavy greedy vote sides with the greedy answer more often than without it.
    heavy = greedy_first.greedy_first_arm(
        items, greedy_first.greedy_first(settings, never, 100.0, rounds)
    )
    greedy = greedy_first.arm("", greedy_first.greedy_arm(items, "large"))

    def distance(outcomes: Any) -> float:
        return float(abs(greedy_first.arm("", outcomes).accuracy - greedy.accuracy))

    assert distance(heavy) <= distance(always)


def test_auto_takes_each_question_s_route(slice_: Slice) -> None:
    items, _ = slice_
    for i, item in enumerate(items):
        item.score = i / N
    large = greedy_first.greedy_arm(items, "large")
    small = greedy_first.greedy_arm(items, "small")
    routed = greedy_first.auto_arm(items, 0.5, large)
    assert routed == small[: N // 2] + large[N // 2 :]
    assert greedy_first.auto_arm(items, 0.0, large) == large
    # The rule's threshold keeps always-large's accuracy at the fewest large routes.
    reference = greedy_first.arm("", large).accuracy
    threshold = greedy_first.router_threshold(items, large, reference)
    assert greedy_first.arm("", greedy_first.auto_arm(items, threshold, large)).accuracy >= (
        reference
    )
    higher = [s for s in {i.score for i in items} if s > threshold]
    for s in higher:
        assert greedy_first.arm("", greedy_first.auto_arm(items, s, large)).accuracy < reference


def test_settings_are_chosen_on_the_fitting_half_and_every_arm_is_read_held_out(
    slice_: Slice,
) -> None:
    items, settings = slice_
    for i, item in enumerate(items):
        item.score = (i * 7 % N) / N
    fitting, held = items[:20], items[20:]
    report, calibrators = greedy_first.measure(fitting, held, settings, 0.3, folds=2)
    assert set(calibrators) == {"choice"}
    assert report["fitting_questions"] == 20 and report["held_out"]["all"]["questions"] == 20
    arms = report["held_out"]["all"]["arms"]
    assert all(a["n"] == 20 for a in arms)
    names = [a["name"] for a in arms]
    assert names[:2] == ["small greedy", "large greedy"]
    assert sum(n.startswith("majority of") for n in names) == 8
    assert sum(n.startswith("auto") for n in names) == 3
    # The project's rule with greedy as the reference cannot pick anything dearer than
    # greedy itself: stop 0 is greedy's accuracy at greedy's tokens.
    ref = report["fitting_reference"]
    rule = report["rule_choice"]
    assert rule["mean_tokens"] == pytest.approx(ref["mean_tokens"])
    chosen = report["target_choice"]
    assert chosen["mean_tokens"] <= greedy_first.TARGET_TOKENS * ref["mean_tokens"]
    sweep = report["fitting_sweep"]
    assert max(p["accuracy"] for p in sweep) == report["most_accurate_on_fitting"]["accuracy"]
    text = greedy_first.render(report)
    assert "| large greedy |" in text


def test_the_sampling_replay_refuses_greedy_first_settings(slice_: Slice) -> None:
    items, settings = slice_
    calibrator = items[0].orders[0].calibrator
    greedy = replace(settings, greedy_first=True)
    with pytest.raises(ValueError, match="greedy_first_rule"):
        replay_loop([i.run for i in items], greedy, calibrator, ORDERS)
    assert greedy.sampling() == settings


def _script(sample: RunSample) -> Script:
    """A banked sample as the scripted engine replays it, token by token."""
    tokens = tuple(
        TokenLogprob(t.token, t.logprob, tuple(TopLogprob(a.token, a.logprob) for a in t.top))
        for t in sample.logprobs
    )
    return Script(tokens=tokens)


def _live(item: Any, settings: LoopSettings, greedy: dict[AnswerKind, Calibrator]) -> LoopResult:
    """The live loop on a scripted engine that answers with the bank: its greedy pass
    at temperature 0, the question's samples in bank order otherwise."""
    samples = [_script(s) for s in item.run.samples]

    def choose(call: ScriptCall) -> Script:
        if call.params.temperature == 0.0:
            return _script(item.large.sample)
        return samples[call.number - 1]  # the greedy pass was the engine's first

    calibrator = read_calibrator(calibrator_file("bundled"))
    loop = ReasoningLoop(ScriptedEngine(choose), settings, calibrator, greedy_calibrators=greedy)

    async def main() -> LoopResult:
        async for event in loop.run([Message("user", item.run.prompt)], deadline=None):
            if isinstance(event, LoopResult):
                return event
        raise AssertionError("the loop ended without a result")

    return asyncio.run(main())


@pytest.mark.parametrize(
    ("stop", "weight", "rounds"), [(0.3, 0.0, 4), (0.55, 4.0, 3), (1.0, 1.0, 2)]
)
def test_the_live_loop_takes_the_replay_s_decisions(
    stop: float, weight: float, rounds: int
) -> None:
    """What bench/greedy_first.py reports for a setting is what evaluator.loop does with
    it: the same answer after the same number of branches, question by question."""
    config = load_config()
    assert config.loop is not None
    settings = replace(
        config.loop.sampling(),
        greedy_first=True,
        greedy_stop=stop,
        greedy_weight=weight,
        max_rounds=rounds,
        token_budget=100_000,
    )
    greedy = read_greedy_calibrators("bundled")
    calibrator = read_calibrator(calibrator_file("bundled"))
    items = []
    for source, count in (("arc_challenge", 8), ("gsm8k", 3)):
        runs = greedy_first.bank_runs(source)[:count]
        small = greedy_first.read_greedy_runs(BANKS / "greedy_small" / f"{source}.jsonl.xz")
        large = greedy_first.read_greedy_runs(BANKS / "greedy_large" / f"{source}.jsonl.xz")
        positions = {run.id: i for i, run in enumerate(runs)}
        items += greedy_first.items_of(runs, positions, small, large, calibrator, 0)
    rule = greedy_replay(settings, rounds)
    for item in items:
        p = greedy_first.greedy_probabilities([item], greedy)[0]
        item.start_from_greedy(p)
        replayed = rule(item.orders[0])
        live = _live(item, settings, greedy)
        assert extract(item.run.kind, live.text) == replayed.answer, item.run.id
        branches = sum(len(r.branches) for r in live.trace.rounds)
        assert branches == replayed.branches, item.run.id
