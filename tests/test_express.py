"""The express path answers exactly what the full path would: one real gateway asked the
same requests with server.express_hits on, then (reloaded) off, compared byte for byte
but for each response's own id and time; and with keys, rate limits and metrics."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.ops.keys import hash_key
from tests.support import BUNDLED_ENGINES, config_file, start_gateway, stop

ADMIN_KEY = "express-admin"
OPEN_KEY = "express-key"
LIMITED_KEY = "express-limited"
LIMIT = 3  # requests per minute of the limited key

CONFIG = f"""
server:
  admin_key: {ADMIN_KEY}
  express_hits: true
router: {{}}
cache: {{}}
auth:
  keys:
    open:
      sha256: {hash_key(OPEN_KEY)}
      tenant: default
    limited:
      sha256: {hash_key(LIMITED_KEY)}
      tenant: limited
      requests_per_minute: {LIMIT}
{BUNDLED_ENGINES}
"""

WARMED = [
    {"prompt": "What is the capital of France?", "response": "Paris.", "model": "small"},
    {"prompt": "What is the capital of France?", "response": "Paris!", "model": "auto"},
    {"prompt": "Name a primary colour.", "response": "Red — or \"blue\".", "model": "small",
     "system": "Answer in one word."},
]  # fmt: skip
ONLY_CACHED = {"cache-control": "only-if-cached"}


def chat(content: str, **fields: Any) -> dict[str, Any]:
    return {"model": "small", "messages": [{"role": "user", "content": content}], **fields}


FRANCE = chat("What is the capital of France?")
DEEP_FIELD = "[" * 300 + "]" * 300
TOO_DEEP = "[" * 5000 + "]" * 5000

# (name, extra headers, body): every kind of request the express path must either
# answer as the full path does, or leave to it. A miss would generate: these say
# only-if-cached where one could.
CASES: list[tuple[str, dict[str, str], bytes]] = [
    ("exact", {}, json.dumps(FRANCE).encode()),
    ("normalised", {}, json.dumps(chat("  What is the capital of France?\n")).encode()),
    ("stream", {}, json.dumps({**FRANCE, "stream": True}).encode()),
    ("stream with usage", {}, json.dumps(
        {**FRANCE, "stream": True, "stream_options": {"include_usage": True}}).encode()),
    ("auto", {}, json.dumps({**FRANCE, "model": "auto"}).encode()),
    ("system prompt", {}, json.dumps({"model": "small", "messages": [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Name a primary colour."}]}).encode()),
    ("no-store", {"x-satisfice-cache": "no-store"}, json.dumps(FRANCE).encode()),
    ("bypass", {"x-satisfice-cache": "bypass", **ONLY_CACHED}, json.dumps(FRANCE).encode()),
    ("only-if-cached", ONLY_CACHED, json.dumps(FRANCE).encode()),
    ("deadline", {"x-satisfice-deadline-ms": "5000"}, json.dumps(FRANCE).encode()),
    ("bad deadline", {"x-satisfice-deadline-ms": "soon"}, json.dumps(FRANCE).encode()),
    ("trace", {"x-satisfice-trace": "true"}, json.dumps(FRANCE).encode()),
    ("conversation", {"x-satisfice-conversation": "c-1"}, json.dumps(FRANCE).encode()),
    ("sampled", ONLY_CACHED, json.dumps({**FRANCE, "temperature": 0.7}).encode()),
    ("n=2", ONLY_CACHED, json.dumps({**FRANCE, "n": 2}).encode()),
    ("empty tools", {}, json.dumps({**FRANCE, "tools": []}).encode()),
    ("tools", {}, json.dumps({**FRANCE, "tools": [{"type": "function"}]}).encode()),
    ("unknown field", {}, json.dumps({**FRANCE, "metadata": {"a": 1}}).encode()),
    ("deep unknown field", {},
     json.dumps(FRANCE)[:-1].encode() + b', "x": ' + DEEP_FIELD.encode() + b"}"),
    ("too deep", {}, json.dumps(FRANCE)[:-1].encode() + b', "x": ' + TOO_DEEP.encode() + b"}"),
    ("string temperature", ONLY_CACHED, json.dumps({**FRANCE, "temperature": "0"}).encode()),
    ("unknown model", {}, json.dumps({**FRANCE, "model": "huge"}).encode()),
    ("no messages", {}, json.dumps({"model": "small", "messages": []}).encode()),
    ("not json", {}, b'{"model": "small", "messages": ['),
    ("text/plain", {"content-type": "text/plain"}, json.dumps(FRANCE).encode()),
    ("no key", {"authorization": ""}, json.dumps(FRANCE).encode()),
    ("wrong key", {"authorization": "Bearer nope"}, json.dumps(FRANCE).encode()),
    ("too many messages", {}, json.dumps({"model": "small", "messages": [
        {"role": "user", "content": "hi"}] * 300}).encode()),
]  # fmt: skip
SERVED_EXPRESS = {
    "exact", "normalised", "stream", "stream with usage", "auto", "system prompt",
    "no-store", "only-if-cached", "deadline", "empty tools", "unknown field",
}  # fmt: skip

# Headers that say what was decided, as against how the bytes were framed.
_COMPARED = re.compile(r"^(x-satisfice-.*|content-type|cache-control|retry-after|server-timing)$")
_ID = re.compile(rb'"id":"chatcmpl-[0-9a-f]{32}"')
_CREATED = re.compile(rb'"created":[0-9]+')


def normalised(response: httpx.Response) -> tuple[int, dict[str, str], bytes]:
    headers = {k: v for k, v in response.headers.items() if _COMPARED.match(k)}
    body = _CREATED.sub(b'"created":0', _ID.sub(b'"id":"chatcmpl-x"', response.content))
    return response.status_code, headers, body


def ask_all(url: str) -> dict[str, tuple[int, dict[str, str], bytes]]:
    base = {"content-type": "application/json", "authorization": f"Bearer {OPEN_KEY}"}
    answers = {}
    with httpx.Client(base_url=url, timeout=60) as http:
        for name, headers, body in CASES:
            sent = {**base, **headers}
            sent = {k: v for k, v in sent.items() if v}
            response = http.post("/v1/chat/completions", content=body, headers=sent)
            answers[name] = normalised(response)
    return answers


def metric(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(f"{url}/metrics").text
    pattern = re.compile(rf"^{name}(\{{{re.escape(labels)}\}})? ([0-9.e+]+)$", re.MULTILINE)
    found = pattern.findall(text)
    return sum(float(value) for _, value in found)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, int]]:
    url, process = start_gateway(CONFIG, tmp_path_factory.mktemp("express"))
    try:
        for tenant in ("default", "limited"):
            lines = "\n".join(json.dumps(line) for line in WARMED).encode()
            report = httpx.post(
                f"{url}/admin/cache/warmup", params={"tenant": tenant}, content=lines,
                headers={"authorization": f"Bearer {ADMIN_KEY}"},
            ).json()  # fmt: skip
            assert report["added"] == len(WARMED)
        yield url, config_file(process), process.pid
    finally:
        stop(process)


def reload_with(url: str, path: Path, pid: int, text: str) -> None:
    before = metric(url, "satisfice_config_reloads_total", 'result="success"')
    path.write_text(text)
    os.kill(pid, signal.SIGHUP)
    deadline = time.monotonic() + 10
    while metric(url, "satisfice_config_reloads_total", 'result="success"') == before:
        assert time.monotonic() < deadline, "the config was not reloaded"
        time.sleep(0.05)


def test_express_answers_what_the_full_path_does(gateway: tuple[str, Path, int]) -> None:
    url, path, pid = gateway
    express_before = metric(url, "satisfice_express_hits_total")
    hits_before = metric(url, "satisfice_cache_hits_total", 'path="exact"')
    express = ask_all(url)
    served = metric(url, "satisfice_express_hits_total") - express_before
    hits = metric(url, "satisfice_cache_hits_total", 'path="exact"') - hits_before
    assert served == len(SERVED_EXPRESS)  # the rest went on to the full path
    reload_with(url, path, pid, CONFIG.replace("express_hits: true", "express_hits: false"))
    try:
        full = ask_all(url)
        assert metric(url, "satisfice_express_hits_total") - express_before == served
        assert metric(url, "satisfice_cache_hits_total", 'path="exact"') - hits_before == 2 * hits
    finally:
        reload_with(url, path, pid, CONFIG)
    for name, _, _ in CASES:
        assert express[name] == full[name], name
    # And the answers are what they should be, not merely alike.
    assert express["exact"][0] == 200 and b'"content":"Paris."' in express["exact"][2]
    assert express["exact"][1]["x-satisfice-cache"] == "exact"
    assert b'"content":"Paris!"' in express["auto"][2]
    assert "Red" in json.loads(express["system prompt"][2])["choices"][0]["message"]["content"]
    stream = express["stream with usage"][2].split(b"\n\n")
    assert stream[-2:] == [b"data: [DONE]", b""] and b'"usage":{"prompt_tokens"' in stream[-3]
    statuses = {name: answer[0] for name, answer in express.items()}
    assert statuses["bypass"] == statuses["n=2"] == statuses["sampled"] == 504
    assert statuses["too deep"] == statuses["bad deadline"] == statuses["tools"] == 400
    assert statuses["deep unknown field"] == statuses["trace"] == 200
    assert statuses["no key"] == statuses["wrong key"] == 401
    assert statuses["text/plain"] == 415 and statuses["unknown model"] == 404


def test_a_rate_limited_key_is_charged_once_per_hit(gateway: tuple[str, Path, int]) -> None:
    url, _, _ = gateway
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=LIMITED_KEY, max_retries=0)
    express_before = metric(url, "satisfice_express_hits_total")
    for _ in range(LIMIT):
        raw = client.chat.completions.with_raw_response.create(
            model="small", messages=[{"role": "user", "content": "What is the capital of France?"}]
        )
        assert raw.headers["x-satisfice-cache"] == "exact"
        assert raw.parse().choices[0].message.content == "Paris."
    assert metric(url, "satisfice_express_hits_total") - express_before == LIMIT
    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(
            model="small", messages=[{"role": "user", "content": "What is the capital of France?"}]
        )
    assert int(refused.value.response.headers["retry-after"]) >= 1
    assert metric(url, "satisfice_express_hits_total") - express_before == LIMIT


def test_an_express_hit_is_counted_and_logged_as_the_full_paths(
    gateway: tuple[str, Path, int],
) -> None:
    url, _, _ = gateway
    before = metric(url, "satisfice_requests_total", 'route="exact",status="200"')
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=OPEN_KEY, max_retries=0)
    stream = client.chat.completions.create(
        model="small",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "Paris."
    assert metric(url, "satisfice_requests_total", 'route="exact",status="200"') == before + 1
