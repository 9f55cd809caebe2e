"""Steps 1-7 of a chat request (docs/architecture.md, "The request's way through the
code"), in order:

1. the exact cache key; 2. the last user turn embedded once, when something needs it;
3. the semantic cache; 4. the router's difficulty; 5a. the engine, whose answer the
evaluator may escalate, or 5b. the reasoning loop; 6. a whole answer noted for the
cache; 7. the answer as events. The request's ``Exchange`` holds its decision as it is
taken; the request settles (step 8) once its response and its work are over.

The embedding of step 2 is computed on first use and reused: the semantic lookup, the
router and the write-back share one vector.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncGenerator, Mapping

import msgspec

from cache.coalesce import Coalescer, Flight
from cache.entry import Namespace, context_fingerprint, entry_id, sampling_key
from cache.semantic_cache import Hit, Miss, SemanticCache
from engines.base import Delta, Engine, Generation, ToolCallDelta, asked_features
from evaluator.loop import Fallback, LoopResult, LoopTrace, ReasoningLoop
from evaluator.shown import Thinking
from gateway.config import AUTO_MODEL
from gateway.pipeline.answer import Answer, CachePlan, SharedAnswer
from gateway.pipeline.exchange import Exchange, Settlement
from gateway.pipeline.keeping import Keeper
from gateway.pipeline.lead import Lead
from gateway.pipeline.live import LiveWork
from gateway.pipeline.outcome import (
    Answering,
    Event,
    Finished,
    Reasoning,
    Refused,
    TextDelta,
    ToolCallPart,
)
from gateway.pipeline.request import ChatRequest
from gateway.pipeline.request_policy import Policy
from gateway.pipeline.sticky import Escalations, first_turn_key
from gateway.pipeline.turns import LoopRun, Superseded, Turns
from router.embedder import Embedder, EmbedderOverloaded, Embedding
from router.router import RouteDecision, Router, Tier


class Pipeline:
    """The request path over the parts it uses. It keeps what requests share while
    they run: the conversations whose loops are in flight, and the identical requests
    in flight. What may change on a reload reaches it in each request's ``Policy``."""

    def __init__(
        self,
        *,
        engines: Mapping[str, Engine],
        engine_timeouts_s: Mapping[str, float | None],
        embedder: Embedder | None,
        router: Router | None,
        cache: SemanticCache | None,
        loop: ReasoningLoop | None,
    ) -> None:
        self._engines = engines
        self._engine_timeouts_s = engine_timeouts_s
        self._embedder = embedder
        self._router = router
        self._cache = cache
        self._loop = loop
        self.turns = Turns()
        self._flights: Coalescer[SharedAnswer] = Coalescer()
        self.live = LiveWork()
        self.escalations = Escalations()

    @property
    def loop(self) -> ReasoningLoop | None:
        return self._loop

    async def run(self, request: ChatRequest, policy: Policy, exchange: Exchange) -> Answering:
        """``request``'s answer as events, with the decision as it stands when the answer
        begins; ``exchange`` holds the decision as it is taken, so that the request
        settles with it even when this raises. Raises ``Refused`` or the engine's error
        when there is no answer to begin."""
        if request.model == AUTO_MODEL and self._router is None:
            raise Refused("model_not_found", "routing is turned off", param="model")
        # A conversation's new turn stops the last one's thinking first: it may be asking
        # the same engines.
        if policy.conversation is not None:
            exchange.decide(superseded_ms=await self.turns.supersede(policy.conversation))
        plan = self._cache_plan(request, policy)
        embedded = Embedded(self._embedder, request.last_user_turn, self._candidates(request))

        # 1-3: the cache, exact then semantic.
        exchange.decide(cache="off" if self._cache is None else "bypass")
        if plan is not None and plan.lookup:
            answer = await self._cached(plan, policy, embedded, request, exchange)
            if answer is not None:
                return Answering(exchange.decision, exchange.told(answer))
            exchange.decide(cache="miss")
        if policy.control.only_cached:
            raise Refused(
                "cache_miss",
                "no cached answer for this request, and Cache-Control: only-if-cached "
                "forbids generating one",
            )
        # 4: where it goes.
        route = None
        sticky = None
        if request.model == AUTO_MODEL:
            route = await self._route(embedded, policy)
            exchange.decide(difficulty=route.score)
            exchange.embedding = embedded.value  # for a policy version in shadow to route
            sticky = _sticky_key(request, policy)
            if sticky is not None and route.tier == "small" and self.escalations.stays(sticky):
                route = self._to_tier(route, "large")
                exchange.decide(sticky="large")
        engine = self._engines[route.engine if route is not None else request.model]
        decision = exchange.decide(
            route=route.tier if route is not None else engine.name,
            engine=engine.name,
            deadline=policy.deadline(engine.name),
        )
        _refuse_unless_able(engine, request)
        # A turn that went large on its own renews the stay; one that stayed uses it.
        if (
            sticky is not None
            and route is not None
            and route.tier == "large"
            and not decision.sticky
        ):
            self._escalated(sticky, policy)

        # An identical request in flight answers this one too.
        flight, shared = await self._coalesce(plan, policy, request, engine, decision.deadline)
        if shared is not None:
            exchange.decide(cache="coalesced", route="coalesced", engine=shared.engine)
            return Answering(exchange.decision, exchange.told(shared.answer))

        # 5-7: the answer, and what becomes of it.
        exchange.generated = True
        self.live.begin()
        keeper = Keeper(exchange, plan, lambda: embedded.get(may_refuse=False), flight)
        answering = self._answer(request, policy, route, engine, exchange, keeper)
        if flight is not None:  # identical requests wait for this answer too
            return _answering(exchange, await Lead(flight, keeper, exchange, answering).events())
        return _answering(exchange, await answering)

    async def reference(
        self, request: ChatRequest, policy: Policy, *, tier: Tier | None = None
    ) -> Reference:
        """What ``request`` is answered when no shortcut is taken: neither cache read nor
        written, no identical request's answer shared, no earlier turn stopped; routed
        as the router decides, or to ``tier`` when given (a routed request's only). For
        background checks of shortcuts (gateway.checks): it is not live work, and its
        exchange settles where no subscriber hears it."""
        policy = msgspec.structs.replace(policy, cache=None, conversation=None, stickiness=None)
        request = msgspec.structs.replace(request, stream=False)
        exchange = Exchange(Settlement(), tenant=policy.tenant, model=request.model, key=None,
                            request_id=None, started=policy.arrived)  # fmt: skip
        exchange.admitted(request, policy)
        route = None
        if request.model == AUTO_MODEL:
            route = await self._route(Embedded(self._embedder, request.last_user_turn, []), policy)
            if tier is not None and route.tier != tier:
                route = self._to_tier(route, tier)
        engine = self._engines[route.engine if route is not None else request.model]
        exchange.decide(
            route=route.tier if route is not None else engine.name,
            engine=engine.name,
            deadline=policy.deadline(engine.name),
        )
        keeper = Keeper(exchange, None, _never_embedded, None)  # nothing is kept
        texts: list[str] = []
        tokens = 0
        try:
            events = await self._answer(request, policy, route, engine, exchange, keeper)
            async with contextlib.aclosing(events):
                async for event in events:
                    if isinstance(event, TextDelta) and event.index == 0:
                        texts.append(event.text)
                    elif isinstance(event, Finished):
                        tokens = event.completion_tokens
        finally:
            exchange.end(200)
        decision = exchange.decision
        return Reference("".join(texts), decision.route, decision.engine, tokens, decision.loop)

    def exact_at_hand(
        self, request: ChatRequest, policy: Policy, exchange: Exchange
    ) -> tuple[Answering, Hit] | None:
        """Step 1 alone, when this process holds the answer and nothing else need run:
        what ``run`` would answer, decided in one synchronous step (the HTTP layer's
        express path, which sends it). None: ``run`` must decide, which may still find
        an exact hit (in the store) or answer otherwise. The hit is not counted: the
        caller counts it when it serves it (``SemanticCache.note_exact_hit``)."""
        cache = self._cache
        if cache is None or policy.conversation is not None:
            return None  # a conversation's turn first stops the last one's thinking
        if request.model == AUTO_MODEL and self._router is None:
            return None
        plan = self._cache_plan(request, policy)
        if plan is None or not plan.lookup:
            return None
        found = cache.exact_at_hand(plan.namespace, plan.prompt, policy.cache)
        if found is None or found.entry.completion_tokens > request.params.max_tokens:
            return None
        if not policy.control.fresh(found.entry.created_at):
            return None
        answer = _served(found, exchange)
        exchange.sent_whole(answer)
        return Answering(exchange.decision, _told(answer)), found

    # -- 1-3: the cache ------------------------------------------------------------

    def _cache_plan(self, request: ChatRequest, policy: Policy) -> CachePlan | None:
        """How the cache takes part in a request; None when the request cannot use it."""
        if self._cache is None or policy.cache is None:
            return None
        params, last = request.params, request.messages[-1]
        # Several samples, token logprobs or an unfinished assistant turn are not
        # answers a cache keeps; nor is a turn that may call tools: a call acts on the
        # world, and is made again when asked again.
        if params.n > 1 or params.logprobs or last.role != "user" or params.tools:
            return None
        if params.temperature and not policy.cache.cache_sampled:
            return None
        # The tenant scopes every key: no tenant reads or writes another's entries.
        namespace = Namespace(
            tenant=policy.tenant,
            model=request.model,
            context=_context(request),
            embedding="none" if self._embedder is None else self._embedder.fingerprint,
            sampling=sampling_key(
                params.temperature,
                top_p=params.top_p,
                seed=params.seed,
                stop=params.stop,
                frequency_penalty=params.frequency_penalty,
                presence_penalty=params.presence_penalty,
                response_format=params.response_format,
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
        exchange: Exchange,
    ) -> Answer | None:
        cache = self._cache
        assert cache is not None
        found = await cache.lookup(plan.namespace, plan.prompt, embedded.get, policy.cache)
        if isinstance(found, Miss):
            exchange.decide(
                cache_stage=found.reason,
                cache_entry=found.candidate,
                similarity=found.candidate_similarity,
                cache_score=found.score,
            )
            return None
        # An answer longer than the client allows is not its answer, nor one older
        # than its Cache-Control: max-age.
        if found.entry.completion_tokens > request.params.max_tokens:
            exchange.decide(cache_stage="too_long")
            return None
        if not policy.control.fresh(found.entry.created_at):
            exchange.decide(cache_stage="too_old")
            return None
        return _served(found, exchange)

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
        engine_timeout_s = self._engine_timeouts_s.get(engine.name)
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
        router = self._router
        if request.model == AUTO_MODEL and router is not None:
            small, large = router.settings.small_engine, router.settings.large_engine
            return [self._engines[small], self._engines[large]]
        return [self._engines[request.model]]

    async def route(self, request: ChatRequest, policy: Policy) -> RouteDecision:
        """Step 4 alone: where ``request`` would go, explained, without generating."""
        if self._router is None:
            raise Refused("model_not_found", "routing is turned off", param="model")
        embedded = Embedded(self._embedder, request.last_user_turn, [])
        return await self._route(embedded, policy)

    def _to_tier(self, route: RouteDecision, tier: Tier) -> RouteDecision:
        """``route`` sent to ``tier`` instead, whatever its score said."""
        router = self._router
        assert router is not None
        settings = router.settings
        engine = settings.large_engine if tier == "large" else settings.small_engine
        return msgspec.structs.replace(route, tier=tier, engine=engine)

    def _escalated(self, sticky: str, policy: Policy) -> None:
        """The conversation ``sticky`` was answered by the large path: it stays there."""
        assert policy.stickiness is not None
        self.escalations.escalated(sticky, policy.stickiness)

    async def _route(self, embedded: Embedded, policy: Policy) -> RouteDecision:
        router = self._router
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
        exchange: Exchange,
        keeper: Keeper,
    ) -> AsyncGenerator[Event]:
        loop = self._loop_for(request, route, policy)
        if loop is not None and (asked := asked_features(request.params)):
            # The loop votes on answers in text; a tool call or a structured answer is
            # the routed engine's one pass.
            exchange.decide(single_pass=asked[0])
            loop = None
        if loop is None:
            return await self._generate(engine, request, exchange, keeper)
        if loop.engine.name == engine.name:  # hard: the loop answers
            return self._think(loop, request, policy, exchange, keeper)
        # Easy, with escalation on: the small engine's answer stands unless the
        # calibrator doubts it.
        generation, probability = await loop.draft(
            engine, request.messages, request.params, exchange.decision.deadline
        )
        exchange.decide(confidence=probability)
        if probability < (loop.settings.escalate_below or 0.0):
            exchange.decide(escalated_from=engine.name)
            if (sticky := _sticky_key(request, policy)) is not None:
                self._escalated(sticky, policy)
            return self._think(loop, request, policy, exchange, keeper)
        answer = _answer_of(generation)
        decision = exchange.decide(engine=generation.engine)
        # The evaluator's P(correct) is this answer's confidence, not its token mean.
        keeper.whole(answer, engine=generation.engine, tier=decision.route, confidence=probability)
        return _told(answer)

    def _loop_for(
        self, request: ChatRequest, route: RouteDecision | None, policy: Policy
    ) -> ReasoningLoop | None:
        """The loop's part in a routed request, tuned for this request: all of a hard
        one; an easy one's, should its answer need escalating; none when the loop is
        off, or the request asks for several samples or logprobs (the loop answers one
        choice in plain text)."""
        loop = self._loop
        params = request.params
        if loop is None or policy.loop is None or route is None or params.n > 1 or params.logprobs:
            return None
        loop = loop.tuned(policy.loop)
        if route.engine != loop.engine.name and loop.settings.escalate_below is None:
            return None
        return loop

    async def _generate(
        self, engine: Engine, request: ChatRequest, exchange: Exchange, keeper: Keeper
    ) -> AsyncGenerator[Event]:
        """One pass of ``engine``. Its first event is awaited here, so that an overloaded
        engine or a prompt too long is refused before the response begins."""
        params = request.params
        if keeper.stores and not params.logprobs:  # the answer's confidence needs them
            params = msgspec.structs.replace(params, logprobs=True)
        logprobs, deadline = request.params.logprobs, exchange.decision.deadline
        if not request.stream:
            generation = await engine.generate(request.messages, params, deadline)
            _failed_over(exchange, engine, generation)
            _whole(generation, exchange, keeper)
            return _whole_events(generation, logprobs)
        events = engine.stream(request.messages, params, deadline)
        try:
            first = await anext(events)
        except BaseException:
            await events.aclose()
            raise
        _failed_over(exchange, engine, first)
        return _generated(first, events, logprobs, exchange, keeper)

    def _think(
        self,
        loop: ReasoningLoop,
        request: ChatRequest,
        policy: Policy,
        exchange: Exchange,
        keeper: Keeper,
    ) -> AsyncGenerator[Event]:
        """The reasoning loop, in a task of its own (a new turn may stop it), with its
        deadline counted from the request's arrival even when it takes over."""
        decision = exchange.decide(
            route="loop", engine=loop.engine.name, deadline=policy.deadline(loop.engine.name)
        )
        events = loop.run(
            request.messages,
            deadline=decision.deadline,
            fallback=policy.fallback,
            difficulty=decision.difficulty,
            max_tokens=request.params.max_tokens,
            # A first answer is for a reader of the stream; a whole answer has no "first".
            first_answer=loop.settings.first_answer and request.stream,
        )
        run = LoopRun(events)
        self.turns.begin(policy.conversation, run)
        return _thought(run, exchange, keeper, policy.fallback.policy)


