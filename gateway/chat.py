"""Chat completions: from an OpenAI request to an engine call, and back to OpenAI's shapes."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence

import msgspec

from engines.base import (
    Delta,
    Engine,
    EngineError,
    Generation,
    Message,
    SamplingParams,
)
from engines.base import TokenLogprob as EngineLogprob
from gateway.config import AUTO_MODEL, ServerSettings
from gateway.errors import APIError
from gateway.openai_types import (
    SSE_DONE,
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatMessage,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    ChunkDelta,
    ErrorResponse,
    TokenLogprob,
    TopLogprob,
    Usage,
    encode_sse,
)
from router.router import RouteDecision


class Checked(msgspec.Struct, frozen=True, kw_only=True):
    """A request checked against the config's limits, in the engines' terms."""

    messages: tuple[Message, ...]
    params: SamplingParams
    include_usage: bool
    # The prompt's size by the gateway's estimate (see prompt_tokens_estimate).
    prompt_tokens: int


def prompt_tokens_estimate(messages: Sequence[Message]) -> int:
    """About four UTF-8 bytes a token, the usual rule for English text: the gateway
    has no tokenizer of each engine's, and the engine counts exactly anyway."""
    return -(-sum(len(m.content.encode()) for m in messages) // 4)


class ChatCall(msgspec.Struct, frozen=True, kw_only=True):
    """A checked request with the engine that will answer it."""

    id: str
    created: int
    model: str
    engine: Engine
    decision: RouteDecision | None
    messages: tuple[Message, ...]
    params: SamplingParams
    include_usage: bool
    # When the request's time is up (time.monotonic() seconds); None: the engine's own.
    deadline: float | None = None
    # The engine may record logprobs for the gateway's own use (an answer's
    # confidence) that the client did not ask for.
    return_logprobs: bool


def check(
    request: ChatCompletionRequest, engines: Mapping[str, Engine], limits: ServerSettings
) -> Checked:
    if request.model != AUTO_MODEL and request.model not in engines:
        raise unknown_model(request.model, engines)
    if len(request.messages) > limits.max_messages:
        raise APIError(
            400,
            f"{len(request.messages)} messages is more than the limit of {limits.max_messages}",
            param="messages",
        )
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
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        stop=stop,
        n=n,
        seed=request.seed,
        frequency_penalty=request.frequency_penalty or 0.0,
        presence_penalty=request.presence_penalty or 0.0,
        logprobs=bool(request.logprobs),
        top_logprobs=request.top_logprobs or 0,
    )
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
    return Checked(
        messages=messages,
        params=params,
        include_usage=bool(request.stream_options and request.stream_options.include_usage),
        prompt_tokens=prompt_tokens,
    )


def new_call(
    model: str,
    checked: Checked,
    engine: Engine,
    decision: RouteDecision | None,
    *,
    record_logprobs: bool = False,
    deadline: float | None = None,
) -> ChatCall:
    params = checked.params
    if record_logprobs and not params.logprobs:
        params = msgspec.structs.replace(params, logprobs=True)
    return ChatCall(
        id=new_id(),
        created=int(time.time()),
        model=model,
        engine=engine,
        decision=decision,
        messages=checked.messages,
        params=params,
        include_usage=checked.include_usage,
        deadline=deadline,
        return_logprobs=checked.params.logprobs,
    )


