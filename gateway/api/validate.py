"""From OpenAI's request to the pipeline's: checked against the config's limits, in the
engines' terms. Everything refused here is a 4xx that names the field at fault."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from engines.base import Engine, Message, SamplingParams
from gateway.api.errors import APIError, shown
from gateway.api.wire import ChatCompletionRequest, ChatMessage
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
    _refuse_what_engines_cannot_do(request)
    if len(request.messages) > limits.max_messages:
        raise APIError(
            400,
            f"{len(request.messages)} messages is more than the limit of {limits.max_messages}",
            param="messages",
        )
    params = _params(request, limits)
    messages = _messages(request.messages)
    prompt_tokens = prompt_tokens_estimate(messages)
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
    )


def _refuse_what_engines_cannot_do(request: ChatCompletionRequest) -> None:
    """400 for what the engines would silently ignore: tool calling, structured output
    and logit bias. Answered anyway, such a request would get a plain-text answer it
    did not ask for, and could be served one from the cache."""
    asked = {
        "tools": bool(request.tools),
        "functions": bool(request.functions),
        "tool_choice": request.tool_choice not in (None, "none"),
        "function_call": request.function_call not in (None, "none"),
        "response_format": request.response_format not in (None, {"type": "text"}),
        "logit_bias": bool(request.logit_bias),
    }
    for field, wanted in asked.items():
        if wanted:
            raise APIError(
                400,
                f"{field} is not supported: this gateway's engines answer in plain text, "
                "without tool calls, structured output or logit bias",
                param=field,
                code="unsupported_parameter",
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
    out = []
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
        out.append(Message(message.role, content or ""))
    return tuple(out)
