"""Anthropic's Messages API (POST /v1/messages) on the chat pipeline: the request
translated into chat completions' terms, answered by the one chat handler
(gateway.api.chat.answer_chat), and the answer rendered as Anthropic's message or its
stream of events.

What the translation decides:

- ``top_k`` is refused, as chat completions refuse ``logit_bias``: no engine here is
  handed it, and an answer sampled without it must not be served (or cached) as one
  sampled with it. So are image and document blocks, and an assistant turn last (a
  prefill: the engines answer a new turn, they do not continue one).
- ``thinking`` (enabled or adaptive) asks to see the reasoning loop's reasoning as
  thinking blocks; how long the gateway thinks is its own decision, so
  ``budget_tokens`` and ``output_config.effort`` are read and ignored. Unasked, a
  stream shows it (as a chat completions stream shows ``reasoning_content``) and a
  plain answer does not, unless x-satisfice-reasoning asks; disabled, or displayed
  "omitted", hides it from both.
- ``output_config.format`` is chat completions' ``response_format`` of a JSON schema.
- Stop reasons: a stop is ``end_turn``, since no engine says whether a stop sequence or
  the end of the turn stopped it (``stop_sequence`` stays null); an answer cut short,
  by ``max_tokens`` or by the deadline, is ``max_tokens``, Anthropic's one reason that
  says the text is unfinished; tool calls are ``tool_use``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import Any, Literal

import msgspec
from litestar import Request, post
from litestar.datastructures import State
from litestar.openapi.datastructures import ResponseSpec
from litestar.types import ASGIApp

from gateway.api import render
from gateway.api.anthropic_wire import (
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    DocumentBlock,
    ImageBlock,
    InputBlock,
    InputJSONDelta,
    InputMessage,
    Message,
    MessageDelta,
    MessagesRequest,
    MessageStart,
    MessageStop,
    MessageUsage,
    OutputBlock,
    OutputConfig,
    RedactedThinkingBlock,
    Stopped,
    StopReason,
    TextBlock,
    Thinking,
    ThinkingBlock,
    ThinkingDelta,
    ThinkingDisabled,
    ThoughtMessage,
    ThoughtMessageDelta,
    ToolChoice,
    ToolChoiceAny,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolResultBlock,
    ToolUseBlock,
    TracedMessage,
    encode_error,
    encode_event,
)
from gateway.api.anthropic_wire import TextDelta as TextDeltaEvent
from gateway.api.chat import Dialect, answer_chat, error_specs
from gateway.api.errors import AnthropicError, APIError, shown
from gateway.api.guards import require_json, require_key
from gateway.api.wire import (
    ChatCompletionRequest,
    ChatMessage,
    ChosenFunction,
    ChosenTool,
    ContentPart,
    FunctionCall,
    FunctionDefinition,
    JSONSchema,
    JSONSchemaFormat,
    Tool,
    ToolCall,
)
from gateway.ops.ids import RandomHex
from gateway.pipeline.exchange import Exchange
from gateway.pipeline.outcome import Answering, Finished, Reasoning, TextDelta, ToolCallPart

# -- the request, in chat completions' terms ---------------------------------------------


def to_chat(request: MessagesRequest) -> ChatCompletionRequest:
    """``request`` as a chat completion request; a 400 naming the field for what the
    translation cannot carry. The rest is checked as any chat request is."""
    if request.top_k is not None:
        raise APIError(
            400,
            "top_k is not supported: no engine of this gateway is handed it; leave it out",
            param="top_k",
            code="unsupported_parameter",
        )
    last = len(request.messages) - 1
    if request.messages[last].role == "assistant":
        raise APIError(
            400,
            "the last message is the assistant's: continuing an assistant turn (prefill) "
            "is not supported here; end with a user turn",
            param=f"messages[{last}].role",
            code="unsupported_parameter",
        )
    messages = _system(request.system)
    for i, message in enumerate(request.messages):
        messages += _turn(i, message)
    tools = [
        Tool(type="function", function=FunctionDefinition(t.name, t.description, t.input_schema))
        for t in request.tools or ()
    ]
    choice = request.tool_choice
    single = None if choice is None else getattr(choice, "disable_parallel_tool_use", None)
    return ChatCompletionRequest(
        model=request.model,
        messages=messages,
        stream=request.stream,
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        stop=request.stop_sequences,
        user=None if request.metadata is None else request.metadata.user_id,
        tools=tools or None,
        tool_choice=_tool_choice(choice),
        parallel_tool_calls=None if single is None else not single,
        response_format=_response_format(request.output_config),
    )


def _response_format(output: OutputConfig | None) -> JSONSchemaFormat | None:
    if output is None or output.format is None:
        return None
    return JSONSchemaFormat(JSONSchema(name="output", schema=output.format.schema))


def _system(system: str | list[TextBlock] | None) -> list[ChatMessage]:
    if not system:
        return []
    if isinstance(system, str):
        return [ChatMessage("system", system)]
    return [ChatMessage("system", [ContentPart("text", block.text) for block in system])]


def _turn(i: int, message: InputMessage) -> list[ChatMessage]:
    """One turn as chat messages: a user turn's tool results are tool messages of their
    own, in the order they came; an assistant turn's tool uses are its tool calls."""
    content = message.content
    if isinstance(content, str):
        return [ChatMessage(message.role, content)]
    if message.role == "assistant":
        return [_assistant_turn(i, content)]
    out: list[ChatMessage] = []
    texts: list[ContentPart] = []
    for j, block in enumerate(content):
        if isinstance(block, TextBlock):
            texts.append(ContentPart("text", block.text))
        elif isinstance(block, ToolResultBlock):
            if texts:
                out.append(ChatMessage("user", texts))
                texts = []
            result = _result_text(f"messages[{i}].content[{j}]", block)
            out.append(ChatMessage("tool", result, tool_call_id=block.tool_use_id))
        else:
            raise _misplaced(i, j, block, "user")
    if texts or not out:
        out.append(ChatMessage("user", texts))
    return out


