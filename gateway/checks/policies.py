"""The policy version in force in one gateway, the one in shadow beside it, and the
moves between them: shadow, activate, revert. Hot: a move applies to the requests
that start after it, on every replica that shares the store within a poll.

A version in shadow decides nothing: for each settled request its router, calibrator
and verifier calibration say what they would have decided, and the gateway counts
(and logs) where that differs from what the version in force decided.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec
import numpy as np

from cache.calibration import OperatingPoints
from cache.semantic_cache import SemanticCache
from cache.verifier import Verification
from evaluator.calibration import Calibrator
from evaluator.loop import ReasoningLoop
from gateway.checks.versions import (
    SHIPPED,
    Move,
    PolicyState,
    PolicyStore,
    PolicyVersion,
    after,
    check_id,
)
from gateway.pipeline.exchange import Settled
from router.model_file import RouterModel
from router.router import Router
from router.scorers import scorer_for

log = logging.getLogger("satisfice.policy")

# Told of each shadow decision: the version, the part, and whether it differs.
ShadowDecision = Callable[[str, str, bool], None]


class UnknownVersion(LookupError):
    """No version of that id in the store."""


class Shipped(msgspec.Struct, frozen=True):
    """The parts the gateway started with, which ``shipped`` names."""

    router: RouterModel | None
    calibrator: Calibrator | None
    verification: Verification | None


class Policies:
    def __init__(
        self,
        store: PolicyStore,
        *,
        router: Router | None,
        loop: ReasoningLoop | None,
        cache: SemanticCache | None,
        decided: ShadowDecision,
    ) -> None:
        self.store = store
        self._router = router
        self._loop = loop
        self._cache = cache
        self._decided = decided
        self._shipped: Shipped | None = None
        self.active = SHIPPED
        self._candidate: _Candidate | None = None  # the version in shadow
        self.state = PolicyState()

    def started(self) -> None:
        """The parts have loaded: what they are now is what ``shipped`` names."""
        self._shipped = Shipped(
            router=None if self._router is None else self._router.model,
            calibrator=None if self._loop is None else self._loop.calibrator,
            verification=None if self._cache is None else self._cache.verification,
        )

    async def sync(self) -> None:
        """Put the store's state in force, if it changed."""
        state = await self.store.state()
        if state == self.state:
            return
        if state.active != self.active:
            await self._apply(None if state.active == SHIPPED else await self._get(state.active))
        shadow = None if state.shadow is None else await self._get(state.shadow)
        self._candidate = None if shadow is None else _Candidate(shadow)
        self.state = state
        log.info("policy %s in force, %s in shadow", self.active, state.shadow or "none")

    async def move(self, move: Move, version: str | None = None) -> PolicyState:
        """Make ``move`` (gateway.checks.versions.after) and put it in force here; other
        replicas follow within a poll. Raises ``UnknownVersion`` for a version the
        store does not hold."""
        if version is not None:
            loaded = await self._get(version)  # it exists, and loads
            if move == "activate":
                self._prepared(loaded)  # and this gateway can put it in force
        state = after(await self.store.state(), move, version)
        await self.store.set_state(state)
        await self.sync()
        return state

    async def _get(self, version_id: str) -> PolicyVersion:
        if version_id == SHIPPED:
            raise UnknownVersion("shipped is what the gateway started with, not a stored version")
        version = await self.store.get(check_id(version_id))
        if version is None:
            raise UnknownVersion(f"no policy version {version_id!r} in {self.store.where}")
        return version

    async def _apply(self, version: PolicyVersion | None) -> None:
        """Put ``version``'s parts in force (None: the shipped ones), all or none."""
        router, verification = self._prepared(version)
        if self._router is not None and router is not None:
            await self._router.use(router)
        if self._loop is not None:
            shipped = self._shipped
            assert shipped is not None
            own = None if version is None else version.calibrator
            self._loop.use_calibrator(own or shipped.calibrator)
        if self._cache is not None:
            self._cache.verification = verification
        self.active = SHIPPED if version is None else version.manifest.id

    def _prepared(
        self, version: PolicyVersion | None
    ) -> tuple[RouterModel | None, Verification | None]:
        """The router and verification ``version`` puts in force, once every check that
        could refuse one has passed (a router of other embeddings, a calibration of
        other verifier weights), so that no part changes unless all can."""
        shipped = self._shipped
        assert shipped is not None, "policies before the parts started"
        router = shipped.router if version is None or version.router is None else version.router
        if self._router is not None and router is not None:
            fingerprint = self._router.embedder.fingerprint
            if router.embedding != fingerprint:
                raise ValueError(
                    f"the version's router was fitted on embeddings of {router.embedding!r}; "
                    f"this gateway embeds with {fingerprint!r}"
                )
        verification = shipped.verification
        if version is not None and version.verifier is not None and verification is not None:
            verification = Verification(verification.verifier, OperatingPoints(version.verifier))
        return router, verification

    # -- in shadow -------------------------------------------------------------------

    def settled(self, settled: Settled) -> None:
        """A settlement subscriber: what the version in shadow would have decided."""
        candidate = self._candidate
        if candidate is None or settled.policy is None or settled.status != 200:
            return
        name = candidate.version.manifest.id
        for part, differs in (
            ("router", candidate.routes_otherwise(settled)),
            ("calibrator", candidate.stops_otherwise(settled)),
            ("verifier", candidate.serves_otherwise(settled)),
        ):
            if differs is not None:
                self._decided(name, part, differs)


