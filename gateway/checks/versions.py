"""Policy versions: the router, the loop's calibrator and the verifier's calibration a
refit produced, kept where every replica finds them, and which version is active and
which runs in shadow.

A version is written once and never changed. The state (active, shadow, and the
version active before, for a revert) is one small record that replicas poll: in a
directory beside the outcome file by default, in the cache's Redis when the cache is
on Redis (so `satisfice policy activate` on any machine reaches every replica).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Literal, Protocol

import msgspec
from redis.asyncio import Redis
from redis.exceptions import RedisError

from cache.calibration import Calibration
from cache.redis_store import redis_client
from cache.settings import CacheSettings, RedisStoreSettings
from cache.store import StoreUnavailable
from evaluator.calibration import Calibrator
from gateway.config.shadow import ShadowSettings
from router.model_file import RouterModel

log = logging.getLogger("satisfice.policy")

# The version of the parts the gateway was started with: its config's files.
SHIPPED = "shipped"


class Rate(msgspec.Struct, frozen=True, kw_only=True):
    """A share with its 95% interval, over ``n`` (effective) checked requests."""

    rate: float | None
    low: float | None
    high: float | None
    n: float


class Comparison(msgspec.Struct, frozen=True, kw_only=True):
    """One part of a new version against the version it was refitted from, estimated
    on checks the refit did not use: how often each would have disagreed with the
    skipped path, and what each spends."""

    part: str  # router | calibrator | verifier
    checks: int  # held-out checks it was estimated on
    live: Rate  # the version in force when refitted
    candidate: Rate
    # What each spends: the router's share of requests sent to the large path; the
    # calibrator's share of early stops that would go on; the verifier's share of
    # semantic hits it would still serve.
    cost: str
    live_cost: float | None
    candidate_cost: float | None


class Manifest(msgspec.Struct, frozen=True, kw_only=True):
    """What a version is, where it came from, and how it compares."""

    id: str
    created_at: float  # unix seconds
    parent: str  # the version in force when it was refitted
    records: int  # outcome records read
    # Labels each part was fitted on (absent: the part was not refitted: too few).
    fitted: dict[str, int]
    comparisons: list[Comparison] = []
    notes: list[str] = []


class PolicyVersion(msgspec.Struct, frozen=True, kw_only=True):
    manifest: Manifest
    router: RouterModel | None = None
    calibrator: Calibrator | None = None
    # The calibrator's map from the P(correct) in force to the new one (isotonic, on a
    # grid): what the version in shadow would have said of a live loop's rounds.
    calibration_map: tuple[list[float], list[float]] | None = None
    verifier: Calibration | None = None


class PolicyState(msgspec.Struct, frozen=True, kw_only=True):
    active: str = SHIPPED
    shadow: str | None = None
    previous: str | None = None  # the version active before (revert goes back to it)
    changed_at: float = 0.0


# What an SRE does with a version: run it in shadow, put it in force, stop its shadow,
# or go back to the version in force before the last activate.
Move = Literal["shadow", "activate", "unshadow", "revert"]


def after(state: PolicyState, move: Move, version: str | None = None) -> PolicyState:
    """The state after ``move`` (of ``version``, for shadow and activate)."""
    now = time.time()
    if move == "revert":
        return PolicyState(active=state.previous or SHIPPED, shadow=state.shadow, changed_at=now)
    if move == "unshadow":
        return msgspec.structs.replace(state, shadow=None, changed_at=now)
    if version is None:
        raise ValueError(f"{move} needs a version")
    if move == "shadow":
        return msgspec.structs.replace(state, shadow=version, changed_at=now)
    return PolicyState(
        active=version,
        shadow=None if state.shadow == version else state.shadow,
        previous=state.active,
        changed_at=now,
    )


class PolicyStore(Protocol):
    where: str

    async def put(self, version: PolicyVersion) -> None: ...

    async def get(self, version_id: str) -> PolicyVersion | None: ...

    async def manifests(self) -> list[Manifest]: ...

    async def state(self) -> PolicyState: ...

    async def set_state(self, state: PolicyState) -> None: ...

    async def close(self) -> None: ...


def encoded(version: PolicyVersion) -> bytes:
    """``version`` as stored, once it is shown to load back: a version that would fail
    to load (a field out of its range) is refused when written, not when activated."""
    data = msgspec.msgpack.encode(version)
    msgspec.msgpack.decode(data, type=PolicyVersion)  # raises msgspec.ValidationError
    return data


def create_policy_store(settings: ShadowSettings, cache: CacheSettings | None) -> PolicyStore:
    """The cache's Redis when the cache is on Redis (every replica sees one state), else
    the directory ``policies`` beside the outcome file."""
    if cache is not None and isinstance(cache.store, RedisStoreSettings):
        return RedisPolicies(cache.store.url, cache.store.key_prefix)
    return FilePolicies(Path(settings.outcomes_file).expanduser().parent / "policies")


def new_id(now: float | None = None) -> str:
    """A version id that sorts by time and says when: p-YYYYmmdd-HHMMSS-xxxx."""
    now = time.time() if now is None else now
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now))
    return f"p-{stamp}-{os.urandom(2).hex()}"


_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-")


def check_id(version_id: str) -> str:
    """``version_id`` if it could name a version (it becomes a file name), else raise."""
    if not version_id or len(version_id) > 64 or not set(version_id) <= _ID_CHARS:
        raise ValueError(f"{version_id[:80]!r} is not a policy version id")
    return version_id


class FilePolicies:
    """One file per version (``<id>.policy``, msgpack) and ``state.json``, written
    whole to a temporary file and renamed, so a reader never sees half of one."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.where = str(directory)

    async def put(self, version: PolicyVersion) -> None:
        name = check_id(version.manifest.id) + ".policy"
        await asyncio.to_thread(self._write, name, encoded(version))

    async def get(self, version_id: str) -> PolicyVersion | None:
        path = self.directory / (check_id(version_id) + ".policy")
        data = await asyncio.to_thread(_read, path)
        return None if data is None else msgspec.msgpack.decode(data, type=PolicyVersion)

    async def manifests(self) -> list[Manifest]:
        return await asyncio.to_thread(self._manifests)

    def _manifests(self) -> list[Manifest]:
        if not self.directory.is_dir():
            return []
        found = []
        for path in sorted(self.directory.glob("*.policy")):
            try:
                version = msgspec.msgpack.decode(path.read_bytes(), type=PolicyVersion)
            except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("policy version %s cannot be read, left out: %s", path, exc)
                continue
            found.append(version.manifest)
        return found

    async def state(self) -> PolicyState:
        data = await asyncio.to_thread(_read, self.directory / "state.json")
        return PolicyState() if data is None else msgspec.json.decode(data, type=PolicyState)

    async def set_state(self, state: PolicyState) -> None:
        await asyncio.to_thread(self._write, "state.json", msgspec.json.encode(state))

    async def close(self) -> None:
        return None

    def _write(self, name: str, data: bytes) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=self.directory, prefix=".writing-")
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
            os.replace(temporary, self.directory / name)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


