"""Exact hits this process holds, answered before the web framework sees the request.

For an exact hit, Litestar's routing, guards, signature model and response objects
cost more than the rest of the request (bench/hit_path.py). A chat request whose
answer is at hand (an exact hit in the memory store, or in the Redis store's near
cache) is answered here, by the steps the full path takes, in its order: the key and
the Content-Type, the same body checks (``chat_request``), headers and policy, the
pipeline's step 1 (``Pipeline.exact_at_hand``), the key's rate limit, and the same
metrics, access line and span. The body is rendered once per cached answer by the
renderer of the full path (``render.template``) and filled with each response's id.

Anything else, and any doubt, goes on to Litestar with its body handed back whole, and
is decided there as always: a miss, a body in several parts, a repeated header, a
request the checks refuse (the full path words the error), a conversation's turn, a
decision trace asked for, a key over its rate limit.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import TYPE_CHECKING, Final

import msgspec
from litestar.enums import ScopeType
from litestar.types import (
    ASGIApp,
    HTTPResponseBodyEvent,
    HTTPResponseStartEvent,
    HTTPScope,
    Receive,
    ReceiveMessage,
    Scope,
    Send,
)

from cache.semantic_cache import Hit
from gateway.api import render
from gateway.api.errors import APIError
from gateway.api.headers import decision_headers, read_headers
from gateway.api.routes import exchange_ended, user_conversation
from gateway.api.validate import chat_request
from gateway.api.wire import ChatCompletionRequest
from gateway.config import GatewayConfig
from gateway.ops.keys import Caller, KeyRefused
from gateway.ops.limits import LimitRefused
from gateway.pipeline.outcome import Decision, Outcome
from gateway.pipeline.policy import resolve
from gateway.pipeline.request import ChatRequest

if TYPE_CHECKING:
    from gateway.pipeline.pipeline import Pipeline
    from gateway.runtime import Runtime

log = logging.getLogger("satisfice.gateway")

CHAT_PATH: Final = "/v1/chat/completions"
# A body with more brackets than this may nest deeper than the full path's JSON
# parser allows from where it runs (it refuses such bodies with 400): decided there.
MAX_BRACKETS: Final = 256
# Cached answers whose rendered responses are kept, least recently used first out.
TEMPLATES: Final = 4096

_JSON = "application/json"
_decoder = msgspec.json.Decoder(ChatCompletionRequest)


class _Found(msgspec.Struct, frozen=True):
    """An exact hit at hand, and what serving it needs."""

    chat: ChatRequest
    caller: Caller
    config: GatewayConfig
    outcome: Outcome
    hit: Hit


class _Rendered(msgspec.Struct, frozen=True):
    body: render.Template
    headers: list[tuple[bytes, bytes]]


class ExpressHits:
    """ASGI middleware in front of Litestar's handler: see the module's docstring."""

    def __init__(self, app: ASGIApp, runtime: Runtime, pipeline: Pipeline) -> None:
        self.app = app
        self._runtime = runtime
        self._pipeline = pipeline
        self._rendered: collections.OrderedDict[tuple[object, ...], _Rendered] = (
            collections.OrderedDict()
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != ScopeType.HTTP or scope["path"] != CHAT_PATH:
            await self.app(scope, receive, send)
            return
        if scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        first = await receive()
        body = first.get("body", b"") if first["type"] == "http.request" else None
        complete = not first.get("more_body", False)
        if isinstance(body, bytes) and complete and await self._served(scope, body, send):
            return
        await self.app(scope, _handing_back(first, receive), send)

    async def _served(self, scope: HTTPScope, body: bytes, send: Send) -> bool:
        """Whether the request was answered here (else nothing has been sent)."""
        arrived = time.monotonic()
        runtime = self._runtime
        exchange = runtime.metrics.exchange()
        try:
            found = self._hit(scope, body, arrived)
        except Exception:  # the full path answers it; this one must never fail it
            log.exception("express path failed; the request goes the full path")
            return False
        if found is None:
            return False
        chat, caller, outcome = found.chat, found.caller, found.outcome
        if caller.limits is not None:
            cost = chat.prompt_tokens + chat.params.max_tokens
            try:
                await runtime.limiter.admit(
                    caller.key or "", caller.limits, cost, found.config.auth.rate_limit_outage
                )
            except LimitRefused:  # refused, and so not charged: the full path refuses it again
                return False
        assert runtime.cache is not None
        runtime.cache.note_exact_hit()
        runtime.metrics.express_hits.inc()
        rendered = await self._rendering(outcome, found.hit, chat.stream, chat.include_usage)
        content = rendered.body.fill(render.completion_id(), int(time.time()))
        headers = [*rendered.headers, (b"content-length", str(len(content)).encode())]
        await send(HTTPResponseStartEvent(type="http.response.start", status=200, headers=headers))
        await send(HTTPResponseBodyEvent(type="http.response.body", body=content, more_body=False))
        exchange_ended(runtime, caller, outcome.decision, exchange, 200)
        return True

    def _hit(self, scope: HTTPScope, body: bytes, arrived: float) -> _Found | None:
        runtime = self._runtime
        if not runtime.ready or runtime.cache is None:
            return None
        # Read together, with no await between them: a reload replaces both at once.
        config, keys = runtime.config, runtime.keys
        if not config.server.express_hits:
            return None
        headers = _headers(scope)
        if headers is None or len(body) > config.server.max_body_bytes:
            return None
        declared = headers.get("content-type", "")
        if declared.partition(";")[0].strip().lower() != _JSON:
            return None
        if body.count(b"[") + body.count(b"{") > MAX_BRACKETS:
            return None
        try:
            caller = keys.caller(headers)
            data = _decoder.decode(body)
            chat = chat_request(data, runtime.engines, runtime.router is not None, config.server)
            asked = read_headers(headers)
        except (APIError, KeyRefused, msgspec.DecodeError):
            return None
        if asked.trace or asked.conversation or user_conversation(data, config):
            return None
        policy = resolve(
            config,
            caller.tenant,
            arrived=arrived,
            asked_deadline_ms=asked.deadline_ms,
            control=asked.cache,
        )
        decision = Decision(tenant=caller.tenant, model=data.model)
        at_hand = self._pipeline.exact_at_hand(chat, policy, decision)
        if at_hand is None:
            return None
        outcome, hit = at_hand
        return _Found(chat, caller, config, outcome, hit)

    async def _rendering(
        self, outcome: Outcome, hit: Hit, stream: bool, include_usage: bool
    ) -> _Rendered:
        """The response of a cached answer, rendered the first time it is served."""
        entry, decision = hit.entry, outcome.decision
        key = (entry.id, entry.created_at, decision.model, stream, include_usage)
        rendered = self._rendered.get(key)
        if rendered is not None:
            self._rendered.move_to_end(key)
            await outcome.events.aclose()
            return rendered
        body = await render.template(
            outcome, decision.model, stream=stream, include_usage=include_usage
        )
        fields = decision_headers(decision)
        if stream:
            fields = {**fields, "Cache-Control": "no-cache"}
        media = b"text/event-stream; charset=utf-8" if stream else _JSON.encode()
        headers = [(b"content-type", media)]
        headers += [(name.lower().encode(), value.encode()) for name, value in fields.items()]
        rendered = self._rendered[key] = _Rendered(body, headers)
        if len(self._rendered) > TEMPLATES:
            self._rendered.popitem(last=False)
        return rendered


def _headers(scope: HTTPScope) -> dict[str, str] | None:
    """The request's headers by lower-case name; None when a name repeats (which of
    two the full path would read is its business)."""
    raw = list(scope["headers"])
    headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in raw}
    return headers if len(headers) == len(raw) else None


def _handing_back(first: ReceiveMessage, receive: Receive) -> Receive:
    """``receive`` as it was before ``first`` was taken from it."""
    pending = [first]

    async def handed_back() -> ReceiveMessage:
        if pending:
            return pending.pop()
        return await receive()

    return handed_back
