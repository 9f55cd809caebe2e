"""False-hit guards: near-miss prompts are told apart, paraphrases are not."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cache.guards import GuardSettings, veto

ALL = GuardSettings()

NEAR_MISSES = [
    ("What is 15% of 80?", "What is 15% of 90?", "numbers"),
    ("What is 6 divided by 3?", "What is 3 divided by 6?", "numbers"),
    ("Split the bill between two people", "Split the bill between three people", "numbers"),
    ("How do I enable 2FA on my account?", "How do I disable 2FA on my account?", "negation"),
    ("Is it safe to eat raw eggs?", "Is it not safe to eat raw eggs?", "negation"),
    ("Why can I log in?", "Why can't I log in?", "negation"),
    ("What is the capital of France?", "What is the capital of Germany?", "entities"),
    ("Is Paris bigger than London?", "Is London bigger than Paris?", "entities"),
    ("Convert 5 km to miles", "Convert 5 miles to km", "entities"),
]
PARAPHRASES = [
    ("What is the capital of France?", "what is the capital city of France"),
    ("How tall is Mount Everest?", "What is the height of Mount Everest?"),
    ("Who wrote Hamlet?", "Who is the author of Hamlet?"),
    ("How many legs does a spider have?", "how many legs do spiders have"),
    ("What is 2,500 plus 10?", "what's 2500 + 10"),
    ("What is the capital of France?", "Which city is France's capital?"),
]


@pytest.mark.parametrize(("cached", "query", "why"), NEAR_MISSES)
def test_near_misses_are_vetoed(cached: str, query: str, why: str) -> None:
    assert veto(cached, query, ALL) == why


@pytest.mark.parametrize(("cached", "query"), PARAPHRASES)
def test_paraphrases_pass(cached: str, query: str) -> None:
    assert veto(cached, query, ALL) is None


def test_each_guard_can_be_switched_off() -> None:
    assert veto("What is 15% of 80?", "What is 15% of 90?", GuardSettings(numbers=False)) is None
    off = GuardSettings(negation=False)
    assert veto("How do I enable 2FA?", "How do I disable 2FA?", off) is None
    off = GuardSettings(entities=False)
    assert veto("Capital of France?", "Capital of Germany?", off) is None


WORDS = st.lists(
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz", min_size=1, max_size=8), max_size=6
).map(" ".join)


@given(
    before=WORDS,
    after=WORDS,
    original=st.integers(min_value=-(10**9), max_value=10**9),
    changed=st.integers(min_value=-(10**9), max_value=10**9),
    decimal=st.booleans(),
)
def test_changing_a_number_never_passes(
    before: str, after: str, original: int, changed: int, decimal: bool
) -> None:
    if original == changed:
        changed += 1
    show = (lambda n: f"{n / 100:.2f}") if decimal else str
    cached = f"{before} {show(original)} {after}?"
    query = f"{before} {show(changed)} {after}?"
    assert veto(cached, query, ALL) == "numbers"
