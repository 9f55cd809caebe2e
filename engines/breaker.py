"""A circuit breaker: stop calling a server that keeps failing, and try it again later.

After ``failures`` consecutive failed calls the breaker opens: every call is refused
at once, without touching the server, for ``open_s`` seconds. Then one trial call
goes through (half-open); its success closes the breaker, its failure opens it again.
A dead server then costs its callers nothing but a fast error instead of a connect
timeout each, and it is not hammered while it comes back.

Each admitted call holds a ``Ticket`` naming the breaker's epoch it was let in under:
a verdict from an older epoch (a long stream that began before the breaker opened)
is ignored, so only what the server did since the last change of state counts.

One breaker for every dependency that may be down: the HTTP engines (``failures``
from their settings), the cache's Redis store and the rate limits' Redis (both at
``failures=1``: Redis speeds a request up and must never hold one back). A verdict
says whether it began or ended an outage, so that each user logs the change once.
A shared lowest-level module: it imports nothing of ours, so every package may
import it (README, "Develop").
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

import msgspec

State = Literal["closed", "open", "half_open"]


class BreakerOpen(Exception):
    """The breaker refused a call; the server may be tried again in ``retry_in_s``."""

    def __init__(self, retry_in_s: float) -> None:
        super().__init__(f"circuit open, retry in {retry_in_s:.0f} s")
        self.retry_in_s = retry_in_s


class Ticket(msgspec.Struct, frozen=True):
    """One admitted call; hand it back with the call's verdict."""

    epoch: int
    trial: bool


class Breaker:
    def __init__(
        self, failures: int, open_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._threshold = failures
        self._open_s = open_s
        self._clock = clock
        self._epoch = 0
        self._failures = 0
        self._opened_at: float | None = None
        self._trial_out = False
        # Times the breaker opened since start, for metrics.
        self.opened = 0

    @property
    def state(self) -> State:
        if self._opened_at is None:
            return "closed"
        if self._trial_out or self._clock() >= self._opened_at + self._open_s:
            return "half_open"
        return "open"

    def admit(self) -> Ticket:
        """Let a call through, or raise ``BreakerOpen``."""
        state = self.state
        if state == "closed":
            return Ticket(self._epoch, trial=False)
        if state == "half_open" and not self._trial_out:
            self._trial_out = True
            self._epoch += 1
            return Ticket(self._epoch, trial=True)
        assert self._opened_at is not None
        # While the trial call runs, a caller is told to wait one more open period.
        wait = self._opened_at + self._open_s - self._clock()
        raise BreakerOpen(wait if wait > 0 else self._open_s)

    def succeeded(self, ticket: Ticket) -> bool:
        """The server answered (an answer, or a refusal that proves it is alive).
        True when this closed the breaker: an outage ended."""
        if ticket.epoch != self._epoch:
            return False
        if ticket.trial:
            self._close()
            return True
        self._failures = 0
        return False

    def failed(self, ticket: Ticket) -> bool:
        """The server could not be reached, answered 5xx, or broke off mid-answer.
        True when this opened a closed breaker: an outage began (a failed trial only
        opens it again)."""
        if ticket.epoch != self._epoch:
            return False
        if ticket.trial:
            self._open()
            return False
        self._failures += 1
        if self._failures >= self._threshold:
            self._open()
            return True
        return False

    def abandoned(self, ticket: Ticket) -> None:
        """The call ended without a verdict (its caller left): a trial may go again."""
        if ticket.trial and ticket.epoch == self._epoch:
            self._trial_out = False

    def _open(self) -> None:
        self._epoch += 1
        self._opened_at = self._clock()
        self._trial_out = False
        self._failures = 0
        self.opened += 1

    def _close(self) -> None:
        self._epoch += 1
        self._opened_at = None
        self._trial_out = False
        self._failures = 0
