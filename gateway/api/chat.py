"""A chat request answered in the words of the API it came by (its dialect): OpenAI's
chat completions, or an API translated onto them (the Responses API, Anthropic's
Messages). Each dialect gives its ids, bodies, stream events, error shape and field
names; the front door, the pipeline and the end of the exchange are one for all.

A chat request is let in by the front door (gateway.api.front), handed to the pipeline
with the settings resolved for it, and its answer rendered; its exchange is ended here,
and everything else (metrics, the access log, the trace span, the cache's write-back)
hears of it once it has settled.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

import msgspec
from litestar import Request, Response
from litestar.datastructures import State
from litestar.exceptions import HTTPException
from litestar.openapi.datastructures import ResponseSpec
from litestar.response import Stream
from litestar.types import ASGIApp

from engines.base import EngineError
from gateway.api import render
from gateway.api.errors import EXCHANGE, APIError, ClientGone, ErrorShape
from gateway.api.front import HANDED, Admitted, admit, charge, open_exchange
from gateway.api.headers import decision_headers
from gateway.api.wire import ChatCompletionRequest
from gateway.config import GatewayConfig
from gateway.ops.keys import Caller
from gateway.ops.metrics import CLIENT_CLOSED
from gateway.pipeline.exchange import Exchange
from gateway.pipeline.outcome import Answering, Refused
from gateway.pipeline.pipeline import Pipeline
from gateway.pipeline.request import ChatRequest
from gateway.pipeline.request_policy import Policy
from gateway.runtime import Runtime

T = TypeVar("T")

# Why a chat request is refused, by status, whatever its API (each in its own shape).
CHAT_ERRORS = {
    400: "Invalid request, or one its engine cannot answer (tools, a JSON format)",
    401: "No API key, or an unknown one",
    404: "Unknown model",
    409: "A newer turn replaced this request",
    413: "Body larger than the limit",
    415: "The body is not declared application/json",
    429: "The key's rate limit, or an engine's queue, is full; see Retry-After",
    502: "The engine failed",
    503: "Not ready, engine unavailable, or the rate limits' store unavailable with "
    "auth.rate_limit_outage: closed",
    504: "Cache-Control: only-if-cached and nothing cached, or the deadline passed and "
    "the fallback policy is error",
}


def error_specs(body: type, **overrides: str) -> dict[int, ResponseSpec]:
    """The OpenAPI schema's error responses of a chat route whose errors are ``body``;
    ``overrides`` words a status (``s400=...``) for this API."""
    return {
        status: ResponseSpec(body, description=overrides.get(f"s{status}", why))
        for status, why in CHAT_ERRORS.items()
    }


def ready(state: State) -> Runtime:
    """The runtime, or the 503 that says it is not ready yet."""
    runtime: Runtime = state.runtime
    if not runtime.ready:
        reason = runtime.failure or "models are still loading"
        raise APIError(
            503, f"not ready: {reason}", type="server_error", code="not_ready", retry_after_s=5
        )
    return runtime


class Dialect(msgspec.Struct, frozen=True):
    """One API's way of answering a chat request: OpenAI's chat completions, or one
    translated onto it (the Responses API, Anthropic's Messages), each with its own
    ids, bodies, stream events and error shape, all onto the one pipeline."""

    shape: ErrorShape
    new_id: Callable[[], str]
    # The answer whole, as the response body; raises what the answer raised.
    whole: Callable[[Answering, render.Reply], Awaitable[bytes]]
    # The answer as a stream's bytes; an error after it began goes in the stream, and
    # ``exchange`` hears the first event go out and the stream end (render.delivered).
    stream: Callable[[Answering, render.Reply, Exchange], AsyncIterator[bytes]]
    # Chat completions' field names (as the checks name them in errors) in this API's
    # words, where they differ.
    fields: Mapping[str, str] = {}

    def error(self, exc: BaseException) -> APIError | None:
        """What a client of this API hears for ``exc`` (None: not one the API answers
        on purpose), naming the field at fault in this API's words."""
        error = APIError.of(exc)
        if error is None or not self.fields:
            return error
        return error.renamed(self.fields)


CHAT_COMPLETIONS = Dialect("openai", render.completion_id, render.completion, render.chunks)


async def answer_chat(
    data: ChatCompletionRequest,
    state: State,
    request: Request[Any, Any, Any],
    dialect: Dialect,
) -> ASGIApp:
    """A chat request, in chat completions' terms, answered in ``dialect``'s."""
    runtime: Runtime = state.runtime
    # Read once: each read of request.state builds a new State (and its lock).
    own = request.state
    caller: Caller = own.caller
    handed: tuple[Exchange, Admitted] | None = own.get(HANDED)
    if handed is None:
        exchange = open_exchange(runtime, tenant=caller.tenant, model=data.model, key=caller.key)
    else:
        exchange = handed[0]
    own[EXCHANGE] = exchange  # ended below, however the request ends
    try:
        response = await _chat(state, request, data, own.config, caller, exchange, handed, dialect)
    except BaseException as exc:
        status, error = ending(exc)
        exchange.end(status, error)
        renamed = dialect.error(exc) if dialect.fields else None
        if renamed is not None and renamed is not exc:
            raise renamed from None
        raise
    return response.to_asgi_response(None, request)


async def _chat(
    state: State,
    request: Request[Any, Any, Any],
    data: ChatCompletionRequest,
    config: GatewayConfig,
    caller: Caller,
    exchange: Exchange,
    handed: tuple[Exchange, Admitted] | None,
    dialect: Dialect,
) -> Response[Any]:
    runtime = ready(state)
    if handed is None:
        admitted = admit(runtime, config, caller, data, request.headers, exchange)
        if caller.limits is not None:
            await charge(runtime, config, caller, admitted.chat)
    else:
        admitted = handed[1]
    chat, policy, pipeline = admitted.chat, admitted.policy, runtime.pipeline
    reply = render.Reply(
        id=dialect.new_id(),
        created=int(time.time()),
        model=data.model,
        include_usage=chat.include_usage,
        trace=admitted.trace,
        reasoning=admitted.reasoning,
    )
    # From here the work is the engines': it stops when the client leaves (a stream's
    # client, by closing the stream, which ends the exchange).
    if chat.stream:
        answering = await _unless_gone(request, pipeline.run(chat, policy, exchange))
        body = dialect.stream(answering, reply, exchange)
        headers = {**decision_headers(answering.decision), "Cache-Control": "no-cache"}
        return Stream(body, media_type="text/event-stream", headers=headers)
    try:
        completion = await _unless_gone(
            request, _whole(pipeline, chat, policy, exchange, reply, dialect)
        )
    except (Refused, EngineError) as exc:
        # The error says what was decided up to then (the loop's deadline with the error
        # fallback, a newer turn, an engine that refused).
        error = dialect.error(exc)
        assert error is not None
        refusal = error.response(dialect.shape)
        refusal.headers.update(decision_headers(exchange.decision))
        exchange.end(error.status, error.reason)
        return refusal
    headers = decision_headers(exchange.decision)  # complete: the answer is whole
    exchange.end(200)
    return Response(completion, media_type="application/json", headers=headers)


async def _whole(
    pipeline: Pipeline,
    chat: ChatRequest,
    policy: Policy,
    exchange: Exchange,
    reply: render.Reply,
    dialect: Dialect,
) -> bytes:
    """A plain answer, whole: the pipeline's answer, drained into one body."""
    return await dialect.whole(await pipeline.run(chat, policy, exchange), reply)


async def _unless_gone(request: Request[Any, Any, Any], work: Awaitable[T]) -> T:
    """What ``work`` gives, unless the client leaves first: then the work is cancelled
    and awaited, so that it has stopped (an engine within a token, as a closed stream
    stops it) when ``ClientGone`` is raised and the exchange ends with 499."""
    working = asyncio.ensure_future(work)
    leaving = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait((working, leaving), return_when=asyncio.FIRST_COMPLETED)
    finally:
        leaving.cancel()
        gone = not working.done()
        if gone:
            working.cancel()
            await asyncio.wait((working,))
    if gone:
        if not working.cancelled():
            working.exception()  # whatever it ended with, nobody is left to hear it
        raise ClientGone
    return working.result()


async def _disconnect(request: Request[Any, Any, Any]) -> None:
    # With the body read, the server's next message for this request is its end.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def ending(exc: BaseException) -> tuple[int, str]:
    """The HTTP status a chat request ends with when ``exc`` ends it, and the error."""
    error = APIError.of(exc)
    if error is not None:
        return error.status, error.reason
    if isinstance(exc, HTTPException):
        return exc.status_code, "http_error"
    if isinstance(exc, (ClientGone, asyncio.CancelledError)):
        return CLIENT_CLOSED, "client_gone"
    return 500, "internal_error"
