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

# Folds of the cross-validated scores a fitted router's threshold is chosen on.
THRESHOLD_FOLDS = 5


def fit_router(
    kind: Kind,
    outcomes: Sequence[Outcome],
    vectors: Vectors,
    *,
    embedding: str,
    k: int = 100,
    trained_on: str = "",
    quality_gap: float | None = None,
) -> RouterModel:
    """A router fitted on ``outcomes`` (``vectors`` are their prompts' embeddings, made
    with ``embedding``), whose threshold sends the large model the share of prompts
    that needed it, or with ``quality_gap`` the fewest prompts that recover that share
    of the accuracy between always-small and always-large: a default to tune with
    ``calibrate`` on real traffic.

    The threshold is read off cross-validated scores, as new prompts would score: on
    its own examples a kNN router mostly sees each prompt's own label (its nearest
    neighbour, at similarity 1), which puts those scores far apart from new ones'."""
    model = fit(kind, outcomes, vectors, embedding=embedding, k=k, trained_on=trained_on)
    needed = float(np.mean([o.large > o.small for o in outcomes]))
    if len(outcomes) >= THRESHOLD_FOLDS:
        scores = cross_validated_scores(kind, outcomes, vectors, THRESHOLD_FOLDS, 0, k)
    else:
        scores = scorer_for(model).score(vectors, [o.prompt for o in outcomes])
    if quality_gap is None:
        threshold = calibrate.for_large_fraction(scores, needed).threshold
    else:
        small = float(np.mean([o.small for o in outcomes]))
        large = float(np.mean([o.large for o in outcomes]))
        target = min(large, small + quality_gap * max(0.0, large - small))
        threshold = calibrate.for_quality(scores, outcomes, target).threshold
    return msgspec.structs.replace(model, threshold=threshold)


class HeldOutRouting(msgspec.Struct, frozen=True):
    """What the shipped kind of router does on prompts it was not fitted on: each fold
    routed by a router fitted, threshold and all, on the other folds."""

    accuracy: float  # %, the answers of the engines it chose
    large_share: float  # %, of prompts sent to the large engine


def cross_validated_routing(
    kind: Kind,
    outcomes: Sequence[Outcome],
    vectors: Vectors,
    folds: int,
    seed: int,
    k: int,
    quality_gap: float | None = None,
) -> HeldOutRouting:
    order = np.random.default_rng(seed).permutation(len(outcomes))
    to_large = np.zeros(len(outcomes), dtype=bool)
    for held_out in np.array_split(order, folds):
        train = np.setdiff1d(order, held_out)
        model = fit_router(
            kind,
            [outcomes[i] for i in train],
            vectors[train],
            embedding="cv",
            k=k,
            quality_gap=quality_gap,
        )
        prompts = [outcomes[i].prompt for i in held_out]
        to_large[held_out] = scorer_for(model).score(vectors[held_out], prompts) >= model.threshold
    answers = [o.large if large else o.small for o, large in zip(outcomes, to_large, strict=True)]
    return HeldOutRouting(100 * float(np.mean(answers)), 100 * float(np.mean(to_large)))


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
