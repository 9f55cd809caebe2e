"""Read timeouts and a header size limit, which uvicorn 0.54 does not have.

uvicorn closes a kept-alive connection that idles between requests
(``timeout_keep_alive``), but arms nothing before a connection's first request, nor
while a request's headers or body arrive, and its httptools parser takes headers of
any size. A client that opens connections and sends nothing, or trickles a byte every
few seconds (slowloris), would hold each connection for ever. This is uvicorn's
httptools protocol with three limits of its own:

- the request line and headers must be whole ``header_s`` after the connection opened
  (or, on a kept-alive connection, after the request's first byte), and be at most
  ``max_header_bytes``: else 408 (431), and the connection is closed; a connection
  that sent nothing at all is closed without a word;
- the body must be whole ``body_s`` after the headers, plus one second for every
  ``body_min_rate`` bytes received: else 408 if the response has not begun, and the
  connection is closed. Time the gateway itself is not reading (its buffer is full,
  or it has not asked for a ``100-continue`` body yet) is not counted against it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Literal

import msgspec
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.api.wire import ErrorBody, ErrorResponse

Phase = Literal["idle", "header", "body", "header_size"]

# The ASGI scope extension set on a request whose body timed out: its handler's error
# then says 408, not that the client left.
TIMED_OUT = "satisfice.timed_out"


class ReadLimits(msgspec.Struct, frozen=True, kw_only=True):
    header_s: float
    body_s: float
    body_min_rate: int  # bytes per second
    max_header_bytes: int


def guarded_protocol(
    limits: ReadLimits, on_refused: Callable[[Phase], None]
) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol held to ``limits``; ``on_refused`` hears each
    connection closed for one of them."""

    class Guarded(_Guarded):
        pass

    Guarded.limits = limits
    Guarded.refused = on_refused
    return Guarded


def _refusal(status: int, reason: str, message: str, code: str) -> bytes:
    body = msgspec.json.encode(
        ErrorResponse(ErrorBody(message=message, type="invalid_request_error", code=code))
    )
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class _Corked:
    """A transport whose writes within one turn of the event loop leave in one system
    call: uvicorn writes a response's status line and headers, then its body, each at
    once, two sends per response where one does (and the headers may leave alone in
    a packet of their own). What is held goes at the end of the turn, or before the
    transport is closed; everything else is the transport's own."""

    def __init__(self, transport: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self._held:
            self._loop.call_soon(self._flush)
        self._held.append(bytes(data))

    def writelines(self, chunks: Any) -> None:
        for chunk in chunks:
            self.write(chunk)

    def _flush(self) -> None:
        if self._held:
            data = b"".join(self._held)
            self._held.clear()
            if not self._transport.is_closing():
                self._transport.write(data)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def write_eof(self) -> None:
        self._flush()
        self._transport.write_eof()

    def abort(self) -> None:
        self._held.clear()
        self._transport.abort()

    def get_write_buffer_size(self) -> int:
        return int(self._transport.get_write_buffer_size()) + sum(map(len, self._held))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _Guarded(HttpToolsProtocol):
    limits: ReadLimits
    refused: Callable[[Phase], None]  # set on the class, so not a method

    def on_refused(self, phase: Phase) -> None:
        type(self).refused(phase)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._begun = False  # a request's first byte has come, its headers not yet whole
        self._header_bytes = 0  # of the request line and headers parsed whole
        self._unparsed_bytes = 0  # received while the headers are not yet whole
        self._body_since = 0.0
        self._body_bytes = 0
        # Refused and closing: what is left of the bytes being parsed is dropped.
        self._refused = False

    # -- the connection ---------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are asyncio's in all but their class.
        super().connection_made(_Corked(transport, self.loop))  # type: ignore[arg-type]
        # Nothing is armed before a connection's first request: its headers' clock
        # starts now, so that a connection that never sends a byte is closed too.
        self._arm_header()

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._header_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._header_timer = self._body_timer = None
        super().connection_lost(exc)

    # -- the request line and headers -------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        super().data_received(data)
        # The parser keeps a header line that has not ended to itself: while headers
        # are not whole, every byte received counts against their limit.
        if self._begun and not self._refused:
            self._unparsed_bytes += len(data)
            self._count_header(0)

    def on_message_begin(self) -> None:
        if self._refused:
            return
        super().on_message_begin()
        self._begun, self._header_bytes, self._unparsed_bytes = True, 0, 0
        if self._header_timer is None:  # a kept-alive connection's next request
            self._arm_header()

    def on_url(self, url: bytes) -> None:
        if not self._count_header(len(url)):
            super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._count_header(len(name) + len(value)):
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        self._begun = False
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().on_headers_complete()
        # The body's clock; on_message_complete stops it at once for a request with none.
        self._body_since, self._body_bytes = self.loop.time(), 0
        self._arm_body(self.limits.body_s)

    def _count_header(self, size: int) -> bool:
        """Whether the request is refused, now or before: its headers too large."""
        if self._refused:
            return True
        self._header_bytes += size
        if max(self._header_bytes, self._unparsed_bytes) > self.limits.max_header_bytes:
            self._refuse(
                "header_size",
                _refusal(
                    431,
                    "Request Header Fields Too Large",
                    f"the request line and headers are over {self.limits.max_header_bytes} bytes",
                    "headers_too_large",
                ),
            )
        return self._refused

    def _arm_header(self) -> None:
        self._header_timer = self.loop.call_later(self.limits.header_s, self._header_late)

    def _header_late(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self.flow.read_paused:  # a pipelined request waits for the one before it
            self._arm_header()
            return
        if not self._begun:  # not a byte of a request: nobody to answer
            self._refuse("idle", b"")
            return
        message = f"the request line and headers did not arrive within {self.limits.header_s} s"
        self._refuse("header", _refusal(408, "Request Timeout", message, "request_timeout"))

    # -- the body ---------------------------------------------------------------

    def on_body(self, body: bytes) -> None:
        if self._refused:
            return
        self._body_bytes += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        if self._refused:
            return
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        super().on_message_complete()

    def _arm_body(self, delay: float) -> None:
        self._body_timer = self.loop.call_later(max(0.0, delay), self._body_late)

    def _body_late(self) -> None:
        self._body_timer = None
        if self.transport.is_closing():
            return
        now, cycle = self.loop.time(), self.cycle
        if self.flow.read_paused or (cycle is not None and cycle.waiting_for_100_continue):
            # The gateway is not reading: a fresh allowance once it is.
            self._body_since, self._body_bytes = now, 0
            self._arm_body(self.limits.body_s)
            return
        limits = self.limits
        due = self._body_since + limits.body_s + self._body_bytes / limits.body_min_rate
        if now < due:  # bytes came meanwhile, each buying more time
            self._arm_body(due - now)
            return
        if cycle is not None:
            cycle.scope.setdefault("extensions", {})[TIMED_OUT] = {}
        answered = cycle is not None and cycle.response_started
        message = (
            f"the request body did not arrive within {limits.body_s} s and "
            f"{limits.body_min_rate} bytes per second"
        )
        refusal = b"" if answered else _refusal(408, "Request Timeout", message, "request_timeout")
        self._refuse("body", refusal)

    # -- refusing ---------------------------------------------------------------

    def _refuse(self, phase: Phase, response: bytes) -> None:
        """Say why (unless the response has begun or nobody asked), and hang up. The
        request's handler, if it runs, hears that its client has gone, and writes
        nothing more."""
        self._refused = True
        self.on_refused(phase)
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.keep_alive = False
            self.cycle.disconnected = True
        if response:
            self.transport.write(response)
        self.transport.close()
