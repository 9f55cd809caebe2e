"""Difficulty scorers: from a prompt's embedding to P(the large model is needed).

Like RouteLLM's routers, a scorer has one method that matters, ``score``; fitting
turns outcome data and the prompts' embeddings into a model file's contents.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

import msgspec
import numpy as np
import numpy.typing as npt

from router.embedder import Vectors
from router.features import text_features
from router.index import VectorIndex
from router.model_file import KNNModel, LogisticModel, RouterModel
from router.outcomes import Outcome

Scores = npt.NDArray[np.float64]


class Neighbour(msgspec.Struct, frozen=True):
    prompt: str
    similarity: float
    label: float


class Scorer(Protocol):
    def score(self, vectors: Vectors, prompts: Sequence[str]) -> Scores:
        """P(the large model is needed) per prompt, given its embedding row, in [0, 1]."""
        ...

    def neighbours(self, vector: Vectors, k: int) -> list[Neighbour]:
        """The labelled examples nearest to one prompt."""
        ...


def need_for_large(outcome: Outcome) -> float:
    """The label a scorer learns: how much better the large model did, in [0, 1].

    When both models are right (or both wrong) the small one was enough.
    """
    return max(0.0, outcome.large - outcome.small)


class _Examples:
    """The model file's labelled examples, searchable by similarity."""

    def __init__(self, model: RouterModel, hnsw_above: int) -> None:
        self._prompts = model.prompts
        self._labels = np.asarray(model.labels, dtype=np.float64)
        self._index = VectorIndex(model.dim, hnsw_above=hnsw_above)
        self._index.add(np.arange(len(model.prompts)), model.matrix())

    def neighbours(self, vector: Vectors, k: int) -> list[Neighbour]:
        if k == 0:
            return []
        similarities, ids = self._index.search(vector, k)
        return [
            Neighbour(self._prompts[i], float(s), float(self._labels[i]))
            for s, i in zip(similarities[0], ids[0], strict=True)
            if i >= 0
        ]


class KNNScorer(_Examples):
    def __init__(self, model: KNNModel, *, hnsw_above: int = 20_000) -> None:
        super().__init__(model, hnsw_above)
        self._k = model.k
        self._temperature = model.temperature

    def score(self, vectors: Vectors, prompts: Sequence[str]) -> Scores:
        similarities, ids = self._index.search(vectors, self._k)
        present = ids >= 0
        # A softmax over similarities: the closest examples count the most, and a
        # crowd of middling ones cannot outvote a near-duplicate.
        logits = np.where(present, similarities / self._temperature, -np.inf)
        weights = np.exp(logits - logits.max(axis=1, keepdims=True))
        labels = self._labels[np.where(present, ids, 0)]
        scores: Scores = (weights * labels).sum(axis=1) / weights.sum(axis=1)
        return scores


class LogisticScorer(_Examples):
    def __init__(self, model: LogisticModel, *, hnsw_above: int = 20_000) -> None:
        super().__init__(model, hnsw_above)
        self._weights = np.asarray(model.weights, dtype=np.float64)
        self._bias = model.bias
        self._mean = np.asarray(model.feature_mean)
        self._scale = np.asarray(model.feature_scale)

    def score(self, vectors: Vectors, prompts: Sequence[str]) -> Scores:
        features = (text_features(prompts) - self._mean) / self._scale
        inputs = np.hstack([vectors.reshape(len(features), -1), features])
        scores: Scores = 1.0 / (1.0 + np.exp(-(inputs @ self._weights + self._bias)))
        return scores


def scorer_for(model: RouterModel) -> Scorer:
    if isinstance(model, KNNModel):
        return KNNScorer(model)
    return LogisticScorer(model)


Kind = Literal["knn", "logistic"]


def fit(
    kind: Kind,
    outcomes: Sequence[Outcome],
    vectors: Vectors,
    *,
    embedding: str,
    k: int = 100,
    temperature: float = 0.1,
    trained_on: str = "",
) -> RouterModel:
    labels = np.array([need_for_large(o) for o in outcomes], dtype=np.float64)
    examples = {
        "embedding": embedding,
        "dim": int(vectors.shape[1]),
        "prompts": [o.prompt for o in outcomes],
        "labels": labels.tolist(),
        "vectors": np.ascontiguousarray(vectors, dtype=np.float16).tobytes(),
        "trained_on": trained_on,
    }
    if kind == "knn":
        return KNNModel(k=k, temperature=temperature, **examples)
    features = text_features([o.prompt for o in outcomes])
    mean, scale = features.mean(axis=0), features.std(axis=0)
    scale[scale == 0] = 1.0
    inputs = np.hstack([vectors, (features - mean) / scale])
    weights, bias = _logistic(inputs, labels)
    return LogisticModel(
        weights=weights,
        bias=bias,
        feature_mean=mean.tolist(),
        feature_scale=scale.tolist(),
        **examples,
    )


def _logistic(inputs: npt.NDArray[np.float64], labels: Scores) -> tuple[list[float], float]:
    from sklearn.linear_model import LogisticRegression

    # Graded labels become two weighted copies of each example, one per class.
    features = np.vstack([inputs, inputs])
    classes = np.concatenate([np.ones(len(labels)), np.zeros(len(labels))])
    weights = np.concatenate([labels, 1.0 - labels])
    keep = weights > 0
    if len(np.unique(classes[keep])) < 2:
        raise ValueError("the outcomes need prompts where the large model was and was not needed")
    # Mild regularisation: picked by cross-validation on the RouteLLM outcome sets.
    regression = LogisticRegression(C=0.3, max_iter=3000)
    regression.fit(features[keep], classes[keep], sample_weight=weights[keep])
    return regression.coef_[0].tolist(), float(regression.intercept_[0])