def _assistant_turn(i: int, content: list[InputBlock]) -> ChatMessage:
    texts: list[ContentPart] = []
    calls: list[ToolCall] = []
    for j, block in enumerate(content):
        if isinstance(block, TextBlock):
            texts.append(ContentPart("text", block.text))
        elif isinstance(block, ToolUseBlock):
            arguments = msgspec.json.encode(block.input).decode()
            calls.append(ToolCall(id=block.id, function=FunctionCall(block.name, arguments)))
        elif isinstance(block, (ThinkingBlock, RedactedThinkingBlock)):
            # Sent back with the turn it came in (the SDK's way to continue); dropped,
            # as Anthropic drops earlier turns' thinking from the model's context.
            continue
        else:
            raise _misplaced(i, j, block, "assistant")
    return ChatMessage("assistant", texts or None, tool_calls=calls or None)


def _result_text(at: str, block: ToolResultBlock) -> str:
    """A tool's result as a tool message's text; an error says it is one, as chat
    completions have no field for that."""
    content = block.content
    if not isinstance(content, str):
        for k, part in enumerate(content):
            if not isinstance(part, TextBlock):
                raise _unreadable(f"{at}.content[{k}]", part)
        content = "\n".join(part.text for part in content if isinstance(part, TextBlock))
    return f"Error: {content}" if block.is_error else content


def _misplaced(i: int, j: int, block: InputBlock, role: str) -> APIError:
    at = f"messages[{i}].content[{j}]"
    if isinstance(block, (ImageBlock, DocumentBlock)):
        return _unreadable(at, block)
    kind = type(block).__struct_config__.tag
    belongs = "a user" if role == "assistant" else "an assistant"
    return APIError(400, f"a {kind} block belongs in {belongs} turn, not a {role} turn", param=at)


def _unreadable(at: str, block: ImageBlock | DocumentBlock) -> APIError:
    kind = type(block).__struct_config__.tag
    return APIError(
        400,
        f"content blocks of type {shown(str(kind))} are not supported: this gateway's "
        "engines read text; send text blocks",
        param=at,
        code="unsupported_content",
    )


