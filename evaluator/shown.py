"""What the reasoning loop shows while it runs: its notes, the leading branch's tokens as
they are generated, and a provisional first answer from the small engine.

Branches and the first answer run in tasks of their own; they put what they have to
show here, and the loop's generator hands it on while it waits for a round
(``during``). The first answer and the branch stream in one text field, so the two
never interleave: while the first answer streams, the branch's tokens wait, and follow
it once it is whole.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Literal

import msgspec

# note: the loop's own status (its budget, a round's summary, a verdict on the first
# answer); thought: a branch's tokens; first_answer: the small engine's provisional one.
ThoughtKind = Literal["note", "thought", "first_answer"]

FIRST_ANSWER_LABEL = "First answer (provisional, the small model's; the loop thinks on):\n"


class Thinking(msgspec.Struct, frozen=True):
    """Progress the client may see while the loop runs (``delta.reasoning_content``)."""

    text: str
    kind: ThoughtKind = "note"


class _RoundOver(msgspec.Struct, frozen=True):
    """Put after the last of a round's items: the round's task is done."""


_ROUND_OVER = _RoundOver()


class Shown:
    """The channel from the loop's tasks to the client, in the order things happened."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[Thinking | _RoundOver] = asyncio.Queue()
        self._held: list[Thinking] = []  # a branch's tokens while the first answer streams
        self._first_answer_streaming = False
        self._started = time.monotonic()
        self._first_at: float | None = None  # when the first thought or first answer came
        self._first_answer_whole_at: float | None = None

    def thought(self, text: str) -> None:
        """A branch's new tokens."""
        self._meaningful()
        if self._first_answer_streaming:
            self._held.append(Thinking(text, "thought"))
        else:
            self._queue.put_nowait(Thinking(text, "thought"))

    def thought_ends(self) -> None:
        """The branch streamed is done for this round: the next text starts a line."""
        self.thought("\n")

    def first_answer(self, text: str) -> None:
        """The first answer's new tokens; its first ones come after its label."""
        self._meaningful()
        if not self._first_answer_streaming:
            self._first_answer_streaming = True
            text = FIRST_ANSWER_LABEL + text
        self._queue.put_nowait(Thinking(text, "first_answer"))

    def first_answer_whole(self) -> None:
        self._first_answer_whole_at = time.monotonic()

    def first_answer_ends(self) -> None:
        """The first answer is whole, or stopped: the branch's held tokens follow it."""
        if not self._first_answer_streaming:
            return
        self._first_answer_streaming = False
        self._queue.put_nowait(Thinking("\n", "first_answer"))
        for held in self._held:
            self._queue.put_nowait(held)
        self._held.clear()

    async def during(self, task: asyncio.Task[object]) -> AsyncIterator[Thinking]:
        """What is shown until ``task`` is done, then whatever came before its end."""
        task.add_done_callback(lambda _: self._queue.put_nowait(_ROUND_OVER))
        while not isinstance(item := await self._queue.get(), _RoundOver):
            yield item

    def ready(self) -> list[Thinking]:
        """What was shown and not yet handed on (between rounds, at the end)."""
        items: list[Thinking] = []
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if isinstance(item, Thinking):
                items.append(item)
        return items

    @property
    def first_shown_ms(self) -> float | None:
        return self._ms(self._first_at)

    @property
    def first_answer_whole_ms(self) -> float | None:
        return self._ms(self._first_answer_whole_at)

    def _ms(self, at: float | None) -> float | None:
        return None if at is None else (at - self._started) * 1000

    def _meaningful(self) -> None:
        if self._first_at is None:
            self._first_at = time.monotonic()
