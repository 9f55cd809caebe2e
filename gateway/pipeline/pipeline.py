"""Steps 1-7 of a chat request (docs/architecture.md, "The request's way through the
code"), in order:

1. the exact cache key; 2. the last user turn embedded once, when something needs it;
3. the semantic cache; 4. the router's difficulty; 5a. the engine, whose answer the
evaluator may escalate, or 5b. the reasoning loop; 6. the write-back; 7. the outcome.

The embedding of step 2 is computed on first use and reused: the semantic lookup, the
router and the write-back share one vector.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING

import msgspec

from cache.coalesce import Coalescer, Flight
from cache.entry import Namespace, context_fingerprint, entry_id, sampling_key
from cache.semantic_cache import Hit, Miss
from engines.base import Delta, Engine, Generation
from evaluator.loop import Fallback, LoopResult, ReasoningLoop, Thinking
from gateway.config import AUTO_MODEL
from gateway.pipeline.keeper import Answer, CachePlan, Keeper, SharedAnswer
from gateway.pipeline.lead import Lead
from gateway.pipeline.outcome import (
    Decision,
    Event,
    Finished,
    Outcome,
    Reasoning,
    Refused,
    TextDelta,
)
from gateway.pipeline.policy import Policy
from gateway.pipeline.request import ChatRequest
from gateway.pipeline.turns import LoopRun, Superseded, Turns
from router.embedder import EmbedderOverloaded, Embedding
from router.router import RouteDecision

if TYPE_CHECKING:
    from gateway.runtime import Runtime


class Pipeline:
    """One runtime's request path. It keeps what requests share while they run: the
    conversations whose loops are in flight, and the identical requests in flight."""

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime
        self.turns = Turns()
        self._flights: Coalescer[SharedAnswer] = Coalescer()

    async def run(self, request: ChatRequest, policy: Policy, decision: Decision) -> Outcome:
        """``request``'s answer as events, and ``decision`` filled in as far as it is known
        when the answer begins (so that whoever made it reads it even when this raises).
        Raises ``Refused`` or the engine's error when there is no answer to begin."""
        runtime = self._runtime
        if request.model == AUTO_MODEL and runtime.router is None:
            raise Refused("model_not_found", "routing is turned off", param="model")
        # A new turn stops the last one's thinking first: it may be asking the same engines.
        decision.superseded_ms = await self.turns.supersede(policy.conversation)
        plan = self._cache_plan(request, policy)
        embedded = Embedded(runtime, request.last_user_turn, self._candidates(request))

        # 1-3: the cache, exact then semantic.
        decision.cache = "off" if runtime.cache is None else "bypass"
        if plan is not None and plan.lookup:
            answer = await self._cached(plan, policy, embedded, request, decision)
            if answer is not None:
                return Outcome(decision, _told(answer))
            decision.cache = "miss"
        if policy.control.only_cached:
            raise Refused(
                "cache_miss",
                "no cached answer for this request, and Cache-Control: only-if-cached "
                "forbids generating one",
            )
        # 4: where it goes.
        route = None
        if request.model == AUTO_MODEL:
            route = await self._route(embedded, policy)
            decision.difficulty = route.score
        engine = runtime.engines[route.engine if route is not None else request.model]
        decision.route = route.tier if route is not None else engine.name
        decision.engine = engine.name
        decision.deadline = policy.deadline(engine.name)

        # An identical request in flight answers this one too.
        flight, shared = await self._coalesce(plan, policy, request, engine, decision.deadline)
        if shared is not None:
            decision.cache = decision.route = "coalesced"
            decision.engine = shared.engine
            return Outcome(decision, _told(shared.answer))

        # 5-6: the answer, and what becomes of it.
        keeper = Keeper(
            runtime.cache, plan, lambda: embedded.get(may_refuse=False), flight,
            runtime.in_background,
        )  # fmt: skip
        answering = self._answer(request, policy, route, engine, decision, keeper)
        if flight is not None:  # identical requests wait for this answer too
            return Outcome(decision, await Lead(flight, keeper, answering).events())
        try:
            events = await answering
        except BaseException:
            keeper.settle(None)
            raise
        return Outcome(decision, events)

    def exact_at_hand(
        self, request: ChatRequest, policy: Policy, decision: Decision
    ) -> tuple[Outcome, Hit] | None:
        """Step 1 alone, when this process holds the answer and nothing else need run:
        what ``run`` would answer, decided in one synchronous step (the HTTP layer's
        express path). None: ``run`` must decide, which may still find an exact hit
        (in the store) or answer otherwise. The hit is not counted: the caller counts
        it when it serves it (``SemanticCache.note_exact_hit``)."""
        cache = self._runtime.cache
        if cache is None or policy.conversation is not None:
            return None  # a conversation's turn first stops the last one's thinking
        if request.model == AUTO_MODEL and self._runtime.router is None:
            return None
        plan = self._cache_plan(request, policy)
        if plan is None or not plan.lookup:
            return None
        found = cache.exact_at_hand(plan.namespace, plan.prompt, policy.cache)
        if found is None or found.entry.completion_tokens > request.params.max_tokens:
            return None
        if not policy.control.fresh(found.entry.created_at):
            return None
        decision.cache = decision.route = found.path
        return Outcome(decision, _told(_served(found, decision))), found

    # -- 1-3: the cache ------------------------------------------------------------

    def _cache_plan(self, request: ChatRequest, policy: Policy) -> CachePlan | None:
        """How the cache takes part in a request; None when the request cannot use it."""
        if self._runtime.cache is None or policy.cache is None:
            return None
        params, last = request.params, request.messages[-1]
        # Several samples, token logprobs or an unfinished assistant turn are not
        # answers a cache keeps.
        if params.n > 1 or params.logprobs or last.role != "user":
            return None
        if params.temperature and not policy.cache.cache_sampled:
            return None
        # The tenant scopes every key: no tenant reads or writes another's entries.
        namespace = Namespace(
            tenant=policy.tenant,
            model=request.model,
            context=_context(request),
            embedding=self._runtime.embedding_model,
            sampling=sampling_key(
                params.temperature,
                top_p=params.top_p,
                seed=params.seed,
                stop=params.stop,
                frequency_penalty=params.frequency_penalty,
                presence_penalty=params.presence_penalty,
            ),
        )
        control = policy.control
        return CachePlan(namespace, last.content, control.lookup, control.store)

    async def _cached(
        self,
        plan: CachePlan,
        policy: Policy,
        embedded: Embedded,
        request: ChatRequest,
        decision: Decision,
    ) -> Answer | None:
        cache = self._runtime.cache
        assert cache is not None
        found = await cache.lookup(plan.namespace, plan.prompt, embedded.get, policy.cache)
        if isinstance(found, Miss):
            decision.cache_stage = found.reason
            decision.cache_entry = found.candidate
            decision.similarity = found.candidate_similarity
            decision.cache_score = found.score
            return None
        # An answer longer than the client allows is not its answer, nor one older
        # than its Cache-Control: max-age.
        if found.entry.completion_tokens > request.params.max_tokens:
            decision.cache_stage = "too_long"
            return None
        if not policy.control.fresh(found.entry.created_at):
            decision.cache_stage = "too_old"
            return None
        decision.cache = decision.route = found.path
        return _served(found, decision)

    async def _coalesce(
        self,
        plan: CachePlan | None,
        policy: Policy,
        request: ChatRequest,
        engine: Engine,
        deadline: float | None,
    ) -> tuple[Flight[SharedAnswer] | None, SharedAnswer | None]:
        """The flight this request leads, or else the answer of the identical request
        that leads it (None, None: no coalescing, or the leader got no answer and this
        request makes its own)."""
        if plan is None or not plan.lookup or policy.cache is None or not policy.cache.coalesce:
            return None, None
        key = (plan.namespace.key, entry_id(plan.namespace, plan.prompt), request.params)
        flight, leads = self._flights.join(key)
        if leads:
            return flight, None
        return None, await self._follow(flight, engine, deadline)

    async def _follow(
        self, flight: Flight[SharedAnswer], engine: Engine, deadline: float | None
    ) -> SharedAnswer | None:
        """The answer of the identical request in flight, or None if it got none."""
        # Bounded by the engine's own timeout: a leader whose response never started
        # (its client left first) may never land its flight.
        engine_timeout_s = self._runtime.config.engines[engine.name].timeout_s
        left_s = None if deadline is None else max(0.0, deadline - time.monotonic())
        limits = [t for t in (engine_timeout_s, left_s) if t is not None]
        try:
            async with asyncio.timeout(min(limits, default=None)):
                return await flight.wait()
        except TimeoutError:
            return None

    # -- 4: the route --------------------------------------------------------------

    def _candidates(self, request: ChatRequest) -> list[Engine]:
        """The engines that could answer: when all are full, the request is refused
        before it is embedded (a semantic hit forgone, but no wait for the embedder,
        whose CPU the engines need) instead of after."""
        runtime, router = self._runtime, self._runtime.config.router
        if request.model == AUTO_MODEL and router is not None:
            return [runtime.engines[router.small_engine], runtime.engines[router.large_engine]]
        return [runtime.engines[request.model]]

    async def route(self, request: ChatRequest, policy: Policy) -> RouteDecision:
        """Step 4 alone: where ``request`` would go, explained, without generating."""
        if self._runtime.router is None:
            raise Refused("model_not_found", "routing is turned off", param="model")
        embedded = Embedded(self._runtime, request.last_user_turn, [])
        return await self._route(embedded, policy)

    async def _route(self, embedded: Embedded, policy: Policy) -> RouteDecision:
        router = self._runtime.router
        assert router is not None
        embedding = await embedded.get()
        return await router.decide(embedded.text, embedding, embedded.ms, policy.router_threshold)

    # -- 5: the answer -------------------------------------------------------------

    async def _answer(
        self,
        request: ChatRequest,
        policy: Policy,
        route: RouteDecision | None,
        engine: Engine,
        decision: Decision,
        keeper: Keeper,
    ) -> AsyncGenerator[Event]:
        loop = self._loop_for(request, route, policy)
        if loop is None:
            return await self._generate(engine, request, decision, keeper)
        if loop.engine.name == engine.name:  # hard: the loop answers
            return self._think(loop, request, policy, decision, keeper)
        # Easy, with escalation on: the small engine's answer stands unless the
        # calibrator doubts it.
        generation, probability = await loop.draft(
            engine, request.messages, request.params, decision.deadline
        )
        decision.confidence = probability
        if probability < (loop.settings.escalate_below or 0.0):
            decision.escalated_from = engine.name
            return self._think(loop, request, policy, decision, keeper)
        answer = _answer_of(generation)
        decision.engine = generation.engine
        # The evaluator's P(correct) is this answer's confidence, not its token mean.
        keeper.settle(answer, engine=generation.engine, tier=decision.route, confidence=probability)
        return _told(answer)

    def _loop_for(
        self, request: ChatRequest, route: RouteDecision | None, policy: Policy
    ) -> ReasoningLoop | None:
        """The loop's part in a routed request, tuned for this request: all of a hard
        one; an easy one's, should its answer need escalating; none when the loop is
        off, or the request asks for several samples or logprobs (the loop answers one
        choice in plain text)."""
        loop = self._runtime.loop
        params = request.params
        if loop is None or policy.loop is None or route is None or params.n > 1 or params.logprobs:
            return None
        loop = loop.tuned(policy.loop)
        if route.engine != loop.engine.name and loop.settings.escalate_below is None:
            return None
        return loop

    async def _generate(
        self, engine: Engine, request: ChatRequest, decision: Decision, keeper: Keeper
    ) -> AsyncGenerator[Event]:
        """One pass of ``engine``. Its first event is awaited here, so that an overloaded
        engine or a prompt too long is refused before the response begins."""
        params = request.params
        if keeper.stores and not params.logprobs:  # the answer's confidence needs them
            params = msgspec.structs.replace(params, logprobs=True)
        logprobs = request.params.logprobs
        if not request.stream:
            generation = await engine.generate(request.messages, params, decision.deadline)
            if (stand_in := _stand_in(engine.name, generation)) is not None:
                decision.engine, decision.failover = stand_in, engine.name
            _settle(generation, decision, keeper)
            return _whole(generation, logprobs)
        events = engine.stream(request.messages, params, decision.deadline)
        try:
            first = await anext(events)
        except BaseException:
            await events.aclose()
            raise
        if (stand_in := _stand_in(engine.name, first)) is not None:
            decision.engine, decision.failover = stand_in, engine.name
        return _generated(first, events, logprobs, decision, keeper)

    def _think(
        self,
        loop: ReasoningLoop,
        request: ChatRequest,
        policy: Policy,
        decision: Decision,
        keeper: Keeper,
    ) -> AsyncGenerator[Event]:
        """The reasoning loop, in a task of its own (a new turn may stop it), with its
        deadline counted from the request's arrival even when it takes over."""
        decision.route, decision.engine = "loop", loop.engine.name
        decision.deadline = policy.deadline(loop.engine.name)
        events = loop.run(
            request.messages,
            deadline=decision.deadline,
            fallback=policy.fallback,
            difficulty=decision.difficulty,
            max_tokens=request.params.max_tokens,
        )
        run = LoopRun(events)
        self.turns.begin(policy.conversation, run)
        return _thought(run, decision, keeper, policy.fallback.policy)


