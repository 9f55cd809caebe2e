"""Stop sequences over text that arrives in arbitrary pieces."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from engines.stops import StopMatcher


def run(pieces: list[str], stops: tuple[str, ...]) -> tuple[str, bool]:
    matcher = StopMatcher(stops)
    out = []
    for piece in pieces:
        safe, matched = matcher.feed(piece)
        out.append(safe)
        if matched:
            return "".join(out), True
    return "".join(out) + matcher.flush(), False


def reference(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    """Cut before the stop sequence that is complete first, reading left to right."""
    for end in range(1, len(text) + 1):
        for stop in sorted(stops, key=len, reverse=True):
            if text[:end].endswith(stop):
                return text[: end - len(stop)], True
    return text, False


def test_holds_back_a_possible_stop() -> None:
    matcher = StopMatcher(("\nQuestion:",))
    assert matcher.feed("Rome\nQue") == ("Rome", False)
    assert matcher.feed("stion: next") == ("", True)


def test_releases_text_that_was_not_a_stop() -> None:
    matcher = StopMatcher(("\nQuestion:",))
    assert matcher.feed("a\nQu") == ("a", False)
    assert matcher.feed("ick") == ("\nQuick", False)


@settings(max_examples=500)
@given(
    text=st.text(alphabet="ab\nQ:", max_size=40),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=8),
    stops=st.lists(st.text(alphabet="ab\nQ:", min_size=1, max_size=4), max_size=3),
)
def test_any_split_gives_the_same_result_as_the_whole(
    text: str, cuts: list[int], stops: list[str]
) -> None:
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    assert run(pieces, tuple(stops)) == reference(text, tuple(stops))
