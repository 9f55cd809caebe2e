"""The x-satisfice-* headers: what a client may ask for with them, and what the response
says about the decision. Both ways, here and nowhere else."""

from __future__ import annotations

import functools
from collections.abc import Mapping

import msgspec

from gateway.api.errors import APIError, shown
from gateway.pipeline.outcome import Decision, DecisionView
from gateway.pipeline.request_policy import CacheControl

DEADLINE_HEADER = "x-satisfice-deadline-ms"
CONVERSATION_HEADER = "x-satisfice-conversation"
CACHE_HEADER = "x-satisfice-cache"
TRACE_HEADER = "x-satisfice-trace"
SUPERSEDED_HEADER = "x-satisfice-superseded-ms"
FIRST_ANSWER_HEADER = "x-satisfice-first-answer"
REASONING_HEADER = "x-satisfice-reasoning"


class RequestHeaders(msgspec.Struct, frozen=True, kw_only=True):
    """What a request's headers ask of the gateway."""

    deadline_ms: int | None  # the client's own deadline; it only shortens the config's
    conversation: str | None  # the conversation a request continues, if it names one
    cache: CacheControl
    trace: bool  # the decision trace in a plain answer's body
    # A streamed hard question's provisional first answer: on, off, or None (the
    # tenant's or the config's choice).
    first_answer: bool | None
    reasoning: bool  # a plain answer's message carries the loop's reasoning


def read_headers(headers: Mapping[str, str]) -> RequestHeaders:
    """The request's x-satisfice-* and Cache-Control headers; 400 for a bad value."""
    return RequestHeaders(
        deadline_ms=_deadline_ms(headers),
        conversation=headers.get(CONVERSATION_HEADER) or None,
        cache=_cache_control(headers),
        trace=_yes(headers.get(TRACE_HEADER, "")),
        first_answer=_switch(headers, FIRST_ANSWER_HEADER),
        reasoning=_yes(headers.get(REASONING_HEADER, "")),
    )


def _yes(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes")


_SWITCH = {"true": True, "1": True, "yes": True, "on": True}
_SWITCH |= {"false": False, "0": False, "no": False, "off": False}


def _switch(headers: Mapping[str, str], name: str) -> bool | None:
    """A header that turns something on or off; absent: None; anything else is a 400."""
    raw = headers.get(name)
    if raw is None:
        return None
    value = _SWITCH.get(raw.strip().lower())
    if value is None:
        raise APIError(400, f"{name} is {shown(raw)}; send true or false", param=name)
    return value


# A day: any longer deadline is none at all, and a far larger number would not fit the
# clock's float.
MAX_DEADLINE_MS = 86_400_000


def _deadline_ms(headers: Mapping[str, str]) -> int | None:
    raw = headers.get(DEADLINE_HEADER)
    if raw is None:
        return None
    digits = raw.strip()
    value = int(digits) if digits.isascii() and digits.isdigit() and len(digits) <= 9 else 0
    if not 1 <= value <= MAX_DEADLINE_MS:
        raise APIError(
            400,
            f"{DEADLINE_HEADER} is {shown(raw)}; send a whole number of milliseconds from 1 "
            f"to {MAX_DEADLINE_MS}",
            param=DEADLINE_HEADER,
        )
    return value


def _cache_control(headers: Mapping[str, str]) -> CacheControl:
    """What the request's cache headers let the cache do (``_parsed_cache_control``)."""
    return _parsed_cache_control(
        headers.get(CACHE_HEADER, ""), headers.get("cache-control"), headers.get("pragma", "")
    )


# Clients send the same few header values again and again: each is parsed once (a
# value refused raises, and is not kept).
@functools.lru_cache(maxsize=256)
def _parsed_cache_control(ours: str, control: str | None, pragma: str) -> CacheControl:
    """``x-satisfice-cache: bypass`` (do not look up), ``no-store`` (do not keep the
    answer), or both; HTTP's own ``Cache-Control: no-cache`` / ``no-store`` mean the
    same, ``max-age=N`` serves only answers cached in the last N seconds (0: none, as
    ``no-cache``), and ``only-if-cached`` answers a miss with 504 instead of generating
    (RFC 9111, 5.2.1). Without Cache-Control, HTTP/1.0's ``Pragma: no-cache`` is
    ``no-cache`` (RFC 9111, 5.4)."""
    tokens = {t.strip().lower() for t in ours.split(",") if t.strip()}
    unknown = tokens - {"bypass", "no-store"}
    if unknown:
        raise APIError(
            400,
            f"{CACHE_HEADER} has {shown(', '.join(sorted(unknown)))}; use bypass, no-store or both",
            param=CACHE_HEADER,
        )
    if control is None:
        control = "no-cache" if "no-cache" in pragma.lower() else ""
    directives = dict(_directive(d) for d in control.split(",") if d.strip())
    max_age_s = _max_age(directives["max-age"]) if "max-age" in directives else None
    return CacheControl(
        lookup="bypass" not in tokens and "no-cache" not in directives and max_age_s != 0,
        store="no-store" not in tokens and "no-store" not in directives,
        only_cached="only-if-cached" in directives,
        max_age_s=max_age_s,
    )


def _directive(text: str) -> tuple[str, str]:
    name, _, value = text.partition("=")
    return name.strip().lower(), value.strip().strip('"')


def _max_age(value: str) -> int:
    """A max-age's seconds; one that is not a number serves nothing cached (RFC 9111,
    4.2.1: an invalid freshness lifetime means stale)."""
    return int(value) if value.isascii() and value.isdigit() and len(value) <= 10 else 0


# The view's fields that are no header of their own, and those whose header has another
# name; every other field ``f`` is the header x-satisfice-<f, with dashes>.
_NOT_HEADERS = frozenset({"tenant", "model", "route", "engine_ms"})
_HEADER_NAMES = {"similarity": "x-satisfice-cache-similarity"}
# Each view field's header, named once here rather than on every response.
_HEADERS = {
    name: _HEADER_NAMES.get(name) or "x-satisfice-" + name.replace("_", "-")
    for name in DecisionView.__struct_fields__
    if name not in _NOT_HEADERS
}


def decision_headers(decision: Decision) -> dict[str, str]:
    """What the response says about its decision (its view). Called when the response
    begins: for a stream, before the answer; for a plain answer, after it, when the
    loop's trace and the engine's time are known too."""
    view = msgspec.to_builtins(decision.view())
    headers = {
        _HEADERS[name]: _shown_value(name, value)
        for name, value in view.items()
        if name in _HEADERS
    }
    if decision.difficulty is not None:  # routed: the loop's fallback is the loop's route
        thought = decision.route in ("loop", "fallback")
        headers["x-satisfice-route"] = "loop" if thought else decision.route
    if "engine_ms" in view:
        # Server-Timing lets a client tell the engine's time from the gateway's own.
        headers["Server-Timing"] = f"engine;dur={view['engine_ms']:.3f}"
    return headers


def _shown_value(name: str, value: object) -> str:
    if isinstance(value, float):
        return f"{value:.1f}" if name == "superseded_ms" else f"{value:.4f}"
    return str(value)
