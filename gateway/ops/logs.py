"""Logging: one request id per HTTP request, on its response and on its log records,
one access line per request, and the text or JSON line each record becomes.

The id lives in a ContextVar: each request runs in its own task, so a record logged
anywhere on the request's way (a stream's last chunk included) finds its id.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal

import msgspec
from litestar.enums import ScopeType
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from gateway.ops.ids import RandomHex
from gateway.pipeline.exchange import Settled

if TYPE_CHECKING:
    from gateway.config import ServerSettings

REQUEST_ID_HEADER = "x-request-id"
ACCESS_LOGGER = "satisfice.access"
# Looked up once: logging.getLogger takes logging's module lock on every call.
_access_log = logging.getLogger(ACCESS_LOGGER)
# Longest client-chosen id kept; a longer one is replaced, never cut.
MAX_REQUEST_ID = 128

request_id: ContextVar[str | None] = ContextVar("request_id", default=None)


class _Written:
    """Whether the request's access line is written: one object, shared by every
    context the request's work runs in (a task it starts has a copy of its context,
    which still points here)."""

    __slots__ = ("line",)

    def __init__(self) -> None:
        self.line = False


_access: ContextVar[_Written | None] = ContextVar("access", default=None)

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


new_request_id = RandomHex()


class RequestIds:
    """ASGI middleware: the request's id, from its `x-request-id` or made here, set
    for its task and sent back on whatever response it gets, errors included; and the
    access line of every request whose handler wrote none (a chat completion's says
    what was decided). uvicorn's own access log is off: a second line for every request
    cost as much as answering an exact hit from the cache."""

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
        started, status = time.monotonic(), 0

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [h for h in message.get("headers", ()) if h[0].lower() != header[0]]
                message = {**message, "headers": [*headers, header]}
            await send(message)

        written = _Written()
        token, access = request_id.set(rid), _access.set(written)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            if not written.line:
                http_access(scope["method"], _path(scope), status, time.monotonic() - started)
            _access.reset(access)
            request_id.reset(token)


# The longest request path an access line quotes.
MAX_LOGGED_PATH = 256


def _path(scope: Scope) -> str:
    """The path as the request line had it: not percent-decoded, so it cannot hold a
    line break to forge log lines with; cut short if long."""
    raw = scope.get("raw_path") or scope["path"].encode()
    path = raw.decode("latin-1")
    return path if len(path) <= MAX_LOGGED_PATH else path[:MAX_LOGGED_PATH] + "..."


class RequestIdFilter(logging.Filter):
    """Puts the current request's id (None outside a request) on every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id.get()
        return True


class _TextFormatter(logging.Formatter):
    """logging's own text format, its time made once per second, not once per line."""

    def __init__(self, fmt: str) -> None:
        super().__init__(fmt)
        self._second = -1
        self._stamp = ""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        second = int(record.created)
        if second != self._second:
            stamp = time.strftime(self.default_time_format, self.converter(second))
            self._second, self._stamp = second, stamp
        return f"{self._stamp},{int(record.msecs):03d}"  # logging's default_msec_format


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


class BatchedStderr(logging.StreamHandler):  # type: ignore[type-arg]
    """stderr, its access lines written a batch at a time: at a line per request, a
    system call per line cost a tenth of an exact hit. Access lines go out within
    ``interval_s`` (from a thread of the handler's own), once ``max_bytes`` wait, with
    any other line (which goes at once, after them), and at exit (logging's shutdown
    flushes every handler); a process killed outright loses at most that much."""

    def __init__(self, interval_s: float = 0.1, max_bytes: int = 64 * 1024) -> None:
        super().__init__(sys.stderr)
        self._pending: list[str] = []
        self._bytes = 0
        self._max_bytes = max_bytes
        flusher = threading.Thread(
            target=self._flush_every, args=(interval_s,), name="log-flush", daemon=True
        )
        flusher.start()

    def emit(self, record: logging.LogRecord) -> None:
        try:  # called with the handler's lock held (Handler.handle)
            line = self.format(record) + self.terminator
        except Exception:
            self.handleError(record)
            return
        self._pending.append(line)
        self._bytes += len(line)
        batched = record.name == ACCESS_LOGGER and record.levelno < logging.WARNING
        if not batched or self._bytes >= self._max_bytes:
            self.flush()

    def flush(self) -> None:
        with self.lock:  # type: ignore[union-attr]
            if self._pending:
                text, self._pending, self._bytes = "".join(self._pending), [], 0
                try:
                    self.stream.write(text)
                except Exception:  # stderr gone: nothing to tell it with
                    return
            super().flush()

    def _flush_every(self, interval_s: float) -> None:
        while True:
            time.sleep(interval_s)
            if self._pending:
                self.flush()


def handler(log_format: Literal["text", "json"]) -> logging.Handler:
    """A stderr handler in the given format, adding the request id to each record."""
    out = BatchedStderr()
    if log_format == "json":
        out.setFormatter(JSONFormatter())
    else:
        out.setFormatter(_TextFormatter(_TEXT_FORMAT))
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
    _access_log.setLevel(level if settings.access_log else logging.WARNING)
    # No format here shows a record's thread or process: not looked up for each one.
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True


def _line(message: str, args: tuple[object, ...], fields: dict[str, object]) -> None:
    """An INFO line on the access logger (its callers have asked whether it is on),
    made without looking up the caller's file and line (which logging would, at a
    third of the line's cost, for nothing here)."""
    record = _access_log.makeRecord(ACCESS_LOGGER, logging.INFO, "", 0, message, args, None)
    # The fields as ``extra`` would set them, less its check of each name against the
    # record's own (ours are none of them).
    record.__dict__.update(fields)
    _access_log.handle(record)


# What a log line or a span keeps of a name the client chose (an unknown model): enough
# to read, never a megabyte of log for one 404.
_NAME_CHARS = 128


def clipped(name: str) -> str:
    """``name`` as logs and traces keep it: whole when short, else its beginning and its
    length."""
    if len(name) <= _NAME_CHARS:
        return name
    return f"{name[:_NAME_CHARS]}... ({len(name)} characters)"


def http_access(method: str, path: str, status: int, seconds: float) -> None:
    """The access line of a request other than a chat completion (0: no response began)."""
    if not _access_log.isEnabledFor(logging.INFO):
        return  # server.access_log: false
    fields: dict[str, object] = {
        "method": method,
        "path": path,
        "status": status,
        "duration_ms": round(seconds * 1000, 3),
    }
    _line("%s %s %s in %.1f ms", (method, path, status, seconds * 1000), fields)


def access(settled: Settled) -> None:
    """The access line of one chat completion, once it has settled: what answered and
    how (the decision's view), never the text nor the key, only the key's name."""
    if not _access_log.isEnabledFor(logging.INFO):
        return  # server.access_log: false
    decision = settled.decision
    fields: dict[str, object] = msgspec.to_builtins(decision.view())  # without the Nones
    fields["model"] = clipped(decision.model)
    fields["status"] = settled.status
    fields["duration_ms"] = round(settled.seconds * 1000, 3)
    if settled.key is not None:
        fields["key"] = settled.key
    if settled.error is not None:
        fields["error"] = settled.error
    route, status, ms = decision.route, settled.status, settled.seconds * 1000
    _line("chat completion %s %s in %.1f ms", (route, status, ms), fields)
    written = _access.get()
    if written is not None:
        written.line = True
