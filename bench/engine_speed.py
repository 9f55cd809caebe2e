"""Engine speed: tokens/s of each bundled model, and what logprobs cost.

Side by side in one run, interleaved so that machine noise hits every variant alike:
  plain      generation without logprobs
  logprobs   our path: one log-sum-exp over the live logits per token
  top5       the same with the 5 most likely alternatives per token
  logits_all llama-cpp-python's built-in logprobs (keeps a logits row per position),
             timed over fewer tokens since it is so slow
It also times the logprob recorder alone on the live logits, which is the steadiest
figure for its cost per token.

Greedy decoding makes every variant generate the same tokens. Run:
    .venv/bin/python bench/engine_speed.py [--rounds 5] [--tokens 128] [--json FILE]
``--plain`` times the plain variant alone (bench/llama_builds.py runs it once per build);
``--no-extra-bufts`` loads the models without llama.cpp's extra buffer types (the
repacked weights its AMX and AVX matrix kernels use).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import llama_cpp

from engines.base import Message, SamplingParams
from engines.bundled import model_file
from engines.llama_cpp import LlamaCppEngine, LogprobRecorder
from engines.settings import LlamaCppSettings
from engines.templates import CompletionTemplate
from gateway.config import load_config

PROMPT = (Message("user", "Write a long story about a dragon and a knight."),)


async def _engine_tps(engine: LlamaCppEngine, params: SamplingParams) -> tuple[float, int]:
    generation = await engine.generate(PROMPT, params)
    sample = generation.samples[0]
    decode_s = sample.timings.total_s - (sample.timings.first_token_s or 0.0)
    return (sample.completion_tokens - 1) / decode_s, sample.completion_tokens


def _logits_all_tps(llm: llama_cpp.Llama, prompt: str, tokens: int) -> float:
    """llama-cpp-python's own logprobs path, timed the same way (after the first token)."""
    first: float | None = None
    count = 0
    for _ in llm.create_completion(
        prompt, max_tokens=tokens, temperature=0, logprobs=1, stream=True
    ):
        count += 1
        if first is None:
            first = time.monotonic()
    assert first is not None and count > 1
    return (count - 1) / (time.monotonic() - first)


def _recorder_cost_s(engine: LlamaCppEngine, top: int, repeats: int = 200) -> float:
    """Seconds one ``LogprobRecorder.record`` takes on the model's live logits."""
    worker = engine._workers[0]
    recorder = LogprobRecorder(worker.llm, worker.token_bytes, top)
    started = time.perf_counter()
    for _ in range(repeats):
        recorder.record(0)
    return (time.perf_counter() - started) / repeats


async def bench_plain(
    name: str, settings: LlamaCppSettings, models_dir: Path, rounds: int, tokens: int
) -> dict[str, object]:
    """Plain greedy decoding alone: the figure that compares builds of llama.cpp."""
    engine = LlamaCppEngine(name, settings, models_dir)
    await engine.start()
    params = SamplingParams(max_tokens=tokens, temperature=0)
    await _engine_tps(engine, params)  # warm-up
    runs = [await _engine_tps(engine, params) for _ in range(rounds)]
    await engine.close()
    return {
        "model": settings.model,
        "tokens_per_run": sorted({count for _, count in runs}),
        "tokens_per_s": {"plain": round(statistics.median(tps for tps, _ in runs), 1)},
    }


def _without_extra_buffer_types() -> None:
    """Load every model from here on with ``use_extra_bufts`` off."""
    default_params = llama_cpp.llama_cpp.llama_model_default_params

    def params() -> llama_cpp.llama_model_params:
        chosen: llama_cpp.llama_model_params = default_params()
        chosen.use_extra_bufts = False
        return chosen

    llama_cpp.llama_cpp.llama_model_default_params = params


async def bench_model(
    name: str, settings: LlamaCppSettings, models_dir: Path, rounds: int, tokens: int
) -> dict[str, object]:
    engine = LlamaCppEngine(name, settings, models_dir)
    await engine.start()
    rendered = engine._render(PROMPT)[0]
    reference = llama_cpp.Llama(
        model_path=str(model_file(settings.model, models_dir)),
        n_ctx=1024,
        n_threads=settings.threads,
        logits_all=True,
        verbose=False,
    )
    # No stop sequences: every variant must run to exactly `tokens` tokens.
    base = SamplingParams(max_tokens=tokens, temperature=0)
    variants = {
        "plain": base,
        "logprobs": SamplingParams(max_tokens=tokens, temperature=0, logprobs=True),
        "top5": SamplingParams(max_tokens=tokens, temperature=0, logprobs=True, top_logprobs=5),
    }
    results: dict[str, list[float]] = {k: [] for k in [*variants, "logits_all"]}
    counts: set[int] = set()
    await _engine_tps(engine, base)  # warm-up
    order = list(variants)
    for round_ in range(rounds):
        # Rotate the order each round so no variant always runs first or last.
        shift = round_ % len(order)
        for variant in order[shift:] + order[:shift]:
            tps, count = await _engine_tps(engine, variants[variant])
            results[variant].append(tps)
            counts.add(count)
        results["logits_all"].append(
            await asyncio.to_thread(_logits_all_tps, reference, rendered, min(tokens, 32))
        )
    reference.close()
    record_s = {top: _recorder_cost_s(engine, top) for top in (0, 5)}
    await engine.close()
    median = {k: statistics.median(v) for k, v in results.items()}
    token_s = 1 / median["plain"]

    def cost(variant: str) -> float:
        """Median over rounds of plain/variant speed, each pair run minutes apart at most:
        the machine's drift between rounds cancels out of each ratio."""
        pairs = zip(results["plain"], results[variant], strict=True)
        return round(statistics.median(p / v for p, v in pairs) - 1, 4)

    return {
        "model": settings.model,
        "tokens_per_run": sorted(counts),
        "tokens_per_s": {k: round(v, 1) for k, v in median.items()},
        "logprobs_cost": cost("logprobs"),
        "top5_cost": cost("top5"),
        "logits_all_slowdown": round(cost("logits_all") + 1, 2),
        "recorder_us_per_token": round(record_s[0] * 1e6, 1),
        "recorder_share_of_token_time": round(record_s[0] / token_s, 4),
        "top5_recorder_us_per_token": round(record_s[5] * 1e6, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--plain", action="store_true", help="plain decoding only")
    parser.add_argument(
        "--no-extra-bufts", action="store_true", help="load models without extra buffer types"
    )
    args = parser.parse_args()
    if args.no_extra_bufts:
        _without_extra_buffer_types()
    bench = bench_plain if args.plain else bench_model
    config = load_config()
    report = []
    for name, settings in config.engines.items():
        assert isinstance(settings, LlamaCppSettings)
        if isinstance(settings.template, CompletionTemplate):
            # The base model's template stops at the end of a short answer; the speed
            # figure needs long runs, so drop the stops for the benchmark.
            template = CompletionTemplate(preamble="", stop=())
            settings = LlamaCppSettings(model=settings.model, template=template)
        models_dir = Path(config.models_dir).expanduser()
        row = asyncio.run(bench(name, settings, models_dir, args.rounds, args.tokens))
        report.append(row)
        print(json.dumps(row))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
