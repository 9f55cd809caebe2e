"""The calibrator: its metrics by hand, fitting on synthetic signals, its file, the runs
it is fitted on, and `satisfice evaluator fit` end to end on a small synthetic file."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.metrics import roc_auc_score

from evaluator.calibration import (
    Calibrator,
    CalibratorFileError,
    brier_score,
    calibrated_eces,
    cross_validate,
    expected_calibration_error,
    fit,
    measure,
    read_calibrator,
    read_greedy_calibrators,
    roc_auc,
    write_calibrator,
)
from evaluator.runs import (
    Run,
    RunAlternative,
    RunFileError,
    RunSample,
    RunToken,
    read_runs,
    write_runs,
)
from evaluator.signals import DEFAULT_FEATURES, SignalSettings, compute_signals
from evaluator.training import training_set
from tests.support import satisfice

# --- metrics ---------------------------------------------------------------------------


def test_ece_by_hand() -> None:
    # bin 0: 0.05 vs 0 right; bin 1: 0.15 vs 0; bin 9: mean 0.95 vs half right.
    p = [0.05, 0.15, 0.95, 0.95]
    y = [0, 0, 1, 0]
    expected = (1 * 0.05 + 1 * 0.15 + 2 * 0.45) / 4
    assert expected_calibration_error(p, y) == pytest.approx(expected)
    assert expected_calibration_error([1.0, 0.0], [1, 0]) == 0.0  # 1.0 sits in the last bin
    assert expected_calibration_error([0.5] * 4, [1, 0, 1, 0]) == 0.0
    assert expected_calibration_error([0.5] * 4, [1, 0, 1, 0], bins=1) == 0.0
    with pytest.raises(ValueError):
        expected_calibration_error([1.5], [1])
    with pytest.raises(ValueError):
        expected_calibration_error([], [])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 9), st.integers(0, 9)), min_size=1, max_size=12))
def test_ece_is_zero_when_each_probability_is_its_own_hit_rate(
    groups: list[tuple[int, int]],
) -> None:
    # n answers at probability m/n, m of them right: calibrated by construction. Within
    # any bin the mean probability is then Σm/Σn, which is exactly the bin's hit rate.
    p: list[float] = []
    y: list[int] = []
    for n, m in groups:
        m = min(m, n)
        p += [m / n] * n
        y += [1] * m + [0] * (n - m)
    assert expected_calibration_error(p, y) == pytest.approx(0.0, abs=1e-12)


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_ece_of_a_calibrated_sample_is_near_zero(seed: int) -> None:
    rng = np.random.default_rng(seed)
    p = rng.uniform(0, 1, 5000)
    y = rng.uniform(0, 1, 5000) < p
    assert expected_calibration_error(p, y) < 0.05
    # Claiming certainty for the same answers is far off.
    assert expected_calibration_error(np.ones(5000), y) > 0.4


def test_brier_and_auroc_by_hand() -> None:
    assert brier_score([0.8, 0.3], [1, 0]) == pytest.approx((0.2**2 + 0.3**2) / 2)
    # Of the 4 (right, wrong) pairs, 3 rank the right answer higher.
    assert roc_auc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx(0.75)
    assert roc_auc([0.5, 0.5], [0, 1]) == 0.5  # a tie counts half
    assert np.isnan(roc_auc([0.2, 0.3], [1, 1]))
    report = measure([0.8, 0.3], [1, 0])
    assert (report.n, report.accuracy, report.roc_auc) == (2, 0.5, 1.0)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.booleans()), min_size=2, max_size=40))
def test_auroc_matches_sklearn(pairs: list[tuple[int, bool]]) -> None:
    scores = [s / 5 for s, _ in pairs]
    labels = [y for _, y in pairs]
    if len(set(labels)) < 2:
        assert np.isnan(roc_auc(scores, labels))
    else:
        assert roc_auc(scores, labels) == pytest.approx(roc_auc_score(labels, scores))


# --- fitting ---------------------------------------------------------------------------

FEATURES = ["vote_share", "tail_confidence"]


def synthetic(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Two signals; the answer is right with probability sigmoid(3 * (vote share - 0.5)
    + tail - 1), a shape no single threshold gets right."""
    rng = np.random.default_rng(seed)
    share = rng.uniform(0, 1, n)
    tail = rng.gamma(2.0, 0.5, n)
    chance = 1 / (1 + np.exp(-(6 * (share - 0.5) + (tail - 1))))
    return np.column_stack([share, tail]), (rng.uniform(0, 1, n) < chance).astype(float)


