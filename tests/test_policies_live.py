"""Policy versions on a live gateway's parts: a version in shadow judges each settled
request beside the one in force, and a move puts a version's router, calibrator and
verifier calibration in force for the requests that start after it, and back.

The router's and the verifier's on a real ``Runtime`` (the bundled embedder, router and
verifier, both tiers on SmolLM2-135M, a memory cache, stores in files); the loop's
calibrator on the scripted pipeline of tests/test_settled.py, whose loop stops on
purpose.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import numpy as np
import pytest

from cache.calibration import OperatingPoints, read_calibration
from cache.verifier import VerifierError
from engines.scripted import ScriptedEngine, script
from evaluator.calibration import Calibrator
from gateway.api.front import open_exchange
from gateway.api.validate import chat_request
from gateway.api.wire import ChatCompletionRequest, ChatMessage
from gateway.checks import refit
from gateway.checks.learn import InForce, learn
from gateway.checks.policies import Policies, UnknownVersion
from gateway.checks.record import CheckRecord
from gateway.checks.shadow import ShadowChecks
from gateway.checks.store import FileOutcomes
from gateway.checks.versions import (
    SHIPPED,
    FilePolicies,
    Manifest,
    PolicyState,
    PolicyVersion,
    new_id,
)
from gateway.config import parse_config
from gateway.config.shadow import ShadowSettings
from gateway.pipeline.exchange import Settled
from gateway.pipeline.outcome import Finished
from gateway.pipeline.request_policy import CacheControl, resolve
from gateway.runtime import Runtime
from router.embedder import Embedder, Vectors
from router.router import Router
from tests.support import satisfice
from tests.test_policy_learn import routed_traffic, word_problem
from tests.test_settled import ALL_LARGE, ALL_SMALL, SIGNALS, SURE, _gateway, _request, embedder

__all__ = ["embedder"]  # the scripted pipeline's module-scoped fixture (test_settled)

# Routed small by the bundled router (its score, 0.16, well under the threshold, 0.22),
# and by a refit on traffic where capitals agree.
EASY = "What is the capital of France?"
# Routed large by the bundled router (0.75), and by the refit.
HARD = (
    "Terry eats 2 yogurts a day. They are currently on sale at 4 yogurts for $5.00. How "
    "much does he spend on yogurt over 30 days?"
)


def runtime_config(directory: Path) -> str:
    return f"""
router: {{model_file: bundled, small_engine: small, large_engine: large}}
cache: {{store: {{kind: memory}}}}
shadow: {{outcomes_file: {directory / "outcomes.jsonl"}}}
engines:
  small: {{backend: llama_cpp, model: smollm2-135m-instruct}}
  large: {{backend: llama_cpp, model: smollm2-135m-instruct}}
