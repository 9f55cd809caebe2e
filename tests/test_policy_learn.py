"""Refitting the shortcuts from their checks (gateway.checks.refit) and a policy version
learned from an outcome store (gateway.checks.learn), on synthetic check records with
real prompts, embedded by the bundled embedder."""

from __future__ import annotations

import random
import uuid
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from cache.calibration import Calibration, OperatingPoints, read_calibration
from evaluator.calibration import Calibrator, calibrator_file, read_calibrator
from gateway.checks import refit
from gateway.checks.learn import HELD_OUT, InForce, learn
from gateway.checks.record import CheckRecord
from gateway.checks.versions import SHIPPED
from router.embedder import Embedder, EmbedderSettings, Vectors
from router.model_file import RouterModel, read_router
from router.router import router_file
from router.scorers import scorer_for
from router.settings import RouterSettings

# -- synthetic traffic --------------------------------------------------------------

_NAMES = ["Tom", "Maria", "Aisha", "Ken", "Lena", "Omar", "Priya", "Jack", "Sofia", "Ravi"]
_THINGS = ["apples", "marbles", "books", "stickers", "pencils", "cookies", "coins", "cards"]
_WORD_PROBLEMS = [
    "{a} has {x} {t} and buys {y} more every day for {z} days. How many {t} does {a} have?",
    "{a} sells {x} {t} for ${y} each and spends ${z} on supplies. What is {a}'s profit?",
    "A box holds {x} {t}. {a} fills {y} boxes and gives away {z} {t}. How many are left?",
    "{a} reads {x} pages a day. The book has {y} pages and {a} has read {z}. How many "
    "more days until {a} finishes?",
    "{a} splits {x} {t} equally among {y} friends and keeps the {z} left over. How many "
    "{t} does each friend get?",
]
_COUNTRIES = [
    "France", "Japan", "Canada", "Kenya", "Peru", "Norway", "Egypt", "Chile", "India", "Spain",
    "Italy", "Brazil", "Mexico", "Ghana", "Poland", "Greece", "Sweden", "Turkey", "Vietnam",
    "Portugal", "Argentina", "Morocco", "Ireland", "Thailand", "Finland",
]  # fmt: skip
_GREETINGS = [
    "Hello! How are you today?", "Hi there, good morning!", "Hey, nice to meet you.",
    "Good evening, how has your day been?", "Hello, thanks for your help earlier!",
    "Hi! Hope you are having a great week.", "Good afternoon, how are things?",
    "Hey there, what's up?", "Howdy, friend!", "Greetings, and welcome back!",
]  # fmt: skip


def word_problem(rng: random.Random) -> str:
    return rng.choice(_WORD_PROBLEMS).format(
        a=rng.choice(_NAMES), t=rng.choice(_THINGS),
        x=rng.randint(12, 90), y=rng.randint(3, 30), z=rng.randint(2, 11),
    )  # fmt: skip


def easy_prompt(rng: random.Random) -> str:
    if rng.random() < 0.5:
        return rng.choice(_GREETINGS)
    return f"What is the capital of {rng.choice(_COUNTRIES)}?"


def check(
    at: float,
    shortcut: Any = "small_route",
    *,
    agree: bool | None = True,
    prompt: str = "What is the capital of France?",
    probability: float = 1.0,
    status: Any = "checked",
    source: Any = "shadow",
    route: str = "small",
    verdict: Any = None,
    confidence: float | None = None,
    cache_score: float | None = None,
    stop: str | None = None,
) -> CheckRecord:
    return CheckRecord(
        id=uuid.uuid4().hex, at=at, source=source, status=status, tenant="default",
        shortcut=shortcut, route=route, model="auto", probability=probability,
        policy=SHIPPED, prompt=prompt, answer="an answer", agree=agree, verdict=verdict,
        confidence=confidence, cache_score=cache_score, stop=stop,
    )  # fmt: skip


def routed_traffic(count: int, seed: int = 0) -> list[CheckRecord]:
    """Half word problems, which the large path always answers otherwise than the
    small engine, half greetings and capitals, on which they always agree; every one
    routed small by the router in force (a threshold pinned above every score), each
    drawn for checking with probability 0.5."""
    rng = random.Random(seed)
    records = []
    for i in range(count):
        hard = i % 2 == 0
        prompt = word_problem(rng) if hard else easy_prompt(rng)
        records.append(check(1_000.0 + i, agree=not hard, prompt=prompt, probability=0.5))
    rng.shuffle(records)  # the store's order is not the time order
    return records


