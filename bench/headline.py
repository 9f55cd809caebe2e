"""The product's headline curve: accuracy against compute for each way of answering,
through a real gateway, on questions nothing was fitted or tuned on.

Each arm is a real `satisfice serve` on 127.0.0.1 (the embedded default config with
the cache off, so every question is answered, and one change per arm), asked every
question once, one after another, by the official openai client:

  always-small   model "small", no loop
  always-large   model "large", no loop: one greedy pass
  always-loop    model "auto", every question routed hard: the reasoning loop
  router         model "auto", no loop: the router picks small or one large pass
  router+loop    model "auto" as shipped: easy questions small, hard ones to the loop
                 (since greedy-first became the default: one greedy pass of large)
  router+sampling-loop  the same with the loop that samples from its first round
                 (greedy_first off: the default before it)
  ...+escalation the same, and small answers below --escalate-below P go to the loop

Compute is what the engines sampled (satisfice_engine_sampled_tokens_total on /metrics,
read before and after each question, so an escalated question counts both attempts),
in all and the large engine's, and the seconds the client waited. The questions are the
held-out part of a trace bank (bench/split_runs.py), less any the shipped router was
fitted on.

    .venv/bin/python bench/headline.py --runs bench/out/bank_qwen_held.jsonl \\
        [--per-source 20] [--skip 0] [--arms always-small router+loop ...] \\
        [--escalate-below 0.5] [--json bench/out/headline.json] [--plot docs/img/headline.png]
    .venv/bin/python bench/headline.py --from-json bench/out/headline*.json \\
        --plot docs/img/headline.png       # runs kept, on other questions, as one
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml
from openai import OpenAI

from evaluator.answers import LabelledQuestion, is_correct
from evaluator.replay_report import wilson
from evaluator.runs import read_runs, take_per_source
from router.model_file import read_router
from router.router import router_file
from router.settings import RouterSettings

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "gateway" / "config" / "default.yaml"
# The default config's large engine, whose tokens `auto` has to save.
LARGE = "large"
SAMPLED = re.compile(r'^satisfice_engine_sampled_tokens_total\{engine="([^"]+)"\} (\S+)$', re.M)

Config = dict[str, Any]


def _no_loop(config: Config, escalate_below: float) -> None:
    config["loop"] = None


def _all_hard(config: Config, escalate_below: float) -> None:
    config["router"]["threshold"] = 0.0


def _shipped(config: Config, escalate_below: float) -> None:
    pass


def _sampling_loop(config: Config, escalate_below: float) -> None:
    config["loop"]["greedy_first"] = False


def _escalating(config: Config, escalate_below: float) -> None:
    config["loop"]["escalate_below"] = escalate_below


# Arm name -> (the model asked for, the change to the default config).
ARMS: dict[str, tuple[str, Callable[[Config, float], None]]] = {
    "always-small": ("small", _no_loop),
    "always-large": ("large", _no_loop),
    "always-loop": ("auto", _all_hard),
    "router": ("auto", _no_loop),
    "router+loop": ("auto", _shipped),
    "router+sampling-loop": ("auto", _sampling_loop),
    "router+loop+escalation": ("auto", _escalating),
}


def arm_config(name: str, escalate_below: float) -> str:
    config: Config = yaml.safe_load(DEFAULT_CONFIG.read_text("utf-8"))
    config["cache"] = None  # every question answered, none served from an earlier arm's
    ARMS[name][1](config, escalate_below)
    return yaml.safe_dump(config)


def held_out_questions(runs_file: str, per_source: int, skip: int = 0) -> list[LabelledQuestion]:
    """The bank's questions, ``per_source`` of each source in file order after its
    first ``skip``, less the prompts the shipped router was fitted on (it has seen
    their outcomes)."""
    fitted_on = set(read_router(router_file(RouterSettings())).prompts)
    unseen = (run for run in read_runs(runs_file).runs if run.prompt not in fitted_on)
    return [run.question for run in take_per_source(unseen, per_source, skip)]


def merged(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Several runs' arms as one: each arm's questions from every run that has it. A
    question asked in two runs would count twice: ValueError."""
    rows: dict[str, list[dict[str, Any]]] = {}
    for arms in runs:
        for arm in arms:
            rows.setdefault(arm["arm"], []).extend(arm["rows"])
    for name, arm_rows in rows.items():
        twice = [p for p, n in Counter(r["prompt"] for r in arm_rows).items() if n > 1]
        if twice:
            raise ValueError(
                f"{name}: {len(twice)} questions are in more than one run "
                "(give each run its own --skip)"
            )
    return [summary(name, arm_rows) for name, arm_rows in rows.items()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(config_text: str, folder: Path) -> tuple[str, subprocess.Popen[bytes]]:
    path = folder / "arm.yaml"
    path.write_text(config_text)
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path), "--port", str(port)],
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the gateway exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/readyz").status_code == 200:
                return url, process
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    process.terminate()
    raise TimeoutError("the gateway was not ready in 300 s")


