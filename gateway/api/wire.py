"""The OpenAI chat-completions wire format, as typed Structs.

Requests are decoded strictly enough to refuse what we cannot honour with a clear
message, and loosely enough (unknown fields are ignored) that the official clients'
newer fields never break a request.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from evaluator.loop import LoopTrace
from gateway.pipeline.outcome import DecisionView

# "function": the legacy function-calling API's answer to a call, as "tool" is now.
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]

# OpenAI's rule for a function's name.
FunctionName = Annotated[str, Meta(pattern="^[a-zA-Z0-9_-]{1,64}$")]


class ContentPart(Struct, frozen=True):
    type: str
    text: str | None = None


class FunctionCall(Struct, frozen=True):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(Struct, frozen=True, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Struct, frozen=True):
    role: Role
    # None is allowed for assistant turns that only carried tool calls.
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # the call a tool turn answers
    function_call: FunctionCall | None = None  # the legacy API's single call


class FunctionDefinition(Struct, frozen=True):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of the arguments
    strict: bool | None = None


class Tool(Struct, frozen=True, kw_only=True):
    type: Literal["function"]
    function: FunctionDefinition


class ChosenFunction(Struct, frozen=True):
    name: str


class ChosenTool(Struct, frozen=True, kw_only=True):
    type: Literal["function"]
    function: ChosenFunction


class JSONSchema(Struct, frozen=True, kw_only=True):
    name: FunctionName
    description: str | None = None
    # The JSON Schema the answer must validate against (None: any JSON value).
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(Struct, frozen=True, tag_field="type", tag="text"):
    pass


class JSONObjectFormat(Struct, frozen=True, tag_field="type", tag="json_object"):
    pass


class JSONSchemaFormat(Struct, frozen=True, tag_field="type", tag="json_schema"):
    json_schema: JSONSchema


ResponseFormat = TextFormat | JSONObjectFormat | JSONSchemaFormat


class StreamOptions(Struct, frozen=True):
    include_usage: bool = False


# Litestar reads an optional field's bounds by truthiness, so a bound of 0 would be
# left out of the OpenAPI schema, and requests the schema allows refused: it is
# written out again under the key whose contents Litestar copies into the schema.
_AT_LEAST_ZERO = {"extra": {"minimum": 0}}
_ABOVE_ZERO = {"extra": {"exclusive_minimum": 0}}


class ChatCompletionRequest(Struct, frozen=True, kw_only=True):
    model: str
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: Annotated[float, Meta(ge=0, le=2, extra_json_schema=_AT_LEAST_ZERO)] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1, extra_json_schema=_ABOVE_ZERO)] | None = None
    n: Annotated[int, Meta(ge=1)] | None = None
    stop: str | Annotated[list[str], Meta(max_length=4)] | None = None
    seed: Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)] | None = None  # int64, as OpenAI's
    frequency_penalty: Annotated[float, Meta(ge=-2, le=2)] | None = None
    presence_penalty: Annotated[float, Meta(ge=-2, le=2)] | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Meta(ge=0, le=20, extra_json_schema=_AT_LEAST_ZERO)] | None = None
    user: str | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ChosenTool | None = None
    parallel_tool_calls: bool | None = None
    # The legacy function-calling API, answered as tools are.
    functions: list[FunctionDefinition] | None = None
    function_call: Literal["none", "auto"] | ChosenFunction | None = None
    response_format: ResponseFormat | None = None
    # Read only to be refused: no engine here biases tokens, and a request that asks
    # for it must not get (or be cached as) an answer sampled without.
    logit_bias: dict[str, Any] | None = None


class TopLogprob(Struct, frozen=True):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(Struct, frozen=True):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(Struct, frozen=True):
    content: list[TokenLogprob]


class AssistantMessage(Struct, frozen=True):
    content: str | None
    role: Literal["assistant"] = "assistant"


class ToolCallingMessage(AssistantMessage, frozen=True, kw_only=True):
    """An answer that calls tools (its content is null when it says nothing else)."""

    tool_calls: list[ToolCall]


class ReasonedMessage(AssistantMessage, frozen=True, kw_only=True):
    """An answer of the reasoning loop with the reasoning behind it, asked for with
    x-satisfice-reasoning (the field reasoning models' servers use)."""

    reasoning_content: str


class Choice(Struct, frozen=True):
    index: int
    message: AssistantMessage
    finish_reason: str
    logprobs: ChoiceLogprobs | None = None


class Usage(Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(Struct, frozen=True, kw_only=True):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    system_fingerprint: str | None = None


class ThoughtCompletion(ChatCompletion, frozen=True, kw_only=True):
    """The reasoning loop's answer, with its decision trace (clients ignore the field)."""

    satisfice: LoopTrace


class TracedCompletion(ChatCompletion, frozen=True, kw_only=True):
    """A completion with its decision trace (clients ignore the extra field)."""

    satisfice: DecisionView


class FunctionCallDelta(Struct, frozen=True, omit_defaults=True):
    name: str | None = None
    arguments: str = ""


class ToolCallChunk(Struct, frozen=True, omit_defaults=True):
    """Part of a streamed tool call: its first part names it, every part adds to its
    arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class ChunkDelta(Struct, frozen=True, omit_defaults=True):
    role: Literal["assistant"] | None = None
    content: str | None = None
    # The reasoning loop's progress while it thinks, as reasoning models stream theirs.
    reasoning_content: str | None = None
    tool_calls: list[ToolCallChunk] | None = None


class ChunkChoice(Struct, frozen=True):
    index: int
    delta: ChunkDelta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(Struct, frozen=True, kw_only=True):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class ThoughtChunk(ChatCompletionChunk, frozen=True, kw_only=True):
    """The reasoning loop's last chunk, with its decision trace."""

    satisfice: LoopTrace


class Model(Struct, frozen=True):
    id: str
    created: int
    owned_by: str = "satisfice"
    object: Literal["model"] = "model"


class ModelList(Struct, frozen=True):
    data: list[Model]
    object: Literal["list"] = "list"


class ErrorBody(Struct, frozen=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(Struct, frozen=True):
    error: ErrorBody


def encode_sse(event: msgspec.Struct) -> bytes:
    return b"data: " + msgspec.json.encode(event) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
