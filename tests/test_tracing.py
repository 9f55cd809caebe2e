"""OpenTelemetry traces: real gateway processes exporting to a real OTLP/HTTP receiver.

The receiver is a plain HTTP server that decodes what it is sent with
opentelemetry-proto's ExportTraceServiceRequest, as a collector would; requests go
through the official openai client.
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from gateway.config import ConfigError, TelemetrySettings, parse_config
from gateway.ops.tracing import from_environment
from tests.support import ROOT, start_gateway, stop
from tests.test_metrics import LOOP_AND_CACHE_CONFIG

SERVER = 2  # Span.SpanKind.SPAN_KIND_SERVER in the OTLP protobuf
STATUS_ERROR = 2  # Status.StatusCode.STATUS_CODE_ERROR
CHAT = "POST /v1/chat/completions"


@dataclass(frozen=True)
class Exported:
    """One span as the receiver decoded it."""

    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status: int
    service: str


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    assert kind is not None, "an attribute exported with no value"
    return getattr(value, kind)


class Receiver:
    """An OTLP/HTTP traces endpoint on a free 127.0.0.1 port, keeping what it is sent."""

    def __init__(self) -> None:
        self.spans: list[Exported] = []
        self.requests: list[tuple[str, dict[str, str]]] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver._keep(self.path, dict(self.headers), body)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    @property
    def url(self) -> str:
        return f"{self.base_url}/v1/traces"

    def _keep(self, path: str, headers: dict[str, str], body: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        spans = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    spans.append(
                        Exported(
                            name=span.name,
                            kind=span.kind,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                            attributes={a.key: _value(a.value) for a in span.attributes},
                            status=span.status.code,
                            service=resource.get("service.name", ""),
                        )
                    )
        with self._lock:
            self.requests.append((path, {k.lower(): v for k, v in headers.items()}))
            self.spans.extend(spans)

    def of_request(self, request_id: str, timeout_s: float = 15) -> Exported:
        """The span of the request with this x-request-id, once it has arrived."""
        return self.wait_for(lambda s: s.attributes.get("satisfice.request_id") == request_id,
                             timeout_s)  # fmt: skip

    def wait_for(self, matches: Callable[[Exported], bool], timeout_s: float = 15) -> Exported:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                found = [s for s in self.spans if matches(s)]
            if found:
                assert len(found) == 1, found
                return found[0]
            time.sleep(0.05)
        raise AssertionError(f"no such span after {timeout_s}s; received: {self.spans}")

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def traceparent() -> tuple[str, str, str]:
    """A client's own trace: its id, its span's id, and the header that carries them."""
    trace_id, span_id = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


# Every routed question is hard and thinks for one round of one short branch; the
# cache keeps what the small engine answers: the config of test_metrics.
TRACED_CONFIG = LOOP_AND_CACHE_CONFIG

SMALL_ONLY = """
engines:
  small:
    backend: llama_cpp
    model: smollm2-135m-instruct
"""


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    receiver = Receiver()
    yield receiver
    receiver.close()


@pytest.fixture(scope="module")
def traced(receiver: Receiver, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    telemetry = f"""
telemetry:
  endpoint: {receiver.url}
  service_name: satisfice-test
  batch_delay_ms: 50
  headers: {{x-collector-key: secret}}
