"""Policy versions over HTTP: a real `satisfice serve` process (the bundled router and
SmolLM2 on both tiers, the outcome and policy stores in files), the official openai
client for chat, and the CLI: x-satisfice-policy on every answer, verdicts by request
id kept in the outcome store, GET and POST /admin/policy, and a version refitted by
`satisfice policy refit` put in force and back without a restart."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import openai
import pytest

from gateway.checks.store import FileOutcomes
from gateway.ops.keys import hash_key
from tests.support import config_file, satisfice, start_gateway, stop
from tests.test_policy_learn import routed_traffic

ADMIN_KEY = f"sk-admin-{uuid.uuid4().hex}"
ALPHA = f"sk-alpha-{uuid.uuid4().hex}"
# Routed small by the bundled router and by a refit on traffic where capitals agree.
EASY = "What is the capital of France?"


def config(directory: Path) -> str:
    return f"""
server: {{admin_key: {ADMIN_KEY}}}
router: {{model_file: bundled, small_engine: small, large_engine: small}}
shadow: {{outcomes_file: {directory / "outcomes.jsonl"}}}
auth:
  keys:
    alpha: {{sha256: {hash_key(ALPHA)}, tenant: acme}}
engines:
  small: {{backend: llama_cpp, model: smollm2-135m-instruct}}
"""


class Served(NamedTuple):
    url: str
    directory: Path
    config: Path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A gateway whose outcome store already holds 200 checks of the shipped router:
    word problems it sent small disagree with the large path, capitals agree."""
    directory = tmp_path_factory.mktemp("policy-api")
    asyncio.run(_seed(directory / "outcomes.jsonl"))
    url, process = start_gateway(config(directory), directory)
    try:
        yield Served(url, directory, config_file(process))
    finally:
        stop(process)


async def _seed(path: Path) -> None:
    store = FileOutcomes(path, max_bytes=1 << 24)
    for record in routed_traffic(200):
        await store.add(record)
    await store.close()


