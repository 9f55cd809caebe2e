"""An outcome as OpenAI's wire format: the whole answer as one completion, or each
event as a server-sent chunk the moment it comes. The one place either is written."""

from __future__ import annotations

import contextlib
import re
from collections import defaultdict
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence

import msgspec

from engines.base import EngineError
from engines.base import TokenLogprob as EngineLogprob
from gateway.api.errors import APIError
from gateway.api.wire import (
    SSE_DONE,
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    ChunkDelta,
    ErrorResponse,
    FunctionCall,
    FunctionCallDelta,
    ReasonedMessage,
    ThoughtChunk,
    ThoughtCompletion,
    TokenLogprob,
    ToolCall,
    ToolCallChunk,
    ToolCallingMessage,
    TopLogprob,
    TracedCompletion,
    Usage,
    encode_sse,
)
from gateway.ops.ids import RandomHex
from gateway.pipeline.exchange import Exchange
from gateway.pipeline.outcome import (
    Answering,
    Finished,
    Reasoning,
    Refused,
    TextDelta,
    ToolCallPart,
)


class Reply(msgspec.Struct, frozen=True, kw_only=True):
    """What the response carries besides the answer."""

    id: str
    created: int
    model: str
    include_usage: bool  # a stream ends with a usage chunk
    trace: bool  # the decision trace in a plain answer's body
    reasoning: bool = False  # the loop's reasoning in a plain answer's message


_random_hex = RandomHex()


def completion_id() -> str:
    """OpenAI's form: "chatcmpl-" and 32 hex digits, random."""
    return "chatcmpl-" + _random_hex()


# Stand-ins for a response's id and time while a template is rendered: any value would
# do, since `"id":"` and `"created":` cannot occur inside a JSON string, where every
# quote is escaped. A completion id has this length, and the time has ten digits.
_TEMPLATE_ID = "chatcmpl-" + "t" * 32
_TEMPLATE_CREATED = 1_000_000_000
_HOLES = re.compile(
    rb'(?<="id":")' + _TEMPLATE_ID.encode() + rb'(?=")|(?<="created":)'
    + str(_TEMPLATE_CREATED).encode() + rb"(?=,)"
)  # fmt: skip


class Template:
    """A whole response body rendered once, with holes for each response's own id and
    time: how a cached answer is sent again without encoding it again."""

    def __init__(self, rendered: bytes) -> None:
        self._parts = _HOLES.split(rendered)

    def fill(self, id_: str, created: int) -> bytes:
        """The body of a response ``id_``, made at ``created``: in each event its id
        comes before its time (the wire structs' field order)."""
        values = (id_.encode(), str(created).encode())
        pieces = [self._parts[0]]
        for i, part in enumerate(self._parts[1:]):
            pieces += (values[i % 2], part)
        return b"".join(pieces)


async def template(
    answering: Answering, model: str, *, stream: bool, include_usage: bool
) -> Template:
    """The body ``completion`` (or with ``stream``, ``chunks``) renders for ``answering``,
    as a template: the same function renders it, so the bytes are the same."""
    reply = Reply(
        id=_TEMPLATE_ID, created=_TEMPLATE_CREATED, model=model,
        include_usage=include_usage, trace=False,
    )  # fmt: skip
    if not stream:
        return Template(await completion(answering, reply))
    body = [part async for part in chunks(answering, reply)]
    return Template(b"".join(body))


async def completion(answering: Answering, reply: Reply) -> bytes:
    """The whole answer as one chat completion (JSON). Raises what the answer raised."""
    texts: defaultdict[int, list[str]] = defaultdict(list)
    logprobs: defaultdict[int, list[EngineLogprob]] = defaultdict(list)
    asked_logprobs = False
    reasoning: list[str] = []
    calls: defaultdict[int, ToolCalls] = defaultdict(ToolCalls)
    end: Finished | None = None
    async with contextlib.aclosing(answering.events) as events:
        async for event in events:
            if isinstance(event, Reasoning):
                reasoning.append(event.text)
            elif isinstance(event, ToolCallPart):
                calls[event.index].add(event)
            elif isinstance(event, TextDelta):
                texts[event.index].append(event.text)
                if event.logprobs is not None:
                    asked_logprobs = True
                    logprobs[event.index].extend(event.logprobs)
            elif isinstance(event, Finished):
                end = event
    if end is None:  # pragma: no cover - every answer ends with Finished or raises
        raise RuntimeError("the answer ended without finishing")
    choices = [
        Choice(
            index,
            _message(
                "".join(texts[index]),
                reasoning if reply.reasoning and index == 0 else None,
                calls[index].whole() if index in calls else [],
            ),
            reason,
            _logprobs(logprobs[index]) if asked_logprobs else None,
        )
        for index, reason in enumerate(end.finish_reasons)
    ]
    body = ChatCompletion(
        id=reply.id, created=reply.created, model=reply.model, choices=choices, usage=_usage(end)
    )
    if end.loop is not None:
        body = ThoughtCompletion(**msgspec.structs.asdict(body), satisfice=end.loop)
    elif reply.trace:
        trace = answering.decision.view()
        body = TracedCompletion(**msgspec.structs.asdict(body), satisfice=trace)
    return msgspec.json.encode(body)


def chunks(
    answering: Answering, reply: Reply, exchange: Exchange | None = None
) -> AsyncIterator[bytes]:
    """The answer as server-sent chunks, as ``delivered`` sends them."""
    return delivered(_chunks(answering, reply), exchange, _error_chunk)


