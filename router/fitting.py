"""Fitting a router on outcome data: a model file's contents with its default
threshold, and cross-validated scores that judge a kind of scorer on data it did not
see."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np

from router import calibrate
from router.embedder import Vectors
from router.model_file import RouterModel
from router.outcomes import Outcome
from router.scorers import Kind, Scores, fit, scorer_for


def fit_router(
    kind: Kind,
    outcomes: Sequence[Outcome],
    vectors: Vectors,
    *,
    embedding: str,
    k: int = 100,
    trained_on: str = "",
) -> RouterModel:
    """A router fitted on ``outcomes`` (``vectors`` are their prompts' embeddings, made
    with ``embedding``), whose threshold sends the large model the share of prompts
    that needed it: a default to tune with ``calibrate`` on real traffic."""
    model = fit(kind, outcomes, vectors, embedding=embedding, k=k, trained_on=trained_on)
    needed = float(np.mean([o.large > o.small for o in outcomes]))
    scores = scorer_for(model).score(vectors, [o.prompt for o in outcomes])
    threshold = calibrate.for_large_fraction(scores, needed).threshold
    return msgspec.structs.replace(model, threshold=threshold)


def cross_validated_scores(
    kind: Kind, outcomes: Sequence[Outcome], vectors: Vectors, folds: int, seed: int, k: int
) -> Scores:
    """Each prompt scored by a router fitted on the other folds only."""
    order = np.random.default_rng(seed).permutation(len(outcomes))
    scores = np.zeros(len(outcomes))
    for held_out in np.array_split(order, folds):
        train = np.setdiff1d(order, held_out)
        model = fit(kind, [outcomes[i] for i in train], vectors[train], embedding="cv", k=k)
        prompts = [outcomes[i].prompt for i in held_out]
        scores[held_out] = scorer_for(model).score(vectors[held_out], prompts)
    return scores
