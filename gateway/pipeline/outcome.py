"""What the pipeline hands the HTTP layer: the decision it took and the answer as events.

Every answer, from the cache, an engine or the reasoning loop, plain or streamed,
is the same stream of events; the HTTP layer drains it into one completion or sends
each event as it comes, and derives headers, logs and metrics from the ``Decision``.
An answer that fails after it has begun raises from the stream: ``Refused`` for what
the client can act on, the engine's ``EngineError`` for what the engine could not do.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Literal

import msgspec

from engines.base import TokenLogprob
from evaluator.loop import LoopTrace

# How the cache took part: served the answer (exact, semantic; coalesced: shared from
# an identical request in flight), looked and missed, was told not to look, or is off.
CacheStatus = Literal["exact", "semantic", "coalesced", "miss", "bypass", "off"]

# The route of a request that failed before it had one.
NO_ROUTE = "error"


class Decision(msgspec.Struct, kw_only=True):
    """What the gateway decided for one request, filled in as it goes: by the time the
    first event arrives everything but the loop's trace and the answer's confidence is
    known (the headers), by the last, everything (the logs, metrics and trace)."""

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


class TextDelta(msgspec.Struct, frozen=True):
    """New answer text of choice ``index``; ``logprobs`` covers exactly its tokens when
    the client asked for them."""

    index: int
    text: str
    logprobs: tuple[TokenLogprob, ...] | None = None


class Reasoning(msgspec.Struct, frozen=True):
    """The loop's progress, which a stream shows at once (``delta.reasoning_content``)."""

    text: str


class Finished(msgspec.Struct, frozen=True):
    """The answer is whole: each choice's finish reason, in index order, and usage."""

    finish_reasons: tuple[str, ...]
    prompt_tokens: int
    completion_tokens: int


Event = TextDelta | Reasoning | Finished


class Outcome(msgspec.Struct, frozen=True):
    """The decision and the answer's events; closing ``events`` stops any work left."""

    decision: Decision
    events: AsyncGenerator[Event]


RefusalKind = Literal[
    "model_not_found",
    "cache_miss",
    "embedder_overloaded",
    "superseded",
    "deadline_exceeded",
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
