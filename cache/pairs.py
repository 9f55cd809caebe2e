"""How a cache configuration would do on labelled prompt pairs.

A pair is a prompt ``a`` that is cached and a prompt ``b`` that is asked, labelled 1
when serving ``a``'s answer for ``b`` would be right. Every ``a`` warms one cache and
every ``b`` is looked up in it (guards applied), once, at threshold 0: any threshold's
hit rate, precision and false-hit rate then follow from the similarities alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated

import msgspec
import numpy as np
import numpy.typing as npt

from cache.entry import Namespace, normalise
from cache.memory_store import MemoryStore
from cache.semantic_cache import Hit, SemanticCache
from cache.settings import CacheSettings, MemoryStoreSettings
from engines.jsonl import read_jsonl
from router.embedder import Embedding, Vectors

Encode = Callable[[Sequence[str]], Vectors]

# The precision a threshold must keep to count as safe: the sweep's headline figure is
# the best hit rate at it.
PRECISION_TARGET = 0.99


class Pair(msgspec.Struct, frozen=True):
    a: str
    b: str
    label: Annotated[int, msgspec.Meta(ge=0, le=1)]


class PairFileError(ValueError):
    """A pairs file that cannot be used; the message names the file and line."""


def read_pairs(path: str | Path) -> list[Pair]:
    return read_jsonl(path, Pair, error=PairFileError).records


class SweepPoint(msgspec.Struct, frozen=True):
    threshold: float
    hit_rate: float  # share of queries served from the cache
    precision: float  # share of hits that were right (1.0 without hits)
    false_hit_rate: float  # share of queries served a wrong answer


class Sweep(msgspec.Struct, frozen=True):
    """Per query: the similarity of what the cache would serve (guards applied), and
    whether serving it would be right."""

    similarity: npt.NDArray[np.float64]  # -1 where nothing passes the guards
    correct: npt.NDArray[np.bool_]

    def at(self, threshold: float) -> SweepPoint:
        hits = self.similarity >= threshold
        count = int(hits.sum())
        right = int((hits & self.correct).sum())
        return SweepPoint(
            threshold=threshold,
            hit_rate=count / len(hits),
            precision=right / count if count else 1.0,
            false_hit_rate=(count - right) / len(hits),
        )

    def best_at_precision(self, target: float = PRECISION_TARGET) -> SweepPoint | None:
        """The lowest threshold (most hits) whose precision still reaches ``target``."""
        best = None
        for threshold in np.unique(self.similarity[self.similarity >= 0])[::-1]:
            point = self.at(float(threshold))
            if point.precision < target:
                break
            best = point
        return best


def sweep(
    pairs: list[Pair], settings: CacheSettings, *, encode: Encode, embedding_model: str
) -> Sweep:
    """Warm a scratch cache with every ``a`` and look up every ``b``. ``encode`` embeds
    prompts with ``embedding_model``; embedding both sides is most of the time taken."""
    warm = list(dict.fromkeys(p.a for p in pairs))
    cached_vectors = encode(warm)
    query_vectors = encode([p.b for p in pairs])
    return asyncio.run(
        _sweep(pairs, warm, cached_vectors, query_vectors, settings, embedding_model)
    )


async def _sweep(
    pairs: list[Pair],
    warm: list[str],
    cached_vectors: Vectors,
    query_vectors: Vectors,
    settings: CacheSettings,
    embedding_model: str,
) -> Sweep:
    # Threshold 0 returns the first candidate every guard accepts; any threshold's
    # outcome follows from its similarity.
    store = MemoryStoreSettings(max_entries=len(warm) + 1, snapshot=None)
    everything = msgspec.structs.replace(
        settings, similarity_threshold=0.0, ttl_s=None, write_confidence=0.0, store=store
    )
    cache = SemanticCache(everything, MemoryStore(store))
    namespace = Namespace(model="eval", embedding=embedding_model)
    await cache.start()
    try:
        entries = [
            cache.entry(
                namespace,
                prompt,
                Embedding(vector, embedding_model),
                response="",
                model="",
                tier="",
                confidence=1.0,
            )
            for prompt, vector in zip(warm, cached_vectors, strict=True)
        ]
        await cache.put(entries)
        similarity = np.full(len(pairs), -1.0)
        correct = np.zeros(len(pairs), dtype=bool)
        for i, (pair, vector) in enumerate(zip(pairs, query_vectors, strict=True)):
            embedding = Embedding(vector, embedding_model)

            async def known(embedding: Embedding = embedding) -> Embedding:
                return embedding

            found = await cache.lookup(namespace, pair.b, known)
            if isinstance(found, Hit):
                similarity[i] = found.similarity
                correct[i] = pair.label == 1 and normalise(found.entry.prompt) == normalise(pair.a)
        return Sweep(similarity, correct)
    finally:
        await cache.close()


def plot(result: Sweep, title: str, path: str | Path) -> None:
    """Precision, hit rate and false-hit rate against the threshold, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    thresholds = np.linspace(0.5, 1.0, 101)
    points = [result.at(float(t)) for t in thresholds]
    figure, axes = plt.subplots(figsize=(7, 4.5))
    axes.plot(thresholds, [p.precision for p in points], label="precision")
    axes.plot(thresholds, [p.hit_rate for p in points], label="hit rate")
    axes.plot(thresholds, [p.false_hit_rate for p in points], label="false-hit rate")
    axes.axhline(PRECISION_TARGET, color="grey", linestyle=":", linewidth=0.8)
    axes.set_xlabel("similarity threshold")
    axes.set_title(title)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
