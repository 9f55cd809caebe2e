"""`satisfice cache warmup | stats | invalidate` against a real Redis."""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import satisfice

QUESTIONS = [
    ("What is the capital of France?", "Paris"),
    ("How many legs does a spider have?", "Eight"),
    ("Who wrote Hamlet?", "William Shakespeare"),
    ("What is the chemical symbol for gold?", "Au"),
]


def cache(*args: str) -> subprocess.CompletedProcess[str]:
    return satisfice("cache", *args)


@pytest.fixture
def redis_config(tmp_path: Path) -> Iterator[Path]:
    prefix = f"satisfice-cli-{uuid.uuid4().hex[:8]}"
    config = tmp_path / "satisfice.yaml"
    config.write_text(f"""
engines:
  small: {{backend: llama_cpp, model: smollm2-135m-instruct}}
cache:
  store: {{kind: redis, key_prefix: {prefix}}}
""")
    yield config
    scan = ["redis-cli", "--scan", "--pattern", f"{prefix}:*"]
    keys = subprocess.run(scan, capture_output=True, text=True, check=False).stdout.split()
    if keys:
        subprocess.run(["redis-cli", "unlink", *keys], capture_output=True, check=False)


# Slow: six CLI processes that each load the embedder; the default run keeps
# the CLI's dry run and the admin endpoints' warm-up and invalidation.
@pytest.mark.slow
def test_warmup_is_idempotent_reports_bad_lines_and_can_be_invalidated(
    redis_config: Path, tmp_path: Path
) -> None:
    lines = [json.dumps({"prompt": q, "response": a}) for q, a in QUESTIONS]
    lines.insert(2, '{"prompt": "no response"}')
    lines.insert(4, "{not json")
    warm = tmp_path / "warm.jsonl"
    warm.write_text("\n".join(lines) + "\n")

    first = cache("warmup", str(warm), "--namespace", "acme", "--config", str(redis_config))
    assert first.returncode == 1, first.stderr  # some lines were bad
    report = json.loads(first.stdout)
    assert report["added"] == 4 and report["bad"] == 2
    assert [e["line"] for e in report["errors"]] == [3, 5]
    assert "response" in report["errors"][0]["error"]

    again = json.loads(
        cache("warmup", str(warm), "--namespace", "acme", "--config", str(redis_config)).stdout
    )
    assert again["added"] == 0 and again["replaced"] == 4

    stats = json.loads(cache("stats", "--config", str(redis_config)).stdout)
    assert stats["store"]["entries"] == 4 and stats["indexed"] == 4
    assert [n["namespace"].split(":")[:2] for n in stats["namespaces"]] == [["acme", "auto"]]

    other = cache("invalidate", "--namespace", "someone-else", "--config", str(redis_config))
    assert json.loads(other.stdout) == {"deleted": 0}
    dropped = cache("invalidate", "--namespace", "acme", "--config", str(redis_config))
    assert json.loads(dropped.stdout) == {"deleted": 4}
    stats = json.loads(cache("stats", "--config", str(redis_config)).stdout)
    assert stats["store"]["entries"] == 0


def test_dry_run_reports_the_hit_rate_and_stores_nothing(
    redis_config: Path, tmp_path: Path
) -> None:
    warm = tmp_path / "warm.jsonl"
    warm.write_text("".join(json.dumps({"prompt": q, "response": a}) + "\n" for q, a in QUESTIONS))
    queries = tmp_path / "queries.jsonl"
    asked = [
        " What is the capital of France?\n",  # exact: whitespace around it aside
        "How many legs do spiders have?",  # semantic
        "What is the chemical symbol for silver?",  # a near miss
        "How do I bake bread?",  # unrelated
    ]
    queries.write_text("".join(json.dumps({"prompt": q}) + "\n" for q in asked))
    result = cache("warmup", str(warm), "--dry-run", "--queries", str(queries),
                       "--config", str(redis_config))  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report == {"queries": 4, "hit_rate": 0.5, "exact_hits": 1, "semantic_hits": 1}
    stats = json.loads(cache("stats", "--config", str(redis_config)).stdout)
    assert stats["store"]["entries"] == 0


def test_warmup_refuses_a_store_that_keeps_nothing(tmp_path: Path) -> None:
    config = tmp_path / "memory.yaml"
    config.write_text("engines:\n  small: {backend: llama_cpp, model: smollm2-135m-instruct}\n"
                      "cache: {}\n")  # fmt: skip
    warm = tmp_path / "warm.jsonl"
    warm.write_text(json.dumps({"prompt": "q", "response": "a"}) + "\n")
    result = cache("warmup", str(warm), "--config", str(config))
    assert result.returncode != 0 and "cache.store.snapshot" in result.stderr