"""


class Live:
    """A started runtime, its config file (for the CLI), and the settled requests."""

    def __init__(self, runtime: Runtime, config_file: Path) -> None:
        self.runtime = runtime
        self.config_file = config_file
        self.settled: list[Settled] = []
        runtime.settlement.subscribe(self.settled.append)

    @property
    def policies(self) -> Policies:
        return self.runtime.policies

    @property
    def router(self) -> Router:
        assert self.runtime.router is not None
        return self.runtime.router

    async def ask(self, question: str) -> Settled:
        """``question`` through the pipeline as the front door sends it, its exchange
        opened as the HTTP layer opens one; neither looked up nor kept in the cache."""
        runtime = self.runtime
        wire = ChatCompletionRequest(
            model="auto", messages=[ChatMessage("user", question)], max_tokens=2, temperature=0
        )
        request = chat_request(wire, runtime.engines, routing=True, limits=runtime.config.server)
        policy = resolve(runtime.config, "default", arrived=time.monotonic(),
                         control=CacheControl(lookup=False, store=False))  # fmt: skip
        exchange = open_exchange(runtime, tenant="default", model="auto", key=None)
        exchange.admitted(request, policy)
        answering = await runtime.pipeline.run(request, policy, exchange)
        events = [event async for event in answering.events]
        assert isinstance(events[-1], Finished)
        exchange.end(200)
        assert exchange.settled
        (mine,) = [s for s in self.settled if s.decision is exchange.decision]
        return mine

    def shadow_decisions(self, version: str, part: str, differs: bool) -> float:
        value = self.runtime.metrics.registry.get_sample_value(
            "satisfice_policy_shadow_decisions_total",
            {"version": version, "part": part, "differs": "true" if differs else "false"},
        )
        return value or 0.0

    def embed(self, prompts: list[str]) -> tuple[Vectors, str]:
        embedder = self.runtime.embedder
        assert embedder is not None
        return embedder.encode(prompts), embedder.fingerprint


@pytest.fixture(scope="module")
async def live(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Live]:
    directory = tmp_path_factory.mktemp("policies-live")
    config_file = directory / "satisfice.yaml"
    config_file.write_text(runtime_config(directory))
    runtime = Runtime(parse_config(config_file.read_text()))
    await runtime.start()
    assert runtime.ready, runtime.failure
    yield Live(runtime, config_file)
    await runtime.close()


@pytest.fixture
async def shipped(live: Live) -> AsyncIterator[Live]:
    """The live runtime with the shipped version in force and none in shadow, before
    and after the test."""
    await live.policies.store.set_state(PolicyState())
    await live.policies.sync()
    assert live.policies.active == SHIPPED
    yield live
    await live.policies.store.set_state(PolicyState())
    await live.policies.sync()


def _manifest(vid: str, fitted: dict[str, int]) -> Manifest:
    return Manifest(id=vid, created_at=time.time(), parent=SHIPPED, records=0, fitted=fitted)


async def _all_large(live: Live) -> PolicyVersion:
    """A version whose router sends everything to the large tier, kept in the store."""
    assert live.router.model is not None
    router = msgspec.structs.replace(live.router.model, threshold=0.0)  # no score under it
    version = PolicyVersion(manifest=_manifest(new_id(), {"router": 1}), router=router)
    await live.policies.store.put(version)
    return version


async def _learned(live: Live) -> PolicyVersion:
    """A version refitted from checks: word problems disagree, greetings and capitals
    agree."""
    assert live.router.model is not None
    in_force = InForce(SHIPPED, live.router.model, None, None, None, None, None)
    version = learn(routed_traffic(200), in_force, live.embed)
    assert version.router is not None
    await live.policies.store.put(version)
    return version


async def test_a_version_in_shadow_counts_where_its_router_would_route_otherwise(
    shipped: Live,
) -> None:
    live = shipped
    version = await _all_large(live)
    vid = version.manifest.id
    state = await live.policies.move("shadow", vid)
    assert (state.active, state.shadow) == (SHIPPED, vid)
    assert live.policies.active == SHIPPED  # a version in shadow decides nothing

    easy = await live.ask(EASY)
    assert easy.decision.route == "small" and easy.decision.policy == SHIPPED
    assert easy.embedding is not None
    assert live.shadow_decisions(vid, "router", differs=True) == 1
    hard = await live.ask(HARD)
    assert hard.decision.route == "large"
    assert live.shadow_decisions(vid, "router", differs=False) == 1
    assert live.shadow_decisions(vid, "router", differs=True) == 1
    # It has no calibrator or verifier of its own: nothing to judge those by.
    assert live.shadow_decisions(vid, "calibrator", differs=False) == 0
    assert live.shadow_decisions(vid, "verifier", differs=False) == 0
    assert f'satisfice_policy_info{{active="shipped",shadow="{vid}"}} 1.0' in (
        live.runtime.metrics.exposition().decode()
    )

    await live.policies.move("unshadow")
    await live.ask(EASY)
    assert live.shadow_decisions(vid, "router", differs=True) == 1  # no longer judged
    assert 'satisfice_policy_info{active="shipped",shadow=""} 1.0' in (
        live.runtime.metrics.exposition().decode()
    )


async def test_activate_routes_with_the_versions_router_and_revert_goes_back(
    shipped: Live,
) -> None:
    live = shipped
    shipped_model = live.router.model
    everything_large, learned = await _all_large(live), await _learned(live)
    assert (await live.ask(EASY)).decision.route == "small"

    state = await live.policies.move("activate", everything_large.manifest.id)
    assert (state.active, state.previous) == (everything_large.manifest.id, SHIPPED)
    assert live.runtime.policy_version == everything_large.manifest.id
    assert live.router.model == everything_large.router
    greeted = await live.ask(EASY)
    assert greeted.decision.route == "large"
    assert greeted.decision.policy == everything_large.manifest.id
    assert greeted.decision.view().policy == everything_large.manifest.id

    await live.policies.move("activate", learned.manifest.id)
    assert live.router.model == learned.router
    assert learned.router is not None
    for question, route in ((EASY, "small"), (HARD, "large"),
                            (word_problem(random.Random(5)), "large")):  # fmt: skip
        settled = await live.ask(question)
        assert (settled.decision.route, settled.decision.policy) == (route, learned.manifest.id)

    state = await live.policies.move("revert")
    assert state.active == everything_large.manifest.id and state.previous is None
    assert (await live.ask(EASY)).decision.route == "large"
    state = await live.policies.move("revert")
    assert state.active == SHIPPED and live.runtime.policy_version == SHIPPED
    assert live.router.model == shipped_model
    back = await live.ask(EASY)
    assert (back.decision.route, back.decision.policy) == ("small", SHIPPED)


async def test_an_unknown_version_is_refused_and_changes_nothing(shipped: Live) -> None:
    live = shipped
    before = await live.policies.store.state()
    for move in ("activate", "shadow"):
        with pytest.raises(UnknownVersion, match="p-never-written"):
            await live.policies.move(move, "p-never-written")
    with pytest.raises(UnknownVersion, match="shipped is what the gateway started with"):
        await live.policies.move("activate", SHIPPED)
    with pytest.raises(ValueError, match="policy version id"):
        await live.policies.move("activate", "../state")
    assert await live.policies.store.state() == before
    assert live.policies.active == SHIPPED


async def test_a_version_one_part_of_which_cannot_apply_is_refused_whole(shipped: Live) -> None:
    live = shipped
    router_before = live.router.model
    version = await _all_large(live)
    other_weights = msgspec.structs.replace(read_calibration(), verifier="other-weights")
    broken = msgspec.structs.replace(version, verifier=other_weights)
    await live.policies.store.put(broken)
    before = await live.policies.store.state()
    with pytest.raises(VerifierError, match="other-weights"):
        await live.policies.move("activate", broken.manifest.id)
    # Nothing changed: not the state, not the router (which could have applied alone).
    assert await live.policies.store.state() == before
    assert live.router.model is router_before and live.policies.active == SHIPPED


async def test_a_versions_verifier_calibration_moves_the_operating_point_and_back(
    shipped: Live,
) -> None:
    live = shipped
    cache = live.runtime.cache
    assert cache is not None and cache.verification is not None
    bound = cache.settings.max_false_hit_rate
    served_at = cache.verification.threshold(bound)
    # Semantic hits at the operating point in force were often wrong below 0.95.
    rng = np.random.default_rng(0)
    scores = rng.uniform(served_at, 1.0, 1000)
    wrong = (scores < 0.95) & (rng.random(1000) < 0.5)
    verifier = refit.verifier_calibration(
        read_calibration(), scores.tolist(), wrong.tolist(), pairs="test"
    )
    version = PolicyVersion(manifest=_manifest(new_id(), {"verifier": 1000}), verifier=verifier)
    await live.policies.store.put(version)

    await live.policies.move("activate", version.manifest.id)
    raised = cache.verification.threshold(bound)
    assert raised == OperatingPoints(verifier).threshold(bound) and raised > served_at
    assert live.router.model is not None  # a version without a router keeps the shipped one
    assert (await live.ask(EASY)).decision.route == "small"
    await live.policies.move("revert")
    assert cache.verification.threshold(bound) == served_at


async def test_a_move_made_elsewhere_is_followed_on_the_next_sync(shipped: Live) -> None:
    live = shipped
    version = await _all_large(live)
    vid = version.manifest.id
    # Another replica, or the CLI, on the same store.
    result = satisfice("policy", "activate", vid, "--config", str(live.config_file),
                       timeout_s=60)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert f"in force: {vid}" in result.stdout
    assert live.policies.active == SHIPPED  # until it polls
    await live.policies.sync()
    assert live.policies.active == vid and live.router.model == version.router
    assert (await live.ask(EASY)).decision.policy == vid

    listed = satisfice("policy", "list", "--json", "--config", str(live.config_file),
                       timeout_s=60)  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    shown = msgspec.json.decode(listed.stdout)
    assert shown["state"]["active"] == vid and shown["state"]["previous"] == SHIPPED
    assert vid in [m["id"] for m in shown["versions"]]

    unknown = satisfice("policy", "shadow", "p-never-written", "--config",
                        str(live.config_file), timeout_s=60)  # fmt: skip
    assert unknown.returncode != 0 and "no policy version 'p-never-written'" in unknown.stderr
    other = FilePolicies(Path(live.policies.store.where))
    await other.set_state(PolicyState())  # a revert written by hand elsewhere
    await live.policies.sync()
    assert live.policies.active == SHIPPED and live.router.model is not None


# -- the loop's calibrator, on scripted engines -------------------------------------

# P(correct) that no round reaches: the loop runs to its budget.
NEVER_SURE = Calibrator(
    features=["vote_share"], signals=SIGNALS, mean=[0.0], scale=[1.0], weights=[0.0], bias=-10.0
)


async def test_a_versions_calibrator_judges_in_shadow_and_decides_when_active(
    embedder: tuple[Embedder, Router], tmp_path: Path
) -> None:
    _, router = embedder
    gateway = _gateway(
        embedder, ScriptedEngine([SURE], name="small"), ScriptedEngine([SURE], name="large")
    )
    decided: list[tuple[str, str, bool]] = []
    policies = Policies(
        FilePolicies(tmp_path / "policies"),
        router=router,
        loop=gateway.pipeline.loop,
        cache=gateway.cache,
        decided=lambda version, part, differs: decided.append((version, part, differs)),
    )
    gateway.settlement.subscribe(policies.settled)
    policies.started()
    loop = gateway.pipeline.loop
    assert loop is not None
    shipped_calibrator = loop.calibrator
    # A version whose map takes every P in force to 0: it would never stop early.
    never = PolicyVersion(
        manifest=_manifest("p-never-sure", {"calibrator": 30}),
        calibrator=NEVER_SURE,
        calibration_map=([0.0, 1.0], [0.0, 0.0]),
    )
    same = PolicyVersion(
        manifest=_manifest("p-as-shipped", {"calibrator": 30}),
        calibrator=shipped_calibrator,
        calibration_map=([0.0, 1.0], [0.0, 1.0]),
    )
    for version in (never, same):
        await policies.store.put(version)
    hard = gateway.policy(router_threshold=ALL_LARGE, control=CacheControl(lookup=False))

    await policies.move("shadow", "p-never-sure")
    stopped = await gateway.settled_for(await gateway.ask(_request("auto"), hard))
    assert stopped.decision.loop is not None and stopped.decision.loop.stop == "confident"
    assert ("p-never-sure", "calibrator", True) in decided
    # Its router is the shipped one's, none of its own: the router is not judged.
    assert [d for d in decided if d[1] == "router"] == []
    decided.clear()
    # A greedy_first pass's P is the greedy calibrator's, which a version does not
    # replace: a loop that pass stopped is not its calibrator's to judge.
    assert hard.loop is not None
    greedy = msgspec.structs.replace(
        hard, loop=msgspec.structs.replace(hard.loop, greedy_first=True)
    )
    stopped = await gateway.settled_for(await gateway.ask(_request("auto"), greedy))
    assert stopped.decision.loop is not None and stopped.decision.loop.stop == "greedy"
    assert [r.greedy for r in stopped.decision.loop.rounds] == [True]
    assert decided == []
    await policies.move("shadow", "p-as-shipped")
    await gateway.settled_for(await gateway.ask(_request("auto"), hard))
    assert decided == [("p-as-shipped", "calibrator", False)]

    await policies.move("activate", "p-never-sure")
    assert loop.calibrator == NEVER_SURE
    ran_on = await gateway.settled_for(await gateway.ask(_request("auto"), hard))
    trace = ran_on.decision.loop
    assert trace is not None and trace.stop != "confident" and len(trace.rounds) == 2
    await policies.move("revert")
    assert loop.calibrator == shipped_calibrator
    again = await gateway.settled_for(await gateway.ask(_request("auto"), hard))
    assert again.decision.loop is not None and again.decision.loop.stop == "confident"


async def test_a_check_is_recorded_under_the_version_that_decided_not_a_later_one(
    embedder: tuple[Embedder, Router], tmp_path: Path
) -> None:
    # The check's reference answer is slow: a version is put in force while it runs.
    slow = script("The answer is 42, after a long think", seconds_per_token=0.05)
    large = ScriptedEngine([slow], name="large")
    gateway = _gateway(embedder, ScriptedEngine([SURE], name="small"), large)
    _, router = embedder
    policies = Policies(
        FilePolicies(tmp_path / "policies"), router=router, loop=gateway.pipeline.loop,
        cache=gateway.cache, decided=lambda *_: None,
    )  # fmt: skip
    policies.started()
    records: list[CheckRecord] = []
    checks = ShadowChecks(
        gateway.pipeline,
        FileOutcomes(tmp_path / "outcomes.jsonl", max_bytes=1 << 20),
        ShadowSettings(share=1.0),
        share_of=lambda _tenant, _shortcut: 1.0,
        recorded=records.append,
    )
    gateway.settlement.subscribe(gateway.pipeline.live.settled)
    gateway.settlement.subscribe(checks.settled)
    checks.start()
    await policies.store.put(PolicyVersion(manifest=_manifest("p-later", {})))
    try:
        easy = gateway.policy(router_threshold=ALL_SMALL, loop=None,
                              control=CacheControl(lookup=False, store=False))  # fmt: skip
        settled = await gateway.settled_for(await gateway.ask(_request("auto"), easy))
        assert (settled.decision.route, settled.decision.policy) == ("small", SHIPPED)
        async with asyncio.timeout(5):  # the check begins on the large engine
            while not large.calls:  # noqa: ASYNC110
                await asyncio.sleep(0.005)
        await policies.move("activate", "p-later")
        async with asyncio.timeout(10):
            await checks.drained()
    finally:
        await checks.close()
    (record,) = records
    assert (record.shortcut, record.status) == ("small_route", "checked")
    assert record.policy == SHIPPED  # the shortcut was the shipped version's


async def test_a_replica_with_every_part_off_still_follows_the_moves(tmp_path: Path) -> None:
    # A replica whose parts are all off still follows the state (it reports it).
    policies = Policies(
        FilePolicies(tmp_path / "policies"), router=None, loop=None, cache=None,
        decided=lambda *_: None,
    )  # fmt: skip
    policies.started()
    version = PolicyVersion(manifest=_manifest("p-nothing", {}))
    await policies.store.put(version)
    async with asyncio.timeout(5):
        await policies.move("activate", "p-nothing")
    assert policies.active == "p-nothing"
    await policies.move("revert")
    assert policies.active == SHIPPED
