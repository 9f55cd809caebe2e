"""Refitting the gateway's shortcuts from its own checks: the router, the loop's
calibrator and the cache verifier's calibration, each from the records of the
shortcut it decides.

Every label here is agreement with the path a shortcut skipped (or a caller's
verdict), not correctness: a router refitted on it learns where the small engine says
what the large path says, a calibrator where the loop's early answer is the one it
would end on. That is what a shortcut promises, and all the traffic can tell without
gold answers.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec
import numpy as np
import numpy.typing as npt

from cache.calibration import Calibration
from evaluator.calibration import Calibrator
from gateway.checks.record import CheckRecord
from router import calibrate
from router.fitting import THRESHOLD_FOLDS
from router.model_file import KNNModel, RouterModel
from router.outcomes import Outcome
from router.scorers import fit, need_for_large, scorer_for

Vectors = npt.NDArray[np.float32]

# Fewest labels each refit needs; with fewer, the part is left as it is.
MIN_ROUTER_LABELS = 20
MIN_CALIBRATOR_LABELS = 30
MIN_VERIFIER_LABELS = 30
# The grid the composed calibration map is written on.
_GRID = np.linspace(0.0, 1.0, 201)


def _checked(records: Iterable[CheckRecord], *shortcuts: str) -> list[CheckRecord]:
    return [
        r
        for r in records
        if r.source == "shadow"
        and r.status == "checked"
        and r.agree is not None
        and r.shortcut in shortcuts
    ]


def router_outcomes(records: Iterable[CheckRecord]) -> list[Outcome]:
    """Routing examples from the checks of both routes: a small engine's answer the
    large path would keep (small_route, agree), or a large path's answer the small
    engine would have given too (large_route, agree), says the small engine was
    enough; a disagreement says the large path was needed. A caller's verdict on a
    small engine's answer says so too."""
    return [
        Outcome(
            prompt=r.prompt,
            small_correct=bool(r.agree),
            large_correct=True,
            source=f"{r.shortcut} check",
        )
        for r in _checked(records, "small_route", "large_route")
    ]


def router_feedback(records: Iterable[CheckRecord]) -> list[Outcome]:
    """Routing examples from callers' verdicts on the small engine's answers (not a
    random sample: callers chose what to judge)."""
    return [
        Outcome(
            prompt=r.prompt,
            small_correct=r.verdict == "right",
            large_correct=True,
            source="feedback",
        )
        for r in records
        if r.source == "feedback" and r.route == "small" and r.verdict is not None
    ]


def refit_router(
    base: RouterModel,
    outcomes: Sequence[Outcome],
    vectors: Vectors,
    *,
    embedding: str,
    trained_on: str,
    seed: int = 0,
) -> KNNModel:
    """A kNN router over ``base``'s labelled examples and the traffic's, whose
    threshold sends the large path the share of the traffic that needed it, read off
    scores the traffic's examples get from routers fitted without them (as new prompts
    of the same kind would score)."""
    if base.embedding != embedding:
        raise ValueError(
            f"the router was fitted on embeddings {base.embedding!r}, the traffic's are "
            f"{embedding!r}: refit it from its outcomes with `satisfice router fit` first"
        )
    shipped = [
        Outcome(prompt=p, small_correct=1.0 - label, large_correct=1.0, source="shipped")
        for p, label in zip(base.prompts, base.labels, strict=True)
    ]
    k = base.k if isinstance(base, KNNModel) else 100
    temperature = base.temperature if isinstance(base, KNNModel) else 0.1
    every = [*shipped, *outcomes]
    matrix = np.vstack([base.matrix(), vectors]).astype(np.float32)
    model = fit("knn", every, matrix, embedding=embedding, k=k, temperature=temperature,
                trained_on=trained_on)  # fmt: skip
    assert isinstance(model, KNNModel)
    needed = float(np.mean([need_for_large(o) > 0 for o in outcomes]))
    scores = _traffic_scores(shipped, outcomes, base.matrix(), vectors, k, temperature, seed)
    threshold = calibrate.for_large_fraction(scores, needed).threshold
    return msgspec.structs.replace(model, threshold=threshold)


def _traffic_scores(
    shipped: Sequence[Outcome],
    outcomes: Sequence[Outcome],
    shipped_vectors: Vectors,
    vectors: Vectors,
    k: int,
    temperature: float,
    seed: int,
) -> npt.NDArray[np.float64]:
    """Each traffic example scored by a router of the shipped examples and the other
    folds of the traffic."""
    folds = min(THRESHOLD_FOLDS, len(outcomes))
    order = np.random.default_rng(seed).permutation(len(outcomes))
    scores = np.zeros(len(outcomes))
    for held_out in np.array_split(order, folds):
        train = np.setdiff1d(order, held_out)
        model = fit(
            "knn",
            [*shipped, *(outcomes[i] for i in train)],
            np.vstack([shipped_vectors, vectors[train]]),
            embedding="cv",
            k=k,
            temperature=temperature,
        )
        prompts = [outcomes[i].prompt for i in held_out]
        scores[held_out] = scorer_for(model).score(vectors[held_out], prompts)
    return scores