def test_fit_is_calibrated_and_ranks_on_held_out_rows() -> None:
    rows, labels = synthetic(1200, seed=1)
    held_out = cross_validate(rows, labels, np.arange(len(labels)), FEATURES, folds=4)
    report = measure(held_out, labels)
    assert report.ece < 0.06
    assert report.roc_auc > 0.75
    assert report.brier < 0.2


def test_isotonic_goes_on_top_only_with_enough_labels() -> None:
    rows, labels = synthetic(400, seed=2)
    small = fit(rows[:100], labels[:100], FEATURES)
    assert small.isotonic_x == [] and small.labels == 100
    large = fit(rows, labels, FEATURES)
    assert len(large.isotonic_x) >= 2 and large.labels == 400
    assert large.positives == int(labels.sum())
    assert fit(rows, labels, FEATURES, isotonic_min=1000).isotonic_x == []
    # More agreement never lowers P(correct), before or after the isotonic map.
    grid = np.column_stack([np.linspace(0, 1, 50), np.full(50, 1.0)])
    for model in (small, large):
        p = model.predict(grid)
        assert np.all(np.diff(p) >= 0) and np.all((p >= 0) & (p <= 1))


def test_fit_refuses_what_it_cannot_learn_from() -> None:
    rows, labels = synthetic(50, seed=3)
    with pytest.raises(ValueError, match="both correct and incorrect"):
        fit(rows, np.ones(50), FEATURES)
    with pytest.raises(ValueError, match="unknown features"):
        fit(rows, labels, ["vote_share", "vibes"])
    with pytest.raises(ValueError, match="finite"):
        fit(np.full((50, 2), np.nan), labels, FEATURES)
    with pytest.raises(ValueError, match="0 or 1"):
        fit(rows, labels * 2, FEATURES)
    with pytest.raises(ValueError, match="folds"):
        cross_validate(rows, labels, np.zeros(50), FEATURES, folds=2)


def test_cross_validation_keeps_a_question_in_one_fold() -> None:
    # Each question has two rows with the same signals. Kept in one fold, the twins are
    # scored by the same model and get the same probability; split, two models that
    # saw different data would score them (almost surely) differently.
    rng = np.random.default_rng(4)
    rows = np.repeat(rng.uniform(0, 1, (100, 2)), 2, axis=0)
    labels = np.repeat(rng.uniform(0, 1, 100) < 0.5, 2).astype(float)
    groups = np.repeat(np.arange(100), 2)
    held_out = cross_validate(rows, labels, groups, FEATURES, folds=5)
    assert held_out.shape == (200,) and np.allclose(held_out[::2], held_out[1::2])


def test_probability_reads_signals_in_the_files_order() -> None:
    rows, labels = synthetic(300, seed=5)
    model = fit(rows[:, ::-1], labels, FEATURES[::-1])
    run = [_sample("The answer is 18", [(-0.1, [-0.1, -4.0])])]
    signals = compute_signals("number", run, settings=SignalSettings(top_k=2))
    expected = model.predict([signals.features(["tail_confidence", "vote_share"])])[0]
    assert model.probability(signals) == pytest.approx(expected)


# --- the file --------------------------------------------------------------------------


@pytest.fixture
def model() -> Calibrator:
    rows, labels = synthetic(300, seed=6)
    return fit(rows, labels, FEATURES, signals=SignalSettings(group_window=8), trained_on="x")


def test_file_round_trip(model: Calibrator, tmp_path: Path) -> None:
    path = tmp_path / "evaluator.calibrator"
    write_calibrator(model, path)
    loaded = read_calibrator(path, features=FEATURES)
    assert loaded == model and loaded.signals.group_window == 8
    grid = np.random.default_rng(7).uniform(0, 2, (20, 2))
    assert np.array_equal(loaded.predict(grid), model.predict(grid))


def test_file_refusals(model: Calibrator, tmp_path: Path) -> None:
    path = tmp_path / "evaluator.calibrator"

    def refused(data: bytes, match: str, **kwargs: list[str]) -> None:
        path.write_bytes(data)
        with pytest.raises(CalibratorFileError, match=match) as caught:
            read_calibrator(path, **kwargs)
        assert str(path) in str(caught.value)

    encode = msgspec.msgpack.encode
    replace = msgspec.structs.replace
    refused(encode(replace(model, version=2)), "version 2, but this Satisfice reads version 1")
    refused(encode({"format": "satisfice-router", "version": 1}), "not a satisfice-calibrator")
    refused(b"\xc1not msgpack", "not a satisfice-calibrator")
    refused(encode(replace(model, features=["vote_share", "vibes"])), "does not compute: vibes")
    refused(encode(model), r"fitted on features \[vote_share, tail_confidence\]", features=["x"])
    refused(encode(replace(model, weights=[1.0])), "corrupt: 2 features but 1 weights")
    refused(encode({"format": "satisfice-calibrator", "version": 1}), "corrupt")
    with pytest.raises(CalibratorFileError, match="cannot read"):
        read_calibrator(tmp_path / "absent")


