"""Hard questions over HTTP: the reasoning loop behind a real gateway process, asked
with the official openai client."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionChunk

from evaluator.calibration import Calibrator, write_calibrator
from evaluator.shown import FIRST_ANSWER_LABEL
from evaluator.signals import SignalSettings
from tests.support import BUNDLED_ENGINES, start_gateway, stop

# Every routed question is hard (threshold 0), and the calibrator (a real one with
# every weight zero) gives every answer P = 0.5, so only rounds, tokens and time stop
# the loop. The deadline is far beyond thirty rounds on any host, however busy, so
# that what stops a loop is what a test chose: its rounds, or a deadline header. The
# `user` field names a conversation here (server.user_is_conversation).
LOOP_CONFIG = f"""
server:
  user_is_conversation: true
router:
  threshold: 0.0
{BUNDLED_ENGINES}
loop:
  branches: 2
  max_rounds: 30
  round_tokens: 48
  calibrator: {{calibrator}}
sla:
  deadline_ms: {{large: 300000}}
  fallback: {{policy: best}}
"""

STORY = "Write a long story about a dragon who learns to fly."
QUESTION = {"role": "user", "content": "Is ice cold?"}
# For tests that want an answer, not thirty rounds: the best one so far, well within
# their client's timeout.
WITHIN_TIMEOUT = {"x-satisfice-deadline-ms": "20000"}


def half_calibrator(path: Path) -> str:
    """A real calibrator file whose P(correct) is 0.5 whatever the signals."""
    half = Calibrator(features=["vote_share"], signals=SignalSettings(), mean=[0.0],
                      scale=[1.0], weights=[0.0], bias=0.0)  # fmt: skip
    write_calibrator(half, path)
    return str(path)


@pytest.fixture(scope="module")
def loop_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("loop")
    config = LOOP_CONFIG.replace("{calibrator}", half_calibrator(folder / "half.calibrator"))
    url, process = start_gateway(config, folder)
    try:
        yield url
    finally:
        stop(process)


@pytest.fixture
def client(loop_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{loop_url}/v1", api_key="unused", max_retries=0)


def test_hard_question_is_answered_by_the_loop(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="auto", messages=[{"role": "user", "content": "Is the sun a star?"}]
    )
    completion = raw.parse()
    assert raw.headers["x-satisfice-route"] == "loop"
    assert raw.headers["x-satisfice-engine"] == "large"
    stop_reason = raw.headers["x-satisfice-stop"]
    assert stop_reason == "max_rounds"
    assert raw.headers["x-satisfice-fallback"] == "none"
    rounds = int(raw.headers["x-satisfice-rounds"])
    assert rounds == 30
    assert int(raw.headers["x-satisfice-branches"]) == 2 * rounds
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content
    # The decision trace rides along in the body; the openai client keeps extra fields.
    assert completion.model_extra is not None
    trace = completion.model_extra["satisfice"]
    assert trace["stop"] == stop_reason and trace["kind"] == "yesno"
    assert len(trace["rounds"]) == rounds
    assert trace["tokens"] == sum(r["tokens"] for r in trace["rounds"]) > 0
    assert completion.usage is not None and completion.usage.completion_tokens == trace["tokens"]
    assert float(raw.headers["x-satisfice-confidence"]) == pytest.approx(
        trace["confidence"], abs=1e-4
    )


def test_stream_shows_reasoning_first_then_the_answer(client: openai.OpenAI) -> None:
    started = time.perf_counter()
    stream = client.chat.completions.create(
        model="auto",
        messages=[{"role": "user", "content": "What is the capital of Spain?"}],
        max_tokens=8,  # thirty rounds of short branches
        stream=True,
        stream_options={"include_usage": True},
    )
    first_at = None
    reasoning: list[str] = []
    content: list[str] = []
    last: ChatCompletionChunk | None = None
    for chunk in stream:
        if first_at is None:
            first_at = time.perf_counter() - started
        if chunk.choices:
            delta = chunk.choices[0].delta
            extra = delta.model_extra or {}
            if extra.get("reasoning_content"):
                assert not content, "reasoning came after the answer"
                reasoning.append(extra["reasoning_content"])
            if delta.content:
                content.append(delta.content)
            if chunk.choices[0].finish_reason:
                last = chunk
    assert reasoning and reasoning[0].startswith("Thinking")
    assert any(r.startswith("Round 1") for r in reasoning)
    assert "".join(content).strip()
    assert last is not None and last.choices[0].finish_reason == "stop"
    trace = (last.model_extra or {})["satisfice"]
    assert trace["fallback"] == "none" and trace["rounds"]
    assert chunk.usage is not None and chunk.usage.completion_tokens == trace["tokens"]
    assert first_at is not None


def test_stream_shows_the_branch_as_it_thinks_and_a_first_answer_first(
    client: openai.OpenAI,
) -> None:
    """With x-satisfice-first-answer, the small model's answer streams first, marked
    provisional, in reasoning_content; the first branch streams token by token; the
    content is the loop's answer alone, and the trace says what became of the first."""
    stream = client.chat.completions.create(
        model="auto",
        messages=[{"role": "user", "content": "What is 12 + 30?"}],
        max_tokens=8,
        stream=True,
        extra_headers={"x-satisfice-deadline-ms": "8000",
                       "x-satisfice-first-answer": "true", "x-satisfice-cache": "bypass"},
    )  # fmt: skip
    reasoning: list[str] = []
    content: list[str] = []
    trace: dict[str, Any] = {}
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if text := (delta.model_extra or {}).get("reasoning_content"):
            assert not content, "reasoning came after the answer"
            reasoning.append(text)
        if delta.content:
            content.append(delta.content)
        if chunk.choices[0].finish_reason:
            trace = (chunk.model_extra or {})["satisfice"]
    shown = "".join(reasoning)
    assert FIRST_ANSWER_LABEL in shown
    assert FIRST_ANSWER_LABEL not in "".join(content) and "".join(content).strip()
    # Beyond the opening note, round notes and the first answer: the branch's tokens,
    # one piece each.
    assert len(reasoning) > 2 + 8 + len(trace["rounds"])
    assert trace["first_answer"]["verdict"] in ("confirmed", "replaced", "unfinished")
    assert trace["first_shown_ms"] is not None and trace["first_shown_ms"] < trace["elapsed_ms"]


