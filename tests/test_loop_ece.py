"""bench/loop_ece.py: the embedded default loop's P at its stops, per source and pooled,
against what a calibrated P would show, on a small synthetic bank of two sources."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from evaluator.runs import read_runs, write_runs
from gateway.config import load_config
from tests.support import ROOT
from tests.test_loop_replay import synthetic_bank

SCRIPT = ROOT / "bench" / "loop_ece.py"


def two_sources(path: Path) -> None:
    synthetic_bank(path)
    runs = read_runs(path).runs
    write_runs(
        [msgspec.structs.replace(r, source="a" if i < 4 else "b") for i, r in enumerate(runs)],
        path,
    )


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, check=False
    )


def test_each_source_and_the_pool_read_against_a_calibrated_p(tmp_path: Path) -> None:
    bank, out, png = tmp_path / "bank.jsonl", tmp_path / "ece.json", tmp_path / "ece.png"
    two_sources(bank)
    done = run(str(bank), "--orders", "2", "--json", str(out), "--plot", str(png))
    assert done.returncode == 0, done.stderr
    results = {r["group"]: r for r in json.loads(out.read_text())}
    assert list(results) == ["a", "b", "all"]
    assert [results[g]["questions"] for g in results] == [4, 8, 12]
    for r in results.values():
        stops = sum(n for _, _, n in r["bins"])
        assert stops == 2 * r["questions"]  # one stop per question and branch order
        # The ECE is its bins' weighted gaps, and the share right their weighted mean.
        gaps = sum(n * abs(right - p) for p, right, n in r["bins"]) / stops
        assert r["ece"] == pytest.approx(gaps)
        assert r["accuracy"] == pytest.approx(sum(n * right for _, right, n in r["bins"]) / stops)
        assert 0.0 <= r["calibrated_median"] <= r["calibrated_p95"] <= 1.0
    pooled = (4 * results["a"]["accuracy"] + 8 * results["b"]["accuracy"]) / 12
    assert results["all"]["accuracy"] == pytest.approx(pooled)
    assert png.stat().st_size > 0
    assert "| all | 12 |" in done.stdout


def test_a_bank_too_short_for_a_round_is_a_clear_error(tmp_path: Path) -> None:
    bank = tmp_path / "bank.jsonl"
    synthetic_bank(bank)
    runs = read_runs(bank).runs
    write_runs([msgspec.structs.replace(r, samples=r.samples[:1]) for r in runs], bank)
    done = run(str(bank))
    assert done.returncode == 2
    loop = load_config().loop
    assert loop is not None
    assert f"fewer than a round of {loop.branches}" in done.stderr
