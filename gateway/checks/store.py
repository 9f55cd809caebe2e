"""The outcome store: every check's record, kept where every replica can read it.

Two backends, one contract (``OutcomeStore``):

- ``FileOutcomes``: one JSON record per line, appended, rotated to ``<file>.1`` past
  its size bound (one old file kept). For one process, the embedded default: appends
  are serialised within the process, not between processes.
- ``RedisOutcomes``: a stream, ``<key_prefix>:outcomes``, that every replica adds to
  (bounded by an approximate MAXLEN), each record one field of JSON.

``tail()`` is how replicas keep their live estimates in step: it returns what was
added, by any process, since this store object's last ``tail()``; its first call
returns every record the store still holds, so that estimates fed from ``tail()``
alone count each record exactly once, from before a restart too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, BinaryIO, Final, Protocol, TypeVar
from urllib.parse import urlsplit

import msgspec
from redis.asyncio import Redis
from redis.exceptions import RedisError

from cache.redis_store import redis_client
from cache.settings import CacheSettings, RedisStoreSettings
from cache.store import StoreUnavailable
from gateway.checks.record import CheckRecord
from gateway.config.shadow import ShadowSettings

log = logging.getLogger("satisfice.checks")

T = TypeVar("T")

# Records per XRANGE / XREAD round trip.
_CHUNK: Final = 1000
# Checks are written and read in the background, never on a request's path: a round
# trip may take far longer than the cache's request-sized timeout.
_REDIS_TIMEOUT_S: Final = 5.0
# The stream field that holds a record's JSON.
_FIELD: Final = b"record"
# Unreadable lines or entries remembered so that each is logged once, up to this many.
_LOGGED_MAX: Final = 1000

_encoder: Final = msgspec.json.Encoder()
_decoder: Final = msgspec.json.Decoder(CheckRecord)


class OutcomeStore(Protocol):
    # Where the records are kept, for messages: a file's path, a Redis stream's key.
    where: str

    async def add(self, record: CheckRecord) -> None:
        """Keep ``record``; the event loop is never blocked on I/O."""
        ...

    async def read(
        self, *, since: float | None = None, tenant: str | None = None
    ) -> list[CheckRecord]:
        """The records kept, oldest first (by ``at``), made at or after ``since`` (unix
        seconds), of ``tenant`` only when given."""
        ...

    async def tail(self) -> list[CheckRecord]:
        """The records added by any process since this object's last ``tail()``, in the
        order they were added; the first call returns every record kept. One caller at
        a time: the position is the object's."""
        ...

    async def close(self) -> None: ...


def create_outcome_store(settings: ShadowSettings, cache: CacheSettings | None) -> OutcomeStore:
    """The Redis stream of the cache's own Redis when the cache is on Redis (so every
    replica shares one store), else the file."""
    if cache is not None and isinstance(cache.store, RedisStoreSettings):
        return RedisOutcomes(
            cache.store.url, cache.store.key_prefix, max_records=settings.stream_max_records
        )
    return FileOutcomes(settings.outcomes_file, max_bytes=settings.outcomes_max_bytes)


def _keep(record: CheckRecord, since: float | None, tenant: str | None) -> bool:
    return (since is None or record.at >= since) and (tenant is None or record.tenant == tenant)


def _oldest_first(records: list[CheckRecord]) -> list[CheckRecord]:
    # Added order is nearly made order (a check is recorded when it ends); sorting
    # makes it exact, stably, so equal times keep the order they were added in.
    records.sort(key=lambda r: r.at)
    return records


# -- the file -----------------------------------------------------------------------


class _Position(msgspec.Struct):
    """Where ``tail()`` has read to: a file (by device and inode, which a rotation
    keeps) and a byte offset in it, always at a line's end."""

    device: int
    inode: int
    offset: int


