"""The Redis store: entries shared by every replica, changes announced on a stream.

Layout under ``key_prefix`` (P below):

- ``P:{<namespace>}:<id>``: one hash per entry, a field per ``CacheEntry`` field
  (numbers as decimal text, the vector as raw bytes, ``expires_at`` absent when None),
  expiring through Redis's own expiry. The namespace in braces is a Redis Cluster hash
  tag, so a namespace's entries share a slot.
- ``P:changes``: a stream on which every put, delete and invalidation is announced
  (``origin``: the announcing store, ``change``: the msgpack-encoded ``Change``), so
  each replica's vector index follows the others without a restart.

Redis speeds requests up and must never stop one: every round trip is bounded by
``timeout_s``, and once Redis fails to answer, calls are refused at once (no network)
for ``retry_interval_s`` before one trial call tries again (engines.breaker, opening
at the first failure). An outage is logged once when it begins and once when it
ends, and the change follower asks for a rebuild afterwards, since it may have missed
changes in between.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import secrets
import time
import types
import typing
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, Final, TypeVar
from urllib.parse import urlsplit

import msgspec
from redis.asyncio import BlockingConnectionPool, ConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from cache.entry import CacheEntry
from cache.near import NearCache
from cache.settings import RedisStoreSettings
from cache.store import (
    Change,
    Deleted,
    FloorChange,
    FloorRaised,
    Invalidated,
    NearCacheStats,
    Put,
    Resync,
    StoreStats,
    StoreUnavailable,
    in_scope,
)
from engines.breaker import Breaker, BreakerOpen, Ticket

log = logging.getLogger("satisfice.cache")

_PUT_CHUNK = 32

T = TypeVar("T")

# How long one XREAD waits for news before the follower checks the stream again.
_BLOCK_S: Final = 1.0
# How late the follower's replies may be before Redis counts as unavailable: well over
# a request's timeout_s. A blocked XREAD's reply comes at the end of its block only as
# closely as Redis's timer (hz) and a busy CPU allow; at 0.25 s of slack, replicas
# under saturating load took a late reply for an outage, bypassed the cache for a
# second and turned their near caches off. Requests still find a down Redis within
# timeout_s, and the follower's own connection errors come at once.
_FOLLOWER_TIMEOUT_S: Final = 5.0
# Keys per SCAN round trip (and entries per pipelined HGETALL), events per XREAD.
_BATCH: Final = 500
_BULK_TIMEOUT_S: Final = 10.0
# Errors that mean Redis cannot serve us now, rather than refusing one command. A
# read-only replica (after a failover) cannot take writes until clients move on.
_UNREACHABLE: Final = (RedisConnectionError, RedisTimeoutError, ReadOnlyError, OSError)
# Corrupt keys remembered so that each is logged once, up to this many.
_CORRUPT_LOGGED_MAX: Final = 1000

# Lua: one entry written and announced in one atomic step, keeping the hit_floor its
# reports raised (HSET alone would keep fields the new entry lacks, so it is replaced
# whole). KEYS: the entry, the stream. ARGV: the entry's own floor ("" for none), its
# expiry in ms ("" for none), the stream's bound, origin and change, then its fields.
# Returns the floor kept, or nil. A floor that is no number (a corrupted hash) is dropped
# rather than failing every later write of the entry.
_PUT: Final = """
local kept = redis.call('HGET', KEYS[1], 'hit_floor')
if kept and not tonumber(kept) then kept = false end
if ARGV[1] ~= '' and (not kept or tonumber(ARGV[1]) > tonumber(kept)) then kept = ARGV[1] end
redis.call('UNLINK', KEYS[1])
redis.call('HSET', KEYS[1], unpack(ARGV, 6))
if kept then redis.call('HSET', KEYS[1], 'hit_floor', kept) end
if ARGV[2] ~= '' then redis.call('PEXPIREAT', KEYS[1], ARGV[2]) end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', 'origin', ARGV[4], 'change', ARGV[5])
return kept
"""
# Lua: an entry's hit_floor raised to ARGV[1] if that is higher, never creating the
# entry (a report racing an invalidation must not bring it back). KEYS and the rest of
# ARGV as _PUT's. Returns {floor now, 1 if raised else 0}, or nil for no entry.
_RAISE_FLOOR: Final = """
if redis.call('EXISTS', KEYS[1]) == 0 then return nil end
local now = redis.call('HGET', KEYS[1], 'hit_floor')
if now and tonumber(now) and tonumber(now) >= tonumber(ARGV[1]) then return {now, 0} end
redis.call('HSET', KEYS[1], 'hit_floor', ARGV[1])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', 'origin', ARGV[3], 'change', ARGV[4])
return {ARGV[1], 1}
"""

_INT = re.compile(rb"-?[0-9]+")
_FLOAT = re.compile(rb"-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")
_KEY_ID = re.compile(r"-?[0-9]+")
# Special to Redis's MATCH glob. Braces are literal to it; they are escaped anyway,
# which costs nothing and keeps the hash-tag braces safe whatever the glob dialect.
_GLOB_SPECIAL: Final = frozenset("\\*?[]{}")


class _Field(msgspec.Struct, frozen=True):
    """How one ``CacheEntry`` field is kept in the entry's hash."""

    name: bytes
    kind: type  # int, float, str or bytes
    optional: bool  # None is kept as an absent field


