"""bench/headline.py's arms and questions: each arm is the embedded default with one
change that the gateway accepts, and no question the shipped router was fitted on is
asked. (The arms themselves run the Qwen pair: a benchmark, not a test.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from evaluator.runs import Run, RunSample, write_runs
from gateway.config import parse_config
from router.model_file import read_router
from router.router import router_file
from router.settings import RouterSettings
from tests.support import bench_script

headline = bench_script("headline")


@pytest.mark.parametrize("arm", list(headline.ARMS))
def test_every_arm_is_a_valid_config_without_the_cache(arm: str) -> None:
    text = headline.arm_config(arm, escalate_below=0.4)
    config = parse_config(text)
    assert config.cache is None
    raw = yaml.safe_load(text)
    if arm in ("always-small", "always-large", "router"):
        assert config.loop is None
    else:
        assert config.loop is not None
        assert config.loop.escalate_below == (0.4 if arm.endswith("escalation") else None)
        # The default's loop is one greedy pass; one arm keeps the sampling loop.
        assert config.loop.greedy_first == (arm != "router+sampling-loop")
    assert raw["router"]["threshold"] == (0.0 if arm == "always-loop" else 0.2024)


def test_questions_the_router_was_fitted_on_are_left_out(tmp_path: Path) -> None:
    seen = read_router(router_file(RouterSettings())).prompts[0]
    sample = (RunSample(text="4"),)
    runs = [
        Run(id=f"q{i}", kind="number", answers=["4"], samples=sample, prompt=p, source="s")
        for i, p in enumerate([seen, "What is 2 + 2, a question never routed?", "And 3 + 1?"])
    ]
    bank = tmp_path / "held.jsonl"
    write_runs(runs, bank)
    asked = headline.held_out_questions(str(bank), per_source=5)
    assert [q.prompt for q in asked] == [runs[1].prompt, runs[2].prompt]
    assert len(headline.held_out_questions(str(bank), per_source=1)) == 1
    # A second run asks the questions after the first's.
    later = headline.held_out_questions(str(bank), per_source=1, skip=1)
    assert [q.prompt for q in later] == [runs[2].prompt]


def test_runs_on_other_questions_merge_arm_by_arm() -> None:
    def row(prompt: str, correct: bool, tokens: float) -> dict[str, object]:
        return {"prompt": prompt, "source": "s", "correct": correct, "tokens": tokens,
                "large_tokens": tokens / 2, "seconds": 1.0, "route": "loop",
                "escalated": False, "fallback": "none"}  # fmt: skip

    first = [headline.summary("router+loop", [row("q1", True, 10.0)])]
    second = [headline.summary("router+loop", [row("q2", False, 30.0), row("q3", False, 20.0)])]
    (arm,) = headline.merged([first, second])
    assert (arm["arm"], arm["questions"], arm["mean_tokens"]) == ("router+loop", 3, 20.0)
    assert arm["accuracy"] == 1 / 3 and arm["mean_large_tokens"] == 10.0
    # The same run twice (or two runs with one --skip) would count its questions twice.
    with pytest.raises(ValueError, match="1 questions are in more than one run"):
        headline.merged([first, first])
