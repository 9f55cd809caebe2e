"""A new policy version from the outcome store: each part refitted on the older checks
and compared with the version in force on the newer ones, which the refit never saw.

The comparison is off-policy on the checks themselves: a checked request has both
answers, the shortcut's and the skipped path's, so what either version would have
served is known, and each check is weighed by 1/probability it was drawn with.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from cache.calibration import Calibration, OperatingPoints
from evaluator.calibration import Calibrator
from gateway.checks import refit
from gateway.checks.estimates import wilson
from gateway.checks.record import CheckRecord
from gateway.checks.versions import Comparison, Manifest, PolicyVersion, Rate, new_id
from router.model_file import RouterModel
from router.scorers import scorer_for

Vectors = npt.NDArray[np.float32]
# Prompts to their embeddings, and the embedding model's fingerprint.
Embed = Callable[[list[str]], tuple[Vectors, str]]

# The newest share of the checks, kept out of every refit to compare versions on.
HELD_OUT = 0.3


class InForce:
    """The parts of the version in force: what a refit starts from and is compared to."""

    def __init__(
        self,
        version: str,
        router: RouterModel | None,
        router_threshold: float | None,
        calibrator: Calibrator | None,
        loop_threshold: float | None,
        verifier: Calibration | None,
        max_false_hit_rate: float | None,
    ) -> None:
        self.version = version
        self.router = router
        self.router_threshold = router_threshold  # None: the model file's
        self.calibrator = calibrator
        self.loop_threshold = loop_threshold
        self.verifier = verifier
        self.max_false_hit_rate = max_false_hit_rate


def learn(
    records: Sequence[CheckRecord],
    in_force: InForce,
    embed: Embed,
    *,
    calibrate_on_agreement: bool = False,
) -> PolicyVersion:
    """A version refitted from ``records`` (the store's, any order). The calibrator
    learns from callers' verdicts, and from early-stop checks' agreement only when
    ``calibrate_on_agreement`` (refit.calibrator_labels says why)."""
    ordered = sorted(records, key=lambda r: r.at)
    shadow = [r for r in ordered if r.source == "shadow" and r.status == "checked"]
    cut = len(shadow) - round(len(shadow) * HELD_OUT)
    fitting = [*shadow[:cut], *(r for r in ordered if r.source == "feedback")]
    held_out = shadow[cut:]
    vid = new_id()
    fitted: dict[str, int] = {}
    comparisons: list[Comparison] = []
    notes: list[str] = []

    router = None
    outcomes = [*refit.router_outcomes(fitting), *refit.router_feedback(fitting)]
    if in_force.router is None:
        notes.append("router: off in this config, not refitted")
    elif len(outcomes) < refit.MIN_ROUTER_LABELS:
        notes.append(f"router: {len(outcomes)} labels, {refit.MIN_ROUTER_LABELS} needed")
    else:
        vectors, fingerprint = embed([o.prompt for o in outcomes])
        router = refit.refit_router(
            in_force.router, outcomes, vectors, embedding=fingerprint,
            trained_on=f"{in_force.version} + {len(outcomes)} checks ({vid})",
        )  # fmt: skip
        fitted["router"] = len(outcomes)
        comparisons.append(_compare_routers(held_out, in_force, router, embed))

    calibrator, mapping = None, None
    confidences, labels = refit.calibrator_labels(fitting, agreement=calibrate_on_agreement)
    if in_force.calibrator is None or in_force.loop_threshold is None:
        notes.append("calibrator: the loop or its calibrator is off, not refitted")
    elif len(labels) < refit.MIN_CALIBRATOR_LABELS:
        notes.append(f"calibrator: {len(labels)} labels, {refit.MIN_CALIBRATOR_LABELS} needed")
    else:
        calibrator = refit.recalibrate(
            in_force.calibrator, confidences, labels,
            trained_on=f"{in_force.version} + {len(labels)} checks ({vid})",
        )  # fmt: skip
        mapping = refit.calibration_map(confidences, labels)
        fitted["calibrator"] = len(labels)
        comparisons.append(_compare_calibrators(held_out, in_force.loop_threshold, mapping))

    verifier = None
    scores, wrong = refit.verifier_labels(fitting)
    if in_force.verifier is None or in_force.max_false_hit_rate is None:
        notes.append("verifier: off in this config, not recalibrated")
    elif len(scores) < refit.MIN_VERIFIER_LABELS:
        notes.append(f"verifier: {len(scores)} labels, {refit.MIN_VERIFIER_LABELS} needed")
    else:
        verifier = refit.verifier_calibration(
            in_force.verifier, scores, wrong, pairs=f"{len(scores)} semantic-hit checks ({vid})"
        )
        fitted["verifier"] = len(scores)
        bound = in_force.max_false_hit_rate
        comparisons.append(_compare_verifiers(held_out, verifier, bound))

    manifest = Manifest(
        id=vid,
        created_at=ordered[-1].at if ordered else 0.0,
        parent=in_force.version,
        records=len(records),
        fitted=fitted,
        comparisons=comparisons,
        notes=notes,
    )
    return PolicyVersion(
        manifest=manifest,
        router=router,
        calibrator=calibrator,
        calibration_map=mapping,
        verifier=verifier,
    )


def _rate(weights: npt.NDArray[np.float64], hits: npt.NDArray[np.bool_]) -> Rate:
    """The weighted share of ``hits`` with its Wilson interval on the effective size."""
    total = float(weights.sum())
    if total == 0:
        return Rate(rate=None, low=None, high=None, n=0.0)
    rate = float(weights[hits].sum()) / total
    n_eff = total**2 / float((weights**2).sum())
    low, high = wilson(rate, n_eff)
    return Rate(rate=rate, low=low, high=high, n=n_eff)


def _share(weights: npt.NDArray[np.float64], chosen: npt.NDArray[np.bool_]) -> float | None:
    total = float(weights.sum())
    return None if total == 0 else float(weights[chosen].sum()) / total


def _weights(records: Sequence[CheckRecord]) -> npt.NDArray[np.float64]:
    return np.array([1.0 / r.probability for r in records], dtype=np.float64)


def _compare_routers(
    held_out: Sequence[CheckRecord], in_force: InForce, router: RouterModel, embed: Embed
) -> Comparison:
    """Regret (routed small where the small engine's answer differs from the large
    path's) and the share sent large, for the routers in force and refitted."""
    checks = [
        r for r in held_out
        if r.shortcut in ("small_route", "large_route") and r.agree is not None
    ]  # fmt: skip
    weights = _weights(checks)
    differs = np.array([not r.agree for r in checks], dtype=bool)
    live_small = np.array([r.shortcut == "small_route" for r in checks], dtype=bool)
    if checks:
        vectors, _ = embed([r.prompt for r in checks])
        scores = scorer_for(router).score(vectors, [r.prompt for r in checks])
        new_small = np.asarray(scores) < router.threshold
    else:
        new_small = np.zeros(0, dtype=bool)
    return Comparison(
        part="router",
        checks=len(checks),
        live=_rate(weights, live_small & differs),
        candidate=_rate(weights, new_small & differs),
        cost="share sent to the large path",
        live_cost=_share(weights, ~live_small),
        candidate_cost=_share(weights, ~new_small),
    )


def _compare_calibrators(
    held_out: Sequence[CheckRecord], threshold: float, mapping: tuple[list[float], list[float]]
) -> Comparison:
    """Flips (an early stop whose answer running on would change) and the share of
    early stops that would go on instead, for the calibrators in force and refitted."""
    checks = [r for r in held_out if r.shortcut == "early_stop" and r.agree is not None]
    weights = _weights(checks)
    flips = np.array([not r.agree for r in checks], dtype=bool)
    new_p = np.interp([r.confidence or 0.0 for r in checks], *mapping)
    stops = np.asarray(new_p, dtype=np.float64) >= threshold
    return Comparison(
        part="calibrator",
        checks=len(checks),
        live=_rate(weights, flips),
        candidate=_rate(weights, stops & flips),
        cost="share of early stops that go on to the budget",
        live_cost=0.0 if checks else None,
        candidate_cost=_share(weights, ~stops),
    )


def _compare_verifiers(
    held_out: Sequence[CheckRecord], new: Calibration, bound: float
) -> Comparison:
    """Disagreement among the semantic hits each serves, and the share of today's
    hits each serves."""
    checks = [
        r for r in held_out
        if r.shortcut == "semantic_hit" and r.agree is not None and r.cache_score is not None
    ]  # fmt: skip
    weights = _weights(checks)
    wrong = np.array([not r.agree for r in checks], dtype=bool)
    threshold = OperatingPoints(new).threshold(bound)
    serves = np.array([(r.cache_score or 0.0) >= threshold for r in checks], dtype=bool)
    return Comparison(
        part="verifier",
        checks=len(checks),
        live=_rate(weights, wrong),
        candidate=_rate(weights[serves], wrong[serves]),
        cost=f"share of today's semantic hits served (operating point {threshold:.3f})",
        live_cost=1.0 if checks else None,
        candidate_cost=_share(weights, serves),
    )
