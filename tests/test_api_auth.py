"""API keys, tenants, per-key limits and the opt-in decision trace, through a real
gateway process with the bundled models, a real Redis for the limits, and the
official openai client."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from gateway.ops.keys import hash_key
from tests.support import BUNDLED_ENGINES, satisfice, start_gateway, stop

ALPHA, BRAVO, OPS = (f"sk-{name}-{uuid.uuid4().hex}" for name in ("alpha", "bravo", "ops"))
LIMITED, TOKENS, REPORTS = (
    f"sk-{name}-{uuid.uuid4().hex}" for name in ("limited", "tokens", "reports")
)
# Key names are what the shared Redis counts under: unique per run, so counts from an
# earlier run in the same minute cannot leak into this one.
RUN = uuid.uuid4().hex[:8]

CONFIG = f"""
router: {{}}
cache: {{}}
server:
  max_prompt_tokens: 100
tenants:
  alpha: {{router_threshold: 2.0}}   # nothing is hard enough: always small
  bravo: {{router_threshold: 0.0}}   # everything is: always large
auth:
  rate_limit_url: redis://127.0.0.1:6379/0
  keys:
    alpha: {{sha256: {hash_key(ALPHA)}, tenant: alpha}}
    bravo: {{env: TEST_BRAVO_KEY, tenant: bravo}}
    ops: {{sha256: {hash_key(OPS)}, admin: true}}
    limited-{RUN}: {{sha256: {hash_key(LIMITED)}, tenant: alpha, requests_per_minute: 2}}
    tokens-{RUN}: {{sha256: {hash_key(TOKENS)}, tenant: alpha, tokens_per_minute: 300}}
    reports-{RUN}: {{sha256: {hash_key(REPORTS)}, tenant: alpha, requests_per_minute: 2}}
{BUNDLED_ENGINES}
"""


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    started, process = start_gateway(
        CONFIG, tmp_path_factory.mktemp("auth"), env={"TEST_BRAVO_KEY": BRAVO}
    )
    yield started
    stop(process)


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def ask(url: str, key: str, question: str, **extra: object) -> httpx.Response:
    body = {"model": "small", "messages": [{"role": "user", "content": question}],
            "max_tokens": 64, "temperature": 0, **extra}  # fmt: skip
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60)


def test_the_api_needs_a_known_key(url: str) -> None:
    for headers in ({}, {"Authorization": "Bearer sk-unknown"}, {"Authorization": "Basic x"}):
        response = httpx.post(f"{url}/v1/chat/completions", json={"bad": "body"}, headers=headers)
        # The key is checked before the body: a caller without one learns nothing more.
        assert response.status_code == 401, response.text
        error = response.json()["error"]
        assert error["type"] == "authentication_error"
        assert error["code"] == "invalid_api_key"
    assert httpx.get(f"{url}/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        client(url, "sk-wrong").models.list()
    # Probes and metrics stay open: they carry no tenant's data.
    assert httpx.get(f"{url}/healthz").status_code == 200
    assert httpx.get(f"{url}/metrics").status_code == 200
    names = [m.id for m in client(url, ALPHA).models.list()]
    assert names == ["small", "large", "auto"]


def test_a_key_from_the_environment_works(url: str) -> None:
    reply = client(url, BRAVO).chat.completions.create(
        model="small", messages=[{"role": "user", "content": "Say hi."}], max_tokens=4
    )
    assert reply.choices[0].message.content is not None


def test_admin_endpoints_need_an_admin_key(url: str) -> None:
    stats = f"{url}/admin/cache/stats"
    assert httpx.get(stats).status_code == 401
    refused = httpx.get(stats, headers={"Authorization": f"Bearer {ALPHA}"})
    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "not_admin"
    assert httpx.get(stats, headers={"Authorization": f"Bearer {OPS}"}).status_code == 200


def test_tenants_neither_read_nor_fill_each_others_cache(url: str) -> None:
    # A whole answer (finish_reason stop) within max_tokens: only those are cached.
    question = f"Reply with one word, the colour of the sky. ({uuid.uuid4().hex[:6]})"
    first = ask(url, ALPHA, question)
    assert first.headers["x-satisfice-cache"] == "miss"
    alpha_answer = first.json()["choices"][0]["message"]["content"]
    assert _eventually_hit(url, ALPHA, question) == alpha_answer

    bravo = ask(url, BRAVO, question)
    assert bravo.headers["x-satisfice-cache"] == "miss"  # alpha's entry is not bravo's
    bravo_again = _eventually_hit(url, BRAVO, question)
    assert bravo_again == bravo.json()["choices"][0]["message"]["content"]
    # Bravo's write went to bravo's namespace: alpha's entry is as it was, byte for byte.
    again = ask(url, ALPHA, question)
    assert again.headers["x-satisfice-cache"] == "exact"
    assert again.json()["choices"][0]["message"]["content"] == alpha_answer
    stats = httpx.get(f"{url}/admin/cache/stats", headers={"Authorization": f"Bearer {OPS}"})
    tenants = {n["namespace"].split(":")[0] for n in stats.json()["namespaces"]}
    assert {"alpha", "bravo"} <= tenants


def test_a_tenant_reports_only_its_own_entries_within_its_key_limit(url: str) -> None:
    question = f"Reply with one word, the colour of grass. ({uuid.uuid4().hex[:6]})"
    ask(url, ALPHA, question)
    _eventually_hit(url, ALPHA, question)
    entry = ask(url, ALPHA, question).headers["x-satisfice-cache-entry"]

    def report(key: str) -> httpx.Response:
        return httpx.post(f"{url}/v1/feedback", json={"entry_id": entry},
                          headers={"Authorization": f"Bearer {key}"})  # fmt: skip

    assert report("sk-unknown").status_code == 401
    stranger = report(BRAVO)  # bravo's key: alpha's entry is not there for it
    assert stranger.status_code == 404 and "'bravo'" in stranger.json()["error"]["message"]
    assert report(ALPHA).status_code == 200
    # Each report is a request charged to the key: the third in a minute is refused.
    assert [report(REPORTS).status_code for _ in range(3)] == [200, 200, 429]


def _eventually_hit(url: str, key: str, question: str) -> str:
    """The cached answer, once the write-back (after the response) has landed."""
    for _ in range(50):
        response = ask(url, key, question)
        if response.headers["x-satisfice-cache"] == "exact":
            return str(response.json()["choices"][0]["message"]["content"])
        time.sleep(0.1)
    raise AssertionError("the answer was never cached")


def test_each_tenant_routes_by_its_own_threshold(url: str) -> None:
    for key, tier in ((ALPHA, "small"), (BRAVO, "large")):
        response = ask(url, key, "What is the capital of France?", model="auto")
        assert response.status_code == 200, response.text
        assert response.headers["x-satisfice-route"] == tier


def test_requests_per_minute_are_limited_with_retry_after(url: str) -> None:
    for _ in range(2):
        assert ask(url, LIMITED, "Say yes.", max_tokens=1).status_code == 200
    refused = ask(url, LIMITED, "Say yes.", max_tokens=1)
    assert refused.status_code == 429
    assert 1 <= int(refused.headers["retry-after"]) <= 2 * 60
    error = refused.json()["error"]
    assert error["type"] == "rate_limit_error"
    assert f"limited-{RUN}" in error["message"] and "2 requests per minute" in error["message"]
    with pytest.raises(openai.RateLimitError):
        client(url, LIMITED).chat.completions.create(
            model="small", messages=[{"role": "user", "content": "Say yes."}], max_tokens=1
        )
    # Another key of the same tenant has its own count.
    assert ask(url, ALPHA, "Say yes.", max_tokens=1).status_code == 200


def test_tokens_per_minute_are_charged_up_front(url: str) -> None:
    too_big = ask(url, TOKENS, "Hi.", max_tokens=400)
    assert too_big.status_code == 400
    assert too_big.json()["error"]["code"] == "request_too_large"
    assert ask(url, TOKENS, "Hi.", max_tokens=200).status_code == 200
    refused = ask(url, TOKENS, "Hi.", max_tokens=200)  # 2 x (1 + 200) > 300
    assert refused.status_code == 429
    assert "300 tokens per minute" in refused.json()["error"]["message"]
    assert ask(url, TOKENS, "Hi.", max_tokens=50).status_code == 200  # 201 + 51 <= 300


def test_prompt_token_limit(url: str) -> None:
    response = ask(url, ALPHA, "word " * 100)  # 500 bytes: about 125 tokens
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages" and error["code"] == "context_length_exceeded"
    assert "at most 100" in error["message"]


def test_decision_trace_is_opt_in(url: str) -> None:
    question = f"Reply with one word: is water wet? ({uuid.uuid4().hex[:6]})"
    plain = ask(url, ALPHA, question, model="auto")
    assert "satisfice" not in plain.json()
    traced = httpx.post(
        f"{url}/v1/chat/completions",
        json={
            "model": "auto",
            "messages": [{"role": "user", "content": question.replace("wet", "damp")}],
            "max_tokens": 64,
            "temperature": 0,
        },
        headers={"Authorization": f"Bearer {ALPHA}", "x-satisfice-trace": "true"},
        timeout=60,
    )
    trace = traced.json()["satisfice"]
    assert trace["tenant"] == "alpha" and trace["route"] == "small"
    assert trace["engine"] == "small" and trace["cache"] in ("miss", "semantic")
    assert 0.0 <= trace["difficulty"] <= 1.0
    hit = _eventually_hit(url, ALPHA, question)
    cached = httpx.post(
        f"{url}/v1/chat/completions",
        json={
            "model": "auto",
            "messages": [{"role": "user", "content": question}],
            "max_tokens": 64,
            "temperature": 0,
        },
        headers={"Authorization": f"Bearer {ALPHA}", "x-satisfice-trace": "1"},
        timeout=60,
    )
    assert cached.json()["satisfice"]["route"] == "exact"
    assert cached.json()["choices"][0]["message"]["content"] == hit


def test_a_missing_environment_key_is_refused_at_start(tmp_path: Path) -> None:
    config = tmp_path / "missing.yaml"
    config.write_text(
        "auth: {keys: {k: {env: SATISFICE_TEST_UNSET_KEY}}}\n"
        "engines: {small: {backend: llama_cpp, model: smollm2-135m-instruct}}\n"
    )
    result = satisfice("config", "check", str(config))
    assert result.returncode == 2
    assert "auth.keys.k.env" in result.stderr and "SATISFICE_TEST_UNSET_KEY" in result.stderr