def _served(found: Hit, decision: Decision) -> Answer:
    """The cached answer of a hit, and what the decision says of it."""
    entry = found.entry
    decision.engine = entry.model
    decision.cache_entry = entry.id
    decision.similarity = found.similarity
    decision.cache_score = found.score
    decision.cache_stage = _stage(found)
    return Answer(
        text=entry.response, finish_reason="stop", completion_tokens=entry.completion_tokens
    )


def _stage(hit: Hit) -> str:
    """What decided a hit: the exact key, the verifier's P, or the similarity alone."""
    if hit.path == "exact":
        return "exact"
    return "similarity" if hit.score is None else "verifier"


def _context(request: ChatRequest) -> str:
    """The fingerprint of what surrounds the last turn: the earlier turns, and every
    message's name where one is given (a conversation without names keeps the key it
    always had, which warm-up files share)."""
    names = request.names or (None,) * len(request.messages)
    turns: list[tuple[str, ...]] = [
        (m.role, m.content) if name is None else (m.role, m.content, name)
        for m, name in zip(request.messages[:-1], names[:-1], strict=True)
    ]
    if names[-1] is not None:
        turns.append(("name", names[-1]))
    return context_fingerprint(turns)


async def _told(answer: Answer) -> AsyncGenerator[Event]:
    """An answer in hand, as events."""
    yield TextDelta(0, answer.text)
    yield Finished((answer.finish_reason,), answer.prompt_tokens, answer.completion_tokens)