def _tool_choice(
    choice: ToolChoice | None,
) -> Literal["none", "auto", "required"] | ChosenTool | None:
    if choice is None:
        return None
    if isinstance(choice, ToolChoiceTool):
        return ChosenTool(type="function", function=ChosenFunction(choice.name))
    if isinstance(choice, ToolChoiceAny):
        return "required"
    if isinstance(choice, ToolChoiceNone):
        return "none"
    return "auto"


# -- the answer, in Anthropic's ---------------------------------------------------------

_random_hex = RandomHex()


def message_id() -> str:
    """Anthropic's form ("msg_" and letters), random."""
    return "msg_" + _random_hex()


# What each finish of the pipeline is to Anthropic: the module's docstring says why.
_STOP_REASONS: dict[str, StopReason] = {
    "stop": "end_turn",
    "length": "max_tokens",
    "deadline": "max_tokens",
    "cancelled": "max_tokens",
    "tool_calls": "tool_use",
}


def _stop_reason(end: Finished) -> StopReason:
    return _STOP_REASONS.get(end.finish_reasons[0], "end_turn")


def _usage(end: Finished) -> MessageUsage:
    return MessageUsage(end.prompt_tokens, end.completion_tokens)


async def whole(answering: Answering, reply: render.Reply, thinking: bool | None) -> bytes:
    """The whole answer as one message (JSON): thinking (shown when asked for), text,
    then its tool uses. Raises what the answer raised."""
    reasoning: list[str] = []
    texts: list[str] = []
    calls = render.ToolCalls()
    end: Finished | None = None
    async with contextlib.aclosing(answering.events) as events:
        async for event in events:
            if isinstance(event, Reasoning):
                reasoning.append(event.text)
            elif isinstance(event, TextDelta):
                texts.append(event.text)
            elif isinstance(event, ToolCallPart):
                calls.add(event)
            elif isinstance(event, Finished):
                end = event
    if end is None:  # pragma: no cover - every answer ends with Finished or raises
        raise RuntimeError("the answer ended without finishing")
    content: list[OutputBlock] = []
    if reasoning and (reply.reasoning if thinking is None else thinking):
        content.append(ThinkingBlock("".join(reasoning)))
    uses = [
        ToolUseBlock(c.id, c.function.name, _input(c.function.arguments)) for c in calls.whole()
    ]
    if texts or not uses:
        content.append(TextBlock("".join(texts)))
    content += uses
    body = Message(
        id=reply.id, content=content, model=reply.model, stop_reason=_stop_reason(end),
        usage=_usage(end),
    )  # fmt: skip
    if end.loop is not None:
        body = ThoughtMessage(**msgspec.structs.asdict(body), satisfice=end.loop)
    elif reply.trace:
        body = TracedMessage(**msgspec.structs.asdict(body), satisfice=answering.decision.view())
    return msgspec.json.encode(body)


