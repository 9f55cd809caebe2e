"""Admin endpoints behind the admin key: the cache's stats, invalidation and warm-up;
the policy versions and the moves between them."""

from __future__ import annotations

from typing import Annotated, Any, Literal

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
from gateway.checks.policies import UnknownVersion
from gateway.checks.versions import Manifest, PolicyState
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


class PolicyMove(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """shadow or activate a version; revert to the version in force before the last
    activate; unshadow: stop the version in shadow."""

    move: Literal["shadow", "activate", "revert", "unshadow"]
    version: Annotated[str, msgspec.Meta(pattern=r"^[a-z0-9-]{1,64}$")] | None = None


class PolicyReport(msgspec.Struct, frozen=True, kw_only=True):
    state: PolicyState
    active: str  # in force on this replica now
    versions: list[Manifest]


_POLICY_ERRORS = {
    400: ResponseSpec(ErrorResponse, description="Invalid request"),
    **{code: spec for code, spec in _ADMIN_ERRORS.items() if code != 404},
    404: ResponseSpec(ErrorResponse, description="No such policy version"),
}


@get("/admin/policy", guards=[require_admin], responses=_POLICY_ERRORS)
async def policy_report(state: State) -> PolicyReport:
    """The policy versions, with how each compared with its parent on held-out checks,
    and which is in force and in shadow."""
    return await _policy_report(state.runtime)


async def _policy_report(runtime: Runtime) -> PolicyReport:
    policies = runtime.policies
    try:
        return PolicyReport(
            state=await policies.store.state(),
            active=policies.active,
            versions=await policies.store.manifests(),
        )
    except StoreUnavailable as exc:
        raise _policy_store_unavailable(exc) from exc


@post("/admin/policy", guards=[require_admin], status_code=200, responses=_POLICY_ERRORS)
async def policy_move(data: PolicyMove, state: State) -> PolicyReport:
    """Move a version into shadow or force, or back: hot, no restart; every replica
    sharing the store follows within a few seconds."""
    runtime: Runtime = state.runtime
    needs_version = data.move in ("shadow", "activate")
    if needs_version != (data.version is not None):
        raise APIError(
            400,
            f"{data.move} {'needs' if needs_version else 'takes no'} version",
            param="version",
        )
    if not runtime.ready:
        raise APIError(503, "not ready", type="server_error", code="not_ready", retry_after_s=5)
    try:
        await runtime.policies.move(data.move, data.version)
    except UnknownVersion as exc:
        raise APIError(404, str(exc), param="version", code="not_found") from exc
    except StoreUnavailable as exc:
        raise _policy_store_unavailable(exc) from exc
    return await _policy_report(runtime)


def _policy_store_unavailable(exc: StoreUnavailable) -> APIError:
    return APIError(
        503, f"the policy store is unavailable: {exc}", type="server_error",
        code="store_unavailable", retry_after_s=1,
    )  # fmt: skip


ADMIN_HANDLERS = [cache_stats, cache_invalidate, cache_warmup, policy_report, policy_move]
