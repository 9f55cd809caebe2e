"""An entry's floor (raised by reports of wrong semantic hits) on every store: raised
in one atomic step that never brings a deleted entry back, kept when the entry is
written again, and heard by the other replicas (issue 32, findings 3, 4 and 6)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from cache.memory_store import MemoryStore
from cache.redis_store import RedisStore
from cache.settings import MemoryStoreSettings, RedisStoreSettings
from cache.store import CacheStore, FloorChange, FloorRaised
from tests.test_redis_store import URL, Follower, entry


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[CacheStore]:
    if request.param == "memory":
        memory = MemoryStore(MemoryStoreSettings(snapshot=None))
        await memory.start()
        yield memory
        await memory.close()
        return
    prefix = f"test-floors-{uuid.uuid4().hex}"
    redis = RedisStore(RedisStoreSettings(url=URL, key_prefix=prefix, timeout_s=5.0))
    await redis.start()
    yield redis
    await redis.close()
    await _forget(prefix)


async def _forget(prefix: str) -> None:
    raw = Redis.from_url(URL)
    keys = [key async for key in raw.scan_iter(match=f"{prefix}*")]
    if keys:
        await raw.unlink(*keys)
    await raw.aclose()


async def test_a_floor_only_rises(store: CacheStore) -> None:
    await store.put([entry(1)])
    assert await store.raise_floor("ns", 1, 0.9) == FloorChange(0.9, raised=True)
    # A replayed report, or a lower one, changes nothing and says so.
    assert await store.raise_floor("ns", 1, 0.9) == FloorChange(0.9, raised=False)
    assert await store.raise_floor("ns", 1, 0.5) == FloorChange(0.9, raised=False)
    assert await store.raise_floor("ns", 1, 0.95) == FloorChange(0.95, raised=True)
    stored = await store.get("ns", 1)
    assert stored is not None and stored.hit_floor == 0.95
    assert stored.response == entry(1).response  # the rest as it was


async def test_writing_an_entry_again_keeps_its_floor(store: CacheStore) -> None:
    """A fresh answer to the same prompt (a client's no-cache) undoes no report."""
    await store.put([entry(2, expires_at=time.time() + 60)])
    await store.raise_floor("ns", 2, 0.97)
    await store.put([entry(2)])
    again = await store.get("ns", 2)
    assert again is not None and again.hit_floor == 0.97 and again.expires_at is None


async def test_a_report_never_brings_a_deleted_entry_back(store: CacheStore) -> None:
    await store.put([entry(3), entry(4, "other")])
    await store.delete("ns", 3)
    assert await store.raise_floor("ns", 3, 0.9) is None
    assert await store.get("ns", 3) is None
    await store.invalidate("other")
    assert await store.raise_floor("other", 4, 0.9) is None
    assert await store.get("other", 4) is None
    assert [e async for e in store.entries()] == []
    # Nor one that was never there, nor one of another namespace.
    await store.put([entry(5)])
    assert await store.raise_floor("elsewhere", 5, 0.9) is None


async def test_a_raised_floor_reaches_the_other_replica() -> None:
    prefix = f"test-floors-{uuid.uuid4().hex}"
    settings = RedisStoreSettings(url=URL, key_prefix=prefix, timeout_s=5.0)
    a, b = RedisStore(settings), RedisStore(settings)
    await a.start()
    await b.start()
    follow_b = Follower(b)
    try:
        await a.put([entry(6)])
        held = await b.get("ns", 6)  # b's near cache now holds it, floorless
        assert held is not None and held.hit_floor is None
        await a.raise_floor("ns", 6, 0.9)
        await follow_b.wait_for(FloorRaised("ns", 6, 0.9))
        now = await b.get("ns", 6)
        assert now is not None and now.hit_floor == 0.9
        # A replica's write of the entry keeps the floor in its own near cache too.
        await b.put([entry(6)])
        rewritten = b.peek("ns", 6)
        assert rewritten is not None and rewritten.hit_floor == 0.9
    finally:
        await follow_b.stop()
        await a.close()
        await b.close()
        await _forget(prefix)


async def test_a_corrupted_floor_neither_blocks_writes_nor_reports() -> None:
    prefix = f"test-floors-{uuid.uuid4().hex}"
    store = RedisStore(RedisStoreSettings(url=URL, key_prefix=prefix, timeout_s=5.0))
    await store.start()
    raw = Redis.from_url(URL)
    try:
        await store.put([entry(7)])
        await raw.hset(f"{prefix}:{{ns}}:7", "hit_floor", "not a number")
        await store.put([entry(7)])  # written again, the bad floor dropped
        assert await raw.hget(f"{prefix}:{{ns}}:7", "hit_floor") is None
        await raw.hset(f"{prefix}:{{ns}}:7", "hit_floor", "nan-ish")
        assert await store.raise_floor("ns", 7, 0.9) == FloorChange(0.9, raised=True)
    finally:
        await raw.aclose()
        await store.close()
        await _forget(prefix)
