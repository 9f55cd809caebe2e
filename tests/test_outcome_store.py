"""The outcome store: every case across every backend (a file, and a Redis stream on
the shared Redis at 6379 under a key prefix of its own), then what only one has."""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import msgspec
import pytest
from redis.asyncio import Redis
from redis.exceptions import RedisError

from cache.settings import CacheSettings, MemoryStoreSettings, RedisStoreSettings
from cache.store import StoreUnavailable
from gateway.checks.record import CheckRecord
from gateway.checks.store import (
    FileOutcomes,
    OutcomeStore,
    RedisOutcomes,
    create_outcome_store,
)
from gateway.config.shadow import ShadowSettings
from tests.support import free_port

URL = "redis://127.0.0.1:6379/0"
BACKENDS = ["file", "redis"]


def record(i: int, *, tenant: str = "acme", at: float | None = None) -> CheckRecord:
    return CheckRecord(
        id=uuid.uuid4().hex,
        at=1_700_000_000.0 + i if at is None else at,
        source="shadow",
        tenant=tenant,
        request_id=f"req-{i}",
        shortcut="semantic_hit",
        route="semantic",
        model="auto",
        probability=0.05,
        policy="v1",
        prompt=f"question {i} ✓",
        answer=f"answer {i}",
        reference=f"answer {i}",
        agree=True,
        confidence=0.9,
    )


async def redis_up() -> bool:
    client = Redis.from_url(URL, socket_connect_timeout=0.5)
    try:
        return bool(await client.ping())
    except (RedisError, OSError):
        return False
    finally:
        await client.aclose()


class Backend:
    """One place records are kept, and as many store objects on it as a test opens
    (on Redis, each as if another replica's)."""

    def __init__(self, kind: str, tmp_path: Path) -> None:
        self.kind = kind
        self.path = tmp_path / "outcomes" / "checks.jsonl"
        self.prefix = f"test-outcomes-{uuid.uuid4().hex}"
        self.opened: list[OutcomeStore] = []

    def open(self, *, bound: int | None = None) -> OutcomeStore:
        """A store; ``bound``: its size bound, max_bytes or max_records."""
        store: OutcomeStore
        if self.kind == "file":
            store = FileOutcomes(self.path, max_bytes=bound or 1 << 20)
        else:
            store = RedisOutcomes(URL, self.prefix, max_records=bound or 100_000)
        self.opened.append(store)
        return store

    async def corrupt(self) -> None:
        """What a crash mid-write leaves: a torn last line; on Redis, an entry that
        holds no record."""
        if self.kind == "file":
            with self.path.open("ab") as handle:
                handle.write(b'{"id": "torn", "at": 17000')
        else:
            client = Redis.from_url(URL)
            await client.xadd(f"{self.prefix}:outcomes", {"record": b'{"id": "torn", "at"'})
            await client.aclose()

    async def close(self) -> None:
        for store in self.opened:
            await store.close()
        if self.kind == "redis":
            client = Redis.from_url(URL)
            keys = [key async for key in client.scan_iter(match=f"{self.prefix}*")]
            if keys:
                await client.unlink(*keys)
            await client.aclose()


@pytest.fixture(params=BACKENDS)
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    if request.param == "redis" and not await redis_up():
        pytest.skip(
            f"Redis is not answering at {URL}: start it with `redis-server --daemonize yes "
            '--bind 127.0.0.1 --port 6379 --save "" --appendonly no`'
        )
    kept = Backend(request.param, tmp_path)
    yield kept
    await kept.close()


def ids(records: list[CheckRecord]) -> list[str]:
    return [r.request_id or "" for r in records]


# -- every backend ------------------------------------------------------------------


async def test_added_records_read_back_whole_oldest_first(backend: Backend) -> None:
    store = backend.open()
    assert await store.read() == []
    added = [record(2), record(0), record(1, tenant="globex")]
    for r in added:
        await store.add(r)
    assert await store.read() == sorted(added, key=lambda r: r.at)
    assert await backend.open().read() == sorted(added, key=lambda r: r.at)


