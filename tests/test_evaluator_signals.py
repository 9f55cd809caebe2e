"""The evaluator's signals, each on small inputs worked out by hand, plus properties."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.special import betainc

from engines.base import Sample, Timings, TokenLogprob, TopLogprob
from evaluator.answers import extract
from evaluator.signals import (
    DEFAULT_FEATURES,
    FEATURES,
    PROBE_SUFFIX,
    MissingSignal,
    Probe,
    SignalSettings,
    beta_majority_probability,
    beta_stop,
    compute_signals,
    group_confidences,
    hesitates,
    majority,
    probe_prompt,
    probe_streak,
    probe_tokens,
    probes_agree,
    read_probe,
    token_confidence,
    trace_confidence,
    vote_share,
    votes,
)


def token(logprob: float, *alternatives: float) -> TokenLogprob:
    return TokenLogprob("t", logprob, tuple(TopLogprob("a", lp) for lp in alternatives))


def confident(c: float, chosen: float = -0.1) -> TokenLogprob:
    """A token whose top-1 confidence is exactly ``c`` (with top_k=1)."""
    return token(chosen, -c)


def sample(text: str, *tokens: TokenLogprob) -> Sample:
    return Sample(
        index=0,
        text=text,
        finish_reason="stop",
        completion_tokens=len(tokens),
        logprobs=tokens,
        timings=Timings(0.0, None, 0.0),
    )


ONE = SignalSettings(top_k=1)

# --- agreement -------------------------------------------------------------------------


def test_majority_ignores_unanswered_samples_and_breaks_ties_by_first_seen() -> None:
    assert majority(["18", None, "16", "18", None, None]) == "18"
    assert majority(["b", "a", "a", "b"]) == "b"
    assert majority([None, None]) is None
    assert majority([]) is None


def test_votes_and_vote_share_count_every_sample_in_k() -> None:
    answers = ["18", "16", "18", None]
    assert votes(answers, "18") == (2, 1)
    assert votes(answers, "16") == (1, 2)
    assert votes(answers, None) == (0, 2)
    assert vote_share(answers, "18") == 0.5  # 2 of 4: the unanswered sample counts in k
    assert vote_share(answers, "7") == 0.0
    with pytest.raises(ValueError):
        vote_share([], "18")


@pytest.mark.parametrize(
    ("leader", "runner_up", "expected"),
    [
        # ∫_.5^1 x dx / B(2, 1) = (1/2 - 1/8) * 2
        (1, 0, 3 / 4),
        # ∫_.5^1 x^2 dx / B(3, 1) = (1/3 - 1/24) * 3
        (2, 0, 7 / 8),
        # P(Bin(5, 1/2) <= 3) = (1 + 5 + 10 + 10) / 32
        (3, 1, 26 / 32),
        # P(Bin(6, 1/2) <= 4) = (1 + 6 + 15 + 20 + 15) / 64
        (4, 1, 57 / 64),
        (5, 0, 63 / 64),
        (0, 0, 1 / 2),
        (2, 2, 1 / 2),
    ],
)
def test_beta_majority_probability_by_hand(leader: int, runner_up: int, expected: float) -> None:
    assert beta_majority_probability(leader, runner_up) == pytest.approx(expected, abs=1e-15)


def test_beta_stop_follows_the_papers_threshold() -> None:
    # 5 of 5 agree: 63/64 ≈ 0.984 >= 0.95; 4 against 1: 57/64 ≈ 0.89 < 0.95.
    assert beta_stop(["7"] * 5)
    assert not beta_stop(["7"] * 4 + ["8"])
    assert beta_stop(["7"] * 4 + ["8"], threshold=0.85)
    assert not beta_stop([None, None, None])


def test_beta_majority_probability_refuses_negative_counts() -> None:
    with pytest.raises(ValueError):
        beta_majority_probability(-1, 0)


counts = st.integers(0, 80)


@settings(max_examples=200, deadline=None)
@given(counts, counts)
def test_beta_matches_the_regularised_incomplete_beta(leader: int, runner_up: int) -> None:
    expected = 1 - float(betainc(leader + 1, runner_up + 1, 0.5))
    assert beta_majority_probability(leader, runner_up) == pytest.approx(expected, abs=1e-9)


@settings(max_examples=200, deadline=None)
@given(counts, counts)
def test_beta_is_monotone_and_symmetric(leader: int, runner_up: int) -> None:
    p = beta_majority_probability(leader, runner_up)
    assert 0.0 < p <= 1.0  # 1 - 2^-54 and beyond round to 1.0
    assert beta_majority_probability(leader + 1, runner_up) >= p
    assert beta_majority_probability(leader, runner_up + 1) <= p
    # P(p1 > p2) + P(p2 > p1) = 1: the posterior puts no mass on a tie.
    assert p + beta_majority_probability(runner_up, leader) == pytest.approx(1.0, abs=1e-12)


answer_lists = st.lists(st.one_of(st.none(), st.sampled_from("abcd")), min_size=1, max_size=30)


@settings(max_examples=200, deadline=None)
@given(answer_lists, st.one_of(st.none(), st.sampled_from("abcde")))
def test_vote_share_is_a_share(answers: list[str | None], candidate: str | None) -> None:
    share = vote_share(answers, candidate)
    assert 0.0 <= share <= 1.0
    leader = majority(answers)
    if leader is not None:
        assert share <= vote_share(answers, leader)


# --- token confidence ------------------------------------------------------------------


def test_token_confidence_is_the_negative_mean_of_the_top_k() -> None:
    t = token(-0.1, -2.3, -0.1, -3.0)  # alternatives out of order on purpose
    assert token_confidence(t, top_k=2) == pytest.approx((0.1 + 2.3) / 2)
    assert token_confidence(t, top_k=5) == pytest.approx((0.1 + 2.3 + 3.0) / 3)
    assert token_confidence(token(-0.1, -0.5, -math.inf), top_k=5) == pytest.approx(0.5)
    assert token_confidence(token(-0.1), top_k=5) is None


def test_group_confidences_slide_over_full_windows() -> None:
    assert group_confidences([1, 2, 3, 4], 2) == [1.5, 2.5, 3.5]
    assert group_confidences([1, 2, 3, 4], 4) == [2.5]
    assert group_confidences([1, 2, 3, 4], 10) == [2.5]  # shorter than a window: one group
    assert group_confidences([], 3) == []


def test_trace_confidence_by_hand() -> None:
    chosen = [-0.5, -1, -0.5, 0, -1]
    tokens = [confident(c, lp) for c, lp in zip([3, 1, 2, 4, 5], chosen, strict=True)]
    found = trace_confidence(
        tokens, SignalSettings(top_k=1, group_window=2, tail_tokens=2, bottom_fraction=0.5)
    )
    assert found.mean_logprob == pytest.approx(-0.6)
    assert found.mean_confidence == pytest.approx(3.0)
    # groups of 2: [2, 1.5, 3, 4.5]
    assert found.lowest_group == pytest.approx(1.5)
    assert found.bottom_group == pytest.approx((1.5 + 2) / 2)  # the lowest half: 2 groups
    assert found.tail == pytest.approx((4 + 5) / 2)


def test_trace_confidence_without_alternatives_has_only_the_mean_logprob() -> None:
    found = trace_confidence([token(-0.5), token(-1.5)])
    assert found.mean_logprob == pytest.approx(-1.0)
    assert found.mean_confidence is None and found.lowest_group is None and found.tail is None


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(0.0, 20.0), min_size=1, max_size=60),
    st.integers(1, 12),
    st.integers(1, 12),
    st.floats(0.01, 1.0),
)
def test_trace_confidence_orders(
    values: list[float], window: int, tail: int, fraction: float
) -> None:
    settings_ = SignalSettings(
        top_k=1, group_window=window, tail_tokens=tail, bottom_fraction=fraction
    )
    found = trace_confidence([confident(c) for c in values], settings_)
    assert found.lowest_group is not None and found.bottom_group is not None
    assert found.mean_confidence is not None and found.tail is not None
    low, high = min(values) - 1e-9, max(values) + 1e-9
    assert low <= found.lowest_group <= found.bottom_group + 1e-9 <= high + 1e-9
    assert low <= found.tail <= high and low <= found.mean_confidence <= high


# --- probes ----------------------------------------------------------------------------


def test_probe_prompt_ends_on_a_marker_every_extractor_reads() -> None:
    prompt = probe_prompt("Step 1: 6 * 3 = 18.")
    assert prompt.startswith("Step 1: 6 * 3 = 18.") and prompt.endswith(PROBE_SUFFIX)
    assert extract("number", prompt + " 18") == "18"
    assert extract("choice", prompt + " (B)") == "B"
    assert extract("yesno", prompt + " No.") == "no"


def test_read_probe_takes_the_first_line_and_keeps_its_cost() -> None:
    probe = read_probe("number", " 42.\nWait, 41", prompt_tokens=14, completion_tokens=6)
    assert probe == Probe(answer="42", certain=True, prompt_tokens=14, completion_tokens=6)
    assert probe.tokens == 20
    assert read_probe("choice", " (b) because").answer == "B"
    assert read_probe("text", " The Eiffel Tower").answer == "eiffel tower"
    assert read_probe("number", " nothing yet").answer is None


def test_read_probe_marks_hesitation_but_not_a_plain_no() -> None:
    assert not read_probe("number", " hmm, 41").certain
    assert not read_probe("number", " 41? Wait").certain
    no = read_probe("yesno", " No")
    assert no.answer == "no" and no.certain
    # Whole words only: Dynasor's substring test would read "know" as "no".
    assert not hesitates("I know it is 4", ["no"])
    assert hesitates("But it is 4", ["but"])
    assert not hesitates("anything", [])


def probes(*answers: str | None, certain: bool = True) -> list[Probe]:
    return [Probe(answer=a, certain=certain, completion_tokens=3) for a in answers]


def test_probe_streak_and_agreement() -> None:
    history = probes("7", "8", "8", "8")
    assert probe_streak(history) == 3
    assert probe_streak(history, "8") == 3
    assert probe_streak(history, "7") == 0
    assert probes_agree(history, 3) and not probes_agree(history, 4)
    assert probe_streak([*history, *probes("8", certain=False)]) == 0
    assert probe_streak([*history, *probes(None)]) == 0
    assert probe_streak([]) == 0
    assert probe_tokens(history) == 12
    with pytest.raises(ValueError):
        probes_agree(history, 0)


# --- one round -------------------------------------------------------------------------


def test_compute_signals_by_hand() -> None:
    round_ = [
        sample("The answer is 18", confident(2.0, -0.2)),
        sample("answer: 16", confident(9.0, -3.0)),  # not behind the majority: left out
        sample("18", confident(4.0, -0.4)),
        sample("no idea", confident(9.0, -3.0)),
    ]
    found = compute_signals("number", round_, probes=probes("18", "18"), settings=ONE)
    assert found.answer == "18"
    assert (found.samples, found.votes, found.runner_up) == (4, 2, 1)
    assert found.vote_share == 0.5
    assert found.majority_probability == pytest.approx(11 / 16)  # P(Bin(4, 1/2) <= 2)
    assert found.mean_logprob == pytest.approx(-0.3)
    assert found.mean_confidence == pytest.approx(3.0)
    assert found.lowest_group_confidence == pytest.approx(3.0)
    assert found.tail_confidence == pytest.approx(3.0)
    assert found.probe_streak == 2 and found.probe_tokens == 6
    # ... then the kind (a number: 0, 0, 1), then the probe streak.
    assert found.features() == pytest.approx(
        [0.5, 11 / 16, -0.3, 3.0, 3.0, 3.0, 3.0, 0.0, 0.0, 1.0, 2.0]
    )
    assert found.features(["tail_confidence", "vote_share"]) == pytest.approx([3.0, 0.5])


def test_compute_signals_for_another_candidate_and_given_answers() -> None:
    round_ = [sample("x"), sample("y"), sample("z")]
    found = compute_signals("number", round_, candidate="16", answers=["18", "16", "18"])
    assert (found.answer, found.votes, found.runner_up) == ("16", 1, 2)
    assert found.majority_probability == pytest.approx(beta_majority_probability(1, 2))
    with pytest.raises(ValueError):
        compute_signals("number", round_, answers=["18"])
    with pytest.raises(ValueError):
        compute_signals("number", [])


def test_compute_signals_when_no_sample_answered() -> None:
    found = compute_signals(
        "number", [sample("no idea", confident(1.0)), sample("?")], settings=ONE
    )
    assert found.answer is None and found.votes == 0 and found.vote_share == 0.0
    assert found.majority_probability == 0.0
    # Token confidence then comes from every sample that has logprobs.
    assert found.mean_confidence == pytest.approx(1.0)


def test_features_name_what_is_missing() -> None:
    found = compute_signals("number", [sample("18", token(-0.1))])
    assert found.mean_logprob == pytest.approx(-0.1)
    assert len(found.features(["vote_share", "mean_logprob"])) == 2
    with pytest.raises(MissingSignal, match="top alternatives"):
        found.features(DEFAULT_FEATURES)
    with pytest.raises(MissingSignal, match="no probes"):
        found.features(["probe_streak"])
    with pytest.raises(MissingSignal, match="unknown signal"):
        found.features(["nonsense"])
    assert FEATURES[-1] == "probe_streak" and "probe_streak" not in DEFAULT_FEATURES
