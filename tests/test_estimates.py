"""Live estimates: hand-computed cases, and a seeded simulation of the intervals'
coverage."""

from __future__ import annotations

import random
import uuid
from typing import Any

import pytest

from evaluator.replay_report import wilson as evaluator_wilson
from gateway.checks.estimates import (
    FEEDBACK_NOTE,
    MEANING,
    Estimate,
    LiveEstimates,
    wilson,
)
from gateway.checks.record import CheckRecord
from gateway.config.shadow import SHORTCUTS


def check(agree: bool | None, probability: float = 0.1, **fields: Any) -> CheckRecord:
    values: dict[str, Any] = {
        "id": uuid.uuid4().hex,
        "at": 1_700_000_000.0,
        "source": "shadow",
        "tenant": "acme",
        "shortcut": "small_route",
        "route": "small",
        "model": "auto",
        "probability": probability,
        "policy": "v1",
        "prompt": "q",
        "answer": "a",
        "agree": agree,
    }
    return CheckRecord(**(values | fields))


def only(estimates: LiveEstimates) -> Estimate:
    (estimate,) = estimates.snapshot()
    return estimate


def test_equal_probabilities_give_the_plain_wilson_interval() -> None:
    records = [check(agree=i >= 3) for i in range(20)]  # 3 of 20 disagree
    estimate = only(LiveEstimates.fold(records))
    assert estimate.rate == pytest.approx(0.15)
    assert (estimate.n, estimate.disagreed) == (20, 3)
    assert estimate.n_eff == pytest.approx(20.0)
    assert (estimate.low, estimate.high) == pytest.approx(evaluator_wilson(3, 20))
    assert (estimate.low, estimate.high) == pytest.approx((0.05237, 0.36042), abs=1e-5)
    assert estimate.meaning == "regret: the large path would change the answer"


def test_unequal_probabilities_weigh_each_check_by_one_over_its_probability() -> None:
    # Weights 2, 2, 4; the two that disagree weigh 2 and 4: rate 6/8. n_eff = 8²/24.
    records = [check(True, 0.5), check(False, 0.5), check(False, 0.25)]
    estimate = only(LiveEstimates.fold(records))
    assert estimate.rate == pytest.approx(0.75)
    assert estimate.n_eff == pytest.approx(64 / 24)
    assert (estimate.n, estimate.disagreed) == (3, 2)
    assert (estimate.low, estimate.high) == pytest.approx((0.23850, 0.96637), abs=1e-5)


def test_undecided_dropped_and_failed_checks_are_counted_apart() -> None:
    records = [
        check(True),
        check(False),
        check(None),  # the comparator could not tell
        check(None, status="dropped", reason="no capacity"),
        check(None, status="dropped", reason="no capacity"),
        check(None, status="dropped", reason="stale"),
        check(None, status="failed", reason="TimeoutError"),
    ]
    estimate = only(LiveEstimates.fold(records))
    assert estimate.rate == pytest.approx(0.5)
    assert (estimate.n, estimate.checked, estimate.undecided) == (2, 3, 1)
    assert estimate.dropped == {"no capacity": 2, "stale": 1}
    assert estimate.failed == 1


def test_estimates_are_per_tenant_and_shortcut() -> None:
    records = [
        check(False, tenant="globex", shortcut="early_stop", route="loop"),
        check(True, tenant="acme", shortcut="semantic_hit", route="semantic"),
        check(True, tenant="acme", shortcut="small_route"),
    ]
    estimates = LiveEstimates.fold(records).snapshot()
    assert [(e.tenant, e.shortcut, e.rate) for e in estimates] == [
        ("acme", "semantic_hit", 0.0),
        ("acme", "small_route", 0.0),
        ("globex", "early_stop", 1.0),
    ]
    assert [e.meaning for e in estimates] == [
        "disagreement with the engine",
        "regret: the large path would change the answer",
        "flip: running on to the budget changes the answer",
    ]
    assert set(MEANING) == set(SHORTCUTS)


