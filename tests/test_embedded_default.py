"""The embedded default as `make serve` runs it: the Qwen pair behind `auto`.

Slow: it loads the bundled models of the default config (about 1.7 GB) and lets the
1.5B reason through a word problem on these cores (about a minute).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from tests.support import ROOT, start_gateway, stop

pytestmark = pytest.mark.slow

WORD_PROBLEM = (
    "Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning and "
    "bakes muffins for her friends every day with four. She sells the remainder at the "
    "farmers' market daily for $2 per fresh duck egg. How much in dollars does she make "
    "every day at the farmers' market?"
)


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenAI]:
    default = (ROOT / "gateway" / "config" / "default.yaml").read_text("utf-8")
    url, process = start_gateway(default, Path(tmp_path_factory.mktemp("default")))
    try:
        yield OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=300, max_retries=0)
    finally:
        stop(process)


def test_a_simple_fact_is_answered_by_the_small_model(client: OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="auto", messages=[{"role": "user", "content": "What is the capital of France?"}]
    )
    assert (raw.headers["x-satisfice-route"], raw.headers["x-satisfice-engine"]) == (
        "small",
        "small",
    )
    assert "Paris" in (raw.parse().choices[0].message.content or "")


def test_a_word_problem_goes_to_the_large_model_and_its_loop(client: OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="auto", messages=[{"role": "user", "content": WORD_PROBLEM}]
    )
    assert (raw.headers["x-satisfice-route"], raw.headers["x-satisfice-engine"]) == (
        "loop",
        "large",
    )
    assert int(raw.headers["x-satisfice-rounds"]) >= 1
    assert int(raw.headers["x-satisfice-tokens"]) > 0
    assert raw.parse().choices[0].message.content
