"""Exact hits this process holds, answered before the web framework sees the request.

For an exact hit, Litestar's routing, guards, signature model and response objects
cost more than the rest of the request (bench/hit_path.py). A chat request whose
answer is at hand (an exact hit in the memory store, or in the Redis store's near
cache) is answered here. It comes in by the front door the handler uses
(gateway.api.front: the key, the Content-Type, then ``admit``: headers, body checks,
rate limit, policy), then the pipeline's step 1 (``Pipeline.exact_at_hand``), and it
settles as any request does. The body is rendered once per cached answer by the
renderer of the full path (``render.template``) and filled with each response's id.

Anything else, and any doubt, goes on to Litestar with its body handed back whole: a
request admitted here but not answered (a miss, a conversation's turn, a decision
trace asked for) with its exchange and admission, so that it is admitted and charged
once; a request the front door refuses, a body in several parts, a repeated header,
as it came (the full path words the error).
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Final

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
from gateway.api.front import HANDED, admit, charge, open_exchange
from gateway.api.headers import decision_headers
from gateway.api.wire import ChatCompletionRequest
from gateway.ops.keys import KeyRefused
from gateway.ops.metrics import CLIENT_CLOSED
from gateway.pipeline.exchange import Exchange
from gateway.pipeline.outcome import Answering
from gateway.pipeline.request import ChatRequest
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
    exchange: Exchange
    answering: Answering
    hit: Hit


class _Rendered(msgspec.Struct, frozen=True):
    body: render.Template
    headers: list[tuple[bytes, bytes]]


class ExpressHits:
    """ASGI middleware in front of Litestar's handler: see the module's docstring."""

    def __init__(self, app: ASGIApp, runtime: Runtime) -> None:
        self.app = app
        self._runtime = runtime
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
        started = time.monotonic()
        try:
            found = await self._hit(scope, body, started)
        except Exception:  # the full path answers it; this one must never fail it
            log.exception("express path failed; the request goes the full path")
            return False
        if found is None:
            return False
        runtime, exchange, answering = self._runtime, found.exchange, found.answering
        assert runtime.cache is not None
        runtime.cache.note_exact_hit()
        runtime.metrics.express_hits.inc()
        chat = found.chat
        rendered = await self._rendering(answering, found.hit, chat.stream, chat.include_usage)
        content = rendered.body.fill(render.completion_id(), int(time.time()))
        headers = [*rendered.headers, (b"content-length", str(len(content)).encode())]
        try:
            start = HTTPResponseStartEvent(type="http.response.start", status=200, headers=headers)
            await send(start)
            body_event = HTTPResponseBodyEvent(
                type="http.response.body", body=content, more_body=False
            )
            await send(body_event)
        except BaseException:
            exchange.end(CLIENT_CLOSED, "client_gone")
            raise
        exchange.end(200)
        return True

    async def _hit(self, scope: HTTPScope, body: bytes, started: float) -> _Found | None:
        """The exact hit at hand for this request, admitted; None: the full path decides
        (with the request's exchange and admission when it was admitted here)."""
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
        except (APIError, KeyRefused, msgspec.DecodeError):
            return None
        exchange = open_exchange(
            runtime, tenant=caller.tenant, model=data.model, key=caller.key, started=started
        )
        try:
            admitted = admit(runtime, config, caller, data, headers, exchange)
            if caller.limits is not None:
                await charge(runtime, config, caller, admitted.chat)
        except Exception:  # refused, and so not charged: the full path refuses it again
            return None
        at_hand = None
        if not admitted.trace:  # a template carries no decision trace
            at_hand = runtime.pipeline.exact_at_hand(admitted.chat, admitted.policy, exchange)
        if at_hand is None:
            scope.setdefault("state", {})[HANDED] = (exchange, admitted)
            return None
        answering, hit = at_hand
        return _Found(admitted.chat, exchange, answering, hit)

    async def _rendering(
        self, answering: Answering, hit: Hit, stream: bool, include_usage: bool
    ) -> _Rendered:
        """The response of a cached answer, rendered the first time it is served."""
        entry, decision = hit.entry, answering.decision
        key = (entry.id, entry.created_at, decision.model, stream, include_usage)
        rendered = self._rendered.get(key)
        if rendered is not None:
            self._rendered.move_to_end(key)
            await answering.events.aclose()
            return rendered
        body = await render.template(
            answering, decision.model, stream=stream, include_usage=include_usage
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