def test_feedback_is_kept_apart_and_said_not_to_be_a_random_sample() -> None:
    def verdict(verdict: str, route: str = "small") -> CheckRecord:
        return check(None, 1.0, source="feedback", shortcut=None, route=route, verdict=verdict)

    records = [check(True), *(verdict(v) for v in ("wrong", "right", "right", "right"))]
    records.append(verdict("wrong", route="loop"))
    estimates = LiveEstimates.fold(records)
    estimate = only(estimates)
    assert (estimate.n, estimate.checked, estimate.rate) == (1, 1, 0.0)
    small, loop = sorted(estimates.feedback(), key=lambda f: f.route, reverse=True)
    assert (small.tenant, small.route, small.wrong, small.n) == ("acme", "small", 1, 4)
    assert small.rate == pytest.approx(0.25)
    assert (small.low, small.high) == pytest.approx(evaluator_wilson(1, 4))
    assert (loop.route, loop.wrong, loop.n, loop.rate) == ("loop", 1, 1, 1.0)
    report = estimates.report()
    assert FEEDBACK_NOTE in report.notes
    assert "not a random sample" in FEEDBACK_NOTE


def test_calibration_bins_confidence_against_agreement() -> None:
    records = [
        *(check(agree, confidence=0.95) for agree in (True, True, True, False)),
        check(True, confidence=0.1),
        check(False, confidence=0.1),
        check(None, confidence=0.5),  # undecided: not in calibration
        check(True),  # no confidence: not in calibration
    ]
    (calibration,) = LiveEstimates.fold(records).calibration()
    assert calibration.shortcut == "small_route"
    assert calibration.n == 6
    assert [b.n for b in calibration.bins] == [2, 0, 0, 0, 4]
    low, *_, high = calibration.bins
    assert (low.lower, low.upper, high.lower, high.upper) == pytest.approx((0, 0.2, 0.8, 1.0))
    assert (high.mean_confidence, high.agreement) == pytest.approx((0.95, 0.75))
    assert (high.low, high.high) == pytest.approx(evaluator_wilson(3, 4))
    assert (low.mean_confidence, low.agreement) == pytest.approx((0.1, 0.5))
    assert calibration.bins[1].agreement is None and calibration.bins[1].mean_confidence is None
    # ECE: 4/6 * |0.95 - 0.75| + 2/6 * |0.1 - 0.5|. The mean gap: mean confidence
    # (3.8 + 0.2) / 6 against agreement 4/6, even though neither bin is calibrated.
    assert calibration.ece == pytest.approx(4 / 6 * 0.2 + 2 / 6 * 0.4)
    assert calibration.mean_gap == pytest.approx(0.0)


def test_confidence_at_the_edges_falls_in_the_first_and_last_bins() -> None:
    records = [check(True, confidence=c) for c in (0.0, 0.2, 1.0)]
    (calibration,) = LiveEstimates.fold(records).calibration()
    assert [b.n for b in calibration.bins] == [1, 1, 0, 0, 1]


def test_records_that_cannot_be_weighted_are_left_out_and_counted() -> None:
    estimates = LiveEstimates.fold([check(True), check(False, probability=0.0)])
    assert only(estimates).n == 1
    assert estimates.report().ignored == 1


def test_adding_one_at_a_time_is_folding_the_list() -> None:
    rng = random.Random(7)
    records = [
        check(rng.random() < 0.8, rng.choice([0.05, 0.2, 1.0]), confidence=rng.random())
        for _ in range(200)
    ]
    live = LiveEstimates()
    for r in records:
        live.add(r)
    assert live.report() == LiveEstimates.fold(records).report()


def test_wilson_takes_a_fractional_sample_size() -> None:
    assert wilson(0.15, 20) == pytest.approx(evaluator_wilson(3, 20))
    low, high = wilson(0.0, 2.5)
    assert low == 0.0 and 0 < high < 1


# Strata of (events, true disagreement rate, probability of being checked): one
# probability for all, then two, the likelier-checked stratum disagreeing more often.
@pytest.mark.parametrize(
    "strata",
    [[(2000, 0.1, 0.05)], [(2000, 0.08, 0.05), (1000, 0.15, 0.1)]],
    ids=["equal probabilities", "two probabilities"],
)
def test_the_95_percent_interval_covers_the_true_rate_about_95_percent_of_the_time(
    strata: list[tuple[int, float, float]],
) -> None:
    rng = random.Random(20240534)
    truth = sum(n * rate for n, rate, _ in strata) / sum(n for n, _, _ in strata)
    covered = 0
    for _ in range(400):
        live = LiveEstimates()
        for events, rate, probability in strata:
            for _ in range(events):
                if rng.random() < probability:
                    live.add(check(rng.random() >= rate, probability))
        estimate = only(live)
        assert estimate.low is not None and estimate.high is not None
        covered += estimate.low <= truth <= estimate.high
    assert 0.90 <= covered / 400 <= 0.99
