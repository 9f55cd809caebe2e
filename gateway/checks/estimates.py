"""Live estimates from check records: how often each shortcut disagrees with the path
it skipped, with 95% intervals; how P(correct) compares with agreement; and callers'
verdicts, kept apart.

A check is drawn with a probability that may differ by tenant and shortcut, so each
record weighs 1/probability. The rate is Hájek's estimator (the weighted share
disagreeing) and its interval Wilson's, on the effective sample size
n_eff = (Σw)²/Σw² (Kish): with equal probabilities it is the plain Wilson interval.

Everything is kept as running sums: ``LiveEstimates.add`` costs O(1) a record, and a
``snapshot()`` or ``report()`` reads the sums. The CLI folds a list of records with
the same class (``fold``).

Agreement with the skipped path is not correctness: both paths may be wrong alike, and
a disagreement does not say which of the two is wrong.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Iterable
from typing import Final

import msgspec

from gateway.checks.record import CheckRecord
from gateway.config.shadow import SHORTCUTS, Shortcut

log = logging.getLogger("satisfice.checks")

Z95: Final = 1.96

# What each shortcut's disagreement rate means.
MEANING: Final[dict[Shortcut, str]] = {
    "semantic_hit": "disagreement with the engine",
    "exact_hit": "disagreement with the engine",
    "small_route": "regret: the large path would change the answer",
    "early_stop": "flip: running on to the budget changes the answer",
    "deadline_fallback": "disagreement with the loop without a deadline",
    "large_route": "the small engine would change the large path's answer",
}

AGREEMENT_NOTE: Final = (
    "agreement with the skipped path is not correctness: both paths can be wrong alike, "
    "and a disagreement does not say which one is wrong"
)
FEEDBACK_NOTE: Final = (
    "feedback verdicts are not a random sample: callers chose which answers to judge, so "
    "the share marked wrong is not a rate of the traffic"
)


def wilson(rate: float, n: float, z: float = Z95) -> tuple[float, float]:
    """Wilson's score interval for a share ``rate`` observed on ``n`` (which may be an
    effective, fractional sample size); ``n`` > 0."""
    z2 = z * z
    centre = (rate + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(rate * (1 - rate) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


class Estimate(msgspec.Struct, frozen=True, kw_only=True):
    """One tenant's checks of one shortcut."""

    tenant: str
    shortcut: Shortcut
    meaning: str  # what a disagreement means for this shortcut
    # The weighted share of decided checks that disagreed, and its 95% interval; None
    # before any check was decided.
    rate: float | None
    low: float | None
    high: float | None
    n: int  # decided checks: the comparator said agree or disagree
    n_eff: float  # the effective sample size the interval is taken on
    disagreed: int  # decided checks that disagreed, unweighted
    checked: int  # checks that ran to the end, decided or not
    undecided: int  # checked, but the comparator could not tell
    dropped: dict[str, int]  # drawn but not run, by reason
    failed: int  # the skipped path raised


class CalibrationBin(msgspec.Struct, frozen=True, kw_only=True):
    """Decided checks whose shortcut was taken at a confidence in [lower, upper)
    (the last bin's upper edge included)."""

    lower: float
    upper: float
    n: int
    n_eff: float
    mean_confidence: float | None  # weighted
    agreement: float | None  # the weighted share agreeing, and its 95% interval
    low: float | None
    high: float | None


class Calibration(msgspec.Struct, frozen=True, kw_only=True):
    """The evaluator's P(correct) against agreement with the skipped path, per
    shortcut (every tenant's checks together)."""

    shortcut: Shortcut
    n: int
    bins: list[CalibrationBin]
    # Expected calibration error: the weighted mean, over bins, of |mean confidence -
    # agreement|.
    ece: float | None
    # Mean confidence - agreement rate: above 0, P(correct) promises more agreement
    # than was seen.
    mean_gap: float | None


class FeedbackShare(msgspec.Struct, frozen=True, kw_only=True):
    """Callers' verdicts on one tenant's answers by one route: not a random sample."""

    tenant: str
    route: str
    wrong: int
    n: int
    rate: float  # the share marked wrong, and its 95% interval
    low: float
    high: float


class Report(msgspec.Struct, frozen=True, kw_only=True):
    estimates: list[Estimate]
    calibration: list[Calibration]
    feedback: list[FeedbackShare]
    notes: list[str]
    # Records left out: a probability outside (0, 1] cannot be weighted.
    ignored: int = 0


class _Rate:
    """Running sums of one weighted share: Σw, Σw², Σw·x and the count."""

    __slots__ = ("hits", "n", "w", "w2", "wx")

    def __init__(self) -> None:
        self.n = 0
        self.hits = 0
        self.w = 0.0
        self.w2 = 0.0
        self.wx = 0.0

    def add(self, weight: float, hit: bool) -> None:
        self.n += 1
        self.hits += hit
        self.w += weight
        self.w2 += weight * weight
        self.wx += weight * hit

    @property
    def n_eff(self) -> float:
        return self.w * self.w / self.w2 if self.w2 else 0.0

    @property
    def rate(self) -> float | None:
        return self.wx / self.w if self.w else None

    def interval(self) -> tuple[float | None, float | None, float | None]:
        rate = self.rate
        if rate is None:
            return None, None, None
        low, high = wilson(rate, self.n_eff)
        return rate, low, high


class _Checks:
    """One (tenant, shortcut)'s running sums."""

    __slots__ = ("checked", "disagreement", "dropped", "failed", "undecided")

    def __init__(self) -> None:
        self.disagreement = _Rate()
        self.checked = 0
        self.undecided = 0
        self.failed = 0
        self.dropped: Counter[str] = Counter()


