"""Conversations that stay where they escalated.

A router decides each turn alone, so a conversation that needed the large model on
one turn would be sent back to the small one on the next if that turn reads easy;
its user then meets a weaker model in the middle of a hard exchange. Once a turn is
answered by the large path, the conversation's next turns stay there for a number of
turns and at most a time (per tenant), and their decisions say so.

What is remembered is per replica (a load balancer with affinity on the conversation
header keeps a conversation on one), and bounded: the least recently escalated
conversations are forgotten first.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import msgspec

from engines.base import Message


class Stickiness(msgspec.Struct, frozen=True):
    """How long a tenant's conversations stay on the large path after escalating."""

    turns: int  # further turns; 0: none
    seconds: float  # at most, after the turn that escalated


class Escalations:
    """The conversations answered by the large path lately, and how long each stays."""

    def __init__(
        self, max_conversations: int = 100_000, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._max = max_conversations
        self._clock = clock
        # conversation -> (turns left, until when)
        self._held: OrderedDict[str, tuple[int, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._held)

    def escalated(self, conversation: str, stickiness: Stickiness) -> None:
        """``conversation``'s turn was answered by the large path: its next turns stay."""
        if stickiness.turns <= 0:
            return
        self._held[conversation] = (stickiness.turns, self._clock() + stickiness.seconds)
        self._held.move_to_end(conversation)
        while len(self._held) > self._max:
            self._held.popitem(last=False)

    def stays(self, conversation: str) -> bool:
        """Whether ``conversation``'s turn now stays on the large path; it uses one of
        the turns left."""
        held = self._held.get(conversation)
        if held is None:
            return False
        turns, until = held
        if self._clock() >= until:
            del self._held[conversation]
            return False
        if turns <= 1:
            del self._held[conversation]
        else:
            self._held[conversation] = (turns - 1, until)
        return True


def first_turn_key(tenant: str, messages: Sequence[Message]) -> str | None:
    """A conversation named by what every later turn sends again: the system prompt
    (and developer messages) before, and the first user turn; None without one."""
    opening = []
    for message in messages:
        opening.append((message.role, message.content))
        if message.role == "user":
            digest = hashlib.sha256(msgspec.json.encode([tenant, opening])).hexdigest()
            return "first-turn:" + digest
    return None
