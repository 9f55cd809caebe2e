"""Can this host run llama.cpp's native library? Asked of a child process first.

A llama.cpp compiled with ``-march=native`` holds the instructions of the CPU that
built it. Some x86-64 hosts advertise AMX without letting a process use it (the OS
or hypervisor has not enabled its tile state), and a library built on another CPU
may hold instructions this one lacks: either way the first matrix multiply kills the
process with SIGILL. The in-process engine loads each model and generates a few
tokens in a child process before it loads the model into its own, so that such a
library is reported with what to do about it instead of taking the gateway down on
its first request.

``main`` is that child.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import importlib.metadata
import importlib.util
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

# How to rebuild llama.cpp for this host, as the Makefile does: -march=native with the
# AMX extensions switched off at compile time.
REBUILD = "make rebuild-llama"
# The Makefile's LLAMA_CMAKE_ARGS on x86-64, for a pip install outside a checkout.
REBUILD_CMAKE_ARGS = (
    "-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF "
    "-DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' "
    "-DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'"
)
_PROMPT = b"The capital of France is"
_TOKENS = 4
_STDERR_TAIL = 1500
# The child's command line: not ``-m``, since the package imports this module first.
_CHILD = "import sys; from engines.native_check import main; sys.exit(main(sys.argv[1:]))"
_WORKING_ON = "generating with "
# Every AMX instruction: tile configuration, loads and stores, the int8/bf16 dot products.
_AMX = re.compile(r"\s(ldtilecfg|sttilecfg|tilerelease|tilezero|tileloadd\w*|tilestored|tdp\w+)\s")


class LlamaCppUnusable(RuntimeError):
    """llama.cpp cannot generate with a model on this host; the message says why and
    what to do."""


async def check_models(models: list[Path], threads: int, timeout_s: float = 300.0) -> float:
    """Generate a few tokens with each model in a child process; the seconds it took.

    Raises LlamaCppUnusable if the child is killed by a signal, fails or hangs."""
    started = time.monotonic()
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _CHILD,
        "--threads",
        str(threads),
        *map(str, models),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        _, stderr = await asyncio.wait_for(child.communicate(), timeout_s)
    except TimeoutError:
        child.kill()
        await child.wait()
        raise LlamaCppUnusable(
            f"llama.cpp did not generate {_TOKENS} tokens with {_names(models)} within "
            f"{timeout_s:g} s in a test process; the host may be overloaded, or the library stuck"
        ) from None
    finally:
        if child.returncode is None:  # cancelled: the child must not outlive the check
            child.kill()
            await child.wait()
    if child.returncode != 0:
        raise LlamaCppUnusable(explain(child.returncode or 0, stderr.decode(errors="replace")))
    return time.monotonic() - started


def explain(returncode: int, stderr: str) -> str:
    """What a failed check means, from the child's exit status and what it printed."""
    library = library_path()
    lines = stderr.strip().splitlines()
    model = next(
        (line[len(_WORKING_ON) :] for line in reversed(lines) if line.startswith(_WORKING_ON)),
        "a model",
    )
    if returncode == -signal.SIGILL:
        return (
            f"llama.cpp's CPU library ({library}) was killed by SIGILL (illegal instruction) "
            f"in a test process generating with {model}: it was compiled for a CPU feature "
            "that this host does not let a process use. On x86-64 this is most often AMX "
            "(amx_tile/amx_int8 in /proc/cpuinfo), which a build with -march=native compiles "
            "in and which some hosts advertise without enabling; a library built on another "
            f"CPU fails the same way. Rebuild it on this host with AMX off: `{REBUILD}` in a "
            "Satisfice checkout, or pip install --force-reinstall --no-cache-dir --no-deps "
            f'llama-cpp-python=={_version()} with CMAKE_ARGS="{REBUILD_CMAKE_ARGS}".'
        )
    if returncode < 0:
        name = signal.Signals(-returncode).name
        return (
            f"llama.cpp's CPU library ({library}) crashed with {name} in a test process "
            f"generating with {model}; `{REBUILD}` rebuilds it for this host. What it "
            "printed:\n" + "\n".join(lines)[-_STDERR_TAIL:]
        )
    reason = lines[-1] if lines else f"exit status {returncode}"
    return f"llama.cpp could not generate with {model} in a test process: {reason}"


def _version() -> str:
    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        return "VERSION"


def library_path() -> Path | None:
    """llama.cpp's CPU library, found without loading it; None if not installed."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent / "lib" / "libggml-cpu.so"


def amx_instructions(library: Path) -> int | None:
    """How many AMX instructions the library's code holds; None without objdump."""
    objdump = shutil.which("objdump")
    if objdump is None:
        return None
    listing = subprocess.run(
        [objdump, "-d", "--no-show-raw-insn", str(library)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return len(_AMX.findall(listing))


def _names(models: list[Path]) -> str:
    return ", ".join(model.name for model in models)


def _generate(model: Path, threads: int) -> None:
    """Load ``model`` and decode a short prompt and a few greedy tokens: both the batch
    kernels (the prompt) and the one-token kernels (each next token) run."""
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=str(model), n_ctx=128, n_threads=threads, n_threads_batch=threads, verbose=False
    )
    tokens = llm.generate(llm.tokenize(_PROMPT), temp=0.0)
    for _ in range(_TOKENS):
        next(tokens)
    tokens.close()
    llm.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Generate a few tokens with each model.")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("models", nargs="+", type=Path)
    args = parser.parse_args(argv)
    # A crash in the library prints where it was before the process dies.
    faulthandler.enable()
    for model in args.models:
        print(f"{_WORKING_ON}{model}", file=sys.stderr, flush=True)
        try:
            _generate(model, args.threads)
        except Exception as exc:  # the parent reports the last line
            print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
    return 0
