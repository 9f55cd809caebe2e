"""A FAISS vector index over normalised embeddings, addressed by integer ids.

Exact (flat) search while small, HNSW once it grows past ``hnsw_above`` vectors:
flat search costs O(n) per query (about 7 ms at 100k on one core), HNSW well under
a millisecond. HNSW cannot delete, so removed ids are tombstoned, filtered out of
results and dropped for good at the next rebuild.

With GPU resources (faiss-gpu, the ``gpu`` extra) the index is an exact flat
index on the GPU at every size: brute force there beats HNSW on a CPU well into
millions of vectors. GPU indexes cannot delete either, so they tombstone too.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal

import faiss
import numpy as np
import numpy.typing as npt

from router.embedder import Vectors

Ids = npt.NDArray[np.int64]

HNSW_NEIGHBOURS = 32
HNSW_SEARCH_DEPTH = 64


Device = Literal["cpu", "gpu"]

log = logging.getLogger("satisfice.index")


def gpu_resources(device: Device) -> Any | None:
    """FAISS GPU resources for ``device: gpu``; None for the CPU, and also, with a
    warning, when this FAISS build or machine has no GPU (the CPU index serves)."""
    if device == "cpu":
        return None
    if not hasattr(faiss, "StandardGpuResources") or faiss.get_num_gpus() < 1:
        log.warning("vector index device 'gpu' asked for, but FAISS sees no GPU: using the CPU")
        return None
    return faiss.StandardGpuResources()


class VectorIndex:
    def __init__(self, dim: int, *, hnsw_above: int = 20_000, gpu: Any | None = None) -> None:
        self.dim = dim
        self.hnsw_above = hnsw_above
        self._gpu = gpu
        self._index = self._flat()
        self.is_hnsw = False
        self._tombstones: set[int] = set()

    @property
    def on_gpu(self) -> bool:
        return self._gpu is not None

    def _flat(self) -> faiss.IndexIDMap2:
        if self._gpu is not None:
            return faiss.IndexIDMap2(faiss.GpuIndexFlatIP(self._gpu, self.dim))
        return faiss.IndexIDMap2(faiss.IndexFlatIP(self.dim))

    def _hnsw(self) -> faiss.IndexIDMap2:
        graph = faiss.IndexHNSWFlat(self.dim, HNSW_NEIGHBOURS, faiss.METRIC_INNER_PRODUCT)
        graph.hnsw.efSearch = HNSW_SEARCH_DEPTH
        return faiss.IndexIDMap2(graph)

    def __len__(self) -> int:
        return int(self._index.ntotal) - len(self._tombstones)

    def add(self, ids: Ids, vectors: Vectors) -> None:
        vectors = np.ascontiguousarray(vectors, dtype=np.float32).reshape(-1, self.dim)
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if len(ids) != len(vectors):
            raise ValueError(f"{len(ids)} ids for {len(vectors)} vectors")
        # Re-adding an id replaces its vector.
        self.remove(ids)
        if not self.is_hnsw and not self.on_gpu and self._index.ntotal + len(ids) > self.hnsw_above:
            # Into HNSW before adding: converting a large flat index afterwards would
            # hold every vector twice.
            self._rebuild(hnsw=True)
        self._index.add_with_ids(vectors, ids)

    def remove(self, ids: Ids) -> None:
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if not self.is_hnsw and not self.on_gpu:
            self._index.remove_ids(ids)  # type: ignore[arg-type]  # the wrapper takes arrays
            return
        present = [int(i) for i in ids if self._contains(int(i))]
        self._tombstones.update(present)
        if len(self._tombstones) > 0.1 * max(1, self._index.ntotal):
            self._rebuild()

    def _contains(self, id_: int) -> bool:
        if id_ in self._tombstones:
            return False
        try:
            self._index.reconstruct(id_)
        except RuntimeError:
            return False
        return True

    def _rebuild(self, *, hnsw: bool | None = None) -> None:
        """Re-create the index without tombstones, as HNSW once it is large enough
        (or as ``hnsw`` says)."""
        live_ids = faiss.vector_to_array(self._index.id_map).astype(np.int64)
        keep = np.array([i not in self._tombstones for i in live_ids], dtype=bool)
        live_ids = live_ids[keep]
        vectors = np.empty((len(live_ids), self.dim), dtype=np.float32)
        for row, id_ in enumerate(live_ids):
            vectors[row] = self._index.reconstruct(int(id_))
        if hnsw is None:
            hnsw = len(live_ids) > self.hnsw_above
        self.is_hnsw = hnsw and not self.on_gpu
        self._index = self._hnsw() if self.is_hnsw else self._flat()
        self._tombstones.clear()
        if len(live_ids):
            self._index.add_with_ids(vectors, live_ids)

    def search(self, vectors: Vectors, k: int) -> tuple[npt.NDArray[np.float32], Ids]:
        """Cosine similarities and ids of the ``k`` nearest vectors per query, best first;
        missing neighbours have id -1."""
        queries = np.ascontiguousarray(vectors, dtype=np.float32).reshape(-1, self.dim)
        if self._index.ntotal == 0:
            empty = np.full((len(queries), k), -1, dtype=np.int64)
            return np.zeros((len(queries), k), dtype=np.float32), empty
        fetch = min(k + len(self._tombstones), int(self._index.ntotal))
        scores, ids = self._index.search(queries, fetch)
        if not self._tombstones:
            return _pad(scores, ids, k)
        dead = np.isin(ids, np.fromiter(self._tombstones, dtype=np.int64))
        scores = np.where(dead, -np.inf, scores)
        order = np.argsort(-scores, axis=1, kind="stable")
        scores = np.take_along_axis(scores, order, axis=1)
        ids = np.where(np.isinf(scores), -1, np.take_along_axis(ids, order, axis=1))
        return _pad(np.where(np.isinf(scores), 0, scores).astype(np.float32), ids, k)

    def save(self, path: str | Path) -> None:
        self._rebuild()
        index = faiss.index_gpu_to_cpu(self._index) if self.on_gpu else self._index
        faiss.write_index(index, str(path))

    @classmethod
    def load(cls, path: str | Path, *, hnsw_above: int = 20_000) -> VectorIndex:
        index = faiss.read_index(str(path))
        if not isinstance(index, faiss.IndexIDMap2):
            raise ValueError(f"{path}: not a vector index written by VectorIndex.save")
        loaded = cls(index.d, hnsw_above=hnsw_above)
        loaded._index = index
        loaded.is_hnsw = not isinstance(faiss.downcast_index(index.index), faiss.IndexFlat)
        return loaded


def _pad(scores: npt.NDArray[np.float32], ids: Ids, k: int) -> tuple[npt.NDArray[np.float32], Ids]:
    if scores.shape[1] >= k:
        return scores[:, :k], ids[:, :k]
    missing = k - scores.shape[1]
    return (
        np.pad(scores, ((0, 0), (0, missing))),
        np.pad(ids, ((0, 0), (0, missing)), constant_values=-1),
    )
