"""Anthropic's Messages API wire format (POST /v1/messages), as typed Structs.

As with chat completions (gateway.api.wire), unknown fields are ignored (the SDK's
newer fields, ``cache_control`` on blocks and tools), and what no engine here can
honour is read only to be refused with a message naming it: image and document
blocks, ``top_k``. Blocks are tagged by their ``type``, so a block of a type Anthropic
has and this gateway does not know is a 400 naming ``messages[i].content[j].type``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from evaluator.loop import LoopTrace
from gateway.api.wire import _ABOVE_ZERO, _AT_LEAST_ZERO, FunctionName
from gateway.pipeline.outcome import DecisionView

# -- content blocks, in requests and (text, tool_use, thinking) in responses ---------


class TextBlock(Struct, frozen=True, tag_field="type", tag="text"):
    text: str


class ToolUseBlock(Struct, frozen=True, tag_field="type", tag="tool_use"):
    id: Annotated[str, Meta(min_length=1)]
    name: str
    input: dict[str, Any]


class ThinkingBlock(Struct, frozen=True, tag_field="type", tag="thinking"):
    """Reasoning shown beside an answer: the loop's, here. Anthropic signs its own;
    this gateway's carry an empty signature, and are dropped when sent back (as
    Anthropic drops earlier turns' thinking)."""

    thinking: str
    signature: str = ""


class RedactedThinkingBlock(Struct, frozen=True, tag_field="type", tag="redacted_thinking"):
    """Accepted in an assistant turn sent back, and dropped as thinking is."""

    data: str = ""


class ImageBlock(Struct, frozen=True, tag_field="type", tag="image"):
    """Read only to be refused: no engine here reads images."""

    source: dict[str, Any] | None = None


class DocumentBlock(Struct, frozen=True, tag_field="type", tag="document"):
    """Read only to be refused: no engine here reads documents."""

    source: dict[str, Any] | None = None


class ToolResultBlock(Struct, frozen=True, tag_field="type", tag="tool_result"):
    tool_use_id: Annotated[str, Meta(min_length=1)]
    content: str | list[TextBlock | ImageBlock | DocumentBlock] = ""
    is_error: bool | None = None


InputBlock = (
    TextBlock
    | ToolUseBlock
    | ToolResultBlock
    | ThinkingBlock
    | RedactedThinkingBlock
    | ImageBlock
    | DocumentBlock
)
OutputBlock = TextBlock | ToolUseBlock | ThinkingBlock


# -- the request ------------------------------------------------------------------------


class InputMessage(Struct, frozen=True):
    role: Literal["user", "assistant"]
    content: str | list[InputBlock]


class Metadata(Struct, frozen=True):
    user_id: str | None = None


class CustomTool(Struct, frozen=True, kw_only=True):
    """A tool the client runs. Anthropic's own tools (bash, web search, ...) have a
    versioned ``type`` of their own: refused by name, as nothing here runs them."""

    name: FunctionName  # Anthropic's rule for a tool's name is OpenAI's
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None


class ToolChoiceAuto(Struct, frozen=True, tag_field="type", tag="auto"):
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(Struct, frozen=True, tag_field="type", tag="any"):
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(Struct, frozen=True, tag_field="type", tag="tool"):
    name: str
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(Struct, frozen=True, tag_field="type", tag="none"):
    pass


ToolChoice = ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone


# How thinking is shown: "omitted" hides it (Anthropic's would still be signed).
ThinkingDisplay = Literal["summarized", "omitted"]


class ThinkingEnabled(Struct, frozen=True, tag_field="type", tag="enabled"):
    """Asks for the answer's reasoning as thinking blocks. How long the gateway thinks
    is its loop's decision (the config's budget), not ``budget_tokens``."""

    budget_tokens: Annotated[int, Meta(ge=1)] | None = None
    display: ThinkingDisplay | None = None


class ThinkingAdaptive(Struct, frozen=True, tag_field="type", tag="adaptive"):
    """The model decides when and how long to think: what the gateway's loop does."""

    display: ThinkingDisplay | None = None


class ThinkingDisabled(Struct, frozen=True, tag_field="type", tag="disabled"):
    """No thinking blocks, not even in a stream."""


