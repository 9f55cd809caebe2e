"""Added latency per request: Satisfice and LiteLLM's proxy in front of the same backend.

One run, three ways to the same OpenAI-compatible backend, interleaved in blocks whose
order rotates each round so the machine's drift hits all three alike:

  - direct: the client talks to the backend itself;
  - satisfice: a real `satisfice serve` with one `openai_http` engine pointing at the
    backend, no cache and no router (nothing to look up or decide: only the proxying);
  - litellm: LiteLLM's proxy (`litellm --config`) with one `openai/<model>` entry whose
    api_base is the backend, its defaults otherwise, one worker.

The backend is a plain OpenAI-compatible server defined in this file: it answers every
chat completion at once with the same one-token reply ("OK"), streamed or not, so that
what the proxies add is not buried under generation time. It stands for the inference
server; neither proxy knows it is not one.

Per concurrency (1 and 8 clients by default, httpx with keep-alive, non-streaming,
``max_tokens=1``), added latency = (through the proxy) - (direct) at p50 and p99, and
the ratio of ours to LiteLLM's.

    .venv/bin/python bench/litellm_overhead.py [--requests 2000] [--clients 1 8]
        [--litellm .venv-litellm/bin/litellm] [--json FILE]

LiteLLM is looked for in ``.venv-litellm`` (``make bench-litellm`` creates it: its
proxy extra pins versions of packages this project also uses), then on PATH.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
MODEL = "echo"
TARGETS = ("direct", "satisfice", "litellm")
REPLY = "OK"

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


# --- the backend: a minimal OpenAI-compatible server ---------------------------------


def _completion(stream: bool) -> dict[str, Any]:
    base = {"id": "chatcmpl-bench", "created": int(time.time()), "model": MODEL}
    usage = {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9}
    if stream:
        return {**base, "object": "chat.completion.chunk"}
    message = {"role": "assistant", "content": REPLY}
    choice = {"index": 0, "message": message, "finish_reason": "length"}
    return {**base, "object": "chat.completion", "choices": [choice], "usage": usage}


def _sse(body: dict[str, Any]) -> bytes:
    chunk = _completion(stream=True)
    events = [
        {**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {**chunk, "choices": [{"index": 0, "delta": {"content": REPLY}}]},
        {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
    ]
    if (body.get("stream_options") or {}).get("include_usage"):
        usage = {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9}
        events.append({**chunk, "choices": [], "usage": usage})
    lines = [f"data: {json.dumps(e)}\n\n" for e in events] + ["data: [DONE]\n\n"]
    return "".join(lines).encode()


async def backend_app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        return
    raw = b""
    while True:
        message = await receive()
        raw += message.get("body", b"")
        if not message.get("more_body"):
            break
    path = scope["path"]
    if path.endswith("/models"):
        payload = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        status, content_type, out = 200, b"application/json", payload.encode()
    elif path.endswith("/chat/completions"):
        body = json.loads(raw or b"{}")
        if body.get("stream"):
            status, content_type, out = 200, b"text/event-stream", _sse(body)
        else:
            status, content_type = 200, b"application/json"
            out = json.dumps(_completion(stream=False)).encode()
    else:
        status, content_type, out = 404, b"application/json", b'{"error": "not found"}'
    headers = [(b"content-type", content_type), (b"content-length", str(len(out)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": out})


def serve_backend(port: int) -> None:
    import uvicorn

    uvicorn.run(backend_app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


# --- the three ways in ----------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _satisfice_config(backend_port: int, clients: int) -> str:
    return yaml.safe_dump(
        {
            "server": {"host": "127.0.0.1"},
            "engines": {
                MODEL: {
                    "backend": "openai_http",
                    "base_url": f"http://127.0.0.1:{backend_port}/v1",
                    "model": MODEL,
                    "concurrency": max(clients, 8),
                    "queue_size": 64,
                }
            },
        }
    )


def _litellm_config(backend_port: int, master_key: str) -> str:
    return yaml.safe_dump(
        {
            # LiteLLM refuses to start without one; requests then carry it as a Bearer
            # token (to all three targets alike), checked against the key in memory.
            "general_settings": {"master_key": master_key},
            "model_list": [
                {
                    "model_name": MODEL,
                    "litellm_params": {
                        "model": f"openai/{MODEL}",
                        "api_base": f"http://127.0.0.1:{backend_port}/v1",
                        "api_key": "unused",
                    },
                }
            ],
        }
    )


def find_litellm(explicit: str | None) -> str:
    candidates = [explicit] if explicit else []
    candidates += [str(ROOT / ".venv-litellm/bin/litellm"), shutil.which("litellm") or ""]
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return candidate
    raise SystemExit("LiteLLM not found: run `make bench-litellm` (or pass --litellm PATH)")


def _litellm_version(binary: str) -> str:
    python = Path(binary).parent / "python"
    code = "import importlib.metadata as m; print(m.version('litellm'))"
    found = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    return found.stdout.strip() or "unknown"


async def _wait_ready(http: httpx.AsyncClient, path: str, process: subprocess.Popen[bytes]) -> None:
    for _ in range(1200):
        if process.poll() is not None:
            raise RuntimeError(f"{process.args!r} exited with {process.returncode}")
        try:
            if (await http.get(path)).status_code == 200:
                return
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.25)
    raise TimeoutError(f"{process.args!r} not ready")


# --- measuring ------------------------------------------------------------------------

BODY = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Say OK."}],
    "max_tokens": 1,
    "temperature": 0,
}


async def _one(http: httpx.AsyncClient) -> float:
    started = time.perf_counter()
    response = await http.post("/v1/chat/completions", json=BODY)
    elapsed = time.perf_counter() - started
    if response.status_code != 200:
        raise RuntimeError(f"{http.base_url}: {response.status_code} {response.text[:300]}")
    if response.json()["choices"][0]["message"]["content"] != REPLY:
        raise RuntimeError(f"{http.base_url}: unexpected answer {response.text[:300]}")
    return elapsed


async def block(http: httpx.AsyncClient, clients: int, requests: int) -> list[float]:
    """``requests`` requests from ``clients`` closed-loop clients; each one's latency."""
    latencies: list[float] = []
    left = requests

    async def client() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            latencies.append(await _one(http))

    await asyncio.gather(*(client() for _ in range(clients)))
    return latencies


