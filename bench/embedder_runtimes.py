"""The embedder's runtimes side by side: the same answers, and how fast.

For each runtime (embedder.runtime: torch, onnx, onnx-int8), on public data:

  1. speed: one query at a time (p50/p90 over QUERIES Quora questions) and batches of
     64, on one thread as the gateway runs it, the runtimes interleaved round by round;
  2. the vectors: cosine of each runtime's vector to torch's (sentence-transformers) on
     those questions, min / 1st percentile / mean;
  3. the figures built on them: `satisfice cache eval` on the Quora and PAWS pair files
     and `satisfice router eval` on RouteLLM's GSM8K outcomes (bench/convert_pairs.py
     and bench/convert_outcomes.py make them), each run once per runtime through a
     config that sets only the runtime, and every figure's difference from torch's.

    .venv/bin/python bench/embedder_runtimes.py [--queries 2000] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from cache_hit_path import questions

from router.embedder import Embedder, EmbedderSettings

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
RUNTIMES = ("torch", "onnx", "onnx-int8")
CACHE_PAIRS = ("pairs_qqp.jsonl", "pairs_paws.jsonl")
ROUTER_OUTCOMES = ("routellm_gsm8k.jsonl",)


def speed(
    embedders: dict[str, Embedder], texts: list[str], rounds: int
) -> dict[str, dict[str, float]]:
    single: dict[str, list[float]] = {name: [] for name in embedders}
    batched: dict[str, list[float]] = {name: [] for name in embedders}
    chunk = len(texts) // rounds
    for r in range(rounds):
        part = texts[r * chunk : (r + 1) * chunk]
        for name, embedder in embedders.items():
            for text in part[:200]:
                started = time.perf_counter()
                embedder.encode([text])
                single[name].append((time.perf_counter() - started) * 1000)
            started = time.perf_counter()
            for i in range(0, len(part), 64):
                embedder.encode(part[i : i + 64])
            batched[name].append(len(part) / (time.perf_counter() - started))
    result = {}
    for name in embedders:
        times = sorted(single[name])
        result[name] = {
            "single_p50_ms": times[len(times) // 2],
            "single_p90_ms": times[int(len(times) * 0.9)],
            "batched_per_s": statistics.median(batched[name]),
        }
    return result


def agreement(embedders: dict[str, Embedder], texts: list[str]) -> dict[str, dict[str, float]]:
    reference = embedders["torch"].encode(texts)
    result = {}
    for name, embedder in embedders.items():
        cosines = (embedder.encode(texts) * reference).sum(axis=1)
        result[name] = {
            "cosine_min": float(cosines.min()),
            "cosine_p1": float(np.percentile(cosines, 1)),
            "cosine_mean": float(cosines.mean()),
        }
    return result


def satisfice_json(args: list[str]) -> Any:
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", *args], cwd=ROOT, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"satisfice {' '.join(args)} failed: {done.stderr[-2000:]}")
    # One JSON object per line: `router eval` writes one per scorer.
    reports = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    return reports[0] if len(reports) == 1 else reports


def figures(runtime: str, work: Path) -> dict[str, Any]:
    """The cache's and the router's evaluation figures with this runtime's vectors."""
    config = work / f"{runtime}.yaml"
    config.write_text(
        "engines: {small: {backend: llama_cpp, model: smollm2-135m-instruct}}\n"
        f"embedder: {{runtime: {runtime}}}\ncache: {{}}\n"
    )
    result: dict[str, Any] = {}
    for pairs in CACHE_PAIRS:
        if (OUT / pairs).exists():
            args = ["cache", "eval", "--config", str(config), "--pairs", str(OUT / pairs), "--json"]
            result[pairs] = satisfice_json(args)
    for outcomes in ROUTER_OUTCOMES:
        if (OUT / outcomes).exists():
            args = ["router", "eval", "--config", str(config), "--outcomes", str(OUT / outcomes),
                    "--kind", "logistic", "knn", "--json"]  # fmt: skip
            result[outcomes] = satisfice_json(args)
    return result


def numbers(value: Any, path: str = "") -> dict[str, float]:
    """Every number in a JSON report, by its path."""
    if isinstance(value, bool):
        return {}
    if isinstance(value, int | float):
        return {path: float(value)}
    if isinstance(value, dict):
        return {
            k: v for key, item in value.items() for k, v in numbers(item, f"{path}.{key}").items()
        }
    if isinstance(value, list):
        return {
            k: v for i, item in enumerate(value) for k, v in numbers(item, f"{path}[{i}]").items()
        }
    return {}


def differences(reports: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per runtime, the largest difference from torch's over each report's rates (the
    figures in [0, 1]: hit rate, precision, APGR, ...), and where it is."""
    base = numbers(reports["torch"])
    result = {}
    for runtime, report in reports.items():
        ours = numbers(report)
        rates = [k for k, v in base.items() if 0.0 <= v <= 1.0 and k in ours]
        worst = max(rates, key=lambda k: abs(ours[k] - base[k]), default="")
        result[runtime] = {
            "figures_compared": len(rates),
            "largest_difference": abs(ours[worst] - base[worst]) if worst else 0.0,
            "where": worst,
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    texts = questions(args.queries)
    embedders = {}
    for runtime in RUNTIMES:
        embedder = Embedder(EmbedderSettings(runtime=runtime))  # type: ignore[arg-type]
        embedder.load()
        embedder.encode(texts[:64])
        embedders[runtime] = embedder
    report: dict[str, Any] = {
        "speed": speed(embedders, texts, args.rounds),
        "agreement_with_torch": agreement(embedders, texts),
    }
    print(json.dumps(report, indent=2), file=sys.stderr)
    with tempfile.TemporaryDirectory() as work:
        evaluations = {runtime: figures(runtime, Path(work)) for runtime in RUNTIMES}
    report["evaluations"] = evaluations
    report["differences_from_torch"] = differences(evaluations)
    text = json.dumps(report, indent=2)
    print(json.dumps(report["differences_from_torch"], indent=2), file=sys.stderr)
    if args.json:
        args.json.write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