def new_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def unknown_model(model: str, engines: Mapping[str, Engine], hint: str = "") -> APIError:
    return APIError(
        404,
        f"model {model!r} does not exist{hint}; available: {', '.join(engines)}",
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
                if part.type != "text" or part.text is None:
                    raise APIError(
                        400,
                        f"content part of type {part.type!r} is not supported; send text parts",
                        param=f"messages[{i}].content[{j}]",
                    )
                texts.append(part.text)
            content = "\n".join(texts)
        out.append(Message(message.role, content or ""))
    return tuple(out)


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


def _usage(generation: Generation) -> Usage:
    completion = generation.completion_tokens
    return Usage(generation.prompt_tokens, completion, generation.prompt_tokens + completion)


async def complete(call: ChatCall) -> tuple[ChatCompletion, Generation]:
    """The completion, and the engine's generation behind it."""
    generation = await call.engine.generate(call.messages, call.params, call.deadline)
    completion = ChatCompletion(
        id=call.id,
        created=call.created,
        model=call.model,
        choices=[
            Choice(
                index=s.index,
                message=AssistantMessage(s.text),
                finish_reason=s.finish_reason,
                logprobs=_logprobs(s.logprobs) if call.return_logprobs else None,
            )
            for s in generation.samples
        ],
        usage=_usage(generation),
    )
    return completion, generation


def engine_seconds(generation: Generation) -> float:
    """Seconds the engine spent on a generation, its queue included."""
    return max(s.timings.queue_s + s.timings.total_s for s in generation.samples)


Finished = Callable[[Generation | None], None]


async def open_stream(call: ChatCall, finished: Finished | None = None) -> AsyncIterator[bytes]:
    """Start generating and wait for the first event, then hand over the SSE body.

    Waiting for the first event lets overload and bad prompts still answer with a
    proper status code instead of an error inside a 200 stream. ``finished`` hears
    the whole generation once the stream has sent it, or None if it did not end.
    """
    events = call.engine.stream(call.messages, call.params, call.deadline)
    try:
        first = await anext(events)
    except BaseException:
        await events.aclose()
        if finished is not None:
            finished(None)
        raise
    return _sse(call, first, events, finished or (lambda _: None))


async def _sse(
    call: ChatCall,
    first: Delta | Generation,
    events: AsyncGenerator[Delta | Generation],
    finished: Finished,
) -> AsyncIterator[bytes]:
    started: set[int] = set()
    generation = None

    def chunk(choices: list[ChunkChoice], usage: Usage | None = None) -> bytes:
        return encode_sse(
            ChatCompletionChunk(
                id=call.id, created=call.created, model=call.model, choices=choices, usage=usage
            )
        )

    def role(index: int) -> ChunkDelta:
        if index in started:
            return ChunkDelta()
        started.add(index)
        return ChunkDelta(role="assistant", content="")

    try:
        async with contextlib.aclosing(events):
            event = first
            while isinstance(event, Delta):
                opening = role(event.index)
                # The role chunk leaves with the first text in one write: one wake-up
                # of the client for its first token, not two.
                role_chunk = chunk([ChunkChoice(event.index, opening)]) if opening.role else b""
                logprobs = _logprobs(event.logprobs) if call.return_logprobs else None
                text = ChunkDelta(content=event.text)
                yield role_chunk + chunk([ChunkChoice(event.index, text, None, logprobs)])
                try:
                    event = await anext(events)
                except EngineError as exc:
                    error = APIError.from_engine(exc)
                    yield b"data: " + msgspec.json.encode(ErrorResponse(error.body)) + b"\n\n"
                    return
            for sample in event.samples:
                opening = role(sample.index)
                yield chunk([ChunkChoice(sample.index, opening, sample.finish_reason)])
            if call.include_usage:
                yield chunk([], _usage(event))
            yield SSE_DONE
            generation = event
    finally:
        finished(generation)


class Answer(msgspec.Struct, frozen=True, kw_only=True):
    """One finished answer the gateway already has: from the cache, or from an
    identical request that was in flight."""

    text: str
    finish_reason: str
    completion_tokens: int
    prompt_tokens: int = 0


class EngineAnswer(msgspec.Struct, frozen=True):
    """An answer and the engine that gave it, as identical requests share it."""

    answer: Answer
    engine: str


def answer_completion(call_id: str, model: str, answer: Answer) -> ChatCompletion:
    return ChatCompletion(
        id=call_id,
        created=int(time.time()),
        model=model,
        choices=[Choice(0, AssistantMessage(answer.text), answer.finish_reason)],
        usage=Usage(
            answer.prompt_tokens,
            answer.completion_tokens,
            answer.prompt_tokens + answer.completion_tokens,
        ),
    )


async def answer_stream(
    call_id: str, model: str, answer: Answer, include_usage: bool
) -> AsyncIterator[bytes]:
    """An answer in hand as a stream: the whole text in one chunk, then the end."""
    completion = answer_completion(call_id, model, answer)

    def chunk(choices: list[ChunkChoice], usage: Usage | None = None) -> bytes:
        return encode_sse(
            ChatCompletionChunk(
                id=call_id, created=completion.created, model=model, choices=choices, usage=usage
            )
        )

    text = ChunkDelta(role="assistant", content=answer.text)
    yield (
        chunk([ChunkChoice(0, text)])
        + chunk([ChunkChoice(0, ChunkDelta(), answer.finish_reason)])
        + (chunk([], completion.usage) if include_usage else b"")
        + SSE_DONE
    )