async def delivered(
    events: AsyncGenerator[bytes],
    exchange: Exchange | None,
    error_event: Callable[[APIError], bytes],
) -> AsyncIterator[bytes]:
    """A stream's events as they go out, in any API's words: an error the answer raises
    after the stream has begun goes in it (``error_event``). ``exchange`` (None: a
    template, sent to nobody yet) hears the first event go out, and the response end:
    499 if the client left before it was whole."""
    # The client left, until the stream has been sent whole or failed on its own.
    status, error = 499, "client_gone"
    try:
        async with contextlib.aclosing(events) as parts:
            unsent = exchange is not None  # the first event is still to go
            async for part in parts:
                if unsent and exchange is not None:
                    unsent = False
                    exchange.first_byte()
                yield part
            status, error = 200, ""
    except (Refused, EngineError) as exc:  # the response has begun: the error goes in it
        refusal = APIError.of(exc)
        assert refusal is not None
        status, error = 200, refusal.reason
        yield error_event(refusal)
    except Exception:
        status, error = 500, "internal_error"
        raise
    finally:
        if exchange is not None:
            exchange.end(status, error or None)


def _error_chunk(refusal: APIError) -> bytes:
    return encode_sse(ErrorResponse(refusal.body))


async def _chunks(answering: Answering, reply: Reply) -> AsyncGenerator[bytes]:
    """Each event of the answer as chat completion chunks."""
    started: set[int] = set()

    def chunk(choices: list[ChunkChoice], usage: Usage | None = None) -> bytes:
        return encode_sse(
            ChatCompletionChunk(
                id=reply.id, created=reply.created, model=reply.model, choices=choices,
                usage=usage,
            )
        )  # fmt: skip

    def opening(index: int) -> bytes:
        """The chunk that gives choice ``index`` its role, once; it leaves with the
        choice's first text in one write (one wake-up of the client, not two)."""
        if index in started:
            return b""
        started.add(index)
        return chunk([ChunkChoice(index, ChunkDelta(role="assistant", content=""))])

    async with contextlib.aclosing(answering.events) as events:
        async for event in events:
            if isinstance(event, Reasoning):
                delta = ChunkDelta(reasoning_content=event.text)
                yield opening(0) + chunk([ChunkChoice(0, delta)])
            elif isinstance(event, TextDelta):
                logprobs = None if event.logprobs is None else _logprobs(event.logprobs)
                text = ChunkChoice(event.index, ChunkDelta(content=event.text), None, logprobs)
                yield opening(event.index) + chunk([text])
            elif isinstance(event, ToolCallPart):
                delta = ChunkDelta(tool_calls=[_tool_call_chunk(event)])
                yield opening(event.index) + chunk([ChunkChoice(event.index, delta)])
            else:
                yield _ending(event, reply, opening, chunk)


def _ending(
    end: Finished,
    reply: Reply,
    opening: Callable[[int], bytes],
    chunk: Callable[[list[ChunkChoice], Usage | None], bytes],
) -> bytes:
    """Each choice's finish, the loop's trace on the last chunk, usage, and the end."""
    parts = []
    for index, reason in enumerate(end.finish_reasons):
        finish = [ChunkChoice(index, ChunkDelta(), reason)]
        if end.loop is not None and index == 0:
            last = ThoughtChunk(
                id=reply.id, created=reply.created, model=reply.model, choices=finish,
                satisfice=end.loop,
            )  # fmt: skip
            parts.append(opening(index) + encode_sse(last))
        else:
            parts.append(opening(index) + chunk(finish, None))
    if reply.include_usage:
        parts.append(chunk([], _usage(end)))
    parts.append(SSE_DONE)
    return b"".join(parts)


def _message(text: str, reasoning: list[str] | None, calls: list[ToolCall]) -> AssistantMessage:
    """A choice's message; with ``reasoning`` (asked for, and there was some), the
    loop's reasoning beside it, in the field reasoning models use; with ``calls``, the
    tools it calls (and null content when it said nothing beside them)."""
    if calls:
        return ToolCallingMessage(text or None, tool_calls=calls)
    if not reasoning:
        return AssistantMessage(text)
    return ReasonedMessage(text, reasoning_content="".join(reasoning))


class ToolCalls:
    """A choice's tool calls, put together from their parts."""

    def __init__(self) -> None:
        self._calls: dict[int, tuple[str, str, list[str]]] = {}

    def add(self, part: ToolCallPart) -> None:
        call = part.call
        if call.index not in self._calls:
            self._calls[call.index] = (call.id or "", call.name or "", [])
        self._calls[call.index][2].append(call.arguments)

    def whole(self) -> list[ToolCall]:
        return [
            ToolCall(id=id_, function=FunctionCall(name, "".join(arguments)))
            for _, (id_, name, arguments) in sorted(self._calls.items())
        ]


def _tool_call_chunk(part: ToolCallPart) -> ToolCallChunk:
    """A tool call's part as OpenAI streams it: the first names the call, and each
    carries the next piece of its arguments."""
    call = part.call
    if call.id is None and call.name is None:
        return ToolCallChunk(call.index, function=FunctionCallDelta(arguments=call.arguments))
    return ToolCallChunk(
        call.index, call.id, "function", FunctionCallDelta(call.name, call.arguments)
    )


def _usage(end: Finished) -> Usage:
    return Usage(
        end.prompt_tokens, end.completion_tokens, end.prompt_tokens + end.completion_tokens
    )


def _logprobs(tokens: Sequence[EngineLogprob]) -> ChoiceLogprobs:
    return ChoiceLogprobs(
        [
            TokenLogprob(
                token=t.token,
                logprob=t.logprob,
                bytes=list(t.token.encode("utf-8")),
                top_logprobs=[
                    TopLogprob(a.token, a.logprob, list(a.token.encode("utf-8"))) for a in t.top
                ],
            )
            for t in tokens
        ]
    )
