"""The llama.cpp library this checkout builds, and the check that it runs on this host.

Some x86-64 hosts advertise AMX without letting a process use it: a llama.cpp built
with -march=native holds AMX tile instructions there and dies with SIGILL at its
first token. The Makefile builds for the host with AMX switched off at compile time,
the image builds for an AVX2 baseline, and every in-process engine generates a few
tokens in a child process before it loads its model, so that a library this host
cannot run is reported, not met as a dead gateway.
"""

from __future__ import annotations

import contextlib
import platform
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from engines.llama_cpp import LlamaCppEngine
from engines.native_check import (
    REBUILD,
    LlamaCppUnusable,
    amx_instructions,
    explain,
    library_path,
)
from engines.settings import LlamaCppSettings
from gateway.config import load_config
from tests.support import ROOT, satisfice, start_gateway, stop

x86_only = pytest.mark.skipif(platform.machine() != "x86_64", reason="AMX is x86-64's")


def makefile_cmake_args() -> str:
    done = subprocess.run(
        ["make", "-s", "print-llama-cmake-args"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def predefined_macros(compiler: str, flags: list[str]) -> set[str]:
    """The macros ``compiler`` defines with ``flags``: ggml compiles its AMX code only
    where ``__AMX_INT8__`` is one of them."""
    done = subprocess.run(
        [compiler, *flags, "-dM", "-E", "-x", "c", "-"],
        input="",
        capture_output=True,
        text=True,
        check=True,
    )
    return {line.split()[1] for line in done.stdout.splitlines() if line.startswith("#define")}


# Slow: both models generate in child processes; every gateway the default run
# starts runs the same check first, and a model that cannot generate is tested
# below (test_serve_exits_non_zero_when_an_engine_cannot_generate).
@pytest.mark.slow
def test_engines_check_generates_with_every_bundled_model() -> None:
    done = satisfice("engines", "check", timeout_s=300)
    assert done.returncode == 0, done.stderr
    # Every engine of the embedded default, by name and the GGUF file it loaded.
    for name in load_config().engines:
        assert re.search(rf"\b{name} \([^)]+\.gguf\)", done.stdout), done.stdout


def test_the_installed_library_holds_no_amx_instruction() -> None:
    library = library_path()
    assert library is not None and library.is_file()
    found = amx_instructions(library)
    if found is None:
        pytest.skip("objdump is not installed")
    assert found == 0, f"{library} holds {found} AMX instructions; run `{REBUILD}`"


@x86_only
@pytest.mark.parametrize("compiler", ["gcc", "g++"])
def test_build_flags_keep_amx_out_where_native_means_amx(compiler: str) -> None:
    """On a Sapphire Rapids host -march=native means -march=sapphirerapids; ggml puts it
    after CMAKE_C(XX)_FLAGS on the command line, and the flags must still win."""
    args = dict(
        arg.removeprefix("-D").split("=", 1)
        for arg in shlex.split(makefile_cmake_args())
        if arg.startswith("-D")
    )
    assert args["GGML_NATIVE"] == "ON"
    flags = shlex.split(args["CMAKE_C_FLAGS" if compiler == "gcc" else "CMAKE_CXX_FLAGS"])
    assert "__AMX_INT8__" in predefined_macros(compiler, ["-march=sapphirerapids"])
    built = predefined_macros(compiler, [*flags, "-march=sapphirerapids"])
    assert not {"__AMX_TILE__", "__AMX_INT8__", "__AMX_BF16__"} & built
    assert "__AVX512VNNI__" in built  # the rest of the host's extensions stay


@x86_only
def test_sigill_is_explained_with_the_cpu_feature_and_the_rebuild_command() -> None:
    printed = "generating with /models/m.gguf\nFatal Python error: Illegal instruction\n"
    message = explain(-signal.SIGILL, printed)
    assert "SIGILL" in message and "AMX" in message and "/models/m.gguf" in message
    assert f"`{REBUILD}`" in message
    # The pip command outside a checkout builds exactly what the Makefile builds.
    assert f'CMAKE_ARGS="{makefile_cmake_args()}"' in message


def test_other_crashes_and_failures_say_what_the_child_printed() -> None:
    printed = "generating with /models/m.gguf\nFatal Python error: Segmentation fault\n"
    message = explain(-signal.SIGSEGV, printed)
    assert "SIGSEGV" in message and "Segmentation fault" in message and REBUILD in message
    failed = explain(1, "generating with /models/m.gguf\nValueError: Failed to load model\n")
    assert failed.endswith(
        "with /models/m.gguf in a test process: ValueError: Failed to load model"
    )


def test_serve_exits_non_zero_when_an_engine_cannot_generate(tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    config = f"engines:\n  small:\n    backend: llama_cpp\n    model: {broken}\n"
    url, process = start_gateway(config, tmp_path, stderr=subprocess.PIPE, ready=False)
    try:
        deadline = time.monotonic() + 120
        while process.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(httpx.TransportError):  # never ready, however early
                assert httpx.get(f"{url}/readyz", timeout=1).status_code == 503
            time.sleep(0.1)
        assert process.wait(timeout=1) == 3
    finally:
        if process.poll() is None:
            stop(process)
    assert process.stderr is not None
    printed = process.stderr.read().decode(errors="replace")
    assert "error: the gateway could not start" in printed
    assert f"could not generate with {broken}" in printed


async def test_start_generates_in_a_test_process_before_loading(tmp_path: Path) -> None:
    """An engine that has started has had its model generate on this host: start()
    runs the check before this process loads the model, so a model that cannot
    generate fails with the check's error, not the in-process loader's."""
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    engine = LlamaCppEngine("small", LlamaCppSettings(model=str(broken)), tmp_path)
    with pytest.raises(LlamaCppUnusable, match=f"could not generate with {broken}"):
        await engine.start()
    assert not engine._workers
    await engine.close()
