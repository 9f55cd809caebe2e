"""Entries of a shared store held in this process, so that a repeated question needs
no network round trip: a near cache, bounded in bytes, least recently used first out.

It is filled by reads and by this process's own writes, and kept coherent by the
change stream the replicas follow: any change another replica announces drops the
entry here (the next read fetches what the store holds now), an invalidation drops
its scope, and a resync drops everything. A read that was in flight while a change
to its entry arrived is not kept: it may hold what the change replaced.
"""

from __future__ import annotations

import collections
from typing import Final

from cache.entry import CacheEntry
from cache.store import NearCacheStats, in_scope

# Bytes counted per entry beyond its text and vector: the struct, its fields' objects
# and the dict slot (measured with tracemalloc: about 630 bytes; rounded up).
ENTRY_OVERHEAD: Final = 768
# Changes remembered for reads in flight; a read older than this many changes is not
# kept (it can no longer be told whether one of them touched its entry).
_RECENT_CHANGES: Final = 4096


def entry_bytes(entry: CacheEntry) -> int:
    """What an entry costs here, as counted against the bound (an estimate: the
    text's characters, the vector's bytes and a fixed overhead)."""
    return ENTRY_OVERHEAD + len(entry.prompt) + len(entry.response) + len(entry.vector)


class NearCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: collections.OrderedDict[int, CacheEntry] = collections.OrderedDict()
        self._bytes = 0
        # Every change counts one; the ids of the latest, and the count at the latest
        # change that touched every entry (an invalidation, a resync).
        self._generation = 0
        self._recent: collections.deque[tuple[int, int]] = collections.deque(maxlen=_RECENT_CHANGES)
        self._everything_at = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    @property
    def generation(self) -> int:
        """Noted before a read of the store; handed back to ``fill`` with its result."""
        return self._generation

    def get(self, namespace: str, id_: int) -> CacheEntry | None:
        entry = self._entries.get(id_)
        if entry is None or entry.namespace != namespace:
            self.misses += 1
            return None
        if entry.expired():
            self._remove(id_)
            self.misses += 1
            return None
        self._entries.move_to_end(id_)
        self.hits += 1
        return entry

    def fill(self, entry: CacheEntry, read_at: int) -> None:
        """Keep ``entry``, read from the store when the generation was ``read_at``,
        unless a change to it (or to everything) has come since."""
        if read_at < self._everything_at:
            return
        if read_at != self._generation:
            oldest = self._recent[0][0] if self._recent else self._generation
            if read_at < oldest - 1:
                return  # too many changes since to know
            for generation, id_ in reversed(self._recent):  # newest first
                if generation <= read_at:
                    break
                if id_ == entry.id:
                    return
        self._keep(entry)

    def wrote(self, entries: list[CacheEntry]) -> None:
        """This process stored ``entries``: they are what the store holds now, and any
        read of them in flight is older."""
        for entry in entries:
            self.changed(entry.id)
            self._keep(entry)

    def changed(self, id_: int) -> None:
        """The entry changed or went: drop it, and refuse reads of it in flight."""
        self._generation += 1
        self._recent.append((self._generation, id_))
        self._remove(id_)

    def changed_scope(self, selector: str | None) -> None:
        """Every entry under ``selector`` (see ``in_scope``; None: all) changed."""
        self._generation += 1
        self._everything_at = self._generation
        if selector is None:
            self._entries.clear()
            self._bytes = 0
            return
        for id_ in [i for i, e in self._entries.items() if in_scope(e.namespace, selector)]:
            self._remove(id_)

    def stats(self) -> NearCacheStats:
        return NearCacheStats(
            entries=len(self._entries),
            bytes=self._bytes,
            max_bytes=self.max_bytes,
            hits=self.hits,
            misses=self.misses,
            evictions=self.evictions,
        )

    def _keep(self, entry: CacheEntry) -> None:
        size = entry_bytes(entry)
        if size > self.max_bytes:
            return
        self._remove(entry.id)
        self._entries[entry.id] = entry
        self._bytes += size
        while self._bytes > self.max_bytes:
            _, oldest = self._entries.popitem(last=False)
            self._bytes -= entry_bytes(oldest)
            self.evictions += 1

    def _remove(self, id_: int) -> None:
        entry = self._entries.pop(id_, None)
        if entry is not None:
            self._bytes -= entry_bytes(entry)
