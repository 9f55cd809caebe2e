"""bench/vote_patterns.py: the best stop that reads only the vote, by backward induction
over the rounds, and the bench on a tiny bank."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.support import ROOT, bench_script
from tests.test_loop_replay import synthetic_bank

vote_patterns = bench_script("vote_patterns")

UNANIMOUS = (1, (2,), 0)
SPLIT = (1, (1, 1), 0)


def cases() -> list[Any]:
    """Three questions of two rounds of 10 tokens: one unanimous and right from the
    start; two split after round 1, of which one is put right by round 2."""
    Case = vote_patterns.Case
    return [
        Case(patterns=[UNANIMOUS, (2, (4,), 0)], right=[True, True], tokens=[10, 10]),
        Case(patterns=[SPLIT, (2, (3, 1), 0)], right=[False, True], tokens=[10, 10]),
        Case(patterns=[SPLIT, (2, (2, 2), 0)], right=[False, False], tokens=[10, 10]),
    ]


def test_a_free_token_draws_on_wherever_it_can_help() -> None:
    stop = vote_patterns.best_rule(cases(), 2, 0.0)
    assert stop == {UNANIMOUS}
    outcome = vote_patterns.play(cases(), stop)
    assert (outcome.accuracy, outcome.tokens) == (2 / 3, 50 / 3)


def test_a_dear_token_stops_where_another_round_gains_less_than_it_costs() -> None:
    # Drawing on puts half the split questions right (0.5) for 10 tokens.
    assert vote_patterns.best_rule(cases(), 2, 0.04) == {UNANIMOUS}
    assert vote_patterns.best_rule(cases(), 2, 0.06) == {UNANIMOUS, SPLIT}
    outcome = vote_patterns.play(cases(), {UNANIMOUS, SPLIT})
    assert (outcome.accuracy, outcome.tokens) == (1 / 3, 10.0)


def test_the_bench_runs_on_a_tiny_bank(tmp_path: Path) -> None:
    bank = tmp_path / "bank.jsonl"
    synthetic_bank(bank)
    script = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "vote_patterns.py"), "--runs", str(bank)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert script.returncode == 0, script.stderr
    assert "reference: 50.0% right, 16.0 tokens" in script.stdout
    assert "the best vote-only rule" in script.stdout
