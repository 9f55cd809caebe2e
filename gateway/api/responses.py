"""POST /v1/responses: OpenAI's Responses API, stateless, answered as the chat request
it translates into, on the one pipeline (gateway.api.chat.answer_chat), in the
Responses API's own body and stream events (gateway.api.responses_render).

Nothing is kept: a request that needs a stored response, conversation or prompt is
refused, and ``store`` is answered false. What the models here cannot read (an image,
a file) or do (a built-in tool) is refused with the item or tool named in ``param``.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Literal

from litestar import Request, post
from litestar.datastructures import State
from litestar.openapi.datastructures import ResponseSpec
from litestar.types import ASGIApp

from gateway.api.chat import Dialect, answer_chat, error_specs
from gateway.api.errors import APIError, shown
from gateway.api.guards import require_json, require_key
from gateway.api.responses_render import response_id, stream, whole
from gateway.api.responses_wire import (
    ChosenTool,
    InputItem,
    InputPart,
    JSONSchemaTextFormat,
    RequestTool,
    Response,
    ResponsesRequest,
    TextConfig,
)
from gateway.api.wire import (
    ChatCompletionRequest,
    ChatMessage,
    ChosenFunction,
    ContentPart,
    ErrorResponse,
    FunctionCall,
    FunctionDefinition,
    JSONSchema,
    JSONSchemaFormat,
    ResponseFormat,
    Tool,
    ToolCall,
)
from gateway.api.wire import ChosenTool as ChatChosenTool

Choice = Literal["none", "auto", "required"]

# What each field that needs state kept here would need.
_STATEFUL = {
    "previous_response_id": "this gateway keeps no responses; send the earlier turns as "
    "input items",
    "conversation": "this gateway keeps no conversations; send the earlier turns as input items",
    "prompt": "this gateway keeps no saved prompts; send the prompt as instructions and input",
}

# Chat completions' names of the fields that the chat request's checks and the rate
# limiter name in their errors, in the Responses API's words.
_FIELDS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "response_format.json_schema.schema": "text.format.schema",
    "tools[].function.name": "tools[].name",
    "tools[].function.parameters": "tools[].parameters",
}


@post(
    "/v1/responses",
    description="A response, or with `stream: true` a text/event-stream of its events "
    "(OpenAI's Responses API, stateless: store is always false).",
    status_code=200,
    guards=[require_key, require_json],
    responses={
        200: ResponseSpec(Response, description="The response (without `stream`)"),
        **error_specs(
            ErrorResponse,
            s400="Invalid request, or one this gateway cannot honour (an image or file, a "
            "built-in tool, previous_response_id, tools or a format its engine cannot answer)",
        ),
    },
)
async def responses(
    data: ResponsesRequest, state: State, request: Request[Any, Any, Any]
) -> ASGIApp:
    chat = as_chat_request(data)
    dialect = Dialect(
        "openai", response_id, partial(whole, data), partial(stream, data), fields=_FIELDS
    )
    return await answer_chat(chat, state, request, dialect)


def as_chat_request(request: ResponsesRequest) -> ChatCompletionRequest:
    """``request`` as the chat request it asks: instructions as the first (system)
    message, then the input's items as messages. Raises the ``APIError`` for what
    cannot be translated."""
    for field, why in _STATEFUL.items():
        if getattr(request, field) is not None:
            raise APIError(
                400, f"{field} is not supported: {why}", param=field, code="unsupported_parameter"
            )
    if request.background:
        raise APIError(
            400,
            "background is not supported: this gateway answers while the request waits, "
            "and keeps no responses to poll",
            param="background",
            code="unsupported_parameter",
        )
    instructions = [ChatMessage("system", request.instructions)] if request.instructions else []
    return ChatCompletionRequest(
        model=request.model,
        messages=[*instructions, *_messages(request.input)],
        stream=request.stream,
        max_completion_tokens=request.max_output_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        user=request.user,
        tools=_tools(request.tools),
        tool_choice=_tool_choice(request.tool_choice),
        parallel_tool_calls=request.parallel_tool_calls,
        response_format=_format(request.text),
    )


def _messages(input_: str | list[InputItem]) -> list[ChatMessage]:
    """The input as chat messages: a function call joins the assistant turn before it
    (or starts one), as a chat answer's text and calls are one message."""
    if isinstance(input_, str):
        return [ChatMessage("user", input_)]
    messages: list[ChatMessage] = []
    for i, item in enumerate(input_):
        where = f"input[{i}]"
        if item.type == "message":
            if item.role is None:
                raise APIError(
                    400, "a message needs its role: user, assistant, system or developer",
                    param=f"{where}.role",
                )  # fmt: skip
            messages.append(ChatMessage(item.role, _content(item.content, f"{where}.content")))
        elif item.type == "function_call":
            name, arguments = _given(item.name, f"{where}.name"), item.arguments
            if arguments is None:
                raise APIError(400, "a function call needs its arguments: JSON text",
                               param=f"{where}.arguments")  # fmt: skip
            call_id = _given(item.call_id, f"{where}.call_id")
            call = ToolCall(id=call_id, function=FunctionCall(name, arguments))
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                calls = [*(last.tool_calls or ()), call]
                messages[-1] = ChatMessage("assistant", last.content, tool_calls=calls)
            else:
                messages.append(ChatMessage("assistant", None, tool_calls=[call]))
        elif item.type == "function_call_output":
            output = _content(item.output, f"{where}.output")
            call_id = _given(item.call_id, f"{where}.call_id")
            messages.append(ChatMessage("tool", output, tool_call_id=call_id))
        elif item.type != "reasoning":  # an earlier answer's reasoning: not read again
            raise APIError(
                400,
                f"input item of type {shown(item.type)} is not supported; send message, "
                "function_call and function_call_output items",
                param=where,
            )
    if not messages:
        raise APIError(
            400, "input has only reasoning items, which are not read: nothing to answer",
            param="input",
        )  # fmt: skip
    return messages


