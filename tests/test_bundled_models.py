"""Models shipped as a series of part packages: joined in order, verified, never torn."""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from engines.base import Message, SamplingParams
from engines.bundled import (
    CHUNKED_MODELS,
    QWEN_CODER_0_5B,
    ChunkedModel,
    ModelFileCorrupt,
    assembled,
    chunk_files,
    model_file,
)
from engines.llama_cpp import LlamaCppEngine
from engines.settings import LlamaCppSettings

CHUNKS = [b"GGUF" + bytes(range(256)) * 40, b"second chunk" * 999, b"the end"]


@pytest.fixture
def parts(tmp_path: Path) -> Iterator[list[str]]:
    """Three installed packages on sys.path, one chunk each, as the part packages are."""
    site = tmp_path / "site"
    names = [f"satisfice_test_part{i}" for i in range(1, 4)]
    for i, (name, chunk) in enumerate(zip(names, CHUNKS, strict=True), start=1):
        (site / name / "data").mkdir(parents=True)
        (site / name / "__init__.py").write_text("")
        (site / name / "data" / f"part{i:02d}.bin").write_bytes(chunk)
    sys.path.insert(0, str(site))
    yield names
    sys.path.remove(str(site))


def _model(packages: list[str], whole: bytes) -> ChunkedModel:
    return ChunkedModel(
        file_name="joined.gguf",
        packages=tuple(packages),
        size=len(whole),
        sha256=hashlib.sha256(whole).hexdigest(),
    )


def test_joins_the_chunks_in_the_packages_order(parts: list[str], tmp_path: Path) -> None:
    whole = b"".join(CHUNKS)
    path = assembled(_model(parts, whole), tmp_path / "models")
    assert path == tmp_path / "models" / "joined.gguf"
    assert path.read_bytes() == whole
    assert assembled(_model(parts, whole), tmp_path / "models") == path  # found, verified


def test_a_wrong_join_is_refused_and_leaves_no_file(parts: list[str], tmp_path: Path) -> None:
    out_of_order = b"".join(reversed(CHUNKS))  # same size, other sha256
    with pytest.raises(ModelFileCorrupt, match="sha256"):
        assembled(_model(parts, out_of_order), tmp_path)
    with pytest.raises(ModelFileCorrupt, match="bytes, not"):
        assembled(_model(parts, b"".join(CHUNKS) + b"x"), tmp_path)
    assert list(tmp_path.glob("joined.gguf*")) == []


def test_a_damaged_file_is_refused_at_start(parts: list[str], tmp_path: Path) -> None:
    whole = b"".join(CHUNKS)
    path = assembled(_model(parts, whole), tmp_path)
    path.write_bytes(whole[:-1] + b"?")
    with pytest.raises(ModelFileCorrupt, match="sha256"):
        assembled(_model(parts, whole), tmp_path)


def test_a_package_with_other_than_one_chunk_is_refused(parts: list[str], tmp_path: Path) -> None:
    data = Path(sys.path[0]) / parts[1] / "data"
    (data / "part99.bin").write_bytes(b"stray")
    with pytest.raises(ModelFileCorrupt, match="holds 2 chunks"):
        chunk_files(_model(parts, b""))


def test_a_missing_package_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="satisfice_no_such_part"):
        assembled(_model(["satisfice_no_such_part"], b"x"), tmp_path)


@pytest.mark.parametrize("name", list(CHUNKED_MODELS))
def test_the_pinned_packages_are_installed_as_one_chunk_each(name: str) -> None:
    model = CHUNKED_MODELS[name]
    chunks = chunk_files(model)
    assert sum(c.stat().st_size for c in chunks) == model.size
    assert [c.name for c in chunks] == [f"part{i:02d}.bin" for i in range(1, len(chunks) + 1)]


@pytest.mark.slow
async def test_qwen_0_5b_joins_verifies_and_answers(tmp_path: Path) -> None:
    path = model_file(QWEN_CODER_0_5B, tmp_path)
    assert path.read_bytes()[:4] == b"GGUF"
    engine = LlamaCppEngine(
        "small", LlamaCppSettings(model=QWEN_CODER_0_5B, template="chat"), tmp_path
    )
    await engine.start()
    try:
        question = (Message("user", "What is the capital of France? Answer in one word."),)
        generation = await engine.generate(question, SamplingParams(max_tokens=8, temperature=0))
    finally:
        await engine.close()
    assert "Paris" in generation.text
