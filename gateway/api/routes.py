"""The API's routes: chat completions (and the Responses API's and Anthropic's
Messages', in gateway.api.responses and .anthropic), the route alone, models, the
probes and /metrics. Chat requests are answered by gateway.api.chat."""

from __future__ import annotations

import time
from typing import Any, TypeVar

from litestar import Request, Response, get, post
from litestar.datastructures import State
from litestar.openapi.datastructures import ResponseSpec
from litestar.types import ASGIApp

from gateway.api import render
from gateway.api.anthropic import messages
from gateway.api.chat import Dialect, answer_chat, error_specs, ready
from gateway.api.errors import APIError
from gateway.api.feedback import feedback
from gateway.api.guards import require_json, require_key
from gateway.api.responses import responses
from gateway.api.validate import chat_request
from gateway.api.wire import ChatCompletion, ChatCompletionRequest, ErrorResponse, Model, ModelList
from gateway.config import AUTO_MODEL, GatewayConfig
from gateway.ops.keys import Caller
from gateway.ops.metrics import CONTENT_TYPE
from gateway.pipeline.request_policy import resolve
from gateway.runtime import Runtime
from router.router import RouteDecision

T = TypeVar("T")

_CHAT_RESPONSES_DOC = "A chat completion, or with `stream: true` a text/event-stream of chunks."
_KEY_ERRORS = {401: ResponseSpec(ErrorResponse, description="No API key, or an unknown one")}
_JSON_ERRORS = {
    415: ResponseSpec(ErrorResponse, description="The body is not declared application/json")
}


# The handler returns finished ASGI responses: given a Stream, Litestar would still
# apply the route's JSON media type. `responses` keeps the OpenAPI schema complete.
@post(
    "/v1/chat/completions",
    description=_CHAT_RESPONSES_DOC,
    status_code=200,
    guards=[require_key, require_json],
    responses={
        200: ResponseSpec(ChatCompletion, description="The completion (without `stream`)"),
        **error_specs(ErrorResponse),
    },
)
async def chat_completions(
    data: ChatCompletionRequest, state: State, request: Request[Any, Any, Any]
) -> ASGIApp:
    return await answer_chat(data, state, request, CHAT_COMPLETIONS)


CHAT_COMPLETIONS = Dialect("openai", render.completion_id, render.completion, render.chunks)


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
    runtime = ready(state)
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
    messages,
    explain_route,
    feedback,
    list_models,
    healthz,
    readyz,
    metrics,
]