Thinking = ThinkingEnabled | ThinkingAdaptive | ThinkingDisabled


class JSONOutputFormat(Struct, frozen=True, tag_field="type", tag="json_schema"):
    schema: dict[str, Any]


class OutputConfig(Struct, frozen=True):
    """``format`` is chat completions' response_format json_schema; ``effort`` is read
    and ignored, as ``budget_tokens`` is: how long to think is the gateway's decision."""

    effort: str | None = None
    format: JSONOutputFormat | None = None


class MessagesRequest(Struct, frozen=True, kw_only=True):
    model: str
    messages: Annotated[list[InputMessage], Meta(min_length=1)]
    max_tokens: Annotated[int, Meta(ge=1)]
    system: str | list[TextBlock] | None = None
    # At most chat completions' four stop sequences, which they become.
    stop_sequences: Annotated[list[str], Meta(max_length=4)] | None = None
    stream: bool | None = False
    temperature: Annotated[float, Meta(ge=0, le=1, extra_json_schema=_AT_LEAST_ZERO)] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1, extra_json_schema=_ABOVE_ZERO)] | None = None
    # Read only to be refused: no engine here is handed top_k, and a request that asks
    # for it must not get (or be cached as) an answer sampled without.
    top_k: int | None = None
    metadata: Metadata | None = None
    tools: list[CustomTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None


# -- the response -----------------------------------------------------------------------

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessageUsage(Struct, frozen=True):
    input_tokens: int
    output_tokens: int


class Message(Struct, frozen=True, kw_only=True):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[OutputBlock]
    model: str
    stop_reason: StopReason | None
    stop_sequence: str | None = None
    usage: MessageUsage


class ThoughtMessage(Message, frozen=True, kw_only=True):
    """The reasoning loop's answer, with its trace (clients ignore the extra field)."""

    satisfice: LoopTrace


class TracedMessage(Message, frozen=True, kw_only=True):
    """An answer with its decision trace, asked for with x-satisfice-trace."""

    satisfice: DecisionView


# -- the stream's events ----------------------------------------------------------------


class TextDelta(Struct, frozen=True, tag_field="type", tag="text_delta"):
    text: str


class InputJSONDelta(Struct, frozen=True, tag_field="type", tag="input_json_delta"):
    partial_json: str


class ThinkingDelta(Struct, frozen=True, tag_field="type", tag="thinking_delta"):
    thinking: str


class MessageStart(Struct, frozen=True, tag_field="type", tag="message_start"):
    message: Message


class ContentBlockStart(Struct, frozen=True, tag_field="type", tag="content_block_start"):
    index: int
    content_block: OutputBlock


class ContentBlockDelta(Struct, frozen=True, tag_field="type", tag="content_block_delta"):
    index: int
    delta: TextDelta | InputJSONDelta | ThinkingDelta


class ContentBlockStop(Struct, frozen=True, tag_field="type", tag="content_block_stop"):
    index: int


class Stopped(Struct, frozen=True):
    stop_reason: StopReason
    stop_sequence: str | None = None


class MessageDelta(Struct, frozen=True, tag_field="type", tag="message_delta"):
    delta: Stopped
    # Counted once the answer is whole: message_start's count of the prompt is 0.
    usage: MessageUsage


class ThoughtMessageDelta(MessageDelta, frozen=True, tag="message_delta"):
    """The reasoning loop's last event but one, with its trace."""

    satisfice: LoopTrace


class MessageStop(Struct, frozen=True, tag_field="type", tag="message_stop"):
    pass


Event = MessageStart | ContentBlockStart | ContentBlockDelta | ContentBlockStop | MessageDelta


def encode_event(event: Event | MessageStop) -> bytes:
    """One server-sent event as Anthropic sends it: its type named on a line of its own."""
    tag = type(event).__struct_config__.tag
    assert isinstance(tag, str)
    return b"event: " + tag.encode() + b"\ndata: " + msgspec.json.encode(event) + b"\n\n"


def encode_error(body: bytes) -> bytes:
    """An error in the stream, its body in Anthropic's error shape."""
    return b"event: error\ndata: " + body + b"\n\n"
