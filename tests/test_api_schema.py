"""The OpenAPI schema a real gateway serves says what it answers: errors in OpenAI's
shape, and the same bounds on a request that the gateway enforces."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

ERROR_REF = "#/components/schemas/ErrorResponse"


@pytest.fixture(scope="module")
def openapi(gateway_url: str) -> dict[str, Any]:
    response = httpx.get(f"{gateway_url}/openapi/openapi.json")
    assert response.status_code == 200
    schema: dict[str, Any] = response.json()
    return schema


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("post", "/v1/chat/completions"),
        pytest.param("post", "/v1/route"),
        ("get", "/admin/cache/stats"),
        ("post", "/admin/cache/invalidate"),
        ("post", "/admin/cache/warmup"),
    ],
)
def test_errors_are_documented_in_openai_shape(
    openapi: dict[str, Any], method: str, path: str
) -> None:
    responses = openapi["paths"][path][method]["responses"]
    errors = {status: spec for status, spec in responses.items() if int(status) >= 400}
    assert errors
    for status, spec in errors.items():
        schema = spec["content"]["application/json"]["schema"]
        assert schema == {"$ref": ERROR_REF}, f"{method.upper()} {path} {status}: {schema}"


def test_admin_endpoints_document_what_they_answer(openapi: dict[str, Any]) -> None:
    # Every admin endpoint may find the gateway not ready or its store down (503); those
    # with a body refuse a bad one with 400.
    for path, method, statuses in [
        ("/admin/cache/stats", "get", {"401", "403", "404", "503"}),
        ("/admin/cache/invalidate", "post", {"400", "401", "403", "404", "503"}),
        ("/admin/cache/warmup", "post", {"400", "401", "403", "404", "503"}),
    ]:
        documented = set(openapi["paths"][path][method]["responses"]) - {"200"}
        assert documented == statuses, path


@pytest.mark.parametrize(
    ("field", "bound", "value"),
    [
        ("temperature", "minimum", 0),
        ("top_p", "exclusiveMinimum", 0),
        ("top_logprobs", "minimum", 0),
    ],
)
def test_a_zero_bound_is_in_the_schema(
    openapi: dict[str, Any], gateway_url: str, field: str, bound: str, value: int
) -> None:
    # Litestar left bounds of 0 out of optional fields: the schema allowed what the
    # gateway refuses.
    request = openapi["components"]["schemas"]["ChatCompletionRequest"]
    assert request["properties"][field][bound] == value
    below = {"temperature": -0.5, "top_p": 0, "top_logprobs": -1}[field]
    response = httpx.post(
        f"{gateway_url}/v1/route",
        json={"model": "auto", "messages": [{"role": "user", "content": "hi"}], field: below},
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == field
