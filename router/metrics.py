"""Routing quality, measured the way RouteLLM measures it.

RouteLLM (lm-sys/RouteLLM, ``routellm/evals/evaluate.py`` and ``benchmarks.py``) is
where the published router figures come from, so every definition here follows its
code, quirks included, to keep our numbers comparable with theirs:

* the quality curve: thresholds are the ``num_results`` + 1 quantile edges of the
  router's scores (``pd.qcut(scores, num_results, retbins=True)``); at each threshold
  prompts scoring ``>=`` it go to the large model, except at the last edge (the
  maximum), where ``>`` is used so that the curve reaches 0 % large calls;
* CPT(p): the % of large calls needed to recover a fraction ``p`` of the gap between
  the small and the large model, read off the curve with ``np.interp``;
* AUC: the trapezoid area under accuracy (%) over the fraction of large calls (0..1);
  APGR: that area's share of the gap between always-small and always-large.

A score is "how much this prompt needs the large model": higher means route to large.
Accuracies and call shares are percentages (0..100), as in RouteLLM; correctness may
be a bool or a graded float in [0, 1].
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import msgspec
import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]

# RouteLLM calls np.trapz, which NumPy 2.4 removed; np.trapezoid is the same rule under
# its new name but only exists from NumPy 2.0, and the project still allows 1.26.
_TRAPEZOID = cast(
    "Callable[..., Any]", getattr(np, "trapezoid", None) or getattr(np, "trapz", None)
)


class CurvePoint(msgspec.Struct, frozen=True):
    threshold: float  # scores at or above it went to large (strictly above at the top edge)
    large_pct: float  # % of prompts sent to the large model
    accuracy: float  # % correct (mean graded score x 100)


class OraclePoint(msgspec.Struct, frozen=True):
    large_pct: float
    accuracy: float


class RoutingReport(msgspec.Struct, frozen=True):
    n: int
    small_accuracy: float  # always-small, %
    large_accuracy: float  # always-large, %
    cpt50: float  # % large calls for 50 % of the quality gap
    cpt80: float
    apgr: float  # 0 = no better than always-small, 1 = as good as always-large
    auc: float  # accuracy % x fraction of large calls
    random_apgr: float  # expected APGR of a router that scores at random (about 0.5)
    roc_auc: float  # how well the score ranks "large strictly better than small"
    curve: list[CurvePoint]  # sorted by large_pct
    oracle: list[OraclePoint]  # best possible accuracy at 0, 10, .., 100 % large calls


def evaluate(
    scores: npt.ArrayLike,
    small: npt.ArrayLike,
    large: npt.ArrayLike,
    num_results: int = 10,
) -> RoutingReport:
    """Everything in one report. ``scores[i]`` is the router's score for prompt ``i``;
    ``small[i]``/``large[i]`` are how correct each model was on it."""
    s, w, g = _check(scores, small, large)
    weak, strong = model_accuracy(w), model_accuracy(g)
    curve = quality_curve(s, w, g, num_results)
    return RoutingReport(
        n=len(s),
        small_accuracy=weak,
        large_accuracy=strong,
        cpt50=cpt(curve, weak, strong, 0.5),
        cpt80=cpt(curve, weak, strong, 0.8),
        apgr=apgr(curve, weak, strong),
        auc=auc(curve),
        random_apgr=random_apgr(w, g, num_results),
        roc_auc=roc_auc(s, w, g),
        curve=curve,
        oracle=oracle_curve(w, g),
    )


def model_accuracy(correct: npt.ArrayLike) -> float:
    """% correct. RouteLLM counts ``== True``; the mean is the same for booleans and
    also gives graded scores their due."""
    return float(np.mean(_unit_floats(correct, "correct"))) * 100


def quality_curve(
    scores: npt.ArrayLike,
    small: npt.ArrayLike,
    large: npt.ArrayLike,
    num_results: int = 10,
) -> list[CurvePoint]:
    """Accuracy against % large calls at RouteLLM's thresholds, sorted by % large.

    ``pd.qcut`` would raise on repeated bin edges (a router with many tied scores);
    here repeated edges just give repeated points, which change neither AUC nor CPT.
    """
    if num_results < 1:
        raise ValueError("num_results must be at least 1")
    s, w, g = _check(scores, small, large)
    # np.quantile's default (linear) interpolation is what pandas' qcut uses.
    thresholds = np.quantile(s, np.linspace(0, 1, num_results + 1))
    points = []
    for i, threshold in enumerate(thresholds):
        last = i == len(thresholds) - 1
        to_large = s > threshold if last else s >= threshold
        accuracy = float(np.mean(np.where(to_large, g, w))) * 100
        points.append(CurvePoint(float(threshold), _pct(to_large), accuracy))
    return _sorted(points)


def cpt(curve: list[CurvePoint], weak_acc: float, strong_acc: float, pct: float) -> float:
    """% of large calls needed to reach ``weak + pct * (strong - weak)`` accuracy.

    Exactly RouteLLM's ``np.interp`` over the curve sorted by % large, with accuracy
    as x. np.interp assumes x increases; when a curve dips (a poor router can do worse
    than always-small part of the way) the answer comes from whichever segment numpy
    lands in. We keep that so that figures compare with theirs; on a curve whose
    accuracy never falls it is the true crossing point. Targets beyond the curve's
    accuracy range clamp to its ends.
    """
    points = _sorted(curve)
    target = pct * (strong_acc - weak_acc) + weak_acc
    accuracies = [p.accuracy for p in points]
    shares = [p.large_pct for p in points]
    return float(np.interp(target, accuracies, shares))


def auc(curve: list[CurvePoint]) -> float:
    points = _sorted(curve)
    return _area([p.accuracy for p in points], points)


def apgr(curve: list[CurvePoint], weak_acc: float, strong_acc: float) -> float:
    """(AUC - weak AUC) / (strong AUC - weak AUC); NaN when the two models tie.

    The baselines are integrated over the curve's own x points, as RouteLLM does, so a
    curve that does not span 0..100 % is compared with baselines over the same span.
    """
    points = _sorted(curve)
    weak = _area([weak_acc] * len(points), points)
    strong = _area([strong_acc] * len(points), points)
    if strong == weak:
        return float("nan")
    return (_area([p.accuracy for p in points], points) - weak) / (strong - weak)


def random_curve(
    small: npt.ArrayLike, large: npt.ArrayLike, num_results: int = 10
) -> list[CurvePoint]:
    """The expected curve of RouteLLM's random router (uniform scores, no ties).

    Computed analytically rather than by sampling: with untied scores the share of
    large calls at each threshold depends only on the number of prompts, so we take
    it from the same threshold code run on any untied scores; and when k of n prompts
    go to large at random, each prompt is there with probability k/n, so expected
    accuracy is exactly ``weak + k/n * (strong - weak)``. Averaging seeded random-score
    curves, as RouteLLM does over 10 runs, converges to this.
    """
    w = _unit_floats(small, "small")
    g = _unit_floats(large, "large")
    weak, strong = model_accuracy(w), model_accuracy(g)
    untied = np.arange(len(w), dtype=np.float64)
    # The thresholds of a random router mean nothing, so they are left as NaN.
    return [
        CurvePoint(float("nan"), p.large_pct, weak + p.large_pct / 100 * (strong - weak))
        for p in quality_curve(untied, w, g, num_results)
    ]


def random_apgr(small: npt.ArrayLike, large: npt.ArrayLike, num_results: int = 10) -> float:
    """APGR of :func:`random_curve`. The expected curve is a straight line from 0 % to
    100 % large calls, which the trapezoid rule integrates exactly, so this is 0.5 up
    to rounding (NaN when the two models tie); it is computed, not assumed, so that any
    change to the curve code shows up here too."""
    w = _unit_floats(small, "small")
    g = _unit_floats(large, "large")
    return apgr(random_curve(w, g, num_results), model_accuracy(w), model_accuracy(g))


def roc_auc(scores: npt.ArrayLike, small: npt.ArrayLike, large: npt.ArrayLike) -> float:
    """ROC AUC of the score for "the large model did strictly better than the small".

    This is how well the score ranks the prompts that need the large model, free of the
    curve's thresholds (a tied score counts half). NaN when either class is empty,
    where sklearn's roc_auc_score would raise.
    """
    from sklearn.metrics import roc_auc_score  # a second to import: only when measuring

    s, w, g = _check(scores, small, large)
    positive = g > w
    if positive.all() or not positive.any():
        return float("nan")
    return float(roc_auc_score(positive, s))


def oracle_curve(small: npt.ArrayLike, large: npt.ArrayLike) -> list[OraclePoint]:
    """Best accuracy reachable at 0, 10, .., 100 % large calls (RouteLLM's
    ``get_optimal_accuracy``): small's score plus the biggest gains from switching.

    RouteLLM adds ``min(n * share, #(small wrong and large right))``, a possibly
    fractional number of calls. For graded scores we take the largest per-prompt gains
    ``max(large - small, 0)`` first and the fractional call as that fraction of the next
    gain, which is the same number when scores are booleans.
    """
    w = _unit_floats(small, "small")
    g = _unit_floats(large, "large")
    _same_length(w, g)
    n = len(w)
    gains = np.sort(np.clip(g - w, 0, None))[::-1]
    best_bonus = np.concatenate([[0.0], np.cumsum(gains)])
    points = []
    for share in range(0, 101, 10):
        bonus = float(np.interp(n * share / 100, np.arange(n + 1), best_bonus))
        points.append(OraclePoint(float(share), (float(w.sum()) + bonus) / n * 100))
    return points


def _area(accuracies: list[float], points: list[CurvePoint]) -> float:
    shares = np.array([p.large_pct for p in points]) / 100
    return float(_TRAPEZOID(np.array(accuracies, dtype=np.float64), shares))


def _sorted(points: list[CurvePoint]) -> list[CurvePoint]:
    # Equal shares come from identical selections (each is "the top k scores"), hence
    # equal accuracy, so the order among them cannot change any figure.
    return sorted(points, key=lambda p: p.large_pct)


def _pct(mask: npt.NDArray[np.bool_]) -> float:
    return float(mask.sum()) / len(mask) * 100


def _check(
    scores: npt.ArrayLike, small: npt.ArrayLike, large: npt.ArrayLike
) -> tuple[FloatArray, FloatArray, FloatArray]:
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    if not np.isfinite(s).all():
        raise ValueError("scores must be finite numbers")
    w = _unit_floats(small, "small")
    g = _unit_floats(large, "large")
    _same_length(s, w, g)
    return s, w, g


def _unit_floats(values: npt.ArrayLike, name: str) -> FloatArray:
    array = np.asarray(values, dtype=np.float64).reshape(-1)
    if len(array) == 0:
        raise ValueError(f"{name}: no prompts")
    if not ((array >= 0) & (array <= 1)).all():
        raise ValueError(f"{name}: correctness must lie in [0, 1]")
    return array


def _same_length(*arrays: FloatArray) -> None:
    if len({len(a) for a in arrays}) != 1:
        raise ValueError(f"lengths differ: {[len(a) for a in arrays]}")
