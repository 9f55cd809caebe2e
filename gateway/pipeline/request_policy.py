"""A request's settings, resolved once at its start: the config in force when it
arrived, its tenant's overrides, its deadlines and what the client let the cache do.

A reload while the request runs changes nothing about it, and nothing further down
asks the config or the tenant again.
"""

from __future__ import annotations

import time

import msgspec

from cache.settings import CacheSettings
from evaluator.loop import FallbackSettings
from evaluator.policy import LoopSettings
from gateway.config import GatewayConfig
from gateway.pipeline.sticky import Stickiness


class CacheControl(msgspec.Struct, frozen=True):
    """What the client lets the cache do for this request."""

    lookup: bool = True
    store: bool = True
    only_cached: bool = False  # a miss is an error, not an engine call
    # Cache-Control: max-age: answers cached longer ago than this are not served.
    max_age_s: int | None = None

    def fresh(self, created_at: float) -> bool:
        """Whether an answer cached at ``created_at`` (wall-clock seconds) may serve."""
        return self.max_age_s is None or time.time() - created_at <= self.max_age_s


ALL_CACHE = CacheControl()


class Policy(msgspec.Struct, frozen=True, kw_only=True):
    tenant: str
    arrived: float  # time.monotonic() seconds
    # Per engine, milliseconds from arrival: the tenant's or the SLA's deadline, or the
    # client's own when shorter; an engine without either is absent.
    deadline_ms: dict[str, int]
    fallback: FallbackSettings  # what answers when the loop's deadline comes
    router_threshold: float | None  # None: the router model file's own
    loop: LoopSettings | None  # None: no loop
    cache: CacheSettings | None  # None: no cache
    control: CacheControl
    conversation: str | None  # the conversation this request is a turn of, if it says
    # How long a conversation stays on the large path after escalating (None: it does
    # not), and whether one is also known by its first turn (router.sticky_by).
    stickiness: Stickiness | None = None
    sticky_by_first_turn: bool = False

    def deadline(self, engine: str) -> float | None:
        """When a request answered by ``engine`` is out of time (monotonic seconds)."""
        ms = self.deadline_ms.get(engine)
        return None if ms is None else self.arrived + ms / 1000


def resolve(
    config: GatewayConfig,
    tenant: str,
    *,
    arrived: float,
    asked_deadline_ms: int | None = None,
    control: CacheControl = ALL_CACHE,
    conversation: str | None = None,
    asked_first_answer: bool | None = None,
) -> Policy:
    """``config``'s settings for one request of ``tenant``; ``asked_deadline_ms`` only
    shortens a deadline, never lengthens it; ``asked_first_answer`` (the request's
    header) outranks the tenant's and the config's first_answer."""
    own = config.tenant(tenant)
    deadlines = {}
    for engine in config.engines:
        limits = [ms for ms in (config.deadline_ms(tenant, engine), asked_deadline_ms) if ms]
        if limits:
            deadlines[engine] = min(limits)
    cache = config.cache
    if cache is not None and own.similarity_threshold is not None:
        cache = msgspec.structs.replace(cache, similarity_threshold=own.similarity_threshold)
    if cache is not None and own.max_false_hit_rate is not None:
        cache = msgspec.structs.replace(cache, max_false_hit_rate=own.max_false_hit_rate)
    loop = config.loop
    if loop is not None and own.loop_threshold is not None:
        loop = msgspec.structs.replace(loop, threshold=own.loop_threshold)
    first_answer = next((f for f in (asked_first_answer, own.first_answer) if f is not None), None)
    if loop is not None and first_answer is not None:
        loop = msgspec.structs.replace(loop, first_answer=first_answer)
    router_threshold = own.router_threshold
    if router_threshold is None and config.router is not None:
        router_threshold = config.router.threshold
    stickiness = None
    if config.router is not None:
        turns = config.router.sticky_turns if own.sticky_turns is None else own.sticky_turns
        seconds = config.router.sticky_s if own.sticky_s is None else own.sticky_s
        stickiness = Stickiness(turns, seconds) if turns else None
    return Policy(
        tenant=tenant,
        arrived=arrived,
        deadline_ms=deadlines,
        fallback=config.fallback(tenant),
        router_threshold=router_threshold,
        loop=loop,
        cache=cache,
        control=control,
        # The tenant scopes the conversation: one tenant's turn never stops another's.
        conversation=None if conversation is None else f"{tenant}\x00{conversation}",
        stickiness=stickiness,
        sticky_by_first_turn=config.router is not None and config.router.sticky_by == "first_turn",
    )
