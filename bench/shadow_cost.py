"""What shadow checks cost live traffic: latency with a share of shortcuts checked
against latency with none, side by side in one run on one gateway.

One real `satisfice serve` (the embedded default, its loop off so that a routed
question is one pass of an engine, and no cache, so every request generates), asked
factual questions (TriviaQA, which the router was not fitted on) through `model:
auto`. Blocks of requests alternate between shadowing off and on (the config file
rewritten and reloaded between blocks, so both arms share the process, its warm
caches and the machine's state); after each "on" block the bench waits until no check
is pending, so none spills into the next block.

  - spare capacity: one client, a pause between requests (checks run in the pauses and
    live requests stop them); each block's questions are asked in both arms, so the
    arms ask the same questions: p50 and p99 of each arm, their ratio, the median of
    each question's on/off ratio, and what became of the checks drawn;
  - saturation: several clients back to back, so live requests always generate and no
    check ever has room: the checks are dropped (stale or queue_full), not run, and the
    latency is the same.

    .venv/bin/python bench/shadow_cost.py [--blocks 8] [--per-block 15] [--pause 1.5]
        [--share 0.05] [--clients 3] [--saturate-s 60] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data" / "triviaqa" / "triviaqa_sm_sub.jsonl"


def questions(limit: int, seed: int) -> list[str]:
    # Split on newlines only: some questions hold U+2028, which splitlines() splits on.
    lines = [line for line in DATA.read_text().split("\n") if line.strip()]
    asked = []
    for line in lines:
        context = json.loads(line)["context"]
        asked.append(context.removeprefix("Question: ").removesuffix("\nAnswer:").strip())
    random.Random(seed).shuffle(asked)
    return asked[:limit]


def config_text(share: float, outcomes: Path) -> str:
    raw = yaml.safe_load((ROOT / "gateway" / "config" / "default.yaml").read_text())
    raw["loop"] = None
    raw["cache"] = None
    # A check waits at most 15 s for room (120 s by default), so that the saturated
    # blocks show what becomes of checks that never find any.
    raw["shadow"] = {"share": share, "outcomes_file": str(outcomes), "max_wait_s": 15}
    raw["server"] = {**(raw.get("server") or {}), "access_log": False}
    return yaml.safe_dump(raw)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Gateway:
    def __init__(self, folder: Path) -> None:
        self.config = folder / "gateway.yaml"
        self.outcomes = folder / "outcomes.jsonl"
        self.config.write_text(config_text(0.0, self.outcomes))
        self.url = f"http://127.0.0.1:{_free_port()}"
        port = self.url.rsplit(":", 1)[1]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "--config", str(self.config),
             "--port", port],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=(folder / "serve.log").open("wb"),
        )  # fmt: skip

    async def ready(self, http: httpx.AsyncClient) -> None:
        for _ in range(1500):
            if self.process.poll() is not None:
                raise RuntimeError("the gateway exited; see serve.log")
            try:
                if (await http.get(f"{self.url}/readyz")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.2)
        raise TimeoutError("the gateway is not ready")

    async def share(self, http: httpx.AsyncClient, share: float) -> None:
        """Reload the config with ``share``, and wait until the gateway says so."""
        before = await self.metric(http, "satisfice_config_reloads_total", result="success")
        self.config.write_text(config_text(share, self.outcomes))
        self.process.send_signal(signal.SIGHUP)
        for _ in range(200):
            now = await self.metric(http, "satisfice_config_reloads_total", result="success")
            if now > before:
                return
            await asyncio.sleep(0.05)
        raise TimeoutError("the reload did not take")

    async def metric(self, http: httpx.AsyncClient, name: str, **labels: str) -> float:
        text = (await http.get(f"{self.url}/metrics")).text
        total = 0.0
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                wanted = all(sample.labels.get(k) == v for k, v in labels.items())
                if sample.name == name and wanted:
                    total += sample.value
        return total

    async def checks(self, http: httpx.AsyncClient) -> dict[str, float]:
        text = (await http.get(f"{self.url}/metrics")).text
        found: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "satisfice_shadow_checks_total":
                    key = sample.labels["status"] + (
                        f":{sample.labels['reason']}" if sample.labels["reason"] else ""
                    )
                    found[key] = found.get(key, 0.0) + sample.value
        return found

    async def drained(self, http: httpx.AsyncClient) -> None:
        while await self.metric(http, "satisfice_shadow_checks_pending"):  # noqa: ASYNC110
            await asyncio.sleep(0.25)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


async def ask(http: httpx.AsyncClient, url: str, question: str) -> float:
    started = time.perf_counter()
    response = await http.post(
        f"{url}/v1/chat/completions",
        json={"model": "auto", "messages": [{"role": "user", "content": question}],
              "max_tokens": 32, "temperature": 0},
        timeout=300,
    )  # fmt: skip
    response.raise_for_status()
    return time.perf_counter() - started


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _arm(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50_s": _pct(values, 0.5),
        "p99_s": _pct(values, 0.99),
        "mean_s": statistics.fmean(values),
    }


async def spare(http: httpx.AsyncClient, gateway: Gateway, asked: list[str],
                args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    """Each block's questions asked twice, once with checks on and once off (the order
    alternating by block), so each question's two latencies pair up."""
    latencies: dict[str, list[float]] = {"off": [], "on": []}
    checks_before = await gateway.checks(http)
    for block in range(args.blocks):
        questions = asked[block * args.per_block : (block + 1) * args.per_block]
        for arm in ("on", "off") if block % 2 == 0 else ("off", "on"):
            await gateway.share(http, args.share if arm == "on" else 0.0)
            for question in questions:
                latencies[arm].append(await ask(http, gateway.url, question))
                await asyncio.sleep(args.pause)
            await gateway.drained(http)
        print(f"block {block + 1}/{args.blocks} done", file=sys.stderr)
    checks_after = await gateway.checks(http)
    off, on = _arm(latencies["off"]), _arm(latencies["on"])
    ratios = sorted(a / b for a, b in zip(latencies["on"], latencies["off"], strict=True))
    return {
        "off": off,
        "on": on,
        "p50_ratio": on["p50_s"] / off["p50_s"],
        "p99_ratio": on["p99_s"] / off["p99_s"],
        "mean_ratio": on["mean_s"] / off["mean_s"],
        "paired_median_ratio": statistics.median(ratios),
        "paired_quartiles": [_pct(ratios, 0.25), _pct(ratios, 0.75)],
        "checks": {k: v - checks_before.get(k, 0.0) for k, v in checks_after.items()},
    }


