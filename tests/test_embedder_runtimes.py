"""The embedder's runtimes give the same vectors: the ONNX graph exported from the
bundled weights against sentence-transformers on public questions, and the export's
own refusals."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from router.embedder import Embedder, EmbedderSettings, bundled_model_dir
from router.onnx_export import ExportFailed, onnx_file

DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data"


def public_questions(limit: int = 300) -> list[str]:
    """Quora questions, short and long, as the cache sees them."""
    archive = DATA / "gptcache_qqp" / "similiar_qqp_full.json.gz"
    if not archive.exists():
        pytest.skip(f"{archive} is not here")
    raw = subprocess.run(["tar", "xzOf", str(archive)], capture_output=True, check=True).stdout
    texts = [p["text_a"] for p in json.loads(raw)[: limit * 2] if isinstance(p["text_a"], str)]
    return [*texts[:limit], "ok", "Hi!", "x" * 3000]  # the shortest and a cut-off one


def vectors(runtime: str, texts: list[str], models_dir: Path | None = None) -> np.ndarray:
    embedder = Embedder(EmbedderSettings(runtime=runtime), models_dir)  # type: ignore[arg-type]
    embedder.load()
    out: np.ndarray = embedder.encode(texts)
    return out


def test_the_onnx_graph_gives_sentence_transformers_vectors(embedder: Embedder) -> None:
    texts = public_questions()
    torch_vectors = vectors("torch", texts)
    onnx_vectors = embedder.encode(texts)  # the default runtime
    cosines = (onnx_vectors * torch_vectors).sum(axis=1)
    assert cosines.min() > 0.9999
    assert np.allclose(np.linalg.norm(onnx_vectors, axis=1), 1.0, atol=1e-5)
    # The weights name the space, whatever computes in it.
    torch_embedder = Embedder(EmbedderSettings(runtime="torch"))
    torch_embedder.load()
    assert torch_embedder.fingerprint == embedder.fingerprint


def test_one_text_or_a_batch_give_the_same_vector(embedder: Embedder) -> None:
    texts = public_questions(80)
    batched = embedder.encode(texts)  # more than max_batch: ordered by length, then back
    alone = np.stack([embedder.encode([t])[0] for t in texts[:10]])
    assert np.allclose(batched[:10], alone, atol=1e-5)


def test_the_graph_is_exported_once_into_models_dir(tmp_path: Path) -> None:
    model_dir = bundled_model_dir(EmbedderSettings().model)
    first = onnx_file(model_dir, "all-minilm-l6-v2:abc", "fp32", tmp_path)
    made = first.stat().st_mtime_ns
    again = onnx_file(model_dir, "all-minilm-l6-v2:abc", "fp32", tmp_path)
    assert again == first and again.stat().st_mtime_ns == made
    assert [p.name for p in tmp_path.iterdir()] == ["embedder-abc-fp32.onnx"]  # no leftovers


def test_an_export_that_fails_says_so_and_what_to_do(tmp_path: Path) -> None:
    broken = tmp_path / "model"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    with pytest.raises(ExportFailed, match=r"embedder\.runtime: torch"):
        onnx_file(broken, "x:0123", "fp32", tmp_path / "models")
    assert not list((tmp_path / "models").iterdir())


@pytest.mark.slow  # a second export, quantized (about 15 s)
def test_int8_stays_near_the_float_vectors(tmp_path: Path) -> None:
    texts = public_questions()
    float_vectors = vectors("onnx", texts, tmp_path)
    int8_vectors = vectors("onnx-int8", texts, tmp_path)
    cosines = (int8_vectors * float_vectors).sum(axis=1)
    assert cosines.mean() > 0.99 and cosines.min() > 0.97