async def _generated(
    first: Delta | Generation,
    events: AsyncGenerator[Delta | Generation],
    logprobs: bool,
    decision: Decision,
    keeper: Keeper,
) -> AsyncGenerator[Event]:
    """An engine's stream as events; the whole generation settles the answer."""
    try:
        async with contextlib.aclosing(events):
            event = first
            while isinstance(event, Delta):
                yield TextDelta(event.index, event.text, event.logprobs if logprobs else None)
                event = await anext(events)
        _settle(event, decision, keeper)
        yield _finished(event)
    finally:
        keeper.settle(None)  # nothing, if it ended before the generation was whole


async def _whole(generation: Generation, logprobs: bool) -> AsyncGenerator[Event]:
    """A whole generation as events: each choice's text at once."""
    samples = sorted(generation.samples, key=lambda s: s.index)
    for s in samples:
        yield TextDelta(s.index, s.text, s.logprobs if logprobs else None)
    yield _finished(generation)


def _stand_in(asked: str, event: Delta | Generation) -> str | None:
    """The engine that answered in place of the one ``asked`` (it was unavailable), as
    the answer's first event or whole generation names it; None: the one asked did."""
    answering = event.engine
    return answering if answering is not None and answering != asked else None


def _settle(generation: Generation, decision: Decision, keeper: Keeper) -> None:
    decision.engine_s = max(s.timings.queue_s + s.timings.total_s for s in generation.samples)
    # A fallback engine's answer (its engine was unavailable) is shared with identical
    # requests in flight but not kept as the asked engine's answer.
    keeper.settle(
        _answer_of(generation),
        engine=generation.engine,
        tier=decision.route,
        confidence=token_confidence(generation),
        store=decision.failover is None,
    )


