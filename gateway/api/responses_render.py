"""An answer as a Responses API response: the output items its events build (the loop's
reasoning, the message, each function call), whole as one response, or streamed as the
API's typed events the moment each answer event comes. One builder serves both, so a
stream's last event carries the response a plain request gets."""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import AsyncGenerator, AsyncIterator

import msgspec

from engines.base import ToolCallDelta
from gateway.api import render
from gateway.api.errors import APIError
from gateway.api.responses_wire import (
    ArgumentsDelta,
    ArgumentsDone,
    ContentPartAdded,
    ContentPartDone,
    ErrorEvent,
    FunctionCallItem,
    IncompleteDetails,
    ItemStatus,
    MessageItem,
    OutputItem,
    OutputItemAdded,
    OutputItemDone,
    OutputText,
    OutputTextDelta,
    OutputTextDone,
    OutputTokensDetails,
    ReasoningConfig,
    ReasoningItem,
    ReasoningText,
    ReasoningTextDelta,
    ReasoningTextDone,
    Response,
    ResponseCompleted,
    ResponseCreated,
    ResponseIncomplete,
    ResponseInProgress,
    ResponsesRequest,
    ResponseUsage,
    StreamEvent,
    TextConfig,
    ThoughtResponse,
    TracedResponse,
    encode_event,
)
from gateway.api.wire import TextFormat
from gateway.ops.ids import RandomHex
from gateway.pipeline.exchange import Exchange
from gateway.pipeline.outcome import (
    Answering,
    Finished,
    Reasoning,
    TextDelta,
    ToolCallPart,
)

_random_hex = RandomHex()

# Why an answer was cut off, in the Responses API's words (deadline is this gateway's:
# the request's deadline stopped it).
_CUT_OFF = {"length": "max_output_tokens", "deadline": "deadline"}


def response_id() -> str:
    """OpenAI's form: "resp_" and 32 hex digits, random."""
    return "resp_" + _random_hex()


async def whole(request: ResponsesRequest, answering: Answering, reply: render.Reply) -> bytes:
    """The whole answer as one response (JSON). Raises what the answer raised. The loop's
    reasoning is in it when asked for: ``reasoning.summary``, or x-satisfice-reasoning
    as on a chat completion."""
    output = _Output()
    end: Finished | None = None
    async with contextlib.aclosing(answering.events) as events:
        async for event in events:
            if isinstance(event, Finished):
                output.finish(event)
                end = event
            else:
                output.take(event)
    if end is None:  # pragma: no cover - every answer ends with Finished or raises
        raise RuntimeError("the answer ended without finishing")
    response = _final(_begun(request, reply), output, end)
    asked = request.reasoning is not None and request.reasoning.summary is not None
    if not (asked or reply.reasoning):
        shown = [item for item in response.output if not isinstance(item, ReasoningItem)]
        response = msgspec.structs.replace(response, output=shown)
    return msgspec.json.encode(_traced(response, answering, reply, end))


def stream(
    request: ResponsesRequest,
    answering: Answering,
    reply: render.Reply,
    exchange: Exchange | None,
) -> AsyncIterator[bytes]:
    """The answer as the Responses API's server-sent events, as ``render.delivered``
    sends them (``exchange`` None: to nobody yet): an error after the stream began is
    an ``error`` event."""
    streamed = _Streamed(_begun(request, reply), answering, reply)
    return render.delivered(streamed.events(), exchange, streamed.failed)


def _begun(request: ResponsesRequest, reply: render.Reply) -> Response:
    """The response in progress: its id and time, and the request's settings echoed."""
    text = request.text.format if request.text is not None else None
    return Response(
        id=reply.id,
        created_at=reply.created,
        status="in_progress",
        instructions=request.instructions,
        max_output_tokens=request.max_output_tokens,
        metadata=request.metadata or {},
        model=reply.model,
        output=[],
        parallel_tool_calls=request.parallel_tool_calls is not False,
        reasoning=request.reasoning or ReasoningConfig(),
        temperature=request.temperature,
        text=TextConfig(text or TextFormat()),
        tool_choice=request.tool_choice or "auto",
        tools=request.tools or [],
        top_p=request.top_p,
        user=request.user,
    )


def _final(begun: Response, output: _Output, end: Finished) -> Response:
    cut_off = _cut_off(end)
    return msgspec.structs.replace(
        begun,
        status="completed" if cut_off is None else "incomplete",
        completed_at=int(time.time()) if cut_off is None else None,
        incomplete_details=None if cut_off is None else IncompleteDetails(cut_off),
        output=list(output.items),
        usage=_usage(end),
    )