def calibrator_labels(
    records: Iterable[CheckRecord], *, agreement: bool = False
) -> tuple[list[float], list[bool]]:
    """The loop's P(correct), and whether its answer was right: callers' verdicts on
    the loop's answers; with ``agreement``, also each checked early stop's P and
    whether running on to the budget kept its answer.

    A loop that kept its greedy pass (stop "greedy") is left out: its P is the greedy
    calibrator's, which a refit of the vote's calibrator must not learn from.

    Agreement is not correctness: on held-out ARC and GSM8K the loop's early answer
    agreed with its budget answer 93% of the time and was right 52% of the time, and a
    calibrator fitted to agreement was 4.5 times worse calibrated against gold
    (docs/benchmarks.md, "Learning from the checks"). So agreement labels are an
    opt-in, for a loop whose P should mean "thinking on would not change this"."""
    records = list(records)
    confidences, labels = [], []
    if agreement:
        for r in _checked(records, "early_stop"):
            assert r.confidence is not None and r.agree is not None
            if r.stop == "greedy":
                continue
            confidences.append(r.confidence)
            labels.append(r.agree)
    for r in records:
        voted = r.route == "loop" and r.stop != "greedy"
        if r.source == "feedback" and voted and r.confidence is not None:
            confidences.append(r.confidence)
            labels.append(r.verdict == "right")
    return confidences, labels


def recalibrate(
    base: Calibrator,
    confidences: Sequence[float],
    labels: Sequence[bool],
    *,
    trained_on: str,
) -> Calibrator:
    """``base`` with its P(correct) mapped again, by an isotonic regression of the
    labels on the P it gave, composed into the file's own isotonic map.

    The checks only see P where the loop stopped (at or above its threshold), so
    below the lowest P seen the new map never raises a P (it keeps the lower of the
    old P and the new map's lowest value): it cannot make the loop stop earlier where
    nothing was checked."""
    xs, ys = calibration_map(confidences, labels)
    old = _GRID if not base.isotonic_x else np.interp(_GRID, base.isotonic_x, base.isotonic_y)
    return msgspec.structs.replace(
        base,
        isotonic_x=_GRID.tolist(),
        isotonic_y=np.interp(old, xs, ys).tolist(),
        labels=len(labels),
        positives=sum(bool(label) for label in labels),
        trained_on=trained_on,
    )


def calibration_map(
    confidences: Sequence[float], labels: Sequence[bool]
) -> tuple[list[float], list[float]]:
    """The map, on a grid of P in force, to the new P: an isotonic regression of the
    labels on the P in force; below the lowest P seen, the lower of the old P and the
    new map's lowest value (never raised where nothing was checked)."""
    from sklearn.isotonic import IsotonicRegression

    x = np.asarray(confidences, dtype=np.float64)
    y = np.asarray(labels, dtype=np.float64)
    if len(x) != len(y) or len(x) == 0:
        raise ValueError("recalibrating needs as many labels as confidences, and some")
    isotonic = IsotonicRegression(y_min=0.0, y_max=1.0, out_of_bounds="clip")
    isotonic.fit(x, y)
    grid = _GRID
    new = isotonic.predict(grid)
    lowest_seen = float(x.min())
    unseen = grid < lowest_seen
    new[unseen] = np.minimum(grid[unseen], float(isotonic.predict([lowest_seen])[0]))
    new = np.maximum.accumulate(new)  # monotone, as the seam may not be
    return grid.tolist(), new.tolist()


def verifier_labels(records: Iterable[CheckRecord]) -> tuple[list[float], list[bool]]:
    """Each checked semantic hit's verifier P, and whether the engine's answer now
    disagreed with the one served (a wrong hit, in the calibration's terms)."""
    scores, wrong = [], []
    for r in _checked(records, "semantic_hit"):
        if r.cache_score is not None:
            scores.append(r.cache_score)
            wrong.append(not r.agree)
    return scores, wrong


def verifier_calibration(
    base: Calibration, scores: Sequence[float], wrong: Sequence[bool], *, pairs: str
) -> Calibration:
    """A verifier calibration from the traffic's own semantic-hit checks.

    They are hits served at the operating point in force, not at operating point 0
    as ``satisfice cache calibrate``'s pairs are: the operating point found from them
    can rise above the one in force, never fall below it."""
    if len(scores) != len(wrong):
        raise ValueError("as many wrong flags as scores, please")
    return Calibration(
        verifier=base.verifier,
        pairs=pairs,
        queries=len(scores),
        scores=[float(s) for s in scores],
        wrong=[bool(w) for w in wrong],
        confidence=base.confidence,
    )
