"""bench/convert_datasets.py on the real public data: every row it writes must grade."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from evaluator.answers import LabelledQuestion, extract, is_correct, read_questions

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / ".." / "shared" / "data"
SCRIPT = ROOT / "bench" / "convert_datasets.py"
SOURCES = [
    "gsm8k",
    "multiarith",
    "addsub",
    "singleeq",
    "simple_arithmetic",
    "arc_easy",
    "arc_challenge",
    "openbookqa",
    "mmlu_stem",
    "boolq",
    "triviaqa",
    "nq_open",
]
KINDS = {
    "gsm8k": "number",
    "multiarith": "number",
    "addsub": "number",
    "singleeq": "number",
    "simple_arithmetic": "number",
    "arc_easy": "choice",
    "arc_challenge": "choice",
    "openbookqa": "choice",
    "mmlu_stem": "choice",
    "boolq": "yesno",
    "triviaqa": "text",
    "nq_open": "text",
}
INSTRUCTIONS = {
    "number": "Answer with the number only.",
    "choice": "Answer with the letter only.",
    "yesno": "Answer yes or no.",
    "text": "Answer in a few words.",
}

pytestmark = pytest.mark.skipif(
    not DATA.is_dir(),
    reason="the public data folder ../shared/data (from the project root) is not here",
)


def convert(out: Path, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), "--data", str(DATA), *args],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout


@pytest.fixture(scope="module")
def every_row(tmp_path_factory: pytest.TempPathFactory) -> list[LabelledQuestion]:
    """All rows of all sources: a per-source limit above the largest set."""
    out = tmp_path_factory.mktemp("convert") / "all.jsonl"
    convert(out, "--per-source", "1000000")
    return read_questions(out)


def test_every_source_present_with_its_kind(every_row: list[LabelledQuestion]) -> None:
    counts = Counter(question.source for question in every_row)
    assert set(counts) == set(SOURCES)
    # Only a few rows go (repeats, ungradeable gold); most of each set survives.
    assert all(count >= 300 for count in counts.values()), counts
    for question in every_row:
        assert question.kind == KINDS[question.source]
        assert question.prompt.endswith(INSTRUCTIONS[question.kind])


def test_every_gold_answer_grades_correct(every_row: list[LabelledQuestion]) -> None:
    wrong = [q for q in every_row if not all(is_correct(q, gold) for gold in q.answers)]
    assert wrong == []


def _wrong_answer(question: LabelledQuestion) -> str:
    match question.kind:
        case "number":
            gold = float(question.answers[0])
            return str(gold * 2 + 1)
        case "choice":
            return "E" if question.answers[0] != "E" else "A"
        case "yesno":
            return "no" if question.answers[0] == "yes" else "yes"
        case "text":
            return "xyzzy plugh"


def test_a_wrong_answer_grades_incorrect(every_row: list[LabelledQuestion]) -> None:
    right = [q for q in every_row if is_correct(q, _wrong_answer(q))]
    assert right == []


def test_gold_answers_are_stored_normalised(every_row: list[LabelledQuestion]) -> None:
    for question in every_row:
        if question.kind != "text":
            assert question.answers == [extract(question.kind, question.answers[0])]
            assert len(question.answers) == 1


def test_choices_are_lettered_in_the_prompt(every_row: list[LabelledQuestion]) -> None:
    for question in every_row:
        if question.kind == "choice":
            assert f"\n{question.answers[0]}. " in question.prompt
            assert "\nA. " in question.prompt and "\nB. " in question.prompt
            assert "Answer1:" not in question.prompt


def test_no_prompt_repeats(every_row: list[LabelledQuestion]) -> None:
    counts = Counter(" ".join(q.prompt.lower().split()) for q in every_row)
    assert [prompt for prompt, count in counts.items() if count > 1] == []


def test_sampling_is_reproducible_and_per_source(tmp_path: Path) -> None:
    first, again, other = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    printed = convert(first, "--per-source", "7", "--sources", "gsm8k,boolq,nq_open")
    convert(again, "--per-source", "7", "--sources", "gsm8k,boolq,nq_open")
    convert(other, "--per-source", "7", "--sources", "boolq", "--seed", "1")
    assert first.read_bytes() == again.read_bytes()
    rows = read_questions(first)
    assert Counter(q.source for q in rows) == {"gsm8k": 7, "boolq": 7, "nq_open": 7}
    assert all(name in printed for name in ("gsm8k", "boolq", "nq_open"))
    # A source's sample depends on the seed, not on which other sources were asked for.
    boolq = [q for q in rows if q.source == "boolq"]
    alone = tmp_path / "d.jsonl"
    convert(alone, "--per-source", "7", "--sources", "boolq")
    assert read_questions(alone) == boolq
    assert read_questions(other) != boolq


def test_then_rest_follows_the_sample_with_every_other_question(tmp_path: Path) -> None:
    """A bank of the sample resumes into a bank of the whole set: the sample comes first,
    unchanged, then the rest of the source in file order, each question once."""
    sampled, whole, every = tmp_path / "s.jsonl", tmp_path / "w.jsonl", tmp_path / "e.jsonl"
    convert(sampled, "--per-source", "30", "--seed", "2", "--sources", "singleeq")
    convert(whole, "--per-source", "30", "--seed", "2", "--sources", "singleeq", "--then-rest")
    convert(every, "--per-source", "1000000", "--sources", "singleeq")
    head, rows, all_rows = read_questions(sampled), read_questions(whole), read_questions(every)
    assert rows[:30] == head
    assert sorted(q.prompt for q in rows) == sorted(q.prompt for q in all_rows)
    rest = rows[30:]
    assert rest == [q for q in all_rows if q not in head]


def test_unknown_source_is_refused(tmp_path: Path) -> None:
    with pytest.raises(subprocess.CalledProcessError) as caught:
        subprocess.run(
            [sys.executable, str(SCRIPT), "--out", str(tmp_path / "x"), "--sources", "squad"],
            capture_output=True,
            text=True,
            check=True,
        )
    assert "unknown sources ['squad']" in caught.value.stderr
