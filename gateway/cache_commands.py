"""`satisfice cache eval`: how a cache configuration would do on labelled prompt pairs."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Annotated

import msgspec
import numpy as np
import numpy.typing as npt

from cache.entry import Namespace, normalise
from cache.memory_store import MemoryStore
from cache.semantic_cache import CacheSettings, Hit, SemanticCache
from gateway.config import load_config
from router.embedder import Embedder, EmbedderSettings, Embedding

PRECISION_TARGET = 0.99


class Pair(msgspec.Struct, frozen=True):
    a: str
    b: str
    label: Annotated[int, msgspec.Meta(ge=0, le=1)]


def read_pairs(path: str) -> list[Pair]:
    decoder = msgspec.json.Decoder(Pair)
    pairs = []
    for number, line in enumerate(Path(path).read_bytes().splitlines(), start=1):
        if line.strip():
            try:
                pairs.append(decoder.decode(line))
            except msgspec.DecodeError as exc:
                raise SystemExit(f"{path}:{number}: {exc}") from exc
    return pairs


class Sweep(msgspec.Struct, frozen=True):
    """Per query: the similarity of what the cache would serve (guards applied), and
    whether serving it would be right."""

    similarity: npt.NDArray[np.float64]  # -1 where nothing passes the guards
    correct: npt.NDArray[np.bool_]

    def at(self, threshold: float) -> dict[str, float]:
        hits = self.similarity >= threshold
        count = int(hits.sum())
        right = int((hits & self.correct).sum())
        return {
            "threshold": threshold,
            "hit_rate": count / len(hits),
            "precision": right / count if count else 1.0,
            "false_hit_rate": (count - right) / len(hits),
        }

    def best_at_precision(self, target: float) -> dict[str, float] | None:
        """The lowest threshold (most hits) whose precision still reaches ``target``."""
        best = None
        for threshold in np.unique(self.similarity[self.similarity >= 0])[::-1]:
            point = self.at(float(threshold))
            if point["precision"] < target:
                break
            best = point
        return best


def sweep(pairs: list[Pair], settings: CacheSettings, embedder: Embedder) -> Sweep:
    warm = list(dict.fromkeys(p.a for p in pairs))
    print(f"embedding {len(warm)} cached and {len(pairs)} queried prompts ...", file=sys.stderr)
    cached_vectors = embedder.encode(warm)
    query_vectors = embedder.encode([p.b for p in pairs])
    # Threshold 0 returns the first candidate every guard accepts; any threshold's
    # outcome follows from its similarity.
    everything = msgspec.structs.replace(
        settings, similarity_threshold=0.0, max_entries=len(warm) + 1, ttl_s=None
    )
    cache = SemanticCache(everything, MemoryStore(len(warm) + 1), dim=embedder.dim)
    namespace = Namespace(model="eval", embedding=embedder.fingerprint)
    for prompt, vector in zip(warm, cached_vectors, strict=True):
        embedding = Embedding(vector, embedder.fingerprint)
        cache.put(namespace, prompt, embedding, response="", model="", tier="", confidence=1.0)
    similarity = np.full(len(pairs), -1.0)
    correct = np.zeros(len(pairs), dtype=bool)
    for i, (pair, vector) in enumerate(zip(pairs, query_vectors, strict=True)):
        found = cache.exact(namespace, pair.b) or cache.semantic(
            namespace, pair.b, Embedding(vector, embedder.fingerprint)
        )
        if isinstance(found, Hit):
            similarity[i] = found.similarity
            correct[i] = pair.label == 1 and normalise(found.entry.prompt) == normalise(pair.a)
    return Sweep(similarity, correct)


def cache_eval(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    settings = config.cache or CacheSettings()
    embedder = Embedder(config.router.embedder if config.router else EmbedderSettings())
    embedder.load()
    pairs = read_pairs(args.pairs)
    result = sweep(pairs, settings, embedder)
    threshold = args.threshold if args.threshold is not None else settings.similarity_threshold
    report: dict[str, object] = {"pairs": len(pairs), **result.at(threshold)}
    best = result.best_at_precision(PRECISION_TARGET)
    report["best_hit_rate_at_99_precision"] = None if best is None else best["hit_rate"]
    report["best_threshold_at_99_precision"] = None if best is None else best["threshold"]
    if args.plot:
        _plot(result, Path(args.pairs).name, args.plot)
    print(json.dumps(report) if args.json else "\n".join(f"{k}: {v}" for k, v in report.items()))
    return 0


def _plot(result: Sweep, title: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    thresholds = np.linspace(0.5, 1.0, 101)
    points = [result.at(float(t)) for t in thresholds]
    figure, axes = plt.subplots(figsize=(7, 4.5))
    axes.plot(thresholds, [p["precision"] for p in points], label="precision")
    axes.plot(thresholds, [p["hit_rate"] for p in points], label="hit rate")
    axes.plot(thresholds, [p["false_hit_rate"] for p in points], label="false-hit rate")
    axes.axhline(PRECISION_TARGET, color="grey", linestyle=":", linewidth=0.8)
    axes.set_xlabel("similarity threshold")
    axes.set_title(title)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    cache = commands.add_parser("cache", help="evaluate and manage the semantic cache")
    sub = cache.add_subparsers(dest="cache_command", required=True)
    ev = sub.add_parser("eval", help="warm with every a, query with every b, report hits")
    ev.add_argument("--pairs", required=True, help='JSONL of {"a", "b", "label"} lines')
    ev.add_argument("--threshold", type=float, help="default: the config's")
    ev.add_argument("--config")
    ev.add_argument("--json", action="store_true")
    ev.add_argument("--plot", help="write precision and hit rate against the threshold here")
    ev.set_defaults(run=cache_eval)
