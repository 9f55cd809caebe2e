"""The in-process store: the embedded default, one dict, bounded, with TTL."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterator

from cache.entry import CacheEntry


class MemoryStore:
    """Entries by id, oldest evicted first once ``max_entries`` is reached."""

    def __init__(self, max_entries: int) -> None:
        self._max_entries = max_entries
        self._entries: OrderedDict[int, CacheEntry] = OrderedDict()

    def get(self, id_: int) -> CacheEntry | None:
        entry = self._entries.get(id_)
        if entry is None:
            return None
        if entry.expired():
            del self._entries[id_]
            return None
        return entry

    def put(self, entry: CacheEntry) -> list[CacheEntry]:
        """Store an entry; returns the entries evicted to make room."""
        self._entries.pop(entry.id, None)
        self._entries[entry.id] = entry
        evicted = []
        while len(self._entries) > self._max_entries:
            evicted.append(self._entries.popitem(last=False)[1])
        return evicted

    def delete(self, id_: int) -> CacheEntry | None:
        return self._entries.pop(id_, None)

    def entries(self) -> Iterator[CacheEntry]:
        now = time.time()
        return (e for e in list(self._entries.values()) if not e.expired(now))

    def __len__(self) -> int:
        return len(self._entries)
