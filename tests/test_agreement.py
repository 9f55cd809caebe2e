"""The shadow checks' comparator: same answer or not, per kind, on replies as models
write them; and, where the public data is present, its accuracy on labelled pairs."""

from __future__ import annotations

import time
from pathlib import Path
from types import ModuleType

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evaluator.agreement import MAX_TEXT_WORDS, TEXT_F1, Agreement, compare
from tests.support import bench_script

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data"

APPLES = "Tom has 40 apples and gives away 2. How many apples does he have left?"
OPTIONS = (
    "Which gas do plants take in?\nA. Oxygen\nB. Carbon dioxide\nC. Helium\nD. Neon\n"
    "Answer with the letter."
)
YESNO = "Is Paris the capital of France? Answer yes or no."
TRIVIA = "Which city is the capital of France?"


def needs_data(folder: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(
        not (DATA / folder).is_dir(),
        reason=f"public data ../shared/data/{folder} is not present next to the project",
    )


# --- numbers ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "reference", "agree"),
    [
        ("The answer is 42.", "#### 42", True),
        ("So he has 40 - 2 = 38 apples left.\n#### 38", "He has $38.00 left.", True),
        ("The answer is 42.", "The answer is 43.", False),
        ("1,000", "1000", True),
        ("0.5", "1/2", True),
        ("Answer: 9 * 2 = 18", "\\boxed{18}", True),
        ("-7", "7", False),
    ],
)
def test_numbers(answer: str, reference: str, agree: bool) -> None:
    verdict = compare(APPLES, answer, reference)
    assert verdict.kind == "number"
    assert verdict.agree is agree


def test_numbers_are_extracted_to_one_spelling() -> None:
    assert compare(APPLES, "It costs $1,234.50.", "#### 1234.5") == Agreement(
        "number", True, "1234.5", "1234.5"
    )


def test_an_answer_without_a_number_cannot_be_told() -> None:
    verdict = compare(APPLES, "I am not sure how to solve this.", "#### 38")
    assert verdict == Agreement("number", None, None, "38")


# --- choices, yes/no -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "reference", "agree"),
    [
        ("(B)", "The answer is B", True),
        ("B", "B. Carbon dioxide", True),
        ("(B)", "C", False),
        ("Answer: D", "The answer is (A).", False),
    ],
)
def test_choices(answer: str, reference: str, agree: bool) -> None:
    verdict = compare(OPTIONS, answer, reference)
    assert verdict.kind == "choice"
    assert verdict.agree is agree


def test_a_choice_reply_with_no_letter_cannot_be_told() -> None:
    # Claude v2's reply to one RouterBench question in six.
    assert compare(OPTIONS, "I do", "B") == Agreement("choice", None, None, "B")


@pytest.mark.parametrize(
    ("answer", "reference", "agree"),
    [
        ("Yes, it is.", "yes", True),
        ("True", "Yes.", True),
        ("No.", "Yes, Paris is the capital.", False),
        ("The answer is: no", "false", True),
    ],
)
def test_yes_or_no(answer: str, reference: str, agree: bool) -> None:
    verdict = compare(YESNO, answer, reference)
    assert verdict.kind == "yesno"
    assert verdict.agree is agree


# --- free text -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "reference", "agree"),
    [
        ("Paris", "Paris, France.", True),  # the shorter, whole, in the longer
        ("The Beatles", "beatles", True),  # articles and case normalised away
        ("Paris", "Lyon", False),
        ("Parisian", "Paris", False),  # whole words only
        ("New York City", "New Jersey Turnpike", False),  # F1 1/3: below the threshold
        ("Eleanor Rigby song", "Eleanor Rigby", True),
    ],
)
def test_free_text(answer: str, reference: str, agree: bool) -> None:
    verdict = compare(TRIVIA, answer, reference)
    assert verdict.kind == "text"
    assert verdict.agree is agree


def test_the_text_threshold_is_inclusive() -> None:
    # F1 of "john paul jones" and "john smith": 2 * (1/3 * 1/2) / (1/3 + 1/2) = 0.4.
    assert TEXT_F1 == 0.4
    assert compare(TRIVIA, "John Paul Jones", "John Smith").agree is True


def test_long_free_text_is_not_judged() -> None:
    long = " ".join(["word"] * (MAX_TEXT_WORDS + 1))
    verdict = compare(TRIVIA, long, long)
    assert verdict.kind == "text"
    assert verdict.agree is None
    # At the limit it still is.
    short = " ".join(["word"] * MAX_TEXT_WORDS)
    assert compare(TRIVIA, short, short).agree is True


