"""Answer while thinking: what a reader of a streamed hard question sees, and when.

Held-out word problems (a question file from bench/convert_datasets.py, less every
question of the files given to --exclude: the router's fitting set and the trace
bank the calibrator was fitted on) are streamed through real gateways on the embedded
default, every routed question hard (router threshold 0) and nothing cached. Arms, in
one run, each question asked of each arm in turn, the order rotated per question so
that a slow spell of the machine falls on all of them:

  before  --before DIR: an earlier checkout (``git worktree add ../before <commit>``),
          whose stream shows the loop's notes only
  live    this tree: the first branch of each round streams as it is generated
  first   this tree with ``x-satisfice-first-answer: true``: the small engine's
          provisional answer first, then the loop's

Per arm: the first meaningful token (the first streamed text that is not the loop's
opening status line: a branch's token, a first answer, a round's summary, or the
answer), p50 and p90 from the request; the final answer's time (its content); accuracy
with 95% Wilson intervals; and for ``first``, how often the loop's answer confirmed,
replaced or outran the first answer, and the first answers' own accuracy.

    .venv/bin/python bench/answer_while_thinking.py --questions FILE.jsonl \\
        --exclude bench/out/questions.jsonl bench/banks/gsm8k/*.xz \\
        [--before ../before] [--count 20] [--json FILE] [--show]

``--show`` asks the first question once through the official openai client, with a
first answer, and prints what it renders: the reasoning as it came, and the content,
all that a client which ignores ``reasoning_content`` sees.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import lzma
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import openai
import yaml

from evaluator.answers import LabelledQuestion, is_correct, read_questions
from evaluator.replay_report import wilson

ROOT = Path(__file__).resolve().parent.parent
FIRST_ANSWER = {"x-satisfice-first-answer": "true"}


def _config(tree: Path) -> str:
    """``tree``'s shipped default as users run it, but every routed question is hard
    and nothing is cached, so that every request does the loop's work."""
    raw = yaml.safe_load((tree / "gateway" / "config" / "default.yaml").read_text())
    raw["router"]["threshold"] = 0.0
    raw["cache"] = None
    return yaml.safe_dump(raw)


def _key(prompt: str) -> str:
    """A question as a bank or another phrasing of the file would start it."""
    return re.sub(r"[^a-z0-9]", "", prompt.lower())[:80]


def _prompts(path: Path) -> set[str]:
    raw = lzma.decompress(path.read_bytes()) if path.suffix == ".xz" else path.read_bytes()
    return {_key(json.loads(line)["prompt"]) for line in raw.splitlines() if line.strip()}


def held_out(questions: Path, exclude: list[Path], count: int) -> list[LabelledQuestion]:
    seen = set().union(*(_prompts(p) for p in exclude)) if exclude else set()
    kept = [q for q in read_questions(questions) if _key(q.prompt) not in seen]
    print(f"{len(kept)} held-out questions; asking {min(count, len(kept))}", file=sys.stderr)
    return kept[:count]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(tree: Path, folder: Path) -> tuple[str, subprocess.Popen[bytes]]:
    config = folder / f"{tree.name}.yaml"
    config.write_text(_config(tree))
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config),
         "--port", str(port)],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    return f"http://127.0.0.1:{port}", process


async def _ready(http: httpx.AsyncClient, url: str, process: subprocess.Popen[bytes]) -> None:
    for _ in range(1500):
        if process.poll() is not None:
            raise RuntimeError(f"the gateway at {url} exited")
        try:
            if (await http.get(f"{url}/readyz")).status_code == 200:
                return
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.2)
    raise TimeoutError(f"the gateway at {url} is not ready")


async def ask(
    http: httpx.AsyncClient, url: str, question: LabelledQuestion, headers: dict[str, str]
) -> dict[str, Any]:
    """One streamed question: when its first meaningful token and its answer came, the
    answer, and the loop's trace."""
    body = {"model": "auto", "stream": True,
            "messages": [{"role": "user", "content": question.prompt}]}  # fmt: skip
    started = time.perf_counter()
    meaningful_s = answer_s = None
    content: list[str] = []
    trace: dict[str, Any] = {}
    error = None
    async with http.stream(
        "POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=300
    ) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:  # in the stream begun: 504 deadline_exceeded, say
                error = chunk["error"]["code"]
                continue
            trace = chunk.get("satisfice", trace)
            if not chunk["choices"]:
                continue
            delta = chunk["choices"][0]["delta"]
            reasoning, text = delta.get("reasoning_content"), delta.get("content")
            now = time.perf_counter() - started
            opening = reasoning is not None and reasoning.startswith("Thinking (")
            if meaningful_s is None and (text or (reasoning and not opening)):
                meaningful_s = now
            if text:
                answer_s = answer_s or now
                content.append(text)
    answer = "".join(content)
    first = trace.get("first_answer")
    # The final answer's time; a stream that ended without one (504 in the stream), its end.
    final_s = answer_s if answer_s is not None else time.perf_counter() - started
    return {
        "meaningful_s": meaningful_s,
        "answer_s": final_s,
        "correct": is_correct(question, answer),
        "answer": answer,
        "error": error,
        "rounds": len(trace.get("rounds", [])),
        "fallback": trace.get("fallback"),
        "first_verdict": None if first is None else first["verdict"],
        # The trace's reading of the first answer; a number compares as one.
        "first_correct": None
        if first is None or first["answer"] is None
        else is_correct(question, first["answer"]),
    }


