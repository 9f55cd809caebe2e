"""Every failure leaves the API in its own API's error shape (OpenAI's, or Anthropic's on
/v1/messages), with a status a client can act on."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping
from typing import Any, Literal

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException, InternalServerException, ValidationException
from litestar.status_codes import HTTP_500_INTERNAL_SERVER_ERROR

from engines.base import (
    CannotFollow,
    EngineError,
    EngineOverloaded,
    EngineUnavailable,
    PromptTooLong,
)
from gateway.api.timeouts import TIMED_OUT
from gateway.api.wire import ErrorBody, ErrorResponse
from gateway.ops import logs
from gateway.ops.keys import KeyRefusal, KeyRefused
from gateway.ops.limits import LimitRefused, LimitsUnavailable, RateLimited, TooManyTokens
from gateway.ops.metrics import CLIENT_CLOSED
from gateway.pipeline.exchange import Exchange
from gateway.pipeline.outcome import RefusalKind, Refused

log = logging.getLogger("satisfice.gateway")


# The request state's key for a chat request's exchange, once it is open: a chat
# request that ends in an error without one gets one here, so that it settles too.
EXCHANGE = "satisfice_exchange"


class ClientGone(Exception):
    """The client left before its answer was ready; the work for it has stopped."""


def shown(value: str, limit: int = 64) -> str:
    """``value`` as an error message quotes it: whole when short, else its beginning and
    its length (an error must not echo a megabyte back, nor fill a log with it)."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value)} characters)"


def _clipped(message: str, limit: int = 400) -> str:
    """A parser's message, which may quote the input, kept to its head and tail (the tail
    says where)."""
    if len(message) <= limit:
        return message
    half = limit // 2
    return f"{message[:half]} ... {message[-half:]}"


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = ErrorBody(message=message, type=type, param=param, code=code)
        self.retry_after_s = retry_after_s

    @classmethod
    def from_engine(cls, exc: EngineError) -> APIError:
        if isinstance(exc, EngineOverloaded):
            return cls(
                429,
                exc.message,
                type="rate_limit_error",
                code="engine_overloaded",
                retry_after_s=exc.retry_after_s,
            )
        if isinstance(exc, CannotFollow):
            return cls(400, exc.message, param=exc.param, code="unsupported")
        if isinstance(exc, PromptTooLong):
            return cls(400, exc.message, param="messages", code="context_length_exceeded")
        if isinstance(exc, EngineUnavailable):
            return cls(
                503,
                f"model {exc.engine!r} is unavailable: {exc.message}",
                type="server_error",
                code="engine_unavailable",
                retry_after_s=1.0,
            )
        return cls(
            502,
            f"model {exc.engine!r} failed: {exc.message}",
            type="server_error",
            code="engine_error",
        )

    @classmethod
    def from_refusal(cls, exc: Refused) -> APIError:
        status, type_ = _REFUSALS[exc.kind]
        return cls(
            status, exc.message, type=type_, param=exc.param, code=exc.kind,
            retry_after_s=exc.retry_after_s,
        )  # fmt: skip

    @classmethod
    def from_key(cls, exc: KeyRefused) -> APIError:
        status, type_ = _KEY_REFUSALS[exc.kind]
        return cls(status, exc.message, type=type_, code=exc.kind)

    @classmethod
    def from_limit(cls, exc: LimitRefused) -> APIError:
        if isinstance(exc, TooManyTokens):
            return cls(400, exc.message, param="max_tokens", code="request_too_large")
        if isinstance(exc, RateLimited):
            return cls(
                429,
                exc.message,
                type="rate_limit_error",
                code="rate_limit_exceeded",
                retry_after_s=exc.retry_after_s,
            )
        if isinstance(exc, LimitsUnavailable):
            return cls(
                503,
                exc.message,
                type="server_error",
                code="rate_limits_unavailable",
                retry_after_s=exc.retry_after_s,
            )
        raise TypeError(f"no answer for the limits' refusal {type(exc).__name__}")

    @classmethod
    def of(cls, exc: BaseException) -> APIError | None:
        """What a client hears for ``exc``, when it is one the API answers on purpose."""
        if isinstance(exc, APIError):
            return exc
        if isinstance(exc, Refused):
            return cls.from_refusal(exc)
        if isinstance(exc, EngineError):
            return cls.from_engine(exc)
        if isinstance(exc, KeyRefused):
            return cls.from_key(exc)
        if isinstance(exc, LimitRefused):
            return cls.from_limit(exc)
        return None

    def renamed(self, fields: Mapping[str, str]) -> APIError:
        """This error naming its field as ``fields`` calls it (an API translated onto
        chat completions names its own fields), or itself when it names none of them.
        A name's ``[]`` stands for any index, which the new name keeps in order
        (``tools[].function.parameters`` -> ``tools[].input_schema``)."""
        old = self.body.param
        if old is None:
            return self
        new = fields.get(old)
        if new is None:
            indices = _INDEX.findall(old)
            pattern = fields.get(_INDEX.sub("[]", old))
            if pattern is None or pattern.count("[]") != len(indices):
                return self
            head, *tails = pattern.split("[]")
            new = head + "".join(f"[{i}]{tail}" for i, tail in zip(indices, tails, strict=True))
        message = self.body.message
        if message.startswith(old):
            message = new + message[len(old) :]
        body = self.body
        return APIError(
            self.status, message, type=body.type, param=new, code=body.code,
            retry_after_s=self.retry_after_s,
        )  # fmt: skip

    @property
    def reason(self) -> str:
        """The error in a word, as logs and settled requests name it: its code, else
        its type."""
        return self.body.code or self.body.type

    def response(self, shape: ErrorShape = "openai") -> Response[bytes]:
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        return Response(
            self.encoded(shape),
            status_code=self.status,
            media_type="application/json",
            headers=headers,
        )

    def encoded(self, shape: ErrorShape = "openai") -> bytes:
        """The error's body in ``shape``: OpenAI's ``{"error": {message, type, param,
        code}}``, or Anthropic's ``{"type": "error", "error": {type, message}}``, whose
        message names the field at fault, as Anthropic's does."""
        if shape == "openai":
            return msgspec.json.encode(ErrorResponse(self.body))
        message = self.body.message
        if self.body.param and self.body.param not in message:
            message = f"{self.body.param}: {message}"
        kind = _ANTHROPIC_TYPES.get(
            self.status, "api_error" if self.status >= 500 else "invalid_request_error"
        )
        return msgspec.json.encode(AnthropicError(AnthropicErrorBody(kind, message)))