def test_a_plain_answer_carries_its_reasoning_on_request(client: openai.OpenAI) -> None:
    ask = {
        "model": "auto",
        "messages": [{"role": "user", "content": "Is the sky blue?"}],
        "max_tokens": 8,
    }
    quick = {"x-satisfice-deadline-ms": "5000", "x-satisfice-cache": "bypass"}
    plain = client.chat.completions.create(**ask, extra_headers=quick)  # type: ignore[call-overload]
    assert "reasoning_content" not in (plain.choices[0].message.model_extra or {})
    reasoned = client.chat.completions.create(  # type: ignore[call-overload]
        **ask, extra_headers={**quick, "x-satisfice-reasoning": "true"}
    )
    message = reasoned.choices[0].message
    reasoning = (message.model_extra or {})["reasoning_content"]
    assert reasoning.startswith("Thinking") and "Round 1" in reasoning
    assert message.content and message.content not in ("", reasoning)


def test_deadline_header_shortens_the_deadline(loop_url: str) -> None:
    body = {"model": "auto", "messages": [{"role": "user", "content": STORY}]}
    started = time.perf_counter()
    response = httpx.post(
        f"{loop_url}/v1/chat/completions",
        json=body,
        headers={"x-satisfice-deadline-ms": "1"},
        timeout=30,
    )
    elapsed = time.perf_counter() - started
    # Nothing can answer within 1 ms, so even "best" has nothing to give.
    assert response.status_code == 504, response.text
    assert response.json()["error"]["code"] == "deadline_exceeded"
    assert response.headers["x-satisfice-stop"] == "deadline"
    assert response.headers["x-satisfice-fallback"] == "error"
    assert elapsed < 5


