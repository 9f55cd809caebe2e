"""`satisfice evaluator bank`: k samples per labelled question, with logprobs, from a real
engine, into a runs file that the calibrator reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evaluator.runs import read_runs
from tests.support import satisfice


# Slow: `satisfice evaluator bank` loads a model in a process of its own to build
# `make default-calibrator`'s trace bank; the loop's signals are covered on live
# branches in test_loop and test_loop_scripted.
@pytest.mark.slow
@pytest.mark.parametrize("batch", [[], ["--batch"]], ids=["one-by-one", "batched"])
def test_bank_samples_each_question_k_times_with_logprobs(tmp_path: Path, batch: list[str]) -> None:
    dataset = tmp_path / "questions.jsonl"
    questions = [
        {"prompt": "What is 2 plus 3?", "answers": ["5"], "kind": "number", "source": "toy"},
        {"prompt": "Is the sun a star?", "answers": ["yes"], "kind": "yesno", "source": "toy"},
    ]
    dataset.write_text("".join(json.dumps(q) + "\n" for q in questions))
    out = tmp_path / "runs.jsonl"
    result = satisfice(
        "evaluator", "bank", "--dataset", str(dataset), "--out", str(out), "--engine", "small",
        "--samples", "3", "--max-tokens", "6", "--top-logprobs", "2", *batch,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    runs = read_runs(out).runs
    assert [r.id for r in runs] == ["toy-1", "toy-2"]
    assert runs[1].kind == "yesno" and runs[1].answers == ["yes"]
    for run in runs:
        assert len(run.samples) == 3
        for sample in run.samples:
            assert sample.completion_tokens and len(sample.logprobs) == sample.completion_tokens
            assert all(t.logprob <= 0 and len(t.top) == 2 for t in sample.logprobs)
