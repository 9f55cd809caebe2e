"""Bad input: every case gets a 4xx in OpenAI's error shape naming the problem,
and the worker keeps serving afterwards."""

from __future__ import annotations

import httpx
import msgspec
import pytest

from gateway.api.errors import APIError
from gateway.ops.keys import KeyRefused
from gateway.ops.limits import LimitsUnavailable, RateLimited, TooManyTokens

USER = [{"role": "user", "content": "hi"}]

CASES = [
    # (name, raw body, status, param, words the message must contain)
    ("malformed json", b'{"model": "small", "messages": [', 400, None, "not valid JSON"),
    ("not an object", b"[1, 2, 3]", 400, None, "object"),
    ("missing messages", b'{"model": "small"}', 400, "messages", "messages"),
    ("missing model", b'{"messages": [{"role": "user", "content": "hi"}]}', 400, "model", "model"),
    ("empty messages", b'{"model": "small", "messages": []}', 400, "messages", "length >= 1"),
    (
        "wrong type",
        b'{"model": "small", "messages": [{"role": "user", "content": 5}]}',
        400,
        "messages[0].content",
        "got `int`",
    ),
    (
        "unknown role",
        b'{"model": "small", "messages": [{"role": "wizard", "content": "hi"}]}',
        400,
        "messages[0].role",
        "wizard",
    ),
    (
        "temperature out of range",
        b'{"model": "small", "messages": [{"role": "user", "content": "hi"}], "temperature": 9}',
        400,
        "temperature",
        "<= 2",
    ),
    (
        "image content",
        b'{"model": "small", "messages": [{"role": "user", "content": '
        b'[{"type": "image_url", "image_url": {"url": "x"}}]}]}',
        400,
        "messages[0].content[0]",
        "image_url",
    ),
    (
        "unknown model",
        b'{"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}',
        404,
        "model",
        "gpt-9",
    ),
    (
        "max_tokens beyond the cap",
        b'{"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 513}',
        400,
        "max_tokens",
        "512",
    ),
    (
        "n beyond the cap",
        b'{"model": "small", "messages": [{"role": "user", "content": "hi"}], "n": 5}',
        400,
        "n",
        "4",
    ),
    (
        "top_logprobs without logprobs",
        b'{"model": "small", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}',
        400,
        "top_logprobs",
        "logprobs",
    ),
    (
        "non-UTF-8",
        b'{"model": "small", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
        400,
        None,
        "UTF-8",
    ),
    ("body over the size limit", b'{"model": "' + b"a" * 70_000 + b'"}', 413, None, "65536"),
]


@pytest.mark.parametrize(
    ("body", "status", "param", "words"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_bad_request_is_explained(
    gateway_url: str, body: bytes, status: int, param: str | None, words: str
) -> None:
    response = httpx.post(
        f"{gateway_url}/v1/chat/completions",
        content=body,
        headers={"content-type": "application/json"},
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert words in error["message"]


def test_prompt_longer_than_context(gateway_url: str) -> None:
    messages = [{"role": "user", "content": "word " * 3000}]
    response = httpx.post(
        f"{gateway_url}/v1/chat/completions",
        json={"model": "small", "messages": messages, "max_tokens": 4},
        timeout=60,
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"


def test_unknown_route_and_method(gateway_url: str) -> None:
    missing = httpx.get(f"{gateway_url}/v1/nothing")
    assert missing.status_code == 404 and "error" in missing.json()
    wrong = httpx.get(f"{gateway_url}/v1/chat/completions")
    assert wrong.status_code == 405 and "error" in wrong.json()


def test_worker_survives_bad_input(gateway_url: str) -> None:
    for _, body, *_ in CASES:
        httpx.post(f"{gateway_url}/v1/chat/completions", content=body)
    response = httpx.post(
        f"{gateway_url}/v1/chat/completions",
        json={"model": "small", "messages": USER, "max_tokens": 2},
        timeout=60,
    )
    assert response.status_code == 200


# What the rate limits and the key table refuse with (ops/, below the HTTP layer), and
# the status, body and Retry-After each is answered with.
REFUSALS = [
    (TooManyTokens("m"), 400, "invalid_request_error", "max_tokens", "request_too_large", None),
    (RateLimited("m", 7), 429, "rate_limit_error", None, "rate_limit_exceeded", "7"),
    (LimitsUnavailable("m", 1.0), 503, "server_error", None, "rate_limits_unavailable", "1"),
    (KeyRefused("invalid_api_key", "m"), 401, "authentication_error", None, "invalid_api_key",
     None),
    (KeyRefused("invalid_admin_key", "m"), 401, "authentication_error", None,
     "invalid_admin_key", None),
    (KeyRefused("admin_closed", "m"), 403, "permission_error", None, "admin_closed", None),
    (KeyRefused("not_admin", "m"), 403, "permission_error", None, "not_admin", None),
]  # fmt: skip


@pytest.mark.parametrize(
    ("exc", "status", "kind", "param", "code", "retry_after"),
    REFUSALS,
    ids=[f"{type(r[0]).__name__}-{r[4]}" for r in REFUSALS],
)
def test_refusals_from_below_the_api_are_answered_in_its_shape(
    exc: Exception, status: int, kind: str, param: str | None, code: str, retry_after: str | None
) -> None:
    error = APIError.of(exc)
    assert error is not None
    response = error.response()
    assert response.status_code == status
    assert msgspec.json.decode(response.content) == {
        "error": {"message": "m", "type": kind, "param": param, "code": code}
    }
    assert response.headers.get("Retry-After") == retry_after
