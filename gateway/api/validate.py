"""From OpenAI's request to the pipeline's: checked against the config's limits, in the
engines' terms. Everything refused here is a 4xx that names the field at fault."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec

from engines.base import Engine, Message, SamplingParams, ToolCall
from gateway.api.errors import APIError, shown
from gateway.api.wire import (
    ChatCompletionRequest,
    ChatMessage,
    ChosenFunction,
    ChosenTool,
    JSONSchemaFormat,
    TextFormat,
    Tool,
)
from gateway.config import AUTO_MODEL, ServerSettings
from gateway.pipeline.request import ChatRequest


def chat_request(
    request: ChatCompletionRequest,
    engines: Mapping[str, Engine],
    routing: bool,
    limits: ServerSettings,
) -> ChatRequest:
    """``request`` checked; ``routing`` says whether the model "auto" exists."""
    if request.model == AUTO_MODEL and not routing:
        raise unknown_model(request.model, engines, " (routing is turned off)")
    if request.model != AUTO_MODEL and request.model not in engines:
        raise unknown_model(request.model, engines)
    if request.logit_bias:
        raise APIError(
            400,
            "logit_bias is not supported: no engine of this gateway biases tokens",
            param="logit_bias",
            code="unsupported_parameter",
        )
    if len(request.messages) > limits.max_messages:
        raise APIError(
            400,
            f"{len(request.messages)} messages is more than the limit of {limits.max_messages}",
            param="messages",
        )
    params = _params(request, limits)
    messages = _messages(request.messages)
    prompt_tokens = prompt_tokens_estimate(messages) + len(params.tools or "") // 4
    if limits.max_prompt_tokens is not None and prompt_tokens > limits.max_prompt_tokens:
        raise APIError(
            400,
            f"the prompt is about {prompt_tokens} tokens (UTF-8 bytes / 4); this gateway "
            f"allows at most {limits.max_prompt_tokens}",
            param="messages",
            code="context_length_exceeded",
        )
    return ChatRequest(
        model=request.model,
        messages=messages,
        names=tuple(m.name for m in request.messages),
        params=params,
        include_usage=bool(request.stream_options and request.stream_options.include_usage),
        stream=bool(request.stream),
        prompt_tokens=prompt_tokens,
    )


def _params(request: ChatCompletionRequest, limits: ServerSettings) -> SamplingParams:
    max_tokens = request.max_completion_tokens or request.max_tokens or limits.default_max_tokens
    if max_tokens > limits.max_tokens_cap:
        param = "max_completion_tokens" if request.max_completion_tokens else "max_tokens"
        raise APIError(
            400,
            f"{param} is {max_tokens}; this gateway allows at most {limits.max_tokens_cap}",
            param=param,
        )
    n = request.n or 1
    if n > limits.max_n:
        raise APIError(400, f"n is {n}; this gateway allows at most {limits.max_n}", param="n")
    if request.top_logprobs and not request.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    stop = (request.stop,) if isinstance(request.stop, str) else tuple(request.stop or ())
    tools, tool_choice = _tools(request)
    return SamplingParams(
        max_tokens=max_tokens,
        # Unset: the config's default, which the cache then keys on as it is sampled.
        temperature=limits.default_temperature
        if request.temperature is None
        else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        stop=stop,
        n=n,
        seed=request.seed,
        frequency_penalty=request.frequency_penalty or 0.0,
        presence_penalty=request.presence_penalty or 0.0,
        logprobs=bool(request.logprobs),
        top_logprobs=request.top_logprobs or 0,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=None if tools is None else request.parallel_tool_calls,
        response_format=_response_format(request),
    )


def _tools(request: ChatCompletionRequest) -> tuple[str | None, str | None]:
    """The request's tools and its choice among them as the engines take them (JSON
    text, the legacy ``functions`` as tools); a choice naming no tool given is a 400.
    No tools, or a choice of none with any: (None, None), a plain-text request."""
    if request.tools and request.functions:
        raise APIError(400, "send tools or the legacy functions, not both", param="functions")
    legacy = bool(request.functions)
    tools = request.tools or [Tool(type="function", function=f) for f in request.functions or ()]
    field = "function_call" if legacy else "tool_choice"
    choice = request.function_call if legacy else request.tool_choice
    if not tools:
        asked = (("tool_choice", request.tool_choice, "tools"),
                 ("function_call", request.function_call, "functions"))  # fmt: skip
        for name, chosen, needs in asked:
            if chosen not in (None, "none"):
                raise APIError(400, f"{name} needs {needs} to choose from", param=name)
        return None, None
    field_name = "functions" if legacy else "tools"
    for i, tool in enumerate(tools):
        kind = (tool.function.parameters or {}).get("type", "object")
        if kind != "object":
            where = f"{field_name}[{i}]" + ("" if legacy else ".function") + ".parameters"
            raise APIError(
                400,
                f"a function's parameters are a JSON Schema of type object (its arguments "
                f"are named); this one's type is {shown(str(kind))}",
                param=where,
            )
    names = [t.function.name for t in tools]
    if len(set(names)) < len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise APIError(
            400,
            f"each tool needs a name of its own; {shown(', '.join(twice))} is given twice",
            param=field_name,
        )
    if choice == "none":
        return None, None
    if isinstance(choice, (ChosenTool, ChosenFunction)):
        name = choice.function.name if isinstance(choice, ChosenTool) else choice.name
        if name not in names:
            raise APIError(
                400,
                f"{field} names {shown(name)}, which is none of the request's tools "
                f"({shown(', '.join(names))})",
                param=field,
            )
        choice = ChosenTool(type="function", function=ChosenFunction(name))
    return (
        msgspec.json.encode(tools).decode(),
        None if choice is None else msgspec.json.encode(choice).decode(),
    )


def _response_format(request: ChatCompletionRequest) -> str | None:
    """The answer's format as the engines take it (JSON text); None for plain text."""
    format_ = request.response_format
    if format_ is None or isinstance(format_, TextFormat):
        return None
    if isinstance(format_, JSONSchemaFormat) and format_.json_schema.schema is not None:
        _check_schema(format_.json_schema.schema)
    return msgspec.json.encode(format_).decode()


