"""bench/greedy_pass_latency.py's arm and its arithmetic: one gateway of the embedded
default with the cache off and every routed question hard, and ratios only over pairs
that generated the same tokens."""

from __future__ import annotations

import itertools

import pytest

from evaluator.answers import LabelledQuestion
from gateway.config import parse_config
from tests.support import bench_script

latency = bench_script("greedy_pass_latency")


def test_the_gateway_is_the_default_with_every_question_hard_and_no_cache() -> None:
    config = parse_config(latency.config_text())
    assert config.cache is None
    assert config.router is not None and config.router.threshold == 0.0
    assert config.loop is not None and config.loop.greedy_first and config.loop.greedy_stop == 0


def answer(seconds: float, tokens: int) -> dict[str, object]:
    return {"seconds": seconds, "tokens": tokens, "route": "loop", "stop": "greedy"}


def test_ratios_count_only_pairs_that_generated_the_same_tokens() -> None:
    pairs = [
        {"source": "a", "large": answer(2.0, 10), "auto": answer(2.2, 10)},
        {"source": "a", "large": answer(4.0, 20), "auto": answer(4.0, 20)},
        # Another greedy answer (a cached prompt's numerics): not the same work.
        {"source": "b", "large": answer(1.0, 5), "auto": answer(9.0, 50)},
    ]
    summary = latency.summary(pairs)
    assert (summary["pairs"], summary["same_tokens"], summary["routed_to_the_loop"]) == (3, 2, 3)
    assert summary["ratio_median"] == pytest.approx(1.05)
    assert (summary["ratio_min"], summary["ratio_max"]) == (pytest.approx(1.0), pytest.approx(1.1))
    assert summary["tokens_mean"] == 15
    low, high = summary["ratio_mean_ci95"]
    assert summary["ratio_mean"] == pytest.approx(1.05)
    assert low < summary["ratio_mean"] < high
    assert latency.summary(pairs[:1])["ratio_mean_ci95"] is None  # one pair: no interval


def test_no_request_follows_one_of_the_same_prompt(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple[str, str]] = []

    def ask(client: object, model: str, prompt: str) -> dict[str, object]:
        asked.append((model, prompt))
        return answer(1.0, 1)

    monkeypatch.setattr(latency, "ask", ask)
    questions = [LabelledQuestion(prompt=f"q{i}", kind="number", answers=["1"]) for i in range(4)]
    pairs = latency.measure(None, questions)
    assert all(set(p) == {"source", "large", "auto"} for p in pairs)
    assert all(a[1] != b[1] for a, b in itertools.pairwise(asked))
    firsts = [next(m for m, p in asked if p == f"q{i}") for i in range(4)]
    assert firsts.count("large") == firsts.count("auto") == 2
