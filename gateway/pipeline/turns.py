"""Conversations: the reasoning loop of each runs in a task of its own, so that a new
turn of the same conversation, or a client that leaves, stops the work at once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator

from evaluator.loop import LoopResult
from evaluator.shown import Thinking

log = logging.getLogger("satisfice.gateway")

# Longest a new turn waits for the previous turn's work to stop before it starts.
_SUPERSEDE_WAIT_S = 1.0


class Superseded(Exception):
    """A newer turn of the same conversation took over this request's work."""


class LoopRun:
    """A loop running in its own task; ``events`` reads what it produces."""

    def __init__(self, loop_events: AsyncGenerator[Thinking | LoopResult]) -> None:
        self._queue: asyncio.Queue[Thinking | LoopResult | BaseException | None] = asyncio.Queue()
        self.superseded = False
        self.task = asyncio.create_task(self._pump(loop_events))

    async def _pump(self, loop_events: AsyncGenerator[Thinking | LoopResult]) -> None:
        try:
            async with contextlib.aclosing(loop_events) as events:
                async for event in events:
                    self._queue.put_nowait(event)
        except asyncio.CancelledError:
            self._queue.put_nowait(None)
            raise
        except Exception as exc:  # re-raised where the request reads it
            self._queue.put_nowait(exc)
        else:
            self._queue.put_nowait(None)

    async def events(self) -> AsyncIterator[Thinking | LoopResult]:
        while True:
            event = await self._queue.get()
            if event is None:
                if self.superseded:
                    raise Superseded
                return
            if isinstance(event, BaseException):
                raise event
            yield event

    async def stop(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


class Turns:
    """The loop in flight per conversation, so that a new turn can stop the last one."""

    def __init__(self) -> None:
        self._runs: dict[str, LoopRun] = {}

    async def supersede(self, key: str | None) -> float | None:
        """Stop the conversation's loop in flight, if any; the milliseconds it took."""
        if key is None or (previous := self._runs.pop(key, None)) is None:
            return None
        started = time.perf_counter()
        previous.superseded = True
        try:
            async with asyncio.timeout(_SUPERSEDE_WAIT_S):
                await previous.stop()
        except TimeoutError:
            log.warning("a superseded turn took over %.1f s to stop", _SUPERSEDE_WAIT_S)
        return (time.perf_counter() - started) * 1000

    def begin(self, key: str | None, run: LoopRun) -> None:
        if key is not None:
            self._runs[key] = run
            run.task.add_done_callback(lambda _: self._end(key, run))

    def _end(self, key: str, run: LoopRun) -> None:
        if self._runs.get(key) is run:
            del self._runs[key]