def _cut_off(end: Finished) -> str | None:
    """Why the answer was cut off; None: it ended on its own."""
    return _CUT_OFF.get(end.finish_reasons[0]) if end.finish_reasons else None


def _traced(
    response: Response, answering: Answering, reply: render.Reply, end: Finished
) -> Response:
    """``response`` with the decision trace a chat completion would carry: the loop's
    when the loop answered, else the decision's when asked for."""
    if end.loop is not None:
        return ThoughtResponse(**msgspec.structs.asdict(response), satisfice=end.loop)
    if reply.trace:
        trace = answering.decision.view()
        return TracedResponse(**msgspec.structs.asdict(response), satisfice=trace)
    return response


def _usage(end: Finished) -> ResponseUsage:
    loop = end.loop
    # The loop's tokens beyond its answer's (its other branches, its probes) are its
    # reasoning; thought_to_output is their ratio (None: the answer is not a branch's).
    answer = end.completion_tokens
    if loop is not None and loop.thought_to_output:
        answer = round(loop.tokens / loop.thought_to_output)
    return ResponseUsage(
        input_tokens=end.prompt_tokens,
        output_tokens=end.completion_tokens,
        output_tokens_details=OutputTokensDetails(end.completion_tokens - answer),
        total_tokens=end.prompt_tokens + end.completion_tokens,
    )


class _Text:
    """An open message or reasoning item, and its text so far."""

    def __init__(self, index: int, reasoning: bool) -> None:
        self.id = ("rs_" if reasoning else "msg_") + _random_hex()
        self.index = index
        self.reasoning = reasoning
        self.parts: list[str] = []

    def part(self, text: str) -> OutputText | ReasoningText:
        return ReasoningText(text) if self.reasoning else OutputText(text)

    def item(self, status: ItemStatus, text: str | None) -> OutputItem:
        """The item, with its text (None: none yet, as when it is added)."""
        if self.reasoning:
            content = [] if text is None else [ReasoningText(text)]
            return ReasoningItem(id=self.id, content=content, status=status)
        return MessageItem(
            id=self.id, status=status, content=[] if text is None else [OutputText(text)]
        )


class _Call:
    """An open function call item, and its arguments so far."""

    def __init__(self, index: int, part: ToolCallDelta) -> None:
        self.id = "fc_" + _random_hex()
        self.index = index
        # An engine gives the call's id and name with its first part.
        self.call_id = part.id or "call_" + _random_hex()
        self.name = part.name or ""
        self.parts: list[str] = []

    def item(self, status: ItemStatus) -> FunctionCallItem:
        return FunctionCallItem(
            id=self.id, call_id=self.call_id, name=self.name, arguments="".join(self.parts),
            status=status,
        )  # fmt: skip


