"""The reasoning loop under load: concurrent hard requests against a deadline.

A real `satisfice serve` on 127.0.0.1 (the embedded default config, with every routed
question hard and the given fallback policy) takes ``--clients`` concurrent streaming
clients, each sending ``--requests`` hard questions one after another with the header
``x-satisfice-deadline-ms``. Per deadline and fallback policy it reports:

  - time to the first streamed byte (the loop's first ``reasoning_content``),
  - time to the final answer (the ``content`` chunk, or the error event),
  - SLA misses: responses that ended later than the deadline + 100 ms,
  - the fallback rate (answers given by a fallback, errors included) and stop reasons.

Then what stopping work costs: a new turn of the same conversation while the last one
is generating (the server's own measure, ``x-satisfice-superseded-ms``, and the new
turn's first byte against an idle one's), and a client that disconnects mid-stream
(the next request's first byte against an idle one's).

    .venv/bin/python bench/loop_latency.py [--deadlines 2000 5000] [--fallbacks best small]
        [--clients 8] [--requests 6] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from evaluator.answers import read_questions

ROOT = Path(__file__).resolve().parent.parent

SLA_SLACK_S = 0.1
LONG = "Write a long story about a dragon who learns to fly."
# Answered in a few tokens per branch: its answer time shows any work left running.
SHORT = "Is ice cold?"


def _config(fallback: str) -> str:
    # The shipped default, as users run it, but every routed question is hard and
    # nothing is cached, so that every request does the work.
    raw = yaml.safe_load((ROOT / "gateway" / "config" / "default.yaml").read_text())
    raw["router"]["threshold"] = 0.0
    raw["sla"]["fallback"] = {"policy": fallback, "hedge": fallback == "small"}
    raw["cache"] = None
    return yaml.safe_dump(raw)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _start(fallback: str, folder: Path) -> tuple[str, subprocess.Popen[bytes]]:
    path = folder / f"loop-{fallback}.yaml"
    path.write_text(_config(fallback))
    port = _free_port()
    process = subprocess.Popen(  # noqa: ASYNC220 - once, before anything is measured
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path), "--port", str(port)],
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient() as http:
        for _ in range(900):
            if process.poll() is not None:
                raise RuntimeError("gateway exited")
            try:
                if (await http.get(f"{url}/readyz")).status_code == 200:
                    return url, process
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.2)
    raise TimeoutError("gateway not ready")


Outcome = dict[str, Any]


async def _ask(
    http: httpx.AsyncClient,
    url: str,
    question: str,
    deadline_ms: int | None,
    user: str | None = None,
) -> Outcome:
    body: dict[str, Any] = {
        "model": "auto",
        "messages": [{"role": "user", "content": question}],
        "stream": True,
    }
    if user:
        body["user"] = user
    headers = {} if deadline_ms is None else {"x-satisfice-deadline-ms": str(deadline_ms)}
    started = time.perf_counter()
    out: Outcome = {"first_s": None, "answer_s": None, "status": 0, "fallback": None,
                    "stop": None, "error": None}  # fmt: skip
    async with http.stream(
        "POST", f"{url}/v1/chat/completions", json=body, headers=headers
    ) as response:
        out["status"] = response.status_code
        out["superseded_ms"] = response.headers.get("x-satisfice-superseded-ms")
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if out["first_s"] is None:
                out["first_s"] = time.perf_counter() - started
            if line == "data: [DONE]":
                break
            event = json.loads(line[6:])
            if "error" in event:
                out["error"] = event["error"].get("code")
                out["answer_s"] = time.perf_counter() - started
                break
            for choice in event.get("choices", []):
                if choice["delta"].get("content") and out["answer_s"] is None:
                    out["answer_s"] = time.perf_counter() - started
            if "satisfice" in event:
                out["fallback"] = event["satisfice"]["fallback"]
                out["stop"] = event["satisfice"]["stop"]
        if response.status_code != 200:
            out["error"] = json.loads(await response.aread() or b"{}").get("error", {}).get("code")
    out["total_s"] = time.perf_counter() - started
    return out


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def _load(
    url: str, questions: list[str], deadline_ms: int, clients: int, requests: int
) -> dict[str, Any]:
    outcomes: list[Outcome] = []
    rng = random.Random(deadline_ms)

    async def client(http: httpx.AsyncClient) -> None:
        for _ in range(requests):
            outcomes.append(await _ask(http, url, rng.choice(questions), deadline_ms))

    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=60) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    wall = time.perf_counter() - started
    firsts = [o["first_s"] for o in outcomes if o["first_s"] is not None]
    totals = [o["total_s"] for o in outcomes]
    limit = deadline_ms / 1000 + SLA_SLACK_S
    answered = [o for o in outcomes if o["status"] == 200 and o["error"] is None]
    stops: dict[str, int] = {}
    fallbacks: dict[str, int] = {}
    for o in outcomes:
        stop = str(o["stop"] or o["error"] or o["status"])
        stops[stop] = stops.get(stop, 0) + 1
        used = str(o["fallback"] or ("error" if o["error"] else "none"))
        fallbacks[used] = fallbacks.get(used, 0) + 1
    return {
        "deadline_ms": deadline_ms,
        "requests": len(outcomes),
        "wall_s": wall,
        "first_byte_ms": {"p50": 1000 * _pct(firsts, 0.5), "p99": 1000 * _pct(firsts, 0.99)},
        "total_ms": {
            "p50": 1000 * _pct(totals, 0.5),
            "p99": 1000 * _pct(totals, 0.99),
            "max": 1000 * max(totals),
        },
        "sla_miss_rate": sum(t > limit for t in totals) / len(totals),
        "fallback_rate": sum(used != "none" for used in _fallbacks(outcomes)) / len(outcomes),
        "answered": len(answered),
        "fallbacks": fallbacks,
        "stops": stops,
        "statuses": sorted({o["status"] for o in outcomes}),
    }


def _fallbacks(outcomes: list[Outcome]) -> list[str]:
    return [str(o["fallback"] or ("error" if o["error"] else "none")) for o in outcomes]


async def _idle(http: httpx.AsyncClient, url: str, trials: int) -> list[Outcome]:
    out = []
    for _ in range(trials):
        out.append(await _ask(http, url, SHORT, None))
        await asyncio.sleep(0.3)
    return out


async def _switching(url: str, trials: int) -> dict[str, Any]:
    """What a new turn and a client that leaves cost."""
    async with httpx.AsyncClient(timeout=60) as http:
        idle = await _idle(http, url, trials)
        superseded, new_turn = [], []
        for i in range(trials):
            user = f"switch-{i}"
            first = asyncio.create_task(_ask(http, url, LONG, None, user=user))
            await asyncio.sleep(1.0)  # generating by now
            second = await _ask(http, url, SHORT, None, user=user)
            old = await first
            assert old["error"] == "superseded", old
            superseded.append(float(second["superseded_ms"]))
            new_turn.append(second)
            await asyncio.sleep(0.3)
        after_leaving = []
        for _ in range(trials):
            started = time.perf_counter()
            async with http.stream("POST", f"{url}/v1/chat/completions", json={
                "model": "auto", "stream": True,
                "messages": [{"role": "user", "content": LONG}],
            }) as response:  # fmt: skip
                async for line in response.aiter_lines():
                    if time.perf_counter() - started > 1.0 and line:
                        break  # the client leaves mid-loop
            after_leaving.append(await _ask(http, url, SHORT, None))
            await asyncio.sleep(0.3)

    def ms(outcomes: list[Outcome], key: str) -> dict[str, float]:
        values = [o[key] for o in outcomes]
        return {"p50": 1000 * statistics.median(values), "max": 1000 * max(values)}

    return {
        "trials": trials,
        # The server's own measure: from the new turn's arrival to the old loop's task
        # ended (its engine samples told to stop; each stops within a token).
        "superseded_stop_ms": {"p50": statistics.median(superseded), "max": max(superseded)},
        # A short hard question's first byte and answer: idle, as the new turn of a
        # conversation whose last turn was generating, and right after a client left
        # mid-loop. Work left running would show as a later answer.
        "first_byte_ms": {
            "idle": ms(idle, "first_s"),
            "new_turn": ms(new_turn, "first_s"),
            "after_disconnect": ms(after_leaving, "first_s"),
        },
        "answer_ms": {
            "idle": ms(idle, "answer_s"),
            "new_turn": ms(new_turn, "answer_s"),
            "after_disconnect": ms(after_leaving, "answer_s"),
        },
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    questions = [q.prompt for q in read_questions(args.questions)]
    report: dict[str, Any] = {
        "clients": args.clients,
        "requests_per_client": args.requests,
        "runs": [],
    }
    with tempfile.TemporaryDirectory() as folder:
        for fallback in args.fallbacks:
            url, process = await _start(fallback, Path(folder))
            try:
                for deadline in args.deadlines:
                    row = await _load(url, questions, deadline, args.clients, args.requests)
                    row["fallback_policy"] = fallback
                    report["runs"].append(row)
                    print(json.dumps(row), flush=True)
                if fallback == args.fallbacks[0] and args.switch_trials:
                    report["switching"] = await _switching(url, args.switch_trials)
                    print(json.dumps(report["switching"]), flush=True)
            finally:
                process.terminate()
                process.wait(30)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--questions", default=str(ROOT / "bench/out/bank_questions.jsonl"))
    parser.add_argument("--deadlines", type=int, nargs="+", default=[2000, 5000])
    parser.add_argument("--fallbacks", nargs="+", default=["best", "small"])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=6, help="per client")
    parser.add_argument("--switch-trials", type=int, default=8)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    report = asyncio.run(main_async(args))
    print()
    print(f"{'fallback':8} {'deadline':>8} {'n':>4} {'1st byte p50/p99 ms':>20} "
          f"{'answer p50/p99/max ms':>24} {'SLA miss':>8} {'fallback':>8}  stops")  # fmt: skip
    for row in report["runs"]:
        first, total = row["first_byte_ms"], row["total_ms"]
        print(
            f"{row['fallback_policy']:8} {row['deadline_ms']:>8} {row['requests']:>4} "
            f"{first['p50']:>9.0f}/{first['p99']:<10.0f} "
            f"{total['p50']:>8.0f}/{total['p99']:.0f}/{total['max']:<8.0f} "
            f"{row['sla_miss_rate']:>8.1%} {row['fallback_rate']:>8.1%}  {row['stops']}"
        )
    if "switching" in report:
        print(json.dumps(report["switching"], indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
