"""`POST /v1/feedback`: a product backend's verdict on an answer it was given.

A verdict (`right` or `wrong`) on any answer, named by the request id it came with (this
replica remembers its recent answers), is kept in the outcome store beside the shadow
checks (gateway.checks), marked as feedback: not a random sample. A semantic hit
reported wrong, by request id (with or without a verdict) or by the entry id and score
its response headers carried (`x-satisfice-cache-entry`, `x-satisfice-cache-score`),
which any replica takes, also stops the entry serving that neighbourhood. A tenant
reaches only its own answers and entries, and a report only ever tightens: nothing a
caller sends can make the cache serve more.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from litestar import Request, post
from litestar.datastructures import State
from litestar.openapi.datastructures import ResponseSpec

from cache.store import StoreUnavailable
from gateway.api.errors import APIError, shown
from gateway.api.guards import require_json, require_key
from gateway.api.wire import ErrorResponse
from gateway.checks.recent import verdict_record
from gateway.config import GatewayConfig
from gateway.ops.keys import Caller
from gateway.runtime import Runtime


class FeedbackRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A verdict on the answer to ``request_id``; or, without a verdict, a semantic hit
    that was wrong: by ``request_id``, or by ``entry_id`` (with the ``score`` it was
    served at, if known; without one its semantic hits stop)."""

    request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=200)] | None = None
    # Decimal text, as the header carries it: JSON numbers lose integers above 2**53.
    entry_id: Annotated[str, msgspec.Meta(pattern=r"^[0-9]{1,19}$")] | None = None
    score: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    verdict: Literal["right", "wrong"] | None = None


class FeedbackResult(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    # The verdict's record in the outcome store; absent for a report without a verdict.
    record_id: str | None = None
    # The semantic hit's entry, when the report concerned one.
    entry_id: str | None = None
    # The score a semantic hit on the entry now needs (above 1: none serves).
    hit_floor: float | None = None
    # Whether this report raised it; false when an earlier one had raised it as far (a
    # replay): such a report changes nothing and is not counted again.
    raised: bool | None = None


@post(
    "/v1/feedback",
    status_code=200,
    guards=[require_key, require_json],
    description="A verdict (right or wrong) on any answer, by the request id it came with, "
    "kept in the outcome store; a semantic cache hit reported wrong also stops its entry "
    "serving queries the cache trusts no more than that one.",
    responses={
        400: ResponseSpec(ErrorResponse, description="Invalid request"),
        401: ResponseSpec(ErrorResponse, description="No API key, or an unknown one"),
        429: ResponseSpec(ErrorResponse, description="The key's rate limit; see Retry-After"),
        404: ResponseSpec(
            ErrorResponse,
            description="No such answer, semantic hit or entry of this tenant, or no cache",
        ),
        503: ResponseSpec(
            ErrorResponse, description="Not ready, or the cache or outcome store unavailable"
        ),
    },
)
async def feedback(
    data: FeedbackRequest, state: State, request: Request[Any, Any, Any]
) -> FeedbackResult:
    runtime: Runtime = state.runtime
    caller: Caller = request.state.caller
    if not runtime.ready:  # the cache's indexes are not rebuilt yet: no entry is known
        raise APIError(503, "not ready", type="server_error", code="not_ready", retry_after_s=5)
    if (data.request_id is None) == (data.entry_id is None):
        raise APIError(
            400, "name the answer by request_id or by entry_id (a semantic hit's), one of them"
        )
    if data.verdict is not None and data.request_id is None:
        raise APIError(400, "a verdict names its answer by request_id", param="verdict")
    if caller.limits is not None:  # a report writes to a store: one request, no tokens
        config: GatewayConfig = request.state.config
        await runtime.limiter.admit(
            caller.key or "", caller.limits, 0, config.auth.rate_limit_outage
        )
    record_id = None
    if data.verdict is not None:
        assert data.request_id is not None
        if data.score is not None:
            raise APIError(400, "score goes with entry_id: a verdict names its answer by "
                           "request_id", param="score")  # fmt: skip
        record_id = await _record_verdict(runtime, caller.tenant, data.request_id, data.verdict)
        # A semantic hit judged wrong is also a false hit its entry must hear of.
        if (
            data.verdict == "right"
            or runtime.recent_hits.get(caller.tenant, data.request_id) is None
        ):
            return FeedbackResult(record_id=record_id)
    return await _false_hit(runtime, caller.tenant, data, record_id)


async def _record_verdict(runtime: Runtime, tenant: str, request_id: str, verdict: str) -> str:
    """The verdict, kept in the outcome store; its record's id."""
    answered = runtime.recent_answers.get(tenant, request_id)
    if answered is None:
        raise APIError(
            404,
            f"no answer of tenant {tenant!r} with request id {shown(request_id)} among its "
            f"last {runtime.recent_answers.capacity} on this replica",
            param="request_id",
            code="not_found",
        )
    record = verdict_record(tenant, request_id, verdict, answered)
    try:
        await runtime.outcomes.add(record)
    except StoreUnavailable as exc:
        raise APIError(
            503, "the outcome store is unavailable; send the verdict again later",
            type="server_error", code="store_unavailable", retry_after_s=5,
        ) from exc  # fmt: skip
    return record.id


async def _false_hit(
    runtime: Runtime, tenant: str, data: FeedbackRequest, record_id: str | None
) -> FeedbackResult:
    """A semantic hit reported wrong: its entry stops serving that neighbourhood."""
    cache = runtime.cache
    if cache is None:
        raise APIError(404, "this config has no cache", code="cache_off")
    entry_id, score = _named(data, runtime, tenant)
    try:
        updated = await cache.report_false_hit(tenant, entry_id, score)
    except StoreUnavailable as exc:
        raise APIError(
            503, "the cache store is unavailable; report it again later",
            type="server_error", code="store_unavailable", retry_after_s=5,
        ) from exc  # fmt: skip
    if updated is None:
        raise APIError(
            404, f"tenant {tenant!r} has no cache entry {entry_id} (expired, evicted "
            "or invalidated since, or another tenant's)", param="entry_id", code="not_found",
        )  # fmt: skip
    if updated.raised:
        runtime.metrics.false_hit_reported(tenant)
    return FeedbackResult(
        record_id=record_id,
        entry_id=str(entry_id),
        hit_floor=updated.floor,
        raised=updated.raised,
    )


def _named(data: FeedbackRequest, runtime: Runtime, tenant: str) -> tuple[int, float | None]:
    """The entry and score the report is about."""
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