def chat(url: str, question: str = EASY) -> dict[str, str]:
    """The response headers of an answer to ``question`` cut at its second token."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=ALPHA, max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="auto", messages=[{"role": "user", "content": question}], temperature=0,
        max_tokens=2,
    )  # fmt: skip
    assert raw.parse().choices[0].finish_reason == "length"
    return dict(raw.headers)


def admin(url: str, key: str | None = ADMIN_KEY) -> httpx.Client:
    headers = {} if key is None else {"authorization": f"Bearer {key}"}
    return httpx.Client(base_url=url, headers=headers, timeout=30)


def feedback(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/feedback", json=body, headers={"authorization": f"Bearer {ALPHA}"}, timeout=30
    )


def error_of(response: httpx.Response) -> dict[str, Any]:
    """The OpenAI error object of an error response."""
    body = response.json()
    assert set(body) == {"error"}, body
    error: dict[str, Any] = body["error"]
    assert {"message", "type", "param", "code"} <= set(error), error
    return error


def test_every_answer_names_the_policy_version_in_force(served: Served) -> None:
    headers = chat(served.url)
    assert headers["x-satisfice-policy"] == "shipped"
    assert headers["x-satisfice-route"] == "small"


@pytest.mark.parametrize("verdict", ["right", "wrong"])
def test_a_verdict_on_an_answer_is_kept_in_the_outcome_store(served: Served, verdict: str) -> None:
    headers = chat(served.url)
    request_id = headers["x-request-id"]
    response = feedback(served.url, {"request_id": request_id, "verdict": verdict})
    assert response.status_code == 200, response.text
    result = response.json()
    assert set(result) == {"record_id"}  # no semantic hit: nothing else to say
    records = asyncio.run(_read(served.directory / "outcomes.jsonl"))
    (kept,) = [r for r in records if r.id == result["record_id"]]
    assert (kept.source, kept.verdict, kept.request_id) == ("feedback", verdict, request_id)
    assert (kept.tenant, kept.route, kept.model) == ("acme", "small", "auto")
    assert kept.policy == "shipped"
    assert kept.prompt == EASY and kept.probability == 1.0
    assert kept.shortcut == "small_route"  # the shortcut taken, even by an answer cut short
    assert kept.difficulty is not None


async def _read(path: Path) -> list[Any]:
    store = FileOutcomes(path, max_bytes=1 << 24)
    try:
        return await store.read()
    finally:
        await store.close()


def test_a_verdict_on_an_unknown_request_is_a_404_naming_it(served: Served) -> None:
    response = feedback(served.url, {"request_id": "never-answered", "verdict": "wrong"})
    assert response.status_code == 404, response.text
    error = error_of(response)
    assert (error["param"], error["code"]) == ("request_id", "not_found")
    assert "never-answered" in error["message"] and "acme" in error["message"]


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"entry_id": "1", "verdict": "wrong"}, "verdict"),
        ({"request_id": "r", "verdict": "maybe"}, "verdict"),
    ],
)
def test_a_verdict_that_cannot_be_kept_is_a_400_naming_it(
    served: Served, body: dict[str, Any], named: str
) -> None:
    response = feedback(served.url, body)
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert named in (error["param"] or "") or named in error["message"], error


def test_the_policy_endpoints_need_the_admin_key(served: Served) -> None:
    for method, body in (("GET", None), ("POST", {"move": "revert"})):
        with admin(served.url, None) as anyone:
            response = anyone.request(method, "/admin/policy", json=body)
        assert response.status_code == 401, response.text
        assert error_of(response)["code"] == "invalid_admin_key"
        with admin(served.url, ALPHA) as tenant:
            response = tenant.request(method, "/admin/policy", json=body)
        assert response.status_code == 403, response.text
        assert error_of(response)["code"] == "not_admin"
    with admin(served.url) as http:
        report = http.get("/admin/policy")
    assert report.status_code == 200, report.text
    assert report.json()["state"]["active"] == "shipped" and report.json()["active"] == "shipped"


@pytest.mark.parametrize(
    ("body", "status", "named"),
    [
        ({"move": "jump"}, 400, "move"),
        ({}, 400, "move"),
        ({"move": "activate"}, 400, "version"),
        ({"move": "shadow"}, 400, "version"),
        ({"move": "revert", "version": "p-1"}, 400, "version"),
        ({"move": "activate", "version": "../state"}, 400, "version"),
        ({"move": "activate", "version": "P-UPPER"}, 400, "version"),
        ({"move": "revert", "why": "x"}, 400, "why"),
        ({"move": "activate", "version": "p-never-written"}, 404, "version"),
    ],
)
def test_a_move_the_gateway_cannot_make_is_refused_naming_the_field(
    served: Served, body: dict[str, Any], status: int, named: str
) -> None:
    with admin(served.url) as http:
        response = http.post("/admin/policy", json=body)
        assert response.status_code == status, response.text
        error = error_of(response)
        assert named in (error["param"] or "") or named in error["message"], error
        assert http.get("/admin/policy").json()["state"]["active"] == "shipped"
    if status == 404:
        assert error["code"] == "not_found" and "p-never-written" in error["message"]


def test_a_refitted_version_goes_into_shadow_and_force_and_back_without_a_restart(
    served: Served,
) -> None:
    refitted = satisfice("policy", "refit", "--config", str(served.config), timeout_s=120)
    assert refitted.returncode == 0, refitted.stderr
    found = re.search(r"wrote policy version (p-[0-9a-z-]+)", refitted.stdout)
    assert found, refitted.stdout
    vid = found.group(1)
    # 200 checks: 140 to refit on, with the verdicts on the small engine's answers the
    # tests before sent; 60 to compare on, on which regret falls.
    records = asyncio.run(_read(served.directory / "outcomes.jsonl"))
    verdicts = sum(r.source == "feedback" and r.route == "small" for r in records)
    labels = 140 + verdicts
    assert f"router on {labels} labels" in refitted.stdout, refitted.stdout
    assert "on 60 held-out checks" in refitted.stdout, refitted.stdout

    with admin(served.url) as http:
        listed = http.get("/admin/policy").json()
        (manifest,) = [v for v in listed["versions"] if v["id"] == vid]
        assert manifest["fitted"] == {"router": labels} and manifest["parent"] == "shipped"
        (router,) = manifest["comparisons"]
        assert router["candidate"]["rate"] < router["live"]["rate"]

        shadowed = http.post("/admin/policy", json={"move": "shadow", "version": vid})
        assert shadowed.status_code == 200, shadowed.text
        assert shadowed.json()["state"]["shadow"] == vid
        assert chat(served.url)["x-satisfice-policy"] == "shipped"
        metrics = httpx.get(f"{served.url}/metrics").text
        assert f'satisfice_policy_info{{active="shipped",shadow="{vid}"}} 1.0' in metrics
        assert re.search(
            rf'satisfice_policy_shadow_decisions_total{{differs="(true|false)",part="router",'
            rf'version="{vid}"}} 1\.0', metrics
        ), metrics  # fmt: skip

        answered_before = chat(served.url)["x-request-id"]
        try:
            activated = http.post("/admin/policy", json={"move": "activate", "version": vid})
            assert activated.status_code == 200, activated.text
            state = activated.json()["state"]
            assert (state["active"], state["shadow"], state["previous"]) == (vid, None, "shipped")
            assert activated.json()["active"] == vid
            headers = chat(served.url)
            assert headers["x-satisfice-policy"] == vid and headers["x-satisfice-route"] == "small"
            metrics = httpx.get(f"{served.url}/metrics").text
            assert f'satisfice_policy_info{{active="{vid}",shadow=""}} 1.0' in metrics
            # A verdict is kept under the version that decided the answer judged.
            ids = {}
            answered_after = headers["x-request-id"]
            for name, request_id in (("before", answered_before), ("after", answered_after)):
                sent = feedback(served.url, {"request_id": request_id, "verdict": "right"})
                assert sent.status_code == 200, sent.text
                ids[sent.json()["record_id"]] = name
            kept = asyncio.run(_read(served.directory / "outcomes.jsonl"))
            assert {ids[r.id]: r.policy for r in kept if r.id in ids} == {
                "before": "shipped", "after": vid,
            }  # fmt: skip
        finally:
            reverted = http.post("/admin/policy", json={"move": "revert"})
        assert reverted.status_code == 200 and reverted.json()["active"] == "shipped"
    assert chat(served.url)["x-satisfice-policy"] == "shipped"


def test_the_checks_already_in_the_store_show_on_metrics_by_policy(served: Served) -> None:
    metrics = httpx.get(f"{served.url}/metrics").text
    # Half the seeded checks disagree; weighted equally, the estimate is a half.
    assert re.search(
        r'satisfice_shortcut_disagreement_ratio{bound="estimate",policy="shipped",'
        r'shortcut="small_route",tenant="default"} 0\.5', metrics
    ), metrics  # fmt: skip
