"""The near cache: its bound and its coherence rules alone, then in front of real Redis,
where replicas change entries under one another."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
from redis.asyncio import Redis

from cache.near import ENTRY_OVERHEAD, NearCache, entry_bytes
from cache.redis_store import RedisStore
from cache.settings import RedisStoreSettings
from cache.store import Put
from tests.support import free_port
from tests.test_redis_store import URL, Follower, RedisServer, entry, eventually


def test_kept_entries_are_bounded_in_bytes_oldest_used_first_out() -> None:
    size = entry_bytes(entry(1))
    assert size == ENTRY_OVERHEAD + len("question 1") + len("answer 1 ✓") + 258
    near = NearCache(max_bytes=3 * size)
    for id_ in (1, 2, 3):
        near.wrote([entry(id_)])
    assert near.get("ns", 1) == entry(1)  # now the most recently used
    near.wrote([entry(4)])
    assert near.get("ns", 2) is None
    assert [near.get("ns", i) is not None for i in (1, 3, 4)] == [True, True, True]
    stats = near.stats()
    assert (stats.entries, stats.bytes, stats.evictions) == (3, 3 * size, 1)
    assert (stats.hits, stats.misses) == (4, 1)


def test_an_entry_larger_than_the_bound_is_not_kept() -> None:
    near = NearCache(max_bytes=ENTRY_OVERHEAD)
    near.wrote([entry(1)])
    assert near.get("ns", 1) is None
    assert near.stats().bytes == 0


def test_another_namespace_and_expired_entries_are_misses() -> None:
    near = NearCache(max_bytes=1 << 20)
    near.wrote([entry(1), entry(2, expires_at=time.time() - 1)])
    assert near.get("other", 1) is None
    assert near.get("ns", 2) is None
    assert near.stats().entries == 1  # the expired one dropped when met


def test_a_read_overtaken_by_a_change_is_not_kept() -> None:
    near = NearCache(max_bytes=1 << 20)
    read_at = near.generation
    near.changed(1)  # another replica's delete arrived while the read was in flight
    near.fill(entry(1), read_at)
    near.fill(entry(2), read_at)  # a change to another entry does not matter
    assert near.get("ns", 1) is None
    assert near.get("ns", 2) == entry(2)


def test_a_read_overtaken_by_an_invalidation_or_too_many_changes_is_not_kept() -> None:
    near = NearCache(max_bytes=1 << 20)
    read_at = near.generation
    near.changed_scope("elsewhere")
    near.fill(entry(1), read_at)
    assert near.get("ns", 1) is None
    read_at = near.generation
    for id_ in range(100, 5000):  # more than the changes it remembers
        near.changed(id_)
    near.fill(entry(2), read_at)
    assert near.get("ns", 2) is None
    read_at = near.generation
    near.fill(entry(3), read_at)
    assert near.get("ns", 3) == entry(3)


def test_an_invalidation_drops_its_scope_only() -> None:
    near = NearCache(max_bytes=1 << 20)
    near.wrote([entry(1, "acme:small:x"), entry(2, "acme:large:y"), entry(3, "other:small:z")])
    near.changed_scope("acme:small")
    assert near.get("acme:small:x", 1) is None
    assert near.get("acme:large:y", 2) is not None
    near.changed_scope("acme")
    assert near.get("acme:large:y", 2) is None
    assert near.get("other:small:z", 3) is not None
    near.changed_scope(None)
    assert near.stats().entries == 0


# -- in front of Redis ----------------------------------------------------------------


@pytest.fixture
async def prefix() -> AsyncIterator[str]:
    prefix = f"test-near-{uuid.uuid4().hex}"
    yield prefix
    raw = Redis.from_url(URL)
    keys = [key async for key in raw.scan_iter(match=f"{prefix}*")]
    if keys:
        await raw.unlink(*keys)
    await raw.aclose()


async def replica(prefix: str, url: str = URL, retry_interval_s: float = 1.0) -> RedisStore:
    settings = RedisStoreSettings(
        url=url, key_prefix=prefix, timeout_s=5.0, retry_interval_s=retry_interval_s
    )
    store = RedisStore(settings)
    await store.start()
    return store


async def test_only_a_followed_store_answers_from_memory(prefix: str) -> None:
    store = await replica(prefix)
    try:
        await store.put([entry(1)])
        assert store.peek("ns", 1) is None  # nobody follows the stream: not coherent
        follower = Follower(store)
        await eventually(lambda: store.peek("ns", 1) is not None, 1.0, "the near cache serves")
        assert store.peek("ns", 1) == entry(1)
        await follower.stop()
        assert store.peek("ns", 1) is None
    finally:
        await store.close()


async def test_a_read_fills_it_and_the_next_needs_no_round_trip(prefix: str) -> None:
    writer, reader = await replica(prefix), await replica(prefix)
    follower = Follower(reader)
    try:
        await writer.put([entry(1)])
        await follower.wait_for(Put(entry(1)))  # which drops any copy the reader had
        assert await reader.get("ns", 1) == entry(1)
        assert reader.peek("ns", 1) == entry(1)
        raw = Redis.from_url(URL)
        await raw.unlink(f"{prefix}:{{ns}}:1")  # behind the stores' backs: not announced
        await raw.aclose()
        assert await reader.get("ns", 1) == entry(1)  # from memory: Redis was not asked
        stats = reader.near_stats()
        assert stats is not None and stats.hits >= 2
    finally:
        await follower.stop()
        await writer.close()
        await reader.close()


async def test_another_replicas_changes_reach_it_within_the_streams_bound(prefix: str) -> None:
    a, b = await replica(prefix), await replica(prefix)
    follow_a, follow_b = Follower(a), Follower(b)
    try:
        first = entry(1)
        await a.put([first])
        await follow_b.wait_for(Put(first))
        assert await b.get("ns", 1) == first
        assert b.peek("ns", 1) == first

        # A new answer for the same entry: b drops its copy and reads the new one.
        second = msgspec.structs.replace(first, response="a newer answer")
        started = time.monotonic()
        await a.put([second])
        await follow_b.wait_for(Put(second))
        assert b.peek("ns", 1) is None
        assert await b.get("ns", 1) == second
        lag_s = time.monotonic() - started

        await a.delete("ns", 1)
        await eventually(lambda: b.peek("ns", 1) is None, 1.0, "b drops a deleted entry")
        assert await b.get("ns", 1) is None

        await a.put([entry(2, "acme:small:x"), entry(3, "other:small:z")])
        await follow_b.wait_for(Put(entry(3, "other:small:z")))
        for id_, namespace in ((2, "acme:small:x"), (3, "other:small:z")):
            assert await b.get(namespace, id_) is not None
        await a.invalidate("acme")
        await eventually(lambda: b.peek("acme:small:x", 2) is None, 1.0, "b drops the scope")
        assert b.peek("other:small:z", 3) is not None
        assert lag_s < 1.0  # one XREAD: the stream's event, not its block timeout
    finally:
        await follow_a.stop()
        await follow_b.stop()
        await a.close()
        await b.close()


async def test_it_does_not_answer_through_an_outage(tmp_path: Path) -> None:
    server = RedisServer(free_port(), tmp_path)
    await server.start()
    store = await replica("near-outage", server.url, retry_interval_s=0.2)
    follower = Follower(store)
    try:
        await store.put([entry(1)])
        await eventually(lambda: store.peek("ns", 1) is not None, 1.0, "the near cache serves")
        await server.kill()
        # The follower's blocked read fails first: another replica may change entries
        # that this one no longer hears of.
        await eventually(lambda: store.peek("ns", 1) is None, 2.0, "it stops answering")
        await server.start()  # empty: it kept nothing
        await eventually(lambda: store.outages == 1 and follower.seen != [], 3.0, "a resync")
        assert await store.get("ns", 1) is None
    finally:
        await follower.stop()
        await store.close()
        await server.kill()