"""
    url, process = start_gateway(TRACED_CONFIG + telemetry, tmp_path_factory.mktemp("traced"))
    try:
        yield url
    finally:
        stop(process)


def test_a_chat_completion_is_one_server_span_with_its_decision(
    traced: str, receiver: Receiver
) -> None:
    question = f"Name a colour. (case {uuid.uuid4().hex[:6]})"
    raw = client(traced).chat.completions.with_raw_response.create(
        model="small", messages=[{"role": "user", "content": question}], max_tokens=4
    )
    span = receiver.of_request(raw.headers["x-request-id"])
    assert span.name == CHAT and span.kind == SERVER and span.status != STATUS_ERROR
    assert span.service == "satisfice-test"
    assert span.parent_span_id == ""  # no traceparent: a trace of its own
    attributes = span.attributes
    assert attributes["http.request.method"] == "POST"
    assert attributes["url.path"] == attributes["http.route"] == "/v1/chat/completions"
    assert attributes["http.response.status_code"] == 200
    assert attributes["satisfice.route"] == "small"
    assert attributes["satisfice.model"] == "small"
    assert attributes["satisfice.engine"] == raw.headers["x-satisfice-engine"] == "small"
    assert attributes["satisfice.cache"] == raw.headers["x-satisfice-cache"] == "miss"
    assert not any(key.startswith("satisfice.loop.") for key in attributes)
    # The exporter sends the configured headers to the collector's path.
    path, headers = receiver.requests[-1]
    assert path == "/v1/traces" and headers["x-collector-key"] == "secret"


def test_a_client_trace_continues_and_a_cache_hit_says_so(traced: str, receiver: Receiver) -> None:
    ask: dict[str, Any] = {
        "model": "small",
        "messages": [{"role": "user", "content": "What is the boiling point of water?"}],
        "max_tokens": 48, "temperature": 0, "stop": [".", "\n"],
    }  # fmt: skip
    openai_client = client(traced)
    for _ in range(20):  # the answer is stored after the response has gone
        trace_id, parent_id, header = traceparent()
        raw = openai_client.chat.completions.with_raw_response.create(
            **ask, extra_headers={"traceparent": header}
        )
        span = receiver.of_request(raw.headers["x-request-id"])
        assert (span.trace_id, span.parent_span_id) == (trace_id, parent_id)
        assert span.span_id != parent_id
        assert span.attributes["satisfice.cache"] == raw.headers["x-satisfice-cache"]
        if raw.headers["x-satisfice-cache"] == "exact":
            assert span.attributes["satisfice.route"] == "exact"
            return
        time.sleep(0.2)
    pytest.fail("the answer was never served from the cache")


def test_a_client_that_does_not_sample_gets_no_span(traced: str, receiver: Receiver) -> None:
    trace_id, parent_id, _ = traceparent()
    unsampled = httpx.get(
        f"{traced}/healthz", headers={"traceparent": f"00-{trace_id}-{parent_id}-00"}
    )
    sampled = httpx.get(f"{traced}/healthz")
    span = receiver.of_request(sampled.headers["x-request-id"])
    assert span.name == "GET /healthz" and span.attributes["http.response.status_code"] == 200
    # Spans are exported in the order they end: the unsampled one would be here by now.
    assert not [s for s in receiver.spans if s.trace_id == trace_id]
    assert unsampled.headers["x-request-id"] not in {
        s.attributes.get("satisfice.request_id") for s in receiver.spans
    }


def test_an_unknown_path_is_named_by_its_method_alone(traced: str, receiver: Receiver) -> None:
    response = httpx.get(f"{traced}/no/such/{uuid.uuid4().hex}")
    assert response.status_code == 404
    span = receiver.of_request(response.headers["x-request-id"])
    assert span.name == "GET" and "http.route" not in span.attributes
    assert span.attributes["http.response.status_code"] == 404
    assert span.status != STATUS_ERROR  # a client's mistake is not the server's error


def test_a_bad_request_span_has_its_status_and_no_route(traced: str, receiver: Receiver) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client(traced).chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}]
        )
    span = receiver.of_request(caught.value.response.headers["x-request-id"])
    assert span.name == CHAT
    assert span.attributes["http.response.status_code"] == 404
    assert span.attributes["satisfice.route"] == "error"
    assert span.attributes["satisfice.model"] == "no-such-model"


def test_a_stream_span_ends_with_the_stream(traced: str, receiver: Receiver) -> None:
    trace_id, parent_id, header = traceparent()
    question = f"Write a long story about a cat and a fox. (case {uuid.uuid4().hex[:6]})"
    with client(traced).chat.completions.with_streaming_response.create(
        model="small",
        messages=[{"role": "user", "content": question}],
        max_tokens=48,
        stream=True,
        extra_headers={"traceparent": header},
    ) as response:
        request_id = response.headers["x-request-id"]
        arrivals = [time.time_ns() for _ in response.iter_lines() if _]
    span = receiver.of_request(request_id)
    assert (span.trace_id, span.parent_span_id) == (trace_id, parent_id)
    assert span.name == CHAT and span.attributes["satisfice.route"] == "small"
    # Long enough that ending at the headers would show: the span ends after the last
    # chunk left the server, which the client heard a moment later.
    first, last = arrivals[0], arrivals[-1]
    assert last - first > 50_000_000, "the stream was too short to tell"
    assert span.end_ns > first + (last - first) // 2
    assert span.end_ns - span.start_ns >= last - first


def test_a_loop_answer_carries_its_rounds_stop_and_confidence(
    traced: str, receiver: Receiver
) -> None:
    question = f"Is the sun a star? (case {uuid.uuid4().hex[:6]})"
    raw = client(traced).chat.completions.with_raw_response.create(
        model="auto", messages=[{"role": "user", "content": question}], max_tokens=8
    )
    assert raw.headers["x-satisfice-route"] == "loop"
    attributes = receiver.of_request(raw.headers["x-request-id"]).attributes
    assert attributes["satisfice.route"] == "loop" and attributes["satisfice.model"] == "auto"
    assert attributes["satisfice.engine"] == raw.headers["x-satisfice-engine"]
    assert attributes["satisfice.loop.rounds"] == int(raw.headers["x-satisfice-rounds"]) == 1
    assert attributes["satisfice.loop.stop"] == raw.headers["x-satisfice-stop"]
    assert attributes["satisfice.loop.fallback"] == "none"
    assert attributes["satisfice.confidence"] == pytest.approx(
        float(raw.headers["x-satisfice-confidence"]), abs=1e-4
    )


# --- switched on by the environment, or off -------------------------------------------


def test_the_standard_variable_switches_tracing_on_and_stop_flushes(
    receiver: Receiver, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = f"from-env-{uuid.uuid4().hex[:6]}"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.base_url)
    monkeypatch.setenv("OTEL_SERVICE_NAME", service)
    url, process = start_gateway(SMALL_ONLY, tmp_path)
    try:
        # The default batch delay (5 s) has not passed when the gateway stops: what it
        # still holds goes out on the way down.
        request_id = httpx.get(f"{url}/v1/models").headers["x-request-id"]
    finally:
        stop(process)
    span = receiver.wait_for(lambda s: s.attributes.get("satisfice.request_id") == request_id,
                             timeout_s=1)  # fmt: skip
    assert span.service == service and span.name == "GET /v1/models"


def test_without_telemetry_no_tracer_or_exporter_is_loaded() -> None:
    code = (
        "import json, sys\n"
        "from gateway.api.app import create_app\n"
        "from gateway.config import parse_config\n"
        f"create_app(parse_config({SMALL_ONLY!r}))\n"
        "print(json.dumps([m for m in sys.modules if m.startswith('opentelemetry.')]))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
        check=True,
    )  # fmt: skip
    loaded = json.loads(out.stdout.splitlines()[-1])
    # redis-py imports the SDK's metrics part by itself when the SDK is installed.
    ours = ("opentelemetry.sdk.trace", "opentelemetry.exporter", "opentelemetry.propagate")
    assert not [m for m in loaded if m.startswith(ours)]


def test_from_environment_reads_the_standard_variables() -> None:
    assert from_environment({}) is None
    base = from_environment({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/"})
    assert base == TelemetrySettings(endpoint="http://collector:4318/v1/traces")
    both = from_environment(
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "https://traces.example/in",
            "OTEL_SERVICE_NAME": "edge",
        }
    )
    assert both == TelemetrySettings(endpoint="https://traces.example/in", service_name="edge")
    with pytest.raises(ConfigError, match="OTEL_EXPORTER_OTLP_ENDPOINT = 'collector:4318'"):
        from_environment({"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4318"})


# --- a collector that never answers ---------------------------------------------------


def test_a_collector_that_never_answers_costs_requests_nothing(tmp_path: Path) -> None:
    # Accepts connections (the kernel does) and never reads or answers them: every
    # export hangs until its timeout, from the first span (the readiness probe's) on.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        telemetry = f"""
