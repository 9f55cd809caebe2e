"""Whether a shortcut's answer agrees with the answer of the path it skipped.

A shadow check answers a sampled request again by the path its shortcut skipped (the
large model for a small-model route, the loop run to its budget for an early stop, the
engine for a cache hit) and compares the two answers here. Agreement is judged on the
answer, not the wording: the final number, the option letter or the yes/no, each
pulled out by evaluator.answers exactly as the loop grades and votes on them, and for
free text SQuAD-normalised words. It runs in the gateway's background on every check,
so it is regular expressions and a word count, never a model.

"Agree" means the two answers would be graded the same: both right or both wrong in
the same way. The figures behind the free-text rule and each kind's accuracy on public
labelled pairs are bench/comparator_accuracy.py's.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from typing import assert_never

import msgspec

from evaluator.answers import (
    _CHOICE_LEADING,
    _CHOICE_MARKER,
    _NUMBER_MARKER,
    AnswerKind,
    _numbers_close,
    extract,
    infer_kind,
)

# Free text agrees when the shorter normalised answer occurs, as whole words, in the
# longer ("paris" in "paris france"), or when their SQuAD word F1 reaches TEXT_F1.
# Chosen on a fitting half of TriviaQA and NQ-open questions (answer aliases of the
# same question against those of others); bench/comparator_accuracy.py reports it on
# the other half and says if a refit would choose otherwise.
TEXT_F1 = 0.4
# Free text longer than this (normalised words, either side) is not judged: the rule
# was fitted on answers of at most ten words, and word overlap told code that passes
# its tests from code that fails no better than chance (MBPP, same benchmark).
MAX_TEXT_WORDS = 32


class Agreement(msgspec.Struct, frozen=True):
    """The comparator's verdict on one shortcut answer and its reference."""

    kind: AnswerKind  # what the two answers were compared as
    agree: bool | None  # None: could not tell (no final answer in one of them, or too long)
    answer: str | None  # the shortcut answer's extracted form
    reference: str | None  # the reference answer's extracted form


# --- what the answers look like, when the question does not say -----------------------

# A reply that *is* an answer of a kind, not merely one that mentions one: a chat reply
# to "What year ...?" may be a paragraph with ten numbers in it.
_YESNO_SHAPE = re.compile(
    r"^\W*(?:yes|no|true|false)\b|\b(?:yes|no|true|false)\W*$"
    r"|answer\s*(?:is|:)\W*(?:yes|no|true|false)\b",
    re.IGNORECASE,
)
_ENDS_IN_NUMBER = re.compile(r"\d\W*$")  # \W covers "%", ".", spaces: one run, no backtracking
# What may stand between a final-answer marker and its number: "#### $20", "**42**".
_OPENS_WITH_NUMBER = re.compile(r"[^\w\n]*\d")
_BARE_LETTER = re.compile(r"^\W*[A-E]\W*$")


def _is_choice(text: str) -> bool:
    stripped = text.strip()
    return bool(
        _BARE_LETTER.match(stripped)
        or _CHOICE_MARKER.search(stripped)
        or _CHOICE_LEADING.match(stripped)
    )


def _is_yesno(text: str) -> bool:
    return _YESNO_SHAPE.search(text.strip()) is not None


def _is_number(text: str) -> bool:
    """A last word that is a number, or a final-answer marker ("####", "answer is",
    "\\boxed{") with one right after it."""
    if _ENDS_IN_NUMBER.search(text):
        return True
    markers = list(_NUMBER_MARKER.finditer(text))
    return bool(markers) and _OPENS_WITH_NUMBER.match(text, markers[-1].end()) is not None


_SHAPES: tuple[tuple[AnswerKind, Callable[[str], bool]], ...] = (
    ("choice", _is_choice),
    ("yesno", _is_yesno),
    ("number", _is_number),
)


def _kind(question: str, answer: str, reference: str) -> AnswerKind:
    asked = infer_kind(question)
    # infer_kind reads "Can you explain ...?" as a yes/no question; the replies say
    # whether it was one.
    if asked in ("number", "choice") or (
        asked == "yesno" and _is_yesno(answer) and _is_yesno(reference)
    ):
        return asked
    for kind, shaped in _SHAPES:
        if shaped(answer) and shaped(reference):
            return kind
    return "text"


# --- free text -------------------------------------------------------------------------


def token_f1(a: str, b: str) -> float:
    """SQuAD's F1 between two normalised answers' words."""
    x, y = a.split(), b.split()
    common = sum((Counter(x) & Counter(y)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(x), common / len(y)
    return 2 * precision * recall / (precision + recall)


def contained(a: str, b: str) -> bool:
    """Whether the shorter normalised answer occurs in the longer, as whole words."""
    shorter, longer = sorted((a, b), key=len)
    return f" {shorter} " in f" {longer} "


def texts_agree(a: str, b: str) -> bool | None:
    """The free-text rule on two normalised answers; None when either is too long."""
    if max(len(a.split()), len(b.split())) > MAX_TEXT_WORDS:
        return None
    return contained(a, b) or token_f1(a, b) >= TEXT_F1


# --- the public face -------------------------------------------------------------------


def compare(
    question: str, answer: str, reference: str, kind: AnswerKind | None = None
) -> Agreement:
    """Whether ``answer`` (the shortcut's) and ``reference`` (the skipped path's) give
    the same answer to ``question``. ``kind`` is read from the question when not given
    (evaluator.answers.infer_kind), or from the answers' own form when the question
    reads as free text but both replies are, say, a number."""
    kind = kind or _kind(question, answer, reference)
    mine, theirs = extract(kind, answer), extract(kind, reference)
    if mine is None or theirs is None:
        return Agreement(kind, None, mine, theirs)
    match kind:
        case "number":
            agree: bool | None = _numbers_close(mine, theirs)
        case "choice" | "yesno":
            agree = mine == theirs
        case "text":
            agree = texts_agree(mine, theirs)
        case _:
            assert_never(kind)
    return Agreement(kind, agree, mine, theirs)
