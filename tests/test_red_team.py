"""The gateway attacked from outside (issue 18): hostile bodies, headers, keys and
tenants, cache poisoning, abandoned and slow connections, each case against a real
gateway process over real HTTP (the official openai client, httpx, or raw sockets
where a client would not misbehave). The holes the attack found stay closed here, and
the cases that held keep holding.
"""

from __future__ import annotations

import json
import select
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from redis import Redis as RedisClient

from gateway.ops.keys import hash_key
from tests.support import config_file, free_port, satisfice, spare_redis, start_gateway, stop

ADMIN = f"sk-admin-{uuid.uuid4().hex}"
KEY_A, KEY_A2, KEY_B, THINKER, QUICK, THROTTLED = (
    f"sk-{name}-{uuid.uuid4().hex}" for name in ("a", "a2", "b", "thinker", "quick", "throttled")
)

# Both bundled models, the router, the loop and the cache in memory, keys of two
# tenants (tA has two keys), and two tenants whose every routed question is hard:
# "thinker" thinks for several rounds, "quick" stops after its first. The server's
# read limits are short enough to test.
CONFIG = f"""
server:
  admin_key: {ADMIN}
  max_tokens_cap: 512
  log_format: json  # the access line's fields, model included
  header_timeout_s: 2
  body_timeout_s: 2
  body_min_rate: 1000
  keep_alive_timeout_s: 1
  max_header_bytes: 16384
router: {{}}
loop:
  branches: 2
  max_rounds: 4
  round_tokens: 48
  token_budget: 1024
  threshold: 0.999
cache:
  store: {{kind: memory}}
tenants:
  thinker: {{router_threshold: 0.0}}
  quick: {{router_threshold: 0.0, loop_threshold: 0.0}}
auth:
  keys:
    a: {{sha256: {hash_key(KEY_A)}, tenant: tA}}
    a2: {{sha256: {hash_key(KEY_A2)}, tenant: tA}}
    b: {{sha256: {hash_key(KEY_B)}, tenant: tB}}
    thinker: {{sha256: {hash_key(THINKER)}, tenant: thinker}}
    quick: {{sha256: {hash_key(QUICK)}, tenant: quick}}
    throttled: {{sha256: {hash_key(THROTTLED)}, tenant: tA, requests_per_minute: 2}}
engines:
  small:
    backend: llama_cpp
    model: smollm2-135m-instruct
    queue_size: 2
    context_tokens: 8192  # room for a 3,000-word prompt
  large:
    backend: llama_cpp
    model: gemma3-270m
    queue_size: 16
    template:
      stop: ["\\nQuestion:", "\\n\\n"]
"""

# Prompts whose answers run long: a story (small), a line that never ends (large).
STORY = "Write a long story about a dragon and a knight."
COUNTING = "List the numbers from 1 to 300, separated by commas, on one line."
# Only whole answers are cached; the first sentence makes a whole answer quickly.
FIRST_SENTENCE: dict[str, Any] = {"max_tokens": 48, "stop": [".", "\n"]}


