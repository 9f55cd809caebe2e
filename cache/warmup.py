"""Warm-up: load known answers from JSONL, as if each had been asked and answered.

Each line is ``{"prompt": str, "response": str, ...}``; optional fields place it in
the namespace a request would use (``model``, ``system``) and say who answered it.
Loading is idempotent: an entry's id is its namespace and normalised prompt, so a
second run replaces rather than adds. Bad lines are reported by number; the good
ones load regardless.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Annotated, Generic, TypeVar

import msgspec

from cache.entry import CacheEntry, Namespace, context_fingerprint, entry_id, sampling_key
from cache.memory_store import MemoryStore
from cache.semantic_cache import Hit, SemanticCache
from cache.settings import CacheSettings, MemoryStoreSettings
from cache.store import StoreUnavailable
from engines.jsonl import BadLine, decode_lines
from router.embedder import Embedding, Vectors

EmbedMany = Callable[[Sequence[str]], Awaitable[Vectors]]
Progress = Callable[[int], None]

Q = TypeVar("Q", bound="Query")

BATCH = 256
PUT_ATTEMPTS = 4
PUT_RETRY_S = 1.0
# Bad lines listed in a report; the count covers them all.
MAX_REPORTED_ERRORS = 100


class Query(msgspec.Struct, frozen=True, kw_only=True):
    prompt: Annotated[str, msgspec.Meta(min_length=1)]
    # The model name requests will ask for ("auto" for routed requests).
    model: str = "auto"
    system: str | None = None


class WarmupLine(Query, frozen=True, kw_only=True):
    response: Annotated[str, msgspec.Meta(min_length=1)]
    tier: str = "warmup"
    confidence: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 1.0
    answered_by: str = "warmup"


class WarmupReport(msgspec.Struct, kw_only=True):
    lines: int = 0
    added: int = 0  # new entries
    replaced: int = 0  # entries that were already there (a re-run)
    skipped: int = 0  # below the cache's write-confidence threshold
    bad: int = 0
    errors: list[BadLine] = msgspec.field(default_factory=list)


class Parsed(msgspec.Struct, Generic[Q], frozen=True):
    lines: list[Q]
    bad: list[BadLine]

    @property
    def total(self) -> int:
        return len(self.lines) + len(self.bad)


def parse(data: bytes) -> Parsed[WarmupLine]:
    return _parse(data, WarmupLine)


def parse_queries(data: bytes) -> list[Query]:
    """Queries for a dry run; a bad line stops it, naming the line."""
    parsed = _parse(data, Query)
    if parsed.bad:
        raise ValueError(f"line {parsed.bad[0].line}: {parsed.bad[0].error}")
    return parsed.lines


def _parse(data: bytes, kind: type[Q]) -> Parsed[Q]:
    good: list[Q] = []
    bad: list[BadLine] = []
    for item in decode_lines(data.splitlines(), kind):
        if isinstance(item, BadLine):
            bad.append(item)
        else:
            good.append(item)
    return Parsed(good, bad)


def namespace_of(line: Query, tenant: str, embedding_model: str) -> Namespace:
    """The namespace a request for this prompt would look in: same tenant and
    model, the system prompt as its only earlier turn, greedy sampling."""
    turns = [("system", line.system)] if line.system else []
    return Namespace(
        tenant=tenant,
        model=line.model,
        context=context_fingerprint(turns),
        embedding=embedding_model,
        sampling=sampling_key(0.0),
    )


def _batches(lines: list[WarmupLine]) -> Iterator[list[WarmupLine]]:
    for start in range(0, len(lines), BATCH):
        yield lines[start : start + BATCH]


async def warm(
    cache: SemanticCache,
    data: bytes,
    *,
    tenant: str,
    embed_many: EmbedMany,
    embedding_model: str,
    progress: Progress | None = None,
) -> WarmupReport:
    parsed = await asyncio.to_thread(parse, data)  # a large upload would stall the loop
    report = WarmupReport(lines=parsed.total, bad=len(parsed.bad))
    report.errors = parsed.bad[:MAX_REPORTED_ERRORS]
    storing: asyncio.Task[None] | None = None

    async def store(batch: list[WarmupLine], vectors: Vectors) -> None:
        entries = []
        for line, vector in zip(batch, vectors, strict=True):
            namespace = namespace_of(line, tenant, embedding_model)
            present = cache.contains(entry_id(namespace, line.prompt))
            entry = cache.entry(
                namespace,
                line.prompt,
                Embedding(vector, embedding_model),
                response=line.response,
                model=line.answered_by,
                tier=line.tier,
                confidence=line.confidence,
            )
            entries.append((entry, present))
        stored = {e.id for e in await _put(cache, [e for e, _ in entries])}
        for entry, present in entries:
            if entry.id not in stored:
                report.skipped += 1
            elif present:
                report.replaced += 1
            else:
                report.added += 1
        if progress is not None:
            progress(len(batch))

    # Embedding is the slow part: the next batch embeds while this one is stored.
    for batch in _batches(parsed.lines):
        vectors = await embed_many([line.prompt for line in batch])
        if storing is not None:
            await storing
        storing = asyncio.create_task(store(batch, vectors))
    if storing is not None:
        await storing
    return report


async def _put(cache: SemanticCache, entries: list[CacheEntry]) -> list[CacheEntry]:
    """A long warm-up rides out a short store outage: each batch is retried a few
    times (re-putting is idempotent) before the warm-up gives up."""
    for attempt in range(PUT_ATTEMPTS):
        try:
            return await cache.put(entries, best_effort=False)
        except StoreUnavailable:
            if attempt == PUT_ATTEMPTS - 1:
                raise
            await asyncio.sleep(PUT_RETRY_S)
    raise AssertionError("unreachable")


class DryRun(msgspec.Struct, frozen=True, kw_only=True):
    queries: int
    hit_rate: float
    exact_hits: int
    semantic_hits: int


async def dry_run(
    cache: SemanticCache,
    queries: Sequence[Query],
    *,
    tenant: str,
    embed_many: EmbedMany,
    embedding_model: str,
) -> DryRun:
    """The hits these queries would get from what ``cache`` holds."""
    lines = list(queries)
    exact = semantic = 0
    for start in range(0, len(lines), BATCH):
        batch = lines[start : start + BATCH]
        vectors = await embed_many([line.prompt for line in batch])
        for line, vector in zip(batch, vectors, strict=True):
            namespace = namespace_of(line, tenant, embedding_model)
            embedding = Embedding(vector, embedding_model)

            async def known(embedding: Embedding = embedding) -> Embedding:
                return embedding

            found = await cache.lookup(namespace, line.prompt, known)
            if isinstance(found, Hit):
                exact += found.path == "exact"
                semantic += found.path == "semantic"
    return DryRun(
        queries=len(lines),
        hit_rate=(exact + semantic) / len(lines) if lines else 0.0,
        exact_hits=exact,
        semantic_hits=semantic,
    )


async def dry_run_file(
    settings: CacheSettings,
    data: bytes,
    queries: Sequence[Query],
    *,
    tenant: str,
    embed_many: EmbedMany,
    embedding_model: str,
) -> DryRun:
    """The hits ``queries`` would get from a cache warmed with the warm-up file ``data``
    alone: a scratch in-process cache with ``settings``' thresholds and guards, so
    nothing is stored anywhere."""
    scratch = MemoryStoreSettings(max_entries=len(data.splitlines()) + 1, snapshot=None)
    cache = SemanticCache(msgspec.structs.replace(settings, store=scratch), MemoryStore(scratch))
    await cache.start()
    try:
        await warm(
            cache, data, tenant=tenant, embed_many=embed_many, embedding_model=embedding_model
        )
        return await dry_run(
            cache, queries, tenant=tenant, embed_many=embed_many, embedding_model=embedding_model
        )
    finally:
        await cache.close()
