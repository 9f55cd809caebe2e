"""The policy version store: every case across every backend (a directory of files, and
the shared Redis at 6379 under a key prefix of its own), then the moves between
versions and what only the files have: a write torn part-way leaves no half file."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from redis.asyncio import Redis

from cache.calibration import Calibration
from cache.settings import CacheSettings, MemoryStoreSettings, RedisStoreSettings
from gateway.checks import versions
from gateway.checks.versions import (
    SHIPPED,
    Comparison,
    FilePolicies,
    Manifest,
    PolicyState,
    PolicyStore,
    PolicyVersion,
    Rate,
    RedisPolicies,
    after,
    check_id,
    create_policy_store,
    new_id,
)
from gateway.config.shadow import ShadowSettings
from router.model_file import KNNModel
from tests.test_outcome_store import URL, redis_up

BACKENDS = ["file", "redis"]


def version(vid: str, *, parent: str = SHIPPED, records: int = 120) -> PolicyVersion:
    """A version with a verifier calibration and a comparison: enough of every field
    to tell a whole one from a half one."""
    rate = Rate(rate=0.1, low=0.05, high=0.2, n=30.0)
    comparison = Comparison(
        part="verifier", checks=30, live=rate, candidate=rate, cost="share served",
        live_cost=1.0, candidate_cost=0.8,
    )  # fmt: skip
    manifest = Manifest(
        id=vid, created_at=1_700_000_000.0, parent=parent, records=records,
        fitted={"verifier": 90}, comparisons=[comparison], notes=["router: 3 labels, 20 needed"],
    )  # fmt: skip
    calibration = Calibration(
        verifier="v-test", pairs="90 semantic-hit checks", queries=90,
        scores=[0.9 + i / 1000 for i in range(90)], wrong=[i % 9 == 0 for i in range(90)],
    )  # fmt: skip
    return PolicyVersion(manifest=manifest, verifier=calibration)


class Backend:
    def __init__(self, kind: str, tmp_path: Path) -> None:
        self.kind = kind
        self.directory = tmp_path / "policies"
        self.prefix = f"test-policies-{uuid.uuid4().hex}"
        self.opened: list[PolicyStore] = []

    def open(self) -> PolicyStore:
        """A store; on Redis each one as if another replica's."""
        store: PolicyStore = (
            FilePolicies(self.directory) if self.kind == "file"
            else RedisPolicies(URL, self.prefix)
        )  # fmt: skip
        self.opened.append(store)
        return store

    async def close(self) -> None:
        for store in self.opened:
            await store.close()
        if self.kind == "redis":
            client = Redis.from_url(URL)
            keys = [key async for key in client.scan_iter(match=f"{self.prefix}:*")]
            if keys:
                await client.unlink(*keys)
            await client.aclose()


@pytest.fixture(params=BACKENDS)
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    if request.param == "redis" and not await redis_up():
        pytest.skip(f"Redis is not answering at {URL}")
    kept = Backend(request.param, tmp_path)
    yield kept
    await kept.close()


# -- every backend ------------------------------------------------------------------


async def test_a_version_put_reads_back_whole_from_another_store(backend: Backend) -> None:
    store = backend.open()
    assert await store.get("p-none") is None
    assert await store.manifests() == []
    kept = version("p-20260101-000000-aaaa")
    await store.put(kept)
    other = backend.open()
    assert await other.get(kept.manifest.id) == kept
    assert await other.manifests() == [kept.manifest]


async def test_manifests_are_listed_by_id(backend: Backend) -> None:
    store = backend.open()
    ids = ["p-20260103-000000-cccc", "p-20260101-000000-aaaa", "p-20260102-000000-bbbb"]
    for vid in ids:
        await store.put(version(vid))
    assert [m.id for m in await backend.open().manifests()] == sorted(ids)


async def test_the_state_starts_shipped_and_reads_back_as_set(backend: Backend) -> None:
    store = backend.open()
    assert await store.state() == PolicyState()
    assert (await store.state()).active == SHIPPED
    state = PolicyState(active="p-a", shadow="p-b", previous=SHIPPED, changed_at=1.5)
    await store.set_state(state)
    assert await backend.open().state() == state
    await store.set_state(after(state, "revert"))
    assert (await backend.open().state()).active == SHIPPED


@pytest.mark.parametrize(
    "bad", ["../x", "a/b", "P-UPPER", "x" * 65, "", "a b", "a.policy", "..", "a\\b", "é"]
)
async def test_ids_that_could_be_a_path_are_refused_everywhere(backend: Backend, bad: str) -> None:
    with pytest.raises(ValueError, match="policy version id"):
        check_id(bad)
    store = backend.open()
    with pytest.raises(ValueError, match="policy version id"):
        await store.get(bad)
    with pytest.raises(ValueError, match="policy version id"):
        await store.put(version(bad))
    assert await store.manifests() == []
    if backend.kind == "file":  # nothing was written anywhere, inside or beside it
        assert not backend.directory.exists() or not any(backend.directory.iterdir())


def test_good_ids_pass_and_new_ids_are_good_and_sort_by_time() -> None:
    for good in ("shipped", "p-1", "a" * 64, new_id()):
        assert check_id(good) == good
    earlier, later = new_id(1_700_000_000.0), new_id(1_800_000_000.0)
    assert earlier.startswith("p-20231114-221320-") and earlier < later


# -- the moves ----------------------------------------------------------------------


