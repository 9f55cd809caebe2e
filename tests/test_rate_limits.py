"""Per-key rate limits: the sliding-window rule, shared between replicas through a
real Redis, in-process without one, and open (not failing) while Redis is down."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

import pytest

from engines.breaker import Breaker
from gateway.config import KeySettings
from gateway.ops.limits import (
    WINDOW_S,
    MemoryCounters,
    RateLimited,
    RateLimiter,
    RedisCounters,
    Refusal,
    TooManyTokens,
    retry_after,
)
from tests.support import free_port, spare_redis, stop

REDIS = "redis://127.0.0.1:6379/0"
DIGEST = "0" * 64


def limits(**per_minute: int) -> KeySettings:
    return KeySettings(sha256=DIGEST, **per_minute)  # type: ignore[arg-type]


async def refused(limiter: RateLimiter, key: str, settings: KeySettings, tokens: int = 0) -> bool:
    try:
        await limiter.admit(key, settings, tokens)
    except RateLimited as exc:
        assert exc.retry_after_s >= 1
        return True
    return False


@pytest.mark.parametrize("shared", [True, False], ids=["redis", "memory"])
async def test_requests_per_minute(shared: bool) -> None:
    counters = RedisCounters(REDIS, f"test-{uuid.uuid4().hex}") if shared else MemoryCounters()
    limiter = RateLimiter(counters)
    key, settings = "k", limits(requests_per_minute=3)
    try:
        assert [await refused(limiter, key, settings) for _ in range(4)] == [
            False, False, False, True
        ]  # fmt: skip
        assert not await refused(limiter, "another", settings)  # keys count apart
    finally:
        await limiter.close()


async def test_replicas_share_the_count_through_redis() -> None:
    prefix = f"test-{uuid.uuid4().hex}"
    one, two = RateLimiter(RedisCounters(REDIS, prefix)), RateLimiter(RedisCounters(REDIS, prefix))
    settings = limits(requests_per_minute=3, tokens_per_minute=1000)
    try:
        assert not await refused(one, "k", settings, 100)
        assert not await refused(two, "k", settings, 100)
        assert not await refused(one, "k", settings, 100)
        assert await refused(two, "k", settings, 100)  # the fourth, on either replica
    finally:
        await one.close()
        await two.close()


async def test_a_refused_request_is_not_charged() -> None:
    limiter = RateLimiter(MemoryCounters())
    settings = limits(requests_per_minute=10, tokens_per_minute=100)
    assert not await refused(limiter, "k", settings, 60)
    assert await refused(limiter, "k", settings, 60)  # tokens refuse it
    assert not await refused(limiter, "k", settings, 40)  # its request was not counted
    with pytest.raises(TooManyTokens, match="allows 100 per minute: lower max_tokens"):
        await limiter.admit("k", settings, 101)


async def test_an_unavailable_redis_leaves_requests_unlimited(
    caplog: pytest.LogCaptureFixture,
) -> None:
    limiter = RateLimiter(RedisCounters(f"redis://127.0.0.1:{free_port()}/0"))
    settings = limits(requests_per_minute=1)
    try:
        with caplog.at_level(logging.ERROR, logger="satisfice.gateway"):
            for _ in range(3):
                assert not await refused(limiter, "k", settings)
        outages = [r for r in caplog.records if "rate limits off" in r.getMessage()]
        assert len(outages) == 1  # one line per outage, not one per request
    finally:
        await limiter.close()


async def test_limits_are_on_again_once_their_redis_answers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()
    now = [1000.0]  # the breaker's clock, moved by hand
    breaker = Breaker(failures=1, open_s=1.0, clock=lambda: now[0])
    limiter = RateLimiter(RedisCounters(f"redis://127.0.0.1:{port}/0"), breaker)
    settings = limits(requests_per_minute=1)
    redis = None
    try:
        with caplog.at_level(logging.INFO, logger="satisfice.gateway"):
            assert not await refused(limiter, "k", settings)  # down: unlimited
            redis = spare_redis(port, tmp_path)
            # Within open_s Redis is left alone: this request is not counted ...
            assert not await refused(limiter, "k", settings)
            now[0] += 1.0
            # ... and the next one tries it, is counted, and ends the outage.
            assert not await refused(limiter, "k", settings)
            assert await refused(limiter, "k", settings)
        messages = [r.getMessage() for r in caplog.records]
        assert sum("rate limits off" in m for m in messages) == 1
        assert sum("rate limits on again" in m for m in messages) == 1
    finally:
        await limiter.close()
        if redis is not None:
            stop(redis)


def test_retry_after_waits_for_the_window_to_slide() -> None:
    # Half-way through a window, with 10 of 10 spent in the previous one and none in
    # this: the previous window weighs 5 now, and 1 more fits once it weighs 9 or less,
    # which is at once; 10 more need it to weigh 0: the rest of this window.
    assert retry_after(Refusal("requests", now=0, before=10), 10, 10, 0.5) == WINDOW_S // 2
    # All spent in this window: wait for the next, and there until this one's weight
    # leaves room for the cost.
    assert retry_after(Refusal("requests", now=10, before=0), 10, 1, 0.0) == WINDOW_S + 6
    assert retry_after(Refusal("tokens", now=3, before=4), 10, 5, 0.25) >= 1