_INDEX = re.compile(r"\[(\d+)\]")

# The error shape of each API: OpenAI's for chat completions and responses.
ErrorShape = Literal["openai", "anthropic"]
MESSAGES_PATH = "/v1/messages"
CHAT_PATHS = frozenset({"/v1/chat/completions", "/v1/responses", MESSAGES_PATH})


def shape_of(path: str) -> ErrorShape:
    """The error shape a request to ``path`` is answered in."""
    return "anthropic" if path == MESSAGES_PATH else "openai"


class AnthropicErrorBody(msgspec.Struct, frozen=True):
    type: str
    message: str


class AnthropicError(msgspec.Struct, frozen=True, tag_field="type", tag="error"):
    error: AnthropicErrorBody


# Anthropic's error type for each status it documents.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


# The status and error type of each reason the pipeline refuses a request.
_REFUSALS: dict[RefusalKind, tuple[int, str]] = {
    "model_not_found": (404, "invalid_request_error"),
    "cache_miss": (504, "server_error"),
    "embedder_overloaded": (429, "rate_limit_error"),
    "superseded": (409, "invalid_request_error"),
    "deadline_exceeded": (504, "server_error"),
    "unsupported": (400, "invalid_request_error"),
}

# The status and error type of each reason a key is refused; the reason is the code.
_KEY_REFUSALS: dict[KeyRefusal, tuple[int, str]] = {
    "invalid_api_key": (401, "authentication_error"),
    "invalid_admin_key": (401, "authentication_error"),
    "admin_closed": (403, "permission_error"),
    "not_admin": (403, "permission_error"),
}

# Litestar's word for a body whose client left before it was whole.
_LEFT_MID_BODY = "client disconnected prematurely"
_MISSING = re.compile(r"missing required field `([^`]+)`")


def _validation_message(exc: ValidationException) -> tuple[str, str | None]:
    """Litestar reports msgspec's decode errors in ``extra``; keep msgspec's wording
    and name the offending field as OpenAI's ``param`` does."""
    details = exc.extra if isinstance(exc.extra, list) else []
    for detail in details:
        if isinstance(detail, dict) and "message" in detail:
            message = str(detail["message"])
            # Litestar calls the body itself "data"; the client never wrote that name.
            key = detail.get("key") if detail.get("key") != "data" else None
            if missing := _MISSING.search(message):
                key = f"{key}.{missing.group(1)}" if key else missing.group(1)
                return _clipped(message), key
            return _clipped(f"{message} (at {key})" if key else message), key
    return _clipped(str(exc.detail)), None


