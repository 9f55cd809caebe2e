"""The Redis store against real Redis: the shared one on 6379 (a key prefix per test),
and redis-server processes of our own where a test kills Redis."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import msgspec
import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from cache.entry import CacheEntry
from cache.redis_store import RedisStore
from cache.settings import RedisStoreSettings
from cache.store import Change, Deleted, Invalidated, Put, Resync, StoreUnavailable
from tests.support import free_port

URL = "redis://127.0.0.1:6379/0"


def entry(
    id_: int, namespace: str = "ns", *, expires_at: float | None = None, vector: bytes = b""
) -> CacheEntry:
    return CacheEntry(
        id=id_,
        namespace=namespace,
        prompt=f"question {id_}",
        response=f"answer {id_} ✓",
        model="small",
        tier="easy",
        confidence=0.875,
        created_at=1_700_000_000.125,
        expires_at=expires_at,
        completion_tokens=12,
        vector=vector or bytes(range(256)) + b"\x00\xff",
    )


async def eventually(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout_s}s: {what}")
        await asyncio.sleep(0.01)


class Follower:
    """Collects what a store's ``changes()`` yields, in the background."""

    def __init__(self, store: RedisStore) -> None:
        self.seen: list[Change] = []
        self.task = asyncio.create_task(self._follow(store))

    async def _follow(self, store: RedisStore) -> None:
        async for change in store.changes():
            self.seen.append(change)

    async def wait_for(self, change: Change, timeout_s: float = 1.0) -> None:
        await eventually(lambda: change in self.seen, timeout_s, f"{change!r} arrives")

    async def stop(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


class RedisServer:
    """A redis-server of our own, without persistence, to kill and restart."""

    def __init__(self, port: int, directory: Path) -> None:
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self._directory = directory
        self._process: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        options = ["--port", str(self.port), "--bind", "127.0.0.1"]
        options += ["--save", "", "--appendonly", "no"]  # a restart comes back empty
        self._process = await asyncio.create_subprocess_exec(
            "redis-server",
            *options,
            cwd=self._directory,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        client = Redis.from_url(self.url, socket_connect_timeout=0.1)
        try:
            deadline = time.monotonic() + 5
            while True:
                try:
                    await client.ping()
                    return
                except RedisConnectionError:
                    if time.monotonic() > deadline or self._process.returncode is not None:
                        raise
                    await asyncio.sleep(0.02)
        finally:
            await client.aclose()

    async def kill(self) -> None:
        if self._process is not None and self._process.returncode is None:
            self._process.kill()
            await self._process.wait()


@pytest.fixture
async def raw() -> AsyncIterator[Redis]:
    client = Redis.from_url(URL)
    yield client
    await client.aclose()


@pytest.fixture
async def prefix(raw: Redis) -> AsyncIterator[str]:
    prefix = f"test-redis-store-{uuid.uuid4().hex}"
    yield prefix
    keys = [key async for key in raw.scan_iter(match=f"{prefix}*")]
    if keys:
        await raw.unlink(*keys)


@pytest.fixture
async def store(prefix: str) -> AsyncIterator[RedisStore]:
    # Tests that are not about outages allow a busy CPU more than the 0.25 s that
    # production fails over in: a slow round trip here is not what they test.
    store = RedisStore(RedisStoreSettings(url=URL, key_prefix=prefix, timeout_s=5.0))
    await store.start()
    yield store
    await store.close()


async def replica(prefix: str, *, stream_max_len: int = 100_000) -> RedisStore:
    store = RedisStore(
        RedisStoreSettings(url=URL, key_prefix=prefix, stream_max_len=stream_max_len, timeout_s=5.0)
    )
    await store.start()
    return store


# -- entries ------------------------------------------------------------------------


async def test_put_get_roundtrip_keeps_every_field(store: RedisStore) -> None:
    expiring = entry(1, expires_at=time.time() + 60)
    lasting = entry(2, vector=b"\x00\x3c" * 384)  # 384 float16 ones
    assert await store.put([expiring, lasting]) == []
    assert await store.get("ns", 1) == expiring
    assert await store.get("ns", 2) == lasting
    assert await store.get("ns", 3) is None
    assert await store.get("other", 1) is None
    assert await store.get_many("ns", [2, 3, 1]) == [lasting, None, expiring]
    assert await store.get_many("ns", []) == []


async def test_layout_one_hash_per_entry_with_redis_expiry(
    store: RedisStore, raw: Redis, prefix: str
) -> None:
    expires_at = time.time() + 60
    await store.put([entry(7, "t:m:abc", expires_at=expires_at), entry(8, "t:m:abc")])
    key = f"{prefix}:{{t:m:abc}}:7"
    assert await raw.type(key) == b"hash"
    fields = await raw.hgetall(key)
    assert fields[b"id"] == b"7"
    assert fields[b"confidence"] == b"0.875"
    assert fields[b"completion_tokens"] == b"12"
    assert fields[b"vector"] == entry(7).vector
    assert float(fields[b"expires_at"]) == expires_at
    assert 59_000 < await raw.pttl(key) <= 60_000
    lasting = await raw.hgetall(f"{prefix}:{{t:m:abc}}:8")
    assert b"expires_at" not in lasting
    # Never reported wrong: no hit_floor field, which a replica of an earlier version
    # would not know. Reported: the floor is kept and read back.
    assert b"hit_floor" not in lasting
    reported = msgspec.structs.replace(entry(8, "t:m:abc"), hit_floor=0.975)
    await store.put([reported])
    assert (await raw.hgetall(f"{prefix}:{{t:m:abc}}:8"))[b"hit_floor"] == b"0.975"
    assert await store.get("t:m:abc", 8) == reported
    assert await raw.pttl(f"{prefix}:{{t:m:abc}}:8") == -1
    assert await raw.type(f"{prefix}:changes") == b"stream"


async def test_ttl_is_redis_expiry(store: RedisStore, raw: Redis, prefix: str) -> None:
    await store.put([entry(1, expires_at=time.time() + 0.3), entry(2)])
    assert await store.get("ns", 1) is not None
    await asyncio.sleep(0.5)
    assert await store.get("ns", 1) is None
    assert not await raw.exists(f"{prefix}:{{ns}}:1")  # gone from Redis, not just hidden
    assert await store.get("ns", 2) is not None


async def test_an_entry_already_expired_is_not_written(
    store: RedisStore, raw: Redis, prefix: str
) -> None:
    assert await store.put([entry(1, expires_at=time.time() - 1)]) == []
    assert not await raw.exists(f"{prefix}:{{ns}}:1")


async def test_put_replaces_the_whole_entry(store: RedisStore) -> None:
    await store.put([entry(1, expires_at=time.time() + 60)])
    await store.put([entry(1)])
    assert await store.get("ns", 1) == entry(1)  # expires_at did not linger


async def test_delete(store: RedisStore) -> None:
    await store.put([entry(1), entry(2)])
    assert await store.delete("ns", 1) is True
    assert await store.delete("ns", 1) is False
    assert await store.get("ns", 1) is None
    assert await store.get("ns", 2) is not None


async def test_invalidate_one_namespace_leaves_the_others(store: RedisStore) -> None:
    # Glob specials and braces in namespaces must not widen the match.
    namespaces = ["a*", "ab", "a*}:b", "[a]", "a", "a\\", "a?"]
    await store.put([entry(i * 10 + j, ns) for i, ns in enumerate(namespaces) for j in (1, 2)])
    assert await store.invalidate("a*") == 2
    assert await store.invalidate("[a]") == 2
    assert await store.invalidate("nothing here") == 0
    left = sorted(e.namespace for e in [e async for e in store.entries()])
    assert left == sorted(ns for ns in namespaces if ns not in ("a*", "[a]") for _ in (1, 2))


async def test_invalidate_all_spares_other_prefixes(store: RedisStore, prefix: str) -> None:
    # A prefix that starts with ours, as another deployment's might.
    other = await replica(f"{prefix}-other")
    try:
        await store.put([entry(1, "x"), entry(2, "y")])
        await other.put([entry(1, "x")])
        assert await store.invalidate(None) == 2
        assert [e async for e in store.entries()] == []
        assert await other.get("x", 1) is not None
    finally:
        await other.close()


async def test_entries_yields_everything_once(store: RedisStore) -> None:
    entries = [entry(i, f"ns{i % 3}") for i in range(1200)]  # several SCAN batches
    for start in range(0, len(entries), 400):
        await store.put(entries[start : start + 400])
    seen = [e async for e in store.entries()]
    assert len(seen) == len(entries)
    assert sorted(seen, key=lambda e: e.id) == entries
    stats = await store.stats()
    assert (stats.kind, stats.entries, stats.available) == ("redis", 1200, True)
    assert stats.bytes is not None and stats.bytes > 0


@pytest.mark.parametrize(
    ("garbage", "dropped"),
    [
        ({b"id": b"not a number"}, []),
        ({}, [b"prompt"]),
        ({b"surprise": b"field"}, []),
        ({b"confidence": b" 0.5"}, []),  # float() would take it; the store does not
        ({b"confidence": b"nan"}, []),
        ({b"created_at": b"1e999"}, []),  # inf
        ({b"expires_at": b"soon"}, []),
        ({b"prompt": b"\xff\xfe"}, []),  # not UTF-8
        ({b"id": b"2"}, []),  # another entry's id under this key
    ],
)
async def test_a_corrupted_hash_is_absent(
    store: RedisStore,
    raw: Redis,
    prefix: str,
    garbage: dict[bytes, bytes],
    dropped: list[bytes],
) -> None:
    await store.put([entry(1), entry(2)])
    key = f"{prefix}:{{ns}}:1"
    if garbage:
        await raw.hset(key, mapping=garbage)  # type: ignore[arg-type]
    if dropped:
        await raw.hdel(key, *dropped)
    assert await store.get("ns", 1) is None
    assert await store.get_many("ns", [1, 2]) == [None, entry(2)]
    assert [e async for e in store.entries()] == [entry(2)]


async def test_keys_that_are_not_entries_are_skipped(
    store: RedisStore, raw: Redis, prefix: str
) -> None:
    await store.put([entry(2)])
    await raw.set(f"{prefix}:{{ns}}:1", "a string, not a hash")
    await raw.hset(f"{prefix}:{{ns}}:not-an-id", mapping={"id": "3"})
    assert await store.get("ns", 1) is None
    assert [e async for e in store.entries()] == [entry(2)]
    assert (await store.stats()).entries == 2  # the string counts; only Redis knows it


# -- replicas -----------------------------------------------------------------------


async def test_changes_reach_the_other_replica_not_the_announcer(prefix: str) -> None:
    a = await replica(prefix)
    await a.put([entry(99)])  # before b starts: not b's news
    b = await replica(prefix)
    follow_a, follow_b = Follower(a), Follower(b)
    try:
        put = entry(1, expires_at=time.time() + 60)
        await a.put([put])
        await follow_b.wait_for(Put(put))
        await a.delete("ns", 1)
        await follow_b.wait_for(Deleted("ns", 1))
        await a.invalidate("ns")
        await follow_b.wait_for(Invalidated("ns"))
        await a.invalidate(None)
        await follow_b.wait_for(Invalidated(None))
        assert follow_b.seen == [Put(put), Deleted("ns", 1), Invalidated("ns"), Invalidated(None)]
        # b's change comes after a's own on the stream: once a has it, a has read past
        # its own and skipped them.
        await b.put([entry(2)])
        await follow_a.wait_for(Put(entry(2)))
        assert follow_a.seen == [Put(entry(2))]
    finally:
        await follow_a.stop()
        await follow_b.stop()
        await a.close()
        await b.close()


async def test_changes_stop_when_the_store_closes(store: RedisStore) -> None:
    follower = Follower(store)
    await asyncio.sleep(0.1)  # blocked in XREAD by now
    started = time.monotonic()
    await store.close()
    await asyncio.wait_for(follower.task, 0.5)
    assert time.monotonic() - started < 0.5


@pytest.mark.parametrize("changes_before", [0, 1], ids=["new-stream", "old-stream"])
async def test_a_trimmed_stream_resyncs(prefix: str, changes_before: int) -> None:
    a = await replica(prefix, stream_max_len=100)
    await a.put([entry(1000 + i) for i in range(changes_before)])
    b = await replica(prefix, stream_max_len=100)
    try:
        for start in range(0, 400, 100):  # b is not reading yet: it falls behind
            await a.put([entry(i) for i in range(start, start + 100)])
        follow_b = Follower(b)
        await follow_b.wait_for(Resync())
        await a.put([entry(2000)])
        await follow_b.wait_for(Put(entry(2000)))
        assert follow_b.seen == [Resync(), Put(entry(2000))]
        await follow_b.stop()
    finally:
        await a.close()
        await b.close()


async def test_a_stream_recreated_under_the_follower_resyncs(prefix: str, raw: Redis) -> None:
    a = await replica(prefix)
    await a.put([entry(1)])
    b = await replica(prefix)
    follow_b = Follower(b)
    try:
        await raw.unlink(f"{prefix}:changes")  # as a FLUSHALL would
        await a.put([entry(2)])
        await a.put([entry(3)])
        await follow_b.wait_for(Resync())
        await a.put([entry(4)])
        await follow_b.wait_for(Put(entry(4)))
        assert follow_b.seen[-1] == Put(entry(4))
    finally:
        await follow_b.stop()
        await a.close()
        await b.close()


# -- outages ------------------------------------------------------------------------


async def test_an_outage_fails_fast_and_ends_with_a_resync(tmp_path: Path) -> None:
    server = RedisServer(free_port(), tmp_path)
    await server.start()
    settings = RedisStoreSettings(url=server.url, timeout_s=0.25, retry_interval_s=0.5)
    store = RedisStore(settings)
    await store.start()
    follower = Follower(store)
    try:
        await store.put([entry(1)])
        assert await store.get("ns", 1) == entry(1)

        await server.kill()
        started = time.monotonic()
        with pytest.raises(StoreUnavailable):  # (entry 1 may still be in the near cache)
            await store.get("ns", 2)
        assert time.monotonic() - started < 0.3
        started = time.monotonic()
        for _ in range(100):  # within retry_interval_s: refused without the network
            with pytest.raises(StoreUnavailable):
                await store.put([entry(2)])
        assert time.monotonic() - started < 0.05
        assert not (await store.stats()).available
        assert store.outages == 1
        assert store.unavailable_calls >= 101
        await asyncio.sleep(0.6)  # the next call tries again, and fails again
        with pytest.raises(StoreUnavailable):
            await store.get("ns", 1)
        assert store.outages == 1

        await server.start()
        answer: list[CacheEntry | None] = []

        async def get_again() -> None:
            with contextlib.suppress(StoreUnavailable):
                answer.append(await store.get("ns", 1))

        deadline = time.monotonic() + 2
        while not answer and time.monotonic() < deadline:
            await get_again()
            await asyncio.sleep(0.05)
        assert answer == [None]  # answered: without persistence the entry is gone
        await follower.wait_for(Resync(), timeout_s=2)
        assert store.outages == 1
        await store.put([entry(3)])
        assert await store.get("ns", 3) == entry(3)
    finally:
        await follower.stop()
        await store.close()
        await server.kill()


async def test_starts_without_redis_and_resyncs_when_it_comes(tmp_path: Path) -> None:
    server = RedisServer(free_port(), tmp_path)  # nothing listens there yet
    store = RedisStore(RedisStoreSettings(url=server.url, retry_interval_s=0.2))
    started = time.monotonic()
    await store.start()
    assert time.monotonic() - started < 0.5
    assert store.outages == 1
    follower = Follower(store)
    try:
        with pytest.raises(StoreUnavailable):
            await store.get("ns", 1)
        with pytest.raises(StoreUnavailable):
            async for _ in store.entries():
                pass
        assert follower.seen == []
        await server.start()
        await follower.wait_for(Resync(), timeout_s=2)  # its probe found Redis back
        await store.put([entry(1)])
        assert await store.get("ns", 1) == entry(1)
        assert store.outages == 1
    finally:
        await follower.stop()
        await store.close()
        await server.kill()


async def test_a_slow_redis_is_an_outage_too(tmp_path: Path) -> None:
    server = RedisServer(free_port(), tmp_path)
    await server.start()
    store = RedisStore(RedisStoreSettings(url=server.url, timeout_s=0.1, retry_interval_s=0.2))
    await store.start()
    admin = Redis.from_url(server.url)
    try:
        await store.put([entry(1)])
        await admin.client_pause(500)  # Redis holds every client's commands for 0.5 s
        started = time.monotonic()
        with pytest.raises(StoreUnavailable):
            await store.get("ns", 1)
        assert time.monotonic() - started < 0.2  # timeout_s, not the pause
        assert store.outages == 1
        await asyncio.sleep(0.6)
        assert await store.get("ns", 1) == entry(1)
        assert store.outages == 1
    finally:
        await admin.aclose()
        await store.close()
        await server.kill()


async def test_a_sentinel_url_finds_the_master(tmp_path: Path) -> None:
    """``redis+sentinel://`` asks a real Redis Sentinel where the master is."""
    master = RedisServer(free_port(), tmp_path)
    await master.start()
    sentinel_port = free_port()
    conf = tmp_path / "sentinel.conf"
    conf.write_text(
        f"port {sentinel_port}\nbind 127.0.0.1\nsentinel monitor cache 127.0.0.1 {master.port} 1\n"
    )
    sentinel = await asyncio.create_subprocess_exec(
        "redis-server", str(conf), "--sentinel", cwd=tmp_path,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    url = f"redis+sentinel://127.0.0.1:{sentinel_port}/cache"
    store = RedisStore(RedisStoreSettings(url=url, key_prefix="sentinel", timeout_s=1.0))
    try:
        await eventually(lambda: sentinel_answers(sentinel_port), 5.0, "sentinel answers")
        await store.start()
        stored = entry(7)
        await store.put([stored])
        assert await store.get("ns", 7) == stored
        direct = Redis.from_url(master.url)
        assert await direct.exists("sentinel:{ns}:7") == 1
        await direct.aclose()
    finally:
        await store.close()
        sentinel.kill()
        await sentinel.wait()
        await master.kill()


def sentinel_answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as connection:
            connection.sendall(b"PING\r\n")
            return connection.recv(16).startswith(b"+PONG")
    except OSError:
        return False
