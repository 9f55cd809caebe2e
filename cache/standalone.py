"""A cache outside a gateway: what the commands that warm, inspect and invalidate a
store from the command line work on."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from cache import create_store
from cache.semantic_cache import SemanticCache
from cache.settings import CacheSettings, MemoryStoreSettings


class StoreKeepsNothing(ValueError):
    """Writing to this store from a command would be lost when the command ends."""


@contextlib.asynccontextmanager
async def opened(settings: CacheSettings, *, writes: bool = False) -> AsyncIterator[SemanticCache]:
    """The cache ``settings`` describe, started (its index rebuilt from the store) and
    closed after. With ``writes``, a memory store without a snapshot is refused: it
    lives in this process, and what was written would be gone when the command ends."""
    store = settings.store
    if writes and isinstance(store, MemoryStoreSettings) and store.snapshot is None:
        raise StoreKeepsNothing(
            "the memory store keeps nothing after this command ends: set "
            "cache.store.snapshot, use the redis store, or POST the file to a running "
            "gateway's /admin/cache/warmup"
        )
    cache = SemanticCache(settings, create_store(settings))
    await cache.start()
    try:
        yield cache
    finally:
        await cache.close()
