"""Per-key rate limits: requests and tokens per minute, in sliding-window counters.

Each limit counts per minute window; a request is weighed against the current window
plus the share of the previous one that still overlaps the last 60 seconds
(Cloudflare's sliding-window counter): smooth like a sliding log, two integers like a
fixed window. With Redis the counters are shared by every replica and checked and
charged in one script, so two replicas cannot both admit the last request.

A request refused raises a ``LimitRefused``, which the HTTP layer answers with its
status and ``Retry-After``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from typing import Any, Protocol

import msgspec
from redis.exceptions import RedisError

from cache.redis_store import redis_client
from engines.breaker import Breaker, BreakerOpen
from gateway.config import KeySettings, Outage

log = logging.getLogger("satisfice.gateway")

WINDOW_S = 60
# Counters outlive their window by one more: the next window still reads them.
_TTL_MS = 2 * WINDOW_S * 1000
# Redis slower than this counts as down: requests go on unlimited rather than wait.
_REDIS_TIMEOUT_S = 0.25
# Once it is down, requests skip it this long before one tries it again: waiting out
# the timeout on each would add it to every keyed request while Redis is away.
_REDIS_RETRY_S = 1.0

# KEYS: requests now, requests before, tokens now, tokens before.
# ARGV: request limit, token limit (0: none), token cost, elapsed share of the window.
# Returns {admitted (1/0), which limit refused (0 requests, 1 tokens), now, before}.
_ADMIT = """
local share = tonumber(ARGV[4])
local costs = {1, tonumber(ARGV[3])}
local limits = {tonumber(ARGV[1]), tonumber(ARGV[2])}
for i = 1, 2 do
  if limits[i] > 0 then
    local now = tonumber(redis.call('GET', KEYS[2 * i - 1]) or '0')
    local before = tonumber(redis.call('GET', KEYS[2 * i]) or '0')
    if before * (1 - share) + now + costs[i] > limits[i] then
      return {0, i - 1, now, before}
    end
  end
end
for i = 1, 2 do
  if limits[i] > 0 then
    redis.call('INCRBY', KEYS[2 * i - 1], costs[i])
    redis.call('PEXPIRE', KEYS[2 * i - 1], ARGV[5])
  end
end
return {1, 0, 0, 0}
"""


class LimitRefused(Exception):
    """A keyed request refused by its limits; ``message`` is safe to show its caller."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class TooManyTokens(LimitRefused):
    """One request would cost more tokens than its key may spend in a minute: it can
    never be admitted as it is (its max_tokens must come down)."""


class RateLimited(LimitRefused):
    """The key's limit is reached for now: it has room again in ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class LimitsUnavailable(LimitRefused):
    """The counters' store does not answer, and the outage policy refuses limited keys
    meanwhile; asking again in ``retry_after_s`` tries the store again."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Refusal(msgspec.Struct, frozen=True):
    limit: str  # "requests" or "tokens"
    now: int  # this window's count
    before: int  # the previous window's


class Counters(Protocol):
    async def admit(
        self, key: str, window: int, share: float, limits: tuple[int, int], tokens: int
    ) -> Refusal | None:
        """Charge one request and ``tokens`` to ``key`` unless a limit would be
        passed; 0 is no limit."""

    async def close(self) -> None: ...