def _answering(exchange: Exchange, events: AsyncGenerator[Event]) -> Answering:
    """The answer as it goes out, noted as served, with the decision taken so far."""
    return Answering(exchange.decision, exchange.sent(events))


def _served(found: Hit, exchange: Exchange) -> Answer:
    """The cached answer of a hit, and what the decision says of it."""
    entry = found.entry
    exchange.decide(
        cache=found.path,
        route=found.path,
        engine=entry.model,
        cache_entry=entry.id,
        similarity=found.similarity,
        cache_score=found.score,
        cache_stage=_stage(found),
    )
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
    for i, m in enumerate(request.messages[:-1]):  # what the tools said, and were asked
        if m.tool_calls or m.tool_call_id is not None:
            calls = [(c.id, c.name, c.arguments) for c in m.tool_calls]
            turns.append(("tools", str(i), msgspec.json.encode([m.tool_call_id, calls]).decode()))
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
    exchange: Exchange,
    keeper: Keeper,
) -> AsyncGenerator[Event]:
    """An engine's stream as events; the generation, once whole, is the answer."""
    async with contextlib.aclosing(events):
        event = first
        while isinstance(event, Delta):
            if event.text or not event.tool_calls:
                yield TextDelta(event.index, event.text, event.logprobs if logprobs else None)
            for call in event.tool_calls:
                yield ToolCallPart(event.index, call)
            event = await anext(events)
    _whole(event, exchange, keeper)
    yield _finished(event)