class _Bin:
    __slots__ = ("agreement", "wc")

    def __init__(self) -> None:
        self.agreement = _Rate()
        self.wc = 0.0  # Σ w·confidence


class LiveEstimates:
    """Estimates kept up to date one record at a time.

    Feed it every record exactly once, from one source: in the gateway, what
    ``OutcomeStore.tail()`` returns (every replica's records, this one's included; the
    first call, every record kept), never also the records this process adds."""

    def __init__(self, bins: int = 5) -> None:
        if bins < 1:
            raise ValueError(f"bins must be 1 or more, not {bins}")
        self.bins = bins
        self.ignored = 0
        self._checks: dict[tuple[str, Shortcut], _Checks] = {}
        self._calibration: dict[Shortcut, list[_Bin]] = {}
        self._feedback: dict[tuple[str, str], _Rate] = {}

    @classmethod
    def fold(cls, records: Iterable[CheckRecord], bins: int = 5) -> LiveEstimates:
        estimates = cls(bins)
        for record in records:
            estimates.add(record)
        return estimates

    def add(self, record: CheckRecord) -> None:
        if record.source == "feedback":
            if record.verdict is not None:
                key = (record.tenant, record.route)
                share = self._feedback.get(key) or self._feedback.setdefault(key, _Rate())
                share.add(1.0, record.verdict == "wrong")
            return
        if record.shortcut is None:
            return  # a check is always of a shortcut; nothing to file this under
        if not (0.0 < record.probability <= 1.0):
            self._ignore(record)
            return
        key2 = (record.tenant, record.shortcut)
        checks = self._checks.get(key2) or self._checks.setdefault(key2, _Checks())
        if record.status == "dropped":
            checks.dropped[record.reason or "unknown"] += 1
        elif record.status == "failed":
            checks.failed += 1
        else:
            checks.checked += 1
            if record.agree is None:
                checks.undecided += 1
                return
            weight = 1.0 / record.probability
            checks.disagreement.add(weight, not record.agree)
            if record.confidence is not None:
                self._calibrate(record.shortcut, record.confidence, weight, record.agree)

    def _calibrate(self, shortcut: Shortcut, confidence: float, weight: float, agree: bool) -> None:
        bins = self._calibration.get(shortcut)
        if bins is None:
            bins = self._calibration[shortcut] = [_Bin() for _ in range(self.bins)]
        at = bins[min(max(int(confidence * self.bins), 0), self.bins - 1)]
        at.agreement.add(weight, agree)
        at.wc += weight * confidence

    def _ignore(self, record: CheckRecord) -> None:
        if not self.ignored:
            log.warning(
                "check record %s has probability %r, outside (0, 1]: left out of the "
                "estimates (and any others like it)",
                record.id,
                record.probability,
            )
        self.ignored += 1

    # -- reading --------------------------------------------------------------------

    def snapshot(self) -> list[Estimate]:
        """Every (tenant, shortcut) seen, by tenant, shortcuts in their usual order."""
        order = {s: i for i, s in enumerate(SHORTCUTS)}
        keys = sorted(self._checks, key=lambda k: (k[0], order[k[1]]))
        return [self._estimate(tenant, shortcut) for tenant, shortcut in keys]

    def _estimate(self, tenant: str, shortcut: Shortcut) -> Estimate:
        checks = self._checks[(tenant, shortcut)]
        rate, low, high = checks.disagreement.interval()
        return Estimate(
            tenant=tenant,
            shortcut=shortcut,
            meaning=MEANING[shortcut],
            rate=rate,
            low=low,
            high=high,
            n=checks.disagreement.n,
            n_eff=checks.disagreement.n_eff,
            disagreed=checks.disagreement.hits,
            checked=checks.checked,
            undecided=checks.undecided,
            dropped=dict(sorted(checks.dropped.items())),
            failed=checks.failed,
        )

    def calibration(self) -> list[Calibration]:
        return [
            self._calibration_of(shortcut)
            for shortcut in SHORTCUTS
            if shortcut in self._calibration
        ]

    def _calibration_of(self, shortcut: Shortcut) -> Calibration:
        bins = self._calibration[shortcut]
        rows = []
        for i, at in enumerate(bins):
            agreement, low, high = at.agreement.interval()
            weight = at.agreement.w
            rows.append(
                CalibrationBin(
                    lower=i / self.bins,
                    upper=(i + 1) / self.bins,
                    n=at.agreement.n,
                    n_eff=at.agreement.n_eff,
                    mean_confidence=at.wc / weight if weight else None,
                    agreement=agreement,
                    low=low,
                    high=high,
                )
            )
        total = sum(at.agreement.w for at in bins)
        ece = mean_gap = None
        if total:
            ece = sum(abs(at.wc - at.agreement.wx) for at in bins) / total
            mean_gap = sum(at.wc - at.agreement.wx for at in bins) / total
        return Calibration(
            shortcut=shortcut,
            n=sum(at.agreement.n for at in bins),
            bins=rows,
            ece=ece,
            mean_gap=mean_gap,
        )

    def feedback(self) -> list[FeedbackShare]:
        shares = []
        for (tenant, route), share in sorted(self._feedback.items()):
            rate, low, high = share.interval()
            assert rate is not None and low is not None and high is not None  # n >= 1
            shares.append(
                FeedbackShare(
                    tenant=tenant,
                    route=route,
                    wrong=share.hits,
                    n=share.n,
                    rate=rate,
                    low=low,
                    high=high,
                )
            )
        return shares

    def report(self) -> Report:
        return Report(
            estimates=self.snapshot(),
            calibration=self.calibration(),
            feedback=self.feedback(),
            notes=[AGREEMENT_NOTE, FEEDBACK_NOTE],
            ignored=self.ignored,
        )
