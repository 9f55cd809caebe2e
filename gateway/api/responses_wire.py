"""OpenAI's Responses API on the wire, stateless: the request as typed Structs, and the
response object with its stream events.

The request is decoded as loosely as the chat request is (unknown fields are ignored),
and its items and tools loosely enough that what this gateway cannot honour (an image,
a built-in tool) reaches gateway.api.responses, which refuses it naming the item. The
response carries every field the official SDK's models require.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from evaluator.loop import LoopTrace
from gateway.api.wire import (
    _ABOVE_ZERO,
    _AT_LEAST_ZERO,
    FunctionName,
    JSONObjectFormat,
    JSONSchema,
    TextFormat,
)
from gateway.pipeline.outcome import DecisionView

# -- the request ----------------------------------------------------------------------


class InputPart(Struct, frozen=True):
    """A part of a message's content: input_text or output_text (the text of an earlier
    answer sent back); any other kind is refused by name."""

    type: str
    text: str | None = None


class InputItem(Struct, frozen=True, kw_only=True):
    """An item of ``input``: a message (its ``type`` may be left out, as the SDK's
    shorthand does), a function call an earlier answer made, that call's output, or an
    earlier answer's reasoning (sent back with its output, and left out: the models
    here do not read it)."""

    type: str = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[InputPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputPart] | None = None


class RequestTool(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A tool the model may call: only ``function`` tools are answered; a built-in
    tool's type (web_search, file_search, ...) is refused by name."""

    type: str
    name: FunctionName | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of the arguments
    strict: bool | None = None


class ChosenTool(Struct, frozen=True):
    """A ``tool_choice`` that names a tool: {type: function, name}; another type (a
    built-in tool, allowed_tools) is refused."""

    type: str
    name: str | None = None


class JSONSchemaTextFormat(
    JSONSchema, frozen=True, kw_only=True, tag_field="type", tag="json_schema"
):
    """``text.format`` json_schema: chat completions' json_schema, flat."""


TextFormatConfig = TextFormat | JSONObjectFormat | JSONSchemaTextFormat


class TextConfig(Struct, frozen=True):
    format: TextFormatConfig | None = None


