"""The router model file: what `satisfice router fit` writes and the config points to.

A msgpack document, versioned, that names the embedding model its vectors came
from. Loading refuses a file from another embedding model or a damaged one with a
message naming the file, never a silently wrong router.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import msgspec
import numpy as np

from router.embedder import Vectors

FORMAT: Literal["satisfice-router"] = "satisfice-router"


class _Header(msgspec.Struct, frozen=True, kw_only=True):
    format: Literal["satisfice-router"] = FORMAT
    version: Literal[1] = 1
    # Fingerprint of the embedding model whose vectors this router was fitted on.
    embedding: str
    dim: Annotated[int, msgspec.Meta(ge=1)]
    # Score at or above which a prompt goes to the large model, as fitted or calibrated.
    threshold: Annotated[float, msgspec.Meta(ge=0.0)] = 0.5
    # Where the outcomes came from, for whoever wonders what the router learned.
    trained_on: str = ""
    # The labelled examples: the kNN scorer scores with them, every scorer explains
    # its decisions with the nearest ones.
    prompts: list[str]
    labels: list[float]  # per example: how much the large model was needed, in [0, 1]
    vectors: bytes  # float16, row-major (len(prompts), dim)

    def matrix(self) -> Vectors:
        rows = np.frombuffer(self.vectors, dtype=np.float16).reshape(-1, self.dim)
        return rows.astype(np.float32)


class KNNModel(_Header, tag="knn", tag_field="kind", frozen=True, kw_only=True):
    """Similarity-weighted k nearest labelled examples."""

    # Defaults chosen by cross-validation on the RouteLLM MMLU and GSM8K outcome sets.
    k: Annotated[int, msgspec.Meta(ge=1)] = 100
    # Softmax temperature over similarities: lower trusts the closest examples more.
    temperature: Annotated[float, msgspec.Meta(gt=0.0)] = 0.1


class LogisticModel(_Header, tag="logistic", tag_field="kind", frozen=True, kw_only=True):
    """Logistic regression on the embedding and the text features (router.features),
    the latter standardised with the mean and scale seen in fitting."""

    weights: list[float]  # dim embedding weights, then one per text feature
    bias: float
    feature_mean: list[float]
    feature_scale: list[float]


RouterModel = KNNModel | LogisticModel


class RouterFileError(ValueError):
    """A router model file that cannot be used; the message names the file."""


def write_router(model: RouterModel, path: str | Path) -> None:
    Path(path).write_bytes(msgspec.msgpack.encode(model))


def read_router(path: str | Path, *, embedding: str | None = None) -> RouterModel:
    """Load a router file; with ``embedding``, refuse one fitted on another model."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise RouterFileError(f"{path}: cannot read: {exc}") from exc
    try:
        model: RouterModel = msgspec.msgpack.decode(data, type=RouterModel)
    except msgspec.DecodeError as exc:
        raise RouterFileError(f"{path}: not a usable {FORMAT} file: {exc}") from exc
    _check_shapes(model, path)
    if embedding is not None and model.embedding != embedding:
        raise RouterFileError(
            f"{path}: fitted on embeddings of {model.embedding!r}, but this gateway embeds "
            f"with {embedding!r}; refit the router with `satisfice router fit`"
        )
    return model


def _check_shapes(model: RouterModel, path: str | Path) -> None:
    rows = len(model.vectors) // (2 * model.dim)
    if rows * 2 * model.dim != len(model.vectors) or not (
        rows == len(model.prompts) == len(model.labels)
    ):
        raise RouterFileError(
            f"{path}: corrupt: {len(model.prompts)} prompts, {len(model.labels)} labels "
            f"and {len(model.vectors)} bytes of {model.dim}-dim vectors do not agree"
        )
    if isinstance(model, LogisticModel) and not (
        len(model.weights) - model.dim == len(model.feature_mean) == len(model.feature_scale) > 0
    ):
        raise RouterFileError(
            f"{path}: corrupt: {len(model.weights)} weights do not fit {model.dim}-dim "
            f"embeddings and {len(model.feature_mean)} text features"
        )