def _entry_fields() -> tuple[_Field, ...]:
    """Derived from ``CacheEntry`` itself, so a field added there is stored too (and
    one of a type the hash cannot hold fails here, at import, not at the first put)."""
    fields = []
    for info in msgspec.structs.fields(CacheEntry):
        kind, optional = info.type, False
        if typing.get_origin(kind) in (types.UnionType, typing.Union):
            args = typing.get_args(kind)
            rest = [a for a in args if a is not type(None)]
            kind, optional = (rest[0] if len(rest) == 1 else None), len(rest) < len(args)
        # A required field that may be None could not be told from a missing one.
        if kind not in (int, float, str, bytes) or (optional and info.required):
            raise TypeError(f"CacheEntry.{info.name}: {info.type} cannot be kept in a hash")
        fields.append(_Field(info.name.encode(), kind, optional))
    return tuple(fields)


_FIELDS: Final = _entry_fields()
_FIELDS_BY_NAME: Final = {f.name: f for f in _FIELDS}


def _encode_value(value: object) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, int | float) and not isinstance(value, bool):
        return repr(value).encode()  # repr: the shortest text that reads back exactly
    raise TypeError(f"cannot keep {type(value).__name__} in a hash field")


def _encode_entry(entry: CacheEntry) -> dict[bytes, bytes]:
    values = ((f.name, getattr(entry, f.name.decode())) for f in _FIELDS)
    return {name: _encode_value(value) for name, value in values if value is not None}


def _decode_value(kind: type, raw: bytes) -> object:
    """Strictly: ``int()`` and ``float()`` alone would take spaces, underscores, nan,
    and a number too large for a float becomes inf."""
    if kind is bytes:
        return raw
    if kind is str:
        return raw.decode()
    if kind is int and _INT.fullmatch(raw):
        return int(raw)
    if kind is float and _FLOAT.fullmatch(raw) and math.isfinite(number := float(raw)):
        return number
    raise ValueError(f"{raw[:40]!r} is not a {kind.__name__}")


def _decode_entry(raw: Mapping[bytes, bytes]) -> CacheEntry:
    """The entry a hash holds; ValueError or msgspec.ValidationError if it holds
    anything else."""
    values: dict[str, object] = {}
    for name, value in raw.items():
        field = _FIELDS_BY_NAME.get(name)
        if field is None:
            raise ValueError(f"unknown field {name[:40]!r}")
        values[field.name.decode()] = _decode_value(field.kind, value)
    return msgspec.convert(values, CacheEntry)  # missing required fields raise here


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in _GLOB_SPECIAL else c for c in text)


class _StreamId(msgspec.Struct, frozen=True, order=True):
    """A stream entry id, ordered as Redis orders them."""

    ms: int
    seq: int

    @classmethod
    def parse(cls, raw: bytes | str) -> _StreamId:
        text = raw.decode() if isinstance(raw, bytes) else raw
        ms, _, seq = text.partition("-")
        return cls(int(ms), int(seq or 0))

    def __str__(self) -> str:
        return f"{self.ms}-{self.seq}"


_STREAM_START: Final = _StreamId(0, 0)


class _StreamState(msgspec.Struct, frozen=True, kw_only=True):
    last_id: _StreamId  # the last id ever generated, even if since trimmed
    first_id: _StreamId | None  # None: the stream is empty
    added: int | None  # entries ever added, trimmed ones included; None before Redis 7.0


class _Event(msgspec.Struct, frozen=True):
    id: _StreamId
    fields: dict[bytes, bytes]


