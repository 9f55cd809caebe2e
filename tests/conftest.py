"""Shared fixtures: real bundled models, a real gateway process, real HTTP.

Only fixtures live here; the helpers they use, which tests use too, are in
tests/support.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from engines.llama_cpp import LlamaCppEngine
from engines.settings import LlamaCppSettings
from gateway.config import GatewayConfig, load_config
from router.embedder import Embedder, EmbedderSettings
from tests.support import GATEWAY_CONFIG, start_gateway, stop


@pytest.fixture(scope="session")
def default_config() -> GatewayConfig:
    return load_config()


@pytest.fixture(scope="session")
def models_dir(default_config: GatewayConfig) -> Path:
    return Path(default_config.models_dir).expanduser()


async def _started(config: GatewayConfig, name: str, models_dir: Path) -> LlamaCppEngine:
    settings = config.engines[name]
    assert isinstance(settings, LlamaCppSettings)
    engine = LlamaCppEngine(name, settings, models_dir)
    await engine.start()
    return engine


@pytest.fixture(scope="session")
async def small_engine(
    default_config: GatewayConfig, models_dir: Path
) -> AsyncIterator[LlamaCppEngine]:
    engine = await _started(default_config, "small", models_dir)
    yield engine
    await engine.close()


@pytest.fixture(scope="session")
async def large_engine(
    default_config: GatewayConfig, models_dir: Path
) -> AsyncIterator[LlamaCppEngine]:
    engine = await _started(default_config, "large", models_dir)
    yield engine
    await engine.close()


@pytest.fixture(scope="session")
async def embedder() -> AsyncIterator[Embedder]:
    """The bundled embedder, loaded once for every test that embeds."""
    embedder = Embedder(EmbedderSettings())
    await embedder.start()
    yield embedder
    await embedder.close()


@pytest.fixture(scope="session")
def gateway_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real `satisfice serve` process on a free port, serving the bundled models."""
    url, process = start_gateway(GATEWAY_CONFIG, tmp_path_factory.mktemp("gateway"))
    try:
        yield url
    finally:
        stop(process)
