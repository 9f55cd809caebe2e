"""Exact and semantic lookup over one store, scoped by namespace.

The exact path needs no embedding: a hash of the normalised prompt in its namespace.
The semantic path searches the namespace's vector index with the embedding the
request already has, and serves the nearest entry above the similarity threshold
that every guard accepts. All methods block (FAISS); callers keep them off the
event loop.
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

import msgspec
import numpy as np

from cache.entry import CacheEntry, Namespace, entry_id
from cache.guards import GuardSettings, veto
from cache.memory_store import MemoryStore
from router.embedder import Embedding
from router.index import VectorIndex

Unit = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]


class CacheSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    exact: bool = True
    semantic: bool = True
    # Cosine similarity a cached prompt needs to be served for a new one.
    similarity_threshold: Unit = 0.92
    # Answers below this confidence are not stored.
    write_confidence: Unit = 0.0
    ttl_s: Annotated[float, msgspec.Meta(gt=0)] | None = 86_400.0
    max_entries: Annotated[int, msgspec.Meta(ge=1)] = 100_000
    # Candidates above the threshold that the guards may examine, nearest first.
    candidates: Annotated[int, msgspec.Meta(ge=1)] = 5
    guards: GuardSettings = GuardSettings()


class Hit(msgspec.Struct, frozen=True):
    entry: CacheEntry
    path: Literal["exact", "semantic"]
    similarity: float


class Miss(msgspec.Struct, frozen=True):
    # "empty": nothing in the namespace; "below_threshold": nearest too far;
    # "guard:<name>": near enough but vetoed by that guard.
    reason: str
    best_similarity: float | None = None


class SemanticCache:
    def __init__(self, settings: CacheSettings, store: MemoryStore, *, dim: int) -> None:
        self.settings = settings
        self._store = store
        self._dim = dim
        self._indexes: dict[str, VectorIndex] = {}

    def exact(self, namespace: Namespace, prompt: str) -> Hit | None:
        if not self.settings.exact:
            return None
        entry = self._store.get(entry_id(namespace, prompt))
        return None if entry is None else Hit(entry, "exact", 1.0)

    def semantic(self, namespace: Namespace, prompt: str, embedding: Embedding) -> Hit | Miss:
        if embedding.model != namespace.embedding:
            raise ValueError(
                f"embedding from {embedding.model!r} in a namespace of {namespace.embedding!r}"
            )
        index = self._indexes.get(namespace.key)
        if not self.settings.semantic or index is None or len(index) == 0:
            return Miss("empty")
        similarities, ids = index.search(embedding.vector, self.settings.candidates)
        best = float(similarities[0, 0])
        reason = "below_threshold"
        for similarity, id_ in zip(similarities[0], ids[0], strict=True):
            if id_ < 0 or similarity < self.settings.similarity_threshold:
                break
            entry = self._store.get(int(id_))
            if entry is None:  # expired or evicted since it was indexed
                index.remove(ids[0][ids[0] == id_])
                continue
            vetoed = veto(entry.prompt, prompt, self.settings.guards)
            if vetoed is None:
                return Hit(entry, "semantic", float(similarity))
            reason = f"guard:{vetoed}"
        return Miss(reason, best)

    def put(
        self,
        namespace: Namespace,
        prompt: str,
        embedding: Embedding,
        *,
        response: str,
        model: str,
        tier: str,
        confidence: float,
    ) -> CacheEntry | None:
        """Store an answer if it is confident enough; None when it is not stored."""
        if confidence < self.settings.write_confidence:
            return None
        if embedding.model != namespace.embedding:
            raise ValueError("the embedding does not belong to this namespace's model")
        now = time.time()
        entry = CacheEntry(
            id=entry_id(namespace, prompt),
            namespace=namespace.key,
            prompt=prompt,
            response=response,
            model=model,
            tier=tier,
            confidence=confidence,
            created_at=now,
            expires_at=None if self.settings.ttl_s is None else now + self.settings.ttl_s,
        )
        for evicted in self._store.put(entry):
            self._unindex(evicted)
        index = self._indexes.setdefault(namespace.key, VectorIndex(self._dim))
        index.add(np.array([entry.id], dtype=np.int64), embedding.vector)
        return entry

    def delete(self, id_: int) -> bool:
        entry = self._store.delete(id_)
        if entry is not None:
            self._unindex(entry)
        return entry is not None

    def invalidate(self, namespace: Namespace) -> int:
        """Drop every entry of a namespace; returns how many."""
        doomed = [e.id for e in self._store.entries() if e.namespace == namespace.key]
        for id_ in doomed:
            self._store.delete(id_)
        self._indexes.pop(namespace.key, None)
        return len(doomed)

    def _unindex(self, entry: CacheEntry) -> None:
        index = self._indexes.get(entry.namespace)
        if index is not None:
            index.remove(np.array([entry.id], dtype=np.int64))
