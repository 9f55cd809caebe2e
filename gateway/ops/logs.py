"""Logging: one request id per HTTP request, on its response and on its log records,
and the text or JSON line each record becomes.

The id lives in a ContextVar: each request runs in its own task, so a record logged
anywhere on the request's way (a stream's last chunk included) finds its id.
"""

from __future__ import annotations

import logging
import sys
import uuid
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal

import msgspec
from litestar.enums import ScopeType
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from gateway.pipeline.outcome import NO_ROUTE, Decision

if TYPE_CHECKING:
    from gateway.config import ServerSettings

REQUEST_ID_HEADER = "x-request-id"
ACCESS_LOGGER = "satisfice.access"
# Longest client-chosen id kept; a longer one is replaced, never cut.
MAX_REQUEST_ID = 128

request_id: ContextVar[str | None] = ContextVar("request_id", default=None)

# What every LogRecord has; anything else on a record came from `extra={...}`
# (uvicorn's color_message repeats the message with terminal colours).
_STANDARD = frozenset(logging.makeLogRecord({}).__dict__) | {
    "message",
    "asctime",
    "color_message",
}
_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


def valid_request_id(value: str | None) -> bool:
    """A client's id is kept when it is 1-128 printable ASCII characters: control
    characters or newlines in it could forge log lines or headers."""
    return (
        value is not None
        and 0 < len(value) <= MAX_REQUEST_ID
        and all(" " <= c <= "~" for c in value)
    )


def new_request_id() -> str:
    return uuid.uuid4().hex


class RequestIds:
    """ASGI middleware: the request's id, from its `x-request-id` or made here, set
    for its task and sent back on whatever response it gets, errors included."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != ScopeType.HTTP:
            await self.app(scope, receive, send)
            return
        given = next(
            (v.decode("latin-1") for k, v in scope["headers"] if k.lower() == b"x-request-id"),
            None,
        )
        rid = given if given is not None and valid_request_id(given) else new_request_id()
        header = (REQUEST_ID_HEADER.encode(), rid.encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", ()) if h[0].lower() != header[0]]
                message = {**message, "headers": [*headers, header]}
            await send(message)

        token = request_id.set(rid)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            request_id.reset(token)


class RequestIdFilter(logging.Filter):
    """Puts the current request's id (None outside a request) on every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id.get()
        return True


class JSONFormatter(logging.Formatter):
    """One JSON object per record: time (ISO 8601 UTC), level, logger, message, the
    request id, the exception if any, and the record's `extra` fields."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        rid = getattr(record, "request_id", None)
        if rid is not None:
            line["request_id"] = rid
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exception"] = record.exc_text
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        for key, value in record.__dict__.items():
            if key not in _STANDARD and key not in line and key != "request_id":
                line[key] = value
        # A value JSON cannot hold (uvicorn's extras, say) is written as its str().
        return msgspec.json.encode(line, enc_hook=str).decode()


def handler(log_format: Literal["text", "json"]) -> logging.Handler:
    """A stderr handler in the given format, adding the request id to each record."""
    out = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        out.setFormatter(JSONFormatter())
    else:
        out.setFormatter(logging.Formatter(_TEXT_FORMAT))
    out.addFilter(RequestIdFilter())
    return out


def configure_logging(settings: ServerSettings, level: int = logging.INFO) -> None:
    """Every record, uvicorn's included, to one stderr handler in ``settings.log_format``.

    uvicorn must then be run with ``log_config=None`` so it leaves this be; its own
    loggers lose their handlers here and reach the root's."""
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(handler(settings.log_format))
    root.setLevel(level)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True


def access(decision: Decision, status: int, seconds: float, key: str | None) -> None:
    """The access line of one chat completion: what answered and how, never the text.
    ``key`` is the API key's name in the config, never the key."""
    fields: dict[str, object] = {
        "route": decision.route,
        "status": status,
        "duration_ms": round(seconds * 1000, 3),
        "model": decision.model,
        "tenant": decision.tenant,
    }
    if key is not None:
        fields["key"] = key
    if decision.engine is not None:
        fields["engine"] = decision.engine
    if decision.route != NO_ROUTE:
        fields["cache"] = decision.cache
    if decision.cache_stage is not None:
        fields["cache_stage"] = decision.cache_stage
    if decision.cache_entry is not None:
        fields["cache_entry"] = str(decision.cache_entry)
    if decision.cache_score is not None:
        fields["cache_score"] = round(decision.cache_score, 4)
    if decision.loop is not None:
        fields["stop"] = decision.loop.stop
        fields["fallback"] = decision.loop.fallback
    logging.getLogger(ACCESS_LOGGER).info(
        "chat completion %s %s in %.1f ms", decision.route, status, seconds * 1000, extra=fields
    )
