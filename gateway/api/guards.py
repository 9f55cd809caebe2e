"""What every API request is checked for before its body is read: its key, and a
JSON body that says it is one."""

from __future__ import annotations

from typing import Any

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from gateway.api.errors import APIError, shown
from gateway.runtime import Runtime

# The guards are coroutines, though nothing in them waits: Litestar runs a plain
# function guard in its thread pool, a thread hop for every request.


async def require_key(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """Before the body is read: who is calling (401 without a valid key, when keys are
    configured), and the config this request keeps to its end, even across a reload."""
    runtime: Runtime = connection.app.state.runtime
    # Read together, with no await between them: apply() replaces both at once.
    config, keys = runtime.config, runtime.keys
    own = connection.state  # read once: each read builds a new State (and its lock)
    own.config = config
    own.caller = keys.caller(connection.headers)


async def require_json(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """Before the body is read: it is JSON only when it says so. A browser may send a
    cross-site "simple" request with a text/plain or form body, or with none declared;
    reading such a body as JSON would let any web page call an open gateway."""
    declared = connection.headers.get("content-type", "")
    if declared.partition(";")[0].strip().lower() != "application/json":
        raise APIError(
            415,
            "the request body must be JSON, sent with Content-Type: application/json; got "
            + (shown(declared) if declared else "no Content-Type"),
            param="content-type",
            code="unsupported_media_type",
        )