def _finished(generation: Generation) -> Finished:
    reasons = tuple(s.finish_reason for s in sorted(generation.samples, key=lambda s: s.index))
    return Finished(reasons, generation.prompt_tokens, generation.completion_tokens)


async def _thought(
    run: LoopRun, decision: Decision, keeper: Keeper, fallback: Fallback
) -> AsyncGenerator[Event]:
    """The loop's run as events; its result settles the answer."""
    result: LoopResult | None = None
    try:
        async for event in run.events():
            if isinstance(event, Thinking):
                yield Reasoning(event.text)
                continue
            result = event
            decision.loop, decision.engine = event.trace, event.engine
            decision.confidence = event.trace.confidence
            if event.trace.fallback != "none":
                decision.route = "fallback"
        if result is None:  # pragma: no cover - the loop always ends with a result
            raise RuntimeError("the reasoning loop ended without an answer")
        trace = result.trace
        if trace.fallback == "error":
            why = (
                "the fallback policy is error"
                if fallback == "error"
                else "no answer to fall back on: the loop had none yet, and the small engine "
                "gave none in the time left (or none is configured)"
            )
            raise Refused(
                "deadline_exceeded",
                f"no answer within the deadline of {trace.deadline_ms or 0:.0f} ms "
                f"({len(trace.rounds)} rounds, stopped at {trace.elapsed_ms:.0f} ms); {why}",
            )
        # Only the loop's own answer is kept: a fallback's is not what it would have said.
        if trace.fallback == "none":
            answer = Answer(
                text=result.text,
                finish_reason="stop",
                completion_tokens=result.answer_tokens,
                prompt_tokens=result.prompt_tokens,
            )
            keeper.settle(answer, engine=result.engine, tier="loop", confidence=trace.confidence)
        yield TextDelta(0, result.text)
        yield Finished(("stop",), result.prompt_tokens, result.completion_tokens)
    except Superseded:
        raise Refused(
            "superseded", "a newer turn of this conversation replaced this request"
        ) from None
    finally:
        # The client left, or the answer is done: nothing may go on thinking for it.
        await run.stop()
        keeper.settle(None)


