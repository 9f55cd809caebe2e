"""Hot reload of a real gateway process: on SIGHUP and on a changed file, validated
first, a bad or restart-only file refused with the last good config kept, and
requests in flight finishing on the config they started with."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import httpx
import pytest

from gateway.ops.keys import hash_key
from tests.support import config_file, start_gateway, stop

SMALL = """
engines:
  small:
    backend: llama_cpp
    model: smollm2-135m-instruct
"""


def config(*, max_messages: int = 8, deadline_ms: int = 60_000, watch: str = "null",
           auth: str = "") -> str:  # fmt: skip
    return (
        f"server: {{max_messages: {max_messages}, watch_interval_s: {watch}}}\n"
        f"sla: {{deadline_ms: {{small: {deadline_ms}}}}}\n{auth}{SMALL}"
    )


class Gateway:
    def __init__(
        self, url: str, process: subprocess.Popen[bytes], path: Path, log: IO[bytes]
    ) -> None:
        self.url, self.process, self.path, self.log = url, process, path, log

    def reloads(self, result: str) -> int:
        text = httpx.get(f"{self.url}/metrics").text
        found = re.search(rf'satisfice_config_reloads_total{{result="{result}"}} (\S+)', text)
        assert found is not None
        return int(float(found.group(1)))

    def rewrite(self, text: str, *, sighup: bool = True) -> None:
        self.path.write_text(text)
        if sighup:
            self.process.send_signal(signal.SIGHUP)

    def wait_for(self, result: str, count: int) -> None:
        deadline = time.monotonic() + 15
        while self.reloads(result) < count:
            assert time.monotonic() < deadline, f"no {result} reload"
            time.sleep(0.05)

    def logged(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    directory = tmp_path_factory.mktemp("reload")
    with (directory / "stderr.log").open("wb") as log:
        url, process = start_gateway(config(), directory, stderr=log)
        yield Gateway(url, process, config_file(process), log)
        stop(process)


def chat(url: str, messages: int, key: str | None = None) -> httpx.Response:
    turns = [{"role": "user", "content": "Say yes."}] * messages
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": "small", "messages": turns, "max_tokens": 1},
        headers=headers,
        timeout=60,
    )


def test_sighup_applies_a_valid_file(gateway: Gateway) -> None:
    assert chat(gateway.url, 3).status_code == 200
    done = gateway.reloads("success")
    gateway.rewrite(config(max_messages=2))
    gateway.wait_for("success", done + 1)
    refused = chat(gateway.url, 3)
    assert refused.status_code == 400 and "limit of 2" in refused.json()["error"]["message"]
    assert "config reloaded (SIGHUP)" in gateway.logged()
    gateway.rewrite(config())
    gateway.wait_for("success", done + 2)
    assert chat(gateway.url, 3).status_code == 200


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("server: {max_messages: [}\n" + SMALL, "not valid YAML"),
        (config(max_messages=0), "server.max_messages = 0"),
        (
            config().replace("smollm2-135m-instruct", "smollm2-135m-instruct\n    threads: 1"),
            "engines, which only a restart applies",
        ),
        (config(auth="auth: {keys: {k: {env: SATISFICE_TEST_UNSET_KEY}}}\n"), "auth.keys.k.env"),
        (
            config() + "shadow: {share: 0.1, outcomes_file: /tmp/elsewhere.jsonl}\n",
            "shadow.outcomes_file, which only a restart applies",
        ),
    ],
    ids=["yaml", "invalid-value", "restart-only", "missing-env-key", "outcome-store-moved"],
)
def test_a_bad_file_keeps_the_last_good_config(gateway: Gateway, text: str, reason: str) -> None:
    failed, done = gateway.reloads("failure"), gateway.reloads("success")
    gateway.rewrite(text)
    gateway.wait_for("failure", failed + 1)
    refusal = [line for line in gateway.logged().splitlines() if "refused" in line][-1]
    assert reason in refusal and "the last good config stays" in refusal
    assert chat(gateway.url, 3).status_code == 200  # max_messages is still 8
    gateway.rewrite(config())  # the good file back, for the next test
    gateway.wait_for("success", done + 1)


def test_shadow_checks_turn_on_and_off_without_a_restart(gateway: Gateway) -> None:
    done = gateway.reloads("success")
    gateway.rewrite(config() + "shadow: {share: 0.1, shares: {exact_hit: 0.5}}\n")
    gateway.wait_for("success", done + 1)
    gateway.rewrite(config())
    gateway.wait_for("success", done + 2)
    assert chat(gateway.url, 3).status_code == 200


def test_keys_change_without_a_restart(gateway: Gateway) -> None:
    key = "sk-reloaded-key"
    done = gateway.reloads("success")
    auth = f"auth: {{keys: {{new: {{sha256: {hash_key(key)}}}}}}}\n"
    gateway.rewrite(config(auth=auth))
    gateway.wait_for("success", done + 1)
    assert chat(gateway.url, 1).status_code == 401
    assert chat(gateway.url, 1, key).status_code == 200
    gateway.rewrite(config())  # rotated out again: open
    gateway.wait_for("success", done + 2)
    assert chat(gateway.url, 1).status_code == 200


def test_a_request_in_flight_keeps_its_config(gateway: Gateway) -> None:
    """A long answer started under a 60 s deadline goes on to its end after a reload
    cuts the deadline to 1 ms; a request after the reload is cut at once. (What the
    request keeps is fixed when it starts: its guard's config and its absolute
    deadline; this checks the effect a client can see.)"""
    finished: dict[str, float | str] = {}

    def stream() -> None:
        body = {"model": "small", "max_tokens": 300, "stream": True, "temperature": 0,
                "messages": [{"role": "user", "content": "Count from 1 to 300, one number "
                              "per line."}]}  # fmt: skip
        with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=body,
                          timeout=120) as response:  # fmt: skip
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    if choice.get("finish_reason"):
                        finished["reason"] = choice["finish_reason"]
                        finished["at"] = time.monotonic()

    reader = threading.Thread(target=stream)
    reader.start()
    time.sleep(0.5)  # the stream has begun generating
    done = gateway.reloads("success")
    gateway.rewrite(config(deadline_ms=1))
    gateway.wait_for("success", done + 1)
    reloaded_at = time.monotonic()
    reader.join(timeout=120)
    assert float(finished["at"]) > reloaded_at, "the answer ended before the reload"
    assert finished["reason"] in ("stop", "length")
    after = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        json={
            "model": "small",
            "messages": [{"role": "user", "content": "Count to 50."}],
            "max_tokens": 50,
        },
        timeout=60,
    )
    assert after.json()["choices"][0]["finish_reason"] == "deadline"
    gateway.rewrite(config())
    gateway.wait_for("success", done + 2)


# Slow: a gateway of its own; the default run keeps reloads by SIGHUP.
@pytest.mark.slow
def test_a_changed_file_is_reloaded_without_a_signal(tmp_path: Path) -> None:
    with (tmp_path / "stderr.log").open("wb") as log:
        url, process = start_gateway(config(watch="0.2"), tmp_path, stderr=log)
        try:
            watched = Gateway(url, process, config_file(process), log)
            watched.rewrite(config(max_messages=2, watch="0.2"), sighup=False)
            watched.wait_for("success", 1)
            assert chat(url, 3).status_code == 400
            assert "config reloaded (file change)" in watched.logged()
        finally:
            stop(process)
