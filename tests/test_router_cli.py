"""`satisfice router fit | calibrate | eval` as an SRE runs them, on a small outcome file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from router.model_file import LogisticModel, read_router
from tests.support import satisfice

EASY = ["What is 2+2?", "Say hello.", "Name a colour.", "What is 3+5?", "Say thanks."]
HARD = [
    "Prove that there are infinitely many primes congruent to 3 mod 4.",
    "A tank fills at 12.5 L/min and drains at 4.75 L/min; it holds 1,240 L. How long?",
    "Derive the variance of a binomial distribution step by step.",
    "If 3 workers build 7 walls in 5.5 days, how many walls do 11 workers build in 9 days?",
    "Explain why the halting problem is undecidable with a diagonal argument.",
]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("router") / "outcomes.jsonl"
    lines = [{"prompt": p, "small_correct": True, "large_correct": True} for p in EASY]
    lines += [{"prompt": p, "small_correct": False, "large_correct": True} for p in HARD]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


# Slow: three CLI processes that load the embedder; the default run keeps the
# CLI's cross-validated eval and bad-line report, and fitting in test_router.
@pytest.mark.slow
def test_fit_then_calibrate(outcomes: Path, tmp_path: Path) -> None:
    router = tmp_path / "my.router"
    fitted = satisfice("router", "fit", "--outcomes", str(outcomes), "--out", str(router))
    assert fitted.returncode == 0, fitted.stderr
    model = read_router(router)
    assert isinstance(model, LogisticModel)
    assert model.embedding.startswith("all-minilm-l6-v2:") and len(model.prompts) == 10

    share = satisfice(
        "router", "calibrate", "--router", str(router),
        "--prompts", str(outcomes), "--large-fraction", "0.5",
    )  # fmt: skip
    assert share.returncode == 0, share.stderr
    assert json.loads(share.stdout)["large_fraction"] == 0.5

    quality = satisfice(
        "router", "calibrate", "--router", str(router),
        "--outcomes", str(outcomes), "--target-quality", "1.0",
    )  # fmt: skip
    assert quality.returncode == 0, quality.stderr
    assert json.loads(quality.stdout)["quality"] == 1.0


def test_eval_cross_validates(outcomes: Path, tmp_path: Path) -> None:
    plot = tmp_path / "curve.png"
    result = satisfice(
        "router", "eval", "--outcomes", str(outcomes), "--folds", "2",
        "--kind", "knn", "logistic", "--k", "3", "--json", "--plot", str(plot),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    reports = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["kind"] for r in reports] == ["knn", "logistic"]
    for report in reports:
        assert report["small_accuracy"] == 50.0 and report["large_accuracy"] == 100.0
        assert set(report) >= {"cpt50", "cpt80", "apgr", "auc", "random_apgr"}
        # Held out, at the threshold each fold's fit chose, hard prompts go large (five
        # examples a fold are too few for knn to send all of them).
        assert report["routed_accuracy"] > report["small_accuracy"]
        assert 0 < report["routed_large_share"] <= 50.0
    assert (reports[1]["routed_accuracy"], reports[1]["routed_large_share"]) == (100.0, 50.0)
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_malformed_outcome_lines(outcomes: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(outcomes.read_text() + '{"prompt": "x", "small_correct": "maybe"}\n')
    refused = satisfice("router", "fit", "--outcomes", str(bad), "--out", str(tmp_path / "r"))
    assert refused.returncode == 2
    assert f"{bad}:11:" in refused.stderr and "--skip-bad" in refused.stderr
    assert not (tmp_path / "r").exists()

    skipped = satisfice(
        "router", "fit", "--outcomes", str(bad), "--out", str(tmp_path / "r"), "--skip-bad"
    )
    assert skipped.returncode == 0, skipped.stderr
    assert "skipped 1 malformed lines" in skipped.stderr
