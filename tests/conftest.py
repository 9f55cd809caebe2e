"""Shared fixtures: real bundled models, a real gateway process, real HTTP."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import IO

import httpx
import pytest

from engines.bundled import SMOLLM2, model_file
from engines.llama_cpp import LlamaCppEngine
from engines.settings import LlamaCppSettings
from gateway.config import GatewayConfig, load_config
from router.embedder import Embedder, EmbedderSettings

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until_ready(url: str, process: subprocess.Popen[bytes], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args!r} exited with {process.returncode}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not ready after {timeout_s}s")


def stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def start_gateway(
    config_text: str,
    directory: Path,
    *,
    env: dict[str, str] | None = None,
    stderr: IO[bytes] | None = None,
) -> tuple[str, subprocess.Popen[bytes]]:
    """A real `satisfice serve` process on a free port with this config, once ready;
    ``config_file(process)`` is the file it reads (and reloads)."""
    config = directory / f"satisfice-{uuid.uuid4().hex[:6]}.yaml"
    config.write_text(config_text)
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config),
         "--port", str(port)],
        cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, stderr=stderr,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(f"{url}/readyz", process)
    except BaseException:
        stop(process)
        raise
    return url, process


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


# Both bundled models as a test gateway's engines, the large one's answers cut at the
# end of their line by its template's stops.
def llama_server(port: int, models_dir: Path) -> subprocess.Popen[bytes]:
    """llama.cpp's own OpenAI-compatible server with the bundled SmolLM2 on ``port``,
    once ready (at http://127.0.0.1:<port>/v1)."""
    process = subprocess.Popen(
        [
            sys.executable, "-m", "llama_cpp.server",
            "--model", str(model_file(SMOLLM2, models_dir)),
            "--model_alias", "smollm2",
            "--host", "127.0.0.1", "--port", str(port),
            "--n_ctx", "2048", "--n_threads", "1",
            # Queue concurrent requests instead of cutting the running one off.
            "--interrupt_requests", "false",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_until_ready(f"http://127.0.0.1:{port}/v1/models", process)
    except BaseException:
        stop(process)
        raise
    return process


def config_file(process: subprocess.Popen[bytes]) -> Path:
    """The --config file of a gateway that start_gateway started."""
    args = [str(arg) for arg in process.args]  # type: ignore[union-attr]
    return Path(args[args.index("--config") + 1])


BUNDLED_ENGINES = """
engines:
  small:
    backend: llama_cpp
    model: smollm2-135m-instruct
  large:
    backend: llama_cpp
    model: gemma3-270m
    template:
      stop: ["\\nQuestion:", "\\n\\n"]
"""

GATEWAY_CONFIG = """
router: {}
server:
  max_body_bytes: 65536
  max_tokens_cap: 512
  max_n: 4
engines:
  small:
    backend: llama_cpp
    model: smollm2-135m-instruct
    queue_size: 1
  large:
    backend: llama_cpp
    model: gemma3-270m
    template:
      stop: ["\\nQuestion:", "\\n\\n"]
"""


@pytest.fixture(scope="session")
def gateway_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real `satisfice serve` process on a free port, serving the bundled models."""
    config = tmp_path_factory.mktemp("gateway") / "satisfice.yaml"
    config.write_text(GATEWAY_CONFIG)
    port = free_port()
    command = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config)]
    process = subprocess.Popen(
        [*command, "--port", str(port)],
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(f"{url}/readyz", process)
        yield url
    finally:
        stop(process)
