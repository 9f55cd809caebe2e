"""bench/loop_splits.py: the loop's recipe (calibrator and threshold from the fitting
half, one read of the other) over random splits of a small synthetic bank."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from evaluator.replay_report import LOOP_THRESHOLDS
from evaluator.runs import read_runs, split_by_source
from tests.support import ROOT, bench_script
from tests.test_loop_replay import synthetic_bank

SCRIPT = ROOT / "bench" / "loop_splits.py"
loop_splits = bench_script("loop_splits")


def test_each_split_chooses_on_its_fitting_half_and_reads_the_other(tmp_path: Path) -> None:
    bank, out = tmp_path / "bank.jsonl", tmp_path / "splits.json"
    synthetic_bank(bank)
    args = [str(bank), "--splits", "2", "--folds", "2", "--orders", "2", "--json", str(out)]
    script = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, check=False
    )
    assert script.returncode == 0, script.stderr
    outcomes = json.loads(out.read_text())
    assert [o["seed"] for o in outcomes] == [0, 1]
    runs = read_runs(bank).runs
    for o in outcomes:
        # Each question's majority of 8 is fixed by the bank (right on the even ones), so
        # fixed k=8's accuracy says which half was read: the split's held-out one.
        held = split_by_source(runs, 0.5, o["seed"])[1]
        assert o["reference_accuracy"] == sum(int(r.id[1:]) % 2 == 0 for r in held) / len(held)
        assert o["reference_tokens"] == 16.0  # 8 samples of 2 tokens
        assert 0.0 <= o["loop_accuracy"] <= 1.0 and 0.0 <= o["ece_at_stops"] <= 1.0
        assert o["tokens_saved"] == 1.0 - o["loop_tokens"] / 16.0
        assert 0.0 <= o["calibrated_floor"] <= 1.0
        # One source: its own figures are the pooled ones.
        (mine,) = o["by_source"].values()
        assert mine["ece_at_stops"] == pytest.approx(o["ece_at_stops"])
        assert mine["calibrated_median"] == pytest.approx(o["calibrated_floor"])
        assert mine["calibrated_median"] <= mine["calibrated_p95"]
        assert o["threshold"] in LOOP_THRESHOLDS
    assert "held-out tokens saved: median" in script.stdout


def test_per_source_splits_only_each_sources_first_questions(tmp_path: Path) -> None:
    bank, out = tmp_path / "bank.jsonl", tmp_path / "splits.json"
    synthetic_bank(bank)
    args = [str(bank), "--per-source", "10", "--splits", "1", "--folds", "2", "--orders", "2"]
    script = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--json", str(out)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert script.returncode == 0, script.stderr
    (o,) = json.loads(out.read_text())
    held = split_by_source(read_runs(bank).runs[:10], 0.5, 0)[1]
    assert o["reference_accuracy"] == sum(int(r.id[1:]) % 2 == 0 for r in held) / len(held)


def test_too_few_questions_for_the_folds_is_an_error_not_a_trace(tmp_path: Path) -> None:
    bank = tmp_path / "bank.jsonl"
    synthetic_bank(bank)
    script = subprocess.run(
        [sys.executable, str(SCRIPT), str(bank), "--splits", "1", "--folds", "50"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert script.returncode == 1
    assert script.stderr.startswith("error: folds must be within")