class MemoryCounters:
    """This process's own counters: every replica limits on its own."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str, int], int] = {}
        self._window = 0

    async def admit(
        self, key: str, window: int, share: float, limits: tuple[int, int], tokens: int
    ) -> Refusal | None:
        if window != self._window:  # once a minute: forget the windows no one reads
            self._counts = {k: n for k, n in self._counts.items() if k[2] >= window - 1}
            self._window = window
        charges = (("requests", 1), ("tokens", tokens))
        for (name, cost), limit in zip(charges, limits, strict=True):
            now = self._counts.get((key, name, window), 0)
            before = self._counts.get((key, name, window - 1), 0)
            if limit and before * (1 - share) + now + cost > limit:
                return Refusal(name, now, before)
        for (name, cost), limit in zip(charges, limits, strict=True):
            if limit:
                self._counts[key, name, window] = self._counts.get((key, name, window), 0) + cost
        return None

    async def close(self) -> None:
        pass


class RedisCounters:
    """Counters in Redis, shared by every replica."""

    def __init__(self, url: str, prefix: str = "satisfice") -> None:
        self._redis = redis_client(url, _REDIS_TIMEOUT_S)
        self._script = self._redis.register_script(_ADMIT)
        self._prefix = f"{prefix}:ratelimit"

    async def admit(
        self, key: str, window: int, share: float, limits: tuple[int, int], tokens: int
    ) -> Refusal | None:
        # One hash tag per key: on a Redis Cluster the script's four keys share a slot.
        base = f"{self._prefix}:{{{key}}}"
        keys = [
            f"{base}:{name}:{w}" for name in ("requests", "tokens") for w in (window, window - 1)
        ]
        args: list[Any] = [limits[0], limits[1], tokens, share, _TTL_MS]
        admitted, which, now, before = await self._script(keys=keys, args=args)
        if admitted:
            return None
        return Refusal("requests" if which == 0 else "tokens", int(now), int(before))

    async def close(self) -> None:
        # Nothing is lost with the connection: a slow goodbye must not fail shutdown.
        with contextlib.suppress(RedisError, OSError):
            await self._redis.aclose()


class RateLimiter:
    """Admits each keyed request against its key's limits, or refuses it."""

    def __init__(self, counters: Counters, breaker: Breaker | None = None) -> None:
        self._counters = counters
        # The same "is it down?" rule as the cache's Redis store: after one failure the
        # counters are left alone for a while (memory counters never fail).
        self._breaker = breaker or Breaker(failures=1, open_s=_REDIS_RETRY_S)
        # Where the "local" outage policy counts while the shared counters are away.
        self._local = MemoryCounters()

    async def admit(
        self, key: str, settings: KeySettings, tokens: int, outage: Outage = "open"
    ) -> None:
        """Charge a request of ``tokens`` to ``key``, or refuse it (``LimitRefused``);
        ``outage`` says what to do while the counters' store is unavailable."""
        requests_limit = settings.requests_per_minute or 0
        tokens_limit = settings.tokens_per_minute or 0
        if not requests_limit and not tokens_limit:
            return
        if tokens_limit and tokens > tokens_limit:
            raise TooManyTokens(
                f"this request may use {tokens} tokens (prompt estimate + max_tokens); the "
                f"key {key!r} allows {tokens_limit} per minute: lower max_tokens"
            )
        now = time.time()
        window, share = int(now // WINDOW_S), (now % WINDOW_S) / WINDOW_S
        limits = (requests_limit, tokens_limit)
        refusal = await self._count(key, window, share, limits, tokens, outage)
        if refusal is _UNAVAILABLE:
            refusal = await self._unavailable(outage, key, window, share, limits, tokens)
        if refusal is None:
            return
        limit = requests_limit if refusal.limit == "requests" else tokens_limit
        cost = 1 if refusal.limit == "requests" else tokens
        retry_after_s = retry_after(refusal, limit, cost, share)
        raise RateLimited(
            f"rate limit of key {key!r}: {limit} {refusal.limit} per minute; retry in "
            f"{retry_after_s} s",
            retry_after_s,
        )

    async def _count(
        self,
        key: str,
        window: int,
        share: float,
        limits: tuple[int, int],
        tokens: int,
        outage: Outage,
    ) -> Refusal | None:
        """The counters' verdict, or ``_UNAVAILABLE`` while their store is down (and
        then, for a while after a failure, without asking it)."""
        try:
            ticket = self._breaker.admit()
        except BreakerOpen:
            return _UNAVAILABLE
        try:
            refusal = await self._counters.admit(key, window, share, limits, tokens)
        except (RedisError, OSError) as exc:
            if self._breaker.failed(ticket):
                log.error("%s: their Redis is unavailable: %s", _MEANWHILE[outage], exc)
            return _UNAVAILABLE
        except BaseException:
            self._breaker.abandoned(ticket)
            raise
        if self._breaker.succeeded(ticket):
            log.info("rate limits on again: their Redis answers")
        return refusal

    async def _unavailable(
        self,
        outage: Outage,
        key: str,
        window: int,
        share: float,
        limits: tuple[int, int],
        tokens: int,
    ) -> Refusal | None:
        """The verdict while the counters are away: ``open`` admits (limits protect
        capacity, and an outage of their store must not become one of the API),
        ``local`` counts in this process alone, ``closed`` refuses (``LimitsUnavailable``)."""
        if outage == "local":
            return await self._local.admit(key, window, share, limits, tokens)
        if outage == "closed":
            raise LimitsUnavailable(
                "rate limits are unavailable (their Redis does not answer) and this "
                "gateway refuses limited keys' requests meanwhile; retry shortly",
                _REDIS_RETRY_S,
            )
        return None

    async def close(self) -> None:
        await self._counters.close()


# The counters could not be asked (their store is down), as _count answers it.
_UNAVAILABLE = Refusal("unavailable", 0, 0)
# What the log says becomes of limits during an outage, by policy.
_MEANWHILE: dict[Outage, str] = {
    "open": "rate limits off",
    "local": "rate limits counted by this replica alone",
    "closed": "requests of limited keys refused",
}


def retry_after(refusal: Refusal, limit: int, cost: int, share: float) -> int:
    """Whole seconds until the sliding count leaves room for ``cost`` (at least 1)."""
    elapsed = share * WINDOW_S
    if refusal.now + cost <= limit and refusal.before > 0:
        # The previous window's weight must fall: before * (1 - (elapsed + t) / W).
        wait = WINDOW_S * (1 - (limit - refusal.now - cost) / refusal.before) - elapsed
    else:
        # Not this window: in the next, this window's count weighs in as `before`.
        wait = WINDOW_S - elapsed
        if refusal.now > 0:
            wait += max(0.0, WINDOW_S * (1 - (limit - cost) / refusal.now))
    return max(1, math.ceil(wait))