def _sampled(http: httpx.Client, url: str) -> dict[str, float]:
    """Tokens each engine of the gateway has sampled so far."""
    return {
        engine: float(value) for engine, value in SAMPLED.findall(http.get(f"{url}/metrics").text)
    }


def _spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {engine: value - before.get(engine, 0.0) for engine, value in after.items()}


def run_arm(name: str, questions: list[LabelledQuestion], escalate_below: float) -> dict[str, Any]:
    model = ARMS[name][0]
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        url, process = _start(arm_config(name, escalate_below), Path(folder))
        try:
            client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=600, max_retries=0)
            with httpx.Client() as http:
                for number, question in enumerate(questions, start=1):
                    before = _sampled(http, url)
                    started = time.perf_counter()
                    raw = client.chat.completions.with_raw_response.create(
                        model=model, messages=[{"role": "user", "content": question.prompt}]
                    )
                    seconds = time.perf_counter() - started
                    spent = _spent(before, _sampled(http, url))
                    text = raw.parse().choices[0].message.content or ""
                    rows.append(
                        {
                            "prompt": question.prompt,  # what a merge of runs keys on
                            "source": question.source,
                            "correct": is_correct(question, text),
                            "tokens": sum(spent.values()),
                            "large_tokens": spent.get(LARGE, 0.0),
                            "seconds": seconds,
                            "route": raw.headers.get("x-satisfice-route"),
                            "engine": raw.headers.get("x-satisfice-engine"),
                            "escalated": raw.headers.get("x-satisfice-escalated-from") is not None,
                            "fallback": raw.headers.get("x-satisfice-fallback"),
                        }
                    )
                    if number % 10 == 0:
                        print(f"{name}: {number}/{len(questions)}", file=sys.stderr, flush=True)
        finally:
            process.terminate()
            process.wait(timeout=30)
    return summary(name, rows)


