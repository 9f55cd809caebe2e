"""Semantic cache: exact and semantic lookup with false-hit guards, scoped by namespace.

Keys and namespaces (entry.py), guards (guards.py), the store contract (store.py)
with an in-process store (memory_store.py) and a Redis one shared by replicas
(redis_store.py), lookup and write-back over a store (semantic_cache.py),
coalescing of identical misses (coalesce.py), warm-up from files (warmup.py), how a
configuration does on labelled prompt pairs (pairs.py) and a cache opened outside a
gateway, for the commands (standalone.py).
"""

from __future__ import annotations

from cache.memory_store import MemoryStore
from cache.settings import CacheSettings, MemoryStoreSettings
from cache.store import CacheStore

__all__ = ["create_store"]


def create_store(settings: CacheSettings) -> CacheStore:
    """The store the settings name; the cache starts and closes it."""
    if isinstance(settings.store, MemoryStoreSettings):
        return MemoryStore(settings.store)
    from cache.redis_store import RedisStore  # only configs that use Redis import it

    return RedisStore(settings.store)
