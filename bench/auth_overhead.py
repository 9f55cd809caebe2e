"""What API keys and shared rate limits add to a request, side by side in one run.

Three real `satisfice serve` processes on 127.0.0.1 with the same bundled small model
and in-process cache, differing only in `auth:`:
  - open: no keys (the embedded default's way);
  - keys: a key per request, checked by its SHA-256;
  - keys + limits: the same key with requests and tokens per minute, counted in Redis
    (one Lua script per request, as every replica would share them).
Each is warmed with one answer, then asked for it again and again: an exact cache hit
is the gateway's cheapest path, so what auth adds shows most there. Requests go round
robin over the three (open, keys, limits, open, ...) so machine noise hits all alike.

    .venv/bin/python bench/auth_overhead.py [--requests 2000] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

from gateway.ops.keys import hash_key

KEY = f"sk-bench-{uuid.uuid4().hex}"
ENGINE = """
cache: {}
engines:
  small: {backend: llama_cpp, model: smollm2-135m-instruct}
"""
AUTH = {
    "open": "",
    "keys": f"auth: {{keys: {{bench: {{sha256: {hash_key(KEY)}}}}}}}\n",
    # Limits far above what the run sends: every request is counted, none refused.
    "keys + limits": (
        "auth:\n  rate_limit_url: redis://127.0.0.1:6379/0\n  keys:\n"
        f"    bench-{uuid.uuid4().hex[:8]}:\n      sha256: {hash_key(KEY)}\n"
        "      requests_per_minute: 10000000\n      tokens_per_minute: 1000000000\n"
    ),
}
QUESTION = {
    "model": "small",
    "temperature": 0,
    "max_tokens": 48,
    "messages": [{"role": "user", "content": "Reply with one word: the sky's colour."}],
}


def start_gateway(config_text: str, directory: Path) -> tuple[str, subprocess.Popen[bytes]]:
    """A `satisfice serve` process with this config on a free port, once it is ready.
    (tests/support.py has the tests' own; a script cannot import tests/, which is not
    an installed package.)"""
    config = directory / f"satisfice-{uuid.uuid4().hex[:6]}.yaml"
    config.write_text(config_text)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config)]
    process = subprocess.Popen([*command, "--port", str(port)])
    url = f"http://127.0.0.1:{port}"
    for _ in range(1200):  # two minutes: the model loads and is checked first
        if process.poll() is not None:
            raise SystemExit(f"the gateway exited with status {process.returncode}")
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return url, process
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    process.kill()
    raise SystemExit("the gateway was not ready within two minutes")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="per configuration")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args()

    directory = Path(tempfile.mkdtemp(prefix="auth-bench-"))
    gateways: dict[str, tuple[str, subprocess.Popen[bytes]]] = {}
    try:
        for name, auth in AUTH.items():
            gateways[name] = start_gateway(auth + ENGINE, directory)
        headers = {"Authorization": f"Bearer {KEY}"}
        clients = {name: httpx.Client(base_url=url, headers=headers, timeout=60)
                   for name, (url, _) in gateways.items()}  # fmt: skip
        for name, client in clients.items():  # warm: the answer, then its write-back
            for _ in range(100):
                response = client.post("/v1/chat/completions", json=QUESTION)
                response.raise_for_status()
                if response.headers["x-satisfice-cache"] == "exact":
                    break
                time.sleep(0.1)
            else:
                raise SystemExit(f"{name}: the answer was never cached")
        seconds: dict[str, list[float]] = {name: [] for name in clients}
        for _ in range(args.requests):
            for name, client in clients.items():
                started = time.perf_counter()
                response = client.post("/v1/chat/completions", json=QUESTION)
                seconds[name].append(time.perf_counter() - started)
                assert response.headers["x-satisfice-cache"] == "exact", response.text
    finally:
        for _, process in gateways.values():
            process.terminate()
            try:
                process.wait(timeout=30)  # requests in flight finish first
            except subprocess.TimeoutExpired:
                process.kill()

    base = percentile(seconds["open"], 0.5)
    rows = {}
    print(f"{'auth':<14} {'p50 ms':>8} {'p99 ms':>8} {'added p50 ms':>13} {'ratio p50':>10}")
    for name, values in seconds.items():
        p50, p99 = percentile(values, 0.5), percentile(values, 0.99)
        rows[name] = {"p50_ms": p50 * 1000, "p99_ms": p99 * 1000,
                      "added_p50_ms": (p50 - base) * 1000, "ratio_p50": p50 / base}  # fmt: skip
        print(f"{name:<14} {p50 * 1000:>8.3f} {p99 * 1000:>8.3f} "
              f"{(p50 - base) * 1000:>13.3f} {p50 / base:>10.3f}")  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps({"requests": args.requests, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