class _Output:
    """The output items an answer's events build, in order, and the numbered stream
    events that say so. One item is open at a time (the calls of one turn together):
    an event of another kind closes it, and the answer's end closes the last."""

    def __init__(self) -> None:
        self.items: list[OutputItem] = []
        self._numbers = itertools.count()
        self._text: _Text | None = None
        self._calls: dict[int, _Call] = {}

    def number(self) -> int:
        """The next event's sequence number."""
        return next(self._numbers)

    def take(self, event: Reasoning | TextDelta | ToolCallPart) -> list[StreamEvent]:
        said: list[StreamEvent] = []
        if isinstance(event, ToolCallPart):
            self._call_part(event.call, said)
        elif isinstance(event, Reasoning) or event.text:  # an engine's empty piece says nothing
            reasoning = isinstance(event, Reasoning)
            text = self._open_text(reasoning, said)
            text.parts.append(event.text)
            delta: type[ReasoningTextDelta | OutputTextDelta]
            delta = ReasoningTextDelta if reasoning else OutputTextDelta
            said.append(
                delta(
                    item_id=text.id, output_index=text.index, content_index=0, delta=event.text,
                    sequence_number=self.number(),
                )
            )  # fmt: skip
        return said

    def finish(self, end: Finished) -> list[StreamEvent]:
        """The last items closed, as complete or cut off; an answer with no text and no
        calls still has its (empty) message."""
        said: list[StreamEvent] = []
        if not any(isinstance(item, (MessageItem, FunctionCallItem)) for item in self.items):
            self._open_text(False, said)
        status: ItemStatus = "completed" if _cut_off(end) is None else "incomplete"
        self._close_text(status, said)
        self._close_calls(status, said)
        return said

    def _open_text(self, reasoning: bool, said: list[StreamEvent]) -> _Text:
        text = self._text
        if text is not None and text.reasoning == reasoning:
            return text
        self._close_text("completed", said)
        self._close_calls("completed", said)
        text = self._text = _Text(len(self.items), reasoning)
        self.items.append(text.item("in_progress", None))
        said += (
            OutputItemAdded(
                output_index=text.index, item=self.items[-1], sequence_number=self.number()
            ),
            ContentPartAdded(
                item_id=text.id, output_index=text.index, content_index=0, part=text.part(""),
                sequence_number=self.number(),
            ),
        )  # fmt: skip
        return text

    def _close_text(self, status: ItemStatus, said: list[StreamEvent]) -> None:
        text, self._text = self._text, None
        if text is None:
            return
        whole = "".join(text.parts)
        id_, index = text.id, text.index
        done: type[ReasoningTextDone | OutputTextDone]
        done = ReasoningTextDone if text.reasoning else OutputTextDone
        said.append(
            done(
                item_id=id_, output_index=index, content_index=0, text=whole,
                sequence_number=self.number(),
            )
        )  # fmt: skip
        said.append(
            ContentPartDone(
                item_id=id_, output_index=index, content_index=0, part=text.part(whole),
                sequence_number=self.number(),
            )
        )  # fmt: skip
        self.items[text.index] = text.item(status, whole)
        said.append(
            OutputItemDone(
                output_index=text.index, item=self.items[text.index], sequence_number=self.number()
            )
        )

    def _call_part(self, part: ToolCallDelta, said: list[StreamEvent]) -> None:
        call = self._calls.get(part.index)
        if call is None:
            self._close_text("completed", said)
            call = self._calls[part.index] = _Call(len(self.items), part)
            self.items.append(call.item("in_progress"))
            said.append(
                OutputItemAdded(
                    output_index=call.index, item=self.items[-1], sequence_number=self.number()
                )
            )
        if part.arguments:
            call.parts.append(part.arguments)
            said.append(
                ArgumentsDelta(
                    item_id=call.id, output_index=call.index, delta=part.arguments,
                    sequence_number=self.number(),
                )
            )  # fmt: skip

    def _close_calls(self, status: ItemStatus, said: list[StreamEvent]) -> None:
        for call in self._calls.values():
            item = self.items[call.index] = call.item(status)
            said += (
                ArgumentsDone(
                    item_id=call.id, output_index=call.index, name=call.name,
                    arguments=item.arguments, sequence_number=self.number(),
                ),
                OutputItemDone(output_index=call.index, item=item, sequence_number=self.number()),
            )  # fmt: skip
        self._calls = {}


class _Streamed:
    """One response's stream: it opens (response.created, then .in_progress) with its
    first event, so that the exchange's first byte is the answer's, as on a chat
    stream; an error before any event opens it too."""

    def __init__(self, begun: Response, answering: Answering, reply: render.Reply) -> None:
        self._begun = begun
        self._answering = answering
        self._reply = reply
        self._output = _Output()
        self._opened = False

    async def events(self) -> AsyncGenerator[bytes]:
        output = self._output
        async with contextlib.aclosing(self._answering.events) as events:
            async for event in events:
                opening = self._opening()
                if isinstance(event, Finished):
                    said = output.finish(event)
                    response = _final(self._begun, output, event)
                    end = (
                        ResponseCompleted if response.status == "completed" else ResponseIncomplete
                    )
                    response = _traced(response, self._answering, self._reply, event)
                    said.append(end(response=response, sequence_number=output.number()))
                else:
                    said = output.take(event)
                sent = opening + b"".join(encode_event(e) for e in said)
                if sent:
                    yield sent

    def failed(self, error: APIError) -> bytes:
        opening = self._opening()
        body = error.body
        event = ErrorEvent(
            code=body.code, message=body.message, param=body.param,
            sequence_number=self._output.number(),
        )  # fmt: skip
        return opening + encode_event(event)

    def _opening(self) -> bytes:
        if self._opened:
            return b""
        self._opened = True
        numbers = self._output
        return encode_event(
            ResponseCreated(response=self._begun, sequence_number=numbers.number())
        ) + encode_event(ResponseInProgress(response=self._begun, sequence_number=numbers.number()))