def _ms(values: list[float], q: float) -> float:
    return round(float(np.percentile(values, q)) * 1000, 3)


def summarise(latencies: dict[str, list[float]]) -> dict[str, Any]:
    out: dict[str, Any] = {"requests_each": len(latencies["direct"])}
    for target in TARGETS:
        out[f"{target}_p50_ms"] = _ms(latencies[target], 50)
        out[f"{target}_p99_ms"] = _ms(latencies[target], 99)
    for q in ("p50", "p99"):
        for proxy in ("satisfice", "litellm"):
            added = out[f"{proxy}_{q}_ms"] - out[f"direct_{q}_ms"]
            out[f"{proxy}_added_{q}_ms"] = round(added, 3)
        ratio = out[f"satisfice_added_{q}_ms"] / out[f"litellm_added_{q}_ms"]
        out[f"ratio_ours_to_litellm_{q}"] = round(ratio, 3)
    return out


async def measure(
    urls: dict[str, str], key: str, clients_list: list[int], requests: int, block_size: int
) -> dict[str, Any]:
    report: dict[str, Any] = {}
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    headers = {"Authorization": f"Bearer {key}"}
    clients = {
        t: httpx.AsyncClient(base_url=urls[t], timeout=60, limits=limits, headers=headers)
        for t in TARGETS
    }
    try:
        for target in TARGETS:  # connections open, first-request paths warm
            await block(clients[target], max(clients_list), 100)
        for concurrency in clients_list:
            latencies: dict[str, list[float]] = {t: [] for t in TARGETS}
            rounds = max(1, requests // block_size)
            for round_ in range(rounds):
                # Rotate the order each round: none of the three always goes first.
                order = TARGETS[round_ % 3 :] + TARGETS[: round_ % 3]
                for target in order:
                    await asyncio.sleep(0.05)
                    latencies[target] += await block(clients[target], concurrency, block_size)
            report[f"clients_{concurrency}"] = summarise(latencies)
    finally:
        for http in clients.values():
            await http.aclose()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000, help="per target and concurrency")
    parser.add_argument("--block", type=int, default=50, help="requests per interleaved block")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--litellm", help="the litellm executable")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--serve-backend", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_backend:
        serve_backend(args.serve_backend)
        return
    litellm = find_litellm(args.litellm)
    ports = {t: _free_port() for t in TARGETS}
    work = Path(tempfile.mkdtemp(prefix="litellm-overhead-"))
    (work / "satisfice.yaml").write_text(_satisfice_config(ports["direct"], max(args.clients)))
    master_key = f"sk-{secrets.token_hex(32)}"
    (work / "litellm.yaml").write_text(_litellm_config(ports["direct"], master_key))
    # LiteLLM would otherwise fetch its model price list from GitHub at start.
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR"}
    commands = {
        "direct": [sys.executable, __file__, "--serve-backend", str(ports["direct"])],
        "satisfice": [
            sys.executable,
            "-m",
            "gateway.cli",
            "serve",
            "--config",
            str(work / "satisfice.yaml"),
            "--port",
            str(ports["satisfice"]),
        ],
        "litellm": [
            litellm,
            "--config",
            str(work / "litellm.yaml"),
            "--host",
            "127.0.0.1",
            "--port",
            str(ports["litellm"]),
            "--num_workers",
            "1",
        ],
    }
    logs = {t: (work / f"{t}.log").open("wb") for t in TARGETS}
    processes = {
        t: subprocess.Popen(commands[t], cwd=ROOT, env=env, stdout=logs[t], stderr=logs[t])
        for t in TARGETS
    }
    urls = {t: f"http://127.0.0.1:{ports[t]}" for t in TARGETS}
    ready_paths = {"direct": "/v1/models", "satisfice": "/readyz", "litellm": "/health/liveliness"}

    async def run() -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=5) as http:
            for t in TARGETS:
                await _wait_ready(http, urls[t] + ready_paths[t], processes[t])
        return await measure(urls, master_key, args.clients, args.requests, args.block)

    try:
        report: dict[str, Any] = {"litellm_version": _litellm_version(litellm), "logs": str(work)}
        report.update(asyncio.run(run()))
    except BaseException:
        for t in TARGETS:
            print(f"--- {t} log ({work / f'{t}.log'}) ---", file=sys.stderr)
            print((work / f"{t}.log").read_text(errors="replace")[-3000:], file=sys.stderr)
        raise
    finally:
        for process in processes.values():
            process.terminate()
        for process in processes.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
