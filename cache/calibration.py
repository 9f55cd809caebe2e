"""The verifier's operating point: the lowest P(same answer) at which semantic hits
are wrong no more often than a bound, with a stated confidence, on labelled pairs.

Calibration keeps every semantic hit the verifier served on the pairs at operating
point 0 (its P, and whether it was wrong); the operating point for a bound is found
from them when the config names the bound, so one calibration serves every bound.

The rule is fixed-sequence testing ("Learn then Test", Angelopoulos et al., 2021):
the thresholds of a fixed grid (0.999, 0.998, ...) are tested from the top down, each
with the one-sided Clopper-Pearson upper bound of the wrong share of the hits at it,
and the search stops at the first that fails. With probability at least
``confidence`` over the draw of the pairs, the threshold returned keeps the wrong
share at or under the bound on traffic drawn like them. Thresholds with too few hits
(under three times what passing without a wrong hit takes) are skipped: that depends
on the counts, not the labels, so the guarantee stands.
"""

from __future__ import annotations

import math
from pathlib import Path

import msgspec
import numpy as np
from scipy.stats import beta

BUNDLED = Path(__file__).parent / "data" / "default.calibration"
CONFIDENCE = 0.95
# A threshold no P reaches: semantic hits are off when no operating point honours the bound.
NEVER = 2.0


class CalibrationError(ValueError):
    """A calibration file that cannot be used; the message names the file."""


class Calibration(msgspec.Struct, frozen=True, kw_only=True):
    """What ``satisfice cache calibrate`` writes."""

    verifier: str  # fingerprint of the weights that scored the pairs
    pairs: str  # what they were (file names)
    queries: int  # pairs looked up
    # Per semantic hit served at operating point 0: the verifier's P, and whether
    # serving it was wrong.
    scores: list[float]
    wrong: list[bool]
    confidence: float = CONFIDENCE


# The thresholds tested, from the top down: a fixed grid, so one unlucky wrong hit among
# the first few does not end the search before it has the hits to judge by.
GRID = np.round(np.arange(0.999, 0.0, -0.001), 3)
# Testing starts at this many times the hits a bound needs with no wrong hit at all.
MARGIN = 3


class OperatingPoints:
    """A calibration's thresholds, one per bound asked for (kept: tenants may differ)."""

    def __init__(self, calibration: Calibration) -> None:
        self.calibration = calibration
        scores = np.asarray(calibration.scores, dtype=np.float64)
        wrong = np.asarray(calibration.wrong, dtype=bool)
        order = np.argsort(scores, kind="stable")
        ascending, wrong_cumulative = scores[order], np.cumsum(wrong[order][::-1])[::-1]
        # Hits and wrong hits at each grid threshold (P >= threshold).
        first = np.searchsorted(ascending, GRID, side="left")
        self._hits = len(scores) - first
        padded = np.r_[wrong_cumulative, 0]
        self._wrongs = padded[first]
        # Below the lowest P seen no hit was seen: pairs looked up at operating point 0
        # reach near 0, but hits served at a higher one (gateway.checks.refit) stop
        # there, and the counts below it would only repeat the counts at it.
        self._lowest = float(ascending[0]) if len(ascending) else 0.0
        self._known: dict[float, float] = {}

    def threshold(self, bound: float) -> float:
        """The lowest P whose hits keep the wrong share under ``bound``, or ``NEVER``."""
        known = self._known.get(bound)
        if known is None:
            known = self._known[bound] = self._search(bound)
        return known

    def _search(self, bound: float) -> float:
        confidence = self.calibration.confidence
        # Where not even k = 0 could pass, and a while below that, one wrong hit would
        # end the search: start where a few may be wrong (power, not validity: the
        # counts alone decide where, not the labels).
        needed = MARGIN * math.log(1 - confidence) / math.log1p(-bound) if bound < 1 else 0.0
        best = NEVER
        for threshold, n, k in zip(GRID, self._hits, self._wrongs, strict=True):
            if threshold < self._lowest:
                break
            if n < needed:
                continue
            upper = 1.0 if k >= n else float(beta.ppf(confidence, k + 1, n - k))
            if upper > bound:
                break
            best = float(threshold)
        return best


def read_calibration(path: str | Path = BUNDLED) -> Calibration:
    try:
        return msgspec.json.decode(Path(path).read_bytes(), type=Calibration)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CalibrationError(f"verifier calibration {path}: {exc}") from exc


def write_calibration(calibration: Calibration, path: str | Path) -> None:
    Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(calibration), indent=0))
