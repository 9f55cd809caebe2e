"""Config files: the embedded default, and bad files refused with path, value and expectation."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from engines.bundled import QWEN_CODER_0_5B, QWEN_CODER_1_5B, SMOLLM2
from engines.settings import LlamaCppSettings
from gateway.config import ConfigError, load_config, parse_config
from tests.support import satisfice

BASE = """
engines:
  small:
    backend: llama_cpp
    model: smollm2-135m-instruct
"""

# Two engines and a router, which a loop needs.
PAIR = (
    BASE
    + """  large:
    backend: llama_cpp
    model: smollm2-135m-instruct
router: {}
"""
)


def test_embedded_default_serves_the_qwen_pair_with_smollm2_as_fallback() -> None:
    config = load_config()
    assert set(config.engines) == {"small", "tiny", "large"}
    small, tiny, large = (config.engines[name] for name in ("small", "tiny", "large"))
    assert isinstance(small, LlamaCppSettings) and small.model == QWEN_CODER_0_5B
    assert isinstance(large, LlamaCppSettings) and large.model == QWEN_CODER_1_5B
    assert isinstance(tiny, LlamaCppSettings) and tiny.model == SMOLLM2
    assert small.template == large.template == tiny.template == "chat"
    assert small.fallback == "tiny" and large.fallback is None
    assert config.router is not None and config.router.model_file == "bundled"
    assert (config.router.small_engine, config.router.large_engine) == ("small", "large")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (BASE + "    concurrency: two\n", "engines.small.concurrency = 'two': Expected `int`"),
        (BASE + "    concurency: 2\n", "engines.small: Object contains unknown field `concurency`"),
        (BASE + "    queue_size: -1\n", "engines.small.queue_size = -1: Expected `int` >= 0"),
        (
            BASE.replace("llama_cpp", "tensorrt"),
            "engines.small.backend = 'tensorrt': Invalid value 'tensorrt'",
        ),
        ("server:\n  port: 99999\n" + BASE, "server.port = 99999: Expected `int` <= 65535"),
        ("engines: {}\n", "at least one engine"),
        (BASE.replace("small:", "auto:"), "engines.auto: the name is reserved"),
        (
            BASE + "  remote:\n    backend: openai_http\n    model: m\n",
            "engines.remote: Object missing required field `base_url`",
        ),
        (BASE + "router: {}\n", "router: engine 'large' is not configured"),
        (BASE + "router:\n  threshold: -1\n", "router.threshold = -1: Expected `float` >= 0.0"),
        (
            PAIR + "loop:\n  greedy_weight: -1\n",
            "loop.greedy_weight = -1: Expected `float` >= 0.0",
        ),
        (PAIR + "loop:\n  greedy_stop: 1.5\n", "loop.greedy_stop = 1.5: Expected `float` <= 1.0"),
        (
            PAIR + "loop:\n  greedy_first: true\n  probes: true\n",
            "greedy_first and probes cannot be combined",
        ),
        ("engines: [1\n", "not valid YAML"),
        ("- 1\n", "expected a mapping"),
    ],
)
def test_bad_config_names_path_value_and_expectation(text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(text, "satisfice.yaml")
    assert str(caught.value).startswith("satisfice.yaml: ")
    assert expected in str(caught.value)


def test_embedded_default_answers_hard_questions_with_one_greedy_pass() -> None:
    loop = load_config().loop
    assert loop is not None
    # The rule's choice (bench/greedy_first.py): the greedy pass, which always stops.
    assert (loop.greedy_first, loop.greedy_stop, loop.greedy_weight) == (True, 0.0, 1.0)
    assert loop.greedy_calibrator_in_use() == "bundled"
    # Without greedy_first, the greedy pass's calibrator is not read (nor needed).
    assert loop.sampling().greedy_calibrator_in_use() is None


def _check(path: Path) -> subprocess.CompletedProcess[str]:
    return satisfice("config", "check", str(path))


def test_config_check_command(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(BASE)
    result = _check(good)
    assert result.returncode == 0, result.stderr
    assert "ok" in result.stdout

    bad = tmp_path / "bad.yaml"
    bad.write_text(BASE + "    threads: many\n")
    result = _check(bad)
    assert result.returncode == 2
    assert "engines.small.threads = 'many'" in result.stderr

    result = _check(tmp_path / "missing.yaml")
    assert result.returncode == 2
    assert "cannot read" in result.stderr

    # The greedy pass's calibrator is read as the loop's is, once greedy_first is on.
    greedy = tmp_path / "greedy.yaml"
    missing = tmp_path / "no.calibrator"
    loop = f"loop:\n  calibrator: null\n  greedy_calibrator: {missing}\n"
    greedy.write_text(PAIR + loop)
    assert _check(greedy).returncode == 0
    greedy.write_text(PAIR + loop + "  greedy_first: true\n")
    result = _check(greedy)
    assert result.returncode == 2
    assert f"{missing}: cannot read" in result.stderr


@pytest.mark.parametrize(
    "path",
    sorted((Path(__file__).parent.parent / "deploy" / "config").glob("*.yaml")),
    ids=lambda p: p.name,
)
def test_shipped_example_configs_are_valid(path: Path) -> None:
    load_config(path)
