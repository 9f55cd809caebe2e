"""The OpenAI-compatible routes, the probes and /metrics.

A chat request is let in by the front door (gateway.api.front), handed to the pipeline
with the settings resolved for it, and its answer rendered; its exchange is ended here,
and everything else (metrics, the access log, the trace span, the cache's write-back)
hears of it once it has settled.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import msgspec
from litestar import Request, Response, get, post
from litestar.datastructures import State
from litestar.exceptions import HTTPException
from litestar.openapi.datastructures import ResponseSpec
from litestar.response import Stream
from litestar.types import ASGIApp

from engines.base import EngineError
from gateway.api import render
from gateway.api.errors import EXCHANGE, APIError, ClientGone, ErrorShape
from gateway.api.feedback import feedback
from gateway.api.front import HANDED, Admitted, admit, charge, open_exchange
from gateway.api.guards import require_json, require_key
from gateway.api.headers import decision_headers
from gateway.api.responses import responses
from gateway.api.validate import chat_request
from gateway.api.wire import ChatCompletion, ChatCompletionRequest, ErrorResponse, Model, ModelList
from gateway.config import AUTO_MODEL, GatewayConfig
from gateway.ops.keys import Caller
from gateway.ops.metrics import CLIENT_CLOSED, CONTENT_TYPE
from gateway.pipeline.exchange import Exchange
from gateway.pipeline.outcome import Answering, Refused
from gateway.pipeline.pipeline import Pipeline
from gateway.pipeline.request import ChatRequest
from gateway.pipeline.request_policy import Policy, resolve
from gateway.runtime import Runtime
from router.router import RouteDecision

T = TypeVar("T")

_CHAT_RESPONSES_DOC = "A chat completion, or with `stream: true` a text/event-stream of chunks."
_KEY_ERRORS = {401: ResponseSpec(ErrorResponse, description="No API key, or an unknown one")}
_JSON_ERRORS = {
    415: ResponseSpec(ErrorResponse, description="The body is not declared application/json")
}


def _ready(state: State) -> Runtime:
    runtime: Runtime = state.runtime
    if not runtime.ready:
        reason = runtime.failure or "models are still loading"
        raise APIError(
            503, f"not ready: {reason}", type="server_error", code="not_ready", retry_after_s=5
        )
    return runtime


# The handler returns finished ASGI responses: given a Stream, Litestar would still
# apply the route's JSON media type. `responses` keeps the OpenAPI schema complete.
@post(
    "/v1/chat/completions",
    description=_CHAT_RESPONSES_DOC,
    status_code=200,
    guards=[require_key, require_json],
    responses={
        200: ResponseSpec(ChatCompletion, description="The completion (without `stream`)"),
        400: ResponseSpec(ErrorResponse, description="Invalid request"),
        **_KEY_ERRORS,
        **_JSON_ERRORS,
        404: ResponseSpec(ErrorResponse, description="Unknown model"),
        429: ResponseSpec(
            ErrorResponse,
            description="The key's rate limit, or an engine's queue, is full; see Retry-After",
        ),
        409: ResponseSpec(ErrorResponse, description="A newer turn replaced this request"),
        413: ResponseSpec(ErrorResponse, description="Body larger than the limit"),
        502: ResponseSpec(ErrorResponse, description="The engine failed"),
        503: ResponseSpec(
            ErrorResponse,
            description="Not ready, engine unavailable, or the rate limits' store "
            "unavailable with auth.rate_limit_outage: closed",
        ),
        504: ResponseSpec(
            ErrorResponse,
            description="Cache-Control: only-if-cached and nothing cached, or the deadline "
            "passed and the fallback policy is error",
        ),
    },
)
async def chat_completions(
    data: ChatCompletionRequest, state: State, request: Request[Any, Any, Any]
) -> ASGIApp:
    return await answer_chat(data, state, request, CHAT_COMPLETIONS)


class Dialect(msgspec.Struct, frozen=True):
    """One API's way of answering a chat request: OpenAI's chat completions, or one
    translated onto it (the Responses API, Anthropic's Messages), each with its own
    ids, bodies, stream events and error shape, all onto the one pipeline."""

    shape: ErrorShape
    new_id: Callable[[], str]
    # The answer whole, as the response body; raises what the answer raised.
    whole: Callable[[Answering, render.Reply], Awaitable[bytes]]
    # The answer as a stream's bytes; an error after it began goes in the stream, and
    # ``exchange`` hears the first event go out and the stream end (render.chunks).
    stream: Callable[[Answering, render.Reply, Exchange], AsyncIterator[bytes]]


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
    runtime = _ready(state)
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
        error = APIError.of(exc)
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


@post(
    "/v1/route",
    status_code=200,
    description="The routing decision for a chat request, explained, without generating.",
    guards=[require_key, require_json],
    responses={
        400: ResponseSpec(ErrorResponse, description="Invalid request, or a model not routed"),
        **_KEY_ERRORS,
        404: ResponseSpec(ErrorResponse, description="Unknown model, or routing is turned off"),
        413: ResponseSpec(ErrorResponse, description="Body larger than the limit"),
        **_JSON_ERRORS,
        429: ResponseSpec(ErrorResponse, description="The key's rate limit; see Retry-After"),
        503: ResponseSpec(
            ErrorResponse,
            description="Not ready, or the rate limits' store unavailable with "
            "auth.rate_limit_outage: closed",
        ),
    },
)
async def explain_route(
    data: ChatCompletionRequest, state: State, request: Request[Any, Any, Any]
) -> RouteDecision:
    """The request checked as a chat request is (the same model names, the same limits)
    and charged to the key's rate limit, as it costs an embedding; only model "auto"
    is routed."""
    runtime = _ready(state)
    pipeline = runtime.pipeline
    config: GatewayConfig = request.state.config
    caller: Caller = request.state.caller
    chat = chat_request(data, runtime.engines, runtime.router is not None, config.server)
    if chat.model != AUTO_MODEL:
        raise APIError(
            400,
            f"model {chat.model!r} is not routed: its requests go to engine {chat.model!r}; "
            f"ask about model {AUTO_MODEL!r}",
            param="model",
        )
    if caller.limits is not None:  # no tokens generated: the prompt's estimate alone
        await runtime.limiter.admit(
            caller.key or "", caller.limits, chat.prompt_tokens, config.auth.rate_limit_outage
        )
    policy = resolve(config, caller.tenant, arrived=time.monotonic())
    return await pipeline.route(chat, policy)


@get("/v1/models", guards=[require_key], responses=_KEY_ERRORS)
async def list_models(state: State) -> ModelList:
    runtime: Runtime = state.runtime
    names = [*runtime.engines, *([AUTO_MODEL] if runtime.router else [])]
    return ModelList([Model(name, state.started_at) for name in names])


@get("/metrics", include_in_schema=False)
async def metrics(state: State) -> Response[bytes]:
    """Prometheus' text exposition of this replica's metrics."""
    runtime: Runtime = state.runtime
    return Response(runtime.metrics.exposition(), media_type=CONTENT_TYPE)


@get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is alive and its event loop answers."""
    return {"status": "ok"}


@get("/readyz")
async def readyz(state: State) -> Response[dict[str, object]]:
    """Every engine has loaded: the replica can take traffic."""
    runtime: Runtime = state.runtime
    body: dict[str, object] = {"ready": runtime.ready, "engines": list(runtime.engines)}
    if runtime.failure:
        body["error"] = runtime.failure
    return Response(body, status_code=200 if runtime.ready else 503)


ROUTES = [
    chat_completions,
    responses,
    explain_route,
    feedback,
    list_models,
    healthz,
    readyz,
    metrics,
]
