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
from gateway.config import GatewayConfig, load_config, parse_config
from router.embedder import Embedder, EmbedderSettings
from tests.support import FAST_PAIR, GATEWAY_CONFIG, start_gateway, stop


@pytest.fixture(scope="session")
def fast_pair() -> GatewayConfig:
    """The engines most tests run on (tests/support.py, FAST_PAIR)."""
    return parse_config(FAST_PAIR, "tests/support.py FAST_PAIR")


@pytest.fixture(scope="session")
def models_dir() -> Path:
    return Path(load_config().models_dir).expanduser()


async def _started(config: GatewayConfig, name: str, models_dir: Path) -> LlamaCppEngine:
    settings = config.engines[name]
    assert isinstance(settings, LlamaCppSettings)
    engine = LlamaCppEngine(name, settings, models_dir)
    await engine.start()
    return engine


@pytest.fixture(scope="session")
async def small_engine(fast_pair: GatewayConfig, models_dir: Path) -> AsyncIterator[LlamaCppEngine]:
    engine = await _started(fast_pair, "small", models_dir)
    yield engine
    await engine.close()


@pytest.fixture(scope="session")
async def large_engine(fast_pair: GatewayConfig, models_dir: Path) -> AsyncIterator[LlamaCppEngine]:
    engine = await _started(fast_pair, "large", models_dir)
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
