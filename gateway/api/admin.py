"""Admin endpoints for the cache: stats, invalidation and warm-up, behind the admin key."""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Request, get, post
from litestar.connection import ASGIConnection
from litestar.datastructures import State
from litestar.handlers.base import BaseRouteHandler
from litestar.openapi.datastructures import ResponseSpec

from cache.semantic_cache import CacheStats, SemanticCache
from cache.store import StoreUnavailable
from cache.warmup import WarmupReport, warm
from gateway.api.errors import APIError, shown
from gateway.api.wire import ErrorResponse
from gateway.config import valid_tenant
from gateway.runtime import Runtime

# A warm-up upload may be far larger than a chat request.
MAX_WARMUP_BYTES = 256 * 1024 * 1024

_ADMIN_ERRORS = {
    401: ResponseSpec(ErrorResponse, description="No admin key, or a wrong one"),
    403: ResponseSpec(
        ErrorResponse, description="Admin endpoints are closed, or the key is not an admin's"
    ),
    404: ResponseSpec(ErrorResponse, description="This config has no cache"),
    503: ResponseSpec(ErrorResponse, description="Not ready, or the cache store is unavailable"),
}
# Without its own 400, Litestar documents one in its default error shape, which these
# endpoints never send: a bad body is answered in OpenAI's error shape like any other.
_ADMIN_BODY_ERRORS = {
    400: ResponseSpec(ErrorResponse, description="Invalid request"),
    **_ADMIN_ERRORS,
}


async def require_admin(
    connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler
) -> None:
    """The admin key, or a key with admin: true (a coroutine: Litestar would run a plain
    function guard in its thread pool)."""
    runtime: Runtime = connection.app.state.runtime
    runtime.keys.admin(connection.headers)


def _cache(state: State) -> SemanticCache:
    runtime: Runtime = state.runtime
    if runtime.cache is None:
        raise APIError(404, "this config has no cache", code="cache_off")
    if not runtime.ready:
        raise APIError(503, "not ready", type="server_error", code="not_ready", retry_after_s=5)
    return runtime.cache


def _unavailable(advice: str) -> APIError:
    return APIError(
        503,
        f"the cache store is unavailable: {advice}",
        type="server_error",
        code="store_unavailable",
        retry_after_s=1,
    )


@get("/admin/cache/stats", guards=[require_admin], responses=_ADMIN_ERRORS)
async def cache_stats(state: State) -> CacheStats:
    return await _cache(state).stats()


class Invalidate(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Exactly one of: a namespace selector ("tenant", "tenant:model" or a full key),
    an entry id, or ``all: true``."""

    namespace: str | None = None
    id: int | None = None
    all: bool = False


class Invalidated(msgspec.Struct, frozen=True):
    deleted: int


@post(
    "/admin/cache/invalidate",
    guards=[require_admin],
    status_code=200,
    responses=_ADMIN_BODY_ERRORS,
)
async def cache_invalidate(data: Invalidate, state: State) -> Invalidated:
    cache = _cache(state)
    chosen = sum((data.namespace is not None, data.id is not None, data.all))
    if chosen != 1:
        raise APIError(400, "give exactly one of namespace, id or all: true", param="body")
    try:
        if data.id is not None:
            return Invalidated(int(await cache.delete(data.id)))
        return Invalidated(await cache.invalidate(None if data.all else data.namespace))
    except StoreUnavailable as exc:
        raise _unavailable("retry the invalidation") from exc


@post(
    "/admin/cache/warmup",
    guards=[require_admin],
    status_code=200,
    request_max_body_size=MAX_WARMUP_BYTES,
    description='JSONL, one {"prompt", "response", ...} per line; ?tenant= picks the tenant.',
    responses=_ADMIN_BODY_ERRORS,
)
async def cache_warmup(
    state: State, request: Request[Any, Any, Any], tenant: str = "default"
) -> WarmupReport:
    if not valid_tenant(tenant):
        raise APIError(
            400,
            f"tenant {shown(tenant)} is not a tenant name: 1 to 64 letters, digits, '_', "
            "'-' or '.'",
            param="tenant",
        )
    cache = _cache(state)
    runtime: Runtime = state.runtime
    assert runtime.embedder is not None  # a cache always comes with the embedder
    try:
        return await warm(
            cache,
            await request.body(),
            tenant=tenant,
            embed_many=runtime.embedder.embed_many,
            embedding_model=runtime.embedder.fingerprint,
        )
    except StoreUnavailable as exc:
        raise _unavailable("warm-up stopped part-way; re-running it is safe") from exc


ADMIN_HANDLERS = [cache_stats, cache_invalidate, cache_warmup]
