"""Coalescing of identical misses: while one request computes an answer, identical
requests wait for it instead of each calling an engine.

The first request for a key leads: it gets a ``Flight`` and must ``land`` it with
the answer, or with None when it has none (failed, cancelled), in every case, and
``end`` it once the answer is where later requests will find it (the cache). The
others follow: they await the leader's answer, and on None compute their own.
Requests that arrive between landing and the end get the answer at once, so no
second engine call starts while the first answer is still being stored. A leader
whose own caller has gone may go on for the followers still waiting: ``deserted``
tells it when the last of them stops waiting.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

T = TypeVar("T")


class Flight(Generic[T]):
    def __init__(self, flights: Coalescer[T], key: Hashable) -> None:
        self._flights = flights
        self._key = key
        self._answer: asyncio.Future[T | None] = asyncio.get_running_loop().create_future()
        self.followers = 0  # waiting now
        self._on_deserted: Callable[[], None] | None = None

    def land(self, answer: T | None) -> None:
        """Hand the answer to every follower; later calls do nothing."""
        if not self._answer.done():
            self._answer.set_result(answer)

    def end(self) -> None:
        """Stop taking followers: the next request for the key starts afresh."""
        self.land(None)
        if self._flights._flights.get(self._key) is self:
            del self._flights._flights[self._key]

    async def wait(self) -> T | None:
        self.followers += 1
        try:
            # Shielded: a follower that gives up must not cancel the others' answer.
            return await asyncio.shield(self._answer)
        finally:
            self.followers -= 1
            if not self.followers and not self._answer.done() and self._on_deserted:
                self._on_deserted()

    def deserted(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once no follower waits for the answer: now, if none does,
        else when the last one stops waiting before the answer lands."""
        if self.followers:
            self._on_deserted = callback
        else:
            callback()


class Coalescer(Generic[T]):
    def __init__(self) -> None:
        self._flights: dict[Hashable, Flight[T]] = {}

    def join(self, key: Hashable) -> tuple[Flight[T], bool]:
        """The flight for ``key`` and whether the caller leads it."""
        flight = self._flights.get(key)
        if flight is not None:
            return flight, False
        flight = self._flights[key] = Flight(self, key)
        return flight, True