# --- runs ------------------------------------------------------------------------------


def _sample(text: str, tokens: list[tuple[float, list[float]]]) -> RunSample:
    return RunSample(
        text=text,
        logprobs=tuple(
            RunToken("t", lp, tuple(RunAlternative("a", alt) for alt in top)) for lp, top in tokens
        ),
    )


def test_read_runs_decodes_the_compact_logprobs(tmp_path: Path) -> None:
    path = tmp_path / "runs.jsonl"
    line = {
        "id": "q1",
        "kind": "number",
        "answers": ["18"],
        "samples": [
            {"text": "The answer is 18", "logprobs": [["18", -0.02, [["18", -0.02], ["16", -4]]]]},
            {"text": "16", "logprobs": [["16", -1.5]], "completion_tokens": 1},
        ],
    }
    path.write_text("\n" + json.dumps(line) + "\n")
    (run,) = read_runs(path).runs
    assert run.samples[0].logprobs[0] == RunToken(
        "18", -0.02, (RunAlternative("18", -0.02), RunAlternative("16", -4.0))
    )
    assert run.samples[1].logprobs[0].top == () and run.samples[1].completion_tokens == 1
    assert run.question.answers == ["18"] and run.question.kind == "number"
    copy = tmp_path / "copy.jsonl"
    write_runs([run, run], copy)
    assert read_runs(copy).runs == [run, run]


