"""GET /metrics: what a real gateway process counts while the openai client uses it.

Every test scrapes before and after its own requests and checks that the counters
moved by exactly what those requests did.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from tests.support import BUNDLED_ENGINES, start_gateway, stop

HELLO: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is 2+2?"}]
STORY: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Write a long story about a dragon and a knight."}
]

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> Samples:
    response = httpx.get(f"{url}/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def moved(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_requests_routes_tokens_and_errors_are_counted(gateway_url: str) -> None:
    openai_client = client(gateway_url)
    before = scrape(gateway_url)
    routes: Counter[tuple[str, str]] = Counter()
    tokens: Counter[tuple[str, str]] = Counter()

    plain = openai_client.chat.completions.create(model="small", messages=HELLO, max_tokens=4)
    assert plain.usage is not None
    routes["small", "200"] += 1
    tokens["small", "prompt"] += plain.usage.prompt_tokens
    tokens["small", "completion"] += plain.usage.completion_tokens

    raw = openai_client.chat.completions.with_raw_response.create(
        model="auto", messages=HELLO, max_tokens=4, temperature=0
    )
    routed, tier = raw.parse(), raw.headers["x-satisfice-route"]
    assert routed.usage is not None and tier in ("small", "large")
    routes[tier, "200"] += 1
    tokens[raw.headers["x-satisfice-engine"], "prompt"] += routed.usage.prompt_tokens
    tokens[raw.headers["x-satisfice-engine"], "completion"] += routed.usage.completion_tokens

    stream = openai_client.chat.completions.create(
        model="large", messages=HELLO, max_tokens=4, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    usage = [chunk.usage for chunk in stream if chunk.usage is not None][-1]
    time.sleep(0.2)  # a stream's end is counted once its last chunk has gone
    routes["large", "200"] += 1
    tokens["large", "prompt"] += usage.prompt_tokens
    tokens["large", "completion"] += usage.completion_tokens

    with pytest.raises(openai.BadRequestError):
        openai_client.chat.completions.create(model="small", messages=HELLO, max_tokens=100_000)
    routes["error", "400"] += 1
    with pytest.raises(openai.NotFoundError):
        openai_client.chat.completions.create(model="no-such-model", messages=HELLO)
    routes["error", "404"] += 1
    # Bodies refused before the handler runs: not JSON, and no messages.
    chat = f"{gateway_url}/v1/chat/completions"
    declared = {"content-type": "application/json"}
    assert httpx.post(chat, content=b"{not json", headers=declared).status_code == 400
    assert httpx.post(chat, json={"model": "small"}).status_code == 400

    after = scrape(gateway_url)
    # The refused bodies count as requests (they settle as every request does), timed
    # from where the handler of their error opened their exchange.
    settled = routes + Counter({("error", "400"): 2})
    for (route, status), count in settled.items():
        assert moved(before, after, "satisfice_requests_total", route=route, status=status) == count
    for route in ("small", "large", "error"):
        count = sum(n for (r, _), n in settled.items() if r == route)
        assert moved(before, after, "satisfice_request_seconds_count", route=route) == count
    # Only the stream has a first byte of its own.
    assert moved(before, after, "satisfice_time_to_first_byte_seconds_count", route="large") == 1
    assert moved(before, after, "satisfice_time_to_first_byte_seconds_count", route="small") == 0
    for (engine, kind), count in tokens.items():
        assert (
            moved(before, after, "satisfice_engine_tokens_total", engine=engine, kind=kind) == count
        )
    for engine in ("small", "large"):
        assert value(after, "satisfice_engine_queue_depth", engine=engine) == 0
    # No deadlines in this config, and no cache.
    assert moved(before, after, "satisfice_sla_misses_total") == 0
    assert not any(name.startswith("satisfice_cache_") for name, _ in after)
    assert value(after, "satisfice_config_reloads_total", result="success") == 0
    assert ("satisfice_config_reloads_total", frozenset({("result", "success")})) in after
    schema = httpx.get(f"{gateway_url}/openapi/openapi.json").json()
    assert "/metrics" not in schema["paths"]


async def test_overload_is_counted_per_engine(gateway_url: str) -> None:
    """The test config gives `small` one slot and one queue place: two of four are shed."""
    before = scrape(gateway_url)
    body = {"model": "small", "messages": STORY, "max_tokens": 60, "temperature": 0}
    async with httpx.AsyncClient(base_url=gateway_url, timeout=60) as http:
        responses = await asyncio.gather(
            *(http.post("/v1/chat/completions", json=body) for _ in range(4))
        )
    assert sorted(r.status_code for r in responses) == [200, 200, 429, 429]
    after = scrape(gateway_url)
    assert moved(before, after, "satisfice_engine_overloads_total", engine="small") == 2
    assert moved(before, after, "satisfice_engine_overloads_total", engine="large") == 0
    assert moved(before, after, "satisfice_requests_total", route="small", status="429") == 2
    assert moved(before, after, "satisfice_requests_total", route="small", status="200") == 2


# Every routed question is hard and thinks for one round of one short branch; the
# cache keeps what the small engine answers.
LOOP_AND_CACHE_CONFIG = f"""
router:
  threshold: 0.0
{BUNDLED_ENGINES}
loop:
  branches: 1
  max_rounds: 1
  round_tokens: 8
  calibrator: null
