"""Tool calls and structured output on the OpenAI wire.

Out: what a chat request carries beyond text. The request's tools, tool choice and
response format go as the client sent them, spliced in unparsed; earlier turns go with
their calls and the tool answers to them. In: the calls of one answer, whole in a
message or in pieces across a stream, as ``ToolCallDelta``s while they come and
``ToolCall``s once the answer is whole.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Literal

import msgspec

from engines.base import Message, SamplingParams, ToolCall, ToolCallDelta

# -- out ------------------------------------------------------------------------------


class _Function(msgspec.Struct, frozen=True):
    name: str
    arguments: str


class _Call(msgspec.Struct, frozen=True):
    id: str
    function: _Function
    type: Literal["function"] = "function"


class WireMessage(msgspec.Struct, frozen=True, omit_defaults=True):
    role: str
    # Always text, "" for an assistant turn that only called tools, never null: the
    # OpenAI protocol takes either, but llama-cpp-python's server refuses null (its
    # content is a str) and its chat templates fail on a turn without content.
    content: str
    tool_calls: tuple[_Call, ...] = ()
    tool_call_id: str | None = None


def wire_messages(messages: Sequence[Message]) -> list[WireMessage]:
    return [
        WireMessage(
            m.role,
            m.content,
            tuple(_Call(c.id, _Function(c.name, c.arguments)) for c in m.tool_calls),
            m.tool_call_id,
        )
        for m in messages
    ]


def asked_fields(params: SamplingParams) -> dict[str, msgspec.Raw]:
    """The request's tools, tool choice and response format, each the JSON text the
    client sent: spliced in as it is, the server reads exactly what the client wrote."""
    fields = {
        "tools": params.tools,
        # OpenAI refuses a tool choice without tools.
        "tool_choice": None if params.tools is None else params.tool_choice,
        "response_format": params.response_format,
        "parallel_tool_calls": None
        if params.tools is None or params.parallel_tool_calls is None
        else msgspec.json.encode(params.parallel_tool_calls).decode(),
    }
    return {key: msgspec.Raw(text.encode()) for key, text in fields.items() if text is not None}


# -- in -------------------------------------------------------------------------------


class FunctionPiece(msgspec.Struct, frozen=True):
    name: str | None = None
    arguments: str | None = None


class CallPiece(msgspec.Struct, frozen=True):
    """A call in an answer: a whole one in a message, or a piece of one in a delta."""

    # Streams number their calls; a message's calls come in order without one.
    index: int | None = None
    id: str | None = None
    function: FunctionPiece | None = None


class _Assembling:
    def __init__(self, id: str | None) -> None:
        # A client answers a call by its id: one the server left out is made here.
        self.id = id or f"call_{secrets.token_hex(12)}"
        self.name: str | None = None
        self.arguments: list[str] = []
        self.announced = False  # its id went out in a delta


class CallAssembler:
    """The calls of one sample as their pieces arrive.

    Servers differ in how they piece a call out. vLLM and OpenAI send the id and name
    once, in the call's first piece; llama-cpp-python repeats both in every piece; a
    message's calls have no index. Calls are told apart by index, else by id, and each
    gets the next index of ours in the order they first appear, so the deltas handed on
    always name a call once and number the calls 0, 1, ...
    """

    def __init__(self) -> None:
        self._calls: list[_Assembling] = []
        self._by_index: dict[int, int] = {}
        self._by_id: dict[str, int] = {}

    def __bool__(self) -> bool:
        return bool(self._calls)

    def add(
        self, pieces: Sequence[CallPiece] | None, legacy: FunctionPiece | None
    ) -> tuple[ToolCallDelta, ...]:
        """Takes one delta's (or message's) calls, or else its legacy ``function_call``
        (the functions API's one call, which llama-cpp-python also sends beside
        ``tool_calls``); the deltas they make, one per call that brought anything."""
        if not pieces and legacy is not None:
            pieces = (CallPiece(index=0, function=legacy),)
        deltas = (self._add(piece) for piece in pieces or ())
        return tuple(delta for delta in deltas if delta is not None)

    def _add(self, piece: CallPiece) -> ToolCallDelta | None:
        ours = self._ours(piece)
        call = self._calls[ours]
        function = piece.function or FunctionPiece()
        name = None
        if call.name is None and function.name:
            call.name = name = function.name
        arguments = function.arguments or ""
        call.arguments.append(arguments)
        first = not call.announced
        if not (first or name or arguments):
            return None
        call.announced = True
        return ToolCallDelta(ours, call.id if first else None, name, arguments)

    def _ours(self, piece: CallPiece) -> int:
        """Our index of the call ``piece`` belongs to, a new one for a new call."""
        if piece.index is not None and piece.index in self._by_index:
            return self._by_index[piece.index]
        if piece.id is not None and piece.id in self._by_id:
            return self._by_id[piece.id]
        if piece.index is None and piece.id is None and self._calls:
            return len(self._calls) - 1  # more of the call under way
        ours = len(self._calls)
        self._calls.append(_Assembling(piece.id))
        if piece.index is not None:
            self._by_index[piece.index] = ours
        if piece.id is not None:
            self._by_id[piece.id] = ours
        return ours

    def calls(self) -> tuple[ToolCall, ...]:
        return tuple(
            ToolCall(call.id, call.name or "", "".join(call.arguments)) for call in self._calls
        )
