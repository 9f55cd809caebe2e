"""The routing decision: a prompt's embedding, its difficulty score, and the tier it earns."""

from __future__ import annotations

import asyncio
import time
from importlib import resources
from pathlib import Path
from typing import Literal

import msgspec

from router.embedder import Embedder, Embedding, Vectors
from router.model_file import RouterModel, read_router
from router.scorers import Neighbour, Scorer, scorer_for
from router.settings import BUNDLED_ROUTER, RouterSettings

Tier = Literal["small", "large"]


class RouteDecision(msgspec.Struct, frozen=True, kw_only=True):
    tier: Tier
    engine: str
    score: float
    threshold: float
    neighbours: list[Neighbour]
    embedding_ms: float
    scoring_ms: float


def router_file(settings: RouterSettings) -> Path:
    if settings.model_file == BUNDLED_ROUTER:
        return Path(str(resources.files("router").joinpath("data/default.router")))
    return Path(settings.model_file).expanduser()


class Router:
    """Scores prompts with the model file's scorer against one threshold."""

    def __init__(self, settings: RouterSettings, embedder: Embedder) -> None:
        self.settings = settings
        self.embedder = embedder
        self.model: RouterModel | None = None
        self._scorer: Scorer | None = None

    async def start(self) -> None:
        """Load the model file; the embedder must be started, its fingerprint is checked."""
        path = router_file(self.settings)
        self.model = await asyncio.to_thread(read_router, path, embedding=self.embedder.fingerprint)
        self._scorer = await asyncio.to_thread(scorer_for, self.model)

    async def use(self, model: RouterModel) -> None:
        """Route with ``model`` from now on (a policy version's): requests already routed
        keep their route."""
        if model.embedding != self.embedder.fingerprint:
            raise ValueError(
                f"router fitted on embeddings of {model.embedding!r}; this gateway embeds "
                f"with {self.embedder.fingerprint!r}"
            )
        scorer = await asyncio.to_thread(scorer_for, model)
        self.model, self._scorer = model, scorer

    @property
    def threshold(self) -> float:
        if self.settings.threshold is not None:
            return self.settings.threshold
        assert self.model is not None, "router is not started"
        return self.model.threshold

    async def decide(
        self,
        prompt: str,
        embedding: Embedding,
        embedding_ms: float,
        threshold: float | None = None,
    ) -> RouteDecision:
        """Route one prompt whose embedding the caller already has, against
        ``threshold`` (a tenant's own) or the router's."""
        assert self.model is not None, "router is not started"
        if embedding.model != self.model.embedding:
            raise ValueError(
                f"embedding from {embedding.model!r}; the router was fitted on "
                f"{self.model.embedding!r}"
            )
        started = time.perf_counter()
        # FAISS search is blocking work; it stays off the event loop.
        score, neighbours = await asyncio.to_thread(self._score, prompt, embedding.vector)
        threshold = self.threshold if threshold is None else threshold
        tier: Tier = "large" if score >= threshold else "small"
        return RouteDecision(
            tier=tier,
            engine=self.settings.large_engine if tier == "large" else self.settings.small_engine,
            score=score,
            threshold=threshold,
            neighbours=neighbours,
            embedding_ms=embedding_ms,
            scoring_ms=(time.perf_counter() - started) * 1000,
        )

    def _score(self, prompt: str, vector: Vectors) -> tuple[float, list[Neighbour]]:
        assert self._scorer is not None, "router is not started"
        score = float(self._scorer.score(vector, [prompt])[0])
        return score, self._scorer.neighbours(vector, self.settings.explain_neighbours)
