"""The reasoning loop live on a subset of the trace bank's questions, against what the
replay over the bank predicts for the same questions.

The live run is evaluator.loop.ReasoningLoop itself on the bundled large model, with
the default config's loop settings and calibrator, no deadline, fresh random samples;
the prediction is evaluator.replay's loop rule (bench/loop_replay.py's) with the same
settings and calibrator over the bank's samples of each question (in several random
orders).
They should agree within sampling noise: accuracy (95% Wilson intervals), completion
tokens and rounds per question, and the stop reasons.

    .venv/bin/python bench/loop_live.py --runs bench/out/bank.jsonl --per-source 20 \\
        [--skip 20] [--max-tokens 16] [--json bench/out/loop_live.json]

Each question is also compared with itself: live less replayed rounds, correctness and
P, with the standard error over questions, which says "within noise" more sharply
than two intervals that overlap.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec

from engines import create_engine
from engines.base import Message
from evaluator.answers import is_correct
from evaluator.calibration import Calibrator, calibrator_file, read_calibrator
from evaluator.loop import LoopResult, ReasoningLoop
from evaluator.policy import LoopSettings
from evaluator.replay import DEFAULT_ORDERS, replay_loop
from evaluator.replay_report import wilson
from evaluator.runs import Run, read_runs, take_per_source
from gateway.config import load_config

ROOT = Path(__file__).resolve().parent.parent


async def live(
    runs: list[Run],
    settings: LoopSettings,
    calibrator: Calibrator,
    models_dir: Path,
    max_tokens: int | None = None,
) -> list[dict[str, Any]]:
    config = load_config()
    engine = create_engine("large", config.engines["large"], models_dir)
    await engine.start()
    loop = ReasoningLoop(engine, settings, calibrator)
    rows = []
    try:
        for number, run in enumerate(runs, start=1):
            result = None
            messages = [Message("user", run.prompt)]
            async for event in loop.run(messages, deadline=None, max_tokens=max_tokens):
                if isinstance(event, LoopResult):
                    result = event
            assert result is not None
            trace = result.trace
            rows.append(
                {
                    "id": run.id,
                    "source": run.source,
                    "kind": trace.kind,  # as the loop read the question
                    "correct": is_correct(run.question, result.text),
                    "tokens": trace.tokens,
                    "rounds": len(trace.rounds),
                    "stop": trace.stop,
                    "confidence": trace.confidence,
                }
            )
            if number % 10 == 0:
                print(f"{number}/{len(runs)}", file=sys.stderr, flush=True)
    finally:
        await engine.close()
    return rows


def predicted(
    runs: list[Run], settings: LoopSettings, calibrator: Calibrator, orders: int
) -> list[dict[str, Any]]:
    return [
        {
            "id": run.id,
            "source": run.source,
            "correct": outcome.correct,
            "tokens": outcome.tokens,
            "rounds": outcome.branches // settings.branches,
            "confidence": outcome.probability,
        }
        for run, outcome in replay_loop(runs, settings, calibrator, orders)
    ]


def summary(rows: list[dict[str, Any]], questions: int) -> dict[str, Any]:
    right = sum(r["correct"] for r in rows)
    # Replayed orders repeat each question: the interval is over questions.
    share = right / len(rows)
    low, high = wilson(round(share * questions), questions)
    return {
        "accuracy": share,
        "accuracy_95ci": [low, high],
        "mean_tokens": statistics.mean(r["tokens"] for r in rows),
        "mean_rounds": statistics.mean(r["rounds"] for r in rows),
        "mean_confidence": statistics.mean(r["confidence"] for r in rows),
    }


def paired(live_rows: list[dict[str, Any]], replay_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per question, live less the mean of its replayed orders: the mean difference of
    rounds, correctness and P over questions, each with its standard error."""
    replayed: dict[str, list[dict[str, Any]]] = {}
    for row in replay_rows:
        replayed.setdefault(row["id"], []).append(row)
    out: dict[str, Any] = {}
    for key in ("rounds", "correct", "confidence"):
        gaps = [
            r[key] - statistics.mean(float(o[key]) for o in replayed[r["id"]]) for r in live_rows
        ]
        error = statistics.stdev(gaps) / len(gaps) ** 0.5 if len(gaps) > 1 else float("nan")
        out[key] = {"difference": statistics.mean(gaps), "standard_error": error}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default=str(ROOT / "bench/out/bank.jsonl"))
    parser.add_argument("--per-source", type=int, default=20)
    parser.add_argument(
        "--skip", type=int, default=0, help="leave out each source's first N questions"
    )
    parser.add_argument("--orders", type=int, default=DEFAULT_ORDERS)
    parser.add_argument(
        "--max-tokens",
        type=int,
        help="a client's max_tokens: the bank's own cap, so that live branches are cut "
        "where the banked samples were (default: the loop's round_tokens alone)",
    )
    parser.add_argument("--json")
    args = parser.parse_args(argv)

    config = load_config()
    assert config.loop is not None, "the default config has a loop"
    # The sampling rounds, live and replayed (the default starts with a greedy pass,
    # which bench/greedy_first.py measures).
    settings = config.loop.sampling()
    calibrator = read_calibrator(calibrator_file(settings.calibrator or "bundled"))
    runs = take_per_source(read_runs(args.runs).runs, args.per_source, args.skip)
    started = time.perf_counter()
    models_dir = Path(config.models_dir).expanduser()
    live_rows = asyncio.run(live(runs, settings, calibrator, models_dir, args.max_tokens))
    seconds = time.perf_counter() - started
    replay_rows = predicted(runs, settings, calibrator, args.orders)
    report: dict[str, Any] = {
        "questions": len(runs),
        "settings": msgspec.to_builtins(settings),
        "live": {
            **summary(live_rows, len(runs)),
            "seconds": seconds,
            "stops": dict(Counter(r["stop"] for r in live_rows)),
        },
        "replay": summary(replay_rows, len(runs)),
        "live_less_replay": paired(live_rows, replay_rows),
        "kinds_read": dict(Counter(r["kind"] for r in live_rows)),
        "live_rows": live_rows,
    }
    for name in ("live", "replay"):
        row = report[name]
        low, high = row["accuracy_95ci"]
        print(
            f"{name:6} accuracy {row['accuracy']:.1%} (95% CI {low:.1%}-{high:.1%}), "
            f"{row['mean_tokens']:.1f} tokens, {row['mean_rounds']:.2f} rounds, "
            f"mean P {row['mean_confidence']:.3f} per question"
        )
    gaps = report["live_less_replay"]
    print(
        "live less replay, per question (standard error): "
        + ", ".join(
            f"{key} {gaps[key]['difference']:+.3f} ({gaps[key]['standard_error']:.3f})"
            for key in ("rounds", "correct", "confidence")
        )
    )
    print(f"live stops: {report['live']['stops']}, kinds read: {report['kinds_read']}")
    print(f"{seconds:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
