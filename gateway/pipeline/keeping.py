"""What becomes of a whole answer: identical requests waiting for it hear it at once,
and, once its request has settled, the cache keeps it (in the background).

``Keeper`` is one request's: the pipeline hands it the answer where it becomes whole.
``WriteBack`` is the runtime's, a subscriber to settled requests.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from cache.coalesce import Flight
from cache.semantic_cache import SemanticCache
from gateway.pipeline.answer import Answer, CachePlan, Kept, SharedAnswer
from gateway.pipeline.exchange import Exchange, Settled
from router.embedder import Embedding

log = logging.getLogger("satisfice.gateway")


class Keeper:
    """One request's whole answer: handed at once to the identical requests that wait
    for it, and noted for the cache when the request may store it."""

    def __init__(
        self,
        exchange: Exchange,
        plan: CachePlan | None,
        embedding: Callable[[], Awaitable[Embedding]],
        flight: Flight[SharedAnswer] | None,
    ) -> None:
        self._exchange = exchange
        self._plan = plan if plan is not None and plan.store else None
        self._embedding = embedding
        self._flight = flight

    @property
    def stores(self) -> bool:
        """Whether a whole answer would go to the cache."""
        return self._plan is not None

    def whole(
        self, answer: Answer, *, engine: str, tier: str, confidence: float, store: bool = True
    ) -> None:
        """``answer`` is whole; ``store`` False keeps it from the cache (a stand-in
        engine's answer is not the asked engine's)."""
        if self._flight is not None:
            self._flight.land(SharedAnswer(answer, engine))
        # Only whole answers: one cut short by max_tokens or a deadline is not the answer.
        if self._plan is None or not store or answer.finish_reason != "stop":
            return
        if not answer.text.strip():
            return
        self._exchange.keep(
            Kept(
                plan=self._plan,
                answer=answer,
                engine=engine,
                tier=tier,
                confidence=confidence,
                embedding=self._embedding,
                flight=self._flight,
            )
        )

    def done(self) -> None:
        """The work is over: identical requests still waiting get no answer from this one
        unless the cache is about to have it."""
        if self._flight is not None and self._exchange.kept is None:
            self._flight.end()


class WriteBack:
    """Settled requests' whole answers, written to the cache in the background; the
    flight they led ends once the entry is stored (or the write failed)."""

    def __init__(
        self, cache: SemanticCache, background: Callable[[asyncio.Task[None]], None]
    ) -> None:
        self._cache = cache
        self._background = background

    def __call__(self, settled: Settled) -> None:
        if settled.kept is not None:
            self._background(asyncio.ensure_future(self._write(settled.kept)))

    async def _write(self, kept: Kept) -> None:
        try:
            entry = self._cache.entry(
                kept.plan.namespace,
                kept.plan.prompt,
                await kept.embedding(),
                response=kept.answer.text,
                model=kept.engine,
                tier=kept.tier,
                confidence=kept.confidence,
                completion_tokens=kept.answer.completion_tokens,
            )
            await self._cache.put([entry])
        except Exception:  # a failed write-back costs a future hit, never this answer
            log.exception("cache write-back failed")
        finally:
            if kept.flight is not None:
                kept.flight.end()