@pytest.fixture(scope="module")
async def embedder() -> AsyncIterator[Embedder]:
    embedder = Embedder(EmbedderSettings())
    await embedder.start()
    yield embedder
    await embedder.close()


def embedding(embedder: Embedder) -> Any:
    """``learn``'s embed: prompts to vectors, and the embedder's fingerprint."""

    def embed(prompts: list[str]) -> tuple[Vectors, str]:
        return embedder.encode(prompts), embedder.fingerprint

    return embed


def shipped_router() -> RouterModel:
    return read_router(router_file(RouterSettings()))


def in_force(
    router: RouterModel | None = None,
    calibrator: Calibrator | None = None,
    verifier: Calibration | None = None,
) -> InForce:
    return InForce(
        version=SHIPPED,
        router=router,
        router_threshold=None,
        calibrator=calibrator,
        loop_threshold=None if calibrator is None else 0.5,
        verifier=verifier,
        max_false_hit_rate=None if verifier is None else BOUND,
    )


# -- the router's labels ------------------------------------------------------------


def test_router_outcomes_are_agreement_with_the_skipped_path_from_checks_only() -> None:
    records = [
        check(1, "small_route", agree=True, prompt="agree small"),
        check(2, "small_route", agree=False, prompt="differ small"),
        check(3, "large_route", agree=True, prompt="agree large"),
        check(4, "large_route", agree=False, prompt="differ large"),
        check(5, "small_route", agree=None, prompt="undecided"),
        check(6, "small_route", status="dropped", agree=None, prompt="dropped"),
        check(7, "small_route", status="failed", agree=False, prompt="failed"),
        check(8, "early_stop", agree=False, prompt="another shortcut"),
        check(9, "small_route", source="feedback", verdict="wrong", prompt="a verdict"),
    ]
    outcomes = refit.router_outcomes(records)
    assert [(o.prompt, o.small_correct, o.large_correct) for o in outcomes] == [
        ("agree small", True, True),
        ("differ small", False, True),
        ("agree large", True, True),
        ("differ large", False, True),
    ]
    assert {o.source for o in outcomes} == {"small_route check", "large_route check"}


def test_router_feedback_is_callers_verdicts_on_the_small_engines_answers() -> None:
    records = [
        check(1, None, source="feedback", verdict="right", prompt="right", agree=None),
        check(2, None, source="feedback", verdict="wrong", prompt="wrong", agree=None),
        check(3, None, source="feedback", verdict="wrong", route="loop", prompt="loop"),
        check(4, "small_route", agree=False, prompt="a check"),
    ]
    assert [(o.prompt, o.small_correct, o.source) for o in refit.router_feedback(records)] == [
        ("right", True, "feedback"),
        ("wrong", False, "feedback"),
    ]


# -- the calibrator -----------------------------------------------------------------


def _labelled(seed: int, low: float, count: int = 400) -> tuple[list[float], list[bool]]:
    """Confidences in [low, 1) whose answers held with probability rising with them."""
    rng = np.random.default_rng(seed)
    confidences = rng.uniform(low, 1.0, count)
    held = rng.random(count) < confidences**3
    return confidences.tolist(), held.tolist()


@pytest.mark.parametrize(("seed", "low"), [(0, 0.4), (1, 0.7), (2, 0.9)])
def test_the_calibration_map_is_monotone_and_never_raises_p_where_nothing_was_seen(
    seed: int, low: float
) -> None:
    confidences, labels = _labelled(seed, low)
    xs, ys = (np.asarray(v) for v in refit.calibration_map(confidences, labels))
    assert xs[0] == 0.0 and xs[-1] == 1.0
    assert np.all(np.diff(ys) >= 0), "not monotone"
    assert np.all((ys >= 0) & (ys <= 1))
    unseen = xs < min(confidences)
    assert unseen.any() and np.all(ys[unseen] <= xs[unseen])


