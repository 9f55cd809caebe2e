"""bench/convert_outcomes.py on the real public data (when present) and on tiny fakes."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from router.outcomes import Outcome, read_outcomes
from tests.support import bench_script

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "convert_outcomes.py"
DATA = ROOT.parent / "shared" / "data"
MIXTRAL = "mistralai/Mixtral-8x7B-Instruct-v0.1"
GPT4 = "gpt-4-1106-preview"

csv.field_size_limit(sys.maxsize)


converter = bench_script("convert_outcomes")


def needs_data(folder: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(
        not (DATA / folder).is_dir(),
        reason=f"public data ../shared/data/{folder} is not present next to the project",
    )


def convert(source: str, out: Path, data: Path = DATA) -> tuple[list[Outcome], str]:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), source, "--out", str(out), "--data", str(data)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return read_outcomes(out).outcomes, result.stdout


def accuracy(outcomes: list[Outcome]) -> tuple[float, float]:
    n = len(outcomes)
    return sum(o.small for o in outcomes) / n, sum(o.large for o in outcomes) / n


def routellm_expected(folder: Path, files: list[Path]) -> tuple[int, float, float]:
    """Rows kept and both accuracies, straight from the CSVs."""
    with (folder / "contaminated_prompts.jsonl").open(encoding="utf-8") as file:
        contaminated = {json.loads(line)["eval_prompt"] for line in file if line.strip()}
    rows = []
    for path in files:
        with path.open(newline="", encoding="utf-8") as file:
            rows += [row for row in csv.DictReader(file) if row["prompt"] not in contaminated]
    n = len(rows)
    return (
        n,
        sum(row[MIXTRAL] == "True" for row in rows) / n,
        sum(row[GPT4] == "True" for row in rows) / n,
    )


@needs_data("routellm_gsm8k")
def test_routellm_gsm8k(tmp_path: Path) -> None:
    folder = DATA / "routellm_gsm8k"
    outcomes, stdout = convert("routellm-gsm8k", tmp_path / "gsm8k.jsonl")
    n, mixtral, gpt4 = routellm_expected(folder, [folder / "gsm8k_responses.csv"])
    # GSM8K's test split is 1,319 problems; RouteLLM lists a dozen as contaminated.
    assert 1319 - 20 <= len(outcomes) == n < 1319
    assert f"dropped {1319 - n} of 1319" in stdout
    assert accuracy(outcomes) == pytest.approx((mixtral, gpt4))
    assert gpt4 > mixtral + 0.15  # GPT-4 is far better at grade-school maths
    assert all(isinstance(o.small_correct, bool) for o in outcomes)


@needs_data("routellm_mmlu")
def test_routellm_mmlu(tmp_path: Path) -> None:
    folder = DATA / "routellm_mmlu"
    files = sorted(folder.glob("mmlu_*.csv"))
    assert len(files) == 57
    outcomes, stdout = convert("routellm-mmlu", tmp_path / "mmlu.jsonl")
    n, mixtral, gpt4 = routellm_expected(folder, files)
    assert 14042 - 20 <= len(outcomes) == n < 14042
    assert f"dropped {14042 - n} of 14042" in stdout
    assert accuracy(outcomes) == pytest.approx((mixtral, gpt4))
    assert gpt4 > mixtral + 0.05


@needs_data("routerbench_subset")
def test_routerbench(tmp_path: Path) -> None:
    small, large = "mistralai/mixtral-8x7b-chat", GPT4
    rows = []
    for path in sorted((DATA / "routerbench_subset").glob("*.csv")):
        with path.open(newline="", encoding="utf-8") as file:
            rows += [row for row in csv.DictReader(file) if row[small] and row[large]]
    outcomes, _ = convert("routerbench", tmp_path / "routerbench.jsonl")
    assert 900 <= len(outcomes) == len(rows) <= 953
    expected = (
        sum(float(row[small]) for row in rows) / len(rows),
        sum(float(row[large]) for row in rows) / len(rows),
    )
    assert accuracy(outcomes) == pytest.approx(expected)
    assert expected[1] > expected[0]
    # Prompts come out as plain text, not as the repr of a Python list.
    assert not any(o.prompt.startswith("['") for o in outcomes)


@needs_data("routerdc_7models")
def test_routerdc(tmp_path: Path) -> None:
    small, large = "mistralai/Mistral-7B-v0.1", "cognitivecomputations/dolphin-2.9-llama3-8b"
    rows = []
    for path in sorted((DATA / "routerdc_7models").glob("*.json")):
        rows += json.loads(path.read_text(encoding="utf-8"))
    outcomes, _ = convert("routerdc", tmp_path / "routerdc.jsonl")
    assert len(outcomes) == len(rows) > 7000
    expected = (
        sum(row["scores"][small] for row in rows) / len(rows),
        sum(row["scores"][large] for row in rows) / len(rows),
    )
    assert accuracy(outcomes) == pytest.approx(expected)
    assert expected[1] > expected[0]
    assert all(isinstance(o.large_correct, float) for o in outcomes)


def test_fake_routellm_folder(tmp_path: Path) -> None:
    folder = tmp_path / "routellm_gsm8k"
    folder.mkdir()
    with (folder / "gsm8k_responses.csv").open("w", newline="", encoding="utf-8") as file:
        writer = csv.writer(file)
        writer.writerow(["prompt", MIXTRAL, GPT4, f"{GPT4}_response"])
        writer.writerow(["What is 1+1?", "True", "True", "2"])
        writer.writerow(["A multi-line,\nquoted prompt", " false ", "TRUE", "x"])
        writer.writerow(["Seen in training", "False", "True", "y"])
        writer.writerow(["No result", "", "True", "z"])
    (folder / "contaminated_prompts.jsonl").write_text(
        json.dumps({"train_prompt": "t", "eval_prompt": "Seen in training"}) + "\n",
        encoding="utf-8",
    )
    outcomes, stdout = convert("routellm-gsm8k", tmp_path / "out.jsonl", data=tmp_path)
    assert outcomes == [
        Outcome("What is 1+1?", True, True),
        Outcome("A multi-line,\nquoted prompt", False, True),
    ]
    assert "dropped 1 of 4 rows: contaminated" in stdout
    assert "dropped 1 of 4 rows: a model has no result" in stdout
    assert "2 rows" in stdout.splitlines()[-1]


def test_missing_folder_is_a_clear_error(tmp_path: Path) -> None:
    out = tmp_path / "x.jsonl"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "routerdc", "--out", str(out), "--data", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 1
    assert "routerdc_7models: no such folder" in result.stderr
    assert not out.exists()


@pytest.mark.parametrize(
    ("cell", "expected"),
    [
        ("True", True),
        (" false\n", False),
        ("TRUE", True),
        ("1.0", True),
        ("0", False),
        ("0.25", 0.25),
        ("", None),
        ("nan", None),
    ],
)
def test_parse_score(cell: str, expected: bool | float | None) -> None:
    parsed = converter.parse_score(cell)
    assert parsed == expected
    assert type(parsed) is type(expected)


@pytest.mark.parametrize("cell", ["yes please", "1.5", "-0.1"])
def test_parse_score_rejects(cell: str) -> None:
    with pytest.raises(converter.ConvertError):
        converter.parse_score(cell)
