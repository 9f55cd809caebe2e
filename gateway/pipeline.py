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
from collections.abc import Mapping
from typing import Literal

import msgspec

from cache.coalesce import Flight
from cache.entry import Namespace, context_fingerprint, entry_id, sampling_key
from cache.semantic_cache import Hit, SemanticCache
from cache.settings import CacheSettings
from engines.base import Generation, Message
from gateway.chat import Answer, ChatCall, Checked, Finished, check, new_call, unknown_model
from gateway.config import AUTO_MODEL
from gateway.errors import APIError
from gateway.openai_types import ChatCompletionRequest
from gateway.runtime import Runtime
from router.embedder import Embedding
from router.router import RouteDecision

log = logging.getLogger("satisfice.gateway")

CACHE_HEADER = "x-satisfice-cache"
# Until there is a tenant per API key, every request shares one tenant's namespace.
DEFAULT_TENANT = "default"


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


def cache_plan(
    request: ChatCompletionRequest,
    checked: Checked,
    settings: CacheSettings,
    embedding_model: str,
    control: CacheControl,
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
    namespace = Namespace(
        tenant=DEFAULT_TENANT,
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
    return CachePlan(namespace, last.content, control.lookup, control.store)


class Served(msgspec.Struct, frozen=True, kw_only=True):
    """An answer the gateway already had."""

    answer: Answer
    source: Literal["exact", "semantic", "coalesced"]
    engine: str  # the engine that first produced it
    similarity: float | None = None


class Dispatch(msgspec.Struct, frozen=True, kw_only=True):
    """A request for an engine; ``finished`` must hear its generation (or None)."""

    call: ChatCall
    cache: Literal["miss", "bypass", "off"]
    finished: Finished


async def handle(
    runtime: Runtime, request: ChatCompletionRequest, headers: Mapping[str, str]
) -> Served | Dispatch:
    checked = check(request, runtime.engines, runtime.config.server)
    if request.model == AUTO_MODEL and runtime.router is None:
        raise unknown_model(request.model, runtime.engines, " (routing is turned off)")
    cache, plan, control = runtime.cache, None, cache_control(headers)
    if cache is not None:
        plan = cache_plan(request, checked, cache.settings, runtime.embedding_model, control)
    embedded = Embedded(runtime, last_user_turn(checked.messages))

    status: Literal["miss", "bypass", "off"] = "off" if cache is None else "bypass"
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

    decision = await route(runtime, embedded) if request.model == AUTO_MODEL else None
    engine = runtime.engines[decision.engine if decision else request.model]

    flight = None
    if cache is not None and plan is not None and plan.lookup and cache.settings.coalesce:
        key = (plan.namespace.key, entry_id(plan.namespace, plan.prompt), checked.params)
        flight, leads = runtime.flights.join(key)
        if not leads:
            served = await _follow(flight, runtime.config.engines[engine.name].timeout_s)
            if served is not None:
                return served
            flight = None  # the leader got no answer: this request makes its own

    storing = cache is not None and plan is not None and plan.store
    call = new_call(request.model, checked, engine, decision, record_logprobs=storing)

    def finished(generation: Generation | None) -> None:
        if flight is not None:
            flight.land(generation)
        if generation is None or not storing or plan is None:
            if flight is not None:
                flight.end()
            return
        tier = decision.tier if decision is not None else engine.name
        write = _write_back(runtime, plan, embedded, generation, tier, flight)
        runtime.in_background(asyncio.ensure_future(write))

    return Dispatch(call=call, cache=status, finished=finished)


async def _from_cache(
    cache: SemanticCache, plan: CachePlan, embedded: Embedded, max_tokens: int
) -> Served | None:
    found, _ = await cache.lookup(plan.namespace, plan.prompt, embedded.get)
    # An answer longer than the client allows is not its answer.
    if not isinstance(found, Hit) or found.entry.completion_tokens > max_tokens:
        return None
    entry = found.entry
    answer = Answer(
        text=entry.response, finish_reason="stop", completion_tokens=entry.completion_tokens
    )
    return Served(answer=answer, source=found.path, engine=entry.model, similarity=found.similarity)


async def _follow(flight: Flight[Generation], limit_s: float | None) -> Served | None:
    """The answer of the identical request in flight, or None if it got none."""
    # Bounded by the engine's own timeout: a leader whose response never started
    # (its client left first) may never land its flight.
    try:
        async with asyncio.timeout(limit_s):
            generation = await flight.wait()
    except TimeoutError:
        return None
    if generation is None:
        return None
    sample = generation.samples[0]
    answer = Answer(
        text=sample.text,
        finish_reason=sample.finish_reason,
        completion_tokens=sample.completion_tokens,
        prompt_tokens=generation.prompt_tokens,
    )
    return Served(answer=answer, source="coalesced", engine=generation.engine)


async def route(runtime: Runtime, embedded: Embedded) -> RouteDecision:
    assert runtime.router is not None
    embedding = await embedded.get()
    return await runtime.router.decide(embedded.text, embedding, embedded.ms)


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
    generation: Generation,
    tier: str,
    flight: Flight[Generation] | None,
) -> None:
    try:
        await _store(runtime, plan, embedded, generation, tier)
    except Exception:  # a failed write-back costs a future hit, never this answer
        log.exception("cache write-back failed")
    finally:
        if flight is not None:
            flight.end()


async def _store(
    runtime: Runtime, plan: CachePlan, embedded: Embedded, generation: Generation, tier: str
) -> None:
    cache = runtime.cache
    sample = generation.samples[0]
    # Only whole answers: one cut short by max_tokens or a deadline is not the answer.
    if cache is None or sample.finish_reason != "stop" or not sample.text.strip():
        return
    entry = cache.entry(
        plan.namespace,
        plan.prompt,
        await embedded.get(),
        response=sample.text,
        model=generation.engine,
        tier=tier,
        confidence=confidence(generation),
        completion_tokens=sample.completion_tokens,
    )
    await cache.put([entry])


def last_user_turn(messages: tuple[Message, ...]) -> str:
    return next((m.content for m in reversed(messages) if m.role == "user"), messages[-1].content)


class Embedded:
    """The last user turn's embedding, computed on first use and then reused."""

    def __init__(self, runtime: Runtime, text: str) -> None:
        self._runtime = runtime
        self.text = text
        self._embedding: Embedding | None = None
        self.ms = 0.0

    async def get(self) -> Embedding:
        if self._embedding is None:
            if self._runtime.embedder is None:
                raise RuntimeError("this config has no embedder")
            started = time.perf_counter()
            self._embedding = await self._runtime.embedder.embed(self.text)
            self.ms = (time.perf_counter() - started) * 1000
        return self._embedding
