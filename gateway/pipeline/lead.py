"""The work of a request that leads identical requests in flight: it runs in a task of
its own, so that it outlives its own client while followers still wait for it, and
stops (within a token) once nobody does.

A request without followers needs none of this: its work stops with it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Coroutine
from typing import Any

from cache.coalesce import Flight
from gateway.pipeline.answer import SharedAnswer
from gateway.pipeline.exchange import Exchange
from gateway.pipeline.keeping import Keeper
from gateway.pipeline.outcome import Event

Work = Coroutine[Any, Any, AsyncGenerator[Event]]


class Lead:
    """``work`` (the answer's events, once its first is due) run by a task that
    the leader's client reads through a queue. When that client leaves, the task goes
    on while the flight has followers, and is cancelled when the last one leaves; the
    leader's request settles once the task is over."""

    def __init__(
        self,
        flight: Flight[SharedAnswer],
        keeper: Keeper,
        exchange: Exchange,
        work: Work,
    ) -> None:
        self._flight = flight
        self._keeper = keeper
        self._exchange = exchange
        exchange.hold()  # the leader's request settles once this work is over
        self._queue: asyncio.Queue[Event | BaseException | None] = asyncio.Queue()
        self._read = True  # the leader's client still reads the events
        self._task = asyncio.create_task(self._pump(work))
        # A callback, not the task's own `finally`: a task cancelled before it started
        # never runs its coroutine.
        self._task.add_done_callback(self._over)

    def _over(self, _: asyncio.Task[None]) -> None:
        self._keeper.done()
        self._exchange.release()

    async def _pump(self, work: Work) -> None:
        try:
            events = await work
            async with contextlib.aclosing(events):
                async for event in events:
                    if self._read:
                        self._queue.put_nowait(event)
        except Exception as exc:  # raised where the leader reads, unless it has gone
            self._queue.put_nowait(exc)
        else:
            self._queue.put_nowait(None)

    async def events(self) -> AsyncGenerator[Event]:
        """The answer's events for the leader; raises what the answer raised before its
        first event here, so that the response has not begun."""
        try:
            first = await self._queue.get()
        except BaseException:  # the leader's client left while the answer was under way
            await self._leave()
            raise
        if isinstance(first, BaseException):
            raise first
        return self._rest(first)

    async def _rest(self, first: Event | None) -> AsyncGenerator[Event]:
        item: Event | BaseException | None = first
        try:
            while item is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
                item = await self._queue.get()
        finally:
            if item is not None:  # closed before the end: the leader's client left
                await self._leave()

    def _stop(self) -> None:
        self._task.cancel()

    async def _leave(self) -> None:
        """The leader's client has gone: the work goes on for the followers waiting, or
        stops now (and is awaited, so that the engine is free when this returns)."""
        self._read = False
        if self._task.done():
            return
        self._flight.deserted(self._stop)
        if self._task.cancelling() or self._task.cancelled():
            await asyncio.gather(self._task, return_exceptions=True)
