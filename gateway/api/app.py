"""The HTTP application, built by a factory from a config (no module-level state)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from litestar import Litestar
from litestar.datastructures import State
from litestar.openapi import OpenAPIConfig
from litestar.types import ASGIApp

from gateway.api.admin import ADMIN_HANDLERS
from gateway.api.errors import EXCEPTION_HANDLERS, JSONRequest
from gateway.api.express import ExpressHits
from gateway.api.routes import ROUTES
from gateway.config import GatewayConfig
from gateway.ops import logs, tracing
from gateway.reload import start_reloading
from gateway.runtime import Runtime


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
    # The config's telemetry section wins over the standard OTEL_* variables.
    telemetry = config.telemetry or tracing.from_environment(os.environ)
    traces = tracing.Tracing(telemetry) if telemetry is not None else None
    if traces is not None:  # a chat request's span carries its decision once it settles
        runtime.settlement.subscribe(tracing.chat_ended)

    async def start() -> None:
        await runtime.start()
        if runtime.failure is not None and on_start_failure is not None:
            on_start_failure(runtime.failure)

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
        route_handlers=[*ROUTES, *ADMIN_HANDLERS],
        state=State({"runtime": runtime, "started_at": int(time.time())}),
        lifespan=[lifespan],
        exception_handlers=EXCEPTION_HANDLERS,  # type: ignore[arg-type]
        request_class=JSONRequest,
        request_max_body_size=config.server.max_body_bytes,
        openapi_config=OpenAPIConfig(title="Satisfice", version="0.1.0", path="/openapi"),
        # Logging is the process's (gateway.ops.logs); Litestar's default would replace
        # the root logger's handler with its own format.
        logging_config=None,
    )
    # Exact hits at hand are answered before Litestar; outside its exception handling,
    # so its 404s and 500s carry the id too.
    handler: ASGIApp = ExpressHits(app.asgi_handler, runtime)
    if traces is not None:
        handler = tracing.server_spans(handler, traces.tracer)
    app.asgi_handler = logs.RequestIds(handler)
    return app
