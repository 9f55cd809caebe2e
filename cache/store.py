"""The store contract: where cache entries live, and how replicas hear of changes.

A store keeps entries (vectors included) durably enough for its kind; the vector
index over them lives in each process and is rebuilt from ``entries()`` at start.
Changes made through other processes sharing the store arrive on ``changes()`` so
every process's index converges without a restart.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

import msgspec

from cache.entry import CacheEntry


def in_scope(namespace: str, selector: str) -> bool:
    """Whether a namespace key falls under a selector: the key itself, or a leading
    part of it ending at a separator ("tenant" or "tenant:model")."""
    return namespace == selector or namespace.startswith(selector + ":")


class StoreUnavailable(Exception):
    """The store cannot be reached or answered too slowly; the caller bypasses it."""


class Put(msgspec.Struct, frozen=True, tag="put"):
    entry: CacheEntry


class Deleted(msgspec.Struct, frozen=True, tag="delete"):
    namespace: str
    id: int


class Invalidated(msgspec.Struct, frozen=True, tag="invalidate"):
    namespace: str | None  # a selector (see in_scope); None: every namespace


class FloorRaised(msgspec.Struct, frozen=True, tag="floor"):
    """An entry's ``hit_floor`` rose (a semantic hit on it was reported wrong); the entry
    is otherwise as it was."""

    namespace: str
    id: int
    floor: float


class Resync(msgspec.Struct, frozen=True, tag="resync"):
    """Changes may have been missed (an outage, a trimmed stream): rebuild from
    ``entries()``."""


Change = Put | Deleted | Invalidated | FloorRaised | Resync


class FloorChange(msgspec.Struct, frozen=True):
    """An entry's floor after a report, and whether the report raised it (a report no
    higher than an earlier one, a replay, changes nothing)."""

    floor: float
    raised: bool


class StoreStats(msgspec.Struct, frozen=True, kw_only=True):
    kind: str
    entries: int
    bytes: int | None = None  # memory the store reports for itself, when it can
    available: bool = True


class NearCacheStats(msgspec.Struct, frozen=True, kw_only=True):
    """What a store holds in this process in front of a shared one (cache/near.py)."""

    entries: int
    bytes: int
    max_bytes: int
    hits: int
    misses: int
    evictions: int


class CacheStore(Protocol):
    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def peek(self, namespace: str, id_: int) -> CacheEntry | None:
        """The live entry if this process holds it, without waiting for anything; None
        says nothing about the store (``get`` may still find it there)."""
        ...

    async def get(self, namespace: str, id_: int) -> CacheEntry | None:
        """The live entry, or None if absent or expired."""
        ...

    async def get_many(self, namespace: str, ids: list[int]) -> list[CacheEntry | None]: ...

    async def put(self, entries: list[CacheEntry]) -> list[CacheEntry]:
        """Store (replacing by id); returns entries the store evicted to make room. An
        entry stored again keeps the floor its reports raised: answering the same prompt
        anew undoes no report."""
        ...

    async def raise_floor(self, namespace: str, id_: int, floor: float) -> FloorChange | None:
        """Raise the entry's ``hit_floor`` to ``floor`` if that is higher, in one atomic
        step; None when there is no such live entry (it is never created)."""
        ...

    async def delete(self, namespace: str, id_: int) -> bool: ...

    async def invalidate(self, namespace: str | None) -> int:
        """Drop the entries of every namespace in scope of the selector (see
        ``in_scope``), or every entry when None; returns how many."""
        ...

    def entries(self) -> AsyncIterator[CacheEntry]:
        """Every live entry, for rebuilding an index."""
        ...

    def changes(self) -> AsyncIterator[Change]:
        """Changes made by other processes, for as long as the store is open."""
        ...

    async def stats(self) -> StoreStats: ...

    def near_stats(self) -> NearCacheStats | None:
        """What the store holds in this process in front of a shared one; None when
        it has no such near cache (the memory store is all near)."""
        ...