def test_shadow_sets_the_shadow_and_keeps_the_rest() -> None:
    state = PolicyState(active="p-a", previous=SHIPPED, changed_at=1.0)
    moved = after(state, "shadow", "p-b")
    assert (moved.active, moved.shadow, moved.previous) == ("p-a", "p-b", SHIPPED)
    assert moved.changed_at > state.changed_at


def test_activate_records_the_previous_and_clears_its_own_shadow_only() -> None:
    state = PolicyState(active="p-a", shadow="p-b", changed_at=1.0)
    same = after(state, "activate", "p-b")
    assert (same.active, same.shadow, same.previous) == ("p-b", None, "p-a")
    other = after(state, "activate", "p-c")
    assert (other.active, other.shadow, other.previous) == ("p-c", "p-b", "p-a")
    first = after(PolicyState(), "activate", "p-a")
    assert (first.active, first.previous) == ("p-a", SHIPPED)


def test_revert_goes_to_the_previous_then_to_shipped() -> None:
    state = after(after(PolicyState(), "activate", "p-a"), "activate", "p-b")
    state = after(state, "shadow", "p-c")
    back = after(state, "revert")
    assert (back.active, back.shadow, back.previous) == ("p-a", "p-c", None)
    again = after(back, "revert")
    assert (again.active, again.shadow) == (SHIPPED, "p-c")
    assert after(PolicyState(), "revert").active == SHIPPED


def test_unshadow_stops_the_shadow_only() -> None:
    state = PolicyState(active="p-a", shadow="p-b", previous="p-0", changed_at=1.0)
    moved = after(state, "unshadow")
    assert (moved.active, moved.shadow, moved.previous) == ("p-a", None, "p-0")
    assert moved.changed_at > state.changed_at


@pytest.mark.parametrize("move", ["shadow", "activate"])
def test_shadow_and_activate_need_a_version(move: versions.Move) -> None:
    with pytest.raises(ValueError, match=f"{move} needs a version"):
        after(PolicyState(), move)


# -- where the store is -------------------------------------------------------------


async def test_the_store_is_beside_the_outcome_file_or_in_the_caches_redis(
    tmp_path: Path,
) -> None:
    shadow = ShadowSettings(outcomes_file=str(tmp_path / "state" / "outcomes.jsonl"))
    memory = CacheSettings(store=MemoryStoreSettings())
    for cache in (None, memory):
        store = create_policy_store(shadow, cache)
        assert isinstance(store, FilePolicies)
        assert store.directory == tmp_path / "state" / "policies"
    on_redis = CacheSettings(store=RedisStoreSettings(url=URL, key_prefix="test-where"))
    store = create_policy_store(shadow, on_redis)
    assert isinstance(store, RedisPolicies) and "test-where:policy" in store.where
    await store.close()


# -- the files ----------------------------------------------------------------------


class _Torn:
    """A file handle that writes half of what it is given, then fails as a full disk
    would."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle

    def __enter__(self) -> _Torn:
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.close()

    def write(self, data: bytes) -> int:
        self._handle.write(data[: len(data) // 2])
        self._handle.flush()
        raise OSError(28, "No space left on device")


async def test_a_torn_write_leaves_the_old_file_whole_and_no_half_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = FilePolicies(tmp_path / "policies")
    first = version("p-20260101-000000-aaaa")
    await store.put(first)
    state = PolicyState(active=first.manifest.id, previous=SHIPPED, changed_at=2.0)
    await store.set_state(state)
    before = sorted(p.name for p in store.directory.iterdir())

    real_fdopen = os.fdopen
    monkeypatch.setattr(os, "fdopen", lambda *a, **k: _Torn(real_fdopen(*a, **k)))
    with pytest.raises(OSError, match="No space"):
        await store.set_state(after(state, "revert"))
    with pytest.raises(OSError, match="No space"):
        await store.put(version("p-20260102-000000-bbbb"))
    monkeypatch.undo()

    # Neither the half state nor the half version, nor their temporary files, remain.
    assert sorted(p.name for p in store.directory.iterdir()) == before
    reader = FilePolicies(tmp_path / "policies")
    assert await reader.state() == state
    assert await reader.get("p-20260102-000000-bbbb") is None
    assert await reader.manifests() == [first.manifest]


async def test_a_version_file_is_msgpack_of_the_whole_version(tmp_path: Path) -> None:
    store = FilePolicies(tmp_path / "policies")
    kept = version("p-20260101-000000-aaaa")
    await store.put(kept)
    (written,) = store.directory.glob("*.policy")
    assert written.name == "p-20260101-000000-aaaa.policy"
    assert msgspec.msgpack.decode(written.read_bytes(), type=PolicyVersion) == kept


async def test_a_version_that_would_not_load_is_refused_when_written(backend: Backend) -> None:
    # A router threshold below 0: the Struct takes it, its decoder does not.
    router = KNNModel(embedding="e", dim=1, threshold=-1.0, prompts=[], labels=[], vectors=b"")
    bad = msgspec.structs.replace(version("p-20261206-000000-bad0"), router=router)
    store = backend.open()
    with pytest.raises(msgspec.ValidationError, match="threshold"):
        await store.put(bad)
    assert await store.manifests() == []


async def test_an_unreadable_version_file_is_left_out_of_the_list(tmp_path: Path) -> None:
    store = FilePolicies(tmp_path)
    await store.put(version("p-20261206-000000-good"))
    (tmp_path / "p-20261206-000000-torn.policy").write_bytes(b"\x85not msgpack")
    assert [m.id for m in await store.manifests()] == ["p-20261206-000000-good"]
