"""Split a trace bank into a fitting part and a held-out part, by question.

The calibrator is fitted, and the loop's settings chosen, on the fitting part only; the
held-out part is what the loop's figures are reported on. Each source is split on its
own (a seeded shuffle of its questions), so both parts have every kind of question in
the same proportions.

    .venv/bin/python bench/split_runs.py bench/out/bank_qwen_*.jsonl \\
        --fit bench/out/bank_qwen_fit.jsonl --held-out bench/out/bank_qwen_held.jsonl \\
        [--held-out-share 0.4] [--seed 0]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from evaluator.runs import read_runs, split_by_source, write_runs


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="trace bank files (JSONL of labelled runs)")
    parser.add_argument("--fit", required=True, help="runs to fit and tune on")
    parser.add_argument("--held-out", required=True, help="runs to report on")
    parser.add_argument("--held-out-share", type=float, default=0.4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not 0 < args.held_out_share < 1:
        parser.error("--held-out-share must be between 0 and 1")
    runs = [run for path in args.runs for run in read_runs(path).runs]
    # A question banked twice (two files, or SingleEq's copies of AddSub's questions
    # converted apart) could land on both sides: no held-out part at all.
    for field, named in (("id", "an id"), ("prompt", "a prompt")):
        values = [value for run in runs if (value := getattr(run, field))]  # "": no prompt kept
        if len(set(values)) != len(values):
            parser.error(f"two runs share {named}: give each bank file its own questions")
    fitting, held = split_by_source(runs, args.held_out_share, args.seed)
    for path, part in ((args.fit, fitting), (args.held_out, held)):
        write_runs(part, path)
        print(f"wrote {path}: {len(part)} runs", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
