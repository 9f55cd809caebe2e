"""The three APIs are one pipeline: an answer cached for a chat completion serves the same
question asked through the Responses API and Anthropic's Messages, and the other way
round, while a request that differs in what it asks (a format) is another question."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support import start_gateway, stop

CONFIG = """
cache: {store: {kind: memory}}
engines:
  small: {backend: llama_cpp, model: smollm2-135m-instruct, template: chat}
"""


@pytest.fixture(scope="module")
def gateway_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A gateway with the cache in memory (the shared test gateway has none)."""
    url, process = start_gateway(CONFIG, tmp_path_factory.mktemp("dialects"))
    try:
        yield url
    finally:
        stop(process)


def _ask(url: str, api: str, question: str, **extra: Any) -> tuple[str, str]:
    """The answer's text and how the cache served it, through ``api``."""
    system = "Be brief."
    if api == "chat":
        body: dict[str, Any] = {
            "model": "small", "temperature": 0, "max_tokens": 64,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": question}],
        }  # fmt: skip
        response = httpx.post(f"{url}/v1/chat/completions", json=body | extra, timeout=120)
        text = response.json()["choices"][0]["message"]["content"]
    elif api == "responses":
        body = {"model": "small", "temperature": 0, "max_output_tokens": 64,
                "instructions": system, "input": question}  # fmt: skip
        response = httpx.post(f"{url}/v1/responses", json=body | extra, timeout=120)
        text = response.json()["output"][-1]["content"][0]["text"]
    else:
        body = {"model": "small", "temperature": 0, "max_tokens": 64, "system": system,
                "messages": [{"role": "user", "content": question}]}  # fmt: skip
        response = httpx.post(f"{url}/v1/messages", json=body | extra, timeout=120)
        text = response.json()["content"][0]["text"]
    assert response.status_code == 200, response.text
    return text, response.headers["x-satisfice-cache"]


def _whole_and_kept(url: str, api: str, question: str) -> str:
    """The first answer to ``question`` through ``api``, once the cache holds it (it is
    written back after it is sent): its text."""
    text, served = _ask(url, api, question)
    assert served == "miss"
    chat = {
        "model": "small", "temperature": 0, "max_tokens": 64,
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": question}],
    }  # fmt: skip
    for _ in range(200):  # only-if-cached: a miss is a 504, nothing is generated
        cached = httpx.post(
            f"{url}/v1/chat/completions", json=chat, headers={"cache-control": "only-if-cached"}
        )
        if cached.status_code == 200:
            return text
        time.sleep(0.05)
    raise AssertionError(f"the answer to {question!r} was never cached (cut short?)")


# Fixed questions (the gateway and its cache are this module's own): greedy, each has one
# answer, and each answer is whole within 64 tokens, so it is kept.
QUESTIONS = {
    "chat": "Say hello.",
    "responses": "What is the capital of France? One word.",
    "messages": "Say OK.",
}


def test_an_answer_cached_through_one_api_serves_the_others(gateway_url: str) -> None:
    for first, question in QUESTIONS.items():
        text = _whole_and_kept(gateway_url, first, question)
        for other in {"chat", "responses", "messages"} - {first}:
            assert _ask(gateway_url, other, question) == (text, "exact"), (first, other)


def test_a_format_asked_through_another_api_is_another_question(gateway_url: str) -> None:
    question = "Name a colour. One word."
    _whole_and_kept(gateway_url, "chat", question)
    formatted = {"text": {"format": {"type": "json_object"}}}
    _, served = _ask(gateway_url, "responses", question, **formatted)
    assert served == "miss"
