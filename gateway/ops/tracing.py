"""OpenTelemetry traces: a request's way through the gateway as spans, sent over OTLP/HTTP.

Each HTTP request is one SERVER span that continues the client's W3C ``traceparent``;
a chat completion's span also carries the decision (route, cache, engine, model, the
loop's rounds, stop and confidence). Spans are batched and exported from the SDK's own
thread, so a slow or absent collector costs requests nothing: at worst spans are
dropped.

OpenTelemetry is imported only when telemetry is configured: a gateway without it never
loads the SDK, and its requests pay one ContextVar read each.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from contextvars import ContextVar
from typing import TYPE_CHECKING

import msgspec

from gateway.config import ConfigError, TelemetrySettings
from gateway.ops.logs import clipped, request_id
from gateway.pipeline.exchange import Settled

if TYPE_CHECKING:
    from litestar.types import ASGIApp, HTTPScope, Message, Receive, Scope, Send
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Status, Tracer


# The standard variables that turn tracing on when the config has no `telemetry`.
TRACES_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
SERVICE_NAME_ENV = "OTEL_SERVICE_NAME"


def from_environment(environ: Mapping[str, str]) -> TelemetrySettings | None:
    """Settings from the standard OpenTelemetry variables, for a config without
    ``telemetry``: ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` as it is, else
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` with ``/v1/traces`` added, as the OTLP
    specification reads them; ``OTEL_SERVICE_NAME`` names the service. None when
    neither endpoint is set; a ConfigError naming the variable when one is not a URL."""
    variable = TRACES_ENDPOINT_ENV if environ.get(TRACES_ENDPOINT_ENV) else ENDPOINT_ENV
    if not environ.get(variable):
        return None
    endpoint = environ[variable]
    if variable == ENDPOINT_ENV:
        endpoint = endpoint.rstrip("/") + "/v1/traces"
    try:
        return msgspec.convert(
            {"endpoint": endpoint, "service_name": environ.get(SERVICE_NAME_ENV) or "satisfice"},
            TelemetrySettings,
        )
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{variable} = {environ[variable]!r}: {exc}") from exc


class Tracing:
    """One app's tracer provider and its exporter. Not the global provider: apps built
    side by side each send their own spans, and nothing else in the process inherits
    them."""

    def __init__(self, settings: TelemetrySettings) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        self.settings = settings
        self.provider: TracerProvider = TracerProvider(
            resource=Resource.create({SERVICE_NAME: settings.service_name}),
            sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)),
        )
        exporter = OTLPSpanExporter(
            endpoint=settings.endpoint,
            headers=dict(settings.headers) or None,
            timeout=settings.export_timeout_s,
        )
        self.provider.add_span_processor(
            BatchSpanProcessor(
                exporter,
                schedule_delay_millis=settings.batch_delay_ms,
                export_timeout_millis=settings.export_timeout_s * 1000,
            )
        )
        self.tracer: Tracer = self.provider.get_tracer("satisfice.gateway")

    def close(self) -> None:
        """Export the spans still waiting, then stop. Blocks up to the export timeout
        (call it off the event loop); a collector that has not answered by then loses
        them. The SDK's own shutdown would wait for a hung export up to 30 s."""
        closing = threading.Thread(target=self.provider.shutdown, name="satisfice-traces-close",
                                   daemon=True)  # fmt: skip
        closing.start()
        closing.join(self.settings.export_timeout_s)


# The server span of the request this task serves; None without tracing, or outside a
# request. A ContextVar, as logs.request_id: a stream's last chunk still finds it.
_request_span: ContextVar[Span | None] = ContextVar("request_span", default=None)


def server_spans(app: ASGIApp, tracer: Tracer) -> ASGIApp:
    """ASGI middleware: one SERVER span per HTTP request, from its arrival to its last
    byte (a stream's end, not its headers), continuing the trace of the request's
    ``traceparent``. Wrap it inside ``logs.RequestIds`` so the span hears the id."""
    from litestar.enums import ScopeType
    from opentelemetry import context, trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    propagator = TraceContextTextMapPropagator()
    error = trace.Status(trace.StatusCode.ERROR)

    async def traced(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != ScopeType.HTTP:
            await app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        # Named by method until the route is known: a path nothing serves would make
        # one span name per typo.
        span = tracer.start_span(
            scope["method"],
            context=propagator.extract(headers),
            kind=trace.SpanKind.SERVER,
            attributes=_request_attributes(scope, headers),
        )
        status: int | None = None

        async def send_noting_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                span.set_attribute("http.response.status_code", message["status"])
            await send(message)

        otel_token = context.attach(trace.set_span_in_context(span))
        span_token = _request_span.set(span)
        try:
            await app(scope, receive, send_noting_status)
        except Exception as exc:
            span.record_exception(exc)
            span.set_status(error)
            raise
        finally:
            _request_span.reset(span_token)
            context.detach(otel_token)
            _end(span, scope, status, error)

    return traced


def _request_attributes(scope: HTTPScope, headers: Mapping[str, str]) -> dict[str, str | int]:
    """The request's attributes, named as OpenTelemetry's HTTP conventions name them."""
    attributes: dict[str, str | int] = {
        "http.request.method": scope["method"],
        "url.path": scope["path"],
        "url.scheme": scope["scheme"],
        "network.protocol.version": scope["http_version"],
    }
    if "user-agent" in headers:
        attributes["user_agent.original"] = headers["user-agent"]
    client = scope.get("client")
    if client:
        attributes["client.address"] = client[0]
    rid = request_id.get()
    if rid is not None:
        attributes["satisfice.request_id"] = rid
    return attributes


def _end(span: Span, scope: HTTPScope, status: int | None, error: Status) -> None:
    """The response has gone: the span is named by its route, marked if the server
    failed, and ended."""
    route = _route_of(scope)
    if route is not None:
        span.set_attribute("http.route", route)
        span.update_name(f"{scope['method']} {route}")
    if status is not None and status >= 500:
        span.set_status(error)
    span.end()


def _route_of(scope: Scope) -> str | None:
    """The path template of the handler Litestar routed the request to, if any."""
    template = scope.get("path_template")
    return template if isinstance(template, str) else None


# The decision view's fields grouped under a namespace on a span; the rest are
# satisfice.<field>.
_SPAN_NAMES = {
    "cache_stage": "cache.stage",
    "cache_entry": "cache.entry",
    "similarity": "cache.similarity",
    "cache_score": "cache.score",
    "stop": "loop.stop",
    "fallback": "loop.fallback",
    "rounds": "loop.rounds",
    "branches": "loop.branches",
    "tokens": "loop.tokens",
}


def chat_ended(settled: Settled) -> None:
    """A settled chat completion's decision (its view), on its request's span when it
    is traced."""
    span = _request_span.get()
    if span is None or not span.is_recording():
        return
    view = msgspec.to_builtins(settled.decision.view())
    view["model"] = clipped(settled.decision.model)
    span.set_attributes(
        {f"satisfice.{_SPAN_NAMES.get(name, name)}": value for name, value in view.items()}
    )
