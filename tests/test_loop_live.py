"""bench/loop_live.py's bookkeeping: which questions a run takes
(evaluator.runs.take_per_source), and each question's live outcome against its own
replayed orders. (The live loop itself runs the bundled
1.5B: a benchmark, not a test.)"""

from __future__ import annotations

import math

import pytest

from evaluator.runs import Run, take_per_source
from tests.support import bench_script

loop_live = bench_script("loop_live")


def run(source: str, number: int) -> Run:
    return Run(id=f"{source}-{number}", kind="number", answers=["1"], samples=(), source=source)


def test_a_second_run_skips_the_questions_of_the_first() -> None:
    bank = [run(s, n) for n in range(1, 5) for s in ("arc", "gsm8k")]
    first = take_per_source(bank, 2)
    second = take_per_source(bank, 2, skip=2)
    assert [r.id for r in first] == ["arc-1", "gsm8k-1", "arc-2", "gsm8k-2"]
    assert [r.id for r in second] == ["arc-3", "gsm8k-3", "arc-4", "gsm8k-4"]
    assert take_per_source(bank, 2, skip=4) == []


def test_each_question_is_compared_with_its_own_replayed_orders() -> None:
    live = [
        {"id": "a", "rounds": 1, "correct": True, "confidence": 0.8},
        {"id": "b", "rounds": 4, "correct": False, "confidence": 0.3},
    ]
    replay = [
        {"id": "a", "rounds": 1, "correct": True, "confidence": 0.7},
        {"id": "a", "rounds": 3, "correct": False, "confidence": 0.5},
        {"id": "b", "rounds": 4, "correct": False, "confidence": 0.3},
    ]
    gaps = loop_live.paired(live, replay)
    # a: 1 - 2 = -1 round; b: 0.
    assert gaps["rounds"]["difference"] == pytest.approx(-0.5)
    assert gaps["rounds"]["standard_error"] == pytest.approx(0.5)
    assert gaps["correct"]["difference"] == pytest.approx(0.25)
    assert gaps["confidence"]["difference"] == pytest.approx(0.1)  # a: 0.8 - 0.6; b: 0
    assert math.isnan(loop_live.paired(live[:1], replay)["rounds"]["standard_error"])
