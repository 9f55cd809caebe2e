"""Samples of one prompt asked for at the same moment, gathered into one group.

The reasoning loop starts a round's k branches as k calls of one sample each, in one
turn of the event loop; a request with ``n = k`` asks for k at once. A backend that
decodes several sequences of one prompt together (engines/llama_batch.py) serves a
group with one pass over the prompt and one batched decode. Samples join the group
open for their prompt until it is dispatched, one turn of the event loop after its
first sample came, or until it holds ``limit`` samples.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Hashable
from typing import Any

from engines.base import Delta, Prompt, SamplingParams
from engines.fanout import SampleDone


class Member:
    """One sample of a group: its own parameters (its seed) and deadline, and the
    queue of the stream that asked for it."""

    __slots__ = ("cancel", "deadline", "finished", "index", "joined", "out", "params")

    def __init__(
        self,
        index: int,
        params: SamplingParams,
        deadline: float | None,
        out: asyncio.Queue[Delta | SampleDone | Exception],
        joined: float,
    ) -> None:
        self.index = index
        self.params = params
        self.deadline = deadline
        self.out = out
        self.joined = joined
        # Set from the event loop when the asking stream is closed; read by the
        # worker thread between two tokens.
        self.cancel = threading.Event()
        self.finished = False  # its SampleDone (or an error) was handed over

    def hand(self, item: Delta | SampleDone | Exception) -> None:
        """Give the asking stream one item (on the event loop's thread)."""
        if not isinstance(item, Delta):
            self.finished = True
        self.out.put_nowait(item)


class Group:
    """Samples of one prompt served together."""

    __slots__ = ("members", "prompt", "submitted", "task")

    def __init__(self, prompt: Prompt) -> None:
        self.prompt = prompt
        self.members: list[Member] = []
        self.task: asyncio.Task[None] | None = None
        # The backend has it: cancelling its task now would free the slot while the
        # worker still decodes; each member's ``cancel`` stops it instead.
        self.submitted = False


class Gathering:
    """Open groups by prompt, and the tasks that serve them."""

    def __init__(self, limit: int, serve: Callable[[Group], Coroutine[Any, Any, None]]) -> None:
        self._limit = limit
        self._serve = serve
        self._open: dict[Hashable, Group] = {}
        self._tasks: set[asyncio.Task[None]] = set()  # the loop keeps only weak references

    def join(self, prompt: Prompt, member: Member) -> Group:
        key = _key(prompt)
        group = self._open.get(key)
        if group is None or len(group.members) >= self._limit:
            group = self._open[key] = Group(prompt)
            group.task = task = asyncio.create_task(self._dispatch(key, group))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        group.members.append(member)
        return group

    def leave(self, group: Group, member: Member) -> None:
        """The member's stream is closed: stop its sample, and the group's task when
        nobody is left to wait for it and the backend does not have it yet."""
        member.cancel.set()
        if group.submitted or group.task is None:
            return
        if all(m.cancel.is_set() for m in group.members):
            key = _key(group.prompt)
            if self._open.get(key) is group:
                del self._open[key]
            group.task.cancel()

    async def _dispatch(self, key: Hashable, group: Group) -> None:
        # Every branch of a round calls in the turn it was started in; one turn later
        # they have all joined.
        await asyncio.sleep(0)
        if self._open.get(key) is group:
            del self._open[key]
        await self._serve(group)


def _key(prompt: Prompt) -> Hashable:
    # Messages are frozen Structs, hashable; a conversation may come as a list.
    return prompt if isinstance(prompt, str) else tuple(prompt)
