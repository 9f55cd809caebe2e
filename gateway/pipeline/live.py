"""How many live requests are generating now: what background work (shadow checks)
yields to."""

from __future__ import annotations

from collections.abc import Callable

from gateway.pipeline.exchange import Settled


class LiveWork:
    """Live requests between the moment the pipeline hands one to an engine or the loop
    and the moment it settles. Every such request settles exactly once
    (gateway.pipeline.exchange), so ``settled`` balances each ``begin``."""

    def __init__(self) -> None:
        self.generating = 0
        # Told of each new count: background work stops at once when one begins, and
        # may start when one settles.
        self._watchers: list[Callable[[int], None]] = []

    def watch(self, watcher: Callable[[int], None]) -> None:
        self._watchers.append(watcher)

    def begin(self) -> None:
        self.generating += 1
        for watcher in self._watchers:
            watcher(self.generating)

    def settled(self, settled: Settled) -> None:
        """A settlement subscriber: a request that generated is over."""
        if settled.generated:
            self.generating -= 1
            for watcher in self._watchers:
                watcher(self.generating)
