"""The cache's part of the config."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from cache.guards import GuardSettings

Unit = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
Seconds = Annotated[float, msgspec.Meta(gt=0)]


class MemoryStoreSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True,
                          tag_field="kind", tag="memory"):  # fmt: skip
    """In-process entries: the embedded default. One process only, nothing shared."""

    # Entries kept; beyond them the oldest written is evicted first.
    max_entries: Annotated[int, msgspec.Meta(ge=1)] = 100_000
    # Written on shutdown (and every ``snapshot_interval_s``) and read at start, so a
    # restart keeps the cache. null: the cache starts empty each time.
    snapshot: str | None = None
    # How often the snapshot is written while serving; null: on shutdown only.
    snapshot_interval_s: Seconds | None = 300.0


class RedisStoreSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True,
                         tag_field="kind", tag="redis"):  # fmt: skip
    """Entries in Redis, shared by every replica; bounded by Redis's own maxmemory."""

    # redis://, rediss:// (TLS), or redis+sentinel://host:port[,host:port]/service[/db]
    # to find the master through Redis Sentinel.
    url: str = "redis://127.0.0.1:6379/0"
    # Every key starts with this, so one Redis can hold several deployments.
    key_prefix: str = "satisfice"
    # A command slower than this counts as an outage: the request goes on without
    # the cache rather than waiting for it.
    timeout_s: Seconds = 0.25
    # While Redis is down, how often to try it again (requests in between bypass).
    retry_interval_s: Seconds = 1.0
    # Changes kept in the sync stream; a replica further behind than this rebuilds.
    stream_max_len: Annotated[int, msgspec.Meta(ge=100)] = 100_000
    # Pooled connections requests may hold at once (the sync stream and scans have
    # their own).
    max_connections: Annotated[int, msgspec.Meta(ge=1)] = 64
    # Entries read or written by this process kept in it too, so that a repeated
    # question is answered without a round trip to Redis; kept coherent by the sync
    # stream, and not used while Redis is unreachable. The least recently used go
    # first beyond this many bytes (text, vector and about 770 bytes each); 0: off.
    near_cache_bytes: Annotated[int, msgspec.Meta(ge=0)] = 64 * 1024 * 1024


StoreSettings = MemoryStoreSettings | RedisStoreSettings


class IndexSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Each process's vector index over the cached prompts (FAISS)."""

    # "gpu" needs faiss-gpu (the `gpu` extra) and a GPU; without them the CPU
    # index serves, with a warning at start.
    device: Literal["cpu", "gpu"] = "cpu"
    # Per namespace: exact search up to this many vectors, HNSW beyond (CPU only).
    hnsw_above: Annotated[int, msgspec.Meta(ge=1)] = 20_000


class VerifierSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The semantic path's second opinion: a pair model's P(same answer) for each
    candidate the guards let through; a hit needs P at the operating point that
    ``cache.max_false_hit_rate`` sets."""

    # The pair model's weights; null: the one shipped (cache/data/default.verifier).
    weights: str | None = None
    # Labelled outcomes the operating point is read from (``satisfice cache
    # calibrate`` writes them); null: those shipped with the model.
    calibration: str | None = None
    # Cached prompts less similar than this are not candidates at all.
    similarity_floor: Unit = 0.75


class CacheSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    # Serve the answer stored for the same prompt (same namespace), without embedding it.
    exact: bool = True
    # Serve the answer stored for a similar prompt, if the threshold and guards allow.
    semantic: bool = True
    # The share of semantic hits allowed to be wrong, bounded with 95% confidence on
    # the verifier's calibration pairs; the operating point follows from it (a bound
    # the calibration cannot show turns semantic hits off). The shipped calibration
    # (Quora questions) shows 8% and up, not 5%: `satisfice cache calibrate` on your
    # own labelled traffic, and `satisfice cache eval --pairwise` to check it.
    max_false_hit_rate: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.1
    # The verifier decides semantic hits; null: the similarity threshold alone does.
    verifier: VerifierSettings | None = VerifierSettings()
    # Without a verifier: the cosine similarity a cached prompt needs to be served.
    similarity_threshold: Unit = 0.92
    # Answers below this confidence are not stored.
    write_confidence: Unit = 0.0
    # How long a stored answer may be served; null: until it is evicted.
    ttl_s: Seconds | None = 86_400.0
    # Candidates above the threshold (or the verifier's floor) examined, nearest first.
    candidates: Annotated[int, msgspec.Meta(ge=1)] = 5
    # Checks that veto a similar prompt whose answer would differ.
    guards: GuardSettings = GuardSettings()
    # Requests that ask for temperature > 0 want varied answers and bypass the cache;
    # true serves and stores them too, in a namespace per temperature.
    cache_sampled: bool = False
    # Concurrent identical misses wait for one engine call instead of each making one.
    coalesce: bool = True
    # Where the entries live: memory (one process) or redis (shared by replicas).
    store: StoreSettings = MemoryStoreSettings()
    # Each process's vector index over the cached prompts.
    index: IndexSettings = IndexSettings()
