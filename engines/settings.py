"""Typed settings of each engine backend, as the config file spells them."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from engines.base import Feature
from engines.templates import CompletionTemplate

Positive = Annotated[int, msgspec.Meta(ge=1)]
Seconds = Annotated[float, msgspec.Meta(gt=0)]


class BreakerSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Stop calling a server that keeps failing; let one trial call through later."""

    # Consecutive failed calls (server unreachable, 5xx, stream broken off) that open
    # the breaker; overload (429/503) and refused requests (4xx) do not count.
    failures: Positive = 5
    # Seconds an open breaker refuses calls at once (503) before one trial call may
    # go to the server; its success closes the breaker, its failure opens it again.
    open_s: Seconds = 10.0


class _Common(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    # Samples generated at once, and samples allowed to wait for one of those slots.
    concurrency: Positive = 1
    # Samples that may wait for a slot; one more is refused with 429 and Retry-After.
    queue_size: Annotated[int, msgspec.Meta(ge=0)] = 16
    # Upper bound on one request's time in this engine, whatever the caller's deadline.
    timeout_s: Seconds | None = 120.0
    # What an overloaded engine tells clients to wait (the Retry-After header).
    retry_after_s: Annotated[float, msgspec.Meta(ge=0)] = 1.0
    # Another engine's name: it answers this engine's requests while this one is
    # unavailable (circuit open, or unreachable before the first token was sent).
    # One tier only: the fallback's own fallback is not followed.
    fallback: str | None = None


class LlamaCppSettings(_Common, tag="llama_cpp", tag_field="backend", kw_only=True, frozen=True):
    """An in-process llama.cpp model (GGUF); one model instance per concurrency slot."""

    # A bundled model name (engines/bundled.py: smollm2-135m-instruct, gemma3-270m,
    # qwen2.5-coder-0.5b-instruct, qwen2.5-coder-1.5b-instruct) or a path to a .gguf file.
    model: str
    # "chat" uses the chat template inside the GGUF; a base model needs a completion template.
    template: Literal["chat"] | CompletionTemplate = "chat"
    # The model's context window in tokens; a prompt that fills it is refused with 400
    # (context_length_exceeded).
    context_tokens: Positive = 2048
    # CPU threads of each model instance, for the prompt and for generation.
    threads: Positive = 2
    # Decode the samples of one prompt together, as one batch in one slot: the n of a
    # request, and the branches of a loop's first round (asked for at the same moment;
    # later rounds continue each branch's own text, a prompt of its own). The
    # prompt is read once and each step decodes a token of every sample still going,
    # in a second llama.cpp context per slot (its KV cache grows to the largest batch
    # so far). Off: each sample takes a slot of its own and they run one by one.
    batch_samples: bool = False
    # Most samples in one batch; more of one prompt at once make further batches.
    batch_sequences: Annotated[int, msgspec.Meta(ge=1, le=64)] = 8


class OpenAIHTTPSettings(
    _Common, tag="openai_http", tag_field="backend", kw_only=True, frozen=True
):
    """An OpenAI-compatible server: trtllm-serve, vLLM, SGLang, llama.cpp server."""

    # The server's OpenAI API root, /v1 included (e.g. http://trtllm:8000/v1).
    base_url: str
    # The model name the server serves, sent with each request.
    model: str
    # The server's API: "chat" (/chat/completions) or "completions" for base models.
    api: Literal["chat", "completions"] = "chat"
    # How api: completions turns a conversation into a prompt; null there: the default
    # few-shot template.
    template: CompletionTemplate | None = None
    # Sent as a Bearer token; null: no Authorization header.
    api_key: str | None = None
    concurrency: Positive = 8
    queue_size: Annotated[int, msgspec.Meta(ge=0)] = 64
    # Longest wait for a connection to the server.
    connect_timeout_s: Seconds = 5.0
    # Longest silence between two bytes of an answer before the server counts as stuck.
    read_timeout_s: Seconds = 60.0
    # Retried only when the request cannot have reached the server (connect errors).
    connect_retries: Annotated[int, msgspec.Meta(ge=0)] = 2
    # Fail fast while the server keeps failing; null: every call tries the server.
    breaker: BreakerSettings | None = BreakerSettings()
    # What the server can do beyond plain text, passed on to it as the client asked:
    # tools (function calling), and response_format json_object and json_schema. A
    # request asking for one not listed is refused with 400 before it reaches the
    # server: list only what the server does (llama-cpp-python's server, say, has no
    # json_schema). With api: completions never tools: a prompt of text has no place
    # for them.
    features: tuple[Feature, ...] = ("tools", "json_object", "json_schema")


EngineSettings = LlamaCppSettings | OpenAIHTTPSettings