def summary(name: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    sources = sorted({r["source"] for r in rows})
    return {
        "arm": name,
        "questions": len(rows),
        "accuracy": statistics.mean(r["correct"] for r in rows),
        "mean_tokens": statistics.mean(r["tokens"] for r in rows),
        "mean_large_tokens": statistics.mean(r["large_tokens"] for r in rows),
        "mean_seconds": statistics.mean(r["seconds"] for r in rows),
        "p90_seconds": sorted(r["seconds"] for r in rows)[round(0.9 * (len(rows) - 1))],
        "routes": dict(Counter(r["route"] or "as asked" for r in rows)),
        "escalated": sum(r["escalated"] for r in rows),
        "fallbacks": sum(r["fallback"] not in (None, "none") for r in rows),
        "by_source": {
            s: {
                "accuracy": statistics.mean(r["correct"] for r in rows if r["source"] == s),
                "mean_tokens": statistics.mean(r["tokens"] for r in rows if r["source"] == s),
            }
            for s in sources
        },
        "rows": rows,
    }


def render(arms: list[dict[str, Any]]) -> str:
    lines = [
        "| arm | accuracy (95% CI, n) | sampled tokens / question (large engine's) "
        "| seconds / question (mean, p90) | routes | escalated |",
        "|---|---|---|---|---|---|",
    ]
    for a in arms:
        routes = ", ".join(f"{k} {v}" for k, v in sorted(a["routes"].items()))
        lines.append(
            f"| {a['arm']} | {_accuracy(a)} | {a['mean_tokens']:.0f} "
            f"({a['mean_large_tokens']:.0f}) | "
            f"{a['mean_seconds']:.1f}, {a['p90_seconds']:.1f} | {routes} | {a['escalated']} |"
        )
    return "\n".join(lines)


def _accuracy(arm: dict[str, Any]) -> str:
    n = arm["questions"]
    low, high = wilson(round(arm["accuracy"] * n), n)
    return f"{100 * arm['accuracy']:.1f}% [{100 * low:.1f}, {100 * high:.1f}], {n}"


def plot(arms: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(12, 5), sharey=True)
    for ax, key, label in (
        (axes[0], "mean_tokens", "tokens sampled per question"),
        (axes[1], "mean_seconds", "seconds per question"),
    ):
        placed: Counter[tuple[float, float]] = Counter()
        for a in arms:
            x, y = a[key], 100 * a["accuracy"]
            # 95% interval over questions: with tens of questions it is most of the story.
            low, high = wilson(round(a["accuracy"] * a["questions"]), a["questions"])
            ax.errorbar(x, y, yerr=[[y - 100 * low], [100 * high - y]], fmt="o", capsize=4)
            # Arms on the same point (the router sent everything one way) get stacked labels.
            stacked = placed[(round(x), round(y))]
            placed[(round(x), round(y))] += 1
            ax.annotate(a["arm"], (x, y), textcoords="offset points",
                        xytext=(6, 4 - 11 * stacked), fontsize=9)  # fmt: skip
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("accuracy on held-out questions (%)")
    figure.suptitle(
        f"Through a real gateway, {arms[0]['questions']} held-out questions (95% intervals)"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", help="held-out part of a trace bank (needed to run arms)")
    parser.add_argument("--per-source", type=int, default=20)
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    parser.add_argument("--escalate-below", type=float, default=0.5)
    parser.add_argument("--json")
    parser.add_argument("--plot")
    parser.add_argument(
        "--skip", type=int, default=0, help="leave out each source's first N questions"
    )
    parser.add_argument(
        "--from-json",
        nargs="+",
        help="render earlier runs' --json (on other questions: --skip) as one; run nothing",
    )
    args = parser.parse_args(argv)
    if args.from_json:
        try:
            arms = merged([json.loads(Path(path).read_text()) for path in args.from_json])
        except ValueError as exc:  # also a file that is not JSON
            parser.error(str(exc))
        except (KeyError, TypeError) as exc:
            parser.error(f"not what headline.py --json writes (by this version): {exc!r}")
        if args.json:
            Path(args.json).write_text(json.dumps(arms, indent=1) + "\n")
        print(render(arms))
        if args.plot:
            plot(arms, args.plot)
        return 0
    if not args.runs:
        parser.error("--runs is needed to run arms")
    questions = held_out_questions(args.runs, args.per_source, args.skip)
    if not questions:
        parser.error(f"no questions in {args.runs} that the router was not fitted on")
    print(f"{len(questions)} questions: {dict(Counter(q.source for q in questions))}",
          file=sys.stderr)  # fmt: skip
    arms = []
    for name in args.arms:
        started = time.perf_counter()
        arms.append(run_arm(name, questions, args.escalate_below))
        print(f"{name}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
        if args.json:  # after every arm: a run of hours keeps what it measured
            Path(args.json).write_text(json.dumps(arms, indent=1) + "\n")
    print(render(arms))
    if args.plot:
        plot(arms, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