@dataclass(frozen=True)
class Gateway:
    url: str
    log: Path  # the gateway's stderr
    process: subprocess.Popen[bytes] | None = None

    def chat(
        self,
        body: dict[str, Any],
        key: str = KEY_A,
        headers: dict[str, str] | None = None,
        timeout_s: float = 120,
    ) -> httpx.Response:
        return httpx.post(
            f"{self.url}/v1/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {key}", **(headers or {})},
            timeout=timeout_s,
        )

    def client(self, key: str = KEY_A) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0)

    def admin(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers={"authorization": f"Bearer {ADMIN}"}, timeout=60
        )

    def metrics(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        text = httpx.get(f"{self.url}/metrics").text
        return {
            (sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics().get((name, frozenset(labels.items())), 0.0)


@pytest.fixture(scope="module")
def red(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    folder = tmp_path_factory.mktemp("red-team")
    log = folder / "gateway.log"
    with log.open("wb") as stderr:
        url, process = start_gateway(CONFIG, folder, stderr=stderr)
        try:
            yield Gateway(url, log, process)
        finally:
            stop(process)


def user(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


# -- 1. cache poisoning through an unset temperature ---------------------------------


def test_an_unset_temperature_is_sampled_greedy_and_cached_as_such(red: Gateway) -> None:
    """A request without a temperature (the official client's default) is sampled as
    the config's default_temperature (0: greedy) and cached under exactly that: what
    another key of the tenant is served for temperature 0 is the greedy answer, never a
    sample someone else chose with a seed."""
    with red.admin() as admin:
        assert admin.post("/admin/cache/invalidate", json={"namespace": "tA"}).status_code == 200
    question = "Describe a strange animal you just made up."
    seeded = red.chat({"model": "small", "messages": user(question), "seed": 3, **FIRST_SENTENCE})
    assert seeded.status_code == 200 and seeded.headers["x-satisfice-cache"] == "miss"
    greedy = red.chat(
        {"model": "small", "messages": user(question), "temperature": 0, **FIRST_SENTENCE},
        headers={"x-satisfice-cache": "bypass, no-store"},
    )
    answer = greedy.json()["choices"][0]["message"]["content"]
    assert seeded.json()["choices"][0]["message"]["content"] == answer

    # The answer stored is the greedy one, served to another key of the tenant.
    hit = _until_cached(red, question, KEY_A2)
    assert hit.json()["choices"][0]["message"]["content"] == answer

    # Sampling, asked for, is neither served a cached answer nor stored.
    for seed in (3, 4):
        sampled = red.chat(
            {"model": "small", "messages": user(question), "temperature": 1.0, "seed": seed,
             **FIRST_SENTENCE}
        )  # fmt: skip
        assert sampled.headers["x-satisfice-cache"] == "bypass"
    again = _until_cached(red, question, KEY_A2)
    assert again.json()["choices"][0]["message"]["content"] == answer


def _until_cached(red: Gateway, question: str, key: str) -> httpx.Response:
    """The exact hit for ``question`` at temperature 0, once its write-back has landed."""
    for _ in range(50):
        response = red.chat(
            {"model": "small", "messages": user(question), "temperature": 0, **FIRST_SENTENCE},
            key=key,
            headers={"cache-control": "only-if-cached"},
        )
        if response.status_code == 200:
            assert response.headers["x-satisfice-cache"] == "exact"
            return response
        assert response.json()["error"]["code"] == "cache_miss"
        time.sleep(0.1)
    raise AssertionError(f"{question!r} was never cached")


# -- 3. the OpenAI `user` field is not a conversation -------------------------------


async def test_one_user_may_ask_two_questions_at_once(red: Gateway) -> None:
    """A second question with the same `user` (an end user's id) while the first is in
    the loop stops nothing: both get their answer. Only x-satisfice-conversation (or
    the config switch server.user_is_conversation) makes a new turn stop an earlier one."""
    async with httpx.AsyncClient(
        base_url=red.url, headers={"authorization": f"Bearer {QUICK}"}, timeout=120
    ) as http:
        first = {"model": "auto", "messages": user(COUNTING), "user": "end-user-7"}
        async with http.stream(
            "POST", "/v1/chat/completions", json={**first, "stream": True}
        ) as stream:
            lines = stream.aiter_lines()
            assert (await anext(lines)).startswith("data: ")  # the loop is thinking
            second = await http.post(
                "/v1/chat/completions",
                json={**first, "messages": user("Is the sun a star?")},
            )
            rest = [line async for line in lines]
    assert second.status_code == 200, second.text
    assert second.headers["x-satisfice-route"] == "loop"
    assert "x-satisfice-superseded-ms" not in second.headers
    assert "data: [DONE]" in rest
    assert not any('"error"' in line for line in rest)


# -- 2. abandoned plain requests stop within a token, on every path ------------------


def send_raw(
    red: Gateway, body: dict[str, Any], key: str = KEY_A, headers: dict[str, str] | None = None
) -> socket.socket:
    """A plain chat request sent whole on a socket of its own, its answer never read:
    closing the socket is a client that leaves."""
    payload = json.dumps(body).encode()
    lines = [
        "POST /v1/chat/completions HTTP/1.1",
        "Host: gateway",
        f"Authorization: Bearer {key}",
        "Content-Type: application/json",
        f"Content-Length: {len(payload)}",
        *(f"{name}: {value}" for name, value in (headers or {}).items()),
    ]
    address = httpx.URL(red.url)
    sock = socket.create_connection((address.host, address.port or 80))
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + payload)
    return sock


def until(condition: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
    """Wait for ``condition``, which the gateway's own metrics answer."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting: {what}")
        time.sleep(0.05)


class Engine:
    """What /metrics says of one engine and of the requests one route answered."""

    def __init__(self, red: Gateway, engine: str, route: str) -> None:
        self._red, self.engine, self.route = red, engine, route

    def sampled(self) -> float:
        return self._red.metric("satisfice_engine_sampled_tokens_total", engine=self.engine)

    def busy(self) -> float:
        return self._red.metric("satisfice_engine_busy_slots", engine=self.engine)

    def waiting(self) -> float:
        return self._red.metric("satisfice_engine_queue_depth", engine=self.engine)

    def ended(self, status: int) -> float:
        return self._red.metric("satisfice_requests_total", route=self.route, status=str(status))

    def generating(self, since: float) -> None:
        until(lambda: self.sampled() > since + 2, f"{self.engine} generating")

    def stops_within_a_token_of(self, gone: int, *, before: float) -> None:
        """Once the ``gone``-th 499 of the route is counted, at most one more token per
        slot is sampled, and every slot comes free."""
        until(lambda: self.ended(499) >= gone, f"{gone} requests of {self.route} ended 499")
        at_the_end = self.sampled()
        until(lambda: self.busy() == 0, f"{self.engine}'s slots free")
        assert self.sampled() - at_the_end <= 1
        assert self.sampled() - before < 300  # far from the answer's 400 tokens


BYPASS = {"x-satisfice-cache": "bypass"}  # no lookup: no identical request to wait for


@pytest.mark.parametrize(
    ("model", "prompt"), [("small", STORY), ("large", COUNTING)], ids=["small", "large"]
)
def test_an_abandoned_plain_request_stops_within_a_token(
    red: Gateway, model: str, prompt: str
) -> None:
    engine = Engine(red, model, model)
    body = {"model": model, "messages": user(prompt), "max_tokens": 400, "temperature": 0}
    before, gone = engine.sampled(), engine.ended(499)
    sock = send_raw(red, body, headers=BYPASS)
    engine.generating(before)
    sock.close()
    engine.stops_within_a_token_of(int(gone) + 1, before=before)


def test_abandoned_requests_leave_the_queue_at_once(red: Gateway) -> None:
    """The issue's case: clients that leave while queued must not hold the queue (small
    has one slot and two places) until the request ahead of them is done."""
    engine = Engine(red, "small", "small")
    body = {"model": "small", "messages": user(STORY), "max_tokens": 400, "temperature": 0}
    before, gone, answered = engine.sampled(), engine.ended(499), engine.ended(200)
    ahead = send_raw(red, body, headers=BYPASS)
    engine.generating(before)
    queued = [send_raw(red, body, headers=BYPASS) for _ in range(2)]
    until(lambda: engine.waiting() == 2, "two requests queued")
    for sock in queued:
        sock.close()
    until(lambda: engine.waiting() == 0, "the queue empty")
    until(lambda: engine.ended(499) == gone + 2, "both queued requests ended 499")
    # ... while the request ahead is still generating.
    assert engine.busy() == 1 and engine.ended(200) == answered
    # Another tenant's request is queued, not refused, and answered once the request
    # ahead is abandoned too.
    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(
            red.chat, {"model": "small", "messages": user("What is 2+2?"), "max_tokens": 2}, KEY_B
        )
        until(lambda: engine.waiting() == 1 or other.done(), "another request queued")
        ahead.close()
        until(lambda: engine.ended(499) == gone + 3, "the request ahead ended 499")
        at_the_end = engine.sampled()
        answer = other.result()
    assert answer.status_code == 200
    until(lambda: engine.busy() == 0, "small's slot free")
    # The one token the abandoned request may still take, and the other's answer.
    assert engine.sampled() - at_the_end <= 1 + answer.json()["usage"]["completion_tokens"]


def test_an_abandoned_loop_stops_within_a_token(red: Gateway) -> None:
    engine = Engine(red, "large", "loop")
    body = {"model": "auto", "messages": user(COUNTING), "max_tokens": 400}
    before, gone = engine.sampled(), engine.ended(499)
    sock = send_raw(red, body, key=THINKER, headers=BYPASS)
    engine.generating(before)
    sock.close()
    engine.stops_within_a_token_of(int(gone) + 1, before=before)


def _leading(red: Gateway, max_tokens: int) -> tuple[Engine, dict[str, Any], socket.socket]:
    """A request (on a socket of its own) that leads the identical ones to come, once it
    is generating: the engine, the body to send again, and the leader's socket."""
    engine = Engine(red, "small", "small")
    body = {"model": "small", "messages": user(f"{STORY} ({uuid.uuid4().hex[:6]})"),
            "max_tokens": max_tokens, "temperature": 0}  # fmt: skip
    sampled = engine.sampled()
    leader = send_raw(red, body)
    engine.generating(sampled)
    return engine, body, leader


def _misses(red: Gateway) -> float:
    return red.metric("satisfice_cache_misses_total")


def _joined(red: Gateway, misses: float) -> None:
    """Wait until an identical request has joined the leader's flight: it does so in the
    same step as it counts its cache miss, with nothing awaited between (so not by a
    pause, which a slow host may outlast)."""
    until(lambda: _misses(red) > misses, "the identical request missed the cache and joined")


def test_a_leader_whose_client_left_answers_the_identical_requests_waiting(
    red: Gateway,
) -> None:
    """Identical requests in flight share one engine call. The first one's client
    leaving must not take the answer from the others still waiting for it."""
    engine, body, leader = _leading(red, max_tokens=150)
    gone, misses = engine.ended(499), _misses(red)
    with ThreadPoolExecutor(1) as pool:
        follower = pool.submit(red.chat, body, KEY_A2)
        _joined(red, misses)
        assert not follower.done()
        leader.close()
        until(lambda: engine.ended(499) == gone + 1, "the leader's request ended 499")
        response = follower.result()
    assert response.status_code == 200, response.text
    assert response.headers["x-satisfice-cache"] == "coalesced"
    assert response.json()["choices"][0]["finish_reason"] == "length"
    assert response.json()["usage"]["completion_tokens"] == 150


def test_work_whose_every_waiter_left_stops_within_a_token(red: Gateway) -> None:
    engine, body, leader = _leading(red, max_tokens=400)
    before, gone, misses = engine.sampled(), engine.ended(499), _misses(red)
    follower = send_raw(red, body, key=KEY_A2)
    _joined(red, misses)
    leader.close()
    # The follower still waits: the work goes on for it (and the leader's request
    # settles, 499, only once that work is over) ...
    left_at = engine.sampled()
    until(lambda: engine.sampled() > left_at + 10, "the work going on for the follower")
    assert engine.ended(499) == gone
    # ... until it leaves too.
    follower.close()
    engine.stops_within_a_token_of(int(gone) + 2, before=before)


# -- 4 and 7. hostile bodies: a clear 4xx, counted, and no traceback ------------------

CHAT = {"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
DEEP = b'{"model": "small", "messages": [{"role": "user", "content": "hi"}], "x": ' + (
    b"[" * 100_000 + b"]" * 100_000 + b"}"
)


def post_raw(red: Gateway, body: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(
        f"{red.url}/v1/chat/completions",
        content=body,
        headers={
            "authorization": f"Bearer {KEY_A}",
            "content-type": "application/json",
            **(headers or {}),
        },
        timeout=60,
    )


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_a_deeply_nested_body_is_a_400_counted_without_a_traceback(red: Gateway) -> None:
    """Only an unexpected error (a 500) logs a traceback: none happens here. (The log
    itself cannot be read for it: llama-cpp-python's loading of two models at once may
    leave the process's stderr on /dev/null.)"""
    refused = red.metric("satisfice_requests_total", route="error", status="400")
    failed = red.metric("satisfice_requests_total", route="error", status="500")
    error = error_of(post_raw(red, DEEP), 400)
    assert "nests" in error["message"] and error["code"] == "too_deeply_nested"
    assert red.metric("satisfice_requests_total", route="error", status="400") == refused + 1
    assert red.metric("satisfice_requests_total", route="error", status="500") == failed
    assert red.chat(CHAT).status_code == 200  # and the worker goes on serving


def test_refusals_before_the_handler_are_counted(red: Gateway) -> None:
    """Requests refused by their key or their headers never reach the handler that
    counts chat requests; they count too, by their status."""
    cases: list[tuple[httpx.Response, int]] = []
    before = {status: red.metric("satisfice_requests_total", route="error", status=status)
              for status in ("401", "415")}  # fmt: skip
    cases.append((red.chat(CHAT, key="sk-nobody"), 401))
    cases.append((post_raw(red, json.dumps(CHAT).encode(), {"content-type": "text/plain"}), 415))
    for response, expected in cases:
        error_of(response, expected)
    for status, count in before.items():
        assert red.metric("satisfice_requests_total", route="error", status=status) == count + 1


# -- 9. what the engines cannot do is refused, not ignored ----------------------------


@pytest.mark.parametrize(
    ("extra", "param", "code"),
    [
        # The small engine's chat template has no tools: refused by name, not answered
        # in plain text (nor served a plain cached answer).
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "unsupported"),
        ({"functions": [{"name": "f"}]}, "tools", "unsupported"),
        ({"tool_choice": "auto"}, "tool_choice", None),
        ({"function_call": {"name": "f"}}, "function_call", None),
        ({"logit_bias": {"50256": -100}}, "logit_bias", "unsupported_parameter"),
    ],
    ids=["tools", "functions", "tool_choice", "function_call", "logit_bias"],
)
def test_what_the_engine_cannot_do_is_refused(
    red: Gateway, extra: dict[str, Any], param: str, code: str | None
) -> None:
    error = error_of(red.chat({**CHAT, **extra}), 400)
    assert error["param"] == param and error["code"] == code


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "maxLength": 10**9},
        {"type": "string", "pattern": "^a{1,20000}$"},
        {"$ref": "#/$defs/n", "$defs": {"n": {"type": "object", "properties": {
            "c": {"$ref": "#/$defs/n"}}}}},
    ],
    ids=["grammar-of-gigabytes", "grammar-too-deep", "recursive"],
)  # fmt: skip
def test_a_schema_no_grammar_can_hold_is_refused_and_the_gateway_lives(
    red: Gateway, schema: dict[str, Any]
) -> None:
    """Before, the first took 19 GB building its grammar and the second killed the
    process in llama.cpp's grammar parser: a forty-byte body could end a replica."""
    form = {"type": "json_schema", "json_schema": {"name": "bomb", "schema": schema}}
    error = error_of(red.chat({**CHAT, "response_format": form}), 400)
    assert error["param"] == "response_format" and error["code"] == "unsupported"
    assert red.chat(CHAT).status_code == 200


def test_asking_for_nothing_unsupported_is_answered(red: Gateway) -> None:
    asked = {"tools": [], "tool_choice": "none", "response_format": {"type": "text"}}
    assert red.chat({**CHAT, **asked}).status_code == 200


def test_a_message_name_scopes_the_cached_answer(red: Gateway) -> None:
    question = f"What is the capital of France? ({uuid.uuid4().hex[:6]})"

    def ask(name: str | None) -> str:
        message: dict[str, str] = {"role": "user", "content": question}
        if name is not None:
            message["name"] = name
        body = {"model": "small", "messages": [message], "temperature": 0, **FIRST_SENTENCE}
        writes = red.metric("satisfice_cache_writes_total")
        response = red.chat(body)
        assert response.status_code == 200, response.text
        served = response.headers["x-satisfice-cache"]
        if served == "miss":  # its answer is written back after it is sent
            until(lambda: red.metric("satisfice_cache_writes_total") > writes, "the write-back")
        return served

    assert ask("alice") == "miss"
    assert ask("alice") == "exact"
    assert ask("bob") == "miss"
    assert ask(None) == "miss"


@pytest.mark.parametrize(
    "content_type", [None, "text/plain", "application/x-www-form-urlencoded", "text/json"]
)
def test_a_body_not_declared_json_is_refused(red: Gateway, content_type: str | None) -> None:
    headers = {"authorization": f"Bearer {KEY_A}"}
    if content_type is not None:
        headers["content-type"] = content_type
    response = httpx.post(
        f"{red.url}/v1/chat/completions", content=json.dumps(CHAT).encode(), headers=headers
    )
    error = error_of(response, 415)
    assert error["param"] == "content-type" and "application/json" in error["message"]


def test_json_with_a_charset_is_json(red: Gateway) -> None:
    body = json.dumps(CHAT).encode()
    response = post_raw(red, body, {"content-type": "application/json; charset=utf-8"})
    assert response.status_code == 200


def test_a_text_part_without_text_says_so(red: Gateway) -> None:
    parts = [{"type": "text", "text": None}]
    error = error_of(red.chat({**CHAT, "messages": [{"role": "user", "content": parts}]}), 400)
    assert error["param"] == "messages[0].content[0].text"
    assert "needs its text" in error["message"] and "not supported" not in error["message"]


@pytest.mark.parametrize("value", ["9" * 5000, "1" + "0" * 400, "99999999999"])
def test_a_huge_deadline_header_is_refused_without_echoing_it(red: Gateway, value: str) -> None:
    error = error_of(red.chat(CHAT, headers={"x-satisfice-deadline-ms": value}), 400)
    assert error["param"] == "x-satisfice-deadline-ms"
    assert len(error["message"]) < 300


def test_a_huge_model_name_is_not_echoed_whole(red: Gateway) -> None:
    error = error_of(red.chat({**CHAT, "model": "m" * 50_000}), 404)
    assert len(error["message"]) < 300 and "50000 characters" in error["message"]


# -- 5. /v1/route: the chat request's checks and the key's rate limit ----------------


def route(red: Gateway, model: str, key: str = KEY_A) -> httpx.Response:
    return httpx.post(
        f"{red.url}/v1/route",
        json={"model": model, "messages": user("What is 2+2?")},
        headers={"authorization": f"Bearer {key}"},
        timeout=60,
    )


def test_route_refuses_models_chat_refuses(red: Gateway) -> None:
    for model in ("gpt-4", ""):
        assert error_of(route(red, model), 404)["code"] == "model_not_found"
        assert error_of(red.chat({**CHAT, "model": model}), 404)["code"] == "model_not_found"
    assert error_of(route(red, "small"), 400)["param"] == "model"
    assert route(red, "auto").status_code == 200


def test_route_is_rate_limited_like_chat(red: Gateway) -> None:
    statuses = [route(red, "auto", key=THROTTLED).status_code for _ in range(3)]
    assert statuses == [200, 200, 429]
    limited = error_of(red.chat(CHAT, key=THROTTLED), 429)
    assert limited["code"] == "rate_limit_exceeded"


# -- 6. slow and idle connections are closed ------------------------------------------


def connect(red: Gateway) -> socket.socket:
    address = httpx.URL(red.url)
    sock = socket.create_connection((address.host, address.port or 80))
    sock.settimeout(15)
    return sock


def trickle(sock: socket.socket, data: bytes, every_s: float = 0.3) -> bytes:
    """Send ``data`` a byte at a time until the server answers or hangs up; what it said."""
    for byte in data:
        if select.select([sock], [], [], every_s)[0]:
            break
        try:
            sock.sendall(bytes([byte]))
        except OSError:  # the server hung up
            break
    else:
        raise AssertionError("the server let the whole trickle in")
    return read_all(sock)


def read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes the connection (a 15 s timeout says it never
    did)."""
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def refused(red: Gateway, reason: str) -> float:
    return red.metric("satisfice_connections_refused_total", reason=reason)


def test_a_connection_that_sends_nothing_is_closed(red: Gateway) -> None:
    before = refused(red, "idle")
    with connect(red) as sock:
        assert read_all(sock) == b""
    until(lambda: refused(red, "idle") == before + 1, "the idle connection counted")


def test_headers_sent_a_byte_at_a_time_get_408(red: Gateway) -> None:
    before = refused(red, "header")
    request = b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\n" + b"X-Slow: a\r\n" * 50
    with connect(red) as sock:
        answer = trickle(sock, request)
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_timeout"
    assert refused(red, "header") == before + 1


def test_a_body_sent_a_byte_at_a_time_gets_408(red: Gateway) -> None:
    before = refused(red, "body")
    counted = red.metric("satisfice_requests_total", route="error", status="408")
    payload = json.dumps({**CHAT, "messages": user("x" * 2000)}).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\n"
        f"Authorization: Bearer {KEY_A}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode()
    with connect(red) as sock:
        sock.sendall(head)
        answer = trickle(sock, payload)
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert refused(red, "body") == before + 1
    until(
        lambda: red.metric("satisfice_requests_total", route="error", status="408") == counted + 1,
        "the chat request counted as 408",
    )


def test_a_kept_alive_connection_idle_between_requests_is_closed(red: Gateway) -> None:
    with connect(red) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: gateway\r\n\r\n")
        started = time.monotonic()
        answer = read_all(sock)  # the answer, then the close a second later
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b'{"status":"ok"}')
    assert time.monotonic() - started < 4.5  # keep_alive_timeout_s: 1, not uvicorn's 5


@pytest.mark.parametrize("ended", [False, True], ids=["unended", "whole"])
def test_headers_over_the_limit_get_431(red: Gateway, ended: bool) -> None:
    before = refused(red, "header_size")
    big = b"GET /healthz HTTP/1.1\r\nHost: gateway\r\nX-Big: " + b"a" * 20_000
    with connect(red) as sock:
        sock.sendall(big + (b"\r\n\r\n" if ended else b""))
        answer = read_all(sock)
    assert answer.startswith(b"HTTP/1.1 431 "), answer
    assert refused(red, "header_size") == before + 1


def test_a_client_that_leaves_mid_body_counts_as_499(red: Gateway) -> None:
    counted = red.metric("satisfice_requests_total", route="error", status="499")
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\n"
        f"Authorization: Bearer {KEY_A}\r\nContent-Type: application/json\r\n"
        "Content-Length: 1000\r\n\r\n{"
    ).encode()
    with connect(red) as sock:
        sock.sendall(head)
        time.sleep(0.3)
    until(
        lambda: red.metric("satisfice_requests_total", route="error", status="499") == counted + 1,
        "the chat request counted as 499",
    )


# -- 8. warm-up's tenant is a tenant name ---------------------------------------------

FAQ = b'{"prompt": "What are your opening hours?", "response": "Nine to five."}\n'


@pytest.mark.parametrize(
    "tenant", ["*", "", "../tA", "tA\nx", "t" * 5000, "tA:small", "tB:*", "t A"]
)
def test_warmup_refuses_what_is_not_a_tenant_name(red: Gateway, tenant: str) -> None:
    with red.admin() as admin:
        stats = admin.get("/admin/cache/stats").json()
        response = admin.post("/admin/cache/warmup", params={"tenant": tenant}, content=FAQ)
        error = error_of(response, 400)
        assert error["param"] == "tenant" and len(error["message"]) < 300
        assert admin.get("/admin/cache/stats").json() == stats  # nothing was stored


def test_warmup_fills_the_tenant_it_names_and_no_other(red: Gateway) -> None:
    with red.admin() as admin:
        report = admin.post("/admin/cache/warmup", params={"tenant": "tB"}, content=FAQ)
        assert report.status_code == 200 and report.json()["lines"] == 1
    ask = {"model": "auto", "messages": user("What are your opening hours?"), "temperature": 0}
    served = red.chat(ask, key=KEY_B)
    assert served.headers["x-satisfice-cache"] == "exact"
    assert served.json()["choices"][0]["message"]["content"] == "Nine to five."
    other = red.chat({**ask, "max_tokens": 1}, key=KEY_A)
    assert other.headers["x-satisfice-cache"] != "exact"


def test_a_warmup_line_nested_too_deeply_is_a_bad_line(red: Gateway) -> None:
    deep = b'{"prompt": "p", "response": "r", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n"
    with red.admin() as admin:
        response = admin.post("/admin/cache/warmup", params={"tenant": "tB"}, content=FAQ + deep)
    assert response.status_code == 200, response.text
    report = response.json()
    assert report["lines"] == 2 and report["bad"] == 1
    assert report["errors"] == [{"line": 2, "error": "arrays or objects nested too deeply"}]


def test_the_warmup_command_refuses_what_is_not_a_tenant_name(tmp_path: Path) -> None:
    faq = tmp_path / "faq.jsonl"
    faq.write_bytes(FAQ)
    done = satisfice("cache", "warmup", str(faq), "--namespace", "tA:small", timeout_s=120)
    assert done.returncode != 0 and "not a tenant name" in done.stderr


# -- 9. rate limits while their Redis hangs: what the SRE chose ------------------------

LIMITED = f"sk-limited-{uuid.uuid4().hex}"
FREE = f"sk-free-{uuid.uuid4().hex}"


def _outage_config(redis_port: int, outage: str, requests_per_minute: int) -> str:
    return f"""
server:
  watch_interval_s: null
auth:
  rate_limit_url: redis://127.0.0.1:{redis_port}/0
  rate_limit_outage: {outage}
  keys:
    limited: {{sha256: {hash_key(LIMITED)}, requests_per_minute: {requests_per_minute}}}
    free: {{sha256: {hash_key(FREE)}}}
engines:
  small:
    backend: llama_cpp
    model: smollm2-135m-instruct
"""


def test_rate_limits_while_their_redis_hangs_do_what_the_config_says(tmp_path: Path) -> None:
    """`open` (the default, tested in test_rate_limits) admits everyone; `closed` refuses
    limited keys with 503 and Retry-After; `local` limits each key in this process."""
    redis_port = free_port()
    redis = spare_redis(redis_port, tmp_path)
    url, gateway = start_gateway(_outage_config(redis_port, "closed", 100), tmp_path)
    try:
        limited = Gateway(url, tmp_path / "unused.log")
        ask = limited.chat

        def reloads() -> float:
            return limited.metric("satisfice_config_reloads_total", result="success")

        assert ask(CHAT, key=LIMITED).status_code == 200
        redis.send_signal(signal.SIGSTOP)  # hung: connections open, nothing answers
        try:
            refused = ask(CHAT, key=LIMITED)
            error = error_of(refused, 503)
            assert error["code"] == "rate_limits_unavailable"
            assert refused.headers["retry-after"] == "1"
            assert ask(CHAT, key=FREE).status_code == 200  # keys without limits go on

            reloaded = reloads()
            config_file(gateway).write_text(_outage_config(redis_port, "local", 2))
            gateway.send_signal(signal.SIGHUP)
            until(lambda: reloads() == reloaded + 1, "the config reloaded")
            statuses = [ask(CHAT, key=LIMITED).status_code for _ in range(3)]
            assert statuses == [200, 200, 429]
        finally:
            redis.send_signal(signal.SIGCONT)
    finally:
        stop(gateway)
        stop(redis)


# -- what held when the gateway was attacked, and must go on holding -------------------


def test_keys_are_required_and_admin_is_for_admins(red: Gateway) -> None:
    chat = f"{red.url}/v1/chat/completions"
    for headers in (
        {},
        {"authorization": "Bearer sk-unknown"},
        {"authorization": "Bearer"},
        {"authorization": f"Basic {KEY_A}"},
        {"authorization": f"Bearer {KEY_A}x"},
        {"authorization": "Bearer " + "k" * 8000},
    ):
        assert error_of(httpx.post(chat, json=CHAT, headers=headers), 401)["type"] == (
            "authentication_error"
        )
    stats = f"{red.url}/admin/cache/stats"
    assert httpx.get(stats, headers={"authorization": f"Bearer {KEY_A}"}).status_code == 403
    assert httpx.get(stats).status_code == 401
    with red.admin() as admin:
        assert admin.get("/admin/cache/stats").status_code == 200


def test_tenants_never_read_each_others_cache(red: Gateway) -> None:
    with red.admin() as admin:
        for tenant in ("tA", "tB"):
            assert admin.post("/admin/cache/invalidate", json={"namespace": tenant}).is_success
    question = "Describe a strange animal you just made up."  # its first sentence ends
    body = {"model": "small", "messages": user(question), "temperature": 0, **FIRST_SENTENCE}
    assert red.chat(body, key=KEY_A).headers["x-satisfice-cache"] == "miss"
    _until_cached(red, question, KEY_A)  # tA has it ...
    only_cached = {"cache-control": "only-if-cached"}
    other = red.chat(body, key=KEY_B, headers=only_cached)  # ... tB does not
    assert error_of(other, 504)["code"] == "cache_miss"


RESPOND = b'{"model": "small", "max_output_tokens": 1, "input": '


@pytest.mark.parametrize(
    ("body", "content_type", "status"),
    [
        (b"", "application/json", 400),
        (b"not json", "application/json", 400),
        (b"null", "application/json", 400),
        (RESPOND + b'"hi"', "application/json", 400),
        (b'{"model": "small"}', "application/json", 400),
        (RESPOND + b"5}", "application/json", 400),
        (RESPOND + b'{"role": "user", "content": "hi"}}', "application/json", 400),
        (RESPOND + b"[]}", "application/json", 400),
        (RESPOND + b'""}', "application/json", 400),
        (RESPOND + b'[{"type": "computer_call", "id": "c"}]}', "application/json", 400),
        (RESPOND + b'[{"type": 5}]}', "application/json", 400),
        (RESPOND + b'[{"type": "reasoning", "id": "rs_1", "summary": []}]}', "application/json",
         400),
        (RESPOND + b'[{"role": "user", "content": {"type": "input_text"}}]}',
         "application/json", 400),
        (RESPOND + b'[{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}',
         "application/json", 400),
        (RESPOND + b'[{"type": "function_call", "call_id": "c", "name": "f"}]}',
         "application/json", 400),
        (RESPOND + b'"hi", "tools": "web_search"}', "application/json", 400),
        (RESPOND + b'"hi", "tools": [{"type": "web_search_preview"}]}', "application/json", 400),
        (RESPOND + b'"hi", "tool_choice": {"type": "often"}}', "application/json", 400),
        (RESPOND + b'"hi", "text": {"format": {"type": "xml"}}}', "application/json", 400),
        (b'{"model": "small", "max_output_tokens": "many", "input": "hi"}', "application/json",
         400),
        (b'{"model": "small", "max_output_tokens": 0, "input": "hi"}', "application/json", 400),
        (RESPOND + b'"hi", "previous_response_id": 7}', "application/json", 400),
        (RESPOND + b'"hi", "previous_response_id": "resp_1"}', "application/json", 400),
        (RESPOND + b'"hi", "metadata": {"a": 1}}', "application/json", 400),
        (RESPOND + json.dumps(user("hi") * 300).encode() + b"}", "application/json", 400),
        (b'{"model": "small", "input": "hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
         "application/json", 400),
        (RESPOND + json.dumps("x" * 2_000_000).encode() + b"}", "application/json", 413),
        (RESPOND + b'"\xff"}', "application/json", 400),
        (RESPOND + b'"hi"}', "text/plain", 415),
        (RESPOND + b'"hi"}', None, 415),
    ],
    ids=[
        "empty", "not-json", "null", "truncated", "no-input", "input-number", "input-object",
        "empty-input", "empty-string", "unknown-item", "item-type-number", "reasoning-only",
        "content-object",
        "input-file", "call-without-arguments", "tools-string", "built-in-tool",
        "unknown-tool-choice", "unknown-format", "max-output-tokens-string",
        "max-output-tokens-0", "previous-response-id-number", "previous-response-id",
        "metadata-number", "300-items", "deeply-nested", "2-mb", "invalid-utf8", "text-plain",
        "no-content-type",
    ],
)  # fmt: skip
def test_hostile_responses_bodies_get_a_4xx_in_openai_shape(
    red: Gateway, body: bytes, content_type: str | None, status: int
) -> None:
    """/v1/responses, OpenAI's Responses API translated onto chat, refuses as chat
    completions do: never a 500, and never an answer to what it cannot honour."""
    headers = {"authorization": f"Bearer {KEY_A}"}
    if content_type is not None:
        headers["content-type"] = content_type
    response = httpx.post(f"{red.url}/v1/responses", content=body, headers=headers, timeout=60)
    assert len(error_of(response, status)["message"]) < 1000


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (b"", 400),
        (b"null", 400),
        (b'"a string"', 400),
        (b'{"model": "small", "messages": [{"role": "user", "content": "hi"}]', 400),
        (b'{"model": 5, "messages": [{"role": "user", "content": "hi"}]}', 400),
        (b'{"model": "small", "messages": {"role": "user"}}', 400),
        (b'{"model": "small", "messages": [{"role": "user", "content": "hi"}], "n": 0}', 400),
        (b'{"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}',
         400),
        (b'{"model": "small", "messages": [{"role": "user", "content": "hi"}], "stop": '
         b'["a", "b", "c", "d", "e"]}', 400),
        (b'{"model": "small", "messages": [{"role": "user", "content": "hi"}], "seed": '
         + b"9" * 40 + b"}", 400),
        (b'{"model": "small", "messages": [{"role": "user", "content": "hi"}], "temperature": '
         b"NaN}", 400),
        (json.dumps({"model": "small", "messages": user("hi") * 300}).encode(), 400),
        (json.dumps({"model": "small", "messages": user("x" * 2_000_000)}).encode(), 413),
        (b'{"model": "small", "messages": [{"role": "user", "content": "\xff"}]}', 400),
    ],
    ids=[
        "empty", "null", "string", "truncated", "model-number", "messages-object", "n-0",
        "max-tokens-negative", "five-stops", "seed-40-digits", "temperature-nan",
        "300-messages", "2-mb", "invalid-utf8",
    ],
)  # fmt: skip
def test_hostile_bodies_get_a_4xx_in_openai_shape(red: Gateway, body: bytes, status: int) -> None:
    error_of(post_raw(red, body), status)


MESSAGE = b'{"model": "small", "max_tokens": 1, "messages": '


@pytest.mark.parametrize(
    ("body", "content_type", "status"),
    [
        (b"", "application/json", 400),
        (b"not json", "application/json", 400),
        (b"null", "application/json", 400),
        (MESSAGE + b'[{"role": "user", "content": "hi"}]', "application/json", 400),
        (MESSAGE + b"[]}", "application/json", 400),
        (MESSAGE + b'{"role": "user"}}', "application/json", 400),
        (MESSAGE + b'[{"role": "user", "content": 5}]}', "application/json", 400),
        (MESSAGE + b'[{"role": "user", "content": [{"type": "video"}]}]}', "application/json",
         400),
        (MESSAGE + b'[{"role": "user", "content": [{"text": "no type"}]}]}', "application/json",
         400),
        (MESSAGE + b'[{"role": "user", "content": [{"type": "image", "source": {}}]}]}',
         "application/json", 400),
        (MESSAGE + b'[{"role": "user", "content": "hi"}], "system": 7}', "application/json",
         400),
        (MESSAGE + b'[{"role": "user", "content": "hi"}], "tools": [{"type": "bash_20250124", '
         b'"name": "bash"}]}', "application/json", 400),
        (MESSAGE + b'[{"role": "user", "content": "hi"}], "tool_choice": {"type": "often"}}',
         "application/json", 400),
        (b'{"model": "small", "max_tokens": "many", "messages": [{"role": "user", "content": '
         b'"hi"}]}', "application/json", 400),
        (DEEP, "application/json", 400),
        (MESSAGE + json.dumps(user("x" * 2_000_000)).encode() + b"}", "application/json", 413),
        (MESSAGE + b'[{"role": "user", "content": "\xff"}]}', "application/json", 400),
        (MESSAGE + b'[{"role": "user", "content": "hi"}]}', "text/plain", 415),
        (MESSAGE + b'[{"role": "user", "content": "hi"}]}', None, 415),
    ],
    ids=[
        "empty", "not-json", "null", "truncated", "empty-messages", "messages-object",
        "content-number", "unknown-block", "block-without-type", "image-block", "system-number",
        "server-tool", "unknown-tool-choice", "max-tokens-string", "deeply-nested", "2-mb",
        "invalid-utf8", "text-plain", "no-content-type",
    ],
)  # fmt: skip
def test_hostile_messages_get_a_4xx_in_anthropic_shape(
    red: Gateway, body: bytes, content_type: str | None, status: int
) -> None:
    """/v1/messages, Anthropic's API, refuses as chat completions do, in its own shape
    (gateway.api.anthropic), with the key as Anthropic's clients send it."""
    headers = {"x-api-key": KEY_A}
    if content_type is not None:
        headers["content-type"] = content_type
    response = httpx.post(f"{red.url}/v1/messages", content=body, headers=headers, timeout=60)
    assert response.status_code == status, response.text
    refusal = response.json()
    assert refusal["type"] == "error" and set(refusal["error"]) == {"type", "message"}
    assert len(refusal["error"]["message"]) < 1000


def test_hostile_headers_are_refused_or_ignored(red: Gateway) -> None:
    for cache in ("everything", "bypass, " + "x" * 5000):
        error = error_of(red.chat(CHAT, headers={"x-satisfice-cache": cache}), 400)
        assert error["param"] == "x-satisfice-cache" and len(error["message"]) < 300
    for rid in ("x" * 500, ""):
        answered = red.chat(CHAT, headers={"x-request-id": rid})
        assert answered.status_code == 200 and answered.headers["x-request-id"] != rid
    kept = red.chat(CHAT, headers={"x-request-id": "trace-me-42"})
    assert kept.headers["x-request-id"] == "trace-me-42"


def test_garbage_on_the_wire_gets_400_and_the_server_goes_on(red: Gateway) -> None:
    for garbage in (b"\x00\x01\x02 nonsense\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n"):
        with connect(red) as sock:
            sock.sendall(garbage)
            assert read_all(sock).startswith(b"HTTP/1.1 400 ")
    assert httpx.get(f"{red.url}/healthz").json() == {"status": "ok"}


def test_a_broken_config_while_serving_keeps_the_last_good_one(red: Gateway) -> None:
    assert red.process is not None
    path = config_file(red.process)
    good = path.read_text()
    failures = red.metric("satisfice_config_reloads_total", result="failure")
    try:
        path.write_text(good.replace("max_tokens_cap: 512", "max_tokens_cap: lots"))
        red.process.send_signal(signal.SIGHUP)
        until(
            lambda: red.metric("satisfice_config_reloads_total", result="failure") > failures,
            "the broken config refused",
        )
    finally:
        path.write_text(good)
    assert red.chat(CHAT).status_code == 200
    assert error_of(red.chat({**CHAT, "max_tokens": 513}), 400)["param"] == "max_tokens"


# -- the second pass (issue 32) ------------------------------------------------------


def warm(red: Gateway, tenant: str, lines: list[tuple[str, str]]) -> None:
    body = "".join(
        json.dumps({"prompt": prompt, "response": answer, "model": "small"}) + "\n"
        for prompt, answer in lines
    )
    with red.admin() as admin:
        report = admin.post("/admin/cache/warmup", params={"tenant": tenant}, content=body)
    assert report.status_code == 200 and report.json()["bad"] == 0, report.text


def cached_only(
    red: Gateway, prompt: str, key: str = KEY_A, headers: dict[str, str] | None = None
) -> httpx.Response:
    """The cache's answer to ``prompt`` (greedy, as warm-up stores), or its 504."""
    body = {"model": "small", "messages": user(prompt), "temperature": 0}
    return red.chat(body, key=key, headers={"cache-control": "only-if-cached", **(headers or {})})


# Issue 32's probes that were served the cached answer of their opposite.
POLARITY = [
    ("Is this medication safe during pregnancy?", "Yes, it is considered safe.",
     "Is this medication unsafe during pregnancy?"),
    ("Is it legal to drive at 16 in California?", "Yes, with a provisional license.",
     "Is it illegal to drive at 16 in California?"),
    ("Is Python faster than C?", "No, C is generally faster.", "Is Python slower than C?"),
    ("Is the Sun larger than the Earth?", "Yes, far larger.", "Is the Sun smaller than the Earth?"),
    ("Are refunds allowed within 30 days?", "Yes, within 30 days.",
     "Are refunds allowed after 30 days?"),
    ("Do all mammals lay eggs?", "No, only monotremes do.", "Do some mammals lay eggs?"),
    ("Does caffeine raise heart rate?", "Yes, briefly.", "Does caffeine lower heart rate?"),
    ("Is the return window longer than 14 days?", "Yes, it is 30 days.",
     "Is the return window shorter than 14 days?"),
]  # fmt: skip


def test_a_question_of_the_opposite_polarity_is_not_served_the_cached_answer(
    red: Gateway,
) -> None:
    warm(red, "tB", [(cached, answer) for cached, answer, _ in POLARITY])
    assert cached_only(red, POLARITY[0][0], key=KEY_B).status_code == 200  # warmed
    for cached, answer, flipped in POLARITY:
        response = cached_only(red, flipped, key=KEY_B)
        assert response.status_code == 504, f"{flipped!r} was served {answer!r} ({cached!r})"


def test_exact_keys_keep_what_changes_an_answer(red: Gateway) -> None:
    """Case, end punctuation and indentation are not folded into one exact key, and the
    semantic path's guards tell those prompts apart too."""
    code = "Why does this fail?\nfor n in range(3):\n    print(n)"
    warm(red, "tB", [("What is 5!", "5! = 120."), ("Convert 1 MB to bits", "8,000,000 bits."),
                     (code, "It does not fail.")])  # fmt: skip
    assert cached_only(red, "What is 5!", key=KEY_B).status_code == 200
    assert cached_only(red, "  What is 5!\n", key=KEY_B).status_code == 200  # spaces around
    for other in ("What is 5?", "Convert 1 Mb to bits", code.replace("    print", "print")):
        response = cached_only(red, other, key=KEY_B)
        assert response.status_code == 504, f"{other!r} was served {response.text}"


def test_cache_control_max_age_and_pragma_are_obeyed(red: Gateway) -> None:
    warm(red, "tB", [("What is the airspeed of a swallow?", "About 11 m/s.")])
    prompt = "What is the airspeed of a swallow?"
    assert cached_only(red, prompt, key=KEY_B).status_code == 200
    assert cached_only(red, prompt, key=KEY_B, headers={"cache-control": "max-age=3600, "
                       "only-if-cached"}).status_code == 200  # fmt: skip
    for stale in ("max-age=0, only-if-cached", "only-if-cached, max-age=nonsense"):
        response = cached_only(red, prompt, key=KEY_B, headers={"cache-control": stale})
        assert error_of(response, 504)["code"] == "cache_miss", stale
    body = {"model": "small", "messages": user(prompt), "temperature": 0, "max_tokens": 1}
    pragma = red.chat(body, key=KEY_B, headers={"pragma": "no-cache"})
    assert pragma.headers["x-satisfice-cache"] == "bypass"


LONG_PROMPT = " ".join(
    f"Section {n}: the harbour trade grew as ships carried grain, salt and wool."
    for n in range(250)
)  # ~3,000 words


def test_a_long_prompt_answers_within_its_deadline(red: Gateway) -> None:
    """Issue 32: a 3,000-word prompt ran 35 s past its 5 s deadline while it was read."""
    unread = ("satisfice_engine_unread_prompts_total", {"engine": "small", "why": "stopped"})
    before = red.metric(unread[0], **unread[1])
    body = {"model": "small", "messages": user(LONG_PROMPT + " Summarise it."), "max_tokens": 8}
    started = time.monotonic()
    response = red.chat(body, headers={"x-satisfice-deadline-ms": "1000", **BYPASS})
    elapsed = time.monotonic() - started
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] == "deadline"
    assert elapsed < 1.0 + 0.5  # reading it whole takes this host some 20 s
    assert red.metric(unread[0], **unread[1]) == before + 1
    # Once the engine has read a prompt of some length, one it cannot read in time is
    # refused at once rather than at the deadline.
    red.chat(
        {"model": "small", "messages": user(LONG_PROMPT[:600]), "max_tokens": 1}, headers=BYPASS
    )
    predicted = red.metric(unread[0], engine="small", why="predicted")
    started = time.monotonic()
    refused = red.chat(
        {**body, "messages": user("Read this. " + LONG_PROMPT)},
        headers={"x-satisfice-deadline-ms": "2000", **BYPASS},
    )
    assert time.monotonic() - started < 1.0
    assert refused.json()["choices"][0]["finish_reason"] == "deadline"
    assert red.metric(unread[0], engine="small", why="predicted") == predicted + 1
    # llama.cpp's own lines about the stop it was asked for are no errors, and they
    # keep to the log's format (JSON here) like every other line.
    lines = red.log.read_text(errors="replace").splitlines()
    assert not [line for line in lines if not line.startswith("{")]
    assert not [line for line in lines if '"ERROR"' in line and "llama_cpp" in line]


def test_a_client_that_leaves_while_its_prompt_is_read_frees_the_slot(red: Gateway) -> None:
    engine = Engine(red, "small", "small")
    gone = engine.ended(499)
    body = {"model": "small", "messages": user("Count the sections. " + LONG_PROMPT),
            "max_tokens": 8}  # fmt: skip
    sock = send_raw(red, body, headers=BYPASS)
    until(lambda: engine.busy() == 1, "small reading the prompt")
    time.sleep(0.5)
    sock.close()
    left = time.monotonic()
    until(lambda: engine.ended(499) == gone + 1, "the request ended 499")
    until(lambda: engine.busy() == 0, "small's slot free", timeout_s=5)
    assert time.monotonic() - left < 2.0  # the whole prompt takes this host some 20 s


BOILING = "What is the boiling point of water at sea level?"
BOILING_AGAIN = "Tell me the boiling point of water at sea level."


def _semantic_hit(red: Gateway) -> httpx.Response:
    response = cached_only(red, BOILING_AGAIN)
    assert response.headers["x-satisfice-cache"] == "semantic", response.headers
    return response


def test_a_report_survives_a_fresh_answer_and_counts_once(red: Gateway) -> None:
    """Issue 32: regenerating the answer (Cache-Control: no-cache) wiped the report, and
    a replayed report counted every time."""
    with red.admin() as admin:
        assert admin.post("/admin/cache/invalidate", json={"namespace": "tA"}).is_success
    body = {"model": "small", "messages": user(BOILING), "temperature": 0, "max_tokens": 256}
    first = red.chat(body)
    assert first.json()["choices"][0]["finish_reason"] == "stop", first.text
    until(lambda: cached_only(red, BOILING).status_code == 200, "the answer cached")
    hit = _semantic_hit(red)
    counted = red.metric("satisfice_cache_false_hits_reported_total", tenant="tA")
    feedback = f"{red.url}/v1/feedback"
    auth = {"authorization": f"Bearer {KEY_A}"}
    report = httpx.post(feedback, json={"request_id": hit.headers["x-request-id"]}, headers=auth)
    assert report.status_code == 200 and report.json()["raised"] is True, report.text
    replay = httpx.post(feedback, json={"request_id": hit.headers["x-request-id"]}, headers=auth)
    assert replay.status_code == 200 and replay.json()["raised"] is False
    assert red.metric("satisfice_cache_false_hits_reported_total", tenant="tA") == counted + 1
    assert cached_only(red, BOILING_AGAIN).headers["x-satisfice-cache-stage"] == "feedback"
    # The same prompt answered anew and stored again keeps the floor.
    fresh = red.chat(body, headers={"cache-control": "no-cache"})
    assert fresh.headers["x-satisfice-cache"] == "bypass"
    time.sleep(0.5)  # the write-back is in the background
    assert cached_only(red, BOILING).status_code == 200
    turned_down = cached_only(red, BOILING_AGAIN)
    assert turned_down.status_code == 504
    assert turned_down.headers["x-satisfice-cache-stage"] == "feedback"


def test_a_huge_model_name_is_not_written_whole_to_the_log(red: Gateway) -> None:
    error_of(red.chat({**CHAT, "model": "q" * 900_000}), 404)
    until(lambda: "qqqq" in red.log.read_text(errors="replace"), "the access line")
    lines = [line for line in red.log.read_text(errors="replace").splitlines() if "qqqq" in line]
    assert lines and max(len(line) for line in lines) < 2_000


def test_a_loop_without_an_answer_at_its_deadline_says_what_it_tried(red: Gateway) -> None:
    """Under fallback "best" (the config's), a loop with no answer yet at its deadline
    falls back to the small engine's answer in the time left; only when that gives none
    either is it a 504, which no longer blames an "error" policy."""
    body = {"model": "auto", "messages": user(COUNTING), "max_tokens": 400}
    response = red.chat(body, key=THINKER, headers={"x-satisfice-deadline-ms": "1500", **BYPASS})
    if response.status_code == 200:
        assert response.headers["x-satisfice-fallback"] in ("best", "small")
        return
    message = error_of(response, 504)["message"]
    assert "fallback policy is error" not in message and "small engine" in message


# Two replicas on one Redis, each with the small engine alone.
def _replica_config(prefix: str) -> str:
    return f"""
server:
  admin_key: {ADMIN}
cache:
  store: {{kind: redis, url: "redis://127.0.0.1:6379/0", key_prefix: {prefix}}}
engines:
  small:
    backend: llama_cpp
    model: smollm2-135m-instruct
"""


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, Gateway]]:
    prefix = f"red-team-{uuid.uuid4().hex}"
    started: list[subprocess.Popen[bytes]] = []
    try:
        gateways = []
        for name in ("a", "b"):
            folder = tmp_path_factory.mktemp(f"replica-{name}")
            url, process = start_gateway(_replica_config(prefix), folder)
            started.append(process)
            gateways.append(Gateway(url, folder / "unused.log", process))
        yield gateways[0], gateways[1]
    finally:
        for process in started:
            stop(process)
        scan = ["redis-cli", "--scan", "--pattern", f"{prefix}*"]
        keys = subprocess.run(scan, capture_output=True, text=True, check=False).stdout.split()
        if keys:
            subprocess.run(["redis-cli", "unlink", *keys], capture_output=True, check=False)