class FileOutcomes:
    """One JSON record per line, appended to ``path`` (``~`` expanded, its directory
    made), rotated to ``<path>.1`` once it would grow past ``max_bytes``."""

    def __init__(self, path: str | Path, max_bytes: int) -> None:
        self.path = Path(path).expanduser()
        self.old = self.path.with_name(self.path.name + ".1")
        self.max_bytes = max_bytes
        self.where = str(self.path)
        # Held by appends (a rotation included) and by reads while they open the two
        # files, so a read never sees a rotation half done.
        self._lock = threading.Lock()
        # Appends in the order they were made: asyncio's lock is FIFO.
        self._order = asyncio.Lock()
        self._tail_at: _Position | None = None
        self._torn_logged: set[tuple[str, int]] = set()

    async def add(self, record: CheckRecord) -> None:
        line = _encoder.encode(record) + b"\n"
        async with self._order:
            await asyncio.to_thread(self._append, line)

    async def read(
        self, *, since: float | None = None, tenant: str | None = None
    ) -> list[CheckRecord]:
        records = await asyncio.to_thread(self._read_all, since)
        return _oldest_first([r for r in records if _keep(r, since, tenant)])

    async def tail(self) -> list[CheckRecord]:
        return await asyncio.to_thread(self._tail)

    async def close(self) -> None:
        async with self._order:  # an append under way finishes first
            pass

    # -- in a worker thread ---------------------------------------------------------

    def _append(self, line: bytes) -> None:
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                size = self.path.stat().st_size
            except FileNotFoundError:
                size = 0
            if size and size + len(line) > self.max_bytes:
                os.replace(self.path, self.old)
                size = 0
            with self.path.open("a+b") as handle:  # + : read its last byte
                # A line torn by a crash mid-write would swallow this one: it starts
                # on a line of its own, and reads skip the torn one.
                if size and os.pread(handle.fileno(), 1, size - 1) != b"\n":
                    line = b"\n" + line
                handle.write(line)  # one write of one line: appends never interleave

    def _read_all(self, since: float | None) -> list[CheckRecord]:
        with contextlib.ExitStack() as files:
            with self._lock:
                old, current = (_open(files, path) for path in (self.old, self.path))
            records: list[CheckRecord] = []
            # Every record in the old file was made before it was last written to.
            if old is not None and (since is None or os.fstat(old.fileno()).st_mtime >= since):
                records += self._decode(self.old, old.read())
            if current is not None:
                records += self._decode(self.path, current.read())
            return records

    def _tail(self) -> list[CheckRecord]:
        with contextlib.ExitStack() as files:
            with self._lock:
                old, current = (_open(files, path) for path in (self.old, self.path))
            if current is None:
                return []  # nothing written yet (or the file was removed)
            records: list[CheckRecord] = []
            here = _file_id(current)
            at = self._tail_at
            start = 0
            if at is not None and here == (at.device, at.inode):
                start = at.offset
            elif at is not None and old is not None and _file_id(old) == (at.device, at.inode):
                # Rotated since the last tail: the rest of the old file, then the new.
                records += self._lines_from(self.old, old, at.offset)[0]
            elif at is not None:
                log.warning(
                    "outcome file %s was rotated more than once, or replaced, since it was "
                    "last read: records added in between are missing from live estimates",
                    self.path,
                )
            elif old is not None:
                records += self._lines_from(self.old, old, 0)[0]
            fresh, offset = self._lines_from(self.path, current, start)
            self._tail_at = _Position(*here, offset)
            return records + fresh

    def _lines_from(
        self, path: Path, handle: BinaryIO, offset: int
    ) -> tuple[list[CheckRecord], int]:
        """The records in whole lines from ``offset`` on, and the offset after them (a
        line still being written is read next time)."""
        if offset > os.fstat(handle.fileno()).st_size:
            log.warning("outcome file %s shrank since it was last read: read again", path)
            offset = 0
        handle.seek(offset)
        data = handle.read()
        data = data[: data.rfind(b"\n") + 1]
        return self._decode(path, data, offset), offset + len(data)

    def _decode(self, path: Path, data: bytes, start: int = 0) -> list[CheckRecord]:
        records = []
        offset = start
        for line in data.split(b"\n"):
            where = offset
            offset += len(line) + 1
            if not line.strip():
                continue
            try:
                records.append(_decoder.decode(line))
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                # A crash mid-write leaves a torn line: skipped, and logged once.
                key = (str(path), where)
                if key not in self._torn_logged and len(self._torn_logged) < _LOGGED_MAX:
                    self._torn_logged.add(key)
                    log.warning(
                        "outcome file %s: the line at byte %d is not a check record, skipped (%s)",
                        path,
                        where,
                        exc,
                    )
        return records


def _open(files: contextlib.ExitStack, path: Path) -> BinaryIO | None:
    try:
        return files.enter_context(path.open("rb"))
    except FileNotFoundError:
        return None


