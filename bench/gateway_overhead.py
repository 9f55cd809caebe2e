"""What the gateway adds: the same requests through HTTP vs a direct in-process engine call.

One run, side by side and interleaved (direct, gateway, direct, gateway, ...), greedy
decoding so both generate the very same tokens:
  - non-streaming: added latency per request (gateway - direct) and the ratio of totals;
  - streaming: time to first token through the gateway vs the engine's first delta;
  - a bare GET /healthz at the same spacing: the HTTP round trip under any overhead;
  - the client's own share: each gateway request is sent twice, by a plain socket
    (what the gateway adds) and by httpx (what a Python httpx client waits on top);
  - the serving process's peak RSS after the run.
The gateway is a real `satisfice serve` process on 127.0.0.1 with the embedded default
config; both clients keep their connection alive, as a product backend would. With
``--before DIR`` (a checkout of an earlier commit, e.g. ``git worktree add ../before
<commit>``) a second gateway, served from that tree, takes its turn beside the first
(plain socket client), and the report gives its added latency and the ratio.

    .venv/bin/python bench/gateway_overhead.py [--rounds 20] [--before DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import NamedTuple, TypeVar

import httpx

from engines.base import Delta, Message, SamplingParams
from engines.llama_cpp import LlamaCppEngine
from engines.settings import LlamaCppSettings
from gateway.config import load_config

ROOT = Path(__file__).resolve().parent.parent

QUESTIONS = [
    "What is 2+2?",
    "Name three colours.",
    "What is the capital of France? Answer in one word.",
    "Say hello.",
    "What is a dragon?",
]
MAX_TOKENS = 32
SETTLE_S = 0.02
T = TypeVar("T")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


async def _wait_ready(http: httpx.AsyncClient, process: subprocess.Popen[bytes]) -> None:
    for _ in range(600):
        if process.poll() is not None:
            raise RuntimeError("gateway exited")
        try:
            if (await http.get("/readyz")).status_code == 200:
                return
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.2)
    raise TimeoutError("gateway not ready")


async def _settled(measurement: Awaitable[T]) -> T:
    """Run a measurement once the other side's llama.cpp threads have stopped spinning.

    llama.cpp's worker threads busy-wait for a while after each decode; on two cores
    they would slow whichever side runs next, so each measurement waits them out.
    """
    await asyncio.sleep(SETTLE_S)
    return await measurement


class Timed(NamedTuple):
    wall_s: float  # what the caller waited
    engine_s: float  # what the engine reports it spent (queue + generation)
    tokens: int


async def _direct(engine: LlamaCppEngine, question: str) -> Timed:
    started = time.perf_counter()
    generation = await engine.generate(
        (Message("user", question),), SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    )
    wall = time.perf_counter() - started
    sample = generation.samples[0]
    engine_s = sample.timings.queue_s + sample.timings.total_s
    return Timed(wall, engine_s, generation.completion_tokens)


_NO_CACHE = {"x-satisfice-cache": "bypass, no-store"}


class PlainClient:
    """HTTP/1.1 over one kept-alive socket, the request bytes written out by hand.

    httpx itself spends about 1.8 ms of Python per request on these cores (measured
    here against this client), which a direct call never pays and a client in another
    language mostly would not: this client's round trip is what the gateway adds. It
    blocks the event loop for the request, which in this benchmark has nothing else
    to do meanwhile (the sides take turns).
    """

    def __init__(self, port: int) -> None:
        self._port = port
        self._socket = self._connect()
        self._buffer = b""

    def _connect(self) -> socket.socket:
        connection = socket.create_connection(("127.0.0.1", self._port))
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return connection

    def open(self) -> None:
        """Connected again if the server closed the connection while it idled: uvicorn
        does after keep_alive_timeout_s (5 s), and on a loaded machine the other sides'
        turns can take that long. Called before a request's clock starts, so that no
        timed request meets a closed socket or pays for a new one."""
        self._socket.setblocking(False)
        try:
            closed = self._socket.recv(1, socket.MSG_PEEK) == b""
        except BlockingIOError:  # nothing to read: still open
            closed = False
        finally:
            self._socket.setblocking(True)
        if closed:
            self._socket.close()
            self._socket, self._buffer = self._connect(), b""

    def close(self) -> None:
        self._socket.close()

    def request(
        self, method: str, path: str, body: bytes = b""
    ) -> tuple[int, dict[str, str], bytes]:
        head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        if body:
            head += "Content-Type: application/json\r\n"
            head += "".join(f"{k}: {v}\r\n" for k, v in _NO_CACHE.items())
        head += f"Content-Length: {len(body)}\r\n\r\n"
        self._socket.sendall(head.encode() + body)
        while b"\r\n\r\n" not in self._buffer:
            self._read()
        raw_head, self._buffer = self._buffer.split(b"\r\n\r\n", 1)
        status_line, *lines = raw_head.decode("latin-1").split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines)
        length = int(headers["content-length"])
        while len(self._buffer) < length:
            self._read()
        content, self._buffer = self._buffer[:length], self._buffer[length:]
        return int(status_line.split()[1]), headers, content

    def _read(self) -> None:
        chunk = self._socket.recv(65536)
        if not chunk:
            raise ConnectionError("the gateway closed the connection")
        self._buffer += chunk


def _chat_body(question: str) -> dict[str, object]:
    return {
        "model": "small",
        "messages": [{"role": "user", "content": question}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }


async def _via_gateway(plain: PlainClient, question: str) -> Timed:
    body = json.dumps(_chat_body(question)).encode()
    plain.open()
    started = time.perf_counter()
    # The engine's path, not the cache's: the embedded default caches answers, and
    # every round asks the same questions.
    status, headers, content = plain.request("POST", "/v1/chat/completions", body)
    elapsed = time.perf_counter() - started
    assert status == 200, content
    engine_ms = float(headers["server-timing"].split("dur=")[1])
    return Timed(elapsed, engine_ms / 1000, int(json.loads(content)["usage"]["completion_tokens"]))


async def _via_httpx(http: httpx.AsyncClient, question: str) -> Timed:
    started = time.perf_counter()
    response = await http.post("/v1/chat/completions", json=_chat_body(question), headers=_NO_CACHE)
    elapsed = time.perf_counter() - started
    response.raise_for_status()
    engine_ms = float(response.headers["server-timing"].split("dur=")[1])
    return Timed(elapsed, engine_ms / 1000, int(response.json()["usage"]["completion_tokens"]))


async def _healthz(plain: PlainClient) -> float:
    """A bare HTTP round trip to the same server: the floor under any gateway overhead."""
    plain.open()
    started = time.perf_counter()
    status, _, _ = plain.request("GET", "/healthz")
    assert status == 200
    return time.perf_counter() - started


async def _direct_ttft(engine: LlamaCppEngine, question: str) -> float:
    started = time.perf_counter()
    params = SamplingParams(max_tokens=4, temperature=0)
    async for event in engine.stream((Message("user", question),), params):
        if isinstance(event, Delta) and event.text:
            return time.perf_counter() - started
    raise RuntimeError("no token")


async def _gateway_ttft(http: httpx.AsyncClient, question: str) -> float:
    body = {
        "model": "small",
        "messages": [{"role": "user", "content": question}],
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
    }
    started = time.perf_counter()
    first: float | None = None
    async with http.stream(
        "POST", "/v1/chat/completions", json=body, headers=_NO_CACHE
    ) as response:
        async for line in response.aiter_lines():
            if first is None and '"content":"' in line and '"content":""' not in line:
                first = time.perf_counter() - started
    if first is None:
        raise RuntimeError("no token")
    return first


class Gateway(NamedTuple):
    process: subprocess.Popen[bytes]
    port: int


async def _in_turn(runs: Sequence[Awaitable[Timed]], turn: int) -> list[Timed]:
    """Await ``runs`` starting at ``turn`` (so order effects cancel), results in order."""
    order = list(range(turn, len(runs))) + list(range(turn))
    timed: dict[int, Timed] = {}
    for index in order:
        timed[index] = await runs[index]
    return [timed[index] for index in range(len(runs))]


async def run(
    rounds: int, engine: LlamaCppEngine, after: Gateway, before: Gateway | None
) -> dict[str, object]:
    await engine.start()
    port = after.port
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as http:
            await _wait_ready(http, after.process)
            plain = PlainClient(port)
            plain_before: PlainClient | None = None
            if before is not None:
                async with httpx.AsyncClient(
                    base_url=f"http://127.0.0.1:{before.port}", timeout=120
                ) as http_before:
                    await _wait_ready(http_before, before.process)
                plain_before = PlainClient(before.port)
            for question in QUESTIONS:  # warm every side up
                await _direct(engine, question)
                await _via_gateway(plain, question)
                await _via_httpx(http, question)
                if plain_before is not None:
                    await _via_gateway(plain_before, question)
            direct, gateway, added, added_httpx, added_before = [], [], [], [], []
            direct_ttft, gateway_ttft, floor = [], [], []
            for round_ in range(rounds):
                for i, question in enumerate(QUESTIONS):
                    runs = [
                        _settled(_direct(engine, question)),
                        _settled(_via_gateway(plain, question)),
                        _settled(_via_httpx(http, question)),
                    ]
                    if plain_before is not None:
                        runs.append(_settled(_via_gateway(plain_before, question)))
                    turn = (round_ + i) % len(runs)
                    d, g, h, *b = await _in_turn(runs, turn)
                    assert all(t.tokens == d.tokens for t in (g, h, *b)), (
                        "every side must generate the same tokens"
                    )
                    direct.append(d.wall_s)
                    gateway.append(g.wall_s)
                    # Time outside the engine on each side: generation time varies from
                    # run to run by more than the overhead, so it is taken out.
                    outside = d.wall_s - d.engine_s
                    added.append((g.wall_s - g.engine_s) - outside)
                    added_httpx.append((h.wall_s - h.engine_s) - outside)
                    if b:
                        added_before.append((b[0].wall_s - b[0].engine_s) - outside)
                    floor.append(await _settled(_healthz(plain)))
                    # A question neither side has just seen, so both pay its prefill.
                    fresh = QUESTIONS[(i + 2) % len(QUESTIONS)]
                    direct_first = _settled(_direct_ttft(engine, fresh))
                    gateway_first = _settled(_gateway_ttft(http, fresh))
                    if turn % 2:
                        gateway_ttft.append(await gateway_first)
                        direct_ttft.append(await direct_first)
                    else:
                        direct_ttft.append(await direct_first)
                        gateway_ttft.append(await gateway_first)
            plain.close()
            if plain_before is not None:
                plain_before.close()
            peak_rss = _peak_rss_mib(after.process.pid)
    finally:
        await engine.close()
    added_ms = sorted(a * 1000 for a in added)
    return {
        "requests": len(added),
        "max_tokens": MAX_TOKENS,
        "direct_median_ms": round(statistics.median(direct) * 1000, 2),
        "gateway_median_ms": round(statistics.median(gateway) * 1000, 2),
        "added_latency_median_ms": round(statistics.median(added_ms), 3),
        "added_latency_p90_ms": round(added_ms[int(0.9 * (len(added_ms) - 1))], 3),
        "added_latency_p99_ms": round(added_ms[int(0.99 * (len(added_ms) - 1))], 3),
        "http_round_trip_median_ms": round(statistics.median(floor) * 1000, 3),
        "added_latency_httpx_client_median_ms": round(statistics.median(added_httpx) * 1000, 3),
        "total_time_ratio": round(sum(gateway) / sum(direct), 4),
        "direct_ttft_median_ms": round(statistics.median(direct_ttft) * 1000, 2),
        "gateway_ttft_median_ms": round(statistics.median(gateway_ttft) * 1000, 2),
        "ttft_ratio": round(statistics.median(gateway_ttft) / statistics.median(direct_ttft), 4),
        "serving_peak_rss_mib": round(peak_rss, 1),
        **_beside_before(added_ms, added_before),
    }


def _beside_before(added_ms: list[float], added_before: list[float]) -> dict[str, float]:
    """The earlier tree's added latency, and the ratio of medians (now / before)."""
    if not added_before:
        return {}
    before_ms = sorted(a * 1000 for a in added_before)
    return {
        "before_added_latency_median_ms": round(statistics.median(before_ms), 3),
        "before_added_latency_p90_ms": round(before_ms[int(0.9 * (len(before_ms) - 1))], 3),
        "before_added_latency_p99_ms": round(before_ms[int(0.99 * (len(before_ms) - 1))], 3),
        "added_latency_median_ratio_to_before": round(
            statistics.median(added_ms) / statistics.median(before_ms), 4
        ),
    }


def _serve(tree: Path) -> Gateway:
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port)],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return Gateway(process, port)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--before", type=Path, help="an earlier checkout, measured beside")
    args = parser.parse_args()
    config = load_config()
    settings = config.engines["small"]
    assert isinstance(settings, LlamaCppSettings)
    engine = LlamaCppEngine("small", settings, Path(config.models_dir).expanduser())
    after = _serve(ROOT)
    before = _serve(args.before.resolve()) if args.before is not None else None
    try:
        report = asyncio.run(run(args.rounds, engine, after, before))
    finally:
        for gateway in (after, before):
            if gateway is not None:
                gateway.process.terminate()
                gateway.process.wait(timeout=30)
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
