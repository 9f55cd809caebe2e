"""The loop's pure decisions: the weighted vote, DeepConf's filter, the stop rules, and
reading what kind of answer a question wants."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from engines.base import Sample, Timings, TokenLogprob, TopLogprob
from evaluator.answers import LabelledQuestion, infer_kind, read_questions
from evaluator.calibration import Calibrator
from evaluator.policy import LoopSettings, Verdict, stop_reason, tally
from evaluator.signals import SignalSettings

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
ONE = SignalSettings(top_k=1, group_window=2)


def branch(text: str, *confidences: float) -> Sample:
    """A branch whose tokens have exactly these token confidences (top_k=1)."""
    tokens = tuple(TokenLogprob("t", -0.1, (TopLogprob("a", -c),)) for c in confidences)
    return Sample(
        index=0,
        text=text,
        finish_reason="stop",
        completion_tokens=len(tokens),
        logprobs=tokens,
        timings=Timings(0.0, None, 0.0),
    )


def test_confident_minority_outweighs_unsure_majority() -> None:
    branches = [branch("Paris", 9.0, 9.0), branch("Lyon", 1.0, 1.0), branch("Lyon", 1.0, 1.0)]
    verdict = tally("text", branches, ["paris", "lyon", "lyon"], settings=ONE)
    assert verdict.answer == "paris"  # 9 against 1 + 1
    assert verdict.signals.votes == 1 and verdict.signals.samples == 3
    assert verdict.probability == pytest.approx(1 / 3)  # the vote share, uncalibrated
    assert verdict.text == "Paris"


def test_filter_leaves_out_low_confidence_branches() -> None:
    branches = [branch("Paris", 9.0, 9.0), branch("Lyon", 1.0, 1.0), branch("Lyon", 1.0, 1.0)]
    verdict = tally("text", branches, ["paris", "lyon", "lyon"], settings=ONE, prune_below=5.0)
    assert verdict.kept == 1 and verdict.pruned == 2
    assert verdict.probability == 1.0
    # A filter that would leave nothing lets every branch vote.
    everyone = tally("text", branches, ["paris", "lyon", "lyon"], settings=ONE, prune_below=99.0)
    assert everyone.kept == 3 and everyone.pruned == 0


def test_equal_weights_go_to_the_first_answer_seen() -> None:
    branches = [branch("no"), branch("yes")]
    verdict = tally("yesno", branches, ["no", "yes"], settings=ONE)
    assert verdict.answer == "no"
    assert verdict.signals.votes == 1 and verdict.signals.runner_up == 1


def test_calibrator_gives_the_probability() -> None:
    # A calibrator that reads only the vote share, with a slope and offset chosen so
    # that P = sigmoid(4 * (share - 0.5)).
    calibrator = Calibrator(
        features=["vote_share"],
        signals=ONE,
        mean=[0.5],
        scale=[1.0],
        weights=[4.0],
        bias=0.0,
    )
    branches = [branch("4", 3.0), branch("4", 3.0), branch("5", 3.0), branch("4", 3.0)]
    verdict = tally("number", branches, ["4", "4", "5", "4"], calibrator=calibrator)
    assert verdict.answer == "4"
    assert verdict.probability == pytest.approx(1 / (1 + pow(2.718281828459045, -1.0)))


def test_no_answer_means_no_confidence_and_missing_logprobs_fall_back() -> None:
    calibrator = Calibrator(
        features=["vote_share", "mean_confidence"],
        signals=ONE,
        mean=[0.0, 0.0],
        scale=[1.0, 1.0],
        weights=[0.0, 0.0],
        bias=5.0,  # P = 0.99 for anything it can read
    )
    empty = tally("number", [branch(""), branch("")], [None, None], calibrator=calibrator)
    assert empty.answer is None and empty.probability == 0.0
    # Branches without logprobs: the calibrator cannot read them; the vote share stands in.
    bare = tally("number", [branch("4"), branch("5")], ["4", "5"], calibrator=calibrator)
    assert bare.answer == "4" and bare.probability == 0.5


def test_kind_is_a_feature() -> None:
    verdict = tally("yesno", [branch("yes", 1.0)], ["yes"], settings=ONE)
    assert verdict.signals.features(["kind_choice", "kind_yesno", "kind_number"]) == [0, 1, 0]


def _verdict(probability: float, answer: str | None = "x") -> Verdict:
    verdict = tally("text", [branch("x")], ["x"], settings=ONE)
    return Verdict(
        answer=answer,
        text="x",
        probability=probability,
        signals=verdict.signals,
        kept=1,
        pruned=0,
    )


SETTINGS = LoopSettings(
    threshold=0.8, max_rounds=3, token_budget=100, calibrator=None, min_gain=0.05
)


@pytest.mark.parametrize(
    ("verdict", "rounds", "tokens", "next_tokens", "left_s", "next_s", "expected"),
    [
        (_verdict(0.9), 1, 10, 10, None, None, "confident"),
        (_verdict(0.9, answer=None), 1, 10, 10, None, None, None),  # no answer to trust
        (None, 1, 10, 10, None, None, None),
        (_verdict(0.5), 3, 10, 10, None, None, "max_rounds"),
        (_verdict(0.5), 2, 80, 30, None, None, "token_budget"),
        (_verdict(0.5), 2, 80, 20, None, None, None),  # exactly the budget still fits
        (_verdict(0.5), 1, 10, 10, 0.0, 0.1, "deadline"),
        (_verdict(0.5), 1, 10, 10, 0.3, 0.5, "deadline"),  # the next round cannot finish
        (_verdict(0.5), 1, 10, 10, 0.6, 0.5, None),
    ],
)
def test_stop_reason(
    verdict: Verdict | None,
    rounds: int,
    tokens: int,
    next_tokens: float,
    left_s: float | None,
    next_s: float | None,
    expected: str | None,
) -> None:
    got = stop_reason(
        verdict,
        rounds=rounds,
        tokens=tokens,
        next_round_tokens=next_tokens,
        settings=SETTINGS,
        time_left_s=left_s,
        next_round_s=next_s,
    )
    assert got == expected


@pytest.mark.parametrize(
    ("before", "after", "expected"),
    [(0.3, 0.32, "no_gain"), (0.3, 0.4, None), (0.5, 0.4, "no_gain")],
)
def test_a_round_that_changes_nothing_ends_the_loop(
    before: float, after: float, expected: str | None
) -> None:
    got = stop_reason(
        _verdict(after),
        rounds=2,
        tokens=10,
        next_round_tokens=10,
        settings=SETTINGS,
        previous=_verdict(before),
    )
    assert got == expected


def test_hard_questions_get_more_branches() -> None:
    settings = LoopSettings(branches=4, hard_branches=8, hard_difficulty=0.9)
    assert settings.branches_for(None) == 4
    assert settings.branches_for(0.5) == 4
    assert settings.branches_for(0.95) == 8
    assert LoopSettings(branches=4).branches_for(0.99) == 4


@pytest.mark.parametrize(
    ("question", "kind"),
    [
        ("Which is a gas?\nA. iron\nB. steam\nC. wood\n\nAnswer with the letter only.", "choice"),
        ("Is the sun a star?", "yesno"),
        ("Can fish breathe air?\n\nAnswer yes or no.", "yesno"),
        ("How many legs does a spider have?", "number"),
        ("What is 17 + 25?", "number"),
        ("25-759=", "number"),
        ("Who wrote Hamlet?", "text"),
        ("What is the capital of Spain?", "text"),
        # Word problems ask for quantities in more ways than "how many".
        ("Bo has 40 crabs and Al twice that. Calculate the total number of crabs.", "number"),
        ("She earns $20 an hour for 35 hours a week. What's her weekly salary?", "number"),
        ("Of 80 votes the winner got 3/4. What percentage did the loser get?", "number"),
        ("Albert is 36 inches tall. How tall was Jackie?", "number"),
        # ... but the same words without a numeral to work with are not one.
        ("What is the average lifespan of a house cat?", "text"),
        ("What change was made to the logo?", "text"),
    ],
)
def test_infer_kind(question: str, kind: str) -> None:
    assert infer_kind(question) == kind


def test_a_word_problem_after_a_long_preamble_still_asks_for_a_number() -> None:
    """Only the question's tail is read for a quantity (it asks at its end), and a
    preamble longer than that tail does not hide the ask."""
    preamble = "Some context that asks for nothing. " * 200
    assert infer_kind(preamble + "Bo has 40 crabs. Calculate the total number of crabs.") == (
        "number"
    )
    assert infer_kind("Calculate the total of 3 and 4. " + preamble) == "text"


def public_questions(sources: str, per_source: int, *flags: str) -> list[LabelledQuestion]:
    """Questions of the shared public sets as bench/convert_datasets.py writes them;
    the test skips where the data is not here."""
    if not SHARED.is_dir():
        pytest.skip(f"{SHARED} is not here (the shared evaluation data)")
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "questions.jsonl"
        subprocess.run(
            [sys.executable, "bench/convert_datasets.py", "--data", str(SHARED),
             "--per-source", str(per_source), "--sources", sources, *flags, "--out", str(out)],
            check=True, capture_output=True, cwd=Path(__file__).resolve().parents[1],
        )  # fmt: skip
        return read_questions(out)


def test_infer_kind_reads_the_public_sets_as_their_graders_do() -> None:
    questions = public_questions("arc_easy,boolq,simple_arithmetic,multiarith,gsm8k,triviaqa", 100)
    agree = sum(infer_kind(q.prompt) == q.kind for q in questions)
    # TriviaQA's "how many ..." questions read as numbers, which is what they ask.
    assert agree / len(questions) >= 0.97


def test_infer_kind_reads_word_problems_as_a_user_asks_them_as_numbers() -> None:
    """As a user asks them (no "answer with the number only"), the question alone must
    say that a number is wanted, or the loop votes on whole sentences."""
    questions = public_questions("gsm8k,multiarith,addsub,singleeq", 300, "--as-asked")
    numbers = sum(infer_kind(q.prompt) == "number" for q in questions)
    assert numbers / len(questions) >= 0.98
