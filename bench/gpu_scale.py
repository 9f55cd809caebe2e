"""The cache's vector index and the embedder on a GPU, side by side with the same
machine's CPU in one run.

1. Exact inner-product search, top 5, over N random unit vectors of MiniLM's width
   (384): one query at a time (p50 / p99 over QUERIES) and batches of 64.
   - the cache's own index, `cache.index.device: gpu` (router.index.VectorIndex on
     FAISS's GPU resources), where this FAISS build can reach a GPU; its build time
     is the cache's own add path, 50,000 vectors a call as a rebuild adds them;
   - one matrix product and a top-k in PyTorch, in float32 and float16: the
     arithmetic a flat GPU index does, measured whether or not FAISS can load.
   The CPU references, at the smallest size on this machine's cores: the cache's index
   (FAISS flat) where FAISS loads, and the same product and top-k in PyTorch.
2. The bundled embedder (all-MiniLM-L6-v2) under sentence-transformers on the GPU in
   float32 and float16, against the CPU: one question at a time (p50 / p99) and
   questions a second in batches of 64 and 256. ``--random-weights`` runs a copy of
   the model folder with freshly initialised weights of the same shapes (the same
   speed; for a machine the weights cannot be copied to).

    python bench/gpu_scale.py [--sizes 1000000 2500000 5000000 10000000] \
        [--questions FILE] [--model DIR] [--random-weights] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

DIM = 384
K = 5
QUERIES = 200
BATCH = 64
CHUNK = 50_000  # vectors per add, as the cache's rebuild adds them

Row = dict[str, Any]


def percentiles(times_ms: list[float]) -> tuple[float, float]:
    ordered = sorted(times_ms)
    return statistics.median(ordered), ordered[max(0, int(len(ordered) * 0.99) - 1)]


def timed(call: Callable[[], object], repeats: int) -> list[float]:
    call()  # warm-up: kernels chosen, caches filled
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append((time.perf_counter() - started) * 1000)
    return times


def unit_chunk(n: int, generator: torch.Generator, device: str) -> torch.Tensor:
    vectors = torch.randn(n, DIM, generator=generator, device=device)
    return torch.nn.functional.normalize(vectors, dim=1)


def torch_search(n: int, dtype: torch.dtype, device: str = "cuda") -> Row:
    """Flat search as one product and a top-k: what a flat GPU index computes."""
    generator = torch.Generator(device).manual_seed(n)
    step = CHUNK * 20
    matrix = torch.cat(
        [
            unit_chunk(min(step, n - start), generator, device).to(dtype)
            for start in range(0, n, step)
        ]
    )
    queries = unit_chunk(QUERIES, generator, device).to(dtype)
    batch = queries[:BATCH]

    def one(q: torch.Tensor) -> None:
        torch.topk(matrix @ q, K).indices.cpu()  # .cpu() waits for the GPU

    rows = iter(queries)
    single = timed(lambda: one(next(rows)), QUERIES - 1)
    batched = timed(lambda: torch.topk(batch @ matrix.T, K, dim=1).indices.cpu(), 20)
    p50, p99 = percentiles(single)
    return {
        "what": f"torch {device} {str(dtype).removeprefix('torch.')} matmul+topk",
        "vectors": n,
        "matrix_mib": round(matrix.nelement() * matrix.element_size() / 2**20),
        "single_p50_ms": p50,
        "single_p99_ms": p99,
        "batch64_ms": statistics.median(batched),
    }


def faiss_search(n: int, gpu: Any) -> Row:
    """The cache's own index, on the GPU (``gpu`` resources) or on this CPU (None)."""
    from router.index import VectorIndex

    generator = torch.Generator("cuda").manual_seed(n)
    index = VectorIndex(DIM, hnsw_above=n + 1, gpu=gpu)
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    build_s = 0.0
    for start in range(0, n, CHUNK):
        vectors = unit_chunk(min(CHUNK, n - start), generator, "cuda").cpu().numpy()
        ids = np.arange(start, start + len(vectors), dtype=np.int64)
        started = time.perf_counter()
        index.add(ids, vectors)
        build_s += time.perf_counter() - started
    memory = (free_before - torch.cuda.mem_get_info()[0]) / 2**20
    queries = unit_chunk(QUERIES, generator, "cuda").cpu().numpy()
    rows = iter(queries)
    single = timed(lambda: index.search(next(rows), K), QUERIES - 1)
    batched = timed(lambda: index.search(queries[:BATCH], K), 20)
    p50, p99 = percentiles(single)
    return {
        "what": "cache index, FAISS " + ("GPU flat" if gpu is not None else "CPU flat"),
        "vectors": n,
        "gpu_mib": round(memory) if gpu is not None else 0,
        "build_s": build_s,
        "single_p50_ms": p50,
        "single_p99_ms": p99,
        "batch64_ms": statistics.median(batched),
    }