def test_a_map_from_answers_that_always_held_changes_nothing_below_the_lowest_seen() -> None:
    confidences = np.linspace(0.8, 0.99, 50).tolist()
    xs, ys = (np.asarray(v) for v in refit.calibration_map(confidences, [True] * 50))
    below = xs < 0.8
    assert np.allclose(ys[below], xs[below])  # not raised to the 1.0 seen above
    assert np.allclose(ys[xs >= 0.8], 1.0)
    with pytest.raises(ValueError, match="as many labels"):
        refit.calibration_map([0.5, 0.6], [True])


def _bundled_calibrator(isotonic: tuple[list[float], list[float]] | None = None) -> Calibrator:
    base = read_calibrator(calibrator_file("bundled"))
    if isotonic is None:
        return base
    return Calibrator(
        features=base.features, signals=base.signals, mean=base.mean, scale=base.scale,
        weights=base.weights, bias=base.bias, isotonic_x=isotonic[0], isotonic_y=isotonic[1],
    )  # fmt: skip


@pytest.mark.parametrize(
    "isotonic",
    [None, ([0.0, 0.2, 0.5, 1.0], [0.0, 0.1, 0.6, 1.0]), ([0.0, 0.3, 1.0], [0.05, 0.5, 0.98])],
)
def test_a_recalibrated_calibrator_keeps_the_order_and_never_raises_a_low_p(
    isotonic: tuple[list[float], list[float]] | None,
) -> None:
    base = _bundled_calibrator(isotonic)
    rows = np.random.default_rng(3).normal(size=(2000, len(base.features)))
    old = base.predict(rows)
    # Checks only see the loop's early stops: P in force at or above 0.6.
    confidences, labels = _labelled(4, 0.6)
    new = refit.recalibrate(base, confidences, labels, trained_on="test").predict(rows)
    order = np.argsort(old, kind="stable")
    assert np.all(np.diff(new[order]) >= -1e-12), "the order of P changed"
    below = old < min(confidences)
    assert below.sum() > 100
    # The composed map is written on a grid of 201 points: within its step of the old P.
    assert np.all(new[below] <= old[below] + 0.005)
    recalibrated = refit.recalibrate(base, confidences, labels, trained_on="test")
    assert (recalibrated.labels, recalibrated.positives) == (len(labels), sum(labels))
    assert recalibrated.trained_on == "test" and recalibrated.features == base.features


def test_calibrator_labels_are_early_stop_checks_and_verdicts_on_the_loop() -> None:
    records = [
        check(1, "early_stop", agree=True, confidence=0.9),
        check(2, "early_stop", agree=False, confidence=0.7),
        check(3, "early_stop", agree=None, confidence=0.8),
        check(4, "small_route", agree=False, confidence=0.6),
        check(5, None, source="feedback", route="loop", verdict="wrong", confidence=0.95),
        check(6, None, source="feedback", route="small", verdict="wrong", confidence=0.5),
        # A kept greedy pass's P is the greedy calibrator's: not the vote's to learn.
        check(7, "early_stop", agree=True, confidence=0.3, stop="greedy"),
        check(
            8,
            None,
            source="feedback",
            route="loop",
            verdict="right",
            confidence=0.2,
            stop="greedy",
        ),
    ]
    # Verdicts are correctness; agreement with the budget's answer is an opt-in.
    assert refit.calibrator_labels(records) == ([0.95], [False])
    on_agreement = refit.calibrator_labels(records, agreement=True)
    assert on_agreement == ([0.9, 0.7, 0.95], [True, False, False])


# -- the verifier -------------------------------------------------------------------


BOUND = 0.1  # the config's default max_false_hit_rate


def _hits_above(
    threshold: float, count: int, wrong_below: float, seed: int
) -> tuple[list[float], list[bool]]:
    """Semantic hits served at ``threshold`` (P at or above it): half of those under
    ``wrong_below`` wrong, none above."""
    rng = np.random.default_rng(seed)
    scores = rng.uniform(threshold, 1.0, count)
    wrong = (scores < wrong_below) & (rng.random(count) < 0.5)
    return scores.tolist(), wrong.tolist()


def test_hits_that_disagree_often_raise_the_operating_point() -> None:
    base = read_calibration()
    current = OperatingPoints(base).threshold(BOUND)
    assert 0 < current < 0.99
    scores, wrong = _hits_above(current, 2000, (current + 1) / 2, seed=5)
    new = refit.verifier_calibration(base, scores, wrong, pairs="test")
    assert new.verifier == base.verifier and new.queries == 2000
    raised = OperatingPoints(new).threshold(BOUND)
    assert raised > current
    assert raised >= (current + 1) / 2 - 0.05  # about where the wrong hits end


