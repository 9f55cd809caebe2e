"""Backend for any OpenAI-compatible server: trtllm-serve, vLLM, SGLang, llama.cpp server.

Every sample is requested as a stream, even for ``generate``: deltas arrive as the
server makes them, a deadline can cut a sample short and keep what exists, and a
server that dies mid-answer is noticed at once instead of at the read timeout. Tools,
tool choice and response format pass through to the server (engines/openai_tools.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import httpx
import msgspec

from engines.admission import Admission
from engines.base import (
    Delta,
    EngineError,
    EngineOverloaded,
    EngineUnavailable,
    Feature,
    FinishReason,
    Generation,
    Prompt,
    PromptTooLong,
    Sample,
    SamplingParams,
    Timings,
    TokenLogprob,
    TopLogprob,
)
from engines.breaker import Breaker, BreakerOpen, Ticket
from engines.fanout import EngineCounters, FanOutEngine, SampleDone, remaining
from engines.openai_tools import (
    CallAssembler,
    CallPiece,
    FunctionPiece,
    asked_fields,
    wire_messages,
)
from engines.settings import OpenAIHTTPSettings
from engines.templates import CompletionTemplate

T = TypeVar("T")


class _ChatLogprob(msgspec.Struct):
    token: str
    logprob: float
    # null when no alternatives were asked for (trtllm-serve's non-streaming bodies)
    top_logprobs: list[TopLogprob] | None = None


class _Logprobs(msgspec.Struct):
    """Chat servers fill ``content``; legacy completions servers fill the rest."""

    content: list[_ChatLogprob] | None = None
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] | None = None


class _ChatDelta(msgspec.Struct):
    """A stream's delta, or the whole message of an answer that was not streamed."""

    content: str | None = None
    tool_calls: list[CallPiece] | None = None
    function_call: FunctionPiece | None = None


class _Choice(msgspec.Struct):
    index: int = 0
    delta: _ChatDelta | None = None
    message: _ChatDelta | None = None
    text: str | None = None
    finish_reason: str | None = None
    logprobs: _Logprobs | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None


def _decode_logprobs(raw: _Logprobs | None) -> tuple[TokenLogprob, ...]:
    if raw is None:
        return ()
    if raw.content is not None:
        return tuple(
            TokenLogprob(c.token, c.logprob, tuple(c.top_logprobs or ())) for c in raw.content
        )
    tops = raw.top_logprobs or [None] * len(raw.tokens)
    return tuple(
        TokenLogprob(
            token,
            float("-inf") if value is None else value,
            tuple(TopLogprob(t, lp) for t, lp in (top or {}).items()),
        )
        for token, value, top in zip(raw.tokens, raw.token_logprobs, tops, strict=False)
    )


class _StreamedAnswer:
    """One sample as its chunks arrive: its text and logprobs, when its first token
    came, how it finished, and the token counts the server reported."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.started = time.monotonic()
        self.first_token_at: float | None = None
        self.pieces: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.calls = CallAssembler()
        self.finish: FinishReason | None = None
        self.usage = _Usage()

    def add(self, choice: _Choice) -> Delta | None:
        """Takes one choice of a chunk; the delta it brings, if it brings any."""
        part = choice.delta or choice.message
        text = choice.text if part is None else part.content
        calls = () if part is None else self.calls.add(part.tool_calls, part.function_call)
        new = _decode_logprobs(choice.logprobs)
        if choice.finish_reason is not None:
            self.finish = _finish_reason(choice.finish_reason)
        if not (text or new or calls):
            return None
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self.pieces.append(text or "")
        self.logprobs.extend(new)
        return Delta(self.index, text or "", new, calls)

    def sample(self, finish: FinishReason, keep_logprobs: bool, queue_s: float) -> Sample:
        """The whole sample, once it has finished."""
        if finish in ("stop", "tool_calls"):
            # A sample that ends with calls finishes "tool_calls", whatever the server
            # says: OpenAI and vLLM say "stop" after a call the tool choice forced.
            finish = "tool_calls" if self.calls else "stop"
        first_token_at = self.first_token_at
        return Sample(
            index=self.index,
            text="".join(self.pieces),
            finish_reason=finish,
            completion_tokens=(
                self.usage.completion_tokens or len(self.logprobs) or len(self.pieces)
            ),
            logprobs=tuple(self.logprobs) if keep_logprobs else (),
            tool_calls=self.calls.calls(),
            timings=Timings(
                queue_s=queue_s,
                first_token_s=None if first_token_at is None else first_token_at - self.started,
                total_s=time.monotonic() - self.started,
            ),
        )


def _finish_reason(reason: str) -> FinishReason:
    """The server's finish reason in ours; any we do not know (trtllm-serve's "timeout"
    and "cancelled", vLLM's "abort") ended the answer, as "stop" does."""
    if reason == "length":
        return "length"
    if reason in ("tool_calls", "function_call"):  # the latter: the legacy functions API
        return "tool_calls"
    return "stop"


