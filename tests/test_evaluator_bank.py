"""`satisfice evaluator bank`: k samples per labelled question, with logprobs, from a real
engine, into a runs file that the calibrator reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evaluator.answers import LabelledQuestion
from evaluator.bank import banked_so_far
from evaluator.runs import Run, RunSample, read_runs, write_runs
from tests.support import bench_script, satisfice

bank_shards = bench_script("bank_shards")


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
    command = (
        "evaluator", "bank", "--dataset", str(dataset), "--out", str(out), "--engine", "small",
        "--samples", "3", "--max-tokens", "6", "--top-logprobs", "2", *batch,
    )  # fmt: skip
    # The first question, then the rest of the bank resumed after it.
    first = satisfice(*command, "--limit", "1")
    assert first.returncode == 0, first.stderr
    banked = out.read_bytes()
    result = satisfice(*command, "--resume")
    assert result.returncode == 0, result.stderr
    assert "banking from question 2" in result.stderr
    assert out.read_bytes().startswith(banked)
    runs = read_runs(out).runs
    assert [r.id for r in runs] == ["toy-1", "toy-2"]
    assert runs[1].kind == "yesno" and runs[1].answers == ["yes"]
    for run in runs:
        assert len(run.samples) == 3
        for sample in run.samples:
            assert sample.completion_tokens and len(sample.logprobs) == sample.completion_tokens
            assert all(t.logprob <= 0 and len(t.top) == 2 for t in sample.logprobs)


def _question(number: int) -> LabelledQuestion:
    return LabelledQuestion(f"What is {number} plus 1?", [str(number + 1)], "number", "toy")


def _write_bank(path: Path, questions: list[LabelledQuestion]) -> bytes:
    runs = [
        Run(
            id=f"toy-{n}",
            kind="number",
            answers=q.answers,
            samples=(RunSample(text="1"),),
            prompt=q.prompt,
            source=q.source,
        )
        for n, q in enumerate(questions, start=1)
    ]
    write_runs(runs, path)
    return path.read_bytes()


def test_a_bank_resumes_after_its_runs_and_drops_a_line_cut_off(tmp_path: Path) -> None:
    questions = [_question(n) for n in range(5)]
    path = tmp_path / "bank.jsonl"
    assert banked_so_far(path, questions) == 0
    whole = _write_bank(path, questions[:3])
    path.write_bytes(whole + b'{"id": "toy-4", "ki')  # a bank stopped mid-write
    assert banked_so_far(path, questions) == 3
    assert path.read_bytes() == whole


@pytest.mark.parametrize(
    "other",
    [
        [_question(n) for n in (0, 7, 2, 3)],  # a prompt that differs
        [LabelledQuestion(q.prompt, q.answers, q.kind, "other") for q in map(_question, range(4))],
        [_question(n) for n in range(2)],  # fewer questions than runs
    ],
    ids=["prompt", "source", "shorter"],
)
def test_a_bank_is_never_resumed_on_another_dataset(
    tmp_path: Path, other: list[LabelledQuestion]
) -> None:
    path = tmp_path / "bank.jsonl"
    _write_bank(path, [_question(n) for n in range(3)])
    with pytest.raises(ValueError, match=r"bank\.jsonl"):
        banked_so_far(path, other)


def test_shards_hold_each_run_once_and_join_back_into_the_bank(tmp_path: Path) -> None:
    questions = [_question(n) for n in range(5)]
    bank, shards = tmp_path / "bank.jsonl", tmp_path / "shards"
    _write_bank(bank, questions[:2])
    assert bank_shards.main(["pack", str(bank), str(shards)]) == 0
    whole = _write_bank(bank, questions)
    assert bank_shards.main(["pack", str(bank), str(shards)]) == 0
    assert bank_shards.main(["pack", str(bank), str(shards)]) == 0  # nothing new: no shard
    assert [p.name for p in bank_shards.shards(shards)] == [
        "0001-0002.jsonl.xz",
        "0003-0005.jsonl.xz",
    ]
    joined = tmp_path / "joined.jsonl"
    assert bank_shards.main(["unpack", str(shards), str(joined)]) == 0
    assert joined.read_bytes() == whole
    # A bank that does not begin with the shards' runs is not packed onto them.
    _write_bank(bank, questions[1:])
    assert bank_shards.main(["pack", str(bank), str(shards)]) == 2
    assert len(bank_shards.shards(shards)) == 2
