"""Overload with the cache on: when every engine that could answer is full, a request
that misses the exact cache is refused before it is embedded; exact hits still answer."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.support import start_gateway, stop

ADMIN = "shedding-admin"
CONFIG = f"""
server: {{admin_key: {ADMIN}}}
cache: {{}}
engines:
  small:
    backend: llama_cpp
    model: smollm2-135m-instruct
    queue_size: 0    # one answer at a time, none waiting: the second is shed
"""
LONG = {
    "model": "small",
    "max_tokens": 400,
    "temperature": 0,
    "stream": True,
    "messages": [{"role": "user", "content": "Count from 1 to 500, one per line."}],
}


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    started, process = start_gateway(CONFIG, tmp_path_factory.mktemp("shedding"))
    yield started
    stop(process)


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_a_full_engine_sheds_before_the_embedding(url: str) -> None:
    warm = httpx.post(
        f"{url}/admin/cache/warmup",
        json={"prompt": "What is the capital of Peru?", "response": "Lima.", "model": "small"},
        headers={"Authorization": f"Bearer {ADMIN}"},
    )
    assert warm.status_code == 200, warm.text
    generating = threading.Event()

    def occupy() -> None:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=LONG, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    generating.set()

    holder = threading.Thread(target=occupy)
    holder.start()
    try:
        assert generating.wait(60), "the long answer never started"
        misses = metric(url, "satisfice_cache_misses_total")
        body = {"model": "small", "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "user", "content": "Name a river in Peru."}]}  # fmt: skip
        shed = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert shed.status_code == 429, shed.text
        assert shed.json()["error"]["code"] == "engine_overloaded"
        assert shed.headers["retry-after"] == "1"
        # Refused before the semantic lookup, which needs the embedding: no miss counted.
        assert metric(url, "satisfice_cache_misses_total") == misses
        body["messages"] = [{"role": "user", "content": "What is the capital of Peru?"}]
        hit = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert hit.status_code == 200 and hit.headers["x-satisfice-cache"] == "exact"
        assert hit.json()["choices"][0]["message"]["content"] == "Lima."
    finally:
        holder.join(timeout=120)
    time.sleep(0.2)  # the slot is free again: the same question is answered
    assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).status_code == 200