def faiss_gpu() -> tuple[bool, Any | None, str]:
    """Whether FAISS loads, its GPU resources through the cache's own helper (None
    where it sees no GPU), and what was found, in words."""
    try:
        import faiss

        from router.index import gpu_resources
    except (ImportError, OSError) as error:  # a GPU build whose CUDA libraries are missing
        return False, None, f"FAISS does not load: {error}"
    resources = gpu_resources("gpu")
    if resources is None:
        return True, None, f"FAISS {faiss.__version__} sees no GPU"
    return True, resources, f"FAISS {faiss.__version__}, {faiss.get_num_gpus()} GPU"


def random_copy(model_dir: Path, into: Path) -> Path:
    """The model folder with its weights replaced by fresh ones of the same shapes."""
    from transformers import AutoConfig, AutoModel

    copy = into / "random-weights"
    shutil.copytree(
        model_dir, copy, ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "onnx")
    )
    config = AutoConfig.from_pretrained(model_dir)
    AutoModel.from_config(config).save_pretrained(copy)  # type: ignore[no-untyped-call]
    return copy


def embedder_speed(model_dir: Path, texts: list[str], device: str, half: bool) -> Row:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(model_dir), device=device)
    if half:
        model.half()

    def encode(batch: list[str]) -> None:
        model.encode(
            batch, batch_size=len(batch), normalize_embeddings=True, show_progress_bar=False
        )

    singles = iter(texts)
    single = timed(lambda: encode([next(singles)]), min(len(texts) - 1, 300))
    row: Row = {"what": f"embedder {device} {'float16' if half else 'float32'}"}
    row["single_p50_ms"], row["single_p99_ms"] = percentiles(single)
    for size in (64, 256):
        batches = [texts[i : i + size] for i in range(0, len(texts) - size + 1, size)][:8]
        for batch in batches:  # each padded length picks its kernels once
            encode(batch)
        times = []
        for batch in batches:
            started = time.perf_counter()
            encode(batch)
            times.append(time.perf_counter() - started)
        row[f"batch{size}_per_s"] = size / statistics.median(times)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=[1_000_000, 2_500_000, 5_000_000, 10_000_000]
    )
    parser.add_argument("--questions", type=Path, help="one question a line (default: Quora's)")
    parser.add_argument(
        "--model", type=Path, help="a sentence-transformers folder (default: bundled)"
    )
    parser.add_argument("--random-weights", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: this benchmark measures a GPU")

    def report(row: Row) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)

    rows: list[Row] = []
    gpu_name = torch.cuda.get_device_name()
    print(f"{gpu_name}, torch {torch.__version__}, {torch.get_num_threads()} CPU threads")
    faiss_loads, resources, faiss_status = faiss_gpu()
    print(faiss_status, flush=True)
    if faiss_loads:
        report(faiss_search(min(args.sizes), None))
    report(torch_search(min(args.sizes), torch.float32, "cpu"))
    for n in args.sizes:
        for dtype in (torch.float32, torch.float16):
            report(torch_search(n, dtype))
            torch.cuda.empty_cache()  # hand the matrix back before the next size
        if resources is not None:
            report(faiss_search(n, resources))

    if args.questions:
        texts = [line.strip() for line in args.questions.read_text().splitlines() if line.strip()]
    else:
        from cache_hit_path import questions

        texts = questions(2000)
    if args.model:
        model_dir = args.model
    else:
        from router.embedder import BUNDLED_EMBEDDER, bundled_model_dir

        model_dir = bundled_model_dir(BUNDLED_EMBEDDER)
    with tempfile.TemporaryDirectory() as scratch:
        if args.random_weights:
            model_dir = random_copy(model_dir, Path(scratch))
        for device, half in (("cuda", False), ("cuda", True), ("cpu", False)):
            report(embedder_speed(model_dir, texts, device, half))
    if args.json:
        args.json.write_text(json.dumps({"faiss": faiss_status, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
