"""What answering through the loop's greedy pass costs over a plain request of `large`,
side by side on one gateway.

With the embedded default, a hard question gets one greedy pass of the large model
inside the loop (`loop.greedy_first`, `greedy_stop: 0`): the same tokens a plain
`model="large"` request generates, plus what the loop adds (top-5 logprobs for
P(greedy right), the loop's task and trace, the router's embedding and decision).
One `satisfice serve` of the embedded default with the cache off and every routed
question hard (`router.threshold: 0`); each question is asked both ways by the official
openai client, never right after a request of the same prompt (which llama.cpp's prompt
cache would speed up), each way first for half of them. A pair counts only when both
generated the same number of tokens (the same greedy answer), so the ratio is time for
the same work.

    .venv/bin/python bench/greedy_pass_latency.py --runs bench/out/bank_qwen_held.jsonl \\
        --per-source 10 [--skip 50] [--json bench/out/greedy_pass_latency.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from openai import OpenAI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from headline import DEFAULT_CONFIG, _start, held_out_questions

from evaluator.answers import LabelledQuestion


def config_text() -> str:
    config = yaml.safe_load(DEFAULT_CONFIG.read_text("utf-8"))
    config["cache"] = None  # both ways answer every time
    config["router"]["threshold"] = 0.0  # every "auto" question to the loop's greedy pass
    return yaml.safe_dump(config)


def ask(client: OpenAI, model: str, prompt: str) -> dict[str, Any]:
    started = time.perf_counter()
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": prompt}]
    )
    seconds = time.perf_counter() - started
    completion = raw.parse()
    usage = completion.usage
    return {
        "seconds": seconds,
        "tokens": 0 if usage is None else usage.completion_tokens,
        "route": raw.headers.get("x-satisfice-route"),
        "stop": raw.headers.get("x-satisfice-stop"),
    }


def measure(client: OpenAI, questions: list[LabelledQuestion]) -> list[dict[str, Any]]:
    """Each question both ways, in two passes over the questions that alternate the
    model: no request follows one of the same prompt, whose prompt the engine would
    still hold (llama.cpp reuses a cached prompt prefix, which makes the second of two
    requests for one prompt several times faster to start, and can change its
    greedy tokens). Each way comes first for half the questions."""
    answers: list[dict[str, Any]] = [{"source": q.source} for q in questions]
    for first in ("large", "auto"):
        for number, question in enumerate(questions):
            model = first if number % 2 == 0 else other(first)
            answers[number][model] = ask(client, model, question.prompt)
        print(f"pass starting with {first}: done", file=sys.stderr, flush=True)
    return answers


def other(model: str) -> str:
    return "auto" if model == "large" else "large"


def summary(pairs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-pair ratios of the loop's seconds to the plain request's, over the pairs
    that generated the same tokens both ways."""
    same = [p for p in pairs if p["auto"]["tokens"] == p["large"]["tokens"]]
    ratios = [p["auto"]["seconds"] / p["large"]["seconds"] for p in same]
    return {
        "pairs": len(pairs),
        "same_tokens": len(same),
        "routed_to_the_loop": sum(p["auto"]["route"] == "loop" for p in pairs),
        "ratio_median": statistics.median(ratios) if ratios else None,
        "ratio_mean": statistics.fmean(ratios) if ratios else None,
        # Over pairs, each its own question: the mean's normal-approximation interval.
        "ratio_mean_ci95": _interval(ratios),
        "ratio_min": min(ratios, default=None),
        "ratio_max": max(ratios, default=None),
        "large_seconds_mean": statistics.fmean(p["large"]["seconds"] for p in same)
        if same
        else None,
        "auto_seconds_mean": statistics.fmean(p["auto"]["seconds"] for p in same) if same else None,
        "tokens_mean": statistics.fmean(p["large"]["tokens"] for p in same) if same else None,
    }


def _interval(values: list[float]) -> list[float] | None:
    if len(values) < 2:
        return None
    mean = statistics.fmean(values)
    half = 1.96 * statistics.stdev(values) / math.sqrt(len(values))
    return [mean - half, mean + half]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", required=True, help="held-out part of a trace bank")
    parser.add_argument("--per-source", type=int, default=10)
    parser.add_argument("--skip", type=int, default=50, help="each source's first N left out")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    questions = held_out_questions(args.runs, args.per_source, args.skip)
    if not questions:
        parser.error(f"no questions in {args.runs} that the router was not fitted on")
    with tempfile.TemporaryDirectory() as folder:
        url, process = _start(config_text(), Path(folder))
        try:
            client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=600, max_retries=0)
            ask(client, "large", "Say hi.")  # the first request loads what is lazy
            pairs = measure(client, questions)
        finally:
            process.terminate()
            process.wait(timeout=30)
    result = {"summary": summary(pairs), "pairs": pairs}
    print(json.dumps(result["summary"], indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