telemetry:
  endpoint: http://127.0.0.1:{silent.getsockname()[1]}/v1/traces
  batch_delay_ms: 1
  export_timeout_s: 6
"""
        url, process = start_gateway(SMALL_ONLY + telemetry, tmp_path)
        try:
            openai_client = client(url)
            hi: dict[str, Any] = {
                "model": "small", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
            }  # fmt: skip
            openai_client.chat.completions.create(**hi)  # the first one warms the model up
            for _ in range(5):
                started = time.monotonic()
                answer = openai_client.chat.completions.create(**hi)
                assert answer.choices[0].message.content is not None
                assert httpx.get(f"{url}/healthz").status_code == 200
                assert time.monotonic() - started < 2
        finally:
            stopping = time.monotonic()
            stop(process)
        # Its last spans wait for the collector no longer than the export timeout.
        assert process.returncode != -signal.SIGKILL and time.monotonic() - stopping < 6 + 5


# --- config -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("telemetry", "names"),
    [
        ("{sample_ratio: 2}", "telemetry.sample_ratio = 2"),
        ("{endpoint: 'ftp://collector/v1/traces'}", "telemetry.endpoint"),
        ("{export_timeout_s: 0}", "telemetry.export_timeout_s = 0"),
        ("{sampling: 0.5}", "sampling"),
    ],
)
def test_a_bad_telemetry_section_is_refused_naming_the_field(telemetry: str, names: str) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_config(SMALL_ONLY + f"telemetry: {telemetry}\n")
    assert names in str(refused.value)


def test_a_telemetry_section_reads_back_with_its_defaults() -> None:
    config = parse_config(SMALL_ONLY + "telemetry: {sample_ratio: 0.25}\n")
    assert config.telemetry == TelemetrySettings(sample_ratio=0.25)
    assert config.telemetry.endpoint == "http://localhost:4318/v1/traces"
    assert parse_config(SMALL_ONLY).telemetry is None
