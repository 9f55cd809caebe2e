"""An answer as the pipeline passes it on: whole, shared with identical requests, and
kept by the cache where the request's plan says."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import msgspec

from cache.coalesce import Flight
from cache.entry import Namespace
from router.embedder import Embedding


class Answer(msgspec.Struct, frozen=True, kw_only=True):
    """One finished answer."""

    text: str
    finish_reason: str
    completion_tokens: int
    prompt_tokens: int = 0


class SharedAnswer(msgspec.Struct, frozen=True):
    """An answer and the engine that gave it, as identical requests share it."""

    answer: Answer
    engine: str


class CachePlan(msgspec.Struct, frozen=True):
    """Where a request's answer is looked up and kept, and whether it may be."""

    namespace: Namespace
    prompt: str  # the last user turn: what semantic matching compares
    lookup: bool
    store: bool


class Kept(msgspec.Struct, frozen=True, kw_only=True):
    """A whole answer the cache may keep, and where."""

    plan: CachePlan
    answer: Answer
    engine: str
    tier: str  # the route that answered: small, large, loop, ...
    confidence: float  # the evaluator's P(correct), else the answer's token confidence
    embedding: Callable[[], Awaitable[Embedding]]  # the prompt's, computed once
    # The identical requests this one led: they take the answer from the flight until
    # the cache has it, and the next one then finds it there.
    flight: Flight[SharedAnswer] | None