class ReasoningConfig(Struct, frozen=True):
    """Accepted and echoed, not acted on: how long to think is the loop's decision
    (its thresholds, in the config); ``summary`` asks for the loop's reasoning in a
    whole response's output, as the x-satisfice-reasoning header does."""

    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(Struct, frozen=True, kw_only=True):
    model: str
    input: Annotated[str, Meta(min_length=1)] | Annotated[list[InputItem], Meta(min_length=1)]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: Annotated[float, Meta(ge=0, le=2, extra_json_schema=_AT_LEAST_ZERO)] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1, extra_json_schema=_ABOVE_ZERO)] | None = None
    stream: bool | None = False
    tools: list[RequestTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ChosenTool | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: Annotated[dict[str, str], Meta(max_length=16)] | None = None
    user: str | None = None
    # Accepted, and answered with store: false: nothing is kept, and OpenAI's default
    # (true, when the field is left out, as the SDK does) must not fail every request.
    store: bool | None = None
    # Read only to be refused: each needs a response or conversation kept here.
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    background: bool | None = None


# -- the response ---------------------------------------------------------------------

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputText(Struct, frozen=True, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class ReasoningText(Struct, frozen=True, tag_field="type", tag="reasoning_text"):
    text: str


class MessageItem(Struct, frozen=True, kw_only=True, tag_field="type", tag="message"):
    id: str
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class FunctionCallItem(Struct, frozen=True, kw_only=True, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


class ReasoningItem(Struct, frozen=True, kw_only=True, tag_field="type", tag="reasoning"):
    """The loop's reasoning as it wrote it (``content``; it has no summary)."""

    id: str
    summary: list[Any] = []
    content: list[ReasoningText]
    status: ItemStatus


OutputItem = MessageItem | FunctionCallItem | ReasoningItem


class InputTokensDetails(Struct, frozen=True):
    # A provider's prompt cache; the gateway's own cache answers whole questions.
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(Struct, frozen=True):
    reasoning_tokens: int


class ResponseUsage(Struct, frozen=True, kw_only=True):
    input_tokens: int
    input_tokens_details: InputTokensDetails = InputTokensDetails()
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(Struct, frozen=True):
    # max_output_tokens, or deadline: the request's deadline cut the answer off.
    reason: str


class Response(Struct, frozen=True, kw_only=True):
    """The response object; a stream's first events carry it in progress, its last
    one whole. The request's settings are echoed as the API does."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    background: bool = False
    completed_at: int | None = None
    error: None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    metadata: dict[str, str]
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: None = None
    reasoning: ReasoningConfig
    store: bool = False
    temperature: float | None
    text: TextConfig
    tool_choice: Literal["none", "auto", "required"] | ChosenTool
    tools: list[RequestTool]
    top_p: float | None
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None


class ThoughtResponse(Response, frozen=True, kw_only=True):
    """The reasoning loop's response, with its decision trace (clients ignore the field)."""

    satisfice: LoopTrace


class TracedResponse(Response, frozen=True, kw_only=True):
    """A response with its decision trace, asked for with x-satisfice-trace."""

    satisfice: DecisionView


# -- the stream's events --------------------------------------------------------------
# Each names itself in its ``type`` (the SSE event's name too) and is numbered in the
# stream's order.


class _ResponseEvent(Struct, frozen=True, kw_only=True):
    response: Response
    sequence_number: int


class ResponseCreated(_ResponseEvent, frozen=True, tag_field="type", tag="response.created"):
    pass


class ResponseInProgress(_ResponseEvent, frozen=True, tag_field="type", tag="response.in_progress"):
    pass


class ResponseCompleted(_ResponseEvent, frozen=True, tag_field="type", tag="response.completed"):
    pass


class ResponseIncomplete(_ResponseEvent, frozen=True, tag_field="type", tag="response.incomplete"):
    pass


class _ItemEvent(Struct, frozen=True, kw_only=True):
    output_index: int
    item: OutputItem
    sequence_number: int


class OutputItemAdded(_ItemEvent, frozen=True, tag_field="type", tag="response.output_item.added"):
    pass


class OutputItemDone(_ItemEvent, frozen=True, tag_field="type", tag="response.output_item.done"):
    pass


class _ContentEvent(Struct, frozen=True, kw_only=True):
    """An event about one content part of an output item."""

    item_id: str
    output_index: int
    content_index: int
    sequence_number: int


class ContentPartAdded(
    _ContentEvent, frozen=True, tag_field="type", tag="response.content_part.added"
):
    part: OutputText | ReasoningText


class ContentPartDone(
    _ContentEvent, frozen=True, tag_field="type", tag="response.content_part.done"
):
    part: OutputText | ReasoningText


class OutputTextDelta(
    _ContentEvent, frozen=True, tag_field="type", tag="response.output_text.delta"
):
    delta: str
    logprobs: list[Any] = []


class OutputTextDone(_ContentEvent, frozen=True, tag_field="type", tag="response.output_text.done"):
    text: str
    logprobs: list[Any] = []


class ReasoningTextDelta(
    _ContentEvent, frozen=True, tag_field="type", tag="response.reasoning_text.delta"
):
    delta: str


class ReasoningTextDone(
    _ContentEvent, frozen=True, tag_field="type", tag="response.reasoning_text.done"
):
    text: str


class ArgumentsDelta(
    Struct,
    frozen=True,
    kw_only=True,
    tag_field="type",
    tag="response.function_call_arguments.delta",
):
    item_id: str
    output_index: int
    delta: str
    sequence_number: int


class ArgumentsDone(
    Struct,
    frozen=True,
    kw_only=True,
    tag_field="type",
    tag="response.function_call_arguments.done",
):
    item_id: str
    output_index: int
    name: str
    arguments: str
    sequence_number: int


class ErrorEvent(Struct, frozen=True, kw_only=True, tag_field="type", tag="error"):
    """An error after the stream began (the status is 200 by then)."""

    code: str | None
    message: str
    param: str | None
    sequence_number: int


StreamEvent = (
    ResponseCreated
    | ResponseInProgress
    | ResponseCompleted
    | ResponseIncomplete
    | OutputItemAdded
    | OutputItemDone
    | ContentPartAdded
    | ContentPartDone
    | OutputTextDelta
    | OutputTextDone
    | ReasoningTextDelta
    | ReasoningTextDone
    | ArgumentsDelta
    | ArgumentsDone
    | ErrorEvent
)


def encode_event(event: StreamEvent) -> bytes:
    """An event as server-sent lines: its type as the SSE event's name, then its JSON."""
    name = event.__struct_config__.tag
    assert isinstance(name, str)
    return b"event: " + name.encode() + b"\ndata: " + msgspec.json.encode(event) + b"\n\n"