async def test_read_since_and_by_tenant(backend: Backend) -> None:
    store = backend.open()
    now = time.time()
    for i, (ago, tenant) in enumerate([(7200, "acme"), (1800, "globex"), (60, "acme")]):
        await store.add(record(i, tenant=tenant, at=now - ago))
    assert ids(await store.read(since=now - 3600)) == ["req-1", "req-2"]
    assert ids(await store.read(tenant="acme")) == ["req-0", "req-2"]
    assert ids(await store.read(since=now - 3600, tenant="acme")) == ["req-2"]
    assert await store.read(since=now + 60) == []
    assert await store.read(tenant="initech") == []


async def test_concurrent_adds_keep_every_record_whole(backend: Backend) -> None:
    store = backend.open()
    added = [record(i) for i in range(60)]
    await asyncio.gather(*(store.add(r) for r in added))
    assert sorted(ids(await store.read())) == sorted(ids(added))


async def test_tail_brings_every_replicas_records_once(backend: Backend) -> None:
    one, two = backend.open(), backend.open()
    assert await one.tail() == []  # nothing kept yet
    await one.add(record(0))
    await two.add(record(1))
    assert ids(await one.tail()) == ["req-0", "req-1"]  # its own and the other's
    assert await one.tail() == []
    # A first tail returns everything kept: estimates fed from tail() alone miss
    # nothing from before a restart, and count nothing twice.
    assert ids(await two.tail()) == ["req-0", "req-1"]
    await two.add(record(2))
    await one.add(record(3))
    assert ids(await one.tail()) == ["req-2", "req-3"]
    assert ids(await two.tail()) == ["req-2", "req-3"]
    assert await two.tail() == []


