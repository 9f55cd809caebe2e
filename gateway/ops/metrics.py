"""Prometheus metrics of one gateway: its requests, the loop, the cache and the engines.

Each Runtime owns one ``Metrics`` with a registry of its own, so apps built side by
side never share a counter. What the cache and the engines count anyway is read when
``/metrics`` is scraped, not counted a second time on the request's way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Protocol, runtime_checkable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cache.semantic_cache import SemanticCache
from engines.base import Engine
from engines.failover import FailoverEngine
from engines.fanout import FanOutEngine
from engines.openai_http import OpenAIHTTPEngine
from gateway.checks.estimates import LiveEstimates
from gateway.checks.record import CheckRecord
from gateway.pipeline.exchange import Settled

# The text format Prometheus has always scraped (generate_latest writes it).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# The status of a request whose client left before it was answered (nginx's code).
CLIENT_CLOSED = 499

_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120)
_ROUNDS = (1, 2, 3, 4, 5, 6, 8, 10, 15, 20, 30, 50)
_BRANCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_RATIOS = (1, 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
_SWITCH_SECONDS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0)
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
            "Streamed chat completions: seconds from the request to the first body chunk, "
            "by the route that answered",
            ["route"],
            buckets=_SECONDS,
            registry=registry,
        )
        self.interaction = Histogram(
            "satisfice_interaction_latency_seconds",
            "Streamed chat completions: seconds from the request to the first token that "
            "means something to a reader (answer text, a branch's reasoning or a first "
            "answer; not the loop's status notes), by the route that answered",
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
        self.express_hits = Counter(
            "satisfice_express_hits",
            "Exact hits answered before the web framework (server.express_hits); the rest "
            'of satisfice_cache_hits_total{path="exact"} took the framework\'s path',
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
        self.loop_thought_to_output = Histogram(
            "satisfice_loop_thought_to_output_ratio",
            "Tokens the reasoning loop generated per token of the answer it gave",
            buckets=_RATIOS,
            registry=registry,
        )
        self.loop_first_answers = Counter(
            "satisfice_loop_first_answers",
            "Provisional first answers the loop's answer judged: confirmed, replaced, "
            "unfinished (the loop answered first) or withdrawn (no answer in time)",
            ["verdict"],
            registry=registry,
        )
        self.context_switch = Histogram(
            "satisfice_context_switch_seconds",
            "Seconds a new turn of a conversation waited for the last turn's loop to stop",
            buckets=_SWITCH_SECONDS,
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
        self.connections_refused = Counter(
            "satisfice_connections_refused",
            "Connections the server closed for a read limit: idle (not a byte before "
            "header_timeout_s), header (headers too slow: 408), header_size (431), body "
            "(body too slow: 408)",
            ["reason"],
            registry=registry,
        )
        for reason in ("idle", "header", "header_size", "body"):
            self.connections_refused.labels(reason=reason)
        # By tenant, so an SRE sees each tenant's reported false-hit rate (the ratio of
        # the two) over time; only with a cache, like every satisfice_cache_ series.
        self.semantic_hits: Counter | None = None
        self.false_hits: Counter | None = None
        if cache is not None:
            self.semantic_hits = Counter(
                "satisfice_cache_semantic_hits_served",
                "Chat completions answered from a similar prompt's cached answer, by tenant",
                ["tenant"],
                registry=registry,
            )
            self.false_hits = Counter(
                "satisfice_cache_false_hits_reported",
                "Semantic hits reported wrong through /v1/feedback, by tenant",
                ["tenant"],
                registry=registry,
            )
            # The tenant of requests without a key has its series from the first scrape.
            self.semantic_hits.labels(tenant="default")
            self.false_hits.labels(tenant="default")
        self.shadow_checks = Counter(
            "satisfice_shadow_checks",
            "Shortcuts drawn for a background check against the path they skipped, by "
            "tenant, shortcut and what became of the check: checked, dropped (reason: "
            "queue_full, stale, preempted by live traffic, busy engines, stopped) or failed",
            ["tenant", "shortcut", "status", "reason"],
            registry=registry,
        )
        self.policy_shadow = Counter(
            "satisfice_policy_shadow_decisions",
            "Requests a policy version in shadow judged beside the version in force, by "
            "version, part (router, calibrator, verifier) and whether it would have decided "
            "otherwise",
            ["version", "part", "differs"],
            registry=registry,
        )
        registry.register(_Collected(engines, cache))
        self._by_route: dict[tuple[str, int], tuple[Counter, Histogram]] = {}

    def by_route(self, route: str, status: int) -> tuple[Counter, Histogram]:
        """The request counter and latency histogram of a route and status, looked up
        once: the label lookup costs more than the count (routes and statuses are few:
        the tiers, the cache's paths, the statuses the API answers)."""
        children = self._by_route.get((route, status))
        if children is None:
            children = self._by_route[(route, status)] = (
                self.requests.labels(route=route, status=str(status)),
                self.seconds.labels(route=route),
            )
        return children

    def settled(self, settled: Settled) -> None:
        """A chat request has settled: counted once, by the route that answered it."""
        decision, status = settled.decision, settled.status
        requests, timed = self.by_route(decision.route, status)
        requests.inc()
        timed.observe(settled.seconds)
        if settled.first_byte_s is not None:
            self.first_byte.labels(route=decision.route).observe(settled.first_byte_s)
        if settled.first_meaningful_s is not None:
            self.interaction.labels(route=decision.route).observe(settled.first_meaningful_s)
        if decision.superseded_ms is not None:
            self.context_switch.observe(decision.superseded_ms / 1000)
        if decision.cache == "semantic" and status == 200 and self.semantic_hits is not None:
            self.semantic_hits.labels(tenant=decision.tenant).inc()
        trace = decision.loop
        # Late, or 504 deadline_exceeded (as the status, or inside a stream that had begun).
        late = decision.deadline is not None and settled.ended > decision.deadline
        if late or (trace is not None and trace.fallback == "error"):
            self.sla_misses.inc()
        if trace is not None:
            self.loop_rounds.observe(len(trace.rounds))
            self.loop_branches.observe(sum(len(r.branches) for r in trace.rounds))
            self.loop_confidence.observe(trace.confidence)
            self.loop_stops.labels(reason=trace.stop).inc()
            if trace.fallback != "none":
                self.loop_fallbacks.labels(fallback=trace.fallback).inc()
            if trace.thought_to_output is not None:
                self.loop_thought_to_output.observe(trace.thought_to_output)
            if trace.first_answer is not None:
                self.loop_first_answers.labels(verdict=trace.first_answer.verdict).inc()

    def connection_refused(self, reason: str) -> None:
        self.connections_refused.labels(reason=reason).inc()

    def false_hit_reported(self, tenant: str) -> None:
        if self.false_hits is not None:
            self.false_hits.labels(tenant=tenant).inc()

    def checked(self, record: CheckRecord) -> None:
        """A shadow check's record was made."""
        # A failure's reason is free text; a drop's is one of a few words.
        reason = record.reason or "" if record.status == "dropped" else ""
        labels = (record.tenant, record.shortcut or "none", record.status, reason)
        self.shadow_checks.labels(*labels).inc()

    def follow_checks(
        self,
        estimates: Mapping[str, LiveEstimates],
        policy: Callable[[], tuple[str, str]],
        pending: Callable[[], int],
    ) -> None:
        """Show the live estimates (per policy version that decided), the policy
        versions in force and in shadow (``policy()``: their ids, "" for none), and the
        checks drawn and not yet recorded."""
        self.registry.register(_Checks(estimates, policy, pending))

    def shadow_decided(self, version: str, part: str, differs: bool) -> None:
        self.policy_shadow.labels(version, part, "true" if differs else "false").inc()

    def reloaded(self, *, ok: bool) -> None:
        self.config_reloads.labels(result="success" if ok else "failure").inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


@runtime_checkable
class _Slots(Protocol):
    """An engine that generates in this process, and can say so token by token."""

    @property
    def tokens_generated(self) -> int: ...

    @property
    def busy_slots(self) -> int: ...


@runtime_checkable
class _PromptReads(Protocol):
    """An engine that reads prompts in this process, within their deadline."""

    @property
    def prompts_refused(self) -> int: ...

    @property
    def prompts_stopped(self) -> int: ...


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
        sampled = CounterMetricFamily(
            "satisfice_engine_sampled_tokens",
            "Tokens an in-process engine sampled, of every sample, finished or cut short (a "
            "cancelled one up to where it stopped): beyond the completion tokens, work thrown "
            "away",
            labels=["engine"],
        )
        busy = GaugeMetricFamily(
            "satisfice_engine_busy_slots",
            "Generation slots of an in-process engine that are generating now (a cancelled "
            "sample's until it has stopped)",
            labels=["engine"],
        )
        unread = CounterMetricFamily(
            "satisfice_engine_unread_prompts",
            "Samples of an in-process engine that ended before their prompt was read: "
            "refused at once because the prompt could not be read before the deadline at "
            "the engine's measured speed (predicted), or stopped while it was read by the "
            "deadline or a client that left (stopped)",
            labels=["engine", "why"],
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
            if isinstance(engine, _Slots):
                sampled.add_metric([name], engine.tokens_generated)
                busy.add_metric([name], engine.busy_slots)
            if isinstance(engine, _PromptReads):
                unread.add_metric([name, "predicted"], engine.prompts_refused)
                unread.add_metric([name, "stopped"], engine.prompts_stopped)
        yield from (tokens, waiting, overloads, breaker_open, breaker_opens, failovers)
        yield from (sampled, busy, unread)

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
        turned_down = CounterMetricFamily(
            "satisfice_cache_verifier_rejections",
            "Semantic candidates the guards let through but no hit: the verifier's P under "
            "the operating point (verifier), or under the entry's floor raised by reported "
            "false hits (feedback)",
            labels=["stage"],
        )
        turned_down.add_metric(["verifier"], counters.verifier_rejections)
        turned_down.add_metric(["feedback"], counters.feedback_rejections)
        yield turned_down
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
        yield from _near_metrics(cache)


def _near_metrics(cache: SemanticCache) -> Iterator[Metric]:
    """The Redis store's near cache (all 0 for a store without one)."""
    near = cache.store.near_stats()
    yield GaugeMetricFamily(
        "satisfice_cache_near_bytes",
        "Bytes of Redis entries this process holds in its near cache (estimated: text, "
        "vector and a fixed overhead per entry), against its near_cache_bytes bound",
        value=0 if near is None else near.bytes,
    )
    yield GaugeMetricFamily(
        "satisfice_cache_near_entries",
        "Redis entries this process holds in its near cache",
        value=0 if near is None else near.entries,
    )
    lookups = CounterMetricFamily(
        "satisfice_cache_near_lookups",
        "Store reads the near cache answered (hit) or passed on to Redis (miss)",
        labels=["result"],
    )
    lookups.add_metric(["hit"], 0 if near is None else near.hits)
    lookups.add_metric(["miss"], 0 if near is None else near.misses)
    yield lookups
    yield CounterMetricFamily(
        "satisfice_cache_near_evictions",
        "Entries the near cache let go to stay within its bound",
        value=0 if near is None else near.evictions,
    )


class _Checks(Collector):
    """The live estimates of each shortcut's disagreement, read at scrape time."""

    def __init__(
        self,
        estimates: Mapping[str, LiveEstimates],
        policy: Callable[[], tuple[str, str]],
        pending: Callable[[], int],
    ) -> None:
        self._estimates = estimates
        self._policy = policy
        self._pending = pending

    def collect(self) -> Iterator[Metric]:
        labels = ["tenant", "shortcut", "policy"]
        rate = GaugeMetricFamily(
            "satisfice_shortcut_disagreement_ratio",
            "Share of checked shortcuts whose skipped path answered otherwise (weighted by "
            "1/probability drawn), with its 95% interval (bound: estimate, low, high); "
            "agreement with the skipped path, not correctness",
            labels=[*labels, "bound"],
        )
        checks = GaugeMetricFamily(
            "satisfice_shortcut_checks",
            "Shadow checks in the outcome store, by what became of them: decided (the "
            "comparator said agree or disagree), undecided, failed, dropped",
            labels=[*labels, "outcome"],
        )
        n_eff = GaugeMetricFamily(
            "satisfice_shortcut_checks_effective",
            "The effective number of decided checks the interval rests on",
            labels=labels,
        )
        ece = GaugeMetricFamily(
            "satisfice_shortcut_calibration_error",
            "Expected calibration error of P(correct) against agreement with the skipped "
            "path, per shortcut checked with a confidence",
            labels=["shortcut", "policy"],
        )
        for version, estimates in list(self._estimates.items()):
            for e in estimates.snapshot():
                own = [e.tenant, e.shortcut, version]
                if e.rate is not None and e.low is not None and e.high is not None:
                    for bound, value in (("estimate", e.rate), ("low", e.low), ("high", e.high)):
                        rate.add_metric([*own, bound], value)
                n_eff.add_metric(own, e.n_eff)
                for outcome, count in (
                    ("decided", e.n),
                    ("undecided", e.undecided),
                    ("failed", e.failed),
                    ("dropped", sum(e.dropped.values())),
                ):
                    checks.add_metric([*own, outcome], count)
            for c in estimates.calibration():
                if c.ece is not None:
                    ece.add_metric([c.shortcut, version], c.ece)
        active, shadow = self._policy()
        info = GaugeMetricFamily(
            "satisfice_policy_info",
            'The policy version in force (active) and the one in shadow ("" for none)',
            labels=["active", "shadow"],
        )
        info.add_metric([active, shadow], 1)
        pending = GaugeMetricFamily(
            "satisfice_shadow_checks_pending",
            "Shadow checks drawn and not yet recorded: queued, waiting for live work to "
            "leave room, or running",
            value=self._pending(),
        )
        yield from (rate, checks, n_eff, ece, info, pending)