def test_best_answer_so_far_at_the_deadline(loop_url: str) -> None:
    # The deadline is a few rounds of this host, as fast or as busy as it is now (one
    # round: the large model's two samples, asked for directly), so that one round fits
    # in it and thirty do not: rounds go on until it leaves no time for another.
    body = {"model": "auto", "messages": [{"role": "user", "content": STORY}], "max_tokens": 32}
    started = time.perf_counter()
    one_round = httpx.post(
        f"{loop_url}/v1/chat/completions", json={**body, "model": "large", "n": 2}, timeout=60
    )
    assert one_round.status_code == 200, one_round.text
    deadline_ms = max(2500, round(4000 * (time.perf_counter() - started)))
    response = httpx.post(
        f"{loop_url}/v1/chat/completions",
        json=body,
        headers={"x-satisfice-deadline-ms": str(deadline_ms)},
        timeout=deadline_ms / 1000 + 30,
    )
    assert response.status_code == 200, response.text
    trace = response.json()["satisfice"]
    assert trace["stop"] == "deadline" and trace["fallback"] == "best"
    assert trace["rounds"] and trace["rounds"][0]["answer"]
    assert trace["elapsed_ms"] < deadline_ms + 400
    assert response.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize(
    ("header", "value"),
    [*(("x-satisfice-deadline-ms", v) for v in ("soon", "0", "-5", "1.5")),
     *(("x-satisfice-first-answer", v) for v in ("maybe", "2", ""))],
)  # fmt: skip
def test_bad_header_is_refused_naming_it(loop_url: str, header: str, value: str) -> None:
    response = httpx.post(
        f"{loop_url}/v1/chat/completions",
        json={"model": "auto", "messages": [{"role": "user", "content": "hi"}]},
        headers={header: value},
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == header and value in error["message"]


def test_new_turn_stops_the_last_one(loop_url: str) -> None:
    """A second turn of the same conversation ends the first one's stream at once and
    says how long stopping it took."""
    body = {
        "model": "auto",
        "messages": [{"role": "user", "content": STORY}],
        "stream": True,
        "user": "reader-1",
    }
    events: list[dict[str, Any]] = []
    first_seen = threading.Event()

    def read_first_turn() -> None:
        with httpx.stream("POST", f"{loop_url}/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
                    first_seen.set()

    reader = threading.Thread(target=read_first_turn)
    reader.start()
    assert first_seen.wait(30)
    time.sleep(0.3)  # the first turn is generating now
    second = httpx.post(
        f"{loop_url}/v1/chat/completions",
        json={**body, "stream": False, "messages": [QUESTION]},
        headers=WITHIN_TIMEOUT,
        timeout=60,
    )
    reader.join(30)
    assert not reader.is_alive()
    assert second.status_code == 200
    stopped_ms = float(second.headers["x-satisfice-superseded-ms"])
    assert 0 <= stopped_ms < 1000
    last = events[-1]
    assert "error" in last and last["error"]["code"] == "superseded"


def test_other_conversations_are_left_alone(loop_url: str) -> None:
    response = httpx.post(
        f"{loop_url}/v1/chat/completions",
        json={
            "model": "auto",
            "messages": [QUESTION],
            "user": "reader-2",
        },
        headers=WITHIN_TIMEOUT,
        timeout=60,
    )
    assert response.status_code == 200
    assert "x-satisfice-superseded-ms" not in response.headers


def test_requests_for_several_samples_skip_the_loop(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="auto", messages=[{"role": "user", "content": "Is ice cold?"}], n=2, max_tokens=8
    )
    assert raw.headers["x-satisfice-route"] == "large"
    assert len(raw.parse().choices) == 2


def escalating_config(calibrator: str, escalate_below: float) -> str:
    # Every routed question is easy (threshold far above any score).
    return f"""
router:
  threshold: 1000.0
{BUNDLED_ENGINES}
loop:
  branches: 2
  max_rounds: 1
  calibrator: {calibrator}
  escalate_below: {escalate_below}
"""


@pytest.mark.parametrize(
    "escalate_below",
    # Slow: one gateway each; the default run keeps the one that escalates.
    [0.6, pytest.param(0.4, marks=pytest.mark.slow)],
)
def test_doubtful_easy_answers_escalate(
    tmp_path_factory: pytest.TempPathFactory, escalate_below: float
) -> None:
    folder = tmp_path_factory.mktemp("escalate")
    calibrator = half_calibrator(folder / "half.calibrator")
    url, process = start_gateway(escalating_config(calibrator, escalate_below), folder)
    try:
        response = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": "auto", "messages": [{"role": "user", "content": "Is ice cold?"}]},
            timeout=60,
        )
    finally:
        stop(process)
    assert response.status_code == 200, response.text
    answer = response.json()["choices"][0]["message"]["content"]
    assert answer.strip()
    if escalate_below > 0.5:
        assert response.headers["x-satisfice-route"] == "loop"
        assert response.headers["x-satisfice-escalated-from"] == "small"
        assert response.json()["satisfice"]["rounds"]
    else:
        assert response.headers["x-satisfice-route"] == "small"
        assert float(response.headers["x-satisfice-confidence"]) == pytest.approx(0.5)
        assert "satisfice" not in response.json()
