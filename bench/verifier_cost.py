"""What the verifier costs a semantic lookup, side by side with the similarity
threshold alone, over the same entries in one run.

ENTRIES distinct Quora questions (the verifier's `fit` split, vectors kept in
bench/out) fill two in-process caches, one with the default verifier and one with
`verifier: null` (threshold 0.92). QUERIES questions are asked of both, alternating in
blocks: the other side of fit pairs (real near neighbours: duplicates and not) and
warmed questions reworded (", please?"). Each lookup is timed from the vector to the
decision (FAISS search, store reads, guards, verifier); the embedding a request needs
first is timed alone, to put the difference in terms of a whole semantic hit.

    .venv/bin/python bench/verifier_cost.py [--entries 100000] [--queries 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

import numpy as np
from convert_pairs import ROOT
from train_verifier import Vectors
from verifier_data import DEFAULT_DATA, qqp_splits

from cache.entry import Namespace
from cache.memory_store import MemoryStore
from cache.semantic_cache import Hit, SemanticCache
from cache.settings import CacheSettings, MemoryStoreSettings
from router.embedder import Embedder, EmbedderSettings, Embedding


def _ms(values: list[float], q: float) -> float:
    return float(np.quantile(values, q)) * 1000


async def _filled(
    settings: CacheSettings, ns: Namespace, texts: list[str], vectors: np.ndarray
) -> SemanticCache:
    cache = SemanticCache(settings, MemoryStore(settings.store))  # type: ignore[arg-type]
    await cache.start()
    for start in range(0, len(texts), 10_000):
        batch = [
            cache.entry(
                ns, t, Embedding(v, ns.embedding), response="a", model="m", tier="t", confidence=1.0
            )
            for t, v in zip(
                texts[start : start + 10_000], vectors[start : start + 10_000], strict=True
            )
        ]
        await cache.put(batch)
    return cache


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--queries", type=int, default=2000)
    parser.add_argument("--block", type=int, default=100)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    fit = qqp_splits(DEFAULT_DATA)["fit"]
    embedder = Embedder(EmbedderSettings())
    embedder.load()
    store = Vectors(embedder, ROOT / "bench" / "out" / "verifier_vectors.npz")
    texts = list(dict.fromkeys(t for p in fit for t in (p["a"], p["b"])))[: args.entries]
    vectors = store.embed(texts)
    cached = set(texts)
    rng = random.Random(0)
    neighbours = [p["b"] for p in fit if p["a"] in cached and p["b"] not in cached]
    asked = rng.sample(neighbours, min(len(neighbours), args.queries // 2))
    asked += [t.rstrip("?").rstrip() + ", please?" for t in rng.sample(texts, args.queries // 2)]
    rng.shuffle(asked)
    asked_vectors = store.embed(asked)

    ns = Namespace(model="m", embedding=embedder.fingerprint)
    memory = MemoryStoreSettings(max_entries=len(texts) + 1, snapshot=None)
    arms = {
        "verifier": await _filled(CacheSettings(store=memory), ns, texts, vectors),
        "threshold": await _filled(CacheSettings(store=memory, verifier=None), ns, texts, vectors),
    }
    times: dict[str, list[float]] = {name: [] for name in arms}
    hits: dict[str, int] = dict.fromkeys(arms, 0)
    for start in range(0, len(asked), args.block):
        order = list(arms) if (start // args.block) % 2 == 0 else list(reversed(arms))
        for name in order:
            cache = arms[name]
            for prompt, vector in zip(
                asked[start : start + args.block],
                asked_vectors[start : start + args.block],
                strict=True,
            ):
                began = time.perf_counter()
                found = await cache.semantic(ns, prompt, Embedding(vector, ns.embedding))
                times[name].append(time.perf_counter() - began)
                hits[name] += isinstance(found, Hit)
    embed_s = []
    for prompt in asked[:200]:
        began = time.perf_counter()
        embedder.encode([prompt])
        embed_s.append(time.perf_counter() - began)
    for cache in arms.values():
        await cache.close()

    embed_p50 = statistics.median(embed_s)
    report: dict[str, object] = {
        "entries": len(texts),
        "queries": len(asked),
        "embed_p50_ms": embed_p50 * 1000,
    }
    for name in arms:
        report[name] = {
            "lookup_p50_ms": _ms(times[name], 0.5),
            "lookup_p99_ms": _ms(times[name], 0.99),
            "hit_rate": hits[name] / len(asked),
        }
    added = _ms(times["verifier"], 0.5) - _ms(times["threshold"], 0.5)
    report["verifier_added_p50_ms"] = added
    # One core embeds one request at a time: a semantic hit costs the embedding plus the lookup.
    whole = {n: embed_p50 + statistics.median(times[n]) for n in arms}
    report["semantic_hits_per_second_ratio"] = whole["threshold"] / whole["verifier"]
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
