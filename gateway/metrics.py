"""Prometheus metrics of one gateway: its requests, the loop, the cache and the engines.

Each Runtime owns one ``Metrics`` with a registry of its own, so apps built side by
side never share a counter. What the cache and the engines count anyway is read when
``/metrics`` is scraped, not counted a second time on the request's way.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterable, Callable, Iterator, Mapping

from litestar.exceptions import HTTPException
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cache.semantic_cache import SemanticCache
from engines.base import Engine, EngineError
from engines.failover import FailoverEngine
from engines.fanout import FanOutEngine
from engines.openai_http import OpenAIHTTPEngine
from evaluator.loop import LoopResult
from gateway.errors import APIError

# The text format Prometheus has always scraped (generate_latest writes it).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# The route of a request that failed before it had one (bad input, not ready, ...).
NO_ROUTE = "error"
# The status of a request whose client left before it was answered (nginx's code).
CLIENT_CLOSED = 499

_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120)
_ROUNDS = (1, 2, 3, 4, 5, 6, 8, 10, 15, 20, 30, 50)
_BRANCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_CONFIDENCE = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)


class Metrics:
    def __init__(self, engines: Mapping[str, Engine], cache: SemanticCache | None) -> None:
        self.registry = registry = CollectorRegistry()
        self.requests = Counter(
            "satisfice_requests",
            "Chat completion requests by the route that answered (exact, semantic, "
            "coalesced, an engine's tier or name, loop, fallback; error: failed before "
            "it had a route) and HTTP status (499: the client left first)",
            ["route", "status"],
            registry=registry,
        )
        self.first_byte = Histogram(
            "satisfice_time_to_first_byte_seconds",
            "Streamed chat completions: seconds from the request to the first body chunk "
            "(by the route known then: a loop's stream counts as loop)",
            ["route"],
            buckets=_SECONDS,
            registry=registry,
        )
        self.seconds = Histogram(
            "satisfice_request_seconds",
            "Chat completions: seconds from the request to its last byte",
            ["route"],
            buckets=_SECONDS,
            registry=registry,
        )
        self.sla_misses = Counter(
            "satisfice_sla_misses",
            "Chat completions that ended after their deadline, or answered 504 deadline_exceeded",
            registry=registry,
        )
        self.loop_rounds = Histogram(
            "satisfice_loop_rounds",
            "Rounds the reasoning loop ran per question",
            buckets=_ROUNDS,
            registry=registry,
        )
        self.loop_branches = Histogram(
            "satisfice_loop_branches",
            "Branches the reasoning loop ran per question, over all its rounds",
            buckets=_BRANCHES,
            registry=registry,
        )
        self.loop_confidence = Histogram(
            "satisfice_loop_confidence",
            "Calibrated P(correct) of the loop's answer when it stopped (0 for the small "
            "model's fallback answer and for errors)",
            buckets=_CONFIDENCE,
            registry=registry,
        )
        self.loop_stops = Counter(
            "satisfice_loop_stops",
            "Why the reasoning loop stopped",
            ["reason"],
            registry=registry,
        )
        self.loop_fallbacks = Counter(
            "satisfice_loop_fallbacks",
            "Loop answers given by a fallback at the deadline (best, small or error)",
            ["fallback"],
            registry=registry,
        )
        self.config_reloads = Counter(
            "satisfice_config_reloads",
            "Config reloads (SIGHUP or a changed file) by result: success, or failure "
            "(the last good config stayed)",
            ["result"],
            registry=registry,
        )
        for result in ("success", "failure"):
            self.config_reloads.labels(result=result)
        registry.register(_Collected(engines, cache))

    def exchange(self, on_end: Callable[[Exchange, int, float], None] | None = None) -> Exchange:
        return Exchange(self, on_end)

    def refused(self, status: int) -> None:
        """A chat request refused before the handler ran (its body unreadable)."""
        self.requests.labels(route=NO_ROUTE, status=str(status)).inc()

    def reloaded(self, *, ok: bool) -> None:
        self.config_reloads.labels(result="success" if ok else "failure").inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def status_of(exc: BaseException) -> int:
    """The HTTP status the client gets for an exception out of a chat request."""
    if isinstance(exc, APIError):
        return exc.status
    if isinstance(exc, EngineError):
        return APIError.from_engine(exc).status
    if isinstance(exc, HTTPException):
        return exc.status_code
    if isinstance(exc, asyncio.CancelledError):
        return CLIENT_CLOSED
    return 500


class Exchange:
    """One chat request as the metrics see it: its route once known, the loop's trace
    if it thought, and its end, recorded once. ``on_end`` hears the end too (status,
    seconds): the access log."""

    def __init__(
        self, metrics: Metrics, on_end: Callable[[Exchange, int, float], None] | None = None
    ) -> None:
        self._metrics = metrics
        self._on_end = on_end
        # Why the loop stopped, and its fallback; None when the loop did not answer.
        self.stop: str | None = None
        self.fallback: str | None = None
        # The loop's rounds and its answer's confidence, for the request's trace span.
        self.rounds: int | None = None
        self.confidence: float | None = None
        self._started = time.monotonic()
        self.route = NO_ROUTE
        self._deadline: float | None = None
        self._deadline_error = False
        self._ended = False

    def routed(self, route: str, deadline: float | None = None) -> None:
        """The path that answers, and its deadline (``time.monotonic()`` seconds)."""
        self.route, self._deadline = route, deadline

    def thought(self, result: LoopResult | None) -> None:
        """The loop's result (None when it gave none)."""
        if result is None:
            return
        trace, metrics = result.trace, self._metrics
        self.stop, self.fallback = trace.stop, trace.fallback
        self.rounds, self.confidence = len(trace.rounds), trace.confidence
        metrics.loop_rounds.observe(len(trace.rounds))
        metrics.loop_branches.observe(sum(len(r.branches) for r in trace.rounds))
        metrics.loop_confidence.observe(trace.confidence)
        metrics.loop_stops.labels(reason=trace.stop).inc()
        if trace.fallback != "none":
            self.route = "fallback"
            metrics.loop_fallbacks.labels(fallback=trace.fallback).inc()
        # 504 deadline_exceeded, as the status or inside a stream that had begun.
        self._deadline_error = trace.fallback == "error"

    def answered(self, status: int) -> None:
        self._end(status)

    def failed(self, exc: BaseException) -> None:
        self._end(status_of(exc))

    async def streamed(self, body: AsyncIterable[str | bytes]) -> AsyncGenerator[str | bytes]:
        """``body`` as it is sent, timing its first chunk and its end."""
        first = True
        try:
            async for chunk in body:
                if first:
                    first = False
                    elapsed = time.monotonic() - self._started
                    self._metrics.first_byte.labels(route=self.route).observe(elapsed)
                yield chunk
        finally:
            # Closed early (the client left), the body must stop its work now.
            if isinstance(body, AsyncGenerator):
                await body.aclose()
            self._end(200)

    def _end(self, status: int) -> None:
        if self._ended:
            return
        self._ended = True
        now, metrics = time.monotonic(), self._metrics
        metrics.requests.labels(route=self.route, status=str(status)).inc()
        metrics.seconds.labels(route=self.route).observe(now - self._started)
        late = self._deadline is not None and now > self._deadline
        if late or self._deadline_error:
            metrics.sla_misses.inc()
        if self._on_end is not None:
            self._on_end(self, status, now - self._started)


