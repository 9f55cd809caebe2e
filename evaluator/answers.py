"""Short answers: pull the answer out of a model's output and grade it against gold.

Four kinds cover the public sets we measure on: a number (GSM8K and the MAWPS family),
a choice letter (ARC, OpenBookQA, MMLU), yes/no (BoolQ) and short free text (TriviaQA,
NQ-open). Extraction is deliberately forgiving about form ("$1,234.0", "(B)", "true")
and strict about content, so a tiny model is graded on what it said, not how.
"""

from __future__ import annotations

import re
import string
import unicodedata
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Annotated, Literal, assert_never

import msgspec

from engines.jsonl import read_jsonl

AnswerKind = Literal["number", "choice", "yesno", "text"]

# Relative tolerance for numbers: wide enough for "0.6666666666666666" vs 2/3, narrow
# enough that no two distinct answers a grade-school problem can have compare equal.
REL_TOL = Fraction(1, 10**6)


class LabelledQuestion(msgspec.Struct, frozen=True):
    """A prompt with its accepted gold answers (aliases for text, one value otherwise)."""

    prompt: str
    answers: Annotated[list[str], msgspec.Meta(min_length=1)]
    kind: AnswerKind
    source: str = ""


class QuestionFileError(ValueError):
    """A questions file has a line that is not a LabelledQuestion."""


# --- numbers ---------------------------------------------------------------------------

# A number may carry a sign, a dollar sign, thousands separators, decimals and a
# "/denominator". The look-behind keeps "x2" or "Answer2" from reading as 2, and the
# minus only counts when it does not follow a word or digit, so "16-3" reads as 16, 3.
_NUMBER = re.compile(
    r"(?<![\w.])(?P<neg>[-\u2212])?(?:\$\s?)?(?P<neg2>[-\u2212])?"
    r"(?P<value>(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)"
    r"(?:/(?P<den>\d+)(?![\d.]))?"
)
# Where a model states its final answer. The last one wins: reasoning models revise.
_NUMBER_MARKER = re.compile(r"(?i:answer)\s*(?:(?i:is)|[:=])|####|\\boxed\{")


def _parse_number(match: re.Match[str]) -> Fraction | None:
    try:
        value = Fraction(match["value"].replace(",", ""))
        if match["den"] is not None:
            denominator = int(match["den"])
            if denominator == 0:
                return None
            value /= denominator
    except ValueError:  # beyond Python's int-string digit limit: not an answer anyway
        return None
    return -value if (match["neg"] or match["neg2"]) else value


def _numbers(text: str) -> list[tuple[re.Match[str], Fraction]]:
    parsed = ((match, _parse_number(match)) for match in _NUMBER.finditer(text))
    return [(match, value) for match, value in parsed if value is not None]


def _canonical(value: Fraction) -> str:
    """One spelling per value, so "18", "18.0" and "$18" extract to the same string."""
    if value.denominator == 1:
        return str(value.numerator)
    return str(Decimal(value.numerator) / Decimal(value.denominator))


_OPERATOR_NEXT = re.compile(r"\s*[-+*/\u00d7=]")


def _extract_number(text: str) -> str | None:
    markers = list(_NUMBER_MARKER.finditer(text))
    if markers:
        # Only the marker's own line: "Answer: let me think" must not grab a number
        # from the working that follows it.
        tail = text[markers[-1].end() :].split("\n", 1)[0]
        after = _numbers(tail)
        # "Answer: 9 * 2 = 18" opens with working; its result follows the last "=".
        if after and _OPERATOR_NEXT.match(tail, after[0][0].end()) and "=" in tail:
            after = _numbers(tail[tail.rindex("=") + 1 :]) or after
        if after:
            return _canonical(after[0][1])
    # Without a usable marker, reasoning ends with its result.
    found = _numbers(text)
    return _canonical(found[-1][1]) if found else None


# --- choices ---------------------------------------------------------------------------

