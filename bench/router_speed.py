"""Router speed: the embedder alone, batched under concurrency, and the decision after it.

Side by side in one run:
  - embedding one query at a time (p50), the micro-batched embedder under 64
    concurrent callers (queries/s), and the model's own batched throughput
    (`encode` on batches of 64): the ratio says what micro-batching keeps;
  - the routing decision after the embedding (score + explanation) with 50,000
    labelled examples, for the kNN scorer (FAISS HNSW, and flat for comparison)
    and the logistic scorer: p50 and p99.
The prompts are real questions from Quora Question Pairs (../shared/data/gptcache_qqp);
labels are random, since only time is measured here.

    .venv/bin/python bench/router_speed.py [--examples 50000] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import time
from pathlib import Path

import numpy as np

from router.embedder import Embedder, EmbedderSettings, Vectors
from router.model_file import KNNModel
from router.outcomes import Outcome
from router.scorers import KNNScorer, Scorer, fit, scorer_for

ROOT = Path(__file__).resolve().parent.parent

CONCURRENCY = 64


def _questions(data: Path, count: int) -> list[str]:
    raw = subprocess.run(
        ["tar", "xzOf", str(data / "gptcache_qqp" / "similiar_qqp_full.json.gz")],
        capture_output=True,
        check=True,
    ).stdout
    seen: dict[str, None] = {}
    for pair in json.loads(raw):
        seen.setdefault(pair["text_a"], None)
        seen.setdefault(pair["text_b"], None)
    return list(seen)[:count]


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1000


async def _embedding(embedder: Embedder, queries: list[str]) -> dict[str, float]:
    single = []
    for query in queries[:200]:
        started = time.perf_counter()
        await embedder.embed(query)
        single.append(time.perf_counter() - started)

    raw_started = time.perf_counter()
    for i in range(0, 2048, CONCURRENCY):
        await asyncio.to_thread(embedder.encode, queries[i : i + CONCURRENCY])
    raw_qps = 2048 / (time.perf_counter() - raw_started)

    pending = iter(queries[:2048])

    async def client() -> None:
        for query in pending:
            await embedder.embed(query)

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(CONCURRENCY)))
    batched_qps = 2048 / (time.perf_counter() - started)
    return {
        "single_query_p50_ms": round(_percentile(single, 50), 2),
        "single_query_p99_ms": round(_percentile(single, 99), 2),
        "raw_batched_qps": round(raw_qps, 1),
        "concurrent_64_qps": round(batched_qps, 1),
        "concurrent_vs_raw": round(batched_qps / raw_qps, 3),
    }


def _decision_times(scorer: Scorer, vectors: Vectors, prompts: list[str]) -> dict[str, float]:
    """What `Router.decide` does after the embedding: score, then explain."""
    times = []
    for vector, prompt in zip(vectors, prompts, strict=True):
        started = time.perf_counter()
        scorer.score(vector, [prompt])
        scorer.neighbours(vector, 5)
        times.append(time.perf_counter() - started)
    return {"p50_ms": round(_percentile(times, 50), 3), "p99_ms": round(_percentile(times, 99), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=50_000)
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    questions = _questions(args.data, args.examples + 1000)
    labelled, queries = questions[: args.examples], questions[args.examples :]
    embedder = Embedder(EmbedderSettings())
    report: dict[str, object] = {"examples": len(labelled), "queries": len(queries)}

    async def measure_embedding() -> None:
        await embedder.start()
        report["embedding"] = await _embedding(embedder, queries + labelled)

    asyncio.run(measure_embedding())
    started = time.perf_counter()
    vectors = embedder.encode(labelled)
    report["embedded_examples_s"] = round(time.perf_counter() - started, 1)
    query_vectors = embedder.encode(queries)
    rng = np.random.default_rng(0)
    outcomes = [Outcome(q, bool(rng.random() < 0.6), True) for q in labelled]

    decisions: dict[str, dict[str, float]] = {}
    for kind in ("knn", "logistic"):
        started = time.perf_counter()
        model = fit(kind, outcomes, vectors, embedding=embedder.fingerprint)
        scorer = scorer_for(model)
        built = time.perf_counter() - started
        decisions[kind] = {"build_s": round(built, 1)} | _decision_times(
            scorer, query_vectors, queries
        )
        if isinstance(model, KNNModel):
            flat = KNNScorer(model, hnsw_above=10**9)
            decisions["knn_flat"] = _decision_times(flat, query_vectors, queries)
    report["decision_after_embedding"] = decisions
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)


if __name__ == "__main__":
    main()