def _answered(
    request: Request[Any, Any, Any], exc: BaseException, response: Response[bytes]
) -> Response[bytes]:
    """The error's response; a chat request's exchange ended with it (one refused by its
    key, its headers or its body before the handler ran has one opened to end, so that
    it settles too); and the error let go of its traceback: that holds every frame of
    the request (its body, its embedding, the ASGI transport) in a reference cycle with
    the frame that raised it, which only Python's rare full collection frees. Under
    overload, 429s kept hundreds of MiB alive between collections."""
    exc.__traceback__ = None
    if request.scope["path"] in CHAT_PATHS and request.method == "POST":
        exchange: Exchange | None = request.state.get(EXCHANGE)
        if exchange is None:
            caller = request.state.get("caller")
            exchange = Exchange(
                request.app.state.runtime.settlement,
                tenant="" if caller is None else caller.tenant,
                model="",  # the body was not read as a request
                key=None if caller is None else caller.key,
                request_id=logs.request_id.get(),
                policy=request.app.state.runtime.policy_version,
            )
        error = APIError.of(exc)
        status = response.status_code or 500
        exchange.end(status, _reason(exc) if error is None else error.reason)
    return response


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ClientGone):
        return "client_gone"
    if isinstance(exc, HTTPException):
        return "invalid_request" if exc.status_code < 500 else "http_error"
    return "internal_error"


def _shaped(
    request: Request[Any, Any, Any], exc: BaseException, error: APIError
) -> Response[bytes]:
    return _answered(request, exc, error.response(shape_of(request.scope["path"])))


def _api_error(request: Request[Any, Any, Any], exc: APIError) -> Response[bytes]:
    return _shaped(request, exc, exc)


def _engine_error(request: Request[Any, Any, Any], exc: EngineError) -> Response[bytes]:
    return _shaped(request, exc, APIError.from_engine(exc))


def _refused(request: Request[Any, Any, Any], exc: Refused) -> Response[bytes]:
    return _shaped(request, exc, APIError.from_refusal(exc))


def _key_refused(request: Request[Any, Any, Any], exc: KeyRefused) -> Response[bytes]:
    return _shaped(request, exc, APIError.from_key(exc))


def _limit_refused(request: Request[Any, Any, Any], exc: LimitRefused) -> Response[bytes]:
    return _shaped(request, exc, APIError.from_limit(exc))


def _http_error(request: Request[Any, Any, Any], exc: HTTPException) -> Response[bytes]:
    if isinstance(exc, ValidationException):
        message, param = _validation_message(exc)
        refusal = APIError(400, f"invalid request body: {message}", param=param)
        return _shaped(request, exc, refusal)
    if isinstance(exc, InternalServerException) and exc.detail == _LEFT_MID_BODY:
        # The body never came whole: the client left before it had sent it, or it came
        # too slowly and the server closed the connection with a 408 of its own.
        timed_out = TIMED_OUT in (request.scope.get("extensions") or {})
        status = 408 if timed_out else CLIENT_CLOSED
        return _answered(request, exc, Response(b"", status_code=status))
    detail = str(exc.detail)
    if exc.status_code == 400:
        # Litestar's other 400s come from msgspec failing to parse the bytes at all.
        detail = f"request body is not valid JSON: {detail}"
    elif exc.status_code == 413:
        limit = request.app.state.runtime.config.server.max_body_bytes
        detail = f"request body is larger than the limit of {limit} bytes"
    kinds = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
    error = APIError(
        exc.status_code,
        detail,
        type="invalid_request_error" if exc.status_code < 500 else "server_error",
        code=kinds.get(exc.status_code),
    )
    return _shaped(request, exc, error)


def _client_gone(request: Request[Any, Any, Any], exc: ClientGone) -> Response[bytes]:
    # Nobody reads it; nginx's 499 says why in any log that sees it.
    return _answered(request, exc, Response(b"", status_code=CLIENT_CLOSED))


def _unexpected(request: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    error = APIError(HTTP_500_INTERNAL_SERVER_ERROR, "internal error", type="server_error")
    return _shaped(request, exc, error)


class JSONRequest(Request[Any, Any, Any]):
    """Litestar's request, whose JSON body nested deeper than the parser's recursion
    limit is a 400 naming the problem rather than a RecursionError (a 500, and a
    traceback in the log for every such body)."""

    async def json(self) -> Any:
        try:
            return await super().json()
        except RecursionError:
            raise APIError(
                400,
                "request body is not valid JSON here: it nests arrays or objects too deeply",
                code="too_deeply_nested",
            ) from None


EXCEPTION_HANDLERS = {
    APIError: _api_error,
    EngineError: _engine_error,
    Refused: _refused,
    KeyRefused: _key_refused,
    LimitRefused: _limit_refused,
    ClientGone: _client_gone,
    HTTPException: _http_error,
    Exception: _unexpected,
}