def _answer_of(generation: Generation) -> Answer:
    sample = generation.samples[0]
    return Answer(
        text=sample.text,
        finish_reason=sample.finish_reason,
        completion_tokens=sample.completion_tokens,
        prompt_tokens=generation.prompt_tokens,
    )


def token_confidence(generation: Generation) -> float:
    """The answer's geometric-mean token probability: its confidence where the evaluator
    gave none; 0 when the engine reported no logprobs."""
    logprobs = generation.samples[0].logprobs
    if not logprobs:
        return 0.0
    return math.exp(sum(t.logprob for t in logprobs) / len(logprobs))


class Embedded:
    """The last user turn's embedding, computed on first use and then reused.

    Before it is computed, a request whose every candidate engine is full is refused
    with the engine's 429, rather than wait for the embedder first."""

    def __init__(self, runtime: Runtime, text: str, candidates: list[Engine]) -> None:
        self._runtime = runtime
        self.text = text
        self._candidates = candidates
        self._embedding: Embedding | None = None
        self.ms = 0.0

    async def get(self, *, may_refuse: bool = True) -> Embedding:
        """The embedding; ``may_refuse=False`` for work after the answer (a write-back)."""
        if self._embedding is None:
            embedder = self._runtime.embedder
            if embedder is None:
                raise RuntimeError("this config has no embedder")
            if may_refuse:
                _refuse_if_full(self._candidates)
            started = time.perf_counter()
            try:
                self._embedding = await embedder.embed(self.text)
            except EmbedderOverloaded as exc:
                raise Refused("embedder_overloaded", str(exc), retry_after_s=1.0) from None
            self.ms = (time.perf_counter() - started) * 1000
        return self._embedding


def _refuse_if_full(engines: list[Engine]) -> None:
    """429 now if every one of ``engines`` would refuse a new request."""
    refusals = [refusal for e in engines if (refusal := e.refusal()) is not None]
    if engines and len(refusals) == len(engines):
        raise refusals[0]  # EngineOverloaded: the client hears 429 with Retry-After