def test_a_report_racing_an_invalidation_never_brings_the_entry_back(
    replicas: tuple[Gateway, Gateway],
) -> None:
    """Issue 32 (6 of 6 tries): a report read the entry and wrote it back whole, so an
    invalidation in between was undone, and both replicas served the entry again as an
    exact hit after the admin was told it was deleted. Redis holds writes back for a
    moment (CLIENT PAUSE ... WRITE, well within the stores' timeouts) while replica a
    invalidates and replica b takes a report: both have read what they read, and their
    writes land in the order they were sent, the invalidation's first."""
    a, b = replicas
    pausing = RedisClient.from_url("redis://127.0.0.1:6379/0")
    try:
        for attempt in range(6):
            prompt = f"What is stored in warehouse bay number {attempt}?"
            warm(a, "default", [(prompt, f"Crates of kind {attempt}.")])
            until(lambda p=prompt: cached_only(b, p).status_code == 200, "b serves it")  # type: ignore[misc]
            entry = cached_only(b, prompt).headers["x-satisfice-cache-entry"]
            with ThreadPoolExecutor(2) as pool, a.admin() as admin:
                pausing.client_pause(150, all=False)
                dropping = pool.submit(
                    admin.post, "/admin/cache/invalidate", json={"namespace": "default"}
                )
                time.sleep(0.03)  # a has scanned and waits to unlink
                report = httpx.post(f"{b.url}/v1/feedback", json={"entry_id": entry, "score": 0.9})
                assert dropping.result().json()["deleted"] == 1
            assert report.status_code in (200, 404), report.text
            time.sleep(0.2)  # each replica has heard of the invalidation by now
            for replica in (a, b):
                assert cached_only(replica, prompt).status_code == 504, f"attempt {attempt}"
    finally:
        pausing.client_unpause()
        pausing.close()