async def _client(
    http: httpx.AsyncClient, url: str, pool: Iterator[str], until: float, latencies: list[float]
) -> None:
    """Back to back until ``until``."""
    while time.monotonic() < until:
        latencies.append(await ask(http, url, next(pool)))


async def saturated(http: httpx.AsyncClient, gateway: Gateway, asked: list[str],
                    args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    result: dict[str, Any] = {}
    pool = iter(asked)
    for arm in ("off", "on", "on", "off"):
        await gateway.share(http, args.share if arm == "on" else 0.0)
        before = await gateway.checks(http)
        latencies: list[float] = []
        until = time.monotonic() + args.saturate_s / 4
        await asyncio.gather(
            *(_client(http, gateway.url, pool, until, latencies) for _ in range(args.clients))
        )
        during = await gateway.checks(http)  # before the quiet after the block
        pending = await gateway.metric(http, "satisfice_shadow_checks_pending")
        await gateway.drained(http)
        after = await gateway.checks(http)
        entry = result.setdefault(
            arm, {"latencies": [], "checks": {}, "during": {}, "pending_at_end": 0.0}
        )
        entry["latencies"] += latencies
        entry["pending_at_end"] += pending
        for k, v in after.items():
            entry["checks"][k] = entry["checks"].get(k, 0.0) + v - before.get(k, 0.0)
        for k, v in during.items():
            entry["during"][k] = entry["during"].get(k, 0.0) + v - before.get(k, 0.0)
    for arm in ("off", "on"):
        result[arm].update(_arm(result[arm].pop("latencies")))
    result["p50_ratio"] = result["on"]["p50_s"] / result["off"]["p50_s"]
    result["p99_ratio"] = result["on"]["p99_s"] / result["off"]["p99_s"]
    return result


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    asked = questions(args.blocks * args.per_block + 2000, args.seed)
    with tempfile.TemporaryDirectory(prefix="shadow-cost-") as folder:
        gateway = Gateway(Path(folder))
        try:
            async with httpx.AsyncClient() as http:
                await gateway.ready(http)
                for question in asked[-3:]:  # warm both engines' first calls
                    await ask(http, gateway.url, question)
                spare_result = await spare(http, gateway, asked, args)
                rest = asked[args.blocks * args.per_block :]
                saturated_result = await saturated(http, gateway, rest, args)
        finally:
            gateway.stop()
    return {"share": args.share, "spare": spare_result, "saturated": saturated_result}


def report(result: dict[str, Any]) -> str:
    lines = [f"shadow share {result['share']:.0%} against off, one gateway, blocks alternated"]
    for name in ("spare", "saturated"):
        part = result[name]
        lines.append(f"{name}:")
        for arm in ("off", "on"):
            a = part[arm]
            lines.append(f"  {arm:3}  n={a['n']:4}  p50 {a['p50_s'] * 1000:7.0f} ms  "
                         f"p99 {a['p99_s'] * 1000:7.0f} ms")  # fmt: skip
        lines.append(f"  on/off: p50 {part['p50_ratio']:.3f}, p99 {part['p99_ratio']:.3f}")
        if "paired_median_ratio" in part:
            low, high = part["paired_quartiles"]
            lines.append(f"  the same question on/off: median {part['paired_median_ratio']:.3f}"
                         f" (quartiles {low:.3f}-{high:.3f})")  # fmt: skip
        checks = part["checks"] if name == "spare" else part["on"]["checks"]
        lines.append("  checks drawn: " + _counts(checks))
        if name == "saturated":
            lines.append("  of which recorded while saturated: " + _counts(part["on"]["during"])
                         + f"; pending when it ended: {part['on']['pending_at_end']:.0f}"
                         " (run, or dropped as stale, in the quiet after)")  # fmt: skip
    return "\n".join(lines)


def _counts(checks: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.0f}" for k, v in sorted(checks.items()) if v) or "none"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=8,
                        help="blocks, each asked with checks on and off")  # fmt: skip
    parser.add_argument("--per-block", type=int, default=15)
    parser.add_argument("--pause", type=float, default=1.5, help="seconds between requests")
    parser.add_argument("--share", type=float, default=0.05)
    parser.add_argument("--clients", type=int, default=3, help="saturating clients")
    parser.add_argument("--saturate-s", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=34)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    print(report(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