class OpenAIHTTPEngine(FanOutEngine):
    def __init__(self, name: str, settings: OpenAIHTTPSettings) -> None:
        self.name = name
        self.model = settings.model
        features: frozenset[Feature] = frozenset(settings.features)
        if settings.api == "completions":
            features -= {"tools"}  # a prompt of text has no place for tools
        self.features = features
        self.timeout_s = settings.timeout_s
        self._settings = settings
        self._admission = Admission(
            name, settings.concurrency, settings.queue_size, settings.retry_after_s
        )
        self.counters = EngineCounters()
        self.breaker: Breaker | None = None
        if settings.breaker is not None:
            self.breaker = Breaker(settings.breaker.failures, settings.breaker.open_s)
        headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
        self._client = httpx.AsyncClient(
            base_url=settings.base_url.rstrip("/"),
            headers=headers,
            timeout=httpx.Timeout(
                connect=settings.connect_timeout_s,
                read=settings.read_timeout_s,
                write=settings.read_timeout_s,
                pool=None,  # the admission queue already bounds the waiting
            ),
            limits=httpx.Limits(
                max_connections=settings.concurrency,
                max_keepalive_connections=settings.concurrency,
            ),
        )
        if settings.api == "completions" and settings.template is None:
            self._template: CompletionTemplate | None = CompletionTemplate()
        else:
            self._template = settings.template

    async def close(self) -> None:
        await self._client.aclose()

    async def stream(
        self, prompt: Prompt, params: SamplingParams, deadline: float | None = None
    ) -> AsyncGenerator[Delta | Generation]:
        """The samples, behind the circuit breaker: one request is one call, whatever
        its ``n``, so that a half-open breaker's trial is one whole request."""
        events = super().stream(prompt, params, deadline)
        breaker = self.breaker
        if breaker is None:
            async with contextlib.aclosing(events):
                async for event in events:
                    yield event
            return
        try:
            ticket = breaker.admit()
        except BreakerOpen as exc:
            raise EngineUnavailable(self.name, str(exc)) from None
        verdict: Callable[[Ticket], object] = breaker.abandoned
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    if isinstance(event, Generation) and _heard_from_server(event):
                        # Callers stop iterating once they have it: judge the call now.
                        verdict = breaker.succeeded
                    yield event
        except EngineUnavailable:
            verdict = breaker.failed
            raise
        except EngineOverloaded:
            # No verdict: the queue in front of the server may have refused it.
            raise
        except EngineError:
            verdict = breaker.succeeded  # refused (4xx): the server is alive
            raise
        finally:
            verdict(ticket)

    def _request(self, prompt: Prompt, params: SamplingParams) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "frequency_penalty": params.frequency_penalty,
            "presence_penalty": params.presence_penalty,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        stops = params.stop + (self._template.stop if self._template else ())
        if stops:
            body["stop"] = list(stops)
        if params.seed is not None:
            body["seed"] = params.seed
        elif params.temperature > 0:
            # Some servers (trtllm-serve) fall back to one fixed seed, which would make
            # every unseeded sample, and every fanned-out branch, the same answer.
            body["seed"] = secrets.randbelow(2**31)
        body.update(asked_fields(params))
        if isinstance(prompt, str) or self._settings.api == "completions":
            if params.tools is not None:
                raise EngineError(self.name, "tools need a conversation on the chat API")
            if not isinstance(prompt, str):
                assert self._template is not None
                prompt = self._template.render(prompt)
            body["prompt"] = prompt
            if params.logprobs:
                body["logprobs"] = max(params.top_logprobs, 1)
            return "/completions", body
        body["messages"] = wire_messages(prompt)
        if params.logprobs:
            body["logprobs"] = True
            body["top_logprobs"] = params.top_logprobs
        return "/chat/completions", body

    async def _sample(
        self,
        prompt: Prompt,
        params: SamplingParams,
        index: int,
        deadline: float | None,
        queue_s: float,
    ) -> AsyncGenerator[Delta | SampleDone]:
        try:
            async for item in self._request_stream(prompt, params, index, deadline, queue_s):
                yield item
        finally:
            self._admission.release()

    async def _request_stream(
        self,
        prompt: Prompt,
        params: SamplingParams,
        index: int,
        deadline: float | None,
        queue_s: float,
    ) -> AsyncGenerator[Delta | SampleDone]:
        path, body = self._request(prompt, params)
        answer = _StreamedAnswer(index)
        async with self._connect(path, body) as response:
            chunks = self._chunks(response, deadline)
            try:
                async with contextlib.aclosing(chunks):
                    async for chunk in chunks:
                        if chunk.usage is not None:
                            answer.usage = chunk.usage
                        for choice in chunk.choices:
                            if (delta := answer.add(choice)) is not None:
                                yield delta
            except TimeoutError:
                answer.finish = "deadline"
        finish = answer.finish
        if finish is None:
            raise EngineUnavailable(self.name, "stream ended before the answer was finished")
        sample = answer.sample(finish, params.logprobs, queue_s)
        yield SampleDone(sample, answer.usage.prompt_tokens)

    async def _chunks(
        self, response: httpx.Response, deadline: float | None
    ) -> AsyncGenerator[_Chunk]:
        """The answer's chunks as they come; TimeoutError at the deadline."""
        if response.headers.get("content-type", "").startswith("application/json"):
            # Answered whole although a stream was asked for (a server may ignore
            # `stream`): one chunk, whose choices hold whole messages.
            yield self._decode(await self._read(response.aread(), deadline))
            return
        lines = response.aiter_lines()
        while True:
            try:
                line = await self._read(anext(lines), deadline)
            except StopAsyncIteration:
                return
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            yield self._decode(data)

    async def _read(self, pending: Awaitable[T], deadline: float | None) -> T:
        """What the server sends next, with its failures in our terms."""
        try:
            async with asyncio.timeout(remaining(deadline)):
                return await pending
        except httpx.ReadTimeout as exc:
            raise EngineUnavailable(
                self.name, f"server sent nothing for {self._settings.read_timeout_s}s"
            ) from exc
        except (httpx.ReadError, httpx.RemoteProtocolError) as exc:
            raise EngineUnavailable(self.name, "server closed the connection mid-answer") from exc

    def _decode(self, data: str | bytes) -> _Chunk:
        try:
            return msgspec.json.decode(data, type=_Chunk)
        except msgspec.DecodeError as exc:
            raise EngineUnavailable(self.name, f"unreadable answer: {exc}") from exc

    @contextlib.asynccontextmanager
    async def _connect(self, path: str, body: dict[str, Any]) -> AsyncIterator[httpx.Response]:
        """Open a streaming response, retrying only failures that never reached the server."""
        settings = self._settings
        # msgspec, not httpx's json: it splices the client's JSON text (msgspec.Raw) in.
        content = msgspec.json.encode(body)
        for attempt in range(settings.connect_retries + 1):
            request = self._client.build_request(
                "POST", path, content=content, headers={"content-type": "application/json"}
            )
            try:
                response = await self._client.send(request, stream=True)
                break
            # A RemoteProtocolError while sending is a keep-alive connection the server
            # had already closed (trtllm-serve closes idle ones after 5 s): the request
            # never reached it, so it is retried like a refused connection.
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError) as exc:
                if attempt == settings.connect_retries:
                    raise EngineUnavailable(
                        self.name,
                        f"cannot connect to {settings.base_url}: {str(exc) or type(exc).__name__}",
                    ) from exc
                await asyncio.sleep(0.05 * 2**attempt)
            except httpx.TimeoutException as exc:
                raise EngineUnavailable(self.name, f"server did not answer: {exc}") from exc
        try:
            if response.status_code >= 400:
                await response.aread()
                raise _status_error(self.name, settings.retry_after_s, response)
            yield response
        finally:
            await response.aclose()