cache:
  store: {{kind: memory}}
"""


@pytest.fixture(scope="module")
def loop_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    url, process = start_gateway(LOOP_AND_CACHE_CONFIG, tmp_path_factory.mktemp("metrics"))
    try:
        yield url
    finally:
        stop(process)


def test_loop_cache_and_sla_misses_are_counted(loop_url: str) -> None:
    openai_client = client(loop_url)
    before = scrape(loop_url)
    question = f"Is the sun a star? (case {uuid.uuid4().hex[:6]})"
    raw = openai_client.chat.completions.with_raw_response.create(
        model="auto", messages=[{"role": "user", "content": question}], max_tokens=8
    )
    assert raw.headers["x-satisfice-route"] == "loop"
    assert raw.headers["x-satisfice-fallback"] == "none"
    loop_headers = dict(raw.headers)

    unrelated = f"Name the largest ocean on Earth. (case {uuid.uuid4().hex[:6]})"
    # A deadline no loop can meet: no answer at all, so 504 from the fallback.
    late = httpx.post(
        f"{loop_url}/v1/chat/completions",
        json={"model": "auto", "messages": [{"role": "user", "content": unrelated}]},
        headers={"x-satisfice-deadline-ms": "1"},
        timeout=60,
    )
    assert late.status_code == 504 and late.json()["error"]["code"] == "deadline_exceeded"

    # The small engine's answer, then the same question from the cache (this question's
    # first sentence is a whole answer, which the cache keeps).
    ask: dict[str, Any] = {
        "model": "small",
        "messages": [{"role": "user", "content": "What is the boiling point of water?"}],
        "max_tokens": 48, "temperature": 0, "stop": [".", "\n"],
    }  # fmt: skip
    misses = 0
    for _ in range(20):  # the answer is stored after the response has gone
        served = openai_client.chat.completions.with_raw_response.create(**ask)
        if served.headers["x-satisfice-cache"] == "exact":
            break
        assert served.headers["x-satisfice-cache"] == "miss"
        misses += 1
        time.sleep(0.2)
    assert misses >= 1
    after = scrape(loop_url)

    requests = "satisfice_requests_total"
    assert moved(before, after, requests, route="loop", status="200") == 1
    assert moved(before, after, requests, route="fallback", status="504") == 1
    assert moved(before, after, requests, route="small", status="200") == misses
    assert moved(before, after, requests, route="exact", status="200") == 1
    assert moved(before, after, "satisfice_sla_misses_total") == 1

    assert moved(before, after, "satisfice_loop_rounds_count") == 2
    rounds = int(loop_headers["x-satisfice-rounds"])
    assert rounds == 1 and moved(before, after, "satisfice_loop_rounds_sum") == rounds
    branches = int(loop_headers["x-satisfice-branches"])
    assert moved(before, after, "satisfice_loop_branches_sum") == branches
    confidence = float(loop_headers["x-satisfice-confidence"])
    assert moved(before, after, "satisfice_loop_confidence_sum") == pytest.approx(
        confidence, abs=1e-4
    )
    stop_reason = loop_headers["x-satisfice-stop"]
    stops = Counter([stop_reason, "deadline"])
    for reason, count in stops.items():
        assert moved(before, after, "satisfice_loop_stops_total", reason=reason) == count
    assert moved(before, after, "satisfice_loop_fallbacks_total", fallback="error") == 1
    assert moved(before, after, "satisfice_loop_fallbacks_total", fallback="best") == 0

    assert moved(before, after, "satisfice_cache_hits_total", path="exact") == 1
    assert moved(before, after, "satisfice_cache_hits_total", path="semantic") == 0
    # The loop's two questions missed too, before they were routed.
    assert moved(before, after, "satisfice_cache_misses_total") == misses + 2