async def _whole_events(generation: Generation, logprobs: bool) -> AsyncGenerator[Event]:
    """A whole generation as events: each choice's text at once."""
    samples = sorted(generation.samples, key=lambda s: s.index)
    for s in samples:
        yield TextDelta(s.index, s.text, s.logprobs if logprobs else None)
        for i, call in enumerate(s.tool_calls):
            yield ToolCallPart(s.index, ToolCallDelta(i, call.id, call.name, call.arguments))
    yield _finished(generation)


def _failed_over(exchange: Exchange, asked: Engine, event: Delta | Generation) -> None:
    """Note the engine that answered in place of the one ``asked`` (it was unavailable),
    as the answer's first event or whole generation names it."""
    answering = event.engine
    if answering is not None and answering != asked.name:
        exchange.decide(engine=answering, failover=asked.name)


def _whole(generation: Generation, exchange: Exchange, keeper: Keeper) -> None:
    engine_s = max(s.timings.queue_s + s.timings.total_s for s in generation.samples)
    decision = exchange.decide(engine_s=engine_s)
    # A fallback engine's answer (its engine was unavailable) is shared with identical
    # requests in flight but not kept as the asked engine's answer.
    keeper.whole(
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
    run: LoopRun, exchange: Exchange, keeper: Keeper, fallback: Fallback
) -> AsyncGenerator[Event]:
    """The loop's run as events; its own result, once whole, is the answer."""
    result: LoopResult | None = None
    try:
        async for event in run.events():
            if isinstance(event, Thinking):
                yield Reasoning(event.text, event.kind)
                continue
            result = event
            exchange.decide(
                loop=event.trace,
                engine=event.engine,
                confidence=event.trace.confidence,
                route="fallback" if event.trace.fallback != "none" else exchange.decision.route,
            )
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
            keeper.whole(answer, engine=result.engine, tier="loop", confidence=trace.confidence)
        yield TextDelta(0, result.text)
        yield Finished(("stop",), result.prompt_tokens, result.completion_tokens, trace)
    except Superseded:
        raise Refused(
            "superseded", "a newer turn of this conversation replaced this request"
        ) from None
    finally:
        # The client left, or the answer is done: nothing may go on thinking for it.
        await run.stop()


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


