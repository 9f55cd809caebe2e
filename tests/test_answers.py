"""Answer extraction and grading on outputs the way small chat models write them."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from evaluator.answers import (
    LabelledQuestion,
    QuestionFileError,
    extract,
    is_correct,
    normalise_text,
    read_questions,
)

JANET = (
    "Janet's ducks lay 16 eggs per day. She eats 3 for breakfast and bakes muffins "
    "with 4. She sells the rest at $2 per egg. How much does she make every day?"
)


def number(gold: str) -> LabelledQuestion:
    return LabelledQuestion(JANET, [gold], "number", "gsm8k")


# --- numbers ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        ("18", "18"),
        ("18.0", "18"),
        ("18.00", "18"),
        ("$18", "18"),
        ("18 dollars", "18"),
        ("$18.", "18"),
        ("1,234", "1234"),
        ("$1,450,000", "1450000"),
        ("-734", "-734"),
        ("The result is -5.", "-5"),
        ("It costs -$5 in the end", "-5"),
        ("3/4", "0.75"),
        ("0.5", "0.5"),
        (".5 of a mile", "0.5"),
        ("12.30", "12.3"),
        ("**18**", "18"),
        ("\\boxed{42}", "42"),
        ("#### 2,125", "2125"),
        # Reasoning: the final number is the result.
        (
            "Janet sells 16 - 3 - 4 = 9 duck eggs a day.\n"
            "She makes 9 * 2 = $18 every day at the farmer's market.",
            "18",
        ),
        ("16-3-4=9 eggs left, and 9*2=18.", "18"),
        ("25-759=-734", "-734"),
        # An answer marker beats the final number.
        ("The answer is 18. She sold 9 eggs at 2 dollars each.", "18"),
        ("Answer: $18 (from 9 eggs at $2)", "18"),
        ("The answer is: 1,234.", "1234"),
        ("Final answer: 7\nCheck: 3 + 4 = 7, and 14 / 2 = 7 too, so 7 of 10", "7"),
        ("First I thought the answer is 5. Wait: 2 + 4 = 6. The answer is 6.", "6"),
        # A marker with no number on its line falls back to the final number.
        ("The answer is:\nLet's see, 16 - 7 = 9 and 9 * 2 = 18", "18"),
        ("Answer: eighteen, since 9 * 2 = 18", "18"),
        # An answer that opens with its working ends with the result.
        ("Answer: 9 * 2 = 18", "18"),
        ("The answer is 16 - 3 - 4 = 9, 9 * 2 = $18 a day", "18"),
        ("The answer is 18 (16 - 3 - 4 = 9 eggs at $2)", "18"),
    ],
)
def test_extract_number(output: str, expected: str) -> None:
    assert extract("number", output) == expected


@pytest.mark.parametrize("output", ["", "I don't know.", "eighteen", "x2 and Answer3"])
def test_extract_number_none(output: str) -> None:
    assert extract("number", output) is None


def test_number_minus_between_numbers_is_subtraction() -> None:
    # "16-3" is a difference, not 16 followed by -3.
    assert extract("number", "16-3") == "3"
    assert extract("number", "16 - 3") == "3"


def test_number_grading() -> None:
    question = number("18")
    assert is_correct(question, "She makes 9 * 2 = $18 every day.")
    assert is_correct(question, "18.0")
    assert is_correct(question, "The answer is $18.00.")
    assert not is_correct(question, "16 - 3 - 4 = 9, so she sells 9 eggs.")
    assert not is_correct(question, "The answer is 9, since 9 * 2 = 18")
    assert not is_correct(question, "I cannot tell.")
    assert not is_correct(question, "")


def test_number_gold_in_file_form_grades() -> None:
    # Gold as a dataset writes it ("2,125", "43", 39.0) goes through the same extraction.
    assert is_correct(number("2,125"), "2125")
    assert is_correct(number("39.0"), "The answer is 39")
    assert is_correct(number("0.6666666666666666"), "2/3")
    assert is_correct(number("0.6666666666666666"), "0.6666667")
    assert not is_correct(number("0.6666666666666666"), "0.67")


def test_number_tolerance_is_relative() -> None:
    assert is_correct(number("1000000"), "1000000.5")
    assert not is_correct(number("1000000"), "1000002")
    assert is_correct(number("0"), "0.0")
    assert not is_correct(number("0"), "0.000001")


def test_any_gold_answer_counts() -> None:
    question = LabelledQuestion("?", ["18", "20"], "number")
    assert is_correct(question, "20")
    assert not is_correct(question, "19")


# --- choices ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        ("B", "B"),
        ("b", "B"),
        ("B.", "B"),
        ("(B)", "B"),
        ("(b)", "B"),
        ("The answer is (B).", "B"),
        ("The answer is B.", "B"),
        ("the correct answer is answer2", "B"),
        ("Answer2", "B"),
        ("Answer: C", "C"),
        ("**Answer:** D", "D"),
        ("Option c", "C"),
        ("I would pick choice 4.", "D"),
        ("B. breathing mask", "B"),
        ("B) breathing mask, because mold spores are breathed in through the nose.", "B"),
        ("I think it is D", "D"),
        ("answer is e.", "E"),
        # The last stated answer wins over the reasoning before it.
        ("A is wrong since goggles protect eyes. The answer is B.", "B"),
    ],
)
def test_extract_choice(output: str, expected: str) -> None:
    assert extract("choice", output) == expected


@pytest.mark.parametrize(
    "output",
    [
        "",
        "a breathing mask",
        "The answer is a breathing mask.",
        "I think you should wear a mask when there is mold, since spores are small.",
        "F",
    ],
)
def test_extract_choice_none(output: str) -> None:
    # "a" is an article and a capital in a long sentence is a word, not a choice.
    assert extract("choice", output) is None


def test_choice_grading() -> None:
    question = LabelledQuestion("Which...?\n\nA. goggles\nB. mask", ["B"], "choice", "arc")
    assert is_correct(question, "The answer is (B).")
    assert is_correct(question, "b")
    assert not is_correct(question, "A")
    assert not is_correct(question, "breathing mask")
    # Gold as LLM-Adapters writes it.
    assert is_correct(LabelledQuestion("?", ["answer2"], "choice"), "B")


# --- yes/no ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        ("true", "yes"),
        ("True.", "yes"),
        ("Yes", "yes"),
        ("yes, it is.", "yes"),
        ("false", "no"),
        ("No.", "no"),
        ("No, ethanol does not produce more energy than it takes.", "no"),
        ("There is no doubt: yes.", "no"),  # first occurrence, as documented
        ("Is it true? The answer is no.", "no"),  # but a stated answer wins
        ("Answer: False", "no"),
    ],
)
def test_extract_yesno(output: str, expected: str) -> None:
    assert extract("yesno", output) == expected


@pytest.mark.parametrize("output", ["", "Maybe.", "It depends on the notion of truth", "yesterday"])
def test_extract_yesno_none(output: str) -> None:
    assert extract("yesno", output) is None


def test_yesno_grading() -> None:
    question = LabelledQuestion("Is house tax the same as property tax?", ["yes"], "yesno")
    assert is_correct(question, "true")
    assert is_correct(question, "Yes, they are the same.")
    assert not is_correct(question, "No.")
    assert not is_correct(question, "I am not sure.")
    assert is_correct(LabelledQuestion("?", ["false"], "yesno"), "no")


# --- free text -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        ("Paris", "paris"),
        ("The Beatles!", "beatles"),
        ("  An   apple, a day. ", "apple day"),
        ("Rāwalpindi", "rāwalpindi"),
        ("“Vermeer”—Delft", "vermeerdelft"),
        ("U.S.", "us"),
    ],
)
def test_normalise_text(output: str, expected: str) -> None:
    assert extract("text", output) == expected
    assert normalise_text(output) == expected


def test_extract_text_none() -> None:
    assert extract("text", "") is None
    assert extract("text", " the ... ") is None


def test_text_grading() -> None:
    paris = LabelledQuestion("What is the capital of France?", ["Paris"], "text", "nq_open")
    assert is_correct(paris, "Paris")
    assert is_correct(paris, "paris.")
    assert is_correct(paris, "Paris, France")
    assert is_correct(paris, "The capital of France is Paris.")
    assert not is_correct(paris, "Parisian cafés")
    assert not is_correct(paris, "Lyon")
    assert not is_correct(paris, "")

    vermeer = LabelledQuestion(
        "Who painted Girl with a Pearl Earring?",
        ["Johannes Vermeer", "Vermeer", "Jan Vermeer"],
        "text",
        "triviaqa",
    )
    assert is_correct(vermeer, "It was painted by Vermeer.")
    assert is_correct(vermeer, "johannes vermeer")
    assert not is_correct(vermeer, "Rembrandt")


def test_text_alias_must_be_whole_words() -> None:
    question = LabelledQuestion("?", ["December 1972", "14 December 1972 UTC"], "text")
    assert is_correct(question, "In December 1972.")
    assert not is_correct(question, "December 19720")
    assert not is_correct(question, "December 14, 1972")


def test_text_alias_that_normalises_to_nothing_matches_nothing() -> None:
    # An empty alias would be a substring of every answer.
    question = LabelledQuestion("?", ["---", "A+"], "text")
    assert not is_correct(question, "anything at all")


# --- reading question files ------------------------------------------------------------


def test_read_questions_round_trip(tmp_path: Path) -> None:
    questions = [
        LabelledQuestion("What is 2 + 2?", ["4"], "number", "simple_arithmetic"),
        LabelledQuestion("Capital of France?", ["Paris", "Paris, France"], "text"),
    ]
    path = tmp_path / "q.jsonl"
    encoder = msgspec.json.Encoder()
    path.write_bytes(b"\n".join(encoder.encode(q) for q in questions) + b"\n\n")
    assert read_questions(path) == questions
    assert read_questions(str(path)) == questions


@pytest.mark.parametrize(
    "bad_line",
    [
        b'{"prompt": "x", "answers": [], "kind": "number"}',
        b'{"prompt": "x", "answers": ["1"], "kind": "essay"}',
        b'{"prompt": "x", "kind": "number"}',
        b'{"prompt": "x", "answers": ["1"], "kind": "number"',
        b"not json",
    ],
)
def test_read_questions_names_the_bad_line(tmp_path: Path, bad_line: bytes) -> None:
    good = b'{"prompt": "x", "answers": ["1"], "kind": "number"}'
    path = tmp_path / "q.jsonl"
    path.write_bytes(good + b"\n\n" + bad_line + b"\n" + good + b"\n")
    with pytest.raises(QuestionFileError, match=r"q\.jsonl:3: ") as caught:
        read_questions(path)
    assert isinstance(caught.value, ValueError)


# --- properties ------------------------------------------------------------------------

_FORMATS = [
    "{plain}",
    "{commas}",
    "${commas}",
    "{plain}.0",
    "${commas}.00",
    "{commas} dollars",
    "The answer is {commas}.",
    "Answer: ${plain}",
    "So the total is {commas}.",
    "First 3 + 4 = 7, then 7 * 2 = 14, so the result is {commas}",
]


@given(st.integers(min_value=-(10**12), max_value=10**12), st.sampled_from(_FORMATS))
def test_formatted_integer_extracts_to_its_value(value: int, template: str) -> None:
    sign = "-" if value < 0 else ""
    text = template.format(plain=f"{abs(value)}", commas=f"{abs(value):,}")
    # The sign goes in front of the dollar sign, as people write "-$5".
    text = text.replace("$", f"{sign}$", 1) if "$" in text else _signed(text, sign, value)
    assert extract("number", text) == str(value)


def _signed(text: str, sign: str, value: int) -> str:
    for spelling in (f"{abs(value):,}", f"{abs(value)}"):
        if spelling in text:
            start = text.rindex(spelling)
            return text[:start] + sign + text[start:]
    raise AssertionError(text)


@given(
    st.decimals(min_value=-(10**6), max_value=10**6, places=2, allow_nan=False),
    st.sampled_from(["{}", "${}", "The answer is {}.", "{} dollars"]),
)
def test_formatted_decimal_grades_against_its_value(value: object, template: str) -> None:
    text = template.format(value)
    assert is_correct(number(str(value)), text)


@given(
    st.integers(min_value=-(10**5), max_value=10**5),
    st.integers(min_value=-(10**5), max_value=10**5),
    st.sampled_from(_FORMATS),
)
def test_a_different_number_never_grades_correct(gold: int, said: int, template: str) -> None:
    assume(gold != said)
    text = template.format(plain=f"{said}", commas=f"{said:,}")
    assert not is_correct(number(str(gold)), text)


@given(st.integers(min_value=1, max_value=10**4))
def test_the_prompts_own_numbers_do_not_grade_correct(extra: int) -> None:
    # Echoing one of the prompt's numbers is not the answer (unless it happens to be).
    gold = 18 + extra
    for echoed in (16, 3, 4, 2):
        assert not is_correct(number(str(gold)), f"She has {echoed} eggs.")


@given(
    st.sampled_from("ABCDE"),
    st.sampled_from(["{}", "({})", "The answer is {}.", "Answer: ({})", "Option {}"]),
)
def test_choice_letter_formats(letter: str, template: str) -> None:
    assert extract("choice", template.format(letter)) == letter
    assert extract("choice", template.format(letter.lower())) == letter
    question = LabelledQuestion("?", [letter], "choice")
    other = "ABCDE"[("ABCDE".index(letter) + 1) % 5]
    assert is_correct(question, template.format(letter))
    assert not is_correct(question, template.format(other))


@given(st.text())
def test_text_normalisation_is_idempotent(text: str) -> None:
    once = extract("text", text)
    if once is not None:
        assert extract("text", once) == once
        assert once == once.strip() and "  " not in once


@given(
    st.lists(st.from_regex(r"[A-Za-z][a-z]{1,8}", fullmatch=True), min_size=1, max_size=3),
    st.text(alphabet="abcdefghij ,.", max_size=20),
    st.text(alphabet="abcdefghij ,.", max_size=20),
)
def test_alias_inside_a_sentence_grades_correct(words: list[str], before: str, after: str) -> None:
    alias = " ".join(words)
    assume(normalise_text(alias))
    question = LabelledQuestion("?", [alias], "text")
    assert is_correct(question, f"{before} {alias.upper()}, {after}")


@given(st.text(max_size=200))
def test_extract_never_raises(text: str) -> None:
    for kind in ("number", "choice", "yesno", "text"):
        extract(kind, text)
