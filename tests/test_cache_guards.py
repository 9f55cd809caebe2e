"""False-hit guards: near-miss prompts are told apart, paraphrases are not."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cache.guards import GuardSettings, explain, veto

ALL = GuardSettings()

NEAR_MISSES = [
    ("What is 15% of 80?", "What is 15% of 90?", "numbers"),
    ("What is 6 divided by 3?", "What is 3 divided by 6?", "numbers"),
    ("Split the bill between two people", "Split the bill between three people", "numbers"),
    ("How do I enable 2FA on my account?", "How do I disable 2FA on my account?", "polarity"),
    ("Is it safe to eat raw eggs?", "Is it not safe to eat raw eggs?", "negation"),
    ("Why can I log in?", "Why can't I log in?", "negation"),
    # Polarity (issue 32's probes): the other end of a scale, a negating prefix, a quantifier.
    (
        "Is this medication safe during pregnancy?",
        "Is this medication unsafe during pregnancy?",
        "polarity",
    ),
    (
        "Is it legal to drive at 16 in California?",
        "Is it illegal to drive at 16 in California?",
        "polarity",
    ),
    ("Is Python faster than C?", "Is Python slower than C?", "polarity"),
    ("Is the Sun larger than the Earth?", "Is the Sun smaller than the Earth?", "polarity"),
    ("Are refunds allowed within 30 days?", "Are refunds allowed after 30 days?", "polarity"),
    ("Do all mammals lay eggs?", "Do some mammals lay eggs?", "polarity"),
    ("Does caffeine raise heart rate?", "Does caffeine lower heart rate?", "polarity"),
    (
        "Is the return window longer than 14 days?",
        "Is the return window shorter than 14 days?",
        "polarity",
    ),
    ("Is renting cheaper than buying?", "Is renting more expensive than buying?", "polarity"),
    ("Is this mushroom toxic?", "Is this mushroom non-toxic?", "polarity"),
    # Marks an embedding barely sees (issue 32, finding 5).
    ("What is 5!", "What is 5?", "form"),
    ("Convert 1 MB to bits", "Convert 1 Mb to bits", "form"),
    ("Is 5 mW of laser power dangerous?", "Is 5 MW of laser power dangerous?", "form"),
    ("Fix this:\nfor x in y:\n    print(x)", "Fix this:\nfor x in y:\nprint(x)", "form"),
    ("What is the capital of France?", "What is the capital of Germany?", "entities"),
    ("Is Paris bigger than London?", "Is London bigger than Paris?", "entities"),
    ("Convert 5 km to miles", "Convert 5 miles to km", "entities"),
    # Same words, other roles: the embedding barely moves, the answer does.
    ("Is coffee worse for you than tea?", "Is tea worse for you than coffee?", "order"),
    ("Should I learn guitar before piano?", "Should I learn piano before guitar?", "order"),
    ("Did Google buy YouTube?", "Did YouTube buy Google?", "entities"),
    ("How do I convert a PDF to Word?", "How do I convert a Word to PDF?", "entities"),
    (
        "Kenneth Brampton and actress Tien Hogue persuaded Pearson Tewksbury to produce it.",
        "Tien Hogue and actress Kenneth Brampton persuaded Pearson Tewksbury to produce it.",
        "entities",
    ),
    (
        "The heraldic coat of arms of Bavaria was designed according to modern traditions.",
        "The modern coat of arms of Bavaria was designed according to heraldic traditions.",
        "order",
    ),
    (
        "Winkleigh is a small municipality and civil village in Devon.",
        "Winkleigh is a civil parish and small village in Devon.",
        "order",
    ),
    ("What is 6 divided by 3 in Python?", "What is 3 divided by 6 in Python?", "numbers"),
    ("Which is better, Coke or Pepsi?", "Which is better, Coke or Sprite?", "entities"),
]
PARAPHRASES = [
    ("What is the capital of France?", "what is the capital city of France"),
    ("How tall is Mount Everest?", "What is the height of Mount Everest?"),
    ("Who wrote Hamlet?", "Who is the author of Hamlet?"),
    ("How many legs does a spider have?", "how many legs do spiders have"),
    ("What is 2,500 plus 10?", "what's 2500 + 10"),
    ("What is the capital of France?", "Which city is France's capital?"),
    # A clause moved whole, a list reordered, "X of Y" for "Y X": no word took another's place.
    ("In 1943, Sarah Kubitschek had a daughter.", "Sarah Kubitschek had a daughter in 1943."),
    (
        "Which airlines fly to Oslo, Bergen and Tromso?",
        "Which airlines fly to Tromso, Oslo and Bergen?",
    ),
    (
        "What is the population growth rate of India?",
        "What is the growth rate of the population of India?",
    ),
    (
        "How do I call the generate_examples method?",
        "How do I call the method of generate_examples?",
    ),
    # Other spellings of the same name; "one" as a pronoun; "why not" asks nothing negative.
    ("Should the education system in India change?", "Should India's educational system change?"),
    ("What are working hours at Mu Sigma?", "What are the working hours at Mu-Sigma?"),
    ("How can one learn French fast?", "How can I learn French fast?"),
    (
        "Is sleeping on the floor good for your back? Why or why not?",
        "Is sleeping on the floor good for your back?",
    ),
    # An opposite counts only against its counterpart.
    ("How can I attract more customers?", "How can I attract customers?"),
    # The same end of a scale in other words; "less" turns a word around; "any" is idle.
    (
        "Is this medication unsafe during pregnancy?",
        "Is this medication dangerous during pregnancy?",
    ),
    ("Is it illegal to drive at 16?", "Is it against the law to drive at 16?"),
    ("Does caffeine raise heart rate?", "Does caffeine increase your heart rate?"),
    ("Is renting cheaper than buying?", "Is renting less expensive than buying?"),
    ("Is there any way to speed up pip install?", "Is there a way to speed up pip install?"),
    # A capital at a word's start only, a comparison, spacing on one line: no marks.
    ("What is the capital of France?", "what is the capital of france"),
    ("Is 5 != 3 in Python?", "Is 5 != 3 in Python"),
    ("Why is  my code slow?", "Why is my code slow?"),
    ("How do I get a US visa?", "how do i get a us visa"),  # capitals not after a number
    ("She was born in 1943. They moved to Oslo.", "She was born in 1943. they moved to Oslo."),
    ("How do I start a blog?", "How can I start a blog?"),
]


@pytest.mark.parametrize(("cached", "query", "why"), NEAR_MISSES)
def test_near_misses_are_vetoed(cached: str, query: str, why: str) -> None:
    assert veto(cached, query, ALL) == why


@pytest.mark.parametrize(("cached", "query"), PARAPHRASES)
def test_paraphrases_pass(cached: str, query: str) -> None:
    assert veto(cached, query, ALL) is None


def test_each_guard_can_be_switched_off() -> None:
    assert veto("What is 15% of 80?", "What is 15% of 90?", GuardSettings(numbers=False)) is None
    assert veto("What is 5!", "What is 5?", GuardSettings(form=False)) is None
    off = GuardSettings(negation=False)
    assert veto("Can I log in?", "Can't I log in?", off) is None
    off = GuardSettings(polarity=False)
    assert veto("How do I enable 2FA?", "How do I disable 2FA?", off) is None
    assert veto("Is it legal?", "Is it illegal?", off) is None
    off = GuardSettings(entities=False)
    assert veto("Capital of France?", "Capital of Germany?", off) is None
    off = GuardSettings(order=False)
    assert veto("Is coffee worse than tea?", "Is tea worse than coffee?", off) is None


def test_substitution_is_opt_in() -> None:
    square = "What hairstyles suit a man with a square face?"
    oval = "What hairstyles suit a man with an oval face?"
    assert veto(square, oval, ALL) is None
    assert veto(square, oval, GuardSettings(substitution=True)) == "substitution"
    # A different form of the same word is no substitution.
    assert veto("Best book for learning Python?", "Best books for learning Python?",
                GuardSettings(substitution=True)) is None  # fmt: skip


def test_explain_names_the_words() -> None:
    assert explain("What is 15% of 80?", "What is 15% of 90?", ALL) == ("numbers", "80 90")
    assert explain("Is coffee worse than tea?", "Is tea worse than coffee?", ALL) == (
        "order",
        "coffee <-> tea",
    )
    assert explain("How do I enable 2FA?", "How do I disable 2FA?", ALL) == (
        "polarity",
        "enable <-> disable",
    )
    assert explain("Is it legal?", "Is it illegal?", ALL) == ("polarity", "legal <-> illegal")
    assert explain("Is it wise?", "Is it unwise?", ALL) == ("polarity", "unwise <-> wise")
    assert explain("Capital of France?", "Capital of Germany?", ALL) == ("entities", "france")
    assert explain("Who wrote Hamlet?", "Who is the author of Hamlet?", ALL) is None


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


# Made-up words that are neither stopwords, names, units nor numbers.
TERMS = st.text(alphabet="bcdfgkmptvz", min_size=3, max_size=7).map(lambda w: "q" + w)
CLAUSE = st.lists(TERMS, min_size=1, max_size=5, unique=True)


@given(
    words=st.lists(TERMS, min_size=4, max_size=12, unique=True),
    data=st.data(),
)
def test_two_words_trading_places_never_pass(words: list[str], data: st.DataObject) -> None:
    """ "A did X to B" against "B did X to A", anywhere in a prompt, unless the two
    are next to each other (then it may be a compound, and the embedding differs)."""
    i = data.draw(st.integers(min_value=0, max_value=len(words) - 3))
    j = data.draw(st.integers(min_value=i + 2, max_value=len(words) - 1))
    swapped = list(words)
    swapped[i], swapped[j] = words[j], words[i]
    assert veto(" ".join(words) + "?", " ".join(swapped) + "?", ALL) == "order"


@given(
    first=CLAUSE,
    second=CLAUSE,
)
def test_a_clause_moved_whole_passes(first: list[str], second: list[str]) -> None:
    """ "In 1943, X had a son" and "X had a son in 1943": a clause moved as a block."""
    second = [w for w in second if w not in first] or ["qzz"]
    cached = " ".join(first + second) + "?"
    query = " ".join(second) + ", " + " ".join(first) + "?"
    assert veto(cached, query, ALL) is None


@given(
    names=st.lists(
        st.text(alphabet="bcdfgkmptvz", min_size=2, max_size=6).map(lambda w: "Q" + w),
        min_size=2,
        max_size=2,
        unique=True,
    ),
    template=st.sampled_from([
        "Is {} bigger than {}?",
        "How far is {} from {}?",
        "Did {} beat {} in the final?",
        "Why does {} hate {}?",
    ]),
)  # fmt: skip
def test_swapping_two_names_never_passes(names: list[str], template: str) -> None:
    first, second = names
    cached, query = template.format(first, second), template.format(second, first)
    assert veto(cached, query, ALL) == "entities"