async def _never_embedded() -> Embedding:
    raise RuntimeError("a reference answer is never kept, so never embedded")


class Reference(msgspec.Struct, frozen=True):
    """The answer of the path no shortcut was taken on (``Pipeline.reference``)."""

    text: str
    route: str  # the tier or engine that answered, loop, or fallback
    engine: str | None
    completion_tokens: int
    loop: LoopTrace | None


class Embedded:
    """The last user turn's embedding, computed on first use and then reused.

    Before it is computed, a request whose every candidate engine is full is refused
    with the engine's 429, rather than wait for the embedder first."""

    def __init__(self, embedder: Embedder | None, text: str, candidates: list[Engine]) -> None:
        self._embedder = embedder
        self.text = text
        self._candidates = candidates
        self._embedding: Embedding | None = None
        self.ms = 0.0

    @property
    def value(self) -> Embedding | None:
        """The embedding, if it was computed."""
        return self._embedding

    async def get(self, *, may_refuse: bool = True) -> Embedding:
        """The embedding; ``may_refuse=False`` for work after the answer (a write-back)."""
        if self._embedding is None:
            embedder = self._embedder
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


def _sticky_key(request: ChatRequest, policy: Policy) -> str | None:
    """What names ``request``'s conversation for staying where it escalated; None:
    stickiness is off for its tenant, or nothing names its conversation."""
    if policy.stickiness is None:
        return None
    if policy.conversation is not None:
        return policy.conversation
    if policy.sticky_by_first_turn:
        return first_turn_key(policy.tenant, request.messages)
    return None


def _refuse_unless_able(engine: Engine, request: ChatRequest) -> None:
    """400 for a request asking ``engine`` for what it cannot do: answered anyway, it
    would get (and the cache could keep) a plain-text answer it did not ask for."""
    for feature in asked_features(request.params):
        if feature not in engine.features:
            able = ", ".join(_FEATURE_NAMES[f] for f in sorted(engine.features))
            raise Refused(
                "unsupported",
                f"engine {engine.name!r} cannot answer with {_FEATURE_NAMES[feature]}; "
                f"it answers with {able or 'plain text only'}",
                param="tools" if feature == "tools" else "response_format",
            )


_FEATURE_NAMES = {
    "tools": "tool calls",
    "json_object": "a JSON object (response_format json_object)",
    "json_schema": "JSON of a given schema (response_format json_schema)",
}


def _refuse_if_full(engines: list[Engine]) -> None:
    """429 now if every one of ``engines`` would refuse a new request."""
    refusals = [refusal for e in engines if (refusal := e.refusal()) is not None]
    if engines and len(refusals) == len(engines):
        raise refusals[0]  # EngineOverloaded: the client hears 429 with Retry-After
