"""What the pipeline hands the HTTP layer: the decision it took and the answer as events.

Every answer, from the cache, an engine or the reasoning loop, plain or streamed,
is the same stream of events; the HTTP layer drains it into one completion or sends
each event as it comes, and derives its headers from the ``Decision`` in force when
the answer begins. Everything else hears of the request once it has settled
(gateway.pipeline.exchange).
An answer that fails after it has begun raises from the stream: ``Refused`` for what
the client can act on, the engine's ``EngineError`` for what the engine could not do.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Literal

import msgspec

from engines.base import TokenLogprob, ToolCallDelta
from evaluator.loop import LoopTrace
from evaluator.shown import ThoughtKind

# How the cache took part: served the answer (exact, semantic; coalesced: shared from
# an identical request in flight), looked and missed, was told not to look, or is off.
CacheStatus = Literal["exact", "semantic", "coalesced", "miss", "bypass", "off"]

# The route of a request that failed before it had one.
NO_ROUTE = "error"


class Decision(msgspec.Struct, frozen=True, kw_only=True):
    """What the gateway decided for one request. Frozen: the pipeline makes a new one
    at each step (``Exchange.decide``); the response's headers read the one in force
    when the answer begins, the settled event the complete one
    (gateway.pipeline.exchange)."""

    tenant: str
    model: str  # the name the client asked for
    # What answered: exact, semantic, coalesced, an engine's tier (small, large, or the
    # engine asked for by name), loop, or fallback (the loop's fallback at its deadline).
    route: str = NO_ROUTE
    cache: CacheStatus = "off"
    # The cached prompt that answered, or the one the deciding stage turned down: its
    # entry id, similarity and the verifier's P; and the stage that decided (exact,
    # verifier, similarity, guard:<name>, below_threshold, feedback, empty, ...).
    cache_entry: int | None = None
    similarity: float | None = None
    cache_score: float | None = None
    cache_stage: str | None = None
    difficulty: float | None = None  # the router's score; None when nothing was routed
    engine: str | None = None  # the engine whose answer this is
    failover: str | None = None  # the engine asked for, when another answered for it
    escalated_from: str | None = None  # the small engine, when the loop took over
    confidence: float | None = None  # the evaluator's calibrated P(correct)
    loop: LoopTrace | None = None
    superseded_ms: float | None = None  # how long the conversation's last turn took to stop
    deadline: float | None = None  # time.monotonic() seconds
    engine_s: float | None = None  # the engine's own time, its queue included
    # The policy version in force when the request arrived (gateway.checks.policies):
    # the router, calibrator and verifier calibration that decided.
    policy: str = "shipped"
    # Why a routed request took one pass where it would have thought (the loop votes on
    # answers in text, not on tool calls or structured output): the feature asked for.
    single_pass: str | None = None
    # The tier a conversation stayed on because an earlier turn escalated to it, where
    # this turn alone would have gone elsewhere.
    sticky: str | None = None

    def view(self) -> DecisionView:
        """The decision as the flat fields every reader shows."""
        trace = self.loop
        # In the view's field order, not by keyword: msgspec matches twenty keywords at
        # several times the cost of the whole view, and every request's access line
        # makes one (tests/test_decision_view.py holds each field to its name).
        return DecisionView(
            self.tenant,
            self.model,
            self.route,
            self.cache,
            self.cache_stage,
            None if self.cache_entry is None else str(self.cache_entry),
            self.similarity,
            self.cache_score,
            self.difficulty,
            self.engine,
            self.failover,
            self.escalated_from,
            self.confidence,
            self.superseded_ms,
            None if self.engine_s is None else self.engine_s * 1000,
            None if trace is None else trace.stop,
            None if trace is None else trace.fallback,
            None if trace is None else len(trace.rounds),
            None if trace is None else sum(len(r.branches) for r in trace.rounds),
            None if trace is None else trace.tokens,
            self.policy,
            self.single_pass,
            self.sticky,
        )


class DecisionView(msgspec.Struct, frozen=True, omit_defaults=True):
    """A decision as flat, named fields: the one view from which the response headers,
    the decision trace a client asks for, the access log and the trace span are all
    derived (gateway.api.headers, gateway.api.render, gateway.ops.logs and .tracing),
    so that a field added here reaches each of them. None: not part of this decision."""

    tenant: str
    model: str  # the name the client asked for
    route: str  # exact, semantic, coalesced, the tier or engine that generated, loop, ...
    cache: str  # exact | semantic | coalesced | miss | bypass | off
    # The cache's stage that decided (exact, verifier, similarity, guard:<name>, ...),
    # and the cached prompt it served or turned down: entry id (decimal: JSON clients
    # lose integers above 2**53), similarity, and the verifier's P(same answer).
    cache_stage: str | None = None
    cache_entry: str | None = None
    similarity: float | None = None
    cache_score: float | None = None
    difficulty: float | None = None  # the router's score, for model "auto"
    engine: str | None = None  # the engine whose answer it is
    failover: str | None = None  # the unavailable engine this one stood in for
    escalated_from: str | None = None  # the small engine, when the loop took over
    confidence: float | None = None  # the evaluator's calibrated P(correct)
    superseded_ms: float | None = None  # how long the conversation's last turn took to stop
    engine_ms: float | None = None  # the engine's own time, its queue included
    # The reasoning loop's: why it stopped, its fallback, rounds, branches and tokens.
    stop: str | None = None
    fallback: str | None = None
    rounds: int | None = None
    branches: int | None = None
    tokens: int | None = None
    policy: str | None = None  # the policy version that decided
    single_pass: str | None = None  # what made a routed request take one pass (tools, ...)
    sticky: str | None = None  # the tier a conversation stayed on after escalating


class TextDelta(msgspec.Struct, frozen=True):
    """New answer text of choice ``index``; ``logprobs`` covers exactly its tokens when
    the client asked for them."""

    index: int
    text: str
    logprobs: tuple[TokenLogprob, ...] | None = None


class Reasoning(msgspec.Struct, frozen=True):
    """The loop's progress, which a stream shows at once (``delta.reasoning_content``):
    a note, a branch's tokens, or the provisional first answer."""

    text: str
    kind: ThoughtKind = "note"


class ToolCallPart(msgspec.Struct, frozen=True):
    """Part of a tool call of choice ``index``: the first part names the call, each
    adds to its arguments (engines.base.ToolCallDelta)."""

    index: int
    call: ToolCallDelta


class Finished(msgspec.Struct, frozen=True):
    """The answer is whole: each choice's finish reason, in index order, usage, and
    the loop's trace when the loop answered (a client sees it with the answer)."""

    finish_reasons: tuple[str, ...]
    prompt_tokens: int
    completion_tokens: int
    loop: LoopTrace | None = None


Event = TextDelta | Reasoning | ToolCallPart | Finished


class Answering(msgspec.Struct, frozen=True):
    """An answer under way: the decision as it stands when the answer begins (what the
    response's headers say), and the answer's events; closing ``events`` stops any
    work left."""

    decision: Decision
    events: AsyncGenerator[Event]


RefusalKind = Literal[
    "model_not_found",
    "cache_miss",
    "embedder_overloaded",
    "superseded",
    "deadline_exceeded",
    "unsupported",
]


class Refused(Exception):
    """The pipeline will not answer, for a reason the client can act on; the HTTP layer
    turns ``kind`` into a status."""

    def __init__(
        self,
        kind: RefusalKind,
        message: str,
        *,
        param: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s
