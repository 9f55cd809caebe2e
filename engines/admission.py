"""A bounded waiting room in front of an engine's generation slots."""

from __future__ import annotations

import asyncio

from engines.base import EngineOverloaded


class Admission:
    """``slots`` samples run at once and at most ``queue_size`` wait for a slot.

    A caller that would be one too many is refused at once with ``EngineOverloaded``
    instead of queueing without bound: under overload a fast 429 beats a timeout.
    """

    def __init__(self, engine: str, slots: int, queue_size: int, retry_after_s: float) -> None:
        self._engine = engine
        self._slots = asyncio.Semaphore(slots)
        self._queue_size = queue_size
        self._retry_after_s = retry_after_s
        self.waiting = 0

    @property
    def full(self) -> bool:
        """One more caller would be refused now."""
        return self._slots.locked() and self.waiting >= self._queue_size

    def refusal(self) -> EngineOverloaded:
        return EngineOverloaded(self._engine, self._queue_size, self._retry_after_s)

    async def acquire(self) -> None:
        if self.full:
            raise self.refusal()
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1

    def release(self) -> None:
        self._slots.release()