def test_a_replica_started_while_redis_is_down_says_so(tmp_path: Path) -> None:
    """Issue 32: its cache stage was "empty" and feedback answered 404, so clients
    dropped reports they should have sent again."""
    config = _replica_config("unreachable").replace("6379", str(free_port()))
    url, process = start_gateway(config, tmp_path)
    try:
        down = Gateway(url, tmp_path / "unused.log", process)
        response = cached_only(down, "What is the capital of France?")
        assert error_of(response, 504)["code"] == "cache_miss"
        assert response.headers["x-satisfice-cache-stage"] == "store_unavailable"
        report = httpx.post(f"{url}/v1/feedback", json={"entry_id": "12345", "score": 0.9})
        assert error_of(report, 503)["code"] == "store_unavailable"
    finally:
        stop(process)


# -- every request settles once (issue 33) ---------------------------------------------


def _load(red: Gateway, requests: int, clients: int) -> int:
    """A bounded mix from ``clients`` threads on 127.0.0.1: exact hits (plain and
    streamed), short misses, unknown models, bodies that are no request, a wrong key
    and a throttled one. The number of chat requests sent."""
    warmed = [f"What is {n} plus {n}?" for n in range(8)]
    for question in warmed:
        red.chat({"model": "small", "messages": user(question), "max_tokens": 4})

    def one(i: int) -> None:
        kind = i % 7
        body: dict[str, Any] = {"model": "small", "messages": user(warmed[i % 8]), "max_tokens": 4}
        if kind == 1:
            body["stream"] = True
        elif kind == 2:
            body["messages"] = user(f"Say the number {i}.")
        elif kind == 3:
            body["model"] = "no-such-model"
        if kind == 4:
            post_raw(red, b'{"model": "small", "messages": ')
        elif kind == 5:
            red.chat(body, key="not-a-key")
        elif kind == 6:
            red.chat(body, key=THROTTLED)
        else:
            red.chat(body)

    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(one, range(requests)))
    return len(warmed) + requests