def _heard_from_server(generation: Generation) -> bool:
    """False when the deadline ended every sample before a token came (perhaps still
    queued here): that proves nothing about the server either way."""
    return any(
        s.finish_reason != "deadline" or s.timings.first_token_s is not None
        for s in generation.samples
    )


# How trtllm-serve words a prompt its model cannot take, each giving the prompt's tokens
# and the limit: the PyTorch backend's check against max_num_tokens (no chunked prefill),
# the check against max_seq_len, and the OpenAI wording of newer releases (with code
# "context_length_exceeded"). Matched in the raw body: all of them answer 400.
_TOO_LONG = (
    re.compile(
        r"prompt length \((?P<prompt>\d+)(?:\.\d+)?\), query length \(\d+\) "
        r"should not exceed max_num_tokens \((?P<limit>\d+)\)"
    ),
    re.compile(r"max_seq_len \((?P<limit>\d+)\) - `splited_prompt_len` \((?P<prompt>\d+)\)"),
    re.compile(
        r"maximum context length is (?P<limit>\d+) tokens\. "
        r"However, your messages resulted in (?P<prompt>\d+) tokens"
    ),
)


def _status_error(engine: str, retry_after_s: float, response: httpx.Response) -> EngineError:
    detail = response.text[:500]
    if response.status_code in (429, 503):
        retry = response.headers.get("retry-after", "")
        wait = float(retry) if retry.replace(".", "", 1).isdigit() else retry_after_s
        return EngineOverloaded(engine, 0, wait)
    if response.status_code >= 500:
        return EngineUnavailable(engine, f"server error {response.status_code}: {detail}")
    for pattern in _TOO_LONG:
        if found := pattern.search(response.text):
            return PromptTooLong(engine, int(found["prompt"]), int(found["limit"]))
    return EngineError(engine, f"server refused the request ({response.status_code}): {detail}")
