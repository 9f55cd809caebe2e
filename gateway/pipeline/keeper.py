"""What becomes of an answer once given: identical requests waiting for it hear it, and
a whole answer that the request may store goes to the cache. Every way a request ends
passes through ``Keeper.settle`` exactly once."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import msgspec

from cache.coalesce import Flight
from cache.entry import Namespace
from cache.semantic_cache import SemanticCache
from router.embedder import Embedding

log = logging.getLogger("satisfice.gateway")


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


class Keeper:
    """Settles one request's answer: hands it to the flight it leads, if any, and
    writes a whole answer back to the cache in the background."""

    def __init__(
        self,
        cache: SemanticCache | None,
        plan: CachePlan | None,
        embedding: Callable[[], Awaitable[Embedding]],
        flight: Flight[SharedAnswer] | None,
        background: Callable[[asyncio.Task[None]], None],
    ) -> None:
        self._cache = cache if plan is not None and plan.store else None
        self._plan = plan
        self._embedding = embedding
        self._flight = flight
        self._background = background
        self._settled = False

    @property
    def stores(self) -> bool:
        """Whether a whole answer would go to the cache."""
        return self._cache is not None

    def settle(
        self,
        answer: Answer | None,
        *,
        engine: str = "",
        tier: str = "",
        confidence: float = 0.0,
        store: bool = True,
    ) -> None:
        """``answer`` is what the request got (None: nothing whole); ``store`` False keeps
        it from the cache (a stand-in engine's answer is not the asked engine's).
        Only the first call counts."""
        if self._settled:
            return
        self._settled = True
        flight = self._flight
        if flight is not None:
            flight.land(None if answer is None else SharedAnswer(answer, engine))
        cache, plan = self._cache, self._plan
        # Only whole answers: one cut short by max_tokens or a deadline is not the answer.
        whole = answer is not None and answer.finish_reason == "stop" and answer.text.strip()
        if answer is None or not whole or not store or cache is None or plan is None:
            if flight is not None:
                flight.end()
            return
        write = self._write(cache, plan, answer, engine, tier, confidence)
        self._background(asyncio.ensure_future(write))

    async def _write(
        self,
        cache: SemanticCache,
        plan: CachePlan,
        answer: Answer,
        engine: str,
        tier: str,
        confidence: float,
    ) -> None:
        try:
            entry = cache.entry(
                plan.namespace,
                plan.prompt,
                await self._embedding(),
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
            if self._flight is not None:
                self._flight.end()