def test_hits_that_always_agree_never_lower_the_operating_point() -> None:
    # They were served at the operating point in force: below it nothing was seen.
    base = read_calibration()
    current = OperatingPoints(base).threshold(BOUND)
    scores, wrong = _hits_above(current, 2000, 0.0, seed=6)
    assert not any(wrong)
    new = refit.verifier_calibration(base, scores, wrong, pairs="test")
    assert OperatingPoints(new).threshold(BOUND) >= current


def test_verifier_labels_are_semantic_hit_checks_with_a_score() -> None:
    records = [
        check(1, "semantic_hit", agree=True, cache_score=0.97),
        check(2, "semantic_hit", agree=False, cache_score=0.91),
        check(3, "semantic_hit", agree=False),
        check(4, "exact_hit", agree=False, cache_score=0.99),
    ]
    assert refit.verifier_labels(records) == ([0.97, 0.91], [False, True])


# -- a version learned --------------------------------------------------------------


def _router_comparison(manifest: Any) -> Any:
    (comparison,) = [c for c in manifest.comparisons if c.part == "router"]
    return comparison


def test_learn_refits_on_the_oldest_and_compares_on_the_newest_it_never_saw(
    embedder: Embedder,
) -> None:
    records = routed_traffic(100)
    # The newest 30% of the checks were routed large by then (large_route): the
    # comparison, which only the held-out checks feed, must see them and only them.
    newest = sorted(records, key=lambda r: r.at)[70:]
    records = [
        check(r.at, "large_route", agree=r.agree, prompt=r.prompt, probability=0.5)
        if r in newest else r
        for r in records
    ]  # fmt: skip
    version = learn(records, in_force(router=shipped_router()), embedding(embedder))
    assert round(100 * HELD_OUT) == 30
    assert version.manifest.fitted == {"router": 70}
    comparison = _router_comparison(version.manifest)
    assert comparison.checks == 30
    assert comparison.live_cost == 1.0  # all 30 went large, none of the 70 did
    assert version.manifest.records == 100 and version.manifest.parent == SHIPPED
    assert version.manifest.created_at == 1_099.0


def test_a_refitted_router_has_lower_regret_where_a_cluster_always_disagrees(
    embedder: Embedder,
) -> None:
    shipped = shipped_router()
    version = learn(routed_traffic(200), in_force(router=shipped), embedding(embedder))
    router = version.router
    assert router is not None and router.embedding == embedder.fingerprint
    assert router.embedding == shipped.embedding
    comparison = _router_comparison(version.manifest)
    assert comparison.checks == 60
    live, candidate = comparison.live, comparison.candidate
    assert live.rate is not None and candidate.rate is not None
    assert live.rate == pytest.approx(0.5)  # every word problem went small
    assert candidate.rate < 0.1 < live.rate
    assert candidate.high is not None and live.low is not None and candidate.high < live.low
    # It pays for it with large calls: about the word problems' share.
    assert comparison.live_cost == 0.0
    assert comparison.candidate_cost is not None and 0.35 < comparison.candidate_cost < 0.7
    assert live.n == pytest.approx(60.0)  # equal weights: effective size = count
    # New prompts of the same kinds route by cluster.
    rng = random.Random(99)
    hard = [word_problem(rng) for _ in range(20)]
    easy = [easy_prompt(rng) for _ in range(20)]
    vectors = embedder.encode(hard + easy)
    scores = scorer_for(router).score(vectors, hard + easy)
    large = np.asarray(scores) >= router.threshold
    assert large[:20].mean() >= 0.9 and large[20:].mean() <= 0.1


def _calibrator_checks(count: int, seed: int, start: float = 2_000.0) -> list[CheckRecord]:
    """Early stops checked every 2 s from ``start``."""
    confidences, labels = _labelled(seed, 0.5, count)
    return [
        check(start + 2 * i, "early_stop", agree=held, confidence=c, route="loop")
        for i, (c, held) in enumerate(zip(confidences, labels, strict=True))
    ]


