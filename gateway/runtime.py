"""The live pieces one gateway process builds from its config, and their readiness."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from cache import create_store
from cache.recent_hits import RecentHits
from cache.semantic_cache import SemanticCache
from cache.settings import RedisStoreSettings
from engines import Engine, create_engine
from engines.failover import FailoverEngine
from engines.native_check import LlamaCppUnusable
from evaluator.calibration import calibrator_file, read_calibrator, read_greedy_calibrators
from evaluator.loop import ReasoningLoop
from gateway.checks.estimates import LiveEstimates
from gateway.checks.policies import Policies
from gateway.checks.recent import RecentAnswers
from gateway.checks.shadow import ShadowChecks
from gateway.checks.store import create_outcome_store
from gateway.checks.versions import create_policy_store
from gateway.config import GatewayConfig
from gateway.config.shadow import ShadowSettings
from gateway.ops import logs
from gateway.ops.keys import KeyTable
from gateway.ops.limits import MemoryCounters, RateLimiter, RedisCounters
from gateway.ops.metrics import Metrics
from gateway.pipeline.exchange import Settled, Settlement
from gateway.pipeline.keeping import WriteBack
from gateway.pipeline.pipeline import Pipeline
from router.embedder import Embedder
from router.router import Router

log = logging.getLogger("satisfice.gateway")

# How often the live estimates read what was added to the outcome store, and the
# policy version in force is checked against the policy store's state.
STORES_POLL_S = 5.0


class Runtime:
    """Engines by model name, the embedder, router and cache; ready once all have loaded."""

    def __init__(self, config: GatewayConfig) -> None:
        # The config now in force, and its keys: replaced whole by apply() on a reload;
        # a request reads them once, at its start, and keeps them to its end.
        self.config = config
        self.keys = KeyTable(config.auth, config.server.admin_key)
        models_dir = Path(config.models_dir).expanduser()
        built = {
            name: create_engine(name, settings, models_dir)
            for name, settings in config.engines.items()
        }
        # An engine with a fallback is served through it while unavailable.
        self.engines: dict[str, Engine] = {
            name: engine if (spare := config.engines[name].fallback) is None
            else FailoverEngine(engine, built[spare])
            for name, engine in built.items()
        }  # fmt: skip
        # One embedder serves the cache and the router: a prompt is embedded once.
        needs_embedder = config.router is not None or config.cache is not None
        self.embedder = Embedder(config.embedder, models_dir) if needs_embedder else None
        self.router: Router | None = None
        if config.router is not None and self.embedder is not None:
            self.router = Router(config.router, self.embedder)
        self.cache: SemanticCache | None = None
        if config.cache is not None:
            self.cache = SemanticCache(config.cache, create_store(config.cache))
        # Hard questions think on the large engine; the small one is the fallback.
        self.loop: ReasoningLoop | None = None
        if config.loop is not None and config.router is not None:
            name = config.loop.calibrator
            calibrator = None if name is None else read_calibrator(calibrator_file(name))
            # P(greedy right) for the greedy_first pass, read only when it is on.
            name = config.loop.greedy_calibrator_in_use()
            greedy = None if name is None else read_greedy_calibrators(name)
            self.loop = ReasoningLoop(
                self.engines[config.router.large_engine],
                config.loop,
                calibrator,
                small=self.engines[config.router.small_engine],
                greedy_calibrators=greedy,
            )
        self.pipeline = Pipeline(
            engines=self.engines,
            engine_timeouts_s={name: e.timeout_s for name, e in config.engines.items()},
            embedder=self.embedder,
            router=self.router,
            cache=self.cache,
            loop=self.loop,
        )
        # Semantic hits this replica served, for feedback by request id.
        self.recent_hits = RecentHits()
        self.limiter = RateLimiter(_counters(config))
        self.metrics = Metrics(self.engines, self.cache)
        # Write-backs run after their response has gone; kept here so they finish.
        self.background: set[asyncio.Task[None]] = set()
        # Where every chat request ends up, once, and who hears of it.
        # (The app subscribes the trace span when it traces: gateway.api.app.)
        self.settlement = Settlement()
        self.settlement.subscribe(self.metrics.settled)
        if config.server.access_log:
            self.settlement.subscribe(logs.access)
        if self.cache is not None:
            self.settlement.subscribe(WriteBack(self.cache, self.in_background))
            self.settlement.subscribe(self._remember_semantic_hit)
        self.settlement.subscribe(self.pipeline.live.settled)
        # Shadow checks: off until the config gives a share (a reload may turn them on).
        # Feedback verdicts go to the same outcome store, checks on or off.
        shadow = config.shadow or ShadowSettings()
        self.outcomes = create_outcome_store(shadow, config.cache)
        # The live estimates, per policy version that decided the shortcuts checked.
        self.estimates: dict[str, LiveEstimates] = {}
        self.checks = ShadowChecks(
            self.pipeline,
            self.outcomes,
            shadow,
            share_of=lambda tenant, shortcut: self.config.shadow_share(tenant, shortcut),
            recorded=self.metrics.checked,
        )
        self.settlement.subscribe(self.checks.settled)
        # Answers this replica gave, for verdicts on them by request id.
        self.recent_answers = RecentAnswers()
        self.settlement.subscribe(self.recent_answers.settled)
        self._follower: asyncio.Task[None] | None = None
        # Policy versions refitted from the checks: the one in force, one in shadow.
        self.policies = Policies(
            create_policy_store(shadow, config.cache),
            router=self.router,
            loop=self.pipeline.loop,
            cache=self.cache,
            decided=self.metrics.shadow_decided,
        )
        self.settlement.subscribe(self.policies.settled)
        self.metrics.follow_checks(
            self.estimates,
            lambda: (self.policies.active, self.policies.state.shadow or ""),
            lambda: self.checks.pending,
        )
        self.ready = False
        self.failure: str | None = None

    def apply(self, config: GatewayConfig, keys: KeyTable) -> None:
        """Put a reloaded config in force for the requests that start from now on.

        One synchronous step, so no request sees half of it. ``config`` differs from
        the one in force only in what can change while serving (gateway.reload)."""
        self.config, self.keys = config, keys
        if self.router is not None and config.router is not None:
            self.router.settings = config.router
        if self.cache is not None and config.cache is not None:
            self.cache.settings = config.cache
        if self.loop is not None and config.loop is not None:
            # A running loop keeps the copy it started with.
            self.loop = self.loop.tuned(config.loop)
        self.checks.settings = config.shadow or ShadowSettings()

    def _remember_semantic_hit(self, settled: Settled) -> None:
        """A semantic hit served, kept for feedback on it by request id."""
        decision = settled.decision
        rid, entry = settled.request_id, decision.cache_entry
        served = decision.cache == "semantic" and settled.status == 200
        if served and entry is not None and rid is not None:
            self.recent_hits.add(decision.tenant, rid, entry, decision.cache_score)

    async def _start_embedder_and_users(self) -> None:
        if self.embedder is not None:
            await self.embedder.start()
        if self.router is not None:
            await self.router.start()
        if self.cache is not None:
            if self.cache.verification is not None and self.embedder is not None:
                self.cache.verification.check(self.embedder.fingerprint)
            await self.cache.start()

    async def start(self) -> None:
        try:
            await asyncio.gather(
                self._start_embedder_and_users(),
                *(engine.start() for engine in self.engines.values()),
            )
        except LlamaCppUnusable as exc:
            self.failure = f"{type(exc).__name__}: {exc}"
            log.error("failed to start: %s", exc)  # the message says it all; no traceback
            return
        except Exception as exc:
            self.failure = f"{type(exc).__name__}: {exc}"
            log.exception("failed to start")
            return
        self.policies.started()
        try:
            await self.policies.sync()
        except Exception:  # the shipped parts serve until the store answers
            log.exception("the policy store could not be read; the shipped policy serves")
        self.checks.start()
        self._follower = asyncio.get_running_loop().create_task(self._follow_stores())
        self.ready = True
        log.info("ready: %s", ", ".join(self.engines))

    @property
    def policy_version(self) -> str:
        """The policy version in force (gateway.checks.policies)."""
        return self.policies.active

    async def _follow_stores(self) -> None:
        """Keep the live estimates in step with the outcome store (what this replica
        and every other one recorded, read as it comes) and the policy version in step
        with the policy store's state (a move made on another replica, or the CLI)."""
        while True:
            try:
                for record in await self.outcomes.tail():
                    self.estimates.setdefault(record.policy, LiveEstimates()).add(record)
            except Exception:
                log.exception("the outcome store could not be read; estimates wait")
            try:
                await self.policies.sync()
            except Exception:
                log.exception("the policy store could not be read; the policy stays")
            await asyncio.sleep(STORES_POLL_S)

    def in_background(self, task: asyncio.Task[None]) -> None:
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def close(self) -> None:
        self.ready = False
        await self.checks.close()
        if self._follower is not None:
            self._follower.cancel()
            await asyncio.gather(self._follower, return_exceptions=True)
        if self.background:
            await asyncio.wait(self.background, timeout=5)
        closing = [engine.close() for engine in self.engines.values()]
        closing.append(self.limiter.close())
        closing.append(self.outcomes.close())
        closing.append(self.policies.store.close())
        if self.cache is not None:
            closing.append(self.cache.close())
        if self.embedder is not None:
            closing.append(self.embedder.close())
        await asyncio.gather(*closing)


def _counters(config: GatewayConfig) -> MemoryCounters | RedisCounters:
    """Where rate limits are counted: auth.rate_limit_url, else the cache's Redis."""
    url = config.auth.rate_limit_url
    store = config.cache.store if config.cache is not None else None
    if url is None and isinstance(store, RedisStoreSettings):
        return RedisCounters(store.url, store.key_prefix)
    return MemoryCounters() if url is None else RedisCounters(url)
