"""Hard questions over HTTP: the reasoning loop's run as a chat completion or a stream.

The loop runs in a task of its own (``LoopRun``) that the request reads from, so that
whatever ends the request's interest stops the work at once: the client leaving (a
closed stream, or a disconnect noticed while a plain response is pending) or a new
turn on the same conversation (``Turns``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping

import msgspec

from engines.base import EngineError, Message
from evaluator.loop import FallbackSettings, LoopResult, LoopTrace, ReasoningLoop, Thinking
from gateway.errors import APIError
from gateway.openai_types import (
    SSE_DONE,
    AssistantMessage,
    ChatCompletionChunk,
    Choice,
    ChunkChoice,
    ChunkDelta,
    ErrorResponse,
    ThoughtChunk,
    ThoughtCompletion,
    Usage,
    encode_sse,
)

log = logging.getLogger("satisfice.gateway")

DEADLINE_HEADER = "x-satisfice-deadline-ms"
CONVERSATION_HEADER = "x-satisfice-conversation"
SUPERSEDED_HEADER = "x-satisfice-superseded-ms"
# Longest a new turn waits for the previous turn's work to stop before it starts.
_SUPERSEDE_WAIT_S = 1.0


def requested_deadline_ms(headers: Mapping[str, str]) -> int | None:
    """The client's own deadline from ``x-satisfice-deadline-ms``, if it sent one."""
    raw = headers.get(DEADLINE_HEADER)
    if raw is None:
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        value = 0
    if value < 1:
        raise APIError(
            400,
            f"{DEADLINE_HEADER} is {raw!r}; send a whole number of milliseconds, at least 1",
            param=DEADLINE_HEADER,
        )
    return value


def conversation_key(tenant: str, headers: Mapping[str, str], user: str | None) -> str | None:
    """Which conversation a request continues: ``x-satisfice-conversation``, else the
    request's ``user`` field; None when it says neither."""
    name = headers.get(CONVERSATION_HEADER) or user
    return f"{tenant}\x00{name}" if name else None


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


class Think(msgspec.Struct, frozen=True, kw_only=True):
    """A hard question for the loop, with everything the response needs."""

    id: str
    created: int
    model: str
    messages: tuple[Message, ...]
    include_usage: bool
    max_tokens: int
    deadline: float | None
    fallback: FallbackSettings
    difficulty: float | None
    conversation: str | None
    # The engine that answers first when the loop only takes over a doubtful answer.
    escalated_from: str | None = None
    # Hears the result (None if there was none) to write an answer back to the cache.
    finished: Callable[[LoopResult | None], None]
    # The loop as the request's config and tenant tune it.
    loop: ReasoningLoop


def start(think: Think, turns: Turns) -> LoopRun:
    events = think.loop.run(
        think.messages,
        deadline=think.deadline,
        fallback=think.fallback,
        difficulty=think.difficulty,
        max_tokens=think.max_tokens,
    )
    run = LoopRun(events)
    turns.begin(think.conversation, run)
    return run


def trace_headers(trace: LoopTrace) -> dict[str, str]:
    return {
        "x-satisfice-stop": trace.stop,
        "x-satisfice-fallback": trace.fallback,
        "x-satisfice-confidence": f"{trace.confidence:.4f}",
        "x-satisfice-rounds": str(len(trace.rounds)),
        "x-satisfice-branches": str(sum(len(r.branches) for r in trace.rounds)),
        "x-satisfice-tokens": str(trace.tokens),
    }


def deadline_error(trace: LoopTrace) -> APIError:
    return APIError(
        504,
        f"no answer within the deadline of {trace.deadline_ms or 0:.0f} ms "
        f"({len(trace.rounds)} rounds, stopped at {trace.elapsed_ms:.0f} ms) and the "
        "fallback policy is error",
        type="server_error",
        code="deadline_exceeded",
    )


def _usage(result: LoopResult) -> Usage:
    return Usage(
        result.prompt_tokens,
        result.completion_tokens,
        result.prompt_tokens + result.completion_tokens,
    )


async def complete(think: Think, run: LoopRun) -> LoopResult:
    """The loop's result, for a plain (non-stream) response."""
    result: LoopResult | None = None
    try:
        async for event in run.events():
            if isinstance(event, LoopResult):
                result = event
    finally:
        think.finished(result)
    if result is None:  # pragma: no cover - the loop always ends with a result
        raise APIError(500, "the reasoning loop ended without an answer", type="server_error")
    return result


def completion(think: Think, result: LoopResult) -> ThoughtCompletion:
    return ThoughtCompletion(
        id=think.id,
        created=think.created,
        model=think.model,
        choices=[Choice(0, AssistantMessage(result.text), "stop")],
        usage=_usage(result),
        satisfice=result.trace,
    )


async def stream(think: Think, run: LoopRun) -> AsyncIterator[bytes]:
    """The loop as server-sent events: its progress as ``delta.reasoning_content`` at
    once, the answer as ``delta.content``, and the decision trace on the last chunk."""

    def chunk(choices: list[ChunkChoice], usage: Usage | None = None) -> bytes:
        return encode_sse(
            ChatCompletionChunk(
                id=think.id, created=think.created, model=think.model, choices=choices,
                usage=usage,
            )
        )  # fmt: skip

    result: LoopResult | None = None
    opened = False
    try:
        async for event in run.events():
            if isinstance(event, Thinking):
                delta = ChunkDelta(reasoning_content=event.text)
                if not opened:
                    delta = ChunkDelta(role="assistant", content="", reasoning_content=event.text)
                    opened = True
                yield chunk([ChunkChoice(0, delta)])
                continue
            result = event
        if result is None:  # pragma: no cover - the loop always ends with a result
            return
        if result.trace.fallback == "error":
            body = ErrorResponse(deadline_error(result.trace).body)
            yield b"data: " + msgspec.json.encode(body) + b"\n\n"
            return
        yield chunk([ChunkChoice(0, ChunkDelta(content=result.text))])
        end = ThoughtChunk(
            id=think.id,
            created=think.created,
            model=think.model,
            choices=[ChunkChoice(0, ChunkDelta(), "stop")],
            satisfice=result.trace,
        )
        yield encode_sse(end)
        if think.include_usage:
            yield chunk([], _usage(result))
        yield SSE_DONE
    except Superseded:
        error = APIError(409, "a newer turn of this conversation replaced this request",
                         code="superseded")  # fmt: skip
        yield b"data: " + msgspec.json.encode(ErrorResponse(error.body)) + b"\n\n"
    except EngineError as exc:  # the response has started: the error goes in the stream
        body = ErrorResponse(APIError.from_engine(exc).body)
        yield b"data: " + msgspec.json.encode(body) + b"\n\n"
    finally:
        # The client left, or the stream is done: nothing may go on thinking for it.
        await run.stop()
        think.finished(result)
