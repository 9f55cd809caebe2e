"""Helpers the tests share: real processes (a `satisfice serve` gateway, llama.cpp's own
server, a spare Redis, the CLI), the configs they start with, and a virtual clock.

Fixtures live in conftest.py and use these; test modules import them from here, never
from conftest.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import importlib.util
import os
import selectors
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Coroutine, Sequence
from pathlib import Path
from types import ModuleType
from typing import IO, TYPE_CHECKING, Any, NamedTuple, TypeVar

import httpx

from engines.base import Delta, Generation, Prompt, SamplingParams
from engines.bundled import SMOLLM2, model_file
from gateway.pipeline.exchange import Exchange

if TYPE_CHECKING:
    from engines.llama_cpp import LlamaCppEngine
    from gateway.pipeline.request import ChatRequest
    from gateway.runtime import Runtime

ROOT = Path(__file__).resolve().parent.parent


def bench_script(name: str) -> ModuleType:
    """A script from bench/ loaded as a module of its own name: bench/ holds scripts, not
    a package, so importing it as `bench.x` would give mypy one file under two names."""
    path = ROOT / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The CLI as the tests run it: this interpreter, from the checkout.
SATISFICE = (sys.executable, "-m", "gateway.cli")

T = TypeVar("T")


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


def satisfice(
    *args: str, timeout_s: float | None = None, input: str | None = None
) -> subprocess.CompletedProcess[str]:
    """One `satisfice` command run to its end, its output captured as text."""
    return subprocess.run(
        [*SATISFICE, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout_s,
        input=input,
    )


def start_gateway(
    config_text: str,
    directory: Path,
    *,
    env: dict[str, str] | None = None,
    stderr: IO[bytes] | int | None = None,
    args: Sequence[str] = (),
    ready: bool = True,
) -> tuple[str, subprocess.Popen[bytes]]:
    """A real `satisfice serve` process on a free port with this config, and its URL.

    It returns once /readyz answers 200 (``ready=False``: at once, for a gateway that
    is not meant to get there); ``config_file(process)`` is the file it reads (and
    reloads). ``env`` adds to this process's environment, ``stderr`` takes the
    gateway's log (a file, or subprocess.PIPE), ``args`` go after ``serve``'s own.
    """
    config = directory / f"satisfice-{uuid.uuid4().hex[:6]}.yaml"
    config.write_text(config_text)
    port = free_port()
    process = subprocess.Popen(
        [*SATISFICE, "serve", "--config", str(config), "--port", str(port), *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        stderr=stderr,
    )
    url = f"http://127.0.0.1:{port}"
    if ready:
        try:
            wait_until_ready(f"{url}/readyz", process)
        except BaseException:
            stop(process)
            raise
    return url, process


def config_file(process: subprocess.Popen[bytes]) -> Path:
    """The --config file of a gateway that start_gateway started."""
    assert isinstance(process.args, list)  # start_gateway starts it with a list
    args = [str(arg) for arg in process.args]
    return Path(args[args.index("--config") + 1])


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


def spare_redis(port: int, directory: Path) -> subprocess.Popen[bytes]:
    """A Redis of a test's own on ``port`` (not the shared one on 6379), without
    persistence unless told to save, once it answers PING."""
    process = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", str(directory)],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    for _ in range(100):
        ping = subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True,
                              text=True, check=False)  # fmt: skip
        if ping.stdout.strip() == "PONG":
            return process
        time.sleep(0.05)
    process.kill()
    process.wait()
    raise TimeoutError("redis-server did not start")


# The fast pair most tests run on: SmolLM2-135M (chat) and Gemma-3-270M (a base model,
# prompted few-shot), several times faster than the Qwen pair the embedded default
# serves (tests/test_bundled_models.py and the slow tests run that one). The
# engine fixtures of conftest.py are these two.
FAST_PAIR = """
engines:
  small:
    backend: llama_cpp
    model: smollm2-135m-instruct
    template: chat
  large:
    backend: llama_cpp
    model: gemma3-270m
    template:
      preamble: |+
        Question: What is 7 plus 5?
        Answer: 12

        Question: What is the capital of France?
        Answer: Paris

        Question: Is the sun a star?
        Answer: Yes

      system: "{content}\\n\\n"
      user: "Question: {content}\\n"
      assistant: "Answer: {content}\\n\\n"
      generation_prefix: "Answer:"
      stop: ["\\nQuestion:", "\\n\\n"]
    queue_size: 64