def _input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object a tool use's input is. Only a call cut short
    (its stop reason says so) leaves them unfinished: its input is then empty, as what
    there was of it has no object to be."""
    try:
        value = msgspec.json.decode(arguments)
    except msgspec.DecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def stream(
    answering: Answering, reply: render.Reply, exchange: Exchange | None, thinking: bool | None
) -> AsyncIterator[bytes]:
    """The answer as Anthropic's stream of events, as ``render.delivered`` sends them
    (``exchange`` None: to nobody yet); its reasoning as thinking blocks unless
    ``thinking`` is False."""
    events = _events(answering, reply, thinking is not False)
    return render.delivered(events, exchange, _error_event)


def _error_event(refusal: APIError) -> bytes:
    return encode_error(refusal.encoded("anthropic"))


class _Blocks:
    """The stream's content blocks: one is open at a time, and closed as the next one
    opens (Anthropic's blocks never interleave)."""

    def __init__(self) -> None:
        self.index = -1
        self._open: object = None  # what the open block holds: its key, None if none
        self.answered = False  # a text or tool use block has opened

    def to(self, key: object, block: OutputBlock) -> bytes:
        """The events that make ``key``'s block the open one."""
        if key == self._open:
            return b""
        ending = self.close()
        self.index += 1
        self._open = key
        self.answered |= not isinstance(block, ThinkingBlock)
        return ending + encode_event(ContentBlockStart(self.index, block))

    def delta(self, delta: TextDeltaEvent | InputJSONDelta | ThinkingDelta) -> bytes:
        return encode_event(ContentBlockDelta(self.index, delta))

    def close(self) -> bytes:
        if self._open is None:
            return b""
        self._open = None
        return encode_event(ContentBlockStop(self.index))


async def _events(
    answering: Answering, reply: render.Reply, thinking: bool
) -> AsyncGenerator[bytes]:
    """Each event of the answer as Anthropic's events; message_start goes out with the
    first, when the prompt's tokens are not counted yet (message_delta counts them)."""
    opening = MessageStart(
        Message(
            id=reply.id, content=[], model=reply.model, stop_reason=None, usage=MessageUsage(0, 0)
        )
    )
    start = encode_event(opening)
    blocks = _Blocks()
    async with contextlib.aclosing(answering.events) as events:
        async for event in events:
            if isinstance(event, Reasoning):
                if not thinking:
                    continue
                out = blocks.to("thinking", ThinkingBlock("")) + blocks.delta(
                    ThinkingDelta(event.text)
                )
            elif isinstance(event, TextDelta):
                out = blocks.to("text", TextBlock("")) + blocks.delta(TextDeltaEvent(event.text))
            elif isinstance(event, ToolCallPart):
                call = event.call
                use = ToolUseBlock(call.id or "", call.name or "", {})
                out = blocks.to(("tool", call.index), use)
                if call.arguments:
                    out += blocks.delta(InputJSONDelta(call.arguments))
            else:
                out = _ending(event, blocks)
            yield start + out
            start = b""


def _ending(end: Finished, blocks: _Blocks) -> bytes:
    """The last block closed (an answer of nothing has an empty text block, as the
    whole answer has), why the answer stopped with its usage, and the stop."""
    empty = b"" if blocks.answered else blocks.to("text", TextBlock(""))
    stopped = Stopped(_stop_reason(end))
    delta = (
        MessageDelta(stopped, _usage(end))
        if end.loop is None
        else ThoughtMessageDelta(stopped, _usage(end), satisfice=end.loop)
    )
    return empty + blocks.close() + encode_event(delta) + encode_event(MessageStop())


# -- the route --------------------------------------------------------------------------


# Chat completions' names of the fields the chat checks name in errors, in the
# Messages API's words.
_FIELDS = {
    "stop": "stop_sequences",
    "response_format": "output_config.format",
    "response_format.json_schema.schema": "output_config.format.schema",
    "tools[].function.name": "tools[].name",
    "tools[].function.parameters": "tools[].input_schema",
}


def _dialect(thinking: bool | None) -> Dialect:
    """Anthropic's dialect for a request whose thinking is asked for (True), turned off
    (False) or left unsaid (None)."""

    def whole_(answering: Answering, reply: render.Reply) -> Awaitable[bytes]:
        return whole(answering, reply, thinking)

    def stream_(
        answering: Answering, reply: render.Reply, exchange: Exchange
    ) -> AsyncIterator[bytes]:
        return stream(answering, reply, exchange, thinking)

    return Dialect("anthropic", message_id, whole_, stream_, fields=_FIELDS)


_DIALECTS: dict[bool | None, Dialect] = {asked: _dialect(asked) for asked in (None, True, False)}


@post(
    "/v1/messages",
    description="Anthropic's Messages API: a message, or with `stream: true` a "
    "text/event-stream of Anthropic's events.",
    status_code=200,
    guards=[require_key, require_json],
    responses={
        200: ResponseSpec(Message, description="The message (without `stream`)"),
        **error_specs(AnthropicError),
    },
)
async def messages(data: MessagesRequest, state: State, request: Request[Any, Any, Any]) -> ASGIApp:
    return await answer_chat(to_chat(data), state, request, _DIALECTS[_shows(data.thinking)])


def _shows(thinking: Thinking | None) -> bool | None:
    """Whether ``thinking`` asks to see the reasoning (None: it says nothing)."""
    if thinking is None:
        return None
    return not isinstance(thinking, ThinkingDisabled) and thinking.display != "omitted"