class _Collected(Collector):
    """The cache's and the engines' own counts, read at scrape time."""

    def __init__(self, engines: Mapping[str, Engine], cache: SemanticCache | None) -> None:
        self._engines = engines
        self._cache = cache

    def collect(self) -> Iterator[Metric]:
        yield from self._engine_metrics()
        if self._cache is not None:
            yield from self._cache_metrics(self._cache)

    def _engine_metrics(self) -> Iterator[Metric]:
        tokens = CounterMetricFamily(
            "satisfice_engine_tokens",
            "Tokens the engines processed: the prompt of every sample and what it generated",
            labels=["engine", "kind"],
        )
        waiting = GaugeMetricFamily(
            "satisfice_engine_queue_depth",
            "Samples waiting for one of the engine's generation slots",
            labels=["engine"],
        )
        overloads = CounterMetricFamily(
            "satisfice_engine_overloads",
            "Calls the engine refused as overloaded (its queue full, or its server's "
            "429/503); a client hears 429 unless the loop had an answer already",
            labels=["engine"],
        )
        breaker_open = GaugeMetricFamily(
            "satisfice_engine_breaker_open",
            "1 while the engine's circuit breaker is open or half-open (calls fail at once "
            "or one trial call probes the server); 0 while closed, or with no breaker",
            labels=["engine"],
        )
        breaker_opens = CounterMetricFamily(
            "satisfice_engine_breaker_opens",
            "Times the engine's circuit breaker opened after consecutive failures",
            labels=["engine"],
        )
        failovers = CounterMetricFamily(
            "satisfice_engine_failovers",
            "Requests for the engine that its fallback engine answered while it was unavailable",
            labels=["engine"],
        )
        for name, engine in self._engines.items():
            # Every engine has every series, at 0 where it has no breaker or fallback,
            # so that rates and alerts work from the first scrape.
            answered_instead = 0
            if isinstance(engine, FailoverEngine):
                answered_instead, engine = engine.failovers, engine.primary
            failovers.add_metric([name], answered_instead)
            breaker = engine.breaker if isinstance(engine, OpenAIHTTPEngine) else None
            is_open = breaker is not None and breaker.state != "closed"
            breaker_open.add_metric([name], float(is_open))
            breaker_opens.add_metric([name], 0 if breaker is None else breaker.opened)
            if not isinstance(engine, FanOutEngine):
                continue
            counters = engine.counters
            tokens.add_metric([name, "prompt"], counters.prompt_tokens)
            tokens.add_metric([name, "completion"], counters.completion_tokens)
            waiting.add_metric([name], engine.waiting)
            overloads.add_metric([name], counters.overloads)
        yield from (tokens, waiting, overloads, breaker_open, breaker_opens, failovers)

    @staticmethod
    def _cache_metrics(cache: SemanticCache) -> Iterator[Metric]:
        counters = cache.counters
        hits = CounterMetricFamily(
            "satisfice_cache_hits", "Cache lookups answered, by path", labels=["path"]
        )
        hits.add_metric(["exact"], counters.exact_hits)
        hits.add_metric(["semantic"], counters.semantic_hits)
        yield hits
        yield CounterMetricFamily(
            "satisfice_cache_misses",
            "Cache lookups that found no answer (guard rejections included)",
            value=counters.misses,
        )
        guards = CounterMetricFamily(
            "satisfice_cache_guard_rejections",
            "Semantic matches near enough but vetoed by a false-hit guard, by guard",
            labels=["guard"],
        )
        for guard, count in sorted(counters.guard_rejections.items()):
            guards.add_metric([guard], count)
        yield guards
        yield CounterMetricFamily(
            "satisfice_cache_writes",
            "Answers written to the cache",
            value=counters.writes,
        )
        yield CounterMetricFamily(
            "satisfice_cache_store_unavailable",
            "Cache store calls that failed because the store was unavailable",
            value=counters.store_unavailable,
        )
