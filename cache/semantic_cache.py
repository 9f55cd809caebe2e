"""Exact and semantic lookup over one store, scoped by namespace.

The exact path needs no embedding: a hash of the normalised prompt in its namespace.
The semantic path searches the namespace's vector index with the embedding the
request already has, and serves the nearest entry above the similarity threshold
that every guard accepts.

The vector indexes live in this process and follow the store: rebuilt from it at
start, updated by this process's writes and by the changes other replicas publish.
FAISS work runs on one dedicated thread, which keeps it off the event loop and
serialises it (a FAISS index is not safe to change while it is searched).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Literal, ParamSpec, TypeVar

import msgspec
import numpy as np

from cache.calibration import NEVER
from cache.entry import CacheEntry, Namespace, entry_id, pack_vector, unpack_vector
from cache.guards import veto
from cache.settings import CacheSettings
from cache.store import (
    CacheStore,
    Deleted,
    FloorChange,
    Invalidated,
    NearCacheStats,
    Put,
    Resync,
    StoreStats,
    StoreUnavailable,
    in_scope,
)
from cache.verifier import Verification
from router.embedder import Embedding
from router.index import VectorIndex, gpu_resources

log = logging.getLogger("satisfice.cache")

P = ParamSpec("P")
T = TypeVar("T")

# How often expired entries are dropped from the indexes (the store drops the
# entries themselves; a lookup that meets one before then drops it too).
EXPIRY_SWEEP_S = 5.0
# Entries read from the store per index update while rebuilding.
REBUILD_BATCH = 10_000


class Hit(msgspec.Struct, frozen=True):
    entry: CacheEntry
    path: Literal["exact", "semantic"]
    similarity: float
    # The verifier's P(same answer); None on the exact path or without a verifier.
    score: float | None = None


class Miss(msgspec.Struct, frozen=True):
    # Which stage decided: "empty": nothing in the namespace; "below_threshold": the
    # nearest too far; "guard:<name>": near enough but vetoed by that guard;
    # "verifier": its P below the operating point; "feedback": below the entry's own
    # floor, raised by reported false hits; "store_unavailable"; "exact_only": the
    # exact path missed and the semantic path is turned off.
    reason: str
    best_similarity: float | None = None
    # The candidate the deciding stage turned down (the nearest the guards let
    # through, or the first they vetoed), if any.
    candidate: int | None = None
    candidate_similarity: float | None = None
    score: float | None = None


class CacheCounters(msgspec.Struct, kw_only=True):
    """Running totals since start, for stats and metrics."""

    exact_hits: int = 0
    semantic_hits: int = 0
    misses: int = 0
    guard_rejections: dict[str, int] = msgspec.field(default_factory=dict)
    verifier_rejections: int = 0
    feedback_rejections: int = 0
    false_hits_reported: int = 0
    writes: int = 0
    writes_below_confidence: int = 0
    store_unavailable: int = 0
    replica_changes: int = 0
    resyncs: int = 0


class NamespaceStats(msgspec.Struct, frozen=True):
    namespace: str
    vectors: int


class CacheStats(msgspec.Struct, frozen=True, kw_only=True):
    store: StoreStats
    near: NearCacheStats | None  # the Redis store's near cache
    indexed: int
    namespaces: list[NamespaceStats]
    counters: CacheCounters


class _Indexes:
    """One vector index per namespace; id -> (namespace, expires_at) of every indexed
    vector; and a heap of expiry times, to drop vectors when their entries expire."""

    def __init__(self) -> None:
        self.indexes: dict[str, VectorIndex] = {}
        self.indexed: dict[int, tuple[str, float | None]] = {}
        self.expiry: list[tuple[float, int]] = []


class SemanticCache:
    def __init__(
        self,
        settings: CacheSettings,
        store: CacheStore,
        verification: Verification | None = None,
    ) -> None:
        """``verification``: the verifier and operating points to use; None: those
        ``settings.verifier`` names (none when it is null)."""
        self.settings = settings
        self.store = store
        self.verification = verification or Verification.configured(settings.verifier)
        self.counters = CacheCounters()
        self._state = _Indexes()
        self._faiss = ThreadPoolExecutor(1, thread_name_prefix="cache-index")
        self._gpu = gpu_resources(settings.index.device)
        self._tasks: list[asyncio.Task[None]] = []
        # Whether the indexes were ever read from the store: until then (a replica that
        # started while its Redis was down) an empty index says nothing about the store.
        self._rebuilt = False

    async def start(self) -> None:
        await self.store.start()
        await self.rebuild()
        self._tasks = [
            asyncio.create_task(self._follow_changes()),
            asyncio.create_task(self._sweep_expired()),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.store.close()
        await asyncio.to_thread(self._faiss.shutdown, wait=True)

    async def _index(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        return await asyncio.get_running_loop().run_in_executor(
            self._faiss, lambda: fn(*args, **kwargs)
        )

    # -- lookup -------------------------------------------------------------------

    async def lookup(
        self,
        namespace: Namespace,
        prompt: str,
        embed: Callable[[], Awaitable[Embedding]],
        settings: CacheSettings | None = None,
    ) -> Hit | Miss:
        """Exact path, then (only if that misses) the semantic path with the vector
        ``embed`` returns: a caller that needs the vector later keeps it there.
        ``settings`` replace the cache's own for this lookup (a tenant's threshold, the
        config a request started with)."""
        settings = settings or self.settings
        hit = await self.exact(namespace, prompt, settings)
        if hit is not None:
            return hit
        if not settings.semantic:
            self.counters.misses += 1
            return Miss("exact_only")
        return await self.semantic(namespace, prompt, await embed(), settings)

    async def exact(
        self, namespace: Namespace, prompt: str, settings: CacheSettings | None = None
    ) -> Hit | None:
        if not (settings or self.settings).exact:
            return None
        entry = await self._guarded(self.store.get(namespace.key, entry_id(namespace, prompt)))
        if entry is None:
            return None
        self.counters.exact_hits += 1
        return Hit(entry, "exact", 1.0)

    def exact_at_hand(
        self, namespace: Namespace, prompt: str, settings: CacheSettings | None = None
    ) -> Hit | None:
        """The exact hit this process holds (the memory store, or Redis's near cache),
        at once; None when it holds none, though ``exact`` may still find one. Not
        counted as a hit until ``note_exact_hit``: it may yet not be served."""
        if not (settings or self.settings).exact:
            return None
        entry = self.store.peek(namespace.key, entry_id(namespace, prompt))
        return None if entry is None else Hit(entry, "exact", 1.0)

    def note_exact_hit(self) -> None:
        self.counters.exact_hits += 1

    async def semantic(
        self,
        namespace: Namespace,
        prompt: str,
        embedding: Embedding,
        settings: CacheSettings | None = None,
    ) -> Hit | Miss:
        if embedding.model != namespace.embedding:
            raise ValueError(
                f"embedding from {embedding.model!r} in a namespace of {namespace.embedding!r}"
            )
        found = await self._semantic(namespace, prompt, embedding, settings or self.settings)
        if isinstance(found, Hit):
            self.counters.semantic_hits += 1
        else:
            self.counters.misses += 1
            if found.reason.startswith("guard:"):
                guard = found.reason.removeprefix("guard:")
                self.counters.guard_rejections[guard] = (
                    self.counters.guard_rejections.get(guard, 0) + 1
                )
            elif found.reason == "verifier":
                self.counters.verifier_rejections += 1
            elif found.reason == "feedback":
                self.counters.feedback_rejections += 1
        return found

    async def _semantic(
        self, namespace: Namespace, prompt: str, embedding: Embedding, settings: CacheSettings
    ) -> Hit | Miss:
        if not self._rebuilt:
            self.counters.store_unavailable += 1
            return Miss("store_unavailable")
        index = self._state.indexes.get(namespace.key)
        if not settings.semantic or index is None or len(index) == 0:
            return Miss("empty")
        verification, floor = self.verification, settings.similarity_threshold
        if verification is None or settings.verifier is None:
            verification = None
        else:
            floor = settings.verifier.similarity_floor
        similarities, ids = await self._index(index.search, embedding.vector, settings.candidates)
        best = float(similarities[0, 0])
        near = [
            (float(similarity), int(id_))
            for similarity, id_ in zip(similarities[0], ids[0], strict=True)
            if id_ >= 0 and similarity >= floor
        ]
        if not near:
            return Miss("below_threshold", best)
        nearest = await self._guards_pass(namespace, prompt, near, settings, best)
        if isinstance(nearest, Miss):
            return nearest
        similarity, entry = nearest
        if verification is not None:
            return self._verified(
                prompt, embedding, entry, similarity, verification, settings, best
            )
        if similarity >= entry.floor:
            return Hit(entry, "semantic", similarity)
        return Miss("feedback", best, entry.id, similarity)

    async def _guards_pass(
        self,
        namespace: Namespace,
        prompt: str,
        near: list[tuple[float, int]],
        settings: CacheSettings,
        best: float,
    ) -> tuple[float, CacheEntry] | Miss:
        """The nearest of ``near`` (similarity, id) that every guard lets through, or
        the miss that says why none."""
        entries = await self._guarded(self.store.get_many(namespace.key, [id_ for _, id_ in near]))
        if entries is None:
            return Miss("store_unavailable", best)
        nearest: tuple[float, CacheEntry] | None = None
        vetoed: Miss | None = None
        gone = []
        for (similarity, id_), entry in zip(near, entries, strict=True):
            if entry is None:  # expired or evicted since it was indexed
                gone.append(id_)
                continue
            guard = veto(entry.prompt, prompt, settings.guards)
            if guard is None:
                nearest = similarity, entry
                break
            if vetoed is None:
                vetoed = Miss(f"guard:{guard}", best, entry.id, similarity)
        if gone:
            await self._unindex(gone)
        return nearest or vetoed or Miss("below_threshold", best)

    @staticmethod
    def _verified(
        prompt: str,
        embedding: Embedding,
        nearest: CacheEntry,
        similarity: float,
        verification: Verification,
        settings: CacheSettings,
        best: float,
    ) -> Hit | Miss:
        """The nearest candidate the guards let through, if the verifier's P clears the
        operating point and the entry's own floor. Only that one: re-ranking the
        candidates by P served more unlabelled near neighbours and fewer of the
        labelled duplicates on the public pairs (docs/benchmarks.md)."""
        score = verification.verifier.score(
            prompt, embedding.vector, [(nearest.prompt, unpack_vector(nearest.vector))]
        )[0]
        operating_point = verification.threshold(settings.max_false_hit_rate)
        if score >= max(operating_point, nearest.floor):
            return Hit(nearest, "semantic", similarity, score)
        stage = "verifier" if score < operating_point else "feedback"
        return Miss(stage, best, nearest.id, similarity, score)

    async def _guarded(self, call: Awaitable[T]) -> T | None:
        """The store's answer, or None while it is unavailable (the request goes on
        without the cache; the store logs the outage once)."""
        try:
            return await call
        except StoreUnavailable:
            self.counters.store_unavailable += 1
            return None

    # -- writes -------------------------------------------------------------------

    def entry(
        self,
        namespace: Namespace,
        prompt: str,
        embedding: Embedding,
        *,
        response: str,
        model: str,
        tier: str,
        confidence: float,
        completion_tokens: int = 0,
    ) -> CacheEntry:
        if embedding.model != namespace.embedding:
            raise ValueError("the embedding does not belong to this namespace's model")
        now = time.time()
        return CacheEntry(
            id=entry_id(namespace, prompt),
            namespace=namespace.key,
            prompt=prompt,
            response=response,
            model=model,
            tier=tier,
            confidence=confidence,
            created_at=now,
            expires_at=None if self.settings.ttl_s is None else now + self.settings.ttl_s,
            completion_tokens=completion_tokens,
            vector=pack_vector(embedding.vector),
        )

    async def put(self, entries: list[CacheEntry], *, best_effort: bool = True) -> list[CacheEntry]:
        """Store the entries confident enough to keep; returns those stored. Best
        effort (a write-back) skips an unavailable store; otherwise it raises."""
        keep = [e for e in entries if e.confidence >= self.settings.write_confidence]
        self.counters.writes_below_confidence += len(entries) - len(keep)
        if not keep:
            return []
        if best_effort:
            evicted = await self._guarded(self.store.put(keep))
            if evicted is None:
                return []
        else:
            evicted = await self.store.put(keep)
        self.counters.writes += len(keep)
        if evicted:
            await self._unindex([e.id for e in evicted])
        await self._add(keep)
        return keep

    def contains(self, id_: int) -> bool:
        """Whether this process has the entry indexed (the store may have dropped it
        since; the next lookup that meets it will notice)."""
        return id_ in self._state.indexed

    async def delete(self, id_: int) -> bool:
        where = self._state.indexed.get(id_)
        if where is None:
            return False
        deleted = bool(await self.store.delete(where[0], id_))
        await self._unindex([id_])
        return deleted

    async def report_false_hit(
        self, tenant: str, id_: int, score: float | None
    ) -> FloorChange | None:
        """A semantic hit on entry ``id_`` was wrong: raise the entry's floor above the
        score it was served at (halfway to certainty), so that query, and any the cache
        trusts no more, is not served it again; with no score, turn its semantic hits
        off. Exact repeats still serve it. One atomic step in the store: it never brings
        back an entry deleted meanwhile, and a replayed report changes nothing. None:
        ``tenant`` has no such entry here. Raises ``StoreUnavailable`` while the store
        is, or before this process has read which entries it holds."""
        where = self._state.indexed.get(id_)
        if where is None and not self._rebuilt:
            raise StoreUnavailable("the cache index has not been read from the store yet")
        # The namespace key begins "tenant:": compared whole, so "acme:small" names no
        # tenant whose entries it could reach.
        if where is None or where[0].split(":", 1)[0] != tenant:
            return None
        floor = NEVER if score is None else score + (1.0 - score) / 2
        change = await self.store.raise_floor(where[0], id_, floor)
        if change is not None and change.raised:
            self.counters.false_hits_reported += 1
        return change

    async def invalidate(self, selector: str | None) -> int:
        """Drop every entry under a namespace selector (see ``in_scope``), or every
        entry when None; returns how many the store dropped."""
        dropped = await self.store.invalidate(selector)
        await self._drop_namespaces(selector)
        return dropped

    async def stats(self) -> CacheStats:
        try:
            store = await self.store.stats()
        except StoreUnavailable:
            store = StoreStats(kind="unavailable", entries=0, available=False)
        return CacheStats(
            store=store,
            near=self.store.near_stats(),
            indexed=len(self._state.indexed),
            namespaces=[
                NamespaceStats(ns, len(index)) for ns, index in self._state.indexes.items()
            ],
            counters=self.counters,
        )

    # -- keeping the indexes in step with the store ---------------------------------

    async def _add(self, entries: Iterable[CacheEntry], state: _Indexes | None = None) -> None:
        state = state or self._state
        by_namespace: dict[str, list[CacheEntry]] = {}
        for entry in entries:
            by_namespace.setdefault(entry.namespace, []).append(entry)
        for namespace, group in by_namespace.items():
            ids = np.array([e.id for e in group], dtype=np.int64)
            vectors = np.stack([unpack_vector(e.vector) for e in group])
            index = state.indexes.get(namespace)
            if index is None:
                index = state.indexes[namespace] = VectorIndex(
                    vectors.shape[1], hnsw_above=self.settings.index.hnsw_above, gpu=self._gpu
                )
            await self._index(index.add, ids, vectors)
            for entry in group:
                state.indexed[entry.id] = (namespace, entry.expires_at)
                if entry.expires_at is not None:
                    heapq.heappush(state.expiry, (entry.expires_at, entry.id))

    async def _unindex(self, ids: Iterable[int]) -> None:
        by_namespace: dict[str, list[int]] = {}
        for id_ in ids:
            where = self._state.indexed.pop(id_, None)
            if where is not None:
                by_namespace.setdefault(where[0], []).append(id_)
        for namespace, group in by_namespace.items():
            index = self._state.indexes.get(namespace)
            if index is not None:
                await self._index(index.remove, np.array(group, dtype=np.int64))

    async def _drop_namespaces(self, selector: str | None) -> None:
        doomed = {ns for ns in self._state.indexes if selector is None or in_scope(ns, selector)}
        for namespace in doomed:
            del self._state.indexes[namespace]
        self._state.indexed = {k: v for k, v in self._state.indexed.items() if v[0] not in doomed}

    async def rebuild(self) -> None:
        """Re-create every index from the store's entries, then swap them in at once."""
        # Built aside and swapped in whole: lookups meanwhile use the old indexes.
        state, batch, count = _Indexes(), [], 0
        try:
            async for entry in self.store.entries():
                batch.append(entry)
                if len(batch) == REBUILD_BATCH:  # a batch at a time: entries are large
                    await self._add(batch, state)
                    count, batch = count + len(batch), []
            await self._add(batch, state)
        except StoreUnavailable:
            log.warning("cache index not rebuilt: the store is unavailable")
            return
        self._state, self._rebuilt = state, True
        log.info("cache index rebuilt: %d entries", count + len(batch))

    async def _follow_changes(self) -> None:
        """Apply what other replicas change, for as long as the cache runs."""
        async for change in self.store.changes():
            self.counters.replica_changes += 1
            try:
                if isinstance(change, Put):
                    await self._add([change.entry])
                elif isinstance(change, Deleted):
                    await self._unindex([change.id])
                elif isinstance(change, Invalidated):
                    await self._drop_namespaces(change.namespace)
                elif isinstance(change, Resync):
                    self.counters.resyncs += 1
                    await self.rebuild()
            except Exception:  # one bad change must not stop the replica following
                log.exception("cache change %r could not be applied", change)

    async def _sweep_expired(self) -> None:
        while True:
            await asyncio.sleep(EXPIRY_SWEEP_S)
            now = time.time()
            expired = []
            while self._state.expiry and self._state.expiry[0][0] <= now:
                expires_at, id_ = heapq.heappop(self._state.expiry)
                where = self._state.indexed.get(id_)
                # A re-stored entry has a later expiry: only the latest one counts.
                if where is not None and where[1] == expires_at:
                    expired.append(id_)
            if expired:
                await self._unindex(expired)