def show(url: str, question: LabelledQuestion) -> dict[str, Any]:
    """One streamed question through the official openai client, with a first answer:
    what it renders as reasoning, when, and what a client that reads only
    ``delta.content`` (as most do) is shown."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    started = time.perf_counter()
    stream = client.chat.completions.create(
        model="auto",
        messages=[{"role": "user", "content": question.prompt}],
        stream=True,
        extra_headers={**FIRST_ANSWER, "x-satisfice-cache": "bypass"},
    )
    reasoning: list[tuple[float, str]] = []
    content: list[tuple[float, str]] = []
    for chunk in stream:
        if not chunk.choices:
            continue
        delta, at = chunk.choices[0].delta, round(time.perf_counter() - started, 3)
        if text := (delta.model_extra or {}).get("reasoning_content"):
            reasoning.append((at, text))
        if delta.content:
            content.append((at, delta.content))
    return {
        "question": question.prompt,
        "reasoning_chunks": len(reasoning),
        "reasoning_first_10": reasoning[:10],
        "reasoning_text": "".join(t for _, t in reasoning),
        "content_only_client_sees": [(at, text) for at, text in content],
    }


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    meaningful = [r["meaningful_s"] for r in rows if r["meaningful_s"] is not None]
    answered = [r["answer_s"] for r in rows if r["answer_s"] is not None]
    right = sum(r["correct"] for r in rows)
    low, high = wilson(right, len(rows))
    out: dict[str, Any] = {
        "questions": len(rows),
        "meaningful_p50_s": round(statistics.median(meaningful), 3),
        "meaningful_p90_s": round(_pct(meaningful, 0.9), 3),
        "answer_p50_s": round(statistics.median(answered), 3),
        "answer_p90_s": round(_pct(answered, 0.9), 3),
        "answer_mean_s": round(statistics.fmean(answered), 3),
        "accuracy": round(right / len(rows), 4),
        "accuracy_95": [round(low, 4), round(high, 4)],
        "rounds_mean": round(statistics.fmean(r["rounds"] for r in rows), 2),
        "fallbacks": dict(Counter(r["fallback"] for r in rows)),
        "errors": dict(Counter(r["error"] for r in rows if r["error"])),
    }
    verdicts = [r["first_verdict"] for r in rows if r["first_verdict"] is not None]
    if verdicts:
        out["first_verdicts"] = dict(Counter(verdicts))
        judged = [v for v in verdicts if v in ("confirmed", "replaced")]
        replaced = judged.count("replaced")
        low, high = wilson(replaced, len(judged))
        out["first_replaced_share"] = round(replaced / len(judged), 4) if judged else None
        out["first_replaced_95"] = [round(low, 4), round(high, 4)]
        first = [r["first_correct"] for r in rows if r["first_correct"] is not None]
        low, high = wilson(sum(first), len(first))
        out["first_accuracy"] = round(sum(first) / len(first), 4) if first else None
        out["first_accuracy_95"] = [round(low, 4), round(high, 4)]
        out["first_read"] = len(first)
    return out


async def run(
    questions: list[LabelledQuestion], arms: dict[str, tuple[str, dict[str, str]]]
) -> dict[str, Any]:
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in arms}
    names = list(arms)
    async with httpx.AsyncClient() as http:
        for i, question in enumerate(questions):
            turn = names[i % len(names) :] + names[: i % len(names)]
            for name in turn:
                url, headers = arms[name]
                row = await ask(http, url, question, {**headers, "x-satisfice-cache": "bypass"})
                rows[name].append(row)
                print(f"{i + 1}/{len(questions)} {name}: first {row['meaningful_s']} s, "
                      f"answer {row['answer_s']} s, correct {row['correct']}, "
                      f"error {row['error']}", file=sys.stderr)  # fmt: skip
    report: dict[str, Any] = {name: summary(r) for name, r in rows.items()}
    base = "before" if "before" in rows else "live"
    for name in rows:
        if name != base:
            # Per question, this arm's answer time over the base arm's: the median ratio.
            ratios = [
                a["answer_s"] / b["answer_s"]
                for a, b in zip(rows[name], rows[base], strict=True)
                if a["answer_s"] and b["answer_s"]
            ]
            report[name][f"answer_time_ratio_to_{base}_median"] = round(
                statistics.median(ratios), 3
            )
            report[name][f"answer_mean_ratio_to_{base}"] = round(
                report[name]["answer_mean_s"] / report[base]["answer_mean_s"], 3
            )
    report["rows"] = rows
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=Path, required=True)
    parser.add_argument("--exclude", type=Path, nargs="*", default=[])
    parser.add_argument("--count", type=int, default=20)
    parser.add_argument("--before", type=Path, help="an earlier checkout, streamed beside")
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--show", action="store_true", help="one question through the openai client, and stop"
    )
    args = parser.parse_args()
    questions = held_out(args.questions, args.exclude, args.count)
    with tempfile.TemporaryDirectory() as folder:
        served = {"after": _serve(ROOT, Path(folder))}
        if args.before is not None:
            served["before"] = _serve(args.before.resolve(), Path(folder))
        try:

            async def ready_then_run() -> dict[str, Any]:
                async with httpx.AsyncClient() as http:
                    for url, process in served.values():
                        await _ready(http, url, process)
                after = served["after"][0]
                if args.show:
                    return await asyncio.to_thread(show, after, questions[0])
                arms = {"live": (after, {}), "first": (after, FIRST_ANSWER)}
                if "before" in served:
                    arms = {"before": (served["before"][0], {}), **arms}
                return await run(questions, arms)

            report = asyncio.run(ready_then_run())
        finally:
            for _, process in served.values():
                process.terminate()
                process.wait(timeout=30)
    rows = report.pop("rows", [])
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**report, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
