"""Request ids and JSON logs: the formatter, the id rules, and a real gateway's
stderr and headers."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import httpx
import pytest

from gateway.ops.logs import (
    ACCESS_LOGGER,
    JSONFormatter,
    RequestIdFilter,
    request_id,
    valid_request_id,
)
from tests.support import start_gateway, stop


def _record(message: str, **extra: object) -> logging.LogRecord:
    record = logging.getLogger("satisfice.test").makeRecord(
        "satisfice.test", logging.WARNING, __file__, 1, message, (), None, extra=extra
    )
    RequestIdFilter().filter(record)
    return record


def test_json_line_has_the_fields_and_extras() -> None:
    token = request_id.set("abc")
    try:
        line = JSONFormatter().format(_record("hello %s", route="small", status=200))
    finally:
        request_id.reset(token)
    assert "\n" not in line
    fields = json.loads(line)
    assert fields["level"] == "WARNING"
    assert fields["logger"] == "satisfice.test"
    assert fields["message"] == "hello %s"
    assert fields["request_id"] == "abc"
    assert fields["route"] == "small" and fields["status"] == 200
    assert fields["time"].endswith("+00:00")


def test_json_line_outside_a_request_has_no_request_id() -> None:
    fields = json.loads(JSONFormatter().format(_record("idle")))
    assert "request_id" not in fields


def test_json_line_carries_the_exception() -> None:
    try:
        raise ValueError("bad\nthing")
    except ValueError:
        record = logging.getLogger("x").makeRecord(
            "x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info()
        )
    line = JSONFormatter().format(record)
    assert "\n" not in line
    fields = json.loads(line)
    assert "ValueError: bad\nthing" in fields["exception"]
    assert "Traceback" in fields["exception"]


def test_json_line_writes_what_json_cannot_hold_as_text() -> None:
    fields = json.loads(JSONFormatter().format(_record("odd", path=Path("/tmp/x"))))
    assert fields["path"] == "/tmp/x"


@pytest.mark.parametrize(
    ("value", "kept"),
    [
        ("test-123", True),
        ("a" * 128, True),
        ("a b~!", True),
        ("", False),
        ("a" * 129, False),
        ("line\nbreak", False),
        ("tab\there", False),
        ("café", False),
        (None, False),
    ],
)
def test_request_id_validation(value: str | None, kept: bool) -> None:
    assert valid_request_id(value) is kept


# The small engine alone: the requests below ask nothing of the large one or the router.
CONFIG = """
server:
  log_format: json
engines:
  small:
    backend: llama_cpp
    model: smollm2-135m-instruct
"""


def test_gateway_logs_json_with_request_ids(tmp_path: Path) -> None:
    log = tmp_path / "stderr.log"
    with log.open("wb") as stderr:
        url, process = start_gateway(CONFIG, tmp_path, stderr=stderr)
    try:
        body = {"model": "small", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        chat = f"{url}/v1/chat/completions"
        given = httpx.post(chat, json=body, headers={"x-request-id": "test-123"}, timeout=60)
        made = httpx.post(chat, json=body, timeout=60)
        refused = httpx.post(chat, json={"model": "small"}, timeout=60)
        forged = httpx.post(chat, json=body, headers={"x-request-id": "a" * 129}, timeout=60)
        missing = httpx.get(f"{url}/no/such/path", timeout=10)
        forging = httpx.get(f"{url}/a%0A%7B%22level%22:%22ERROR%22%7D", timeout=10)
        not_json = httpx.post(chat, content=b"{}", headers={"content-type": "text/plain"})
        streamed = {**body, "stream": True}
        with httpx.stream(
            "POST", chat, json=streamed, headers={"x-request-id": "stream-1"}, timeout=60
        ) as stream:
            stream.read()
    finally:
        stop(process)
    assert given.status_code == 200 and given.headers["x-request-id"] == "test-123"
    assert made.status_code == 200 and len(made.headers["x-request-id"]) == 32
    assert refused.status_code == 400 and refused.headers["x-request-id"]
    assert forged.headers["x-request-id"] != "a" * 129
    assert missing.status_code == 404 and missing.headers["x-request-id"]
    answered = (given, made, refused, forged, missing, forging, not_json)
    ids = {r.headers["x-request-id"] for r in answered}
    assert len(ids) == 7

    # llama.cpp and progress bars write to stderr past Python's logging: skip them.
    text = log.read_text(errors="replace").splitlines()
    lines = [json.loads(line) for line in text if line.startswith("{")]
    assert not [line for line in text if line.startswith(("INFO", "WARNING", "ERROR"))]
    assert all({"time", "level", "logger", "message"} <= line.keys() for line in lines)
    access = [line for line in lines if line["logger"] == ACCESS_LOGGER]
    mine = [line for line in access if line.get("request_id") == "test-123"]
    assert len(mine) == 1
    assert mine[0]["status"] == 200
    assert mine[0]["route"] and mine[0]["model"] == "small" and mine[0]["engine"] == "small"
    assert isinstance(mine[0]["duration_ms"], float) and mine[0]["duration_ms"] > 0
    assert "Hi" not in json.dumps(mine[0])  # no prompt text
    assert stream.headers["x-request-id"] == "stream-1"
    ended = [line for line in access if line.get("request_id") == "stream-1"]
    assert len(ended) == 1 and ended[0]["status"] == 200
    # uvicorn's own lines go through the same JSON handler.
    assert any(line["logger"].startswith("uvicorn") for line in lines)
    # One access line per request, whoever answered it (uvicorn's access log is off).
    by_id = {rid: [line for line in access if line.get("request_id") == rid] for rid in ids}
    assert all(len(found) == 1 for found in by_id.values()), by_id
    assert not [line for line in lines if line["logger"] == "uvicorn.access"]
    (lost,) = by_id[missing.headers["x-request-id"]]
    assert (lost["method"], lost["path"], lost["status"]) == ("GET", "/no/such/path", 404)
    (forged_line,) = by_id[forging.headers["x-request-id"]]
    assert forged_line["path"] == "/a%0A%7B%22level%22:%22ERROR%22%7D"  # as sent, not decoded
    assert by_id[not_json.headers["x-request-id"]][0]["status"] == 415