class RedisPolicies:
    """``{prefix}:policy:<id>`` per version, ``{prefix}:policies`` (a hash of
    manifests) and ``{prefix}:policy-state``."""

    def __init__(self, url: str, key_prefix: str, *, timeout_s: float = 5.0) -> None:
        self._redis: Redis = redis_client(url, timeout_s)
        self._prefix = key_prefix
        self.where = f"Redis {url.rsplit('@', 1)[-1]}, keys {key_prefix}:policy*"

    async def put(self, version: PolicyVersion) -> None:
        vid = check_id(version.manifest.id)
        async with self._guard():
            pipe = self._redis.pipeline(transaction=True)
            pipe.set(f"{self._prefix}:policy:{vid}", encoded(version))
            pipe.hset(f"{self._prefix}:policies", vid, msgspec.json.encode(version.manifest))
            await pipe.execute()

    async def get(self, version_id: str) -> PolicyVersion | None:
        vid = check_id(version_id)
        async with self._guard():
            data = await self._redis.get(f"{self._prefix}:policy:{vid}")
        return None if data is None else msgspec.msgpack.decode(_raw(data), type=PolicyVersion)

    async def manifests(self) -> list[Manifest]:
        async with self._guard():
            found = await self._redis.hgetall(f"{self._prefix}:policies")
        manifests = [msgspec.json.decode(_raw(v), type=Manifest) for v in found.values()]
        return sorted(manifests, key=lambda m: m.id)

    async def state(self) -> PolicyState:
        async with self._guard():
            data = await self._redis.get(f"{self._prefix}:policy-state")
        return PolicyState() if data is None else msgspec.json.decode(_raw(data), type=PolicyState)

    async def set_state(self, state: PolicyState) -> None:
        async with self._guard():
            await self._redis.set(f"{self._prefix}:policy-state", msgspec.json.encode(state))

    async def close(self) -> None:
        await self._redis.aclose()

    def _guard(self) -> contextlib.AbstractAsyncContextManager[None]:
        return _unavailable(self.where)


def _raw(value: bytes | str) -> bytes:
    """A reply as bytes (the client decodes none; its types allow for one that does)."""
    return value if isinstance(value, bytes) else value.encode()


@contextlib.asynccontextmanager
async def _unavailable(where: str) -> AsyncIterator[None]:
    """Redis errors as ``StoreUnavailable``, naming the store."""
    try:
        yield
    except (RedisError, OSError, TimeoutError) as exc:
        raise StoreUnavailable(f"policy store ({where}): {exc}") from exc