# One option reference: "(b)", "option c", "choice 2", "answer2" (LLM-Adapters' own
# form), or a bare capital letter. A bare lowercase letter only counts before ".", ")"
# or ":" or at the end, since "a" is usually the article.
_OPTION = (
    r"(?:\(\s*(?P<paren>[A-Ea-e])\s*\)"
    r"|(?i:option|choice)\s*(?P<named>[A-Ea-e1-5])\b"
    r"|(?i:answer)\s*(?P<numbered>[1-5])\b"
    r"|(?P<upper>[A-E])\b"
    r"|(?P<lower>[a-e])(?=[.):]|\s*$))"
)
_CHOICE_MARKER = re.compile(r"(?i:answer)\s*(?:(?i:is)|:)[\s:*]*" + _OPTION)
_CHOICE_EXPLICIT = re.compile(
    r"\(\s*(?P<paren>[A-Ea-e])\s*\)"
    r"|(?i:option|choice)\s*(?P<named>[A-Ea-e1-5])\b"
    r"|(?i:answer)\s*(?P<numbered>[1-5])\b"
)
_CHOICE_LEADING = re.compile(r"^\W*(?P<upper>[A-E])(?:[.):]|\s*$)")
_CHOICE_STANDALONE = re.compile(r"\b(?P<upper>[A-E])\b")
# Longer than this and a stray capital is more likely a word ("A") than an answer.
_SHORT_CHARS = 40


def _letter(match: re.Match[str]) -> str:
    token = next(group for group in match.groups() if group is not None)
    return "ABCDE"[int(token) - 1] if token.isdigit() else token.upper()


def _extract_choice(text: str) -> str | None:
    stripped = text.strip()
    markers = list(_CHOICE_MARKER.finditer(stripped))
    if markers:
        return _letter(markers[-1])
    for pattern in (_CHOICE_EXPLICIT, _CHOICE_LEADING):
        match = pattern.search(stripped)
        if match:
            return _letter(match)
    bare = stripped.strip(string.punctuation + " ")
    if len(bare) == 1 and bare.upper() in "ABCDE":
        return bare.upper()
    if len(stripped) <= _SHORT_CHARS:
        match = _CHOICE_STANDALONE.search(stripped)
        if match:
            return _letter(match)
    return None


# --- yes/no ----------------------------------------------------------------------------

_YESNO = re.compile(r"\b(yes|true|no|false)\b", re.IGNORECASE)
_YESNO_MARKER = re.compile(r"answer\s*(?:is|:)", re.IGNORECASE)


def _extract_yesno(text: str) -> str | None:
    markers = list(_YESNO_MARKER.finditer(text))
    start = markers[-1].end() if markers else 0
    match = _YESNO.search(text, start) or (_YESNO.search(text) if start else None)
    if match is None:
        return None
    return "yes" if match[1].lower() in ("yes", "true") else "no"


# --- free text -------------------------------------------------------------------------

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_ASCII_PUNCTUATION = frozenset(string.punctuation)


def _is_punctuation(char: str) -> bool:
    # SQuAD strips ASCII punctuation only; curly quotes and dashes are just as noisy.
    return char in _ASCII_PUNCTUATION or unicodedata.category(char).startswith("P")


def normalise_text(text: str) -> str:
    """SQuAD's answer normalisation: lowercase, no punctuation or articles, one space."""
    lowered = "".join(char for char in text.lower() if not _is_punctuation(char))
    return " ".join(_ARTICLES.sub(" ", lowered).split())


# --- the public face -------------------------------------------------------------------


def extract(kind: AnswerKind, text: str) -> str | None:
    """The answer in a model's output, normalised for comparison; None when there is none."""
    match kind:
        case "number":
            return _extract_number(text)
        case "choice":
            return _extract_choice(text)
        case "yesno":
            return _extract_yesno(text)
        case "text":
            return normalise_text(text) or None
        case _:
            assert_never(kind)


