"""The HTTP application, built by a factory from a config (no module-level state)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
from litestar import Litestar, Request, Response, get, post
from litestar.connection import ASGIConnection
from litestar.datastructures import State
from litestar.handlers.base import BaseRouteHandler
from litestar.openapi import OpenAPIConfig
from litestar.openapi.datastructures import ResponseSpec
from litestar.response import Stream
from litestar.types import ASGIApp

from engines.failover import failed_over
from evaluator.loop import LoopResult
from gateway import logs, thinking, tracing
from gateway.admin import ADMIN_HANDLERS
from gateway.auth import Caller
from gateway.chat import (
    Answer,
    ChatCall,
    answer_completion,
    answer_stream,
    check,
    complete,
    engine_seconds,
    new_id,
    open_stream,
    unknown_model,
)
from gateway.config import AUTO_MODEL, GatewayConfig
from gateway.errors import EXCEPTION_HANDLERS, APIError
from gateway.metrics import CONTENT_TYPE, Exchange
from gateway.openai_types import (
    ChatCompletion,
    ChatCompletionRequest,
    Decision,
    ErrorResponse,
    Model,
    ModelList,
    TracedCompletion,
)
from gateway.pipeline import (
    CACHE_HEADER,
    Dispatch,
    Embedded,
    Served,
    Thought,
    handle,
    last_user_turn,
    route,
)
from gateway.reload import start_reloading
from gateway.runtime import Runtime
from gateway.thinking import SUPERSEDED_HEADER, Think
from router.router import RouteDecision

_CHAT_RESPONSES_DOC = "A chat completion, or with `stream: true` a text/event-stream of chunks."
# A request header: "true" adds the decision trace to a plain answer's body.
TRACE_HEADER = "x-satisfice-trace"


def require_key(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """Before the body is read: who is calling (401 without a valid key, when keys are
    configured), and the config this request keeps to its end, even across a reload."""
    runtime: Runtime = connection.app.state.runtime
    # Read together, with no await between them: apply() replaces both at once.
    config, keys = runtime.config, runtime.keys
    connection.state.config = config
    connection.state.caller = keys.caller(connection.headers)


def _asked(request: Request[Any, Any, Any]) -> tuple[GatewayConfig, Caller]:
    """What require_key found for this request."""
    return request.state.config, request.state.caller


def _runtime(state: State) -> Runtime:
    runtime: Runtime = state.runtime
    if not runtime.ready:
        reason = runtime.failure or "models are still loading"
        raise APIError(
            503, f"not ready: {reason}", type="server_error", code="not_ready", retry_after_s=5
        )
    return runtime


_KEY_ERRORS = {401: ResponseSpec(ErrorResponse, description="No API key, or an unknown one")}


# The handler returns finished ASGI responses: given a Stream, Litestar would still
# apply the route's JSON media type. `responses` keeps the OpenAPI schema complete.
@post(
    "/v1/chat/completions",
    description=_CHAT_RESPONSES_DOC,
    status_code=200,
    guards=[require_key],
    responses={
        200: ResponseSpec(ChatCompletion, description="The completion (without `stream`)"),
        400: ResponseSpec(ErrorResponse, description="Invalid request"),
        **_KEY_ERRORS,
        404: ResponseSpec(ErrorResponse, description="Unknown model"),
        429: ResponseSpec(
            ErrorResponse,
            description="The key's rate limit, or an engine's queue, is full; see Retry-After",
        ),
        409: ResponseSpec(ErrorResponse, description="A newer turn replaced this request"),
        413: ResponseSpec(ErrorResponse, description="Body larger than the limit"),
        502: ResponseSpec(ErrorResponse, description="The engine failed"),
        503: ResponseSpec(ErrorResponse, description="Not ready, or engine unavailable"),
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
    runtime: Runtime = state.runtime
    # The one place where a chat request's outcome is known, for the metrics and the
    # access log (which hears what the response's headers say once there is one).
    caller: Caller = request.state.caller
    facts = {"model": data.model, "tenant": caller.tenant}
    if caller.key is not None:
        facts["key"] = caller.key  # the key's name in the config, never the key

    def log_access(ended: Exchange, status: int, seconds: float) -> None:
        logs.access(ended, status, seconds, facts)
        tracing.chat_ended(ended, facts)

    exchange = runtime.metrics.exchange(log_access)
    try:
        response = await _chat(_runtime(state), exchange, data, request)
    except BaseException as exc:
        exchange.failed(exc)
        raise
    for header, fact in (("x-satisfice-engine", "engine"), (CACHE_HEADER, "cache")):
        if header in response.headers:
            facts[fact] = str(response.headers[header])
    if isinstance(response, Stream):
        assert isinstance(response.iterator, AsyncIterable)  # every stream here is async
        response.iterator = exchange.streamed(response.iterator)
    else:
        exchange.answered(response.status_code or 200)
        if _wants_trace(request.headers) and response.status_code in (None, 200):
            response = _traced(response, caller.tenant)
    return response.to_asgi_response(None, request)


def _wants_trace(headers: Any) -> bool:
    return str(headers.get(TRACE_HEADER, "")).strip().lower() in ("1", "true", "yes")


def _traced(response: Response[Any], tenant: str) -> Response[Any]:
    """A plain answer with its decision trace added as the ``satisfice`` field, from
    the headers that carry it; a loop answer already has its own."""
    completion = msgspec.json.decode(response.content)
    if "satisfice" in completion:
        return response
    said = {k.lower(): str(v) for k, v in response.headers.items()}

    def number(header: str) -> float | None:
        return float(said[header]) if header in said else None

    engine = said.get("x-satisfice-engine")
    cache = said.get(CACHE_HEADER)
    served = cache in ("exact", "semantic", "coalesced")
    decision = Decision(
        tenant=tenant,
        route=cache if served and cache else said.get("x-satisfice-route", engine or "unknown"),
        engine=engine,
        cache=cache,
        similarity=number("x-satisfice-cache-similarity"),
        difficulty=number("x-satisfice-difficulty"),
        confidence=number("x-satisfice-confidence"),
        failover=said.get("x-satisfice-failover"),
    )
    traced = msgspec.convert(completion, ChatCompletion)
    body = TracedCompletion(**msgspec.structs.asdict(traced), satisfice=decision)
    return Response(
        msgspec.json.encode(body), media_type="application/json", headers=dict(response.headers)
    )


async def _chat(
    runtime: Runtime,
    exchange: Exchange,
    data: ChatCompletionRequest,
    request: Request[Any, Any, Any],
) -> Response[Any]:
    config, caller = _asked(request)
    outcome = await handle(runtime, config, caller, data, request.headers)
    if isinstance(outcome, Served):
        exchange.routed(outcome.source)
        return _served(outcome, data)
    if isinstance(outcome, Thought):
        return await _thought(runtime, exchange, outcome.think, outcome, data, request)
    call = outcome.call
    tier = call.decision.tier if call.decision is not None else call.engine.name
    exchange.routed(tier, call.deadline)
    headers = {**_trace_headers(call), CACHE_HEADER: outcome.cache}
    if outcome.superseded_ms is not None:
        headers[SUPERSEDED_HEADER] = f"{outcome.superseded_ms:.1f}"
    if outcome.escalate is not None:
        # The small engine's answer stands unless the calibrator doubts it.
        loop = outcome.escalate.loop
        try:
            generation, probability = await loop.draft(
                call.engine, call.messages, call.params, call.deadline
            )
        except BaseException:
            outcome.finished(None)
            raise
        threshold = loop.settings.escalate_below or 0.0
        if probability < threshold:
            outcome.finished(None)
            return await _thought(runtime, exchange, outcome.escalate, outcome, data, request)
        outcome.finished(generation)
        headers["x-satisfice-confidence"] = f"{probability:.4f}"
        answer = Answer(
            text=generation.text,
            finish_reason=generation.samples[0].finish_reason,
            completion_tokens=generation.completion_tokens,
            prompt_tokens=generation.prompt_tokens,
        )
        return _answered(answer, data, headers)
    if not data.stream:
        try:
            completion, generation = await complete(call)
        except BaseException:
            outcome.finished(None)
            raise
        outcome.finished(generation)
        headers.update(_failover_headers())
        # Server-Timing lets a client tell the engine's time from the gateway's own.
        headers["Server-Timing"] = f"engine;dur={engine_seconds(generation) * 1000:.3f}"
        return Response(
            msgspec.json.encode(completion), media_type="application/json", headers=headers
        )
    body = await open_stream(call, outcome.finished)
    headers.update(_failover_headers())
    headers["Cache-Control"] = "no-cache"
    return Stream(body, media_type="text/event-stream", headers=headers)


def _served(served: Served, data: ChatCompletionRequest) -> Response[Any]:
    """An answer from the cache, or shared from an identical request in flight."""
    headers = {CACHE_HEADER: served.source, "x-satisfice-engine": served.engine}
    if served.similarity is not None:
        headers["x-satisfice-cache-similarity"] = f"{served.similarity:.4f}"
    return _answered(served.answer, data, headers)


def _answered(
    answer: Answer, data: ChatCompletionRequest, headers: dict[str, str]
) -> Response[Any]:
    """An answer already in hand, as a completion or a one-chunk stream."""
    call_id = new_id()
    if not data.stream:
        completion = answer_completion(call_id, data.model, answer)
        return Response(
            msgspec.json.encode(completion), media_type="application/json", headers=headers
        )
    include_usage = bool(data.stream_options and data.stream_options.include_usage)
    headers["Cache-Control"] = "no-cache"
    body = answer_stream(call_id, data.model, answer, include_usage)
    return Stream(body, media_type="text/event-stream", headers=headers)


async def _thought(
    runtime: Runtime,
    exchange: Exchange,
    think: Think,
    outcome: Thought | Dispatch,
    data: ChatCompletionRequest,
    request: Request[Any, Any, Any],
) -> Response[Any]:
    """A hard question, answered by the reasoning loop."""
    exchange.routed("loop", think.deadline)
    keep = think.finished

    def finished(result: LoopResult | None) -> None:  # the metrics hear the result too
        exchange.thought(result)
        keep(result)

    think = msgspec.structs.replace(think, finished=finished)
    headers = {
        CACHE_HEADER: outcome.cache,
        "x-satisfice-engine": think.loop.engine.name,
        "x-satisfice-route": "loop",
    }
    if think.difficulty is not None:
        headers["x-satisfice-difficulty"] = f"{think.difficulty:.4f}"
    if think.escalated_from is not None:
        headers["x-satisfice-escalated-from"] = think.escalated_from
    if outcome.superseded_ms is not None:
        headers[SUPERSEDED_HEADER] = f"{outcome.superseded_ms:.1f}"
    run = thinking.start(think, runtime.turns)
    if data.stream:
        headers["Cache-Control"] = "no-cache"
        body = thinking.stream(think, run)
        return Stream(body, media_type="text/event-stream", headers=headers)
    # A plain response has no stream to close when the client leaves: watch for it.
    watcher = asyncio.create_task(_stop_when_gone(request, run))
    try:
        result = await thinking.complete(think, run)
    except thinking.Superseded:
        raise APIError(
            409, "a newer turn of this conversation replaced this request", code="superseded"
        ) from None
    finally:
        watcher.cancel()
        await run.stop()
    headers.update(thinking.trace_headers(result.trace))
    headers["x-satisfice-engine"] = result.engine  # the small one, if it answered
    if result.trace.fallback == "error":
        refusal = thinking.deadline_error(result.trace).response()
        refusal.headers.update(headers)
        return refusal
    encoded = msgspec.json.encode(thinking.completion(think, result))
    return Response(encoded, media_type="application/json", headers=headers)


async def _stop_when_gone(request: Request[Any, Any, Any], run: thinking.LoopRun) -> None:
    # With the body read, the server's next message for this request is its end.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            await run.stop()
            return


def _trace_headers(call: ChatCall) -> dict[str, str]:
    """Which engine answered, and for routed requests why."""
    headers = {"x-satisfice-engine": call.engine.name}
    if call.decision is not None:
        headers["x-satisfice-route"] = call.decision.tier
        headers["x-satisfice-difficulty"] = f"{call.decision.score:.4f}"
    return headers


def _failover_headers() -> dict[str, str]:
    """The engine that answered instead of the one asked, which was unavailable."""
    failover = failed_over()
    if failover is None:
        return {}
    return {"x-satisfice-engine": failover.target, "x-satisfice-failover": failover.source}


@post(
    "/v1/route",
    status_code=200,
    description="The routing decision for a chat request, explained, without generating.",
    guards=[require_key],
    responses={
        400: ResponseSpec(ErrorResponse, description="Invalid request"),
        **_KEY_ERRORS,
        404: ResponseSpec(ErrorResponse, description="Routing is turned off"),
        413: ResponseSpec(ErrorResponse, description="Body larger than the limit"),
        503: ResponseSpec(ErrorResponse, description="Not ready"),
    },
)
async def explain_route(
    data: ChatCompletionRequest, state: State, request: Request[Any, Any, Any]
) -> RouteDecision:
    runtime = _runtime(state)
    config, caller = _asked(request)
    if runtime.router is None or config.router is None:
        raise unknown_model(AUTO_MODEL, runtime.engines, " (routing is turned off)")
    checked = check(msgspec.structs.replace(data, model=AUTO_MODEL), runtime.engines,
                    config.server)  # fmt: skip
    threshold = config.tenant(caller.tenant).router_threshold
    embedded = Embedded(runtime, last_user_turn(checked.messages))
    return await route(
        runtime, embedded, config.router.threshold if threshold is None else threshold
    )


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


def create_app(
    config: GatewayConfig,
    config_path: Path | None = None,
    adjust: Callable[[GatewayConfig], GatewayConfig] = lambda config: config,
    on_start_failure: Callable[[str], None] | None = None,
) -> Litestar:
    """The app for ``config``, read from ``config_path`` (None: the embedded default),
    which is reloaded on SIGHUP or change, through ``adjust`` (the command line's
    overrides). ``on_start_failure`` hears why the models could not start (the serve
    command stops the server then, rather than serve a gateway that is never ready)."""
    runtime = Runtime(config)

    async def start() -> None:
        await runtime.start()
        if runtime.failure is not None and on_start_failure is not None:
            on_start_failure(runtime.failure)

    # The config's telemetry section wins over the standard OTEL_* variables.
    telemetry = config.telemetry or tracing.from_environment(os.environ)
    traces = tracing.Tracing(telemetry) if telemetry is not None else None

    @contextlib.asynccontextmanager
    async def lifespan(_: Litestar) -> AsyncIterator[None]:
        # Load models in the background so /healthz answers while they load.
        loading = asyncio.create_task(start())
        stop_reloading = start_reloading(runtime, config_path, adjust)
        try:
            yield
        finally:
            stop_reloading()
            loading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loading
            await runtime.close()
            if traces is not None:  # the last spans, flushed; blocks up to its timeout
                await asyncio.to_thread(traces.close)

    app = Litestar(
        route_handlers=[
            chat_completions,
            explain_route,
            list_models,
            healthz,
            readyz,
            metrics,
            *ADMIN_HANDLERS,
        ],
        state=State({"runtime": runtime, "started_at": int(time.time())}),
        lifespan=[lifespan],
        exception_handlers=EXCEPTION_HANDLERS,  # type: ignore[arg-type]
        request_max_body_size=config.server.max_body_bytes,
        openapi_config=OpenAPIConfig(title="Satisfice", version="0.1.0", path="/openapi"),
        # Logging is the process's (gateway.logs); Litestar's default would replace
        # the root logger's handler with its own format.
        logging_config=None,
    )
    # Outside Litestar's exception handling, so its 404s and 500s carry the id too.
    handler = app.asgi_handler
    if traces is not None:
        handler = tracing.server_spans(handler, traces.tracer)
    app.asgi_handler = logs.RequestIds(handler)
    return app
