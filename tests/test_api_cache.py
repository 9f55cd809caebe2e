"""The cache on the request path: a real gateway process, a real Redis, the openai client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypedDict, Unpack

import httpx
import openai
import pytest

from tests.support import free_port, spare_redis, start_gateway, stop

ADMIN_KEY = "test-admin-key"


def cache_gateway_config(redis_url: str, prefix: str) -> str:
    return f"""
server:
  admin_key: {ADMIN_KEY}
engines:
  small:
    backend: llama_cpp
    model: smollm2-135m-instruct
    queue_size: 32
cache:
  store:
    kind: redis
    url: {redis_url}
    key_prefix: {prefix}
    retry_interval_s: 0.2
"""


def drop_keys(prefix: str) -> None:
    scan = ["redis-cli", "--scan", "--pattern", f"{prefix}:*"]
    keys = subprocess.run(scan, capture_output=True, text=True, check=False).stdout.split()
    if keys:
        subprocess.run(["redis-cli", "unlink", *keys], capture_output=True, check=False)


@pytest.fixture(scope="module")
def cached_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    prefix = f"satisfice-test-{uuid.uuid4().hex[:8]}"
    config = cache_gateway_config("redis://127.0.0.1:6379/0", prefix)
    url, process = start_gateway(config, tmp_path_factory.mktemp("cached"))
    try:
        yield url
    finally:
        stop(process)
        drop_keys(prefix)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


class Options(TypedDict, total=False):
    """The arguments of `create` that these tests set, typed as the openai client takes them."""

    max_tokens: int
    temperature: float
    stop: list[str] | openai.Omit
    extra_headers: dict[str, str]


# Only whole answers are cached; the first sentence makes a whole answer quickly.
FIRST_SENTENCE: Options = {"max_tokens": 48, "temperature": 0, "stop": [".", "\n"]}


def ask(url: str, prompt: str, **extra: Unpack[Options]) -> tuple[str, dict[str, str]]:
    """The answer and the response headers; waits for the write-back of a miss."""
    options: Options = {**FIRST_SENTENCE, **extra}
    raw = client(url).chat.completions.with_raw_response.create(
        model="small", messages=[{"role": "user", "content": prompt}], **options
    )
    if raw.headers["x-satisfice-cache"] == "miss":
        time.sleep(0.2)  # the answer is stored after the response has gone
    return raw.parse().choices[0].message.content or "", dict(raw.headers)


def error_body(error: openai.APIStatusError) -> dict[str, Any]:
    """The error object of an error response, as the openai client read it."""
    assert isinstance(error.body, dict)
    return error.body


def admin(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"authorization": f"Bearer {ADMIN_KEY}"})


def unique(question: str) -> str:
    # Every test asks its own questions: the module's gateway keeps what it caches.
    return f"{question} (case {uuid.uuid4().hex[:6]})"


def test_exact_and_semantic_hits_serve_the_first_answer(cached_url: str) -> None:
    prompt = "What is the boiling point of water at sea level?"
    first, headers = ask(cached_url, prompt)
    assert headers["x-satisfice-cache"] == "miss"
    again, headers = ask(cached_url, "  What is the boiling point of water at sea level?\n")
    assert headers["x-satisfice-cache"] == "exact" and again == first
    paraphrase, headers = ask(cached_url, "Tell me the boiling point of water at sea level.")
    assert headers["x-satisfice-cache"] == "semantic" and paraphrase == first
    assert float(headers["x-satisfice-cache-similarity"]) >= 0.92

    stream = client(cached_url).chat.completions.create(
        model="small", messages=[{"role": "user", "content": prompt}], **FIRST_SENTENCE,
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == first
    assert chunks[-1].usage is not None


def test_near_misses_and_sampled_requests_are_not_served(cached_url: str) -> None:
    ask(cached_url, "What is 15% of 80?")
    _, headers = ask(cached_url, "What is 15% of 90?")
    assert headers["x-satisfice-cache"] == "miss"
    _, headers = ask(cached_url, "What is 15% of 80?", temperature=0.8)
    assert headers["x-satisfice-cache"] == "bypass"


def test_only_if_cached_never_generates(cached_url: str) -> None:
    only_cached = {"cache-control": "only-if-cached"}
    with pytest.raises(openai.APIStatusError) as error:
        ask(cached_url, unique("What is the tallest mountain?"), extra_headers=only_cached)
    assert error.value.status_code == 504
    assert error_body(error.value)["code"] == "cache_miss"
    ask(cached_url, "What is 15% of 80?")
    _, headers = ask(cached_url, "What is 15% of 80?", extra_headers=only_cached)
    assert headers["x-satisfice-cache"] == "exact"


def test_headers_bypass_lookup_and_storing(cached_url: str) -> None:
    prompt = unique("Name a primary colour.")
    _, headers = ask(cached_url, prompt, extra_headers={"x-satisfice-cache": "no-store"})
    assert headers["x-satisfice-cache"] == "miss"
    _, headers = ask(cached_url, prompt)
    assert headers["x-satisfice-cache"] == "miss"  # the first answer was not kept
    _, headers = ask(cached_url, prompt, extra_headers={"x-satisfice-cache": "bypass"})
    assert headers["x-satisfice-cache"] == "bypass"
    _, headers = ask(cached_url, prompt, extra_headers={"cache-control": "no-cache"})
    assert headers["x-satisfice-cache"] == "bypass"
    _, headers = ask(cached_url, prompt)
    assert headers["x-satisfice-cache"] == "exact"

    with pytest.raises(openai.BadRequestError) as error:
        ask(cached_url, prompt, extra_headers={"x-satisfice-cache": "sometimes"})
    assert error_body(error.value)["param"] == "x-satisfice-cache"
    assert "sometimes" in error_body(error.value)["message"]


async def test_concurrent_identical_misses_share_one_engine_call(cached_url: str) -> None:
    prompt = unique("Write one sentence about the sea.")
    async with openai.AsyncOpenAI(base_url=f"{cached_url}/v1", api_key="unused") as aclient:

        async def one() -> tuple[str, str]:
            raw = await aclient.chat.completions.with_raw_response.create(
                model="small", messages=[{"role": "user", "content": prompt}],
                **FIRST_SENTENCE,
            )  # fmt: skip
            return raw.parse().choices[0].message.content or "", raw.headers["x-satisfice-cache"]

        answers = await asyncio.gather(*(one() for _ in range(6)))
    assert sorted(source for _, source in answers).count("miss") == 1
    assert {source for _, source in answers} <= {"miss", "coalesced", "exact"}
    assert len({text for text, _ in answers}) == 1


def test_admin_endpoints_need_the_key(cached_url: str) -> None:
    anonymous = httpx.get(f"{cached_url}/admin/cache/stats")
    assert anonymous.status_code == 401
    assert anonymous.json()["error"]["code"] == "invalid_admin_key"
    wrong = httpx.get(f"{cached_url}/admin/cache/stats", headers={"authorization": "Bearer no"})
    assert wrong.status_code == 401
    with admin(cached_url) as http:
        stats = http.get("/admin/cache/stats").json()
    assert stats["store"]["kind"] == "redis" and stats["store"]["available"]


def test_warmup_invalidate_through_admin_endpoints(cached_url: str) -> None:
    tenant_prompt = unique("What is the chemical symbol for gold?")
    lines = [
        json.dumps({"prompt": tenant_prompt, "response": "Au", "model": "small"}),
        "not json",
        json.dumps({"prompt": "missing a response", "model": "small"}),
    ]
    body = "\n".join(lines).encode()
    with admin(cached_url) as http:
        report = http.post("/admin/cache/warmup", content=body).json()
        assert report["lines"] == 3 and report["added"] == 1 and report["bad"] == 2
        assert [e["line"] for e in report["errors"]] == [2, 3]
        again = http.post("/admin/cache/warmup", content=body).json()
        assert again["added"] == 0 and again["replaced"] == 1  # idempotent

        # Warmed answers serve requests without sampling settings of their own.
        answer, headers = ask(cached_url, tenant_prompt, stop=openai.omit)
        assert answer == "Au" and headers["x-satisfice-cache"] == "exact"

        bad = http.post("/admin/cache/invalidate", json={"namespace": "x", "all": True})
        assert bad.status_code == 400 and "exactly one" in bad.json()["error"]["message"]
        deleted = http.post("/admin/cache/invalidate", json={"namespace": "default:small"})
        assert deleted.status_code == 200 and deleted.json()["deleted"] >= 1
    _, headers = ask(cached_url, tenant_prompt, stop=openai.omit)
    assert headers["x-satisfice-cache"] == "miss"


def test_a_semantic_hit_reported_wrong_stops_serving_that_query(cached_url: str) -> None:
    tag = uuid.uuid4().hex[:6]
    cached = f"How can I improve my English speaking skills? ({tag})"
    query = f"How do I improve my spoken English? ({tag})"
    only_cached = {"cache-control": "only-if-cached"}
    line = json.dumps({"prompt": cached, "response": "Speak it every day.", "model": "small"})
    with admin(cached_url) as http:
        assert http.post("/admin/cache/warmup", content=line.encode()).json()["added"] == 1
    answer, headers = ask(cached_url, query, stop=openai.omit, extra_headers=only_cached)
    assert answer == "Speak it every day." and headers["x-satisfice-cache"] == "semantic"
    assert headers["x-satisfice-cache-stage"] == "verifier"
    entry, score = headers["x-satisfice-cache-entry"], float(headers["x-satisfice-cache-score"])

    feedback = f"{cached_url}/v1/feedback"
    reported = httpx.post(feedback, json={"request_id": headers["x-request-id"]})
    assert reported.status_code == 200, reported.text
    assert reported.json()["entry_id"] == entry and reported.json()["hit_floor"] > score
    with pytest.raises(openai.APIStatusError) as error:
        ask(cached_url, query, stop=openai.omit, extra_headers=only_cached)
    turned_down = error.value.response.headers
    assert error.value.status_code == 504
    assert turned_down["x-satisfice-cache-stage"] == "feedback"
    assert turned_down["x-satisfice-cache-entry"] == entry
    # The entry still answers its own question.
    _, headers = ask(cached_url, cached, stop=openai.omit, extra_headers=only_cached)
    assert headers["x-satisfice-cache"] == "exact"

    # By entry id (as the headers carried it), from any replica: a second report
    # tightens further.
    again = httpx.post(feedback, json={"entry_id": entry, "score": 0.99})
    assert again.status_code == 200 and again.json()["hit_floor"] >= 0.995
    metrics = httpx.get(f"{cached_url}/metrics").text
    assert 'satisfice_cache_false_hits_reported_total{tenant="default"}' in metrics
    assert 'satisfice_cache_semantic_hits_served_total{tenant="default"}' in metrics


@pytest.mark.parametrize(
    ("body", "status", "named"),
    [
        ({}, 400, "request_id or by entry_id"),
        ({"request_id": "r", "entry_id": "1"}, 400, "request_id or by entry_id"),
        ({"entry_id": "12x"}, 400, "entry_id"),
        ({"entry_id": "1", "score": 1.5}, 400, "score"),
        ({"request_id": "r", "score": 0.5}, 400, "score"),
        ({"entry_id": "1", "verdict": "wrong"}, 400, "verdict"),
        ({"request_id": "never-served"}, 404, "never-served"),
        ({"entry_id": "123456789"}, 404, "123456789"),
    ],
)
def test_feedback_that_names_no_hit_is_refused_clearly(
    cached_url: str, body: dict[str, object], status: int, named: str
) -> None:
    response = httpx.post(f"{cached_url}/v1/feedback", json=body)
    assert response.status_code == status, response.text
    assert named in response.json()["error"]["message"]


# Slow: a Redis and a gateway of its own; the default run keeps Redis killed,
# restarted and paused under the store itself (test_redis_store).
@pytest.mark.slow
def test_gateway_answers_through_a_redis_outage(tmp_path: Path) -> None:
    redis_port = free_port()
    redis = spare_redis(redis_port, tmp_path)
    url, gateway = start_gateway(
        cache_gateway_config(f"redis://127.0.0.1:{redis_port}/0", "outage"), tmp_path
    )
    try:
        _, headers = ask(url, "What colour is the sky on a clear day?")
        assert headers["x-satisfice-cache"] == "miss"
        _, headers = ask(url, "What colour is the sky on a clear day?")
        assert headers["x-satisfice-cache"] == "exact"

        redis.kill()
        redis.wait()
        for _ in range(3):  # still answered, from the engine
            answer, headers = ask(url, "What colour is the sky on a clear day?")
            assert answer and headers["x-satisfice-cache"] == "miss"
        with admin(url) as http:
            stats = http.get("/admin/cache/stats").json()
        assert stats["store"]["available"] is False
        assert stats["counters"]["store_unavailable"] >= 3

        redis = spare_redis(redis_port, tmp_path)  # back, empty (no persistence)
        time.sleep(0.5)
        ask(url, "What colour is grass?")
        _, headers = ask(url, "What colour is grass?")
        assert headers["x-satisfice-cache"] == "exact"
    finally:
        stop(gateway)
        redis.kill()
        redis.wait()


def eventually(check: Callable[[], bool], within_s: float = 1.0) -> bool:
    deadline = time.monotonic() + within_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# Slow: three gateway starts; the default run keeps Redis behind one gateway
# (cached_url) and replicas following the change stream (test_redis_store).
GOLD = json.dumps(
    {"prompt": "What is the chemical symbol for gold?", "response": "Au", "model": "small"}
).encode()


@contextlib.contextmanager
def two_replicas(tmp_path: Path) -> Iterator[tuple[str, list[subprocess.Popen[bytes]]]]:
    """Two gateways on one Redis (a fresh key prefix), gold's symbol warmed through
    the first: the config, and both processes (a test may replace one)."""
    prefix = f"satisfice-replicas-{uuid.uuid4().hex[:8]}"
    config = cache_gateway_config("redis://127.0.0.1:6379/0", prefix)
    processes: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(2):
            processes.append(start_gateway(config, tmp_path)[1])
        with admin(url_of(processes[0])) as http:
            assert http.post("/admin/cache/warmup", content=GOLD).json()["added"] == 1
        yield config, processes
    finally:
        for process in processes:
            stop(process)
        drop_keys(prefix)


def url_of(process: subprocess.Popen[bytes]) -> str:
    assert isinstance(process.args, list)
    args = [str(arg) for arg in process.args]
    return f"http://127.0.0.1:{args[args.index('--port') + 1]}"


@pytest.mark.slow
def test_replicas_share_one_redis(tmp_path: Path) -> None:
    """Two gateways on one Redis: what one learns the other serves, semantically
    too (its index follows the change stream), and a restarted one rebuilds."""
    with two_replicas(tmp_path) as (config, gateways):
        url_a, url_b = url_of(gateways[0]), url_of(gateways[1])

        def served_by_b(prompt: str, source: str) -> Callable[[], bool]:
            return lambda: ask(url_b, prompt, stop=openai.omit)[1]["x-satisfice-cache"] == source

        assert eventually(served_by_b("What is the chemical symbol for gold?", "exact"))
        assert eventually(served_by_b("What is gold's chemical symbol?", "semantic"))

        with admin(url_b) as http:
            assert http.post("/admin/cache/invalidate", json={"all": True}).json()["deleted"] == 1
        no_store = {"x-satisfice-cache": "no-store"}  # keep the engine's answer out

        def missed_by_a() -> bool:
            asked = ask(url_a, "What is gold's chemical symbol?", stop=openai.omit,
                        extra_headers=no_store)  # fmt: skip
            return asked[1]["x-satisfice-cache"] == "miss"

        assert eventually(missed_by_a)

        with admin(url_b) as http:
            http.post("/admin/cache/warmup", content=GOLD)
        stop(gateways[0])
        url_a, gateways[0] = start_gateway(config, tmp_path)  # rebuilt from Redis at start
        answer, headers = ask(url_a, "What is gold's chemical symbol?", stop=openai.omit)
        assert answer == "Au" and headers["x-satisfice-cache"] == "semantic"


# Slow: two gateway starts; the default run tests the near cache's coherence on real
# Redis replicas of the store (test_near_cache) and the express path (test_express).
@pytest.mark.slow
def test_a_replicas_invalidation_reaches_the_other_ones_near_cache(tmp_path: Path) -> None:
    """Replica b answers an exact hit from its near cache, without Redis; replica a
    invalidates it; b stops serving it within the change stream's delivery (well under
    a second: XREAD returns as soon as a change arrives), as its index always did."""
    with two_replicas(tmp_path) as (_, gateways):
        url_a, url_b = url_of(gateways[0]), url_of(gateways[1])
        only_cached = {"cache-control": "only-if-cached"}

        def served_by_b() -> bool:
            try:
                ask(url_b, "What is the chemical symbol for gold?", stop=openai.omit,
                    extra_headers=only_cached)  # fmt: skip
            except openai.APIStatusError as miss:
                assert miss.status_code == 504
                return False
            return True

        assert eventually(served_by_b)
        assert served_by_b()  # now from b's near cache
        near = httpx.get(f"{url_b}/metrics").text
        assert re.search(r'^satisfice_cache_near_lookups_total\{result="hit"\} [1-9]', near, re.M)
        with admin(url_a) as http:
            assert http.post("/admin/cache/invalidate", json={"all": True}).json()["deleted"] == 1
        invalidated = time.monotonic()
        assert eventually(lambda: not served_by_b(), within_s=1.0)
        print(f"b stopped serving the entry {time.monotonic() - invalidated:.3f} s after a")
