"""`POST /v1/feedback`: a product backend reports that a semantic hit it was served
was wrong, and the entry stops serving that neighbourhood.

The hit is named by the request id that got it (this replica remembers its recent
semantic hits) or by the entry id and score its response headers carried
(`x-satisfice-cache-entry`, `x-satisfice-cache-score`), which any replica takes. A
tenant reaches only its own entries, and a report only ever tightens: nothing a caller
sends can make the cache serve more.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from litestar import Request, post
from litestar.datastructures import State
from litestar.openapi.datastructures import ResponseSpec

from cache.store import StoreUnavailable
from gateway.api.errors import APIError, shown
from gateway.api.guards import require_json, require_key
from gateway.api.wire import ErrorResponse
from gateway.config import GatewayConfig
from gateway.ops.keys import Caller
from gateway.runtime import Runtime


class FeedbackRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A semantic hit that was wrong: by ``request_id``, or by ``entry_id`` (with the
    ``score`` it was served at, if known; without one its semantic hits stop)."""

    request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=200)] | None = None
    # Decimal text, as the header carries it: JSON numbers lose integers above 2**53.
    entry_id: Annotated[str, msgspec.Meta(pattern=r"^[0-9]{1,19}$")] | None = None
    score: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None


class FeedbackResult(msgspec.Struct, frozen=True, kw_only=True):
    entry_id: str
    # The score a semantic hit on the entry now needs (above 1: none serves).
    hit_floor: float
    # Whether this report raised it; false when an earlier one had raised it as far (a
    # replay): such a report changes nothing and is not counted again.
    raised: bool


@post(
    "/v1/feedback",
    status_code=200,
    guards=[require_key, require_json],
    description="Report a semantic cache hit that was wrong; the entry stops serving "
    "queries the cache trusts no more than that one.",
    responses={
        400: ResponseSpec(ErrorResponse, description="Invalid request"),
        401: ResponseSpec(ErrorResponse, description="No API key, or an unknown one"),
        429: ResponseSpec(ErrorResponse, description="The key's rate limit; see Retry-After"),
        404: ResponseSpec(
            ErrorResponse, description="No such semantic hit or entry of this tenant, or no cache"
        ),
        503: ResponseSpec(ErrorResponse, description="Not ready, or the cache store unavailable"),
    },
)
async def feedback(
    data: FeedbackRequest, state: State, request: Request[Any, Any, Any]
) -> FeedbackResult:
    runtime: Runtime = state.runtime
    caller: Caller = request.state.caller
    cache = runtime.cache
    if cache is None:
        raise APIError(404, "this config has no cache", code="cache_off")
    if not runtime.ready:  # the cache's indexes are not rebuilt yet: no entry is known
        raise APIError(503, "not ready", type="server_error", code="not_ready", retry_after_s=5)
    if caller.limits is not None:  # a report writes to the store: one request, no tokens
        config: GatewayConfig = request.state.config
        await runtime.limiter.admit(
            caller.key or "", caller.limits, 0, config.auth.rate_limit_outage
        )
    entry_id, score = _named(data, runtime, caller.tenant)
    try:
        updated = await cache.report_false_hit(caller.tenant, entry_id, score)
    except StoreUnavailable as exc:
        raise APIError(
            503, "the cache store is unavailable; report it again later",
            type="server_error", code="store_unavailable", retry_after_s=5,
        ) from exc  # fmt: skip
    if updated is None:
        raise APIError(
            404, f"tenant {caller.tenant!r} has no cache entry {entry_id} (expired, evicted "
            "or invalidated since, or another tenant's)", param="entry_id", code="not_found",
        )  # fmt: skip
    if updated.raised:
        runtime.metrics.false_hit_reported(caller.tenant)
    return FeedbackResult(entry_id=str(entry_id), hit_floor=updated.floor, raised=updated.raised)


def _named(data: FeedbackRequest, runtime: Runtime, tenant: str) -> tuple[int, float | None]:
    """The entry and score the report is about."""
    if (data.request_id is None) == (data.entry_id is None):
        raise APIError(400, "name the hit by request_id or by entry_id (one of them)")
    if data.entry_id is not None:
        return int(data.entry_id), data.score
    assert data.request_id is not None
    if data.score is not None:
        raise APIError(
            400, "score goes with entry_id: a request id's hit has its own", param="score"
        )
    hit = runtime.recent_hits.get(tenant, data.request_id)
    if hit is None:
        raise APIError(
            404,
            f"no semantic hit of tenant {tenant!r} with request id {shown(data.request_id)} "
            f"among its last {runtime.recent_hits.capacity} on this replica; name it by the "
            "x-satisfice-cache-entry and x-satisfice-cache-score headers it came with",
            param="request_id",
            code="not_found",
        )
    return hit
