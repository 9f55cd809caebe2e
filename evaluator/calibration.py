"""Calibration: from a round's signals to P(the answer is correct).

Logistic regression on the standardised signals, then, given enough labels, isotonic
regression on the logistic output (Zadrozny & Elkan's two-step recipe, as sklearn's
``CalibratedClassifierCV(method="isotonic", ensemble=False)`` does it): the logistic
model ranks, the isotonic map fixes the shape of its probabilities where the sigmoid
is wrong. Below the label count the isotonic step overfits, so it is left out.

The model file is msgpack with a versioned header naming the features in order and the
signal settings they were computed with; a file with another version, unknown features
or features other than the caller expects is refused with a message naming the file.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import msgspec
import numpy as np
import numpy.typing as npt

from evaluator.answers import AnswerKind
from evaluator.signals import DEFAULT_SETTINGS, FEATURES, Signals, SignalSettings

FloatArray = npt.NDArray[np.float64]

FORMAT: Literal["satisfice-calibrator"] = "satisfice-calibrator"
VERSION = 1
# Isotonic regression needs this many labels before its steps mean anything.
ISOTONIC_MIN_LABELS = 200


# The loop's "calibrator: bundled": fitted for the bundled large model by
# `make default-calibrator`, shipped in the package.
BUNDLED_CALIBRATOR = "bundled"
# The package's file that "bundled" names for the vote's calibrator, and those of
# P(greedy right) by answer kind for the loop's greedy_calibrator (bench/greedy_first.py
# fits them): the same logprobs mean a sure letter and an unsure worked answer, and one
# calibrator over both ranked greedy answers no better than chance.
VOTE_FILE = "default.calibrator"
GREEDY_FILES: dict[AnswerKind, str] = {
    "choice": "greedy_choice.calibrator",
    "number": "greedy_number.calibrator",
}


def calibrator_file(name: str, bundled: str = VOTE_FILE) -> Path:
    """The file a config's ``calibrator`` names: "bundled" (the package's file
    ``bundled``), or a path."""
    if name == BUNDLED_CALIBRATOR:
        return Path(str(resources.files("evaluator").joinpath(f"data/{bundled}")))
    return Path(name).expanduser()


class CalibratorFileError(ValueError):
    """A calibrator file that cannot be used; the message names the file."""


class Calibrator(msgspec.Struct, frozen=True, kw_only=True):
    format: Literal["satisfice-calibrator"] = FORMAT
    version: int = VERSION
    features: Annotated[list[str], msgspec.Meta(min_length=1)]  # the row order
    signals: SignalSettings  # compute the features with these, or they mean other things
    mean: list[float]  # per feature, seen in fitting
    scale: list[float]
    weights: list[float]
    bias: float
    # Breakpoints of the isotonic map over the logistic probability; empty when unused.
    isotonic_x: list[float] = []
    isotonic_y: list[float] = []
    labels: int = 0  # how many labelled rows it was fitted on
    positives: int = 0
    trained_on: str = ""

    def predict(self, rows: npt.ArrayLike) -> FloatArray:
        """P(correct) for each row of features, in ``self.features`` order."""
        x = np.asarray(rows, dtype=np.float64).reshape(-1, len(self.features))
        standard = (x - np.asarray(self.mean)) / np.asarray(self.scale)
        p = _sigmoid(standard @ np.asarray(self.weights) + self.bias)
        if self.isotonic_x:
            # sklearn's IsotonicRegression.predict with out_of_bounds="clip" is exactly
            # this linear interpolation between its thresholds.
            p = np.interp(p, self.isotonic_x, self.isotonic_y)
        return p

    def probability(self, signals: Signals) -> float:
        return float(self.predict([signals.features(self.features)])[0])


def _sigmoid(z: FloatArray) -> FloatArray:
    # exp(-log(1 + e^-z)) does not overflow for large |z|.
    return np.exp(-np.logaddexp(0.0, -z))


# --- fitting ---------------------------------------------------------------------------


def fit(
    rows: npt.ArrayLike,
    labels: npt.ArrayLike,
    features: Sequence[str],
    *,
    signals: SignalSettings = DEFAULT_SETTINGS,
    isotonic_min: int = ISOTONIC_MIN_LABELS,
    regularisation: float = 1.0,
    seed: int = 0,
    trained_on: str = "",
) -> Calibrator:
    """Fit on feature rows (in ``features`` order) and whether each answer was right."""
    from sklearn.linear_model import LogisticRegression

    x, y = _check(rows, labels, features)
    mean, scale = x.mean(axis=0), x.std(axis=0)
    # A constant feature carries nothing; a unit scale keeps it from dividing by zero.
    scale[scale == 0] = 1.0
    standard = (x - mean) / scale
    regression = LogisticRegression(C=regularisation, max_iter=1000)
    regression.fit(standard, y)
    model = Calibrator(
        features=list(features),
        signals=signals,
        mean=mean.tolist(),
        scale=scale.tolist(),
        weights=regression.coef_[0].tolist(),
        bias=float(regression.intercept_[0]),
        labels=len(y),
        positives=int(y.sum()),
        trained_on=trained_on,
    )
    if len(y) < isotonic_min:
        return model
    held_out = _out_of_fold(model, standard, y, seed, regularisation)
    if held_out is None:
        return model
    from sklearn.isotonic import IsotonicRegression

    isotonic = IsotonicRegression(y_min=0.0, y_max=1.0, out_of_bounds="clip")
    isotonic.fit(held_out, y)
    return msgspec.structs.replace(
        model,
        isotonic_x=np.asarray(isotonic.X_thresholds_, dtype=np.float64).tolist(),
        isotonic_y=np.asarray(isotonic.y_thresholds_, dtype=np.float64).tolist(),
    )


def _out_of_fold(
    model: Calibrator, standard: FloatArray, y: FloatArray, seed: int, regularisation: float
) -> FloatArray | None:
    """Logistic probabilities for each row from a model that did not see it.

    The isotonic map is fitted on these, not on the full model's own (in-sample)
    outputs, which are more extreme than what it will see in service.
    """
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import StratifiedKFold

    fewest = int(min(y.sum(), len(y) - y.sum()))
    if fewest < 2:
        return None
    splits = StratifiedKFold(n_splits=min(5, fewest), shuffle=True, random_state=seed)
    held_out = np.empty(len(y))
    for train, test in splits.split(standard, y):
        regression = LogisticRegression(C=regularisation, max_iter=1000)
        regression.fit(standard[train], y[train])
        held_out[test] = regression.predict_proba(standard[test])[:, 1]
    return held_out


def cross_validate(
    rows: npt.ArrayLike,
    labels: npt.ArrayLike,
    groups: npt.ArrayLike,
    features: Sequence[str],
    *,
    folds: int = 5,
    seed: int = 0,
    **options: Any,
) -> FloatArray:
    """P(correct) for every row from a calibrator fitted on the other folds only.

    Rows that share a group (one question's rows at several k) fall in the same fold,
    so that no question is scored by a model that saw it.
    """
    x, y = _check(rows, labels, features)
    g = np.asarray(groups).reshape(-1)
    if len(g) != len(y):
        raise ValueError(f"{len(g)} groups for {len(y)} rows")
    unique = np.unique(g)
    if not 2 <= folds <= len(unique):
        raise ValueError(f"folds must be within 2..{len(unique)} (one per question at most)")
    order = np.random.default_rng(seed).permutation(unique)
    held_out = np.empty(len(y))
    for number, fold in enumerate(np.array_split(order, folds), start=1):
        test = np.isin(g, fold)
        try:
            model = fit(x[~test], y[~test], features, seed=seed, **options)
        except ValueError as exc:
            raise ValueError(f"fold {number} of {folds}: {exc}") from exc
        held_out[test] = model.predict(x[test])
    return held_out


def _check(
    rows: npt.ArrayLike, labels: npt.ArrayLike, features: Sequence[str]
) -> tuple[FloatArray, FloatArray]:
    unknown = [name for name in features if name not in FEATURES]
    if unknown or not features:
        raise ValueError(f"unknown features {unknown}; known: {', '.join(FEATURES)}")
    x = np.asarray(rows, dtype=np.float64).reshape(-1, len(features))
    y = np.asarray(labels, dtype=np.float64).reshape(-1)
    if len(x) != len(y):
        raise ValueError(f"{len(x)} rows for {len(y)} labels")
    if not np.isfinite(x).all():
        raise ValueError("features must be finite numbers")
    if not np.isin(y, (0.0, 1.0)).all():
        raise ValueError("labels must be 0 or 1")
    if len(np.unique(y)) < 2:
        raise ValueError("the labels need both correct and incorrect answers")
    return x, y


# --- measuring -------------------------------------------------------------------------


def expected_calibration_error(
    probabilities: npt.ArrayLike, labels: npt.ArrayLike, bins: int = 10
) -> float:
    """ECE over ``bins`` equal-width bins of [0, 1]: Σ_b |B_b|/n · |acc(B_b) - conf(B_b)|.

    Bin b holds probabilities in [b/bins, (b+1)/bins); the last bin also holds 1.0.
    """
    p, y = _pair(probabilities, labels)
    if bins < 1:
        raise ValueError("bins must be at least 1")
    which = np.minimum((p * bins).astype(np.int64), bins - 1)
    total = 0.0
    for b in np.unique(which):
        members = which == b
        total += members.sum() * abs(float(y[members].mean()) - float(p[members].mean()))
    return float(total) / len(p)


def calibrated_eces(
    probabilities: npt.ArrayLike, groups: Sequence[int], seed: int, draws: int = 200
) -> FloatArray:
    """The ECEs a perfectly calibrated P would itself show on these probabilities: one
    per draw of labels from them. Entries of one group (one question's branch orders,
    which mostly stop on one answer) share a draw, so they count nearly as one label,
    as they do in the measured ECE. On a few hundred questions these are well above
    zero: a measured ECE is read against them."""
    p = np.asarray(probabilities, dtype=np.float64)
    rng = np.random.default_rng(seed)
    index = np.unique(np.asarray(groups), return_inverse=True)[1]
    return np.array(
        [
            expected_calibration_error(p, rng.random(index.max() + 1)[index] < p)
            for _ in range(draws)
        ]
    )


def brier_score(probabilities: npt.ArrayLike, labels: npt.ArrayLike) -> float:
    """Mean squared difference between P(correct) and the 0/1 outcome."""
    p, y = _pair(probabilities, labels)
    return float(np.mean((p - y) ** 2))


def roc_auc(scores: npt.ArrayLike, labels: npt.ArrayLike) -> float:
    """How often a correct answer outscores a wrong one (ties count half). NaN when one
    class is empty, where sklearn's roc_auc_score would raise."""
    from sklearn.metrics import roc_auc_score  # a second to import: only when measuring

    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    y = np.asarray(labels, dtype=np.float64).reshape(-1).astype(bool)
    if len(s) != len(y):
        raise ValueError(f"{len(s)} scores for {len(y)} labels")
    if y.all() or not y.any():
        return float("nan")
    return float(roc_auc_score(y, s))


class CalibrationMetrics(msgspec.Struct, frozen=True):
    n: int
    accuracy: float  # share of answers that were right: the base rate
    ece: float
    brier: float
    roc_auc: float


def measure(probabilities: npt.ArrayLike, labels: npt.ArrayLike) -> CalibrationMetrics:
    p, y = _pair(probabilities, labels)
    return CalibrationMetrics(
        n=len(p),
        accuracy=float(y.mean()),
        ece=expected_calibration_error(p, y),
        brier=brier_score(p, y),
        roc_auc=roc_auc(p, y),
    )


def _pair(probabilities: npt.ArrayLike, labels: npt.ArrayLike) -> tuple[FloatArray, FloatArray]:
    p = np.asarray(probabilities, dtype=np.float64).reshape(-1)
    y = np.asarray(labels, dtype=np.float64).reshape(-1)
    if len(p) != len(y) or len(p) == 0:
        raise ValueError(f"{len(p)} probabilities for {len(y)} labels")
    if not ((p >= 0) & (p <= 1)).all():
        raise ValueError("probabilities must lie in [0, 1]")
    return p, y


# --- the file --------------------------------------------------------------------------


class _Header(msgspec.Struct):
    format: str = ""
    version: int = 0


def write_calibrator(model: Calibrator, path: str | Path) -> None:
    Path(path).write_bytes(msgspec.msgpack.encode(model))


def read_calibrator(path: str | Path, *, features: Sequence[str] | None = None) -> Calibrator:
    """Load a calibrator; with ``features``, refuse one fitted on any other list."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise CalibratorFileError(f"{path}: cannot read: {exc}") from exc
    try:
        header = msgspec.msgpack.decode(data, type=_Header)
    except msgspec.DecodeError as exc:
        raise CalibratorFileError(f"{path}: not a {FORMAT} file: {exc}") from exc
    if header.format != FORMAT:
        raise CalibratorFileError(f"{path}: not a {FORMAT} file (format {header.format!r})")
    if header.version != VERSION:
        raise CalibratorFileError(
            f"{path}: {FORMAT} version {header.version}, but this Satisfice reads version "
            f"{VERSION}; refit it with `satisfice evaluator fit`"
        )
    try:
        model = msgspec.msgpack.decode(data, type=Calibrator)
    except msgspec.DecodeError as exc:
        raise CalibratorFileError(f"{path}: corrupt {FORMAT} file: {exc}") from exc
    unknown = [name for name in model.features if name not in FEATURES]
    if unknown:
        raise CalibratorFileError(
            f"{path}: fitted on features this Satisfice does not compute: {', '.join(unknown)}"
        )
    if features is not None and list(features) != model.features:
        raise CalibratorFileError(
            f"{path}: fitted on features [{', '.join(model.features)}], but "
            f"[{', '.join(features)}] were expected; refit it with `satisfice evaluator fit`"
        )
    width = len(model.features)
    if not (len(model.mean) == len(model.scale) == len(model.weights) == width) or len(
        model.isotonic_x
    ) != len(model.isotonic_y):
        raise CalibratorFileError(
            f"{path}: corrupt: {width} features but {len(model.weights)} weights, "
            f"{len(model.mean)} means, {len(model.scale)} scales, "
            f"{len(model.isotonic_x)}/{len(model.isotonic_y)} isotonic points"
        )
    return model


def for_every_kind(calibrator: Calibrator) -> dict[AnswerKind, Calibrator]:
    """One calibrator for every answer kind."""
    return dict.fromkeys(get_args(AnswerKind), calibrator)


def read_greedy_calibrators(name: str) -> dict[AnswerKind, Calibrator]:
    """P(greedy right)'s calibrators by answer kind, as the loop's greedy_calibrator
    names them: "bundled", the package's for the kinds it has one for; a path, that
    file for every kind."""
    if name == BUNDLED_CALIBRATOR:
        return {
            kind: read_calibrator(calibrator_file(name, file))
            for kind, file in GREEDY_FILES.items()
        }
    return for_every_kind(read_calibrator(calibrator_file(name)))