async def test_a_bad_last_record_is_skipped_and_logged(
    backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    store = backend.open()
    await store.add(record(0))
    await backend.corrupt()
    with caplog.at_level(logging.WARNING, logger="satisfice.checks"):
        assert ids(await store.read()) == ["req-0"]
    assert "not a check record" in caplog.text
    # The next record is not swallowed by the torn one.
    await store.add(record(1))
    assert ids(await store.read()) == ["req-0", "req-1"]
    assert ids(await backend.open().tail()) == ["req-0", "req-1"]


async def test_the_store_keeps_about_its_bound_newest_first(backend: Backend) -> None:
    line = len(msgspec.json.encode(record(0))) + 1
    # The file: rotated past 10 lines, one old file kept. Redis: MAXLEN ~ 100 trims
    # whole nodes (100 entries apiece by default), so between 100 and 200 are left.
    bound, count = (10 * line + line // 2, 35) if backend.kind == "file" else (100, 320)
    store = backend.open(bound=bound)
    added = [record(i) for i in range(count)]
    for r in added:
        await store.add(r)
    kept = ids(await store.read())
    limit = 20 if backend.kind == "file" else 200
    assert 10 <= len(kept) <= limit
    assert kept == ids(added)[-len(kept) :]  # the newest, none missing in between


# -- the file -----------------------------------------------------------------------


async def test_the_file_rotates_to_one_old_file(tmp_path: Path) -> None:
    path = tmp_path / "checks.jsonl"
    line = len(msgspec.json.encode(record(0))) + 1
    store = FileOutcomes(path, max_bytes=4 * line)
    for i in range(10):
        await store.add(record(i))
    old = path.with_name("checks.jsonl.1")
    assert path.stat().st_size <= 4 * line and old.stat().st_size <= 4 * line
    assert sorted(os.listdir(tmp_path)) == ["checks.jsonl", "checks.jsonl.1"]
    # 0-3 filled the file, 4 rotated them out, 8 rotated 4-7 out and 0-3 away.
    assert ids(await store.read()) == [f"req-{i}" for i in range(4, 10)]


async def test_the_file_tail_follows_across_a_rotation(tmp_path: Path) -> None:
    line = len(msgspec.json.encode(record(0))) + 1
    writer = FileOutcomes(tmp_path / "checks.jsonl", max_bytes=4 * line)
    reader = FileOutcomes(tmp_path / "checks.jsonl", max_bytes=4 * line)
    seen: list[CheckRecord] = []
    for i in range(14):
        await writer.add(record(i))
        if i % 3 == 2:  # a rotation every 4 records: at most one between tails
            seen += await reader.tail()
    seen += await reader.tail()
    assert ids(seen) == [f"req-{i}" for i in range(14)]


async def test_a_line_being_written_waits_for_the_next_tail(tmp_path: Path) -> None:
    path = tmp_path / "checks.jsonl"
    store = FileOutcomes(path, max_bytes=1 << 20)
    await store.add(record(0))
    whole = msgspec.json.encode(record(1)) + b"\n"
    with path.open("ab") as handle:
        handle.write(whole[:20])
    assert ids(await store.tail()) == ["req-0"]
    with path.open("ab") as handle:
        handle.write(whole[20:])
    assert ids(await store.tail()) == ["req-1"]


async def test_the_file_path_is_expanded_and_its_directory_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    store = FileOutcomes("~/state/satisfice/outcomes.jsonl", max_bytes=1 << 20)
    await store.add(record(0))
    assert (tmp_path / "state" / "satisfice" / "outcomes.jsonl").is_file()
    assert store.where == str(tmp_path / "state" / "satisfice" / "outcomes.jsonl")


async def test_adds_do_not_block_the_event_loop(tmp_path: Path) -> None:
    """A slow disk holds the add, not the loop: another task keeps running meanwhile."""
    store = FileOutcomes(tmp_path / "checks.jsonl", max_bytes=1 << 20)
    slow = store._append

    def append(line: bytes) -> None:
        time.sleep(0.3)
        slow(line)

    store._append = append  # type: ignore[method-assign]
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    ticker = asyncio.create_task(tick())
    await store.add(record(0))
    ticker.cancel()
    assert ticks >= 10
    assert ids(await store.read()) == ["req-0"]


# -- Redis and the choice between them ----------------------------------------------


async def test_unreachable_redis_raises_store_unavailable_naming_it() -> None:
    port = free_port()
    store = RedisOutcomes(f"redis://127.0.0.1:{port}/0", "satisfice", max_records=1000)
    try:
        for call in (store.add(record(0)), store.read(), store.tail()):
            with pytest.raises(StoreUnavailable, match=f"127.0.0.1:{port}.*unavailable"):
                await call
    finally:
        await store.close()


async def test_the_store_is_the_caches_redis_when_the_cache_is_on_redis(tmp_path: Path) -> None:
    shadow = ShadowSettings(outcomes_file=str(tmp_path / "o.jsonl"), stream_max_records=500)
    redis = CacheSettings(store=RedisStoreSettings(url=URL, key_prefix="deploy-7"))
    stores: list[Callable[[], OutcomeStore]] = [
        lambda: create_outcome_store(shadow, redis),
        lambda: create_outcome_store(shadow, CacheSettings(store=MemoryStoreSettings())),
        lambda: create_outcome_store(shadow, None),
    ]
    on_redis, *on_file = (make() for make in stores)
    assert isinstance(on_redis, RedisOutcomes)
    assert (on_redis.key, on_redis.max_records) == ("deploy-7:outcomes", 500)
    for store in on_file:
        assert isinstance(store, FileOutcomes)
        assert store.path == tmp_path / "o.jsonl"
        assert store.max_bytes == shadow.outcomes_max_bytes
        await store.close()
    await on_redis.close()
    assert not (tmp_path / "o.jsonl").exists()  # nothing written until a record is
