"""Turn public per-prompt correctness tables into outcome JSONL (see router/outcomes.py).

Each output line is ``{"prompt", "small_correct", "large_correct"}``: how well a weak
("small") and a strong ("large") model did on one prompt. Sources, all read from the
shared data folder (``../shared/data`` from the project root unless --data says):

  routellm-gsm8k  routellm_gsm8k/gsm8k_responses.csv, GSM8K test (1,319 prompts)
  routellm-mmlu   routellm_mmlu/mmlu_*.csv, all 57 MMLU subjects (14,042 prompts)
      RouteLLM's own pair: small = mistralai/Mixtral-8x7B-Instruct-v0.1, large =
      gpt-4-1106-preview. Prompts in the folder's contaminated_prompts.jsonl (they
      also occur in RouteLLM's training data) are dropped, as its benchmarks.py does.
  routerbench     routerbench_subset/*.csv (ARC-Challenge, MBPP, Winogrande: 953 rows)
      small = mistralai/mixtral-8x7b-chat, large = gpt-4-1106-preview: the same pair
      RouteLLM routes between, as RouterBench names them. Rows where either model
      has no result are dropped.
  routerdc        routerdc_7models/*.json (GSM8K, MATH prealgebra, ARC, MMLU: 7,468 rows)
      small = mistralai/Mistral-7B-v0.1 (the base model the others are tuned from),
      large = cognitivecomputations/dolphin-2.9-llama3-8b (best on average, tied with
      the maths-only MetaMath-Mistral-7B). Scores are graded floats in [0, 1].

--small/--large pick another pair of the source's model columns. Run:
    .venv/bin/python bench/convert_outcomes.py SOURCE --out FILE.jsonl [--data DIR]
"""

from __future__ import annotations

import argparse
import ast
import csv
import math
import sys
from collections.abc import Iterator
from pathlib import Path

import msgspec

from router.outcomes import Outcome

ROOT = Path(__file__).resolve().parent.parent

DEFAULT_DATA = ROOT / ".." / "shared" / "data"


class Source(msgspec.Struct, frozen=True):
    folder: str
    small: str
    large: str


SOURCES = {
    "routellm-gsm8k": Source(
        "routellm_gsm8k", "mistralai/Mixtral-8x7B-Instruct-v0.1", "gpt-4-1106-preview"
    ),
    "routellm-mmlu": Source(
        "routellm_mmlu", "mistralai/Mixtral-8x7B-Instruct-v0.1", "gpt-4-1106-preview"
    ),
    "routerbench": Source(
        "routerbench_subset", "mistralai/mixtral-8x7b-chat", "gpt-4-1106-preview"
    ),
    "routerdc": Source(
        "routerdc_7models",
        "mistralai/Mistral-7B-v0.1",
        "cognitivecomputations/dolphin-2.9-llama3-8b",
    ),
}


class ConvertError(ValueError):
    """Input that cannot be converted; the message names the file (and row)."""


class Converted(msgspec.Struct):
    outcomes: list[Outcome]
    notes: list[str]  # what was dropped and why, for the user to see


class _ContaminatedLine(msgspec.Struct):
    eval_prompt: str


class _RouterDCRow(msgspec.Struct):
    question: str
    scores: dict[str, float]


class _Collector:
    """Builds outcomes, setting aside unusable rows by reason so they can be reported."""

    def __init__(self) -> None:
        self.outcomes: list[Outcome] = []
        self.dropped: dict[str, list[str]] = {}

    def add(self, prompt: str, small: Score, large: Score, where: str) -> None:
        if small is None or large is None:
            self.drop("a model has no result", where)
        elif not prompt.strip():
            self.drop("empty prompt", where)
        else:
            self.outcomes.append(Outcome(prompt, small, large))

    def drop(self, reason: str, where: str) -> None:
        self.dropped.setdefault(reason, []).append(where)

    def result(self, total: int) -> Converted:
        notes = []
        for reason, places in self.dropped.items():
            shown = ", ".join(places[:3]) + (", ..." if len(places) > 3 else "")
            notes.append(f"dropped {len(places)} of {total} rows: {reason} ({shown})")
        return Converted(self.outcomes, notes)


Score = bool | float | None


def convert(name: str, data: Path, small: str | None = None, large: str | None = None) -> Converted:
    source = SOURCES[name]
    folder = data / source.folder
    if not folder.is_dir():
        raise ConvertError(f"{folder}: no such folder (is --data right?)")
    pair = (small or source.small, large or source.large)
    if name == "routellm-gsm8k":
        return _routellm(folder, [folder / "gsm8k_responses.csv"], *pair)
    if name == "routellm-mmlu":
        return _routellm(folder, sorted(folder.glob("mmlu_*.csv")), *pair)
    if name == "routerbench":
        return _routerbench(sorted(folder.glob("*.csv")), *pair)
    return _routerdc(sorted(folder.glob("*.json")), *pair)


def parse_score(text: str) -> Score:
    """A correctness cell: True/False in any case, 0/1, or a graded number in [0, 1].
    Empty or NaN means the model has no result for the prompt (None). Whole 0/1 values
    become booleans, so that binary data stays binary in the output."""
    cleaned = text.strip().lower()
    if cleaned in ("true", "false"):
        return cleaned == "true"
    if cleaned in ("", "nan", "none", "null"):
        return None
    try:
        value = float(cleaned)
    except ValueError:
        raise ConvertError(f"not a correctness score: {text!r}") from None
    return _check_graded(value, text) if value not in (0, 1) else value == 1


