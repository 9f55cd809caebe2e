"""bench/split_runs.py and evaluator.runs.split_by_source: a trace bank split by question
into a fitting and a held-out part."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec

from evaluator.runs import Run, RunSample, read_runs, split_by_source
from tests.support import ROOT


def _runs(source: str, count: int) -> list[Run]:
    sample = (RunSample(text="1"),)
    return [
        Run(id=f"{source}-{i}", kind="number", answers=["1"], samples=sample, source=source)
        for i in range(count)
    ]


def test_each_source_is_split_in_proportion_with_no_question_on_both_sides() -> None:
    runs = _runs("gsm8k", 10) + _runs("arc", 30)
    fitting, held = split_by_source(runs, 0.4, 0)
    assert {r.id for r in fitting}.isdisjoint(r.id for r in held)
    assert len(fitting) + len(held) == len(runs)
    assert [r.source for r in held].count("gsm8k") == 4
    assert [r.source for r in held].count("arc") == 12
    # Reproducible from the seed, and a source's split does not depend on the others.
    assert split_by_source(runs, 0.4, 0) == (fitting, held)
    alone = split_by_source(_runs("gsm8k", 10), 0.4, 0)[1]
    assert [r.id for r in alone] == [r.id for r in held if r.source == "gsm8k"]
    assert split_by_source(runs, 0.4, 1)[1] != held


def test_the_script_writes_both_parts_and_refuses_ids_that_repeat(tmp_path: Path) -> None:
    bank = tmp_path / "bank.jsonl"
    bank.write_bytes(b"".join(msgspec.json.encode(r) + b"\n" for r in _runs("gsm8k", 5)))
    fit, held = tmp_path / "fit.jsonl", tmp_path / "held.jsonl"
    script = [sys.executable, str(ROOT / "bench" / "split_runs.py")]
    done = subprocess.run(
        [*script, str(bank), "--fit", str(fit), "--held-out", str(held)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert len(read_runs(fit).runs) == 3 and len(read_runs(held).runs) == 2
    # The same file twice: every question on both sides would be no held-out part at all.
    twice = subprocess.run(
        [*script, str(bank), str(bank), "--fit", str(fit), "--held-out", str(held)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert twice.returncode == 2 and "share an id" in twice.stderr
    # The same question under another id (converted in another file) is refused too.
    renamed = [msgspec.structs.replace(r, id=f"other-{r.id}", prompt="Same?") for r in
               _runs("gsm8k", 2)]  # fmt: skip
    bank.write_bytes(b"".join(msgspec.json.encode(r) + b"\n" for r in renamed))
    copied = subprocess.run(
        [*script, str(bank), "--fit", str(fit), "--held-out", str(held)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert copied.returncode == 2 and "share a prompt" in copied.stderr