def _stream_state(info: Mapping[str, Any]) -> _StreamState:
    first = info.get("first-entry")
    added = info.get("entries-added")
    return _StreamState(
        last_id=_StreamId.parse(info["last-generated-id"]),
        first_id=None if not first else _StreamId.parse(first[0]),
        added=None if added is None else int(added),
    )


SENTINEL_SCHEME = "redis+sentinel"


def _sentinel(url: str, connection: dict[str, Any]) -> tuple[Sentinel, str]:
    """``redis+sentinel://[:password@]host:port[,host:port...]/service[/db]``: the
    sentinels to ask, and the name of the master they watch."""
    parts = urlsplit(url)
    credentials, _, hosts = parts.netloc.rpartition("@")
    path = [p for p in parts.path.split("/") if p]
    if not hosts or not path:
        raise ValueError(f"{url!r}: expected redis+sentinel://host:port[,host:port]/service[/db]")
    sentinels = []
    for host in hosts.split(","):
        name, _, port = host.rpartition(":")
        sentinels.append((name or host, int(port) if name else 26379))
    password = credentials.partition(":")[2] or None
    # redis-py types Sentinel() from 8.2 on; before that the call is untyped.
    sentinel = Sentinel(  # type: ignore[no-untyped-call, unused-ignore]
        sentinels,
        sentinel_kwargs={"socket_timeout": connection["socket_connect_timeout"]},
        password=password,
        db=int(path[1]) if len(path) > 1 else 0,
    )
    return sentinel, path[0]


def redis_client(url: str, timeout_s: float) -> Redis:
    """A plain client for ``url`` (redis://, rediss:// or redis+sentinel://) that
    fails within ``timeout_s`` rather than retrying: for small side uses of Redis."""
    common: dict[str, Any] = {
        "socket_connect_timeout": timeout_s,
        "socket_timeout": timeout_s,
        "retry": Retry(NoBackoff(), 0),
    }
    if urlsplit(url).scheme == SENTINEL_SCHEME:
        sentinel, service = _sentinel(url, common)
        client: Redis = sentinel.master_for(service, **common)
        return client
    return Redis.from_url(url, **common)


