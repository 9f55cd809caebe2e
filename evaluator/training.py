"""Training data for the calibrator, from labelled runs: one row per run and k, the
signals of the answer the loop would give after k samples and whether it is right.

Apart from evaluator.calibration because the rows come from the loop's own vote
(evaluator.policy.tally), and the policy uses a calibrator: the dependency goes
training -> policy -> calibration, one way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from evaluator.answers import extract, is_correct
from evaluator.calibration import (
    ISOTONIC_MIN_LABELS,
    CalibrationMetrics,
    Calibrator,
    FloatArray,
    cross_validate,
    fit,
    measure,
)
from evaluator.policy import tally
from evaluator.runs import Run
from evaluator.signals import (
    DEFAULT_SETTINGS,
    MissingSignal,
    Signals,
    SignalSettings,
    trace_confidence,
)


class TrainingSet(msgspec.Struct, frozen=True, kw_only=True):
    """One row per (run, k): the signals of the first k samples' majority answer, and
    whether that answer is right."""

    signals: list[Signals]
    labels: list[bool]
    groups: list[int]  # the run's position in the file, for folds that keep runs whole
    ks: list[int]
    short: dict[int, int]  # per k: runs left out for having fewer than k samples

    def rows(self, features: Sequence[str]) -> FloatArray:
        return np.array([s.features(features) for s in self.signals], dtype=np.float64)

    def readable(self, features: Sequence[str]) -> TrainingSet:
        """The rows that have every one of ``features``: a row whose samples all came
        back empty (no text, no logprobs) has no token signals to fit on."""
        keep = []
        for i, signals in enumerate(self.signals):
            try:
                signals.features(features)
            except MissingSignal:
                continue
            keep.append(i)
        return TrainingSet(
            signals=[self.signals[i] for i in keep],
            labels=[self.labels[i] for i in keep],
            groups=[self.groups[i] for i in keep],
            ks=[self.ks[i] for i in keep],
            short=self.short,
        )


def training_set(
    runs: Sequence[Run], ks: Sequence[int], settings: SignalSettings = DEFAULT_SETTINGS
) -> TrainingSet:
    """Rows for the loop's own candidate: the confidence-weighted vote of the first k
    samples (evaluator.policy.tally), so that the calibrator learns P(correct) of the
    answer the loop would give."""
    if not ks or min(ks) < 1:
        raise ValueError("k must be at least 1")
    signals: list[Signals] = []
    labels: list[bool] = []
    groups: list[int] = []
    row_ks: list[int] = []
    short = dict.fromkeys(ks, 0)
    for position, run in enumerate(runs):
        answers = [extract(run.kind, sample.text) for sample in run.samples]
        traces = [trace_confidence(sample.logprobs, settings) for sample in run.samples]
        for k in ks:
            if len(run.samples) < k:
                short[k] += 1
                continue
            verdict = tally(
                run.kind, run.samples[:k], answers[:k], traces=traces[:k], settings=settings
            )
            signals.append(verdict.signals)
            labels.append(verdict.answer is not None and is_correct(run.question, verdict.text))
            groups.append(position)
            row_ks.append(k)
    return TrainingSet(signals=signals, labels=labels, groups=groups, ks=row_ks, short=short)


# Signals that are probabilities as they stand: their held-out metrics, uncalibrated,
# are what the calibrator has to beat.
RAW_PROBABILITIES = ("vote_share", "majority_probability")


class FittedCalibrator(msgspec.Struct, frozen=True, kw_only=True):
    """A calibrator fitted on labelled runs, and how it did on runs it did not see."""

    model: Calibrator
    rows: int  # (run, k) rows it was fitted on
    short: dict[int, int]  # per k: runs left out for having fewer than k samples
    unreadable: int  # rows left out: their samples lack one of the features
    # Pooled over the folds, each row scored by a calibrator that never saw its run.
    held_out: CalibrationMetrics
    uncalibrated: dict[str, CalibrationMetrics]  # each of RAW_PROBABILITIES as it stands


def fit_calibrator(
    runs: Sequence[Run],
    ks: Sequence[int],
    features: Sequence[str],
    settings: SignalSettings = DEFAULT_SETTINGS,
    *,
    folds: int = 5,
    seed: int = 0,
    isotonic_min: int = ISOTONIC_MIN_LABELS,
    trained_on: str = "",
) -> FittedCalibrator:
    """Fit on the loop's vote after each of ``ks`` samples of every run, and measure it
    cross-validated by run. Bad settings, a missing signal and unfit data raise
    ValueError (MissingSignal, when no row has every feature)."""
    data = training_set(runs, ks, settings)
    if not data.signals:
        raise ValueError(f"no run has {min(ks)} samples")
    readable = data.readable(features)
    if not readable.signals:
        data.rows(features)  # raises MissingSignal, naming the signal
    rows = readable.rows(features)
    labels = np.array(readable.labels, dtype=np.float64)
    options: dict[str, Any] = {"signals": settings, "isotonic_min": isotonic_min}
    held_out = cross_validate(
        rows, labels, readable.groups, features, folds=folds, seed=seed, **options
    )
    model = fit(rows, labels, features, seed=seed, trained_on=trained_on, **options)
    return FittedCalibrator(
        model=model,
        rows=len(labels),
        short=data.short,
        unreadable=len(data.signals) - len(readable.signals),
        held_out=measure(held_out, labels),
        uncalibrated={
            name: measure(readable.rows([name])[:, 0], labels) for name in RAW_PROBABILITIES
        },
    )