def test_empty_text_cannot_be_told() -> None:
    assert compare(TRIVIA, "...", "Paris") == Agreement("text", None, None, "paris")


# --- the kind --------------------------------------------------------------------------


def test_a_given_kind_wins_over_the_question() -> None:
    verdict = compare(TRIVIA, "It is 12.", "12", kind="text")
    assert verdict.kind == "text"
    assert verdict.agree is True  # "12" inside "it is 12"


@pytest.mark.parametrize(
    ("answer", "reference", "kind"),
    [
        ("I got 12.", "#### 12", "number"),
        ("B", "(B)", "choice"),
        ("Yes.", "yes, certainly", "yesno"),
        ("Paris", "Lyon", "text"),
        ("The answer is Paris", "The answer is Lyon", "text"),  # a marker, no number
    ],
)
def test_the_kind_falls_back_on_the_replies(answer: str, reference: str, kind: str) -> None:
    assert compare("What did you get?", answer, reference).kind == kind


def test_a_question_that_only_reads_as_yes_or_no_is_compared_as_text() -> None:
    # infer_kind takes "Can you ...?" for a yes/no question; these replies are not.
    question = "Can you name the capital of France?"
    verdict = compare(question, "The capital of France is Paris.", "Paris")
    assert verdict.kind == "text"
    assert verdict.agree is True


def test_an_agreement_is_a_struct_that_encodes() -> None:
    verdict = compare(APPLES, "#### 38", "38")
    assert msgspec.json.decode(msgspec.json.encode(verdict), type=Agreement) == verdict
    with pytest.raises(AttributeError):
        verdict.agree = False  # type: ignore[misc]


# --- properties ------------------------------------------------------------------------

replies = st.text(alphabet=st.sampled_from("ab AB()$#.,:-/\n0123456789yesno"), max_size=40)
questions = st.sampled_from([APPLES, OPTIONS, YESNO, TRIVIA, "What did you get?"])


@settings(max_examples=300, deadline=None)
@given(questions, replies)
def test_a_reply_never_disagrees_with_itself(question: str, reply: str) -> None:
    assert compare(question, reply, reply).agree is not False


@settings(max_examples=300, deadline=None)
@given(questions, replies, replies)
def test_agreement_is_symmetric(question: str, a: str, b: str) -> None:
    forward, backward = compare(question, a, b), compare(question, b, a)
    assert forward.kind == backward.kind
    assert forward.agree == backward.agree
    assert (forward.answer, forward.reference) == (backward.reference, backward.answer)


def test_hostile_replies_stay_cheap() -> None:
    # A digit, then a long run of spaces or punctuation: a pattern that backtracks over
    # the run (as \d\s*%?\W*$ would) takes minutes on these.
    start = time.perf_counter()
    for run in (" " * 50_000, " ." * 50_000):
        hostile = f"1{run}x"
        compare("What did you get?", hostile, hostile + "1")
        compare(APPLES, hostile, "#### " + hostile)
    assert time.perf_counter() - start < 2.0


# --- on the public labelled pairs ------------------------------------------------------


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return bench_script("comparator_accuracy")


@needs_data("routellm_gsm8k")
def test_numbers_on_gsm8k_pairs(bench: ModuleType) -> None:
    judged, _ = bench.judge(bench.routellm_gsm8k(DATA))
    figures = bench.score(judged)
    assert figures["labelled"] > 1000
    assert figures["undecided"] < 20
    assert figures["accuracy"]["rate"] > 0.95
    assert figures["false_disagree"]["rate"] < 0.02


@needs_data("routerbench_subset")
def test_choices_on_routerbench_pairs(bench: ModuleType) -> None:
    load = bench.routerbench("arc_challenge_test", "choice")
    figures = bench.score(bench.judge(load(DATA))[0])
    assert figures["labelled"] > 400
    assert figures["accuracy"]["rate"] > 0.99


@needs_data("triviaqa")
@needs_data("nq_open")
def test_the_shipped_text_rule_is_the_one_fitted(bench: ModuleType) -> None:
    notes: list[str] = []
    rows, fitted = bench.text_rows(DATA, 0, notes)
    assert fitted["matches_shipped"], fitted["candidates"][:3]
    pooled = bench.score([j for row in rows for j in row.judged])
    # Held out; the labels are gold aliases, many sharing no word (see the bench).
    assert pooled["accuracy"]["rate"] > 0.7
    assert pooled["false_agree"]["rate"] < 0.06
