"""Choosing the difficulty threshold: by the share of traffic the large model may take,
or by the quality the routed mix must reach at the lowest cost."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np

from router.outcomes import Outcome
from router.scorers import Scores

# A threshold above every score: nothing goes to the large model.
NEVER = float(np.nextafter(1.0, 2.0))


class Calibration(msgspec.Struct, frozen=True):
    threshold: float
    large_fraction: float
    quality: float | None = None  # mean score of the routed mix, when outcomes are known


def for_large_fraction(scores: Scores, fraction: float) -> Calibration:
    """The threshold that sends (as nearly as ties allow) ``fraction`` of prompts to large."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"large fraction must be within [0, 1], got {fraction}")
    ranked = np.sort(np.asarray(scores, dtype=np.float64))[::-1]
    count = round(fraction * len(ranked))
    threshold = NEVER if count == 0 else float(ranked[count - 1])
    return Calibration(threshold, float(np.mean(ranked >= threshold)))


def for_quality(scores: Scores, outcomes: Sequence[Outcome], target: float) -> Calibration:
    """The highest threshold (fewest large calls) whose routed mix reaches ``target``."""
    small = np.array([o.small for o in outcomes])
    large = np.array([o.large for o in outcomes])
    scores = np.asarray(scores, dtype=np.float64)
    for threshold in [NEVER, *np.sort(np.unique(scores))[::-1]]:
        routed = scores >= threshold
        quality = float(np.where(routed, large, small).mean())
        if quality >= target:
            return Calibration(float(threshold), float(routed.mean()), quality)
    best = float(large.mean()) if len(large) else 0.0
    raise ValueError(f"no threshold reaches quality {target}; always-large reaches {best:.4f}")