def _given(value: str | None, param: str) -> str:
    """A field an item needs: a string, not empty."""
    if not value:
        field = param.rpartition(".")[2]
        raise APIError(400, f"the item needs its {field}: a string, not empty", param=param)
    return value


def _content(content: str | list[InputPart] | None, where: str) -> str | list[ContentPart]:
    """A message's content, or a call's output, as chat content: its text parts."""
    if content is None:
        raise APIError(400, "a string or a list of input_text parts is needed", param=where)
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if part.type not in ("input_text", "output_text"):
            raise APIError(
                400,
                f"content part of type {shown(part.type)} is not supported: the models here "
                "read text; send input_text parts",
                param=f"{where}[{j}]",
            )
        if part.text is None:
            raise APIError(
                400, "a text part needs its text: a string, not null or missing",
                param=f"{where}[{j}].text",
            )  # fmt: skip
        parts.append(ContentPart("text", part.text))
    return parts


def _tools(tools: list[RequestTool] | None) -> list[Tool] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise APIError(
                400,
                f"tool of type {shown(tool.type)} is not supported: this gateway has no "
                "built-in tools; send function tools",
                param=f"tools[{i}]",
                code="unsupported_parameter",
            )
        if tool.name is None:
            raise APIError(400, "a function tool needs its name", param=f"tools[{i}].name")
        function = FunctionDefinition(tool.name, tool.description, tool.parameters, tool.strict)
        out.append(Tool(type="function", function=function))
    return out


def _tool_choice(choice: Choice | ChosenTool | None) -> Choice | ChatChosenTool | None:
    if not isinstance(choice, ChosenTool):
        return choice
    if choice.type != "function":
        raise APIError(
            400,
            f"tool_choice of type {shown(choice.type)} is not supported; choose none, auto, "
            "required or a function",
            param="tool_choice",
        )
    if choice.name is None:
        raise APIError(400, "a function's tool_choice needs its name", param="tool_choice.name")
    return ChatChosenTool(type="function", function=ChosenFunction(choice.name))


def _format(text: TextConfig | None) -> ResponseFormat | None:
    format_ = None if text is None else text.format
    if isinstance(format_, JSONSchemaTextFormat):
        schema = JSONSchema(
            name=format_.name, description=format_.description, schema=format_.schema,
            strict=format_.strict,
        )  # fmt: skip
        return JSONSchemaFormat(schema)
    return format_
