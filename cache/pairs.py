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
from typing import Annotated, Literal

import msgspec
import numpy as np
import numpy.typing as npt

from cache.calibration import Calibration
from cache.entry import Namespace, normalise
from cache.memory_store import MemoryStore
from cache.semantic_cache import Hit, SemanticCache
from cache.settings import CacheSettings, MemoryStoreSettings
from cache.verifier import BUNDLED, Verification, Verifier
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
    threshold: float  # on the score the cache decides by
    hit_rate: float  # share of queries served from the cache
    precision: float  # share of hits that were right (1.0 without hits)
    false_hit_rate: float  # share of queries served a wrong answer
    semantic_hit_rate: float  # share of queries served a similar prompt's answer
    # Share of those semantic hits that were wrong: what cache.max_false_hit_rate bounds.
    semantic_wrong_share: float


class Sweep(msgspec.Struct, frozen=True):
    """Per query: the score the cache decides by (the verifier's P, or the similarity
    without a verifier) of what it would serve, guards applied (inf for an exact
    repeat, -1 where nothing passes), and whether serving it would be right."""

    score: npt.NDArray[np.float64]
    correct: npt.NDArray[np.bool_]
    by: Literal["verifier", "similarity"]
    served: list[str | None]  # the cached prompt it would serve

    def at(self, threshold: float) -> SweepPoint:
        hits = self.score >= threshold
        semantic = hits & np.isfinite(self.score)
        count, right = int(hits.sum()), int((hits & self.correct).sum())
        semantic_count = int(semantic.sum())
        semantic_wrong = int((semantic & ~self.correct).sum())
        return SweepPoint(
            threshold=threshold,
            hit_rate=count / len(hits),
            precision=right / count if count else 1.0,
            false_hit_rate=(count - right) / len(hits),
            semantic_hit_rate=semantic_count / len(hits),
            semantic_wrong_share=semantic_wrong / semantic_count if semantic_count else 0.0,
        )

    def configured(self, settings: CacheSettings) -> float:
        """The threshold ``settings`` decide by: the verifier's operating point for their
        bound, or the similarity threshold without a verifier."""
        if self.by == "similarity":
            return settings.similarity_threshold
        verification = Verification.configured(settings.verifier)
        assert verification is not None  # the sweep was decided by it
        return verification.threshold(settings.max_false_hit_rate)

    def best_at_precision(self, target: float = PRECISION_TARGET) -> SweepPoint | None:
        """The lowest threshold (most hits) whose precision still reaches ``target``."""
        best = None
        scores = self.score[np.isfinite(self.score) & (self.score >= 0)]
        for threshold in np.unique(scores)[::-1]:
            point = self.at(float(threshold))
            if point.precision < target:
                break
            best = point
        return best

    def calibration(self, verifier: str, pairs: str) -> Calibration:
        """The semantic hits as a calibration of the verifier that scored them."""
        semantic = np.isfinite(self.score) & (self.score >= 0)
        return Calibration(
            verifier=verifier,
            pairs=pairs,
            queries=len(self.score),
            scores=[round(float(s), 6) for s in self.score[semantic]],
            wrong=[not bool(c) for c in self.correct[semantic]],
        )


def sweep(
    pairs: list[Pair],
    settings: CacheSettings,
    *,
    encode: Encode,
    embedding_model: str,
    pairwise: bool = False,
) -> Sweep:
    """Warm a scratch cache with every ``a`` and look up every ``b``. ``encode`` embeds
    prompts with ``embedding_model``; embedding both sides is most of the time taken.

    ``pairwise``: each pair on its own instead, its ``a`` alone in a namespace of its
    own, so every hit is judged by the pair's own label. A file labels only the pairs
    it lists: in one shared cache a query is often served another duplicate that no
    label links to it, which the whole-file view counts wrong."""
    warm = [p.a for p in pairs] if pairwise else list(dict.fromkeys(p.a for p in pairs))
    cached_vectors = encode(warm)
    query_vectors = encode([p.b for p in pairs])
    return asyncio.run(
        _sweep(pairs, warm, cached_vectors, query_vectors, settings, embedding_model, pairwise)
    )


async def _sweep(
    pairs: list[Pair],
    warm: list[str],
    cached_vectors: Vectors,
    query_vectors: Vectors,
    settings: CacheSettings,
    embedding_model: str,
    pairwise: bool,
) -> Sweep:
    # Operating point 0 (threshold 0 without a verifier) serves the candidate the cache
    # trusts most; any operating point's outcome follows from its score.
    store = MemoryStoreSettings(max_entries=len(warm) + 1, snapshot=None)
    everything = msgspec.structs.replace(
        settings, similarity_threshold=0.0, ttl_s=None, write_confidence=0.0, store=store
    )
    # Operating point 0, so no calibration is read: calibrating needs none.
    verification = None
    if settings.verifier is not None:
        verification = Verification(Verifier.load(settings.verifier.weights or BUNDLED), None)
        verification.check(embedding_model)
    cache = SemanticCache(everything, MemoryStore(store), verification)

    def namespace(i: int) -> Namespace:
        return Namespace(model=f"pair-{i}" if pairwise else "eval", embedding=embedding_model)

    await cache.start()
    try:
        entries = [
            cache.entry(
                namespace(i),
                prompt,
                Embedding(vector, embedding_model),
                response="",
                model="",
                tier="",
                confidence=1.0,
            )
            for i, (prompt, vector) in enumerate(zip(warm, cached_vectors, strict=True))
        ]
        await cache.put(entries)
        score = np.full(len(pairs), -1.0)
        correct = np.zeros(len(pairs), dtype=bool)
        served: list[str | None] = [None] * len(pairs)
        for i, (pair, vector) in enumerate(zip(pairs, query_vectors, strict=True)):
            embedding = Embedding(vector, embedding_model)

            async def known(embedding: Embedding = embedding) -> Embedding:
                return embedding

            found = await cache.lookup(namespace(i), pair.b, known)
            if isinstance(found, Hit):
                exact = found.path == "exact"
                decided_by = found.similarity if found.score is None else found.score
                score[i] = np.inf if exact else decided_by
                correct[i] = pair.label == 1 and normalise(found.entry.prompt) == normalise(pair.a)
                served[i] = found.entry.prompt
        by: Literal["verifier", "similarity"] = "similarity" if verification is None else "verifier"
        return Sweep(score, correct, by, served)
    finally:
        await cache.close()


def plot(result: Sweep, title: str, path: str | Path) -> None:
    """Precision, hit rate and false-hit rate against the threshold, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    low = 0.0 if result.by == "verifier" else 0.5
    thresholds = np.linspace(low, 1.0, 101)
    points = [result.at(float(t)) for t in thresholds]
    figure, axes = plt.subplots(figsize=(7, 4.5))
    axes.plot(thresholds, [p.precision for p in points], label="precision")
    axes.plot(thresholds, [p.hit_rate for p in points], label="hit rate")
    axes.plot(thresholds, [p.false_hit_rate for p in points], label="false-hit rate")
    axes.axhline(PRECISION_TARGET, color="grey", linestyle=":", linewidth=0.8)
    axes.set_xlabel(
        "verifier operating point (P)" if result.by == "verifier" else "similarity threshold"
    )
    axes.set_title(title)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