class _Candidate:
    """A version in shadow, with what judging each request needs built once."""

    def __init__(self, version: PolicyVersion) -> None:
        self.version = version
        self.scorer = None if version.router is None else scorer_for(version.router)
        self.verifier = None if version.verifier is None else OperatingPoints(version.verifier)

    def routes_otherwise(self, settled: Settled) -> bool | None:
        """Whether its router sends the request to the other tier; None: no router, or
        nothing was routed."""
        router, decision, policy = self.version.router, settled.decision, settled.policy
        if self.scorer is None or router is None or settled.embedding is None or policy is None:
            return None
        if decision.route not in ("small", "large", "loop", "fallback"):
            return None
        score = float(self.scorer.score(settled.embedding.vector, [""])[0])
        pinned = policy.router_threshold  # the config's or the tenant's, if any
        large = score >= (router.threshold if pinned is None else pinned)
        return large != (decision.route != "small" and decision.escalated_from is None)

    def stops_otherwise(self, settled: Settled) -> bool | None:
        """Whether its calibrator stops the loop at another round (or not at all where
        the loop stopped confident). A greedy_first pass's P is the greedy calibrator's,
        which a version does not replace: only the voting rounds are read, and a loop
        the greedy pass stopped is not the version's to judge."""
        mapping, trace, policy = self.version.calibration_map, settled.decision.loop, settled.policy
        if mapping is None or trace is None or trace.fallback != "none":
            return None
        rounds = [r for r in trace.rounds if not r.greedy]
        if not rounds or policy is None or policy.loop is None:
            return None
        p = np.interp([r.probability for r in rounds], *mapping)
        confident = np.flatnonzero(p >= policy.loop.threshold)
        stop = int(confident[0]) + 1 if len(confident) else None
        return stop != (len(rounds) if trace.stop == "confident" else None)

    def serves_otherwise(self, settled: Settled) -> bool | None:
        """Whether its verifier calibration serves a semantic hit the live one did not,
        or turns down one it served."""
        decision, policy = settled.decision, settled.policy
        if self.verifier is None or decision.cache_score is None or policy is None:
            return None
        if policy.cache is None or decision.cache not in ("semantic", "miss"):
            return None
        serves = decision.cache_score >= self.verifier.threshold(policy.cache.max_false_hit_rate)
        return serves != (decision.cache == "semantic")
