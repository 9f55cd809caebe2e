"""The live pieces one gateway process builds from its config, and their readiness."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from pathlib import Path

from engines import Engine, create_engine
from engines.base import Message
from gateway.config import GatewayConfig
from router.embedder import Embedder
from router.router import RouteDecision, Router

log = logging.getLogger("satisfice.gateway")


class Runtime:
    """Engines by model name, and the router; ready once everything has loaded."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        models_dir = Path(config.models_dir).expanduser()
        self.engines: dict[str, Engine] = {
            name: create_engine(name, settings, models_dir)
            for name, settings in config.engines.items()
        }
        self.embedder: Embedder | None = None
        self.router: Router | None = None
        if config.router is not None:
            self.embedder = Embedder(config.router.embedder)
            self.router = Router(config.router, self.embedder)
        self.ready = False
        self.failure: str | None = None

    async def _start_router(self) -> None:
        if self.embedder is not None and self.router is not None:
            await self.embedder.start()
            await self.router.start()

    async def start(self) -> None:
        try:
            await asyncio.gather(
                self._start_router(), *(engine.start() for engine in self.engines.values())
            )
        except Exception as exc:
            self.failure = f"{type(exc).__name__}: {exc}"
            log.exception("failed to start")
            return
        self.ready = True
        log.info("ready: %s", ", ".join(self.engines))

    async def close(self) -> None:
        self.ready = False
        closing = [engine.close() for engine in self.engines.values()]
        if self.embedder is not None:
            closing.append(self.embedder.close())
        await asyncio.gather(*closing)

    async def route(self, messages: Sequence[Message]) -> RouteDecision | None:
        """Where a routed request goes; None when this config has no router.

        The embedding is computed once here, from the last user turn, which is what
        the request is asking now.
        """
        if self.router is None or self.embedder is None:
            return None
        text = next(
            (m.content for m in reversed(messages) if m.role == "user"), messages[-1].content
        )
        started = time.perf_counter()
        embedding = await self.embedder.embed(text)
        return await self.router.decide(text, embedding, (time.perf_counter() - started) * 1000)
