"""Batched samples: tokens/s of k samples of one prompt as one batch, beside k samples
one after another on the single-sample path.

For each k (1, 2, 4, 8 by default), side by side in one run:
  batched      one call with n = k on an engine with ``batch_samples`` on: the prompt
               decoded once, then one token of every running sample per step
  sequential   k calls with n = 1, one after another, on the same engine: each takes
               the single-sample path (a group of one), as with ``batch_samples`` off
Both use one model instance (one slot), the same prompt, max_tokens, temperature 0.7
and seeds (sample i of a round has seed round*100 + i either way). The order of the k
values rotates every round and the two variants alternate which goes first, so the
machine's drift hits both alike; the ratio is the median over rounds of each round's
batched/sequential pair. k = 1 is the single path both ways (a group of one), so its
ratio shows the noise.

Tokens/s counts every completion token over the call's wall time, prompt included; the
single path reuses its KV cache for a prompt it has just decoded, so its k calls pay
the prompt about once too. A sample may end early at EOS; the tokens counted are the
ones generated. Run:
    .venv/bin/python bench/batch_speed.py [--model gemma3-270m | FILE.gguf]
        [--ks 1,2,4,8] [--tokens 48] [--rounds 3] [--threads 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from engines.base import EngineError, Message, SamplingParams
from engines.bundled import GEMMA3
from engines.llama_cpp import LlamaCppEngine
from engines.settings import LlamaCppSettings
from engines.templates import CompletionTemplate
from gateway.config import load_config

PROMPT = (Message("user", "Write a long story about a dragon and a knight."),)
TEMPERATURE = 0.7
# The base model's template stops at the end of a short answer; the speed figure
# needs long samples, so it runs without stops (as bench/engine_speed.py does).
NO_STOPS = CompletionTemplate(preamble="", stop=())


async def _started(model: str, threads: int, sequences: int, models_dir: Path) -> LlamaCppEngine:
    """An engine with batching on; a model without a chat template gets the
    completion template."""
    for template in ("chat", NO_STOPS) if model != GEMMA3 else (NO_STOPS,):
        settings = LlamaCppSettings(
            model=model,
            template=template,
            threads=threads,
            batch_samples=True,
            batch_sequences=sequences,
        )
        engine = LlamaCppEngine("bench", settings, models_dir)
        try:
            await engine.start()
        except EngineError:
            await engine.close()
            continue
        return engine
    raise SystemExit(f"could not start {model}")


async def _batched(engine: LlamaCppEngine, k: int, tokens: int, seed: int) -> tuple[int, float]:
    params = SamplingParams(max_tokens=tokens, temperature=TEMPERATURE, seed=seed, n=k)
    started = time.monotonic()
    generation = await engine.generate(PROMPT, params)
    return generation.completion_tokens, time.monotonic() - started


async def _sequential(engine: LlamaCppEngine, k: int, tokens: int, seed: int) -> tuple[int, float]:
    started = time.monotonic()
    count = 0
    for i in range(k):
        params = SamplingParams(max_tokens=tokens, temperature=TEMPERATURE, seed=seed + i)
        count += (await engine.generate(PROMPT, params)).completion_tokens
    return count, time.monotonic() - started


async def bench(
    model: str, ks: list[int], tokens: int, rounds: int, threads: int, models_dir: Path
) -> dict[str, object]:
    engine = await _started(model, threads, max(ks), models_dir)
    variants = {"batched": _batched, "sequential": _sequential}
    speed: dict[tuple[int, str], list[float]] = {(k, v): [] for k in ks for v in variants}
    counts: dict[tuple[int, str], list[int]] = {(k, v): [] for k in ks for v in variants}
    await _batched(engine, max(ks), 8, 0)  # warm-up: makes and sizes the batch context
    await _sequential(engine, 1, 8, 0)
    for round_ in range(rounds):
        shift = round_ % len(ks)
        for position, k in enumerate(ks[shift:] + ks[:shift]):
            order = list(variants) if (round_ + position) % 2 == 0 else list(variants)[::-1]
            for variant in order:
                count, seconds = await variants[variant](engine, k, tokens, round_ * 100)
                speed[k, variant].append(count / seconds)
                counts[k, variant].append(count)
    await engine.close()
    rows = []
    for k in ks:
        pairs = zip(speed[k, "batched"], speed[k, "sequential"], strict=True)
        rows.append(
            {
                "k": k,
                "batched_tok_s": round(statistics.median(speed[k, "batched"]), 1),
                "sequential_tok_s": round(statistics.median(speed[k, "sequential"]), 1),
                "ratio": round(statistics.median(b / s for b, s in pairs), 2),
                "tokens_batched": counts[k, "batched"],
                "tokens_sequential": counts[k, "sequential"],
            }
        )
    return {
        "model": model,
        "threads": threads,
        "max_tokens": tokens,
        "rounds": rounds,
        "temperature": TEMPERATURE,
        "rows": rows,
    }


def _print(report: dict[str, object]) -> None:
    print(
        f"{report['model']}: {report['threads']} threads, max_tokens {report['max_tokens']}, "
        f"temperature {report['temperature']}, median of {report['rounds']} rounds"
    )
    print(f"{'k':>3} {'batched tok/s':>14} {'sequential tok/s':>17} {'ratio':>6}")
    rows = report["rows"]
    assert isinstance(rows, list)
    for row in rows:
        print(
            f"{row['k']:>3} {row['batched_tok_s']:>14} {row['sequential_tok_s']:>17} "
            f"{row['ratio']:>6}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=GEMMA3, help="a bundled model's name or a GGUF file")
    parser.add_argument("--ks", default="1,2,4,8", help="batch sizes, comma-separated")
    parser.add_argument("--tokens", type=int, default=48, help="max_tokens of every sample")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    models_dir = Path(load_config().models_dir).expanduser()
    report = asyncio.run(bench(args.model, ks, args.tokens, args.rounds, args.threads, models_dir))
    _print(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