# What a question asks for, read from the question alone: the live loop votes on answers
# it must first extract, and a chat request does not say what kind of answer it wants.
_OPTION_LINE = re.compile(r"^\s*\(?[A-E][.):]\s+\S", re.MULTILINE)
_ASKS_YESNO = re.compile(
    r"\byes or no\b|\btrue or false\b|^\s*(?:is|are|was|were|do|does|did|can|could|will|"
    r"would|should|has|have|had)\b[^?]*\?\s*$",
    re.IGNORECASE,
)
_ASKS_NUMBER = re.compile(
    r"\bhow (?:many|much|far|long|old)\b|\bwhat is [-\d(][-\d\s.+*/x\u00d7()]*[?=]|"
    r"\b(?:the )?number only\b|^[-\d\s.+*/()]+=\s*$",
    re.IGNORECASE,
)
# A word problem asks for a quantity in many more ways than "how many": "calculate the
# total", "what is her annual salary", "what percentage of". One in six of GSM8K's
# questions was read as free text without these, and the loop then voted on whole
# sentences. A numeral must be there too: a trivia question asking "what is the average
# lifespan of ..." has none to work with, and stays free text. Only the last
# _QUANTITY_TAIL characters are read for it: a word problem asks at its end, and a
# hostile megabyte of "what is" would otherwise cost this pattern a third of a second.
_QUANTITY_TAIL = 2000
_ASKS_QUANTITY = re.compile(
    r"\b(?:calculate|compute)\b|\bfind (?:the|her|his|their|its)\b"
    r"|\bwhat(?:'s|\u2019s| is| was| will| would| are| were)(?: be)?"
    r" (?:the |her |his |their |its |your )?(?:[\w'\u2019-]+ ){0,3}?"
    r"(?:total|sum|average|mean|difference|percent(?:age)?|fraction|number|amount|cost|price"
    r"|value|weight|length|distance|area|perimeter|volume|speed|score|profit|salary|pension"
    r"|age|height|temperature|capacity|depth|balance|charge|probability|likelihood|chance"
    r"|rate|combined|grade|smallest|largest)s?\b"
    r"|\bwhat (?:percent(?:age)?|fraction|number|amount|score|speed|temperature)\b"
    r"|\bhow (?:tall|fast|high|big|heavy|wide|deep|large|short|loud)\b",
    re.IGNORECASE,
)
_NUMERAL = re.compile(r"\d")


def infer_kind(question: str) -> AnswerKind:
    """The kind of answer ``question`` asks for: two or more option lines ("A. ...")
    make a choice, a count, sum or other quantity a number, a yes/no question yes/no,
    else free text."""
    if len(_OPTION_LINE.findall(question)) >= 2:
        return "choice"
    tail = question[-_QUANTITY_TAIL:]
    if _ASKS_NUMBER.search(question) or (_NUMERAL.search(tail) and _ASKS_QUANTITY.search(tail)):
        return "number"
    # Judged on the question's own sentence, not an instruction line after it.
    if any(_ASKS_YESNO.search(line) for line in question.splitlines()):
        return "yesno"
    return "text"


def _numbers_close(a: str, b: str) -> bool:
    x, y = Fraction(a), Fraction(b)
    return abs(x - y) <= REL_TOL * max(abs(x), abs(y))


def is_correct(question: LabelledQuestion, text: str) -> bool:
    """Whether a model's output answers the question, under the field's usual rules."""
    answer = extract(question.kind, text)
    if answer is None:
        return False
    # Gold goes through the same extraction, so "2,125" or "answer2" in a file still match.
    golds = [gold for gold in (extract(question.kind, a) for a in question.answers) if gold]
    if question.kind == "number":
        return any(_numbers_close(answer, gold) for gold in golds)
    if question.kind == "text":
        # TriviaQA / NQ-open style: an alias anywhere in the answer, as whole words,
        # so "Paris, France" answers "Paris" but "Parisian" does not.
        padded = f" {answer} "
        return any(f" {gold} " in padded for gold in golds)
    return answer in golds


def read_questions(path: str | Path) -> list[LabelledQuestion]:
    """LabelledQuestion JSONL, one per line; blank lines are skipped."""
    return read_jsonl(path, LabelledQuestion, error=QuestionFileError).records
