"""`satisfice eval collect` with a real engine: it writes the router's typed outcome
records, which `router fit` reads, as it reads the plain three-field lines."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec

from router.outcomes import Outcome, read_outcomes


def test_collect_writes_outcomes_with_both_answers(tmp_path: Path) -> None:
    dataset = tmp_path / "questions.jsonl"
    questions = [
        {"prompt": "What is 2 plus 3?", "answers": ["5"], "kind": "number", "source": "toy"},
        {"prompt": "Is the sun a star?", "answers": ["yes"], "kind": "yesno"},
    ]
    dataset.write_text("".join(json.dumps(q) + "\n" for q in questions))
    out = tmp_path / "outcomes.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "eval", "collect", "--dataset", str(dataset),
         "--out", str(out), "--small", "small", "--large", "small", "--max-tokens", "6"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    outcomes = read_outcomes(out).outcomes
    assert [o.prompt for o in outcomes] == [q["prompt"] for q in questions]
    assert [o.source for o in outcomes] == ["toy", ""]
    for outcome in outcomes:
        # The same engine, greedy, twice: the same answer, graded the same.
        assert outcome.small_output and outcome.small_output == outcome.large_output
        assert outcome.small_correct == outcome.large_correct
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert "source" not in lines[1]  # an empty default is left out


def test_an_outcome_without_the_collected_fields_is_the_three_field_line() -> None:
    line = b'{"prompt":"p","small_correct":true,"large_correct":0.5}'
    outcome = msgspec.json.decode(line, type=Outcome)
    assert (outcome.source, outcome.small_output, outcome.large_output) == ("", None, None)
    assert msgspec.json.encode(outcome) == line
