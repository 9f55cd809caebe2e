"""Routing metrics on examples small enough to check by hand, plus properties."""

from __future__ import annotations

import itertools

import msgspec
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from router.metrics import (
    CurvePoint,
    RoutingReport,
    apgr,
    auc,
    cpt,
    evaluate,
    model_accuracy,
    oracle_curve,
    quality_curve,
    random_apgr,
    random_curve,
    roc_auc,
)

# Four prompts, two thresholds' worth of bins (num_results=2):
#   score  small  large
#   0.1    1      1
#   0.4    0      1     <- large strictly better
#   0.6    1      0
#   0.9    0      1     <- large strictly better
SCORES = [0.1, 0.4, 0.6, 0.9]
SMALL = [True, False, True, False]
LARGE = [True, True, False, True]


def test_hand_example_curve() -> None:
    # Quantile edges at 0, .5, 1: 0.1, 0.5 (halfway from 0.4 to 0.6) and 0.9.
    #   >= 0.1: all four to large          -> 100 %, accuracy 3/4
    #   >= 0.5: 0.6 and 0.9 to large       ->  50 %, accuracy (1 + 0 + 0 + 1)/4
    #   >  0.9: none (last edge uses ">")  ->   0 %, accuracy 2/4
    curve = quality_curve(SCORES, SMALL, LARGE, num_results=2)
    assert [(p.large_pct, p.accuracy) for p in curve] == [(0.0, 50.0), (50.0, 50.0), (100.0, 75.0)]
    assert [p.threshold for p in curve] == pytest.approx([0.9, 0.5, 0.1])


def test_hand_example_report() -> None:
    report = evaluate(SCORES, SMALL, LARGE, num_results=2)
    assert report.n == 4
    assert report.small_accuracy == 50.0
    assert report.large_accuracy == 75.0
    # Trapezoids over x = 0, .5, 1: (50+50)/2*.5 + (50+75)/2*.5 = 25 + 31.25.
    assert report.auc == pytest.approx(56.25)
    # Baselines: 50 and 75 over [0, 1]; (56.25 - 50) / (75 - 50).
    assert report.apgr == pytest.approx(0.25)
    # Target 62.5 lies on the segment (50 %, 50) -> (100 %, 75): 50 + 12.5/25 * 50.
    assert report.cpt50 == pytest.approx(75.0)
    # Target 70: 50 + 20/25 * 50.
    assert report.cpt80 == pytest.approx(90.0)
    # Positives score 0.4 and 0.9, negatives 0.1 and 0.6: 3 of 4 pairs ordered right.
    assert report.roc_auc == pytest.approx(0.75)
    assert report.random_apgr == pytest.approx(0.5)
    # Two prompts gain 1 from switching; 10 % of 4 prompts is 0.4 calls, and so on.
    assert [p.accuracy for p in report.oracle] == pytest.approx(
        [50, 60, 70, 80, 90, 100, 100, 100, 100, 100, 100]
    )
    assert [p.large_pct for p in report.oracle] == list(range(0, 101, 10))