def test_read_runs_names_bad_lines(tmp_path: Path) -> None:
    path = tmp_path / "runs.jsonl"
    good = {"id": "q1", "kind": "yesno", "answers": ["yes"], "samples": [{"text": "yes"}]}
    bad = {"id": "q2", "kind": "essay", "answers": ["x"], "samples": [{"text": "x"}]}
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n{broken\n")
    with pytest.raises(RunFileError, match=r"runs\.jsonl:2: .*--skip-bad"):
        read_runs(path)
    loaded = read_runs(path, skip_bad=True)
    assert [r.id for r in loaded.runs] == ["q1"]
    assert [p.split(": ")[0].rsplit(":", 1)[1] for p in loaded.skipped] == ["2", "3"]
    path.write_text(json.dumps(bad) + "\n")
    with pytest.raises(RunFileError, match="no usable runs"):
        read_runs(path, skip_bad=True)
    with pytest.raises(RunFileError, match="cannot read"):
        read_runs(tmp_path / "absent")


def test_training_set_labels_the_majority_of_the_first_k() -> None:
    runs = [
        Run(
            id="a",
            kind="number",
            answers=["18"],
            samples=tuple(_sample(t, []) for t in ("answer: 18", "answer: 16", "answer: 16")),
        ),
        Run(id="b", kind="number", answers=["6"], samples=(_sample("answer: 6.0", []),)),
    ]
    data = training_set(runs, [1, 3])
    assert data.short == {1: 0, 3: 1}  # run b has one sample
    assert data.groups == [0, 0, 1] and data.ks == [1, 3, 1]
    # a at k=1: "18", right; a at k=3: "16" wins 2-1, wrong; b: "6.0" reads as 6, right.
    assert data.labels == [True, False, True]
    assert [s.answer for s in data.signals] == ["18", "16", "6"]
    assert data.rows(["vote_share"]).tolist() == [[1.0], [2 / 3], [1.0]]
    with pytest.raises(ValueError):
        training_set(runs, [0])


# --- the command -----------------------------------------------------------------------


def write_synthetic_runs(path: Path, n: int, *, logprobs: bool = True, seed: int = 0) -> None:
    """Runs whose samples agree more, and are surer token by token, when the question
    is easy, so that the signals carry something to calibrate."""
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(n):
        ease = rng.uniform(0.1, 0.95)
        samples = []
        for _ in range(6):
            right = rng.uniform() < ease
            answer = "18" if right else str(rng.choice(["16", "17", "20"]))
            gap = rng.uniform(2, 6) if right else rng.uniform(0.1, 2)
            tokens = [
                ["x", -0.1, [["x", -0.1], ["y", -0.1 - gap]]]
                for _ in range(int(rng.integers(3, 9)))
            ]
            sample: dict[str, object] = {"text": f"So the answer is {answer}."}
            if logprobs:
                sample["logprobs"] = tokens
            samples.append(sample)
        lines.append({"id": f"q{i}", "kind": "number", "answers": ["18"], "samples": samples})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_evaluator_fit_command(tmp_path: Path) -> None:
    runs = tmp_path / "runs.jsonl"
    out = tmp_path / "evaluator.calibrator"
    write_synthetic_runs(runs, 80)
    done = satisfice(
        "evaluator", "fit", "--runs", str(runs), "--out", str(out),
        "--k", "3", "5", "--folds", "4", "--top-k", "2", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["runs"] == 80 and report["rows"] == 160 and report["k"] == [3, 5]
    assert report["features"] == list(DEFAULT_FEATURES) and report["folds"] == 4
    held_out = report["held_out"]
    assert set(held_out) == {"n", "accuracy", "ece", "brier", "roc_auc"}
    assert held_out["n"] == 160 and held_out["roc_auc"] > 0.6
    assert set(report["uncalibrated"]) == {"vote_share", "majority_probability"}
    model = read_calibrator(out, features=DEFAULT_FEATURES)
    assert model.labels == 160 and model.signals.top_k == 2 and "runs.jsonl" in model.trained_on


def test_evaluator_fit_command_without_logprobs(tmp_path: Path) -> None:
    runs = tmp_path / "runs.jsonl"
    out = tmp_path / "evaluator.calibrator"
    write_synthetic_runs(runs, 40, logprobs=False)
    missing = satisfice("evaluator", "fit", "--runs", str(runs), "--out", str(out))
    assert missing.returncode == 2
    assert "mean_logprob" in missing.stderr and "--features" in missing.stderr
    assert not out.exists()
    done = satisfice(
        "evaluator", "fit", "--runs", str(runs), "--out", str(out),
        "--features", "vote_share", "majority_probability", "--k", "9",
    )  # fmt: skip
    assert done.returncode == 2 and "no run has 9 samples" in done.stderr
    done = satisfice(
        "evaluator", "fit", "--runs", str(runs), "--out", str(out),
        "--features", "vote_share", "majority_probability", "--group-window", "0",
    )  # fmt: skip
    assert done.returncode == 2 and "group_window" in done.stderr
    done = satisfice(
        "evaluator", "fit", "--runs", str(runs), "--out", str(out),
        "--features", "vote_share", "majority_probability",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "held_out:" in done.stdout
    assert read_calibrator(out).features == ["vote_share", "majority_probability"]


def test_evaluator_fit_leaves_out_rows_without_signals(tmp_path: Path) -> None:
    runs = tmp_path / "runs.jsonl"
    out = tmp_path / "evaluator.calibrator"
    write_synthetic_runs(runs, 60)
    # Two more runs whose samples all came back empty: no text, no logprobs.
    empty = {"kind": "number", "answers": ["18"], "samples": [{"text": ""}] * 6}
    with runs.open("a") as file:
        for i in range(2):
            file.write(json.dumps({"id": f"empty{i}", **empty}) + "\n")
    done = satisfice(
        "evaluator", "fit", "--runs", str(runs), "--out", str(out), "--k", "3", "--json"
    )
    assert done.returncode == 0, done.stderr
    assert "left out 2 rows" in done.stderr
    assert json.loads(done.stdout)["rows"] == 60


def test_the_noise_floor_is_nil_where_p_is_certain_and_not_where_it_is_a_coin() -> None:
    certain = np.array([0.0, 1.0, 1.0, 0.0])
    assert set(calibrated_eces(certain, [0, 0, 1, 1], seed=0)) == {0.0}
    # 50 questions at P = 0.5, 8 entries each sharing a draw: about 0.5 * 1/sqrt(50) off.
    coin = np.full(400, 0.5)
    floor = float(np.median(calibrated_eces(coin, [i // 8 for i in range(400)], seed=0)))
    assert 0.02 < floor < 0.15
    # Sharing a draw is what keeps it there: 400 questions of one entry each sit lower.
    alone = float(np.median(calibrated_eces(coin, list(range(400)), seed=0)))
    assert alone < floor / 2


def test_the_bundled_greedy_calibrators_are_by_kind_and_a_file_serves_every_kind(
    tmp_path: Path,
) -> None:
    bundled = read_greedy_calibrators("bundled")
    assert set(bundled) == {"choice", "number"}
    for kind, model in bundled.items():
        assert model.features == ["mean_logprob", "mean_confidence"]
        assert f"{kind} answers" in model.trained_on and model.labels >= 50
    path = tmp_path / "mine.calibrator"
    write_calibrator(bundled["choice"], path)
    mine = read_greedy_calibrators(str(path))
    assert set(mine) == {"choice", "number", "yesno", "text"}
    assert all(model == bundled["choice"] for model in mine.values())
    with pytest.raises(CalibratorFileError, match=r"missing\.calibrator"):
        read_greedy_calibrators(str(tmp_path / "missing.calibrator"))