def _check_schema(schema: dict[str, object]) -> None:
    """400 for a schema that no answer can be checked against (it is not one)."""
    kind = schema.get("type")
    known = ("object", "array", "string", "number", "integer", "boolean", "null")
    kinds = kind if isinstance(kind, list) else [kind]
    if kind is not None and not all(isinstance(k, str) and k in known for k in kinds):
        raise APIError(
            400,
            f"response_format.json_schema.schema has type {shown(str(kind))}; a JSON Schema "
            f"type is one of {', '.join(known)}",
            param="response_format.json_schema.schema",
        )


def prompt_tokens_estimate(messages: Sequence[Message]) -> int:
    """About four UTF-8 bytes a token, the usual rule for English text: the gateway
    has no tokenizer of each engine's, and the engine counts exactly anyway."""
    return -(-sum(len(m.content.encode()) for m in messages) // 4)


def unknown_model(model: str, engines: Mapping[str, Engine], hint: str = "") -> APIError:
    return APIError(
        404,
        f"model {shown(model)} does not exist{hint}; available: {', '.join(engines)}",
        param="model",
        code="model_not_found",
    )


def _messages(messages: Sequence[ChatMessage]) -> tuple[Message, ...]:
    out: list[Message] = []
    for i, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text":
                    raise APIError(
                        400,
                        f"content part of type {shown(part.type)} is not supported; send text "
                        "parts",
                        param=f"messages[{i}].content[{j}]",
                    )
                if part.text is None:
                    raise APIError(
                        400,
                        "a text content part needs its text: a string, not null or missing",
                        param=f"messages[{i}].content[{j}].text",
                    )
                texts.append(part.text)
            content = "\n".join(texts)
        out.append(_message(i, message, content or "", out))
    return tuple(out)


def _message(i: int, message: ChatMessage, content: str, earlier: list[Message]) -> Message:
    """One message in the engines' terms: an assistant turn's calls, the call a tool
    turn answers; the legacy API's function call and answer as a tool's."""
    if message.role == "tool" and not message.tool_call_id:
        raise APIError(
            400,
            "a tool message needs the tool_call_id of the call it answers",
            param=f"messages[{i}].tool_call_id",
        )
    calls = tuple(
        ToolCall(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or ()
    )
    if message.function_call is not None:
        call = message.function_call
        calls += (ToolCall(f"call_{i}", call.name, call.arguments),)
    if message.role == "function":
        # The legacy answer names its function: it answers that function's last call.
        answered = next(
            (c.id for m in reversed(earlier) for c in m.tool_calls if c.name == message.name),
            None,
        )
        return Message("tool", content, tool_call_id=answered or f"function_{message.name}")
    return Message(message.role, content, tool_calls=calls, tool_call_id=message.tool_call_id)
