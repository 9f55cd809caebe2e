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


def test_a_grown_bank_splits_as_before_and_holds_its_new_questions_out(tmp_path: Path) -> None:
    """--per-source N splits each source's first N as the bank of N alone was split; the
    questions the bank grew by go to --rest, on neither side."""
    small, grown = tmp_path / "small.jsonl", tmp_path / "grown.jsonl"
    runs = _runs("gsm8k", 4) + _runs("arc", 10)
    small.write_bytes(b"".join(msgspec.json.encode(r) + b"\n" for r in runs))
    grown.write_bytes(small.read_bytes() + b"".join(
        msgspec.json.encode(r) + b"\n" for r in _runs("arc", 16)[10:]))  # fmt: skip
    script = [sys.executable, str(ROOT / "bench" / "split_runs.py")]
    parts = {name: tmp_path / f"{name}.jsonl" for name in ("fit", "held", "fit2", "held2", "rest")}
    before = subprocess.run(
        [*script, str(small), "--fit", str(parts["fit"]), "--held-out", str(parts["held"])],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert before.returncode == 0, before.stderr
    after = subprocess.run(
        [*script, str(grown), "--fit", str(parts["fit2"]), "--held-out", str(parts["held2"]),
         "--per-source", "10", "--rest", str(parts["rest"])],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert after.returncode == 0, after.stderr
    assert parts["fit2"].read_bytes() == parts["fit"].read_bytes()
    assert parts["held2"].read_bytes() == parts["held"].read_bytes()
    assert [r.id for r in read_runs(parts["rest"]).runs] == [f"arc-{i}" for i in range(10, 16)]
    alone = subprocess.run(
        [*script, str(grown), "--fit", str(parts["fit2"]), "--held-out", str(parts["held2"]),
         "--per-source", "10"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert alone.returncode == 2 and "go together" in alone.stderr
