"""The cache's vector index at scale: memory, build time and search time per size.

The same index the cache builds (router.index.VectorIndex: exact flat search, HNSW
with M=32 and efSearch=64 above `hnsw_above`), over unit vectors of MiniLM's width
(384). Random unit vectors stand in for embeddings: flat search costs the same on any
data; HNSW's build and search times are those of a hard (uniform) distribution.

    .venv/bin/python bench/faiss_scale.py [--sizes 100000 250000 1000000] [--hnsw-max 250000]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import faiss
import numpy as np

from router.index import VectorIndex

DIM = 384
QUERIES = 200


def unit_vectors(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    vectors = rng.standard_normal((n, DIM), dtype=np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def measure(n: int, hnsw: bool) -> dict[str, float | int | str]:
    before = rss_mib()
    vectors = unit_vectors(n, seed=n)
    ids = np.arange(n, dtype=np.int64)
    index = VectorIndex(DIM, hnsw_above=0 if hnsw else n + 1)
    started = time.perf_counter()
    for start in range(0, n, 50_000):  # as a warm-up or a rebuild adds them
        index.add(ids[start : start + 50_000], vectors[start : start + 50_000])
    build_s = time.perf_counter() - started
    assert index.is_hnsw == hnsw
    del vectors, ids
    gc.collect()
    memory = rss_mib() - before  # what the index holds (the input arrays are freed)
    queries = unit_vectors(QUERIES, seed=-1 % 2**32)
    times = []
    for query in queries:
        started = time.perf_counter()
        index.search(query, 5)
        times.append((time.perf_counter() - started) * 1000)
    times.sort()
    return {
        "vectors": n,
        "kind": "hnsw" if hnsw else "flat",
        "index_mib": memory,
        "build_s": build_s,
        "search_p50_ms": statistics.median(times),
        "search_p99_ms": times[int(len(times) * 0.99) - 1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 250_000, 1_000_000])
    # HNSW takes minutes per million vectors to build on 2 cores.
    parser.add_argument("--hnsw-max", type=int, default=250_000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    print(f"faiss {faiss.__version__}, {faiss.omp_get_max_threads()} threads", file=sys.stderr)
    rows = []
    for n in args.sizes:
        for hnsw in (False, True):
            if hnsw and n > args.hnsw_max:
                continue
            rows.append(measure(n, hnsw))
            print(json.dumps(rows[-1]), file=sys.stderr)
    text = json.dumps(rows, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)


if __name__ == "__main__":
    main()
