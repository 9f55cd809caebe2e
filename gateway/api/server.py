"""The server stack every gateway process runs on: uvicorn on uvloop, its httptools
parser held to the read limits of gateway.api.timeouts, one access line per request
(the gateway's own). bench/hit_path.py serves its ceiling apps on the same stack."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import uvicorn

from gateway.api.timeouts import Phase, ReadLimits, guarded_protocol
from gateway.config import ServerSettings


def server_config(
    app: Any, settings: ServerSettings, on_refused: Callable[[Phase], None]
) -> uvicorn.Config:
    """``app`` served as ``settings`` say; ``on_refused`` hears each connection closed
    for a read limit."""
    limits = ReadLimits(
        header_s=settings.header_timeout_s,
        body_s=settings.body_timeout_s,
        body_min_rate=settings.body_min_rate,
        max_header_bytes=settings.max_header_bytes,
    )
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        log_level="info",
        log_config=None,  # configure_logging's handler serves uvicorn's loggers too
        timeout_graceful_shutdown=30,
        timeout_keep_alive=settings.keep_alive_timeout_s,
        access_log=False,  # one access line per request: gateway.ops.logs writes it
        # Nothing here reads the client's address: X-Forwarded-For rewriting would cost
        # every request for nothing (behind a proxy, its own logs have the address).
        proxy_headers=False,
        # uvicorn has no read timeouts of its own (gateway/api/timeouts.py).
        http=guarded_protocol(limits, on_refused),
    )
