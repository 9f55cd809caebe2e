"""A chat request's way through the gateway: exact cache key, one embedding, semantic
cache, route, engine, write-back (DESIGN.md, "the request's way through the code").

The last user turn is embedded at most once: the semantic lookup and the router use
the same vector, and so does the write-back.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Literal

import msgspec

from cache.coalesce import Flight
from cache.entry import Namespace, context_fingerprint, entry_id, sampling_key
from cache.semantic_cache import Hit, SemanticCache
from cache.settings import CacheSettings
from engines.base import Engine, Generation, Message
from engines.fanout import FanOutEngine
from evaluator.loop import LoopResult
from gateway.auth import Caller
from gateway.chat import (
    Answer,
    ChatCall,
    Checked,
    EngineAnswer,
    Finished,
    check,
    new_call,
    new_id,
    unknown_model,
)
from gateway.config import AUTO_MODEL, GatewayConfig
from gateway.errors import APIError
from gateway.openai_types import ChatCompletionRequest
from gateway.runtime import Runtime
from gateway.thinking import Think, conversation_key, requested_deadline_ms
from router.embedder import EmbedderOverloaded, Embedding
from router.router import RouteDecision

log = logging.getLogger("satisfice.gateway")

CACHE_HEADER = "x-satisfice-cache"


class CacheControl(msgspec.Struct, frozen=True):
    lookup: bool = True
    store: bool = True
    only_cached: bool = False  # a miss is an error, not an engine call


def cache_control(headers: Mapping[str, str]) -> CacheControl:
    """Per-request cache control: ``x-satisfice-cache: bypass`` (do not look up),
    ``no-store`` (do not keep the answer), or both; HTTP's own ``Cache-Control:
    no-cache`` / ``no-store`` mean the same, and ``only-if-cached`` answers a miss
    with 504 instead of generating (RFC 9111, 5.2.1.7)."""
    tokens = {t.strip().lower() for t in headers.get(CACHE_HEADER, "").split(",") if t.strip()}
    unknown = tokens - {"bypass", "no-store"}
    if unknown:
        raise APIError(
            400,
            f"{CACHE_HEADER} has {', '.join(sorted(unknown))}; use bypass, no-store or both",
            param=CACHE_HEADER,
        )
    standard = {t.strip().lower() for t in headers.get("cache-control", "").split(",")}
    return CacheControl(
        lookup="bypass" not in tokens and "no-cache" not in standard,
        store="no-store" not in tokens and "no-store" not in standard,
        only_cached="only-if-cached" in standard,
    )


class CachePlan(msgspec.Struct, frozen=True):
    namespace: Namespace
    prompt: str  # the last user turn: what semantic matching compares
    lookup: bool
    store: bool
    settings: CacheSettings  # the request's config and its tenant's threshold


def cache_plan(
    request: ChatCompletionRequest,
    checked: Checked,
    settings: CacheSettings,
    embedding_model: str,
    control: CacheControl,
    tenant: str,
) -> CachePlan | None:
    """How the cache takes part in a request; None when the request cannot use it."""
    params = checked.params
    last = checked.messages[-1]
    # Several samples, token logprobs or an unfinished assistant turn are not
    # answers a cache keeps.
    if params.n > 1 or params.logprobs or last.role != "user":
        return None
    if request.temperature and not settings.cache_sampled:
        return None
    # The tenant scopes every key: no tenant reads or writes another's entries.
    namespace = Namespace(
        tenant=tenant,
        model=request.model,
        context=context_fingerprint([(m.role, m.content) for m in checked.messages[:-1]]),
        embedding=embedding_model,
        sampling=sampling_key(
            request.temperature,
            top_p=params.top_p,
            seed=params.seed,
            stop=params.stop,
            frequency_penalty=params.frequency_penalty,
            presence_penalty=params.presence_penalty,
        ),
    )
    return CachePlan(namespace, last.content, control.lookup, control.store, settings)


class Served(msgspec.Struct, frozen=True, kw_only=True):
    """An answer the gateway already had."""

    answer: Answer
    source: Literal["exact", "semantic", "coalesced"]
    engine: str  # the engine that first produced it
    similarity: float | None = None


CacheStatus = Literal["miss", "bypass", "off"]


class Dispatch(msgspec.Struct, frozen=True, kw_only=True):
    """A request for an engine; ``finished`` must hear its generation (or None)."""

    call: ChatCall
    cache: CacheStatus
    finished: Finished
    # Easy answers the loop may take over when the calibrator doubts them.
    escalate: Think | None = None
    # Milliseconds the conversation's previous turn took to stop, if one was in flight.
    superseded_ms: float | None = None


class Thought(msgspec.Struct, frozen=True, kw_only=True):
    """A hard question for the reasoning loop."""

    think: Think
    cache: CacheStatus
    superseded_ms: float | None = None


async def handle(
    runtime: Runtime,
    config: GatewayConfig,
    caller: Caller,
    request: ChatCompletionRequest,
    headers: Mapping[str, str],
) -> Served | Dispatch | Thought:
    """``config`` is the one in force when the request arrived: a reload during the
    request changes nothing about it."""
    arrived = time.monotonic()
    checked = check(request, runtime.engines, config.server)
    if request.model == AUTO_MODEL and runtime.router is None:
        raise unknown_model(request.model, runtime.engines, " (routing is turned off)")
    asked_ms = requested_deadline_ms(headers)
    if caller.limits is not None:
        await runtime.limiter.admit(
            caller.key or "", caller.limits, checked.prompt_tokens + checked.params.max_tokens
        )
    tenant = caller.tenant
    # A new turn stops the last one's thinking before anything else: it may be asking
    # the same engines.
    conversation = conversation_key(tenant, headers, request.user)
    superseded_ms = await runtime.turns.supersede(conversation)
    cache, plan, control = runtime.cache, None, cache_control(headers)
    if cache is not None and config.cache is not None:
        settings = config.cache
        own = config.tenant(tenant).similarity_threshold
        if own is not None:
            settings = msgspec.structs.replace(settings, similarity_threshold=own)
        plan = cache_plan(request, checked, settings, runtime.embedding_model, control, tenant)
    # The engines that could answer: under overload, when all are full, the request is
    # refused before it is embedded (a semantic hit forgone, but no wait for the
    # embedder, whose CPU the engines need) instead of after.
    if request.model == AUTO_MODEL and config.router is not None:
        candidates = [runtime.engines[config.router.small_engine],
                      runtime.engines[config.router.large_engine]]  # fmt: skip
    else:
        candidates = [runtime.engines[request.model]]
    embedded = Embedded(
        runtime, last_user_turn(checked.messages), before=lambda: _refuse_if_full(candidates)
    )

    status: CacheStatus = "off" if cache is None else "bypass"
    if cache is not None and plan is not None and plan.lookup:
        served = await _from_cache(cache, plan, embedded, checked.params.max_tokens)
        if served is not None:
            return served
        status = "miss"
    if control.only_cached:
        raise APIError(
            504,
            "no cached answer for this request, and Cache-Control: only-if-cached forbids "
            "generating one",
            type="server_error",
            code="cache_miss",
        )

    threshold = config.tenant(tenant).router_threshold
    if threshold is None and config.router is not None:
        threshold = config.router.threshold  # null: the model file's
    decision = None
    if request.model == AUTO_MODEL:
        decision = await route(runtime, embedded, threshold)
    engine = runtime.engines[decision.engine if decision else request.model]
    limits = [config.deadline_ms(tenant, engine.name), asked_ms]
    deadline_ms = min((ms for ms in limits if ms is not None), default=None)
    deadline = None if deadline_ms is None else arrived + deadline_ms / 1000

    flight = None
    if cache is not None and plan is not None and plan.lookup and cache.settings.coalesce:
        key = (plan.namespace.key, entry_id(plan.namespace, plan.prompt), checked.params)
        flight, leads = runtime.flights.join(key)
        if not leads:
            limit_s = None if deadline is None else max(0.0, deadline - time.monotonic())
            served = await _follow(flight, config.engines[engine.name].timeout_s, limit_s)
            if served is not None:
                return served
            flight = None  # the leader got no answer: this request makes its own

    storing = cache is not None and plan is not None and plan.store
    tier = decision.tier if decision is not None else engine.name
    keep = _Keeper(runtime, plan if storing else None, embedded, tier, flight, engine.name)
    think = _think(
        runtime, config, tenant, request, checked, decision, conversation, keep, arrived, asked_ms
    )
    if think is not None and think.escalated_from is None:
        return Thought(think=think, cache=status, superseded_ms=superseded_ms)
    call = new_call(
        request.model, checked, engine, decision, record_logprobs=storing, deadline=deadline
    )
    return Dispatch(
        call=call,
        cache=status,
        finished=keep.generation,
        escalate=think,
        superseded_ms=superseded_ms,
    )


def _think(
    runtime: Runtime,
    config: GatewayConfig,
    tenant: str,
    request: ChatCompletionRequest,
    checked: Checked,
    decision: RouteDecision | None,
    conversation: str | None,
    keep: _Keeper,
    arrived: float,
    asked_ms: int | None,
) -> Think | None:
    """The loop's part in a routed request: all of a hard one; an easy one's, should
    its answer need escalating; none when the loop is off or the request asks for
    several samples or logprobs (the loop answers one choice in plain text)."""
    loop = runtime.loop
    if loop is None or decision is None or checked.params.n > 1 or checked.params.logprobs:
        return None
    if config.loop is not None:
        # The loop as this request's config and tenant tune it.
        own = config.tenant(tenant).loop_threshold
        settings = (
            config.loop if own is None else msgspec.structs.replace(config.loop, threshold=own)
        )
        loop = loop.tuned(settings)
    escalated_from = None if decision.engine == loop.engine.name else decision.engine
    if escalated_from is not None and loop.settings.escalate_below is None:
        return None
    # The loop's own deadline, from the request's arrival, even when it takes over
    # from the small engine.
    limits = [config.deadline_ms(tenant, loop.engine.name), asked_ms]
    deadline_ms = min((ms for ms in limits if ms is not None), default=None)
    return Think(
        id=new_id(),
        created=int(time.time()),
        model=request.model,
        messages=checked.messages,
        include_usage=checked.include_usage,
        max_tokens=checked.params.max_tokens,
        deadline=None if deadline_ms is None else arrived + deadline_ms / 1000,
        fallback=config.fallback(tenant),
        loop=loop,
        difficulty=decision.score,
        conversation=conversation,
        escalated_from=escalated_from,
        finished=keep.loop_result,
    )


class _Keeper:
    """What happens to an answer once given: identical requests waiting for it hear it,
    and, if the request may be stored, a whole answer goes to the cache."""

    def __init__(
        self,
        runtime: Runtime,
        plan: CachePlan | None,
        embedded: Embedded,
        tier: str,
        flight: Flight[EngineAnswer] | None,
        engine: str,
    ) -> None:
        self._runtime, self._plan, self._embedded = runtime, plan, embedded
        self._tier, self._flight, self._engine = tier, flight, engine

    def generation(self, generation: Generation | None) -> None:
        if generation is None:
            return self._keep(None, "", 0.0)
        sample = generation.samples[0]
        answer = Answer(
            text=sample.text,
            finish_reason=sample.finish_reason,
            completion_tokens=sample.completion_tokens,
            prompt_tokens=generation.prompt_tokens,
        )
        # A fallback engine's answer (its engine was unavailable) is shared with
        # identical requests in flight but not cached as the asked engine's answer.
        stand_in = generation.engine != self._engine
        return self._keep(answer, generation.engine, confidence(generation), store=not stand_in)

    def loop_result(self, result: LoopResult | None) -> None:
        # Only the loop's own answer: a fallback's is not what it would have said.
        if result is None or result.trace.fallback != "none":
            return self._keep(None, "", 0.0)
        answer = Answer(
            text=result.text,
            finish_reason="stop",
            completion_tokens=result.answer_tokens,
            prompt_tokens=result.prompt_tokens,
        )
        return self._keep(answer, result.engine, result.trace.confidence)

    def _keep(
        self, answer: Answer | None, engine: str, confidence: float, *, store: bool = True
    ) -> None:
        flight = self._flight
        if flight is not None:
            flight.land(None if answer is None else EngineAnswer(answer, engine))
        if answer is None or self._plan is None or not store:
            if flight is not None:
                flight.end()
            return
        write = _write_back(
            self._runtime, self._plan, self._embedded, answer, engine, confidence, self._tier,
            flight,
        )  # fmt: skip
        self._runtime.in_background(asyncio.ensure_future(write))


async def _from_cache(
    cache: SemanticCache, plan: CachePlan, embedded: Embedded, max_tokens: int
) -> Served | None:
    found, _ = await cache.lookup(plan.namespace, plan.prompt, embedded.get, plan.settings)
    # An answer longer than the client allows is not its answer.
    if not isinstance(found, Hit) or found.entry.completion_tokens > max_tokens:
        return None
    entry = found.entry
    answer = Answer(
        text=entry.response, finish_reason="stop", completion_tokens=entry.completion_tokens
    )
    return Served(answer=answer, source=found.path, engine=entry.model, similarity=found.similarity)


async def _follow(
    flight: Flight[EngineAnswer], engine_timeout_s: float | None, deadline_s: float | None
) -> Served | None:
    """The answer of the identical request in flight, or None if it got none."""
    # Bounded by the engine's own timeout: a leader whose response never started
    # (its client left first) may never land its flight.
    limits = [t for t in (engine_timeout_s, deadline_s) if t is not None]
    try:
        async with asyncio.timeout(min(limits, default=None)):
            shared = await flight.wait()
    except TimeoutError:
        return None
    if shared is None:
        return None
    return Served(answer=shared.answer, source="coalesced", engine=shared.engine)


async def route(
    runtime: Runtime, embedded: Embedded, threshold: float | None = None
) -> RouteDecision:
    assert runtime.router is not None
    embedding = await embedded.get()
    return await runtime.router.decide(embedded.text, embedding, embedded.ms, threshold)


def confidence(generation: Generation) -> float:
    """The answer's geometric-mean token probability: the stand-in for P(correct)
    until the evaluator gives one; 0 when the engine reported no logprobs."""
    logprobs = generation.samples[0].logprobs
    if not logprobs:
        return 0.0
    return math.exp(sum(t.logprob for t in logprobs) / len(logprobs))


async def _write_back(
    runtime: Runtime,
    plan: CachePlan,
    embedded: Embedded,
    answer: Answer,
    engine: str,
    confidence: float,
    tier: str,
    flight: Flight[EngineAnswer] | None,
) -> None:
    cache = runtime.cache
    try:
        # Only whole answers: one cut short by max_tokens or a deadline is not the answer.
        if cache is None or answer.finish_reason != "stop" or not answer.text.strip():
            return
        entry = cache.entry(
            plan.namespace,
            plan.prompt,
            await embedded.get(may_refuse=False),
            response=answer.text,
            model=engine,
            tier=tier,
            confidence=confidence,
            completion_tokens=answer.completion_tokens,
        )
        await cache.put([entry])
    except Exception:  # a failed write-back costs a future hit, never this answer
        log.exception("cache write-back failed")
    finally:
        if flight is not None:
            flight.end()


def last_user_turn(messages: tuple[Message, ...]) -> str:
    return next((m.content for m in reversed(messages) if m.role == "user"), messages[-1].content)


def _refuse_if_full(engines: list[Engine]) -> None:
    """429 now if every one of ``engines`` would refuse a new request."""
    full = [e for e in engines if isinstance(e, FanOutEngine) and e.full]
    if engines and len(full) == len(engines):
        raise full[0].refusal()  # EngineOverloaded: the client hears 429 with Retry-After


class Embedded:
    """The last user turn's embedding, computed on first use and then reused.

    ``before`` runs ahead of the embedding and may refuse the request instead."""

    def __init__(
        self, runtime: Runtime, text: str, before: Callable[[], None] = lambda: None
    ) -> None:
        self._runtime = runtime
        self.text = text
        self._before = before
        self._embedding: Embedding | None = None
        self.ms = 0.0

    async def get(self, *, may_refuse: bool = True) -> Embedding:
        """The embedding; ``may_refuse=False`` for work after the answer (a write-back),
        which ``before`` must not refuse."""
        if self._embedding is None:
            if self._runtime.embedder is None:
                raise RuntimeError("this config has no embedder")
            if may_refuse:
                self._before()
            started = time.perf_counter()
            try:
                self._embedding = await self._runtime.embedder.embed(self.text)
            except EmbedderOverloaded as exc:
                raise APIError(
                    429,
                    str(exc),
                    type="rate_limit_error",
                    code="embedder_overloaded",
                    retry_after_s=1.0,
                ) from None
            self.ms = (time.perf_counter() - started) * 1000
        return self._embedding