def _synthetic(n: int = 2000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    small = rng.random(n) < 0.55
    large = rng.random(n) < 0.85
    return small, large


def test_oracle_like_score_is_near_perfect() -> None:
    small, large = _synthetic()
    needs_large = (large > small).astype(float)
    # A little noise breaks ties so the thresholds fall inside each class.
    noise = np.random.default_rng(1).random(len(small)) * 1e-3
    report = evaluate(needs_large + noise, small, large)
    assert report.roc_auc == 1.0
    assert report.apgr > 0.9
    # Half the gap is closed by sending just the prompts that need large (fewer than
    # half of them), which is far under the 50 % a random router needs.
    assert report.cpt50 < 0.5 * needs_large.mean() * 100 + 1
    assert report.cpt50 < 25
    assert report.cpt50 <= report.cpt80 < 50


def test_reversed_score_is_bad() -> None:
    small, large = _synthetic()
    needs_large = (large > small).astype(float)
    noise = np.random.default_rng(1).random(len(small)) * 1e-3
    report = evaluate(-(needs_large + noise), small, large)
    assert report.roc_auc == 0.0
    assert report.apgr < 0.2


def test_constant_score_is_a_coin_flip() -> None:
    # Every edge equals the constant: ">=" sends all to large, the last ">" sends none,
    # so the curve is the straight line from always-small to always-large.
    small, large = _synthetic()
    report = evaluate(np.zeros(len(small)), small, large)
    assert report.apgr == pytest.approx(0.5)
    assert report.cpt50 == pytest.approx(50)
    assert report.cpt80 == pytest.approx(80)
    assert report.roc_auc == 0.5


def test_random_scores_average_to_the_analytic_random_router() -> None:
    small, large = _synthetic(n=500)
    rng = np.random.default_rng(7)
    runs = [quality_curve(rng.random(len(small)), small, large) for _ in range(300)]
    mean_accuracy = np.mean([[p.accuracy for p in run] for run in runs], axis=0)
    expected = random_curve(small, large)
    assert [p.large_pct for p in runs[0]] == [p.large_pct for p in expected]
    assert mean_accuracy == pytest.approx([p.accuracy for p in expected], abs=0.3)
    weak, strong = model_accuracy(small), model_accuracy(large)
    assert np.mean([apgr(run, weak, strong) for run in runs]) == pytest.approx(0.5, abs=0.02)
    assert random_apgr(small, large) == pytest.approx(0.5)


def test_cpt_reads_the_curve_like_routellm() -> None:
    # Given in a scrambled order: cpt sorts by % large before interpolating.
    curve = [
        CurvePoint(0.2, 100.0, 80.0),
        CurvePoint(0.9, 0.0, 60.0),
        CurvePoint(0.5, 50.0, 76.0),
    ]
    # 50 % of the 60 -> 80 gap is 70: 10/16 of the way from 0 % to 50 %.
    assert cpt(curve, 60.0, 80.0, 0.5) == pytest.approx(31.25)
    # Above the curve's best accuracy, np.interp clamps to the last point.
    assert cpt(curve, 60.0, 90.0, 0.9) == 100.0
    # AUC: (60+76)/2*.5 + (76+80)/2*.5 = 34 + 39.
    assert auc(curve) == pytest.approx(73.0)
    assert apgr(curve, 60.0, 80.0) == pytest.approx(13 / 20)
    assert np.isnan(apgr(curve, 70.0, 70.0))


outcomes = st.lists(
    st.tuples(st.integers(0, 4), st.booleans(), st.booleans()), min_size=2, max_size=60
)


@settings(max_examples=200, deadline=None)
@given(outcomes)
def test_roc_auc_matches_pairwise_count(rows: list[tuple[int, bool, bool]]) -> None:
    scores = [float(s) for s, _, _ in rows]
    small = [w for _, w, _ in rows]
    large = [g for _, _, g in rows]
    positive = [s for s, w, g in rows if g > w]
    negative = [s for s, w, g in rows if not g > w]
    assume(positive and negative)
    wins = sum(
        1.0 if p > q else 0.5 if p == q else 0.0 for p, q in itertools.product(positive, negative)
    )
    assert roc_auc(scores, small, large) == pytest.approx(wins / (len(positive) * len(negative)))


@settings(max_examples=200, deadline=None)
@given(outcomes, st.integers(1, 12))
def test_cpt_is_monotonic_on_rising_curves(
    rows: list[tuple[int, bool, bool]], num_results: int
) -> None:
    # Where large is never worse than small, sending more prompts to large can only
    # help, whatever the score: the curve rises, and CPT must too.
    scores = [float(s) for s, _, _ in rows]
    small = [w for _, w, _ in rows]
    large = [w or extra for _, w, extra in rows]
    weak, strong = model_accuracy(small), model_accuracy(large)
    assume(strong > weak)
    curve = quality_curve(scores, small, large, num_results)
    accuracies = [p.accuracy for p in curve]
    assert accuracies == sorted(accuracies)
    cpts = [cpt(curve, weak, strong, pct) for pct in (0.2, 0.5, 0.8)]
    assert cpts == sorted(cpts)
    assert all(0 <= c <= 100 for c in cpts)
    report = evaluate(scores, small, large, num_results)
    assert report.cpt50 <= report.cpt80


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.booleans()), min_size=1, max_size=60))
def test_oracle_matches_routellm_formula(rows: list[tuple[bool, bool]]) -> None:
    small = [w for w, _ in rows]
    large = [g for _, g in rows]
    n = len(rows)
    weak_correct = sum(small)
    switch_gains = sum(1 for w, g in rows if not w and g)
    expected = [
        (weak_correct + min(n * share / 100, switch_gains)) / n * 100 for share in range(0, 101, 10)
    ]
    assert [p.accuracy for p in oracle_curve(small, large)] == pytest.approx(expected)


def test_oracle_with_graded_scores_takes_biggest_gains_first() -> None:
    small = [0.0, 0.5, 1.0, 0.2, 0.9]
    large = [1.0, 0.6, 0.0, 0.2, 0.9]  # gains 1.0, 0.1, 0 (loss), 0, 0
    # 10 % of 5 prompts = 0.5 calls: half of the biggest gain.
    oracle = oracle_curve(small, large)
    assert oracle[0].accuracy == pytest.approx(2.6 / 5 * 100)
    assert oracle[1].accuracy == pytest.approx(3.1 / 5 * 100)
    assert oracle[10].accuracy == pytest.approx(3.7 / 5 * 100)


def test_graded_correctness_is_averaged() -> None:
    assert model_accuracy([0.25, 0.75, 1.0, 0.0]) == 50.0


def test_report_round_trips_as_json() -> None:
    report = evaluate(SCORES, SMALL, LARGE)
    assert msgspec.json.decode(msgspec.json.encode(report), type=RoutingReport) == report


@pytest.mark.parametrize(
    ("scores", "small", "large", "message"),
    [
        ([0.1, 0.2], [True], [True, False], "lengths differ"),
        ([0.1, float("nan")], [True, True], [True, False], "finite"),
        ([0.1, 0.2], [True, 1.5], [True, False], r"\[0, 1\]"),
        ([], [], [], "no prompts"),
    ],
)
def test_bad_input_is_rejected(
    scores: list[float], small: list[float], large: list[float], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        evaluate(scores, small, large)
