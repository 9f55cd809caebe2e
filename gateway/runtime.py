"""The live pieces one gateway process builds from its config, and their readiness."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from engines import Engine, create_engine
from gateway.config import GatewayConfig

log = logging.getLogger("satisfice.gateway")


class Runtime:
    """Engines by model name; ready once every engine has loaded."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        models_dir = Path(config.models_dir).expanduser()
        self.engines: dict[str, Engine] = {
            name: create_engine(name, settings, models_dir)
            for name, settings in config.engines.items()
        }
        self.ready = False
        self.failure: str | None = None

    async def start(self) -> None:
        try:
            await asyncio.gather(*(engine.start() for engine in self.engines.values()))
        except Exception as exc:
            self.failure = f"{type(exc).__name__}: {exc}"
            log.exception("engines failed to start")
            return
        self.ready = True
        log.info("ready: %s", ", ".join(self.engines))

    async def close(self) -> None:
        self.ready = False
        await asyncio.gather(*(engine.close() for engine in self.engines.values()))
