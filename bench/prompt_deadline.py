"""A long prompt with a short deadline, through a real gateway on the embedded default.

Issue 32: a 3,000-word prompt to `small` with a 5 s deadline took 39.9 s and ended
after 1 token, and with its client gone it kept the only `small` slot for 37 s. Each
arm sends a fresh 3,000-word prompt (about 3,800 tokens, no prefix the engine could
reuse) to `small`, on a fresh gateway each repeat:

- `stopped`: a 5 s deadline before the engine has measured how fast it reads (llama.cpp
  is stopped between two graph nodes at the deadline);
- `predicted`: the same once a 300-word prompt was read whole (refused at once);
- `left`: no deadline (the SLA's 20 s), the client gone after 3 s: how long the slot
  stays busy after it left.

`--before DIR` runs the same arms on another checkout (e.g. a worktree of the commit
before) in the same run, side by side.

    .venv/bin/python bench/prompt_deadline.py --repeat 3 --before ../before
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

DEADLINE_MS = 5000
BUSY = "satisfice_engine_busy_slots"


def long_prompt(words: int = 3000) -> str:
    """About ``words`` words, starting with a fresh tag, so no two share a prefix."""
    sentence = "the harbour trade grew as ships carried grain, salt and wool to the north"
    body = " ".join(f"Section {n}: {sentence}." for n in range(words // 17))  # 17 words each
    return f"[{uuid.uuid4().hex}] {body} Summarise the text above in one sentence."


def serve(folder: Path, checkout: Path | None) -> tuple[str, subprocess.Popen[bytes]]:
    """`satisfice serve` on the embedded default (of ``checkout``, if given), once ready."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port)],
        cwd=folder,
        env={
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            **({} if checkout is None else {"PYTHONPATH": str(checkout)}),
        },
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(3000):
        if process.poll() is not None:
            raise RuntimeError(f"the gateway exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return url, process
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    process.terminate()
    raise TimeoutError("the gateway was not ready")


def ask(url: str, prompt: str, deadline_ms: int | None) -> tuple[float, str]:
    """Seconds to the whole response, and its finish reason."""
    headers = {"x-satisfice-cache": "bypass"}
    if deadline_ms is not None:
        headers["x-satisfice-deadline-ms"] = str(deadline_ms)
    body = {"model": "small", "messages": [{"role": "user", "content": prompt}], "max_tokens": 16}
    started = time.monotonic()
    response = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=600)
    elapsed = time.monotonic() - started
    response.raise_for_status()
    return elapsed, response.json()["choices"][0]["finish_reason"]


def busy(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(BUSY) and 'engine="small"' in line
    )


def slot_held_after_leaving(url: str, leave_after_s: float) -> float:
    """Seconds the small engine stays busy after its client left mid-prompt."""
    body = {"model": "small", "messages": [{"role": "user", "content": long_prompt()}]}
    payload = json.dumps({**body, "max_tokens": 16}).encode()
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json"
        f"\r\nx-satisfice-cache: bypass\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    sock.sendall(head.encode() + payload)
    time.sleep(leave_after_s)
    sock.close()
    left = time.monotonic()
    while busy(url) > 0:
        # Finely at first, then gently: every scrape takes CPU from the engine itself.
        time.sleep(0.01 if time.monotonic() - left < 1.0 else 0.25)
    return time.monotonic() - left


ARMS = ("stopped", "predicted", "left")


def measure(checkout: Path | None, repeat: int) -> dict[str, list[tuple[float, str]]]:
    """Per arm, each repeat's seconds and finish reason."""
    figures: dict[str, list[tuple[float, str]]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(repeat):
            # A fresh gateway each time: `stopped` needs an engine that has not read a
            # prompt whole yet, so it does not know its speed.
            url, process = serve(Path(folder), checkout)
            try:
                figures["stopped"].append(ask(url, long_prompt(), DEADLINE_MS))
                ask(url, long_prompt(300), None)  # read whole: its speed is measured
                figures["predicted"].append(ask(url, long_prompt(), DEADLINE_MS))
                figures["left"].append((slot_held_after_leaving(url, 3.0), "-"))
            finally:
                process.terminate()
                process.wait()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--before", type=Path, help="another checkout, measured alongside")
    args = parser.parse_args()
    runs = {"this checkout": measure(None, args.repeat)}
    if args.before is not None:
        runs[f"before ({args.before})"] = measure(args.before.resolve(), args.repeat)
    print(f"deadline {DEADLINE_MS} ms; seconds to the whole response, or (left) the slot")
    print("busy after the client left: median and max over the repeats, finish reasons")
    for name, figures in runs.items():
        print(name)
        for arm, values in figures.items():
            seconds = [v for v, _ in values]
            finish = ",".join(sorted({f for _, f in values}))
            median, most = statistics.median(seconds), max(seconds)
            print(f"  {arm:>9}: {median:7.3f} {most:7.3f} n={len(values)} finish={finish}")


if __name__ == "__main__":
    main()
