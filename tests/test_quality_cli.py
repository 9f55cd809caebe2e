"""`satisfice quality` on outcome stores written here: the figures it prints."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec
import pytest
from redis.asyncio import Redis
from redis.exceptions import RedisError

from gateway.checks.estimates import AGREEMENT_NOTE
from gateway.checks.record import CheckRecord
from gateway.checks.store import RedisOutcomes
from gateway.cli import quality
from gateway.config import GatewayConfig
from tests.support import free_port

URL = "redis://127.0.0.1:6379/0"
NOW = time.time()
ENGINES = "engines:\n  small: {backend: llama_cpp, model: smollm2-135m-instruct}\n"


def record(agree: bool | None, probability: float = 0.1, **fields: Any) -> CheckRecord:
    values: dict[str, Any] = {
        "id": uuid.uuid4().hex,
        "at": NOW - 3600,
        "source": "shadow",
        "tenant": "acme",
        "shortcut": "small_route",
        "route": "small",
        "model": "auto",
        "probability": probability,
        "policy": "v1",
        "prompt": "q",
        "answer": "a",
        "agree": agree,
    }
    return CheckRecord(**(values | fields))


def records() -> list[CheckRecord]:
    loop = {"shortcut": "early_stop", "route": "loop"}
    hit = {"shortcut": "semantic_hit", "route": "semantic"}
    return [
        # acme's small route: 3 of 20 disagree, all drawn with one probability; the
        # 17 that agree were answered at P(correct) 0.9, the 3 others at 0.3.
        *(record(True, confidence=0.9) for _ in range(17)),
        *(record(False, confidence=0.3) for _ in range(3)),
        record(None),
        record(None, status="dropped", reason="no capacity"),
        record(None, status="dropped", reason="no capacity"),
        record(None, status="failed", reason="TimeoutError"),
        # acme's early stops, drawn with unequal probabilities: weights 2, 2, 4.
        record(True, 0.5, **loop),
        record(False, 0.5, **loop),
        record(False, 0.25, **loop),
        # globex: two days ago.
        record(True, 1.0, tenant="globex", at=NOW - 48 * 3600, **hit),
        # Callers' verdicts on acme's small answers: 1 of 4 wrong.
        *(
            record(None, 1.0, source="feedback", shortcut=None, verdict=verdict)
            for verdict in ("wrong", "right", "right", "right")
        ),
    ]


def write(path: Path, kept: list[CheckRecord]) -> Path:
    path.write_bytes(b"".join(msgspec.json.encode(r) + b"\n" for r in kept))
    return path


@pytest.fixture
def outcomes(tmp_path: Path) -> Path:
    return write(tmp_path / "outcomes.jsonl", records())


def satisfice_quality(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """The command as `satisfice` runs it: parsed by the parser it adds, then run."""
    parser = argparse.ArgumentParser(prog="satisfice")
    quality.add_commands(parser.add_subparsers(dest="command", required=True))
    parsed = parser.parse_args(["quality", *args])
    code: int = parsed.run(parsed)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def row(out: str, *starts: str) -> list[str]:
    """The table row whose first cells are ``starts``, split into its cells."""
    for line in out.splitlines():
        cells = [c.strip() for c in line.split("  ") if c.strip()]
        if cells[: len(starts)] == list(starts):
            return cells
    raise AssertionError(f"no row {starts} in:\n{out}")


def test_the_table_gives_each_rate_with_its_interval_and_counts(
    outcomes: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = satisfice_quality(capsys, "--outcomes", str(outcomes))
    assert code == 0
    assert out.startswith(f"32 check records, from {outcomes}\n")
    assert row(out, "acme", "small_route") == [
        "acme", "small_route", "15.0%", "[5.2%, 36.0%]", "20", "1", "no capacity 2", "1",
        "regret: the large path would change the answer",
    ]  # fmt: skip
    assert row(out, "acme", "early_stop") == [
        "acme", "early_stop", "75.0%", "[23.8%, 96.6%] *", "3 (n_eff 2.7)", "0", "0", "0",
        "flip: running on to the budget changes the answer",
    ]  # fmt: skip
    assert row(out, "globex", "semantic_hit")[2:5] == ["0.0%", "[0.0%, 79.3%] *", "1"]
    # 20 compared: enough; 2.7 and 1 effective checks are flagged, and the flag explained.
    assert "* fewer than 10 effective checks" in out
    # Calibration: ECE 3/20 * 0.3 + 17/20 * 0.1; mean confidence 0.81 against 0.85.
    assert "small_route: 20 compared; ECE 0.130; mean gap -0.040" in out
    assert row(out, "0.2-0.4") == ["0.2-0.4", "3", "0.300", "0.0%", "[0.0%, 56.2%]"]
    assert row(out, "0.8-1.0") == ["0.8-1.0", "17", "0.900", "100.0%", "[81.6%, 100.0%]"]
    assert row(out, "acme", "small", "25.0% (1)") == [
        "acme", "small", "25.0% (1)", "[4.6%, 69.9%]", "4"
    ]  # fmt: skip
    assert "not a random sample" in out
    assert out.rstrip().splitlines()[-1] == AGREEMENT_NOTE[0].upper() + AGREEMENT_NOTE[1:] + "."
    assert "error rate" not in out.lower() and "accuracy" not in out.lower()


def test_json_carries_the_same_figures(outcomes: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = satisfice_quality(capsys, "--outcomes", str(outcomes), "--json")
    assert code == 0
    report = json.loads(out)
    assert report["records"] == 32 and report["store"] == str(outcomes)
    small = next(e for e in report["estimates"] if e["shortcut"] == "small_route")
    assert small["rate"] == pytest.approx(0.15)
    assert (small["low"], small["high"]) == pytest.approx((0.05237, 0.36042), abs=1e-5)
    assert (small["n"], small["undecided"], small["failed"]) == (20, 1, 1)
    assert small["dropped"] == {"no capacity": 2}
    (feedback,) = report["feedback"]
    assert (feedback["wrong"], feedback["n"]) == (1, 4)
    assert any("not a random sample" in note for note in report["notes"])


def test_tenant_and_since_narrow_what_is_read(
    outcomes: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, out, _ = satisfice_quality(capsys, "--outcomes", str(outcomes), "--tenant", "globex")
    assert out.startswith("1 check records of tenant globex, from")
    assert row(out, "globex", "semantic_hit")
    assert "acme" not in out
    _, out, _ = satisfice_quality(capsys, "--outcomes", str(outcomes), "--since", "24")
    assert out.startswith("31 check records made in the last 24 hours, from")
    assert "globex" not in out


def test_an_empty_store_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = satisfice_quality(capsys, "--outcomes", str(tmp_path / "none.jsonl"))
    assert code == 0
    assert "(no checks recorded)" in out and "(no verdicts recorded)" in out


@pytest.mark.skipif(
    "shadow" not in GatewayConfig.__struct_fields__,
    reason="the config has no shadow section (outcomes_file) yet",
)
def test_the_config_names_the_outcome_file(
    tmp_path: Path, outcomes: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "satisfice.yaml"
    config.write_text(f"{ENGINES}shadow: {{share: 0.05, outcomes_file: {outcomes}}}\n")
    code, out, _ = satisfice_quality(capsys, "--config", str(config), "--json")
    assert code == 0
    assert json.loads(out)["records"] == 32


async def redis_up() -> bool:
    client = Redis.from_url(URL, socket_connect_timeout=0.5)
    try:
        return bool(await client.ping())
    except (RedisError, OSError):
        return False
    finally:
        await client.aclose()


async def _on_redis(prefix: str, kept: list[CheckRecord]) -> None:
    store = RedisOutcomes(URL, prefix, max_records=1000)
    for r in kept:
        await store.add(r)
    await store.close()


async def _forget(prefix: str) -> None:
    client = Redis.from_url(URL)
    keys = [key async for key in client.scan_iter(match=f"{prefix}*")]
    if keys:
        await client.unlink(*keys)
    await client.aclose()


def test_with_the_cache_on_redis_the_store_is_its_stream(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if not asyncio.run(redis_up()):
        pytest.skip(f"Redis is not answering at {URL}")
    prefix = f"test-quality-{uuid.uuid4().hex}"
    config = tmp_path / "satisfice.yaml"
    config.write_text(
        f"{ENGINES}cache:\n  store: {{kind: redis, url: {URL}, key_prefix: {prefix}}}\n"
    )
    try:
        asyncio.run(_on_redis(prefix, records()))
        code, out, _ = satisfice_quality(capsys, "--config", str(config), "--since", "24")
    finally:
        asyncio.run(_forget(prefix))
    assert code == 0
    where = f"Redis at 127.0.0.1:6379, stream {prefix}:outcomes"
    assert out.startswith(f"31 check records made in the last 24 hours, from {where}\n")
    assert row(out, "acme", "small_route")[2:4] == ["15.0%", "[5.2%, 36.0%]"]


def test_an_unreachable_store_is_an_error_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    port = free_port()
    config = tmp_path / "satisfice.yaml"
    config.write_text(
        f"{ENGINES}cache:\n  store: {{kind: redis, url: 'redis://127.0.0.1:{port}/0'}}\n"
    )
    code, out, err = satisfice_quality(capsys, "--config", str(config))
    assert code == 3 and out == ""
    assert err.startswith(f"error: the outcome store (Redis at 127.0.0.1:{port}, stream ")
    assert "is unavailable" in err
