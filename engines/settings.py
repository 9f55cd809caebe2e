"""Typed settings of each engine backend, as the config file spells them."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from engines.templates import CompletionTemplate

Positive = Annotated[int, msgspec.Meta(ge=1)]
Seconds = Annotated[float, msgspec.Meta(gt=0)]


class _Common(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    # Samples generated at once, and samples allowed to wait for one of those slots.
    concurrency: Positive = 1
    queue_size: Annotated[int, msgspec.Meta(ge=0)] = 16
    # Upper bound on one request's time in this engine, whatever the caller's deadline.
    timeout_s: Seconds | None = 120.0
    # What an overloaded engine tells clients to wait (the Retry-After header).
    retry_after_s: Annotated[float, msgspec.Meta(ge=0)] = 1.0


class LlamaCppSettings(_Common, tag="llama_cpp", tag_field="backend", kw_only=True, frozen=True):
    """An in-process llama.cpp model (GGUF); one model instance per concurrency slot."""

    # A bundled model name (smollm2-135m-instruct, gemma3-270m) or a path to a .gguf file.
    model: str
    # "chat" uses the chat template inside the GGUF; a base model needs a completion template.
    template: Literal["chat"] | CompletionTemplate = "chat"
    context_tokens: Positive = 2048
    threads: Positive = 2


class OpenAIHTTPSettings(
    _Common, tag="openai_http", tag_field="backend", kw_only=True, frozen=True
):
    """An OpenAI-compatible server: trtllm-serve, vLLM, SGLang, llama.cpp server."""

    base_url: str
    model: str
    # The server's API: "chat" (/chat/completions) or "completions" for base models.
    api: Literal["chat", "completions"] = "chat"
    template: CompletionTemplate | None = None
    api_key: str | None = None
    concurrency: Positive = 8
    queue_size: Annotated[int, msgspec.Meta(ge=0)] = 64
    connect_timeout_s: Seconds = 5.0
    # Longest silence between two bytes of an answer before the server counts as stuck.
    read_timeout_s: Seconds = 60.0
    # Retried only when the request cannot have reached the server (connect errors).
    connect_retries: Annotated[int, msgspec.Meta(ge=0)] = 2


EngineSettings = LlamaCppSettings | OpenAIHTTPSettings