def _verifier_checks(count: int, current: float, seed: int, start: float) -> list[CheckRecord]:
    """Semantic hits checked every 2 s from ``start``, served at ``current``."""
    scores, wrong = _hits_above(current, count, (current + 1) / 2, seed)
    return [
        check(start + 2 * i, "semantic_hit", agree=not w, cache_score=s, route="semantic")
        for i, (s, w) in enumerate(zip(scores, wrong, strict=True))
    ]


def test_parts_with_too_few_labels_or_switched_off_are_left_with_a_note(
    embedder: Embedder,
) -> None:
    # 30 checks, the newest 9 held out: all 10 router checks (made first) and 11
    # early stops are left to fit on.
    few = routed_traffic(10)
    base_calibrator = _bundled_calibrator()
    version = learn(
        [*few, *_calibrator_checks(20, 7, start=1_000.5)],
        in_force(router=shipped_router(), calibrator=base_calibrator),
        embedding(embedder),
        calibrate_on_agreement=True,
    )
    assert version.router is None and version.calibrator is None and version.verifier is None
    assert version.manifest.fitted == {} and version.manifest.comparisons == []
    assert version.manifest.notes == [
        f"router: 10 labels, {refit.MIN_ROUTER_LABELS} needed",
        f"calibrator: 11 labels, {refit.MIN_CALIBRATOR_LABELS} needed",
        "verifier: off in this config, not recalibrated",
    ]
    off = learn(few, in_force(), embedding(embedder))
    assert off.manifest.notes == [
        "router: off in this config, not refitted",
        "calibrator: the loop or its calibrator is off, not refitted",
        "verifier: off in this config, not recalibrated",
    ]
    assert learn([], in_force(), embedding(embedder)).manifest.records == 0


def test_feedback_counts_toward_the_refit_but_never_toward_the_held_out_share(
    embedder: Embedder,
) -> None:
    checks = routed_traffic(20)  # 14 to fit on
    verdicts = [
        check(5_000.0 + i, None, source="feedback", verdict="wrong", agree=None,
              prompt=f"What is {i} times {i + 7}?")
        for i in range(6)
    ]  # fmt: skip
    version = learn([*checks, *verdicts], in_force(router=shipped_router()), embedding(embedder))
    assert version.manifest.fitted == {"router": 20}
    assert _router_comparison(version.manifest).checks == 6


def test_the_calibrator_and_the_verifier_are_refitted_and_compared(embedder: Embedder) -> None:
    base_verifier = read_calibration()
    current = OperatingPoints(base_verifier).threshold(BOUND)
    # Taken in turns: of 1000 checks the newest 300 are held out, 150 of each.
    records = [
        *_calibrator_checks(500, 8, start=2_000.0),
        *_verifier_checks(500, current, 9, start=2_001.0),
    ]
    random.Random(1).shuffle(records)
    by_default = learn(
        records,
        in_force(calibrator=_bundled_calibrator(), verifier=base_verifier),
        embedding(embedder),
    )
    assert by_default.manifest.fitted == {"verifier": 350}  # no verdicts: no calibrator
    version = learn(
        records,
        in_force(calibrator=_bundled_calibrator(), verifier=base_verifier),
        embedding(embedder),
        calibrate_on_agreement=True,
    )
    assert version.manifest.fitted == {"calibrator": 350, "verifier": 350}
    assert version.calibrator is not None and version.calibration_map is not None
    assert version.calibrator.labels == 350
    assert version.verifier is not None and version.verifier.queries == 350
    parts = {c.part: c for c in version.manifest.comparisons}
    assert parts["calibrator"].checks == parts["verifier"].checks == 150
    verifier = parts["verifier"]
    assert verifier.live.rate is not None and verifier.candidate.rate is not None
    assert verifier.candidate.rate < verifier.live.rate  # it serves fewer wrong hits
    assert verifier.candidate_cost is not None and 0.0 < verifier.candidate_cost < 1.0
    assert verifier.live_cost == 1.0
    # The loop's early stops held with probability P**3: a calibrator that says so
    # stops fewer of them, and fewer of those that would have changed.
    calibrator = parts["calibrator"]
    assert calibrator.live.rate is not None and calibrator.candidate.rate is not None
    assert calibrator.candidate.rate < calibrator.live.rate
    assert calibrator.candidate_cost is not None and calibrator.candidate_cost > 0.0
