"""The in-process store: the embedded default. One dict, bounded, with TTL, and an
optional snapshot file so that a restart keeps what was cached."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec

from cache.entry import CacheEntry
from cache.settings import MemoryStoreSettings
from cache.store import Change, FloorChange, StoreStats, in_scope

log = logging.getLogger("satisfice.cache")

_SNAPSHOT_VERSION = 1


class _Snapshot(msgspec.Struct):
    version: int
    entries: list[CacheEntry]


class MemoryStore:
    """Entries by id, oldest evicted first once ``max_entries`` is reached.

    Nothing else shares it, so ``changes()`` never yields.
    """

    def __init__(self, settings: MemoryStoreSettings) -> None:
        self.settings = settings
        self._entries: OrderedDict[int, CacheEntry] = OrderedDict()
        self._closed = asyncio.Event()
        self._snapshots: asyncio.Task[None] | None = None
        self._snapshot = None if settings.snapshot is None else Path(settings.snapshot).expanduser()

    async def start(self) -> None:
        path = self._snapshot
        if path is None:
            return
        entries = await asyncio.to_thread(_read_snapshot, path)
        now = time.time()
        for entry in entries:
            if not entry.expired(now):
                self._entries[entry.id] = entry
        self._evict()
        log.info("cache snapshot %s: %d entries loaded", path, len(self._entries))
        if self.settings.snapshot_interval_s is not None:
            self._snapshots = asyncio.create_task(self._snapshot_every(path))

    async def close(self) -> None:
        self._closed.set()
        if self._snapshots is not None:
            self._snapshots.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._snapshots
        if self._snapshot is not None:
            await self.save(self._snapshot)

    async def save(self, path: Path) -> None:
        entries = list(self._entries.values())
        await asyncio.to_thread(_write_snapshot, path, entries)

    async def _snapshot_every(self, path: Path) -> None:
        assert self.settings.snapshot_interval_s is not None
        while True:
            await asyncio.sleep(self.settings.snapshot_interval_s)
            try:
                await self.save(path)
            except OSError:
                log.exception("cache snapshot %s could not be written", path)

    async def get(self, namespace: str, id_: int) -> CacheEntry | None:
        return self.peek(namespace, id_)

    def peek(self, namespace: str, id_: int) -> CacheEntry | None:
        entry = self._entries.get(id_)
        if entry is None or entry.namespace != namespace:
            return None
        if entry.expired():
            del self._entries[id_]
            return None
        return entry

    async def get_many(self, namespace: str, ids: list[int]) -> list[CacheEntry | None]:
        return [self.peek(namespace, id_) for id_ in ids]

    async def put(self, entries: list[CacheEntry]) -> list[CacheEntry]:
        for entry in entries:
            old = self._entries.pop(entry.id, None)
            same = old if old is not None and old.namespace == entry.namespace else None
            # The floor its reports raised survives a fresh answer.
            if same is not None and not same.expired() and same.floor > entry.floor:
                entry = msgspec.structs.replace(entry, hit_floor=same.hit_floor)
            self._entries[entry.id] = entry
        return self._evict()

    async def raise_floor(self, namespace: str, id_: int, floor: float) -> FloorChange | None:
        entry = self.peek(namespace, id_)
        if entry is None:
            return None
        if floor <= entry.floor:
            return FloorChange(entry.floor, raised=False)
        # In place: a report does not make the entry any younger for eviction.
        self._entries[id_] = msgspec.structs.replace(entry, hit_floor=floor)
        return FloorChange(floor, raised=True)

    def _evict(self) -> list[CacheEntry]:
        evicted = []
        while len(self._entries) > self.settings.max_entries:
            evicted.append(self._entries.popitem(last=False)[1])
        return evicted

    async def delete(self, namespace: str, id_: int) -> bool:
        entry = self._entries.get(id_)
        if entry is None or entry.namespace != namespace:
            return False
        del self._entries[id_]
        return True

    async def invalidate(self, namespace: str | None) -> int:
        doomed = [
            id_
            for id_, entry in self._entries.items()
            if namespace is None or in_scope(entry.namespace, namespace)
        ]
        for id_ in doomed:
            del self._entries[id_]
        return len(doomed)

    async def entries(self) -> AsyncIterator[CacheEntry]:
        now = time.time()
        for entry in list(self._entries.values()):
            if not entry.expired(now):
                yield entry

    async def changes(self) -> AsyncIterator[Change]:
        await self._closed.wait()
        return
        yield  # an async generator that ends when the store closes

    async def stats(self) -> StoreStats:
        return StoreStats(kind="memory", entries=len(self._entries))

    def near_stats(self) -> None:
        return None


def _read_snapshot(path: Path) -> list[CacheEntry]:
    if not path.exists():
        return []
    try:
        snapshot = msgspec.msgpack.decode(path.read_bytes(), type=_Snapshot)
    except (OSError, msgspec.DecodeError) as exc:
        return _set_aside(path, str(exc))
    if snapshot.version != _SNAPSHOT_VERSION:
        return _set_aside(path, f"version {snapshot.version}, not {_SNAPSHOT_VERSION}")
    return snapshot.entries


def _set_aside(path: Path, why: str) -> list[CacheEntry]:
    """A snapshot this version cannot read must not stop the gateway, nor be
    overwritten by the next save: it is renamed for a person to look at."""
    aside = path.with_name(path.name + ".unreadable")
    os.replace(path, aside)
    log.error("cache snapshot %s is unreadable (%s): moved to %s, starting empty", path, why, aside)
    return []


def _write_snapshot(path: Path, entries: list[CacheEntry]) -> None:
    # Write beside the target and rename: a crash mid-write leaves the old snapshot.
    path.parent.mkdir(parents=True, exist_ok=True)
    data = msgspec.msgpack.encode(_Snapshot(_SNAPSHOT_VERSION, entries))
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=path.name, delete=False) as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    os.replace(out.name, path)
