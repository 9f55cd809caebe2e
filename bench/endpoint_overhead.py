"""What the Responses API and Anthropic's Messages add over chat completions.

One `satisfice serve` process (SmolLM2 as its engine, the cache in memory) answers the
same question through /v1/chat/completions, /v1/responses and /v1/messages, interleaved
(their order shuffled each round) over one keep-alive connection each, in two ways:

  - cached: the answer is an exact hit, so what is timed is the gateway alone (its
    decoding, translating and rendering); chat completions' exact hits take the
    express path before the web framework, the other two do not, so chat completions
    is also timed with the express path off (a second gateway), the fair twin;
  - generated: the cache bypassed, the engine writes 16 tokens greedily (what the new
    endpoints add to a real answer).

Each endpoint's median and p90 seconds, and the median of per-round ratios to chat
completions (same round, same answer), are printed and written with ``--json``.

    .venv/bin/python bench/endpoint_overhead.py [--rounds 200] [--generated 20] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
SATISFICE = str(ROOT / ".venv" / "bin" / "satisfice")
CONFIG = """
cache: {store: {kind: memory}}
engines:
  small: {backend: llama_cpp, model: smollm2-135m-instruct, template: chat, threads: 2}
"""
QUESTION = "What is the capital of France?"
SYSTEM = "Answer in one short sentence."


def chat_body(max_tokens: int) -> dict[str, Any]:
    return {
        "model": "small", "temperature": 0, "max_tokens": max_tokens,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
    }  # fmt: skip


def responses_body(max_tokens: int) -> dict[str, Any]:
    return {
        "model": "small", "temperature": 0, "max_output_tokens": max_tokens,
        "instructions": SYSTEM, "input": QUESTION,
    }  # fmt: skip


def messages_body(max_tokens: int) -> dict[str, Any]:
    return {
        "model": "small", "temperature": 0, "max_tokens": max_tokens, "system": SYSTEM,
        "messages": [{"role": "user", "content": QUESTION}],
    }  # fmt: skip


ENDPOINTS: dict[str, tuple[str, Callable[[int], dict[str, Any]]]] = {
    "chat completions": ("/v1/chat/completions", chat_body),
    "responses": ("/v1/responses", responses_body),
    "messages": ("/v1/messages", messages_body),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def gateway(folder: Path, *, express: bool) -> Iterator[str]:
    config = folder / f"gateway-{'x' if express else 'f'}.yaml"
    config.write_text(CONFIG + ("" if express else "server: {express_hits: false}\n"))
    port = free_port()
    log = (folder / f"{config.stem}.log").open("wb")
    process = subprocess.Popen(
        [SATISFICE, "serve", "--config", str(config), "--port", str(port)],
        cwd=ROOT, stderr=log, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            if process.poll() is not None:
                raise RuntimeError(f"the gateway exited; see {log.name}")
            try:
                if httpx.get(f"{url}/readyz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(30)
        log.close()


def timed(client: httpx.Client, path: str, body: dict[str, Any], bypass: bool) -> float:
    headers = {"x-satisfice-cache": "bypass"} if bypass else {}
    started = time.perf_counter()
    response = client.post(path, json=body, headers=headers)
    seconds = time.perf_counter() - started
    response.raise_for_status()
    served = response.headers.get("x-satisfice-cache")
    if not bypass and served != "exact":
        raise RuntimeError(f"{path} was not an exact hit ({served}): {response.text[:200]}")
    return seconds


def run(
    targets: dict[str, tuple[httpx.Client, str, dict[str, Any]]], rounds: int, bypass: bool
) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in targets}
    names = list(targets)
    for _ in range(rounds):
        random.shuffle(names)
        for name in names:
            client, path, body = targets[name]
            times[name].append(timed(client, path, body, bypass))
    return times


def summary(times: dict[str, list[float]], *references: str) -> dict[str, dict[str, float]]:
    """Each endpoint's median and p90, and the median of its per-round ratios to each
    of ``references``."""
    out = {}
    for name, seconds in times.items():
        row = {
            "median_ms": statistics.median(seconds) * 1000,
            "p90_ms": statistics.quantiles(seconds, n=10)[-1] * 1000,
            "n": len(seconds),
        }
        for reference in references:
            ratios = [a / b for a, b in zip(seconds, times[reference], strict=True)]
            row[f"ratio to {reference}"] = statistics.median(ratios)
        out[name] = row
    return out


def show(title: str, table: dict[str, dict[str, float]]) -> None:
    print(f"\n{title}")
    columns = list(next(iter(table.values())))
    print(f"{'endpoint':<34}" + "".join(f"{c:>{max(10, len(c) + 2)}}" for c in columns))
    for name, row in table.items():
        cells = "".join(f"{row[c]:>{max(10, len(c) + 2)}.3f}" for c in columns)
        print(f"{name:<34}{cells}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--generated", type=int, default=20, help="rounds with generation")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="endpoints-") as scratch:
        folder = Path(scratch)
        with gateway(folder, express=True) as fast, gateway(folder, express=False) as plain:
            clients = [httpx.Client(base_url=url, timeout=120) for url in (fast, plain)]
            express, framework = clients
            cached = {name: (express, path, make(16)) for name, (path, make) in ENDPOINTS.items()}
            chat_path = ENDPOINTS["chat completions"][0]
            cached["chat completions, framework path"] = (framework, chat_path, chat_body(16))
            for client, path, body in cached.values():  # the answer made, then cached
                client.post(path, json=body).raise_for_status()
            time.sleep(1)  # the write-backs land
            run(cached, 10, bypass=False)  # warm
            hits = summary(
                run(cached, args.rounds, bypass=False),
                "chat completions",
                "chat completions, framework path",
            )
            fresh = {name: (express, path, make(16)) for name, (path, make) in ENDPOINTS.items()}
            run(fresh, 2, bypass=True)
            generated = summary(run(fresh, args.generated, bypass=True), "chat completions")
            for client in clients:
                client.close()
    show("exact hits (the gateway alone)", hits)
    show("generated, 16 tokens greedy (the cache bypassed)", generated)
    if args.json:
        args.json.write_text(json.dumps({"cached": hits, "generated": generated}, indent=2))


if __name__ == "__main__":
    main()