def test_every_chat_request_settles_once(red: Gateway) -> None:
    """Runs last in this module: after every attack above (and a bounded load run), the
    requests counted in satisfice_requests_total are the requests that settled, one
    access line each, and every chat request the server saw has settled: none twice
    (two lines of one request id), none lost (a request with no settled line)."""
    before = _requests_total(red)
    sent = _load(red, requests=140, clients=12)
    until(lambda: _requests_total(red) - before == sent, f"{sent} requests settled", 30)
    time.sleep(1.0)  # nothing more settles late: a leader's work is long over
    total = _requests_total(red)
    assert total - before == sent
    settled: list[str] = []
    unsettled: set[str] = set()
    for line in red.log.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        record = json.loads(line)
        if record.get("logger") != "satisfice.access":
            continue
        if record["message"].startswith("chat completion "):
            settled.append(record.get("request_id", ""))
        elif record.get("path") == "/v1/chat/completions":
            # Only a leader whose client left writes this before it settles.
            unsettled.add(record.get("request_id", ""))
    assert len(settled) == total, "one access line per request counted"
    assert len(set(settled)) == len(settled), "a request settled twice"
    assert unsettled <= set(settled), "a chat request that never settled"


def _requests_total(red: Gateway) -> float:
    return sum(
        value for (name, _), value in red.metrics().items() if name == "satisfice_requests_total"
    )