def _check_graded(value: float, shown: object) -> float | None:
    if math.isnan(value):
        return None
    if not 0 <= value <= 1:
        raise ConvertError(f"correctness score out of [0, 1]: {shown!r}")
    return value


def _routellm(folder: Path, files: list[Path], small: str, large: str) -> Converted:
    if not files:
        raise ConvertError(f"{folder}: no response CSVs")
    contaminated = _contaminated(folder / "contaminated_prompts.jsonl")
    collector = _Collector()
    total = 0
    for row, where in _csv_rows(files, small, large):
        total += 1
        # Exact text match, as RouteLLM's ``~df["prompt"].isin(contaminated)``.
        if row["prompt"] in contaminated:
            collector.drop("contaminated (also in RouteLLM's training data)", where)
            continue
        collector.add(row["prompt"], _cell(row, small, where), _cell(row, large, where), where)
    return collector.result(total)


def _contaminated(path: Path) -> set[str]:
    decoder = msgspec.json.Decoder(_ContaminatedLine)
    try:
        lines = path.read_bytes().splitlines()
        return {decoder.decode(line).eval_prompt for line in lines if line.strip()}
    except (OSError, msgspec.DecodeError) as exc:
        raise ConvertError(f"{path}: {exc}") from exc


def _routerbench(files: list[Path], small: str, large: str) -> Converted:
    if not files:
        raise ConvertError("routerbench: no CSVs")
    collector = _Collector()
    total = 0
    for row, where in _csv_rows(files, small, large):
        total += 1
        prompt = _routerbench_prompt(row["prompt"])
        collector.add(prompt, _cell(row, small, where), _cell(row, large, where), where)
    return collector.result(total)


def _routerbench_prompt(cell: str) -> str:
    # RouterBench stores each prompt as the repr of a Python list of strings (one per
    # turn); a literal parse undoes the quoting that the repr added.
    try:
        parsed = ast.literal_eval(cell)
    except (ValueError, SyntaxError):
        return cell
    if isinstance(parsed, list) and all(isinstance(part, str) for part in parsed):
        return "\n\n".join(parsed)
    return cell


def _routerdc(files: list[Path], small: str, large: str) -> Converted:
    if not files:
        raise ConvertError("routerdc: no JSON files")
    collector = _Collector()
    total = 0
    for path in files:
        try:
            rows = msgspec.json.decode(path.read_bytes(), type=list[_RouterDCRow])
        except (OSError, msgspec.DecodeError) as exc:
            raise ConvertError(f"{path}: {exc}") from exc
        for number, row in enumerate(rows):
            total += 1
            where = f"{path.name}[{number}]"
            pair = []
            for model in (small, large):
                if model not in row.scores:
                    raise ConvertError(f"{where}: no score for {model!r}")
                try:
                    # Graded scores stay floats even where one is exactly 0 or 1, so
                    # that a file holds one kind of score.
                    pair.append(_check_graded(row.scores[model], row.scores[model]))
                except ConvertError as exc:
                    raise ConvertError(f"{where}: {exc}") from None
            collector.add(row.question, pair[0], pair[1], where)
    return collector.result(total)


def _cell(row: dict[str, str], column: str, where: str) -> Score:
    try:
        return parse_score(row[column] or "")
    except ConvertError as exc:
        raise ConvertError(f"{where}: {column}: {exc}") from None


def _csv_rows(files: list[Path], small: str, large: str) -> Iterator[tuple[dict[str, str], str]]:
    # Model responses in these CSVs run to many kilobytes per cell.
    csv.field_size_limit(sys.maxsize)
    for path in files:
        try:
            with path.open(newline="", encoding="utf-8") as file:
                reader = csv.DictReader(file)
                missing = {"prompt", small, large} - set(reader.fieldnames or [])
                if missing:
                    raise ConvertError(f"{path}: no column(s) {sorted(missing)}")
                for row in reader:
                    # line_num is the file line where the row ends: enough to find it.
                    yield row, f"{path.name}:{reader.line_num}"
        except OSError as exc:
            raise ConvertError(f"{path}: {exc}") from exc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("source", choices=sorted(SOURCES))
    parser.add_argument("--out", type=Path, required=True, help="outcome JSONL to write")
    parser.add_argument(
        "--data",
        type=Path,
        default=DEFAULT_DATA,
        help="shared data folder (default: ../shared/data from the project root)",
    )
    parser.add_argument("--small", help="model column to use as small (default: see above)")
    parser.add_argument("--large", help="model column to use as large (default: see above)")
    args = parser.parse_args(argv)

    try:
        converted = convert(args.source, args.data, args.small, args.large)
    except ConvertError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if not converted.outcomes:
        print(f"error: {args.source}: no usable rows", file=sys.stderr)
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("wb") as file:
        for outcome in converted.outcomes:
            file.write(msgspec.json.encode(outcome) + b"\n")

    for note in converted.notes:
        print(note)
    source = SOURCES[args.source]
    n = len(converted.outcomes)
    small_acc = sum(o.small for o in converted.outcomes) / n
    large_acc = sum(o.large for o in converted.outcomes) / n
    print(
        f"{args.source}: {n} rows, small {args.small or source.small} {small_acc:.1%}, "
        f"large {args.large or source.large} {large_acc:.1%} -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
