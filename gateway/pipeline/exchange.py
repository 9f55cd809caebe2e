"""One chat request from the front door to the moment it settles.

Every request settles exactly once, on every exit: answered from the cache (exact,
semantic, coalesced, on the express path or the framework's), by an engine or the
reasoning loop, or by a fallback at the deadline; refused, failed, its client gone,
or replaced by a newer turn. It settles when its response is over and so is its work:
a request that leads identical ones may work on for them after its own client left.

The settled event carries the request, its resolved policy, the complete decision,
the answer as served (or the reason there is none) and what the cache may keep. The
cache's write-back, the metrics, the access log, the trace span and the memory of
semantic hits for feedback subscribe to it (``Settlement``); none of them is called
from an exit.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, Callable

import msgspec

from gateway.pipeline.answer import Answer, Kept
from gateway.pipeline.outcome import Decision, Event, Finished, Reasoning, TextDelta, ToolCallPart
from gateway.pipeline.request import ChatRequest
from gateway.pipeline.request_policy import Policy
from router.embedder import Embedding

log = logging.getLogger("satisfice.gateway")


class Served(msgspec.Struct, frozen=True, kw_only=True):
    """The answer as the client was sent it: each choice's text, in index order, and
    how each finished (none: it was cut off, by an error or the client leaving)."""

    texts: tuple[str, ...]
    finish_reasons: tuple[str, ...] = ()
    prompt_tokens: int = 0
    completion_tokens: int = 0


class Settled(msgspec.Struct, frozen=True, kw_only=True):
    """A request, settled: what it asked, what was decided, what it got."""

    request_id: str | None
    key: str | None  # the API key's name in the config, never the key
    request: ChatRequest | None  # None: refused before its body was read as a request
    policy: Policy | None  # None: refused before its settings were resolved
    decision: Decision  # complete
    answer: Served | None  # None: nothing of an answer was sent
    status: int  # the HTTP status (499: the client left first)
    error: str | None  # why the answer is missing or cut off, as the client was told
    seconds: float  # from arrival to the end of the response
    ended: float  # time.monotonic() when the response ended
    first_byte_s: float | None  # a stream's first chunk, from arrival
    # A stream's first answer text, branch token or first answer (interaction
    # latency: the loop's status notes do not count), from arrival.
    first_meaningful_s: float | None = None
    kept: Kept | None  # the whole answer the cache may keep
    # Whether an engine or the loop was set to work for it (not a cached or shared answer).
    generated: bool = False
    # The last user turn's embedding, when the router used it.
    embedding: Embedding | None = None


Subscriber = Callable[[Settled], None]


class Settlement:
    """Where settled requests go: to each subscriber, in the order they subscribed. A
    subscriber that fails is logged and costs the others nothing."""

    def __init__(self) -> None:
        self._subscribers: list[Subscriber] = []

    def subscribe(self, subscriber: Subscriber) -> None:
        self._subscribers.append(subscriber)

    def publish(self, settled: Settled) -> None:
        for subscriber in self._subscribers:
            try:
                subscriber(settled)
            except Exception:
                log.exception("a subscriber to settled requests failed")


class Exchange:
    """One chat request on its way to ``Settled``: the front door opens it and ends its
    response (``end``); the pipeline records its decision, the answer as it is sent and
    what the cache may keep, and holds it open while its work outlives the response."""

    __slots__ = (
        "_ended",
        "_finished",
        "_first_byte_s",
        "_first_meaningful_s",
        "_holds",
        "_sent_whole",
        "_settlement",
        "_texts",
        "decision",
        "embedding",
        "generated",
        "kept",
        "key",
        "policy",
        "request",
        "request_id",
        "settled",
        "started",
    )

    def __init__(
        self,
        settlement: Settlement,
        *,
        tenant: str,
        model: str,
        key: str | None,
        request_id: str | None,
        started: float | None = None,
        policy: str = "shipped",
    ) -> None:
        self._settlement = settlement
        self.started = time.monotonic() if started is None else started
        self.key = key
        self.request_id = request_id
        self.decision = Decision(tenant=tenant, model=model, policy=policy)
        self.request: ChatRequest | None = None
        self.policy: Policy | None = None
        self.kept: Kept | None = None
        self.generated = False  # set by the pipeline as it hands the request to an engine
        self.embedding: Embedding | None = None  # set by the pipeline when it routes
        self._texts: dict[int, list[str]] = {}  # a streamed answer's, as sent
        self._finished: Finished | None = None
        self._sent_whole: Served | None = None  # an answer sent in one piece
        self._first_byte_s: float | None = None
        self._first_meaningful_s: float | None = None
        self._holds = 1  # the response's, until ``end``
        self._ended: tuple[int, str | None, float] | None = None
        self.settled = False

    def admitted(self, request: ChatRequest, policy: Policy) -> None:
        self.request, self.policy = request, policy

    def decide(self, **changes: object) -> Decision:
        """The decision with ``changes``, now in force. A settled decision is complete:
        changing it then is a bug."""
        if self.settled:
            raise RuntimeError(f"the decision of a settled request changed: {changes}")
        self.decision = msgspec.structs.replace(self.decision, **changes)
        return self.decision

    def keep(self, kept: Kept) -> None:
        """A whole answer the cache may keep: the write-back's, once settled."""
        self.kept = kept

    async def sent(self, events: AsyncGenerator[Event]) -> AsyncGenerator[Event]:
        """``events`` as they go to the client, each noted as part of the answer served."""
        try:  # contextlib.aclosing's work, without its context manager's two coroutines
            async for event in events:
                if self._first_meaningful_s is None and _meaningful(event):
                    self._first_meaningful_s = time.monotonic() - self.started
                if isinstance(event, TextDelta):
                    self._texts.setdefault(event.index, []).append(event.text)
                elif isinstance(event, Finished):
                    self._finished = event
                yield event
        finally:
            await events.aclose()

    async def told(self, answer: Answer) -> AsyncGenerator[Event]:
        """An answer in hand (a cached or shared one) as events, each noted as part of
        the answer served as it goes: what ``sent`` notes of them, with no generator
        between."""
        self._texts[0] = [answer.text]
        self._first_meaningful_s = time.monotonic() - self.started
        yield TextDelta(0, answer.text)
        self._finished = Finished(
            (answer.finish_reason,), answer.prompt_tokens, answer.completion_tokens
        )
        yield self._finished

    def sent_whole(self, answer: Answer) -> None:
        """An answer sent in one piece (a cached one, rendered before)."""
        self._sent_whole = Served(
            texts=(answer.text,),
            finish_reasons=(answer.finish_reason,),
            prompt_tokens=answer.prompt_tokens,
            completion_tokens=answer.completion_tokens,
        )

    def first_byte(self) -> float:
        """A stream's first chunk is going out: seconds since arrival."""
        self._first_byte_s = time.monotonic() - self.started
        return self._first_byte_s

    def hold(self) -> None:
        """Work that may outlive the response has begun: settle only once it is over."""
        self._holds += 1

    def release(self) -> None:
        """The work held open is over."""
        self._let_go()

    def end(self, status: int, error: str | None = None) -> None:
        """The response is over, with ``status``; ``error`` says why there is no answer,
        or why it was cut off. Only the first call counts."""
        if self._ended is not None:
            return
        self._ended = (status, error, time.monotonic())
        self._let_go()

    def _let_go(self) -> None:
        self._holds -= 1
        if self._holds or self._ended is None:
            return
        status, error, ended = self._ended
        self.settled = True
        self._settlement.publish(
            Settled(
                request_id=self.request_id,
                key=self.key,
                request=self.request,
                policy=self.policy,
                decision=self.decision,
                answer=self._served(),
                status=status,
                error=error,
                seconds=ended - self.started,
                ended=ended,
                first_byte_s=self._first_byte_s,
                first_meaningful_s=self._first_meaningful(ended),
                kept=self.kept,
                generated=self.generated,
                embedding=self.embedding,
            )
        )

    def _first_meaningful(self, ended: float) -> float | None:
        """A stream's interaction latency; a stream sent whole (a cached answer, one
        write) means something once it is sent."""
        if self.request is None or not self.request.stream:
            return None
        if self._sent_whole is not None:
            return ended - self.started
        return self._first_meaningful_s

    def _served(self) -> Served | None:
        if self._sent_whole is not None:
            return self._sent_whole
        if not self._texts and self._finished is None:
            return None
        end = self._finished
        choices = max([*self._texts, *(() if end is None else range(len(end.finish_reasons)))])
        texts = tuple("".join(self._texts.get(i, ())) for i in range(choices + 1))
        if end is None:
            return Served(texts=texts)
        return Served(
            texts=texts,
            finish_reasons=end.finish_reasons,
            prompt_tokens=end.prompt_tokens,
            completion_tokens=end.completion_tokens,
        )


def _meaningful(event: Event) -> bool:
    """Whether ``event`` means something to a reader: text, not a status note."""
    if isinstance(event, Reasoning):
        return event.kind != "note"
    return isinstance(event, (TextDelta, ToolCallPart))