class RedisStore:
    """Entries in Redis, shared by every replica; bounded by Redis's maxmemory."""

    def __init__(self, settings: RedisStoreSettings) -> None:
        self.settings = settings
        # For metrics: outages begun, and calls refused or failed because of them.
        self.outages = 0
        self.unavailable_calls = 0
        self._prefix = settings.key_prefix
        self._stream = f"{settings.key_prefix}:changes"
        self._entries_pattern = _glob_escape(f"{settings.key_prefix}:{{") + "*"
        # Tells this store's own announcements apart on the shared stream.
        self._origin = secrets.token_hex(8).encode()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Change)
        url = urlsplit(settings.url)  # for log lines: host and port, never the password
        self._where = url.netloc.rpartition("@")[2] or url.path
        # No retries inside redis-py: a retry would spend the request's time budget,
        # and the breaker decides when Redis is worth trying again.
        common: dict[str, Any] = {
            "socket_connect_timeout": settings.timeout_s,
            "retry": Retry(NoBackoff(), 0),
            "protocol": 2,  # the reply shapes parsed below are RESP2's
        }
        # The change follower gets its own connections: its XREAD blocks for
        # _BLOCK_S, which must neither hold a pooled connection requests need nor
        # trip their timeout. Two: the next read may start while a cancelled one is
        # still letting go.
        reader = {**common, "max_connections": 2, "socket_timeout": _BLOCK_S + _FOLLOWER_TIMEOUT_S}
        # Scans over every entry (an index rebuild, an invalidation, stats) move far more
        # than a request's lookup: on connections of their own, with a longer limit, so
        # a rebuild under load is neither cut short nor taken for an outage.
        bulk = {**common, "max_connections": 2, "socket_timeout": _BULK_TIMEOUT_S}
        if url.scheme == SENTINEL_SCHEME:
            sentinel, service = _sentinel(settings.url, common)
            self._redis = sentinel.master_for(
                service,
                max_connections=settings.max_connections,
                socket_timeout=settings.timeout_s,
                **common,
            )
            self._reader = sentinel.master_for(service, **reader)
            self._bulk = sentinel.master_for(service, **bulk)
        else:
            # A blocking pool: a burst beyond max_connections waits (within
            # timeout_s) for a connection instead of failing as if Redis were down.
            self._redis = Redis.from_pool(
                BlockingConnectionPool.from_url(
                    settings.url,
                    max_connections=settings.max_connections,
                    timeout=settings.timeout_s,
                    socket_timeout=settings.timeout_s,
                    **common,
                )
            )
            self._reader = Redis.from_pool(ConnectionPool.from_url(settings.url, **reader))
            self._bulk = Redis.from_pool(ConnectionPool.from_url(settings.url, **bulk))
        self._closed = asyncio.Event()
        self._step_in_flight: asyncio.Task[Any] | None = None
        # Where the change follower reads from, and how many entries the stream had
        # had by then (Redis >= 7.0). None: unknown (start() could not reach Redis),
        # so the follower starts with a Resync.
        self._position: _StreamId | None = None
        self._added: int | None = None
        self._breaker = Breaker(failures=1, open_s=settings.retry_interval_s)
        self._down_since = 0.0  # when the outage under way began, for its end's log line
        self._calls_at_outage = 0
        self._resync_needed = False  # an outage happened; the follower owes a Resync
        self._last_refusal = ""
        self._corrupt_logged: set[bytes] = set()
        self._near = NearCache(settings.near_cache_bytes) if settings.near_cache_bytes else None
        self._put_script = self._redis.register_script(_PUT)
        self._floor_script = self._redis.register_script(_RAISE_FLOOR)
        # The near cache answers only while the change follower runs: without it,
        # other replicas' changes would never reach it.
        self._following = False

    # -- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        """Note the change stream's position before the caller rebuilds from
        ``entries()``, so that no change made during the rebuild is missed. Never
        raises for an unreachable Redis: the gateway starts without the cache."""
        try:
            state = await self._call(self._read_stream_state)
        except StoreUnavailable:
            return  # logged as an outage; the follower resyncs once Redis answers
        self._restart_at(state)

    async def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        step = self._step_in_flight
        if step is not None:  # the follower's step: it lets go of its connection first
            step.cancel()
            await asyncio.wait((step,))
        await self._reader.aclose()
        await self._bulk.aclose()
        await self._redis.aclose()

    # -- entries --------------------------------------------------------------------

    def peek(self, namespace: str, id_: int) -> CacheEntry | None:
        """The entry if this process holds it (the near cache), without a round trip."""
        if self._near is None or not self._following or self._resync_needed:
            return None
        return self._near.get(namespace, id_)

    async def get(self, namespace: str, id_: int) -> CacheEntry | None:
        (entry,) = await self.get_many(namespace, [id_])
        return entry

    async def get_many(self, namespace: str, ids: list[int]) -> list[CacheEntry | None]:
        found = [self.peek(namespace, id_) for id_ in ids]
        missing = [i for i, entry in enumerate(found) if entry is None]
        if not missing:
            return found
        read_at = None if self._near is None else self._near.generation
        keys = [self._key(namespace, ids[i]) for i in missing]
        raws = await self._hgetall(keys)
        for i, key, raw in zip(missing, keys, raws, strict=True):
            entry = found[i] = self._entry(key, raw, namespace, ids[i])
            if entry is not None and self._near is not None and read_at is not None:
                self._near.fill(entry, read_at)
        return found

    def near_stats(self) -> NearCacheStats | None:
        return None if self._near is None else self._near.stats()

    async def put(self, entries: list[CacheEntry]) -> list[CacheEntry]:
        """Store and announce the entries, each in one atomic step that keeps the floor
        an earlier report raised; Redis evicts by its own maxmemory policy, so nothing
        is returned as evicted."""
        now = time.time()
        live = [e for e in entries if not e.expired(now)]
        if not live:
            return []

        def write(chunk: list[CacheEntry]) -> Callable[[Redis], Awaitable[list[Any]]]:
            async def run(redis: Redis) -> list[Any]:
                async with redis.pipeline(transaction=False) as pipe:
                    for entry in chunk:
                        fields = _encode_entry(entry)
                        floor = fields.pop(b"hit_floor", b"")
                        expires = (
                            b"" if entry.expires_at is None else b"%d" % (entry.expires_at * 1000)
                        )
                        flat = [value for pair in fields.items() for value in pair]
                        await self._put_script(
                            keys=[self._key(entry.namespace, entry.id), self._stream],
                            args=[floor, expires, *self._announcement(Put(entry)), *flat],
                            client=pipe,
                        )
                    return list(await pipe.execute())

            return run

        # Bulk writes (a warm-up) go in small pipelines: each round trip must fit in
        # timeout_s, which is sized for one request's write-back.
        for start in range(0, len(live), _PUT_CHUNK):
            chunk = live[start : start + _PUT_CHUNK]
            try:
                floors = await self._call(write(chunk))
            except BaseException:
                self._near_changed([e.id for e in chunk])  # written or not: not known
                raise
            if self._near is not None:
                kept = [
                    e if f is None else msgspec.structs.replace(e, hit_floor=float(f))
                    for e, f in zip(chunk, floors, strict=True)
                ]
                self._near.wrote(kept)
        return []

    async def raise_floor(self, namespace: str, id_: int, floor: float) -> FloorChange | None:
        key = self._key(namespace, id_)
        change = FloorRaised(namespace, id_, floor)

        async def run(redis: Redis) -> Any:
            return await self._floor_script(
                keys=[key, self._stream],
                args=[_encode_value(floor), *self._announcement(change)],
                client=redis,
            )

        try:
            reply = await self._call(run)
        finally:  # raised or not, what this replica holds of it is read again
            self._near_changed([id_])
        if reply is None:
            return None
        now, raised = reply
        return FloorChange(float(now), raised=bool(raised))

    async def delete(self, namespace: str, id_: int) -> bool:
        key = self._key(namespace, id_)

        async def unlink(redis: Redis) -> bool:
            async with redis.pipeline(transaction=True) as pipe:
                pipe.unlink(key)
                self._announce(pipe, Deleted(namespace, id_))
                removed, _ = await pipe.execute()
            return int(removed) > 0

        try:
            return await self._call(unlink)
        finally:  # after the unlink: a read begun before it is not kept either
            self._near_changed([id_])

    async def invalidate(self, namespace: str | None) -> int:
        try:
            return await self._invalidate(namespace)
        finally:
            if self._near is not None:
                self._near.changed_scope(namespace)

    async def _invalidate(self, namespace: str | None) -> int:
        if namespace is None:
            pattern = self._entries_pattern
        else:
            pattern = _glob_escape(f"{self._prefix}:{{{namespace}") + "*"
        dropped = 0
        async for keys in self._scan(pattern):
            # The glob's trailing * also takes namespaces that merely start with the
            # selector; the parsed key decides.
            doomed = [
                key
                for key in keys
                if (where := self._parse_key(key)) is not None
                and (namespace is None or in_scope(where[0], namespace))
            ]
            if doomed:
                dropped += await self._unlink(doomed)
        await self._call(lambda redis: self._announce(redis, Invalidated(namespace)))
        return dropped

    async def entries(self) -> AsyncIterator[CacheEntry]:
        async for keys in self._scan(self._entries_pattern):
            located: list[tuple[bytes, tuple[str, int]]] = []
            for key in keys:
                where = self._parse_key(key)
                if where is None:
                    self._corrupt(key, "not an entry key")
                else:
                    located.append((key, where))
            raws = await self._hgetall([key for key, _ in located], bulk=True)
            for (key, (namespace, id_)), raw in zip(located, raws, strict=True):
                entry = self._entry(key, raw, namespace, id_)
                if entry is not None:
                    yield entry

    async def stats(self) -> StoreStats:
        try:
            count = 0
            async for keys in self._scan(self._entries_pattern):
                count += sum(self._parse_key(key) is not None for key in keys)
            memory = await self._call(lambda redis: redis.info("memory"))
        except StoreUnavailable:
            return StoreStats(kind="redis", entries=0, available=False)
        used = memory.get("used_memory")
        return StoreStats(
            kind="redis", entries=count, bytes=used if isinstance(used, int) else None
        )

    # -- changes from other replicas ------------------------------------------------

    async def changes(self) -> AsyncIterator[Change]:
        """What other stores announce, from the position noted at ``start()``, until
        ``close()``. Survives outages: after one it yields ``Resync()``, as it does
        when the stream was trimmed past its position or lost by Redis. One consumer
        at a time: the position is the store's. While it runs, the near cache serves."""
        self._following = True
        try:
            while True:
                try:
                    # Raced against close(), which would otherwise wait out a blocked XREAD.
                    batch = await self._unless_closed(self._next_changes())
                except StoreUnavailable:
                    if not await self._pause(self.settings.retry_interval_s):
                        return
                    continue
                if batch is None:
                    return
                for change in batch:
                    yield change
        finally:
            self._following = False
            if self._near is not None:
                self._near.changed_scope(None)

    async def _next_changes(self) -> list[Change]:
        if self._position is None or self._resync_needed:
            # Doubles as the probe that ends an outage for the follower.
            state = await self._call(self._read_stream_state, reader=True)
            self._resync_needed = False
            return [self._restart_at(state)]
        position = self._position
        reply = await self._call(
            lambda redis: self._xread(redis, position),
            reader=True,
            timeout_s=_BLOCK_S + _FOLLOWER_TIMEOUT_S,
        )
        events = [
            _Event(_StreamId.parse(event_id), fields or {})
            for _, stream_events in reply
            for event_id, fields in stream_events
        ]
        # Read after the events, so that it describes at least what they came from.
        state = await self._call(self._read_stream_state, reader=True)
        reached = events[-1].id if events else position
        added = None if self._added is None else self._added + len(events)
        lost = self._lost(position, reached, added, state)
        if lost:
            log.warning("cache change stream %s %s: rebuilding the index", self._stream, lost)
            return [self._restart_at(state)]
        self._position, self._added = reached, added
        return self._decode(events)

    def _restart_at(self, state: _StreamState | None) -> Resync:
        """Follow from the stream's end as it is now: what came before is in what the
        consumer rebuilds from, which it reads after this (and the near cache from
        the store again)."""
        if self._near is not None:
            self._near.changed_scope(None)
        if state is None:  # no stream yet: it will count from its first change
            self._position, self._added = _STREAM_START, 0
        else:
            self._position, self._added = state.last_id, state.added
        return Resync()

    @staticmethod
    def _lost(
        position: _StreamId, reached: _StreamId, added: int | None, state: _StreamState | None
    ) -> str | None:
        """Why changes after ``position`` may be missing from what was read (up to
        ``reached``, the stream having had ``added`` entries by then), if they may."""
        if state is None:
            return "is gone" if reached > _STREAM_START else None
        # Redis counts every entry ever added: fewer than we have counted means a new
        # stream under the old key.
        had = state.added
        if state.last_id < reached or (had is not None and added is not None and had < added):
            return "was re-created (flushed, or lost by Redis)"
        # Trimming drops the oldest entries (MAXLEN ~ whole nodes of them): if even our
        # position is gone, we are that far behind. (Redis's max-deleted id would be
        # exact, but it follows XDEL only, not trimming.)
        if position > _STREAM_START and state.first_id is not None and state.first_id > position:
            return "was trimmed past our position"
        # Read to the end, yet a different count: some went before we read them.
        if had is not None and added is not None and state.last_id == reached and had != added:
            return "lost changes we had not read"
        return None

    def _decode(self, events: list[_Event]) -> list[Change]:
        changes: list[Change] = []
        for event in events:
            if event.fields.get(b"origin") == self._origin:
                continue
            try:
                change = self._decoder.decode(event.fields[b"change"])
            except (KeyError, msgspec.DecodeError) as exc:
                # A change we cannot read is one we cannot apply: rebuild instead.
                log.warning("undecodable cache change %s (%s): rebuilding", event.id, exc)
                change = Resync()
            self._near_follows(change)
            if not (isinstance(change, Resync) and changes and changes[-1] == change):
                changes.append(change)
        return changes

    def _near_follows(self, change: Change) -> None:
        """Another replica's change drops what it touched here (never replaces it: two
        replicas' writes of one entry arrive in the store's order, and this one's own
        write, which may be the later, is not on the stream it reads)."""
        if self._near is None:
            return
        if isinstance(change, Put):
            self._near.changed(change.entry.id)
        elif isinstance(change, Deleted | FloorRaised):
            self._near.changed(change.id)
        elif isinstance(change, Invalidated):
            self._near.changed_scope(change.namespace)
        else:
            self._near.changed_scope(None)

    def _near_changed(self, ids: list[int]) -> None:
        if self._near is not None:
            for id_ in ids:
                self._near.changed(id_)

    async def _xread(self, redis: Redis, position: _StreamId) -> Any:
        block_ms = int(_BLOCK_S * 1000)
        return await redis.xread({self._stream: str(position)}, _BATCH, block_ms)

    async def _read_stream_state(self, redis: Redis) -> _StreamState | None:
        try:
            info = await redis.xinfo_stream(self._stream)
        except ResponseError as exc:
            if "no such key" in str(exc).lower():
                return None
            raise
        return _stream_state(info)

    def _announce(self, redis: Redis, change: Change) -> Awaitable[Any]:
        fields: dict[str, bytes] = {"origin": self._origin, "change": self._encoder.encode(change)}
        return redis.xadd(
            self._stream,
            fields,  # type: ignore[arg-type]
            maxlen=self.settings.stream_max_len,
            approximate=True,
        )

    def _announcement(self, change: Change) -> list[bytes]:
        """What the scripts add to the stream for ``change``: the stream's length bound,
        this store's origin, the encoded change (as ``_announce`` does)."""
        return [b"%d" % self.settings.stream_max_len, self._origin, self._encoder.encode(change)]

    # -- round trips and the breaker ------------------------------------------------

    async def _call(
        self,
        op: Callable[[Redis], Awaitable[T]],
        *,
        reader: bool = False,
        bulk: bool = False,
        timeout_s: float | None = None,
    ) -> T:
        """One round trip, bounded by ``timeout_s`` (default: the settings', and the
        follower's own _FOLLOWER_TIMEOUT_S for ``reader`` calls), behind the
        breaker: while it is open, callers' calls are refused without touching the
        network; the follower's (``reader``: on its own connection) wait for it."""
        if not reader and self._closed.is_set():
            self.unavailable_calls += 1
            raise StoreUnavailable("the Redis store is closed")
        ticket = await self._admit(reader)
        try:
            limit = timeout_s or (
                _BULK_TIMEOUT_S
                if bulk
                else _FOLLOWER_TIMEOUT_S
                if reader
                else self.settings.timeout_s
            )
            client = self._reader if reader else self._bulk if bulk else self._redis
            async with asyncio.timeout(limit):
                result = await op(client)
        except _UNREACHABLE as exc:
            self._unreachable(ticket, exc, counted=not reader)
            raise StoreUnavailable(f"Redis at {self._where} is unavailable: {exc}") from exc
        except RedisError as exc:
            self._refused(ticket, exc, counted=not reader)
            raise StoreUnavailable(f"Redis refused a command: {exc}") from exc
        except BaseException:
            self._breaker.abandoned(ticket)  # cancelled, or our own error: no verdict
            raise
        self._answered(ticket)
        return result

    async def _admit(self, reader: bool) -> Ticket:
        while True:
            try:
                return self._breaker.admit()
            except BreakerOpen as exc:
                if not reader:
                    self.unavailable_calls += 1
                    raise StoreUnavailable(f"Redis at {self._where} is unavailable") from None
                # The follower has nothing to do without Redis: it waits to try again.
                if not await self._pause(exc.retry_in_s):
                    raise StoreUnavailable("the Redis store is closed") from None

    def _unreachable(self, ticket: Ticket, exc: BaseException, *, counted: bool) -> None:
        if self._closed.is_set():
            self._breaker.abandoned(ticket)  # connections torn down by close(), not an outage
            return
        if counted:
            self.unavailable_calls += 1
        if not self._breaker.failed(ticket):
            return  # a failed trial, or a call from before the outage began
        self._down_since, self._resync_needed = time.monotonic(), True
        self._calls_at_outage = self.unavailable_calls - int(counted)
        self.outages += 1
        log.warning(
            "Redis at %s is unavailable (%s: %s); the cache is bypassed, trying again every %.1fs",
            self._where,
            type(exc).__name__,
            exc,
            self.settings.retry_interval_s,
        )

    def _refused(self, ticket: Ticket, exc: RedisError, *, counted: bool) -> None:
        """Redis answered, with an error (out of memory, a wrong type): not an outage,
        but the call goes on without the cache all the same."""
        if self._closed.is_set():
            self._breaker.abandoned(ticket)
            return
        self._answered(ticket)
        if counted:
            self.unavailable_calls += 1
        message = f"{type(exc).__name__}: {exc}"
        if message != self._last_refusal:  # once per kind of refusal, not per request
            self._last_refusal = message
            log.warning("Redis at %s refused a command: %s", self._where, message)

    def _answered(self, ticket: Ticket) -> None:
        # A call let in before the outage began (the follower's blocking XREAD) says
        # nothing about Redis now: the breaker ignores it. A trial since then does.
        if self._breaker.succeeded(ticket):
            log.info(
                "Redis at %s answers again after %.1fs; %d calls bypassed it meanwhile",
                self._where,
                time.monotonic() - self._down_since,
                self.unavailable_calls - self._calls_at_outage,
            )

    async def _pause(self, seconds: float) -> bool:
        """Sleep, cut short by ``close()``; whether the store is still open."""
        if seconds > 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(seconds):
                    await self._closed.wait()
        return not self._closed.is_set()

    async def _unless_closed(self, work: Awaitable[T]) -> T | None:
        """``work``'s result, or None once ``close()`` is called (``work`` is then
        cancelled, and ``close()`` waits for it to let go of its connection)."""
        task = asyncio.ensure_future(work)
        self._step_in_flight = task
        task.add_done_callback(self._step_done)
        closing = asyncio.ensure_future(self._closed.wait())
        try:
            await asyncio.wait((task, closing), return_when=asyncio.FIRST_COMPLETED)
        finally:
            closing.cancel()
            if not task.done():
                task.cancel()
        if self._closed.is_set():
            return None
        return task.result()

    def _step_done(self, task: asyncio.Task[Any]) -> None:
        if self._step_in_flight is task:
            self._step_in_flight = None
        if not task.cancelled():
            task.exception()  # retrieved here so a read abandoned at close() is not reported

    # -- keys and hashes ------------------------------------------------------------

    def _key(self, namespace: str, id_: int) -> str:
        return f"{self._prefix}:{{{namespace}}}:{id_}"

    def _parse_key(self, key: bytes) -> tuple[str, int] | None:
        """(namespace, id) of an entry key; None for any other key. The id is the
        text after the last "}:", so a namespace may hold any character."""
        head = f"{self._prefix}:{{"
        try:
            text = key.decode()
        except UnicodeDecodeError:
            return None
        if not text.startswith(head):
            return None
        namespace, sep, id_text = text[len(head) :].rpartition("}:")
        if not sep or not _KEY_ID.fullmatch(id_text):
            return None
        return namespace, int(id_text)

    async def _scan(self, pattern: str) -> AsyncIterator[list[bytes]]:
        """Batches of the keys matching ``pattern``, each key once (SCAN may repeat
        a key while Redis rehashes)."""
        seen: set[bytes] = set()
        cursor = 0
        while True:
            cursor, keys = await self._scan_once(cursor, pattern)
            fresh = [key for key in keys if key not in seen]
            seen.update(fresh)
            if fresh:
                yield fresh
            if cursor == 0:
                return

    async def _scan_once(self, cursor: int, pattern: str) -> tuple[int, list[bytes]]:
        reply = await self._call(
            lambda redis: redis.scan(cursor, match=pattern, count=_BATCH), bulk=True
        )
        # Bytes, as the clients do not decode; typed either way by redis-py.
        return int(reply[0]), [k if isinstance(k, bytes) else k.encode() for k in reply[1]]

    async def _unlink(self, keys: list[bytes]) -> int:
        return int(await self._call(lambda redis: redis.unlink(*keys), bulk=True))

    async def _hgetall(self, keys: list[str] | list[bytes], *, bulk: bool = False) -> list[Any]:
        """Each key's hash (empty when absent), or the error Redis answered for it
        (a key of another type): one pipelined round trip."""
        if not keys:
            return []

        async def read(redis: Redis) -> list[Any]:
            async with redis.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.hgetall(key)
                return await pipe.execute(raise_on_error=False)

        return await self._call(read, bulk=bulk)

    def _entry(self, key: str | bytes, raw: Any, namespace: str, id_: int) -> CacheEntry | None:
        """The live entry a hash holds; None, logged, for anything that is not one."""
        if isinstance(raw, Exception):
            self._corrupt(key, str(raw))
            return None
        if not raw:
            return None
        try:
            entry = _decode_entry(raw)
            if entry.namespace != namespace or entry.id != id_:
                raise ValueError("its namespace or id does not match its key")
        except (ValueError, msgspec.ValidationError) as exc:
            self._corrupt(key, str(exc))
            return None
        return None if entry.expired() else entry

    def _corrupt(self, key: str | bytes, why: str) -> None:
        raw_key = key.encode() if isinstance(key, str) else key
        if raw_key in self._corrupt_logged:
            return
        if len(self._corrupt_logged) < _CORRUPT_LOGGED_MAX:
            self._corrupt_logged.add(raw_key)
        log.warning("Redis key %r is not a cache entry, ignored: %s", raw_key[:200], why)
