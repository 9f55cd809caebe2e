"""Split a trace bank into a fitting part and a held-out part, by question.

The calibrator is fitted, and the loop's settings chosen, on the fitting part only; the
held-out part is what the loop's figures are reported on. Each source is split on its
own (a seeded shuffle of its questions), so both parts have every kind of question in
the same proportions. With --per-source N only each source's first N questions are split;
the questions a bank grew by after them go to --rest, held out from everything, so
that growing a bank leaves the split, and what was fitted on it, as they were.

    .venv/bin/python bench/split_runs.py bench/out/bank_qwen_*.jsonl \\
        --fit bench/out/bank_qwen_fit.jsonl --held-out bench/out/bank_qwen_held.jsonl \\
        [--held-out-share 0.4] [--seed 0] [--per-source 240 --rest FILE]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from evaluator.runs import Run, read_runs, split_by_source, take_per_source, write_runs


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="trace bank files (JSONL of labelled runs)")
    parser.add_argument("--fit", required=True, help="runs to fit and tune on")
    parser.add_argument("--held-out", required=True, help="runs to report on")
    parser.add_argument("--held-out-share", type=float, default=0.4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--per-source", type=int, help="split each source's first N runs only")
    parser.add_argument("--rest", help="the runs after each source's first N (with --per-source)")
    args = parser.parse_args(argv)
    if not 0 < args.held_out_share < 1:
        parser.error("--held-out-share must be between 0 and 1")
    if (args.per_source is None) != (args.rest is None):
        parser.error("--per-source and --rest go together")
    if args.per_source is not None and args.per_source < 1:
        parser.error("--per-source must be at least 1")
    runs = [run for path in args.runs for run in read_runs(path).runs]
    # A question banked twice (two files, or SingleEq's copies of AddSub's questions
    # converted apart) could land on both sides: no held-out part at all.
    for field, named in (("id", "an id"), ("prompt", "a prompt")):
        values = [value for run in runs if (value := getattr(run, field))]  # "": no prompt kept
        if len(set(values)) != len(values):
            parser.error(f"two runs share {named}: give each bank file its own questions")
    parts: list[tuple[str, list[Run]]] = []
    if args.per_source is not None:
        parts.append((args.rest, take_per_source(runs, len(runs), skip=args.per_source)))
        runs = take_per_source(runs, args.per_source)
    fitting, held = split_by_source(runs, args.held_out_share, args.seed)
    for path, part in ((args.fit, fitting), (args.held_out, held), *parts):
        write_runs(part, path)
        print(f"wrote {path}: {len(part)} runs", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