"""


# Both bundled models as a test gateway's engines, the large one's answers cut at the
# end of their line by its template's stops.
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

# The session's shared gateway (conftest's gateway_url): both bundled models, the
# small one with a queue of one, and the server's limits low enough to test.
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


# The bundled Qwen 0.5B alone, as engine "qwen": of the bundled models, the one whose
# chat template renders tools (the function-calling tests' engine).
QWEN_TOOLS = """
engines:
  qwen:
    backend: llama_cpp
    model: qwen2.5-coder-0.5b-instruct
    template: chat
    context_tokens: 4096
"""


class VirtualClock:
    """Time for code that reads ``time.monotonic()``, moved by hand or by waiting.

    ``run`` runs a coroutine on an event loop of its own in which this clock is
    ``time.monotonic()`` (and so the loop's own time): whenever every task waits on a
    timer, the clock jumps to the earliest one instead of sleeping. A test of deadlines
    then sees the same times on every run, however busy the machine is.
    """

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def run(self, main: Coroutine[Any, Any, T]) -> T:
        loop = asyncio.SelectorEventLoop(_JumpingSelector(self))
        real = time.monotonic
        time.monotonic = self.monotonic
        try:
            return loop.run_until_complete(main)
        finally:
            try:
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                time.monotonic = real
                loop.close()


class _JumpingSelector(selectors.DefaultSelector):
    """Asks the OS only whether a file is ready now; the wait for the next timer is
    the virtual clock's jump."""

    # A loop with no timer and nothing ready can only be woken by another thread.
    IDLE_LIMIT_S = 30.0

    def __init__(self, clock: VirtualClock) -> None:
        super().__init__()
        self._clock = clock

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            events = super().select(self.IDLE_LIMIT_S)
            if not events:
                raise RuntimeError("every task waits, and on nothing that can end")
            return events
        events = super().select(0)
        if not events and timeout > 0:
            self._clock.advance(timeout)
        return events


async def engine_idle(engine: LlamaCppEngine) -> None:
    # Polling: the engine signals nothing when a cancelled worker thread winds down.
    while engine.busy_slots:  # noqa: ASYNC110
        await asyncio.sleep(0.001)


async def tokens_after_cancel(
    engine: LlamaCppEngine, prompt: Prompt, params: SamplingParams, after_deltas: int
) -> int:
    """Tokens the engine generated after cancelling a streaming caller that had seen
    ``after_deltas`` deltas, counted once its slots are idle again."""
    await engine_idle(engine)
    seen = asyncio.Event()

    async def consume() -> None:
        count = 0
        async for event in engine.stream(prompt, params):
            count += isinstance(event, Delta)
            if count == after_deltas:
                seen.set()

    task = asyncio.create_task(consume())
    await seen.wait()
    before = engine.tokens_generated
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await asyncio.wait_for(engine_idle(engine), timeout=5)
    return engine.tokens_generated - before


class Streamed(NamedTuple):
    """A stream drained: each sample's text and logprob count from its deltas, by
    index, and the Generation it ended with."""

    texts: dict[int, str]
    logprobs: dict[int, int]
    generation: Generation


async def streamed(engine: LlamaCppEngine, prompt: Prompt, params: SamplingParams) -> Streamed:
    # A sample that ends before its first token sends no delta: empty, not missing.
    texts: dict[int, str] = collections.defaultdict(str)
    logprobs: dict[int, int] = collections.defaultdict(int)
    final = None
    async for event in engine.stream(prompt, params):
        if isinstance(event, Delta):
            texts[event.index] += event.text
            logprobs[event.index] += len(event.logprobs)
        else:
            final = event
    assert isinstance(final, Generation), "the stream ended without a Generation"
    return Streamed(texts, logprobs, final)


def exchange_for(runtime: Runtime, request: ChatRequest, tenant: str = "default") -> Exchange:
    """An exchange for ``request``, as the front door opens one: it settles into
    ``runtime``'s settlement once ended."""
    return Exchange(
        runtime.settlement, tenant=tenant, model=request.model, key=None, request_id=None
    )