def _file_id(handle: BinaryIO) -> tuple[int, int]:
    """Device and inode: what a rename keeps, so a rotated file is still known."""
    stat = os.fstat(handle.fileno())
    return stat.st_dev, stat.st_ino


# -- Redis --------------------------------------------------------------------------


def _stream_id(raw: bytes | str) -> tuple[int, int]:
    text = raw.decode() if isinstance(raw, bytes) else raw
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


class RedisOutcomes:
    """A Redis stream, ``<key_prefix>:outcomes``, that every replica adds its records
    to and reads everyone's from; the oldest trimmed past about ``max_records``."""

    def __init__(
        self, url: str, key_prefix: str, *, max_records: int, timeout_s: float = _REDIS_TIMEOUT_S
    ) -> None:
        self.key = f"{key_prefix}:outcomes"
        self.max_records = max_records
        self.timeout_s = timeout_s
        self._redis = redis_client(url, timeout_s)
        parts = urlsplit(url)  # for messages: host and port, never the password
        self._host = parts.netloc.rpartition("@")[2] or parts.path
        self.where = f"Redis at {self._host}, stream {self.key}"
        self._tail_at = "0-0"
        self._corrupt_logged: set[bytes] = set()

    async def add(self, record: CheckRecord) -> None:
        fields: dict[Any, Any] = {_FIELD: _encoder.encode(record)}
        await self._call(
            lambda redis: redis.xadd(self.key, fields, maxlen=self.max_records, approximate=True)
        )

    async def read(
        self, *, since: float | None = None, tenant: str | None = None
    ) -> list[CheckRecord]:
        # Stream ids are the time each record was added, never before it was made:
        # starting at ``since`` misses none, and ``_keep`` drops those made earlier.
        start = "-" if since is None else f"{max(int(since * 1000), 0)}-0"
        records: list[CheckRecord] = []
        while True:
            events = await self._call(self._range_from(start))
            records += [r for r in self._decode(events) if _keep(r, since, tenant)]
            if len(events) < _CHUNK:
                return _oldest_first(records)
            ms, seq = _stream_id(events[-1][0])
            start = f"{ms}-{seq + 1}"

    async def tail(self) -> list[CheckRecord]:
        records: list[CheckRecord] = []
        while True:
            events = await self._call(self._read_after(self._tail_at))
            if not events:
                return records
            records += self._decode(events)
            last = events[-1][0]
            self._tail_at = last.decode() if isinstance(last, bytes) else str(last)

    def _range_from(self, start: str) -> Callable[[Redis], Awaitable[list[Any]]]:
        async def run(redis: Redis) -> list[Any]:
            return list(await redis.xrange(self.key, min=start, max="+", count=_CHUNK) or [])

        return run

    def _read_after(self, after: str) -> Callable[[Redis], Awaitable[list[Any]]]:
        async def run(redis: Redis) -> list[Any]:
            reply: Any = await redis.xread({self.key: after}, count=_CHUNK)
            # RESP2 answers [[stream, events]], RESP3 {stream: events}.
            streams = reply.values() if isinstance(reply, dict) else (s for _, s in reply or [])
            return [event for events in streams for event in events]

        return run

    async def close(self) -> None:
        await self._redis.aclose()

    async def _call(self, op: Callable[[Redis], Awaitable[T]]) -> T:
        try:
            async with asyncio.timeout(self.timeout_s):
                return await op(self._redis)
        except (RedisError, OSError, TimeoutError) as exc:
            raise StoreUnavailable(
                f"the outcome store ({self.where}) is unavailable: {type(exc).__name__}: {exc}"
            ) from exc

    def _decode(self, events: list[Any]) -> list[CheckRecord]:
        records = []
        for event_id, fields in events:
            try:
                records.append(_decoder.decode(fields[_FIELD]))
            except (KeyError, msgspec.DecodeError, msgspec.ValidationError) as exc:
                raw_id = event_id if isinstance(event_id, bytes) else str(event_id).encode()
                if raw_id not in self._corrupt_logged and len(self._corrupt_logged) < _LOGGED_MAX:
                    self._corrupt_logged.add(raw_id)
                    log.warning(
                        "outcome stream %s: entry %s is not a check record, skipped (%s)",
                        self.key,
                        raw_id.decode(errors="replace"),
                        exc,
                    )
        return records
