"""The engine contract: what every backend takes, returns and raises.

A backend turns a prompt into one or more samples. ``stream`` yields ``Delta``s as
tokens arrive and ends with the complete ``Generation``; ``generate`` is the same
stream drained. Deadlines are absolute ``time.monotonic()`` seconds so that one
deadline can be handed down through every layer of a request unchanged.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from typing import Literal, Protocol

import msgspec

Role = Literal["system", "developer", "user", "assistant", "tool"]

# "deadline": the request's deadline (or the engine's own timeout) stopped the sample;
# "cancelled" only appears in traces, a cancelled caller never sees a result;
# "tool_calls": the model ended its turn with calls of the request's tools.
FinishReason = Literal["stop", "length", "deadline", "cancelled", "tool_calls"]

# What a request may ask of an engine beyond plain text (``asked_features``).
Feature = Literal["tools", "json_object", "json_schema"]


class ToolCall(msgspec.Struct, frozen=True):
    """A call of one of the request's tools, in OpenAI's terms: ``arguments`` is the
    JSON text of the call's arguments as the model wrote it."""

    id: str
    name: str
    arguments: str


class ToolCallDelta(msgspec.Struct, frozen=True):
    """Part of a streamed tool call. The first part of call ``index`` carries its id
    and name; every part carries the next piece of its arguments' text (maybe none),
    so that the pieces joined are the arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class Message(msgspec.Struct, frozen=True):
    role: Role
    content: str
    # An assistant turn's calls of tools, and the call a tool turn answers.
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None


# A conversation is rendered by the backend's template; a plain string is raw
# completion text that the backend continues as it is.
Prompt = str | Sequence[Message]


def last_user_turn(messages: Sequence[Message]) -> str:
    """The content of the last user message: the question a conversation asks now;
    empty when there is none."""
    return next((m.content for m in reversed(messages) if m.role == "user"), "")


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    n: int = 1
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: bool = False
    top_logprobs: int = 0
    # What the answer must be beyond text, as the JSON text the client sent: OpenAI's
    # `tools` array (legacy `functions` as tools), its `tool_choice`, and a
    # `response_format` of json_object or json_schema. Text keeps params hashable (the
    # cache and the coalescer key on them) and passes on to HTTP engines unchanged.
    tools: str | None = None
    tool_choice: str | None = None
    response_format: str | None = None
    # Whether the model may call several tools at once (None: the backend's default).
    parallel_tool_calls: bool | None = None


def asked_features(params: SamplingParams) -> tuple[Feature, ...]:
    """What ``params`` asks beyond plain text, in the words an engine's ``features``
    answer in."""
    asked: list[Feature] = []
    if params.tools is not None:
        asked.append("tools")
    if params.response_format is not None:
        kind = msgspec.json.decode(params.response_format).get("type")
        if kind in ("json_object", "json_schema"):
            asked.append(kind)
    return tuple(asked)


class TopLogprob(msgspec.Struct, frozen=True):
    token: str
    logprob: float


class TokenLogprob(msgspec.Struct, frozen=True):
    """The chosen token's log-probability under the model, before sampling settings."""

    token: str
    logprob: float
    top: tuple[TopLogprob, ...] = ()


class Timings(msgspec.Struct, frozen=True):
    queue_s: float
    first_token_s: float | None
    total_s: float


class Sample(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    text: str
    finish_reason: FinishReason
    completion_tokens: int
    logprobs: tuple[TokenLogprob, ...] = ()
    # The calls the sample ends with (its finish_reason is then "tool_calls"); its
    # text is whatever the model said beside them.
    tool_calls: tuple[ToolCall, ...] = ()
    timings: Timings


class Generation(msgspec.Struct, frozen=True, kw_only=True):
    engine: str  # the engine that generated it (a failover's stand-in names itself)
    model: str
    prompt_tokens: int
    samples: tuple[Sample, ...]

    @property
    def completion_tokens(self) -> int:
        return sum(s.completion_tokens for s in self.samples)

    @property
    def text(self) -> str:
        return self.samples[0].text


class Delta(msgspec.Struct, frozen=True):
    """New text of one sample; ``logprobs`` covers exactly the tokens behind ``text``."""

    index: int
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    tool_calls: tuple[ToolCallDelta, ...] = ()
    # Set on a stream's first delta by an engine answering in another's place (a
    # failover's stand-in): its name, before the Generation that names it exists.
    engine: str | None = None


class EngineError(Exception):
    """The backend failed; ``message`` is safe to show to API clients."""

    def __init__(self, engine: str, message: str) -> None:
        super().__init__(f"engine {engine!r}: {message}")
        self.engine = engine
        self.message = message


class EngineOverloaded(EngineError):
    """The engine's queue is full; try again after ``retry_after_s``."""

    def __init__(self, engine: str, queue_size: int, retry_after_s: float) -> None:
        super().__init__(engine, f"queue full ({queue_size} waiting); retry later")
        self.retry_after_s = retry_after_s


class EngineUnavailable(EngineError):
    """The backend cannot be reached or broke off mid-answer."""


class CannotFollow(EngineError):
    """The request asks for what this backend cannot hold its answer to (a schema, a
    tool choice); ``param`` names the field to change. The client's to fix: a 400."""

    def __init__(self, engine: str, param: str, message: str) -> None:
        super().__init__(engine, f"{param}: {message}")
        self.param = param


class PromptTooLong(EngineError):
    def __init__(self, engine: str, prompt_tokens: int, context_tokens: int) -> None:
        super().__init__(
            engine,
            f"prompt is {prompt_tokens} tokens; the model's context holds {context_tokens}",
        )
        self.prompt_tokens = prompt_tokens
        self.context_tokens = context_tokens


class Engine(Protocol):
    name: str
    model: str

    @property
    def features(self) -> frozenset[Feature]:
        """What this engine answers beyond plain text, once started: a request asking
        for anything else is refused before it reaches the engine, never answered in
        plain text."""
        ...

    async def start(self) -> None:
        """Load weights or open connections; the engine is ready when this returns."""

    async def close(self) -> None: ...

    def refusal(self) -> EngineOverloaded | None:
        """What a new request would be refused with now; None: it would be taken.

        Asked before work that only this engine's answer would use (the embedding), so
        a request every candidate engine would refuse is refused first."""
        ...

    def stream(
        self, prompt: Prompt, params: SamplingParams, deadline: float | None = None
    ) -> AsyncGenerator[Delta | Generation]:
        """Yield deltas of all ``params.n`` samples as they come, then the Generation.

        Closing the iterator (or cancelling the task consuming it) stops generation.
        """
        ...

    async def generate(
        self, prompt: Prompt, params: SamplingParams, deadline: float | None = None
    ) -> Generation: ...
