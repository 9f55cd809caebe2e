"""Shadow checks on scripted engines: which shortcuts are drawn and with what
probability, what answers each again, that a check never delays, serves or caches
anything, and that live work stops one at once.

The pipeline is the real one (tests/test_settled.py's: scripted engines, the bundled
embedder and router, a memory cache); the records go to a real file store.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import msgspec

from engines.base import SamplingParams
from engines.scripted import ScriptedEngine, script
from gateway.checks.record import KEPT_CHARS, CheckRecord
from gateway.checks.shadow import ShadowChecks
from gateway.checks.store import FileOutcomes
from gateway.config.shadow import ShadowSettings, Shortcut
from gateway.pipeline.request_policy import CacheControl, Policy
from router.embedder import Embedder
from router.router import Router
from tests.test_settled import (
    ALL_LARGE,
    ALL_SMALL,
    ANSWER,
    QUESTION,
    SURE,
    Gateway,
    _gateway,
    _request,
    embedder,
)

__all__ = ["embedder"]  # the module-scoped fixture, shared with tests/test_settled.py

WRONG = script("The answer is 41.", logprob=-0.1, alternatives=(-3.9,))


class Checking:
    """A gateway with shadow checks subscribed, and every record they made."""

    def __init__(self, gateway: Gateway, directory: Path, settings: ShadowSettings) -> None:
        self.gateway = gateway
        self.records: list[CheckRecord] = []
        self.store = FileOutcomes(directory / "outcomes.jsonl", max_bytes=1 << 20)
        self.checks = ShadowChecks(
            gateway.pipeline,
            self.store,
            settings,
            share_of=lambda _tenant, shortcut: settings.share_of(shortcut),
            recorded=self._recorded,
            rng=random.Random(7),
        )
        gateway.settlement.subscribe(gateway.pipeline.live.settled)
        gateway.settlement.subscribe(self.checks.settled)
        self.checks.start()

    def _recorded(self, record: CheckRecord) -> None:
        self.records.append(record)

    async def recorded(self, count: int) -> list[CheckRecord]:
        """The records, once every check drawn is over and the checks are closed: at
        least ``count`` of them."""
        async with asyncio.timeout(10):
            await self.checks.drained()
        await self.checks.close()
        assert len(self.records) >= count, self.records
        return self.records


async def _checking(
    parts: tuple[Embedder, Router],
    tmp_path: Path,
    small: ScriptedEngine,
    large: ScriptedEngine,
    **settings: object,
) -> Checking:
    shadow = msgspec.convert({"share": 1.0, **settings}, ShadowSettings)
    return Checking(_gateway(parts, small, large), tmp_path, shadow)


async def test_a_small_answer_is_checked_against_the_large_path_and_recorded(
    embedder: tuple[Embedder, Router], tmp_path: Path
) -> None:
    checking = await _checking(
        embedder, tmp_path, ScriptedEngine([SURE], name="small"),
        ScriptedEngine([WRONG], name="large"),
    )  # fmt: skip
    gateway = checking.gateway
    policy = gateway.policy(router_threshold=ALL_SMALL, loop=None)
    settled = await gateway.settled_for(await gateway.ask(_request("auto"), policy))
    assert settled.decision.route == "small"
    (record,) = await checking.recorded(1)
    assert (record.shortcut, record.status, record.source) == ("small_route", "checked", "shadow")
    assert record.probability == 1.0 and record.policy == settled.decision.policy == "shipped"
    assert record.answer == ANSWER and record.reference == "The answer is 41."
    assert record.reference_route == "large"
    assert (record.kind, record.answer_extracted, record.reference_extracted) == (
        "number",
        "42",
        "41",
    )
    assert record.agree is False
    # Kept in the store, whole, and never in the cache: the cached answer is the small one.
    assert await checking.store.read() == [record]
    assert gateway.pipeline.live.generating == 0


async def test_an_exact_hit_is_checked_against_the_engine_and_the_check_is_never_cached(
    embedder: tuple[Embedder, Router], tmp_path: Path
) -> None:
    small = ScriptedEngine([SURE, WRONG], name="small")
    checking = await _checking(
        embedder, tmp_path, small, ScriptedEngine([SURE], name="large"),
        shares={"small_route": 0.0},
    )  # fmt: skip
    gateway = checking.gateway
    policy = gateway.policy()
    await gateway.settled_for(await gateway.ask(_request(), policy))  # cached
    hit = await gateway.settled_for(await gateway.ask(_request(), policy))
    assert hit.decision.cache == "exact"
    (record,) = await checking.recorded(1)
    assert (record.shortcut, record.reference, record.agree) == ("exact_hit", WRONG.text, False)
    # The cache still serves the answer it kept, not the check's.
    again = await gateway.settled_for(await gateway.ask(_request(), policy))
    assert again.decision.cache == "exact" and again.answer is not None
    assert again.answer.texts == (ANSWER,)
    assert len(small.calls) == 2  # the first answer and the check's, nothing more


async def test_the_share_draws_at_random_and_records_its_probability(
    embedder: tuple[Embedder, Router], tmp_path: Path
) -> None:
    checking = await _checking(
        embedder, tmp_path, ScriptedEngine([SURE], name="small"),
        ScriptedEngine([SURE], name="large"), share=0.0, shares={"small_route": 0.5},
    )  # fmt: skip
    gateway = checking.gateway
    policy = gateway.policy(
        router_threshold=ALL_SMALL, loop=None, control=CacheControl(lookup=False, store=False)
    )
    for _ in range(20):  # each check runs in the quiet before the next request
        await gateway.settled_for(await gateway.ask(_request("auto"), policy))
        async with asyncio.timeout(10):
            await checking.checks.drained()
    await checking.checks.close()
    drawn = checking.records
    assert 3 <= len(drawn) <= 17  # 20 draws at 0.5 (seeded)
    assert {(r.probability, r.shortcut, r.agree) for r in drawn} == {(0.5, "small_route", True)}


async def _early_stops(
    embedder: tuple[Embedder, Router], tmp_path: Path
) -> tuple[Checking, ScriptedEngine, Policy]:
    """Checks of early stops only, on a gateway whose every question is hard and whose
    large engine is sure: its checking, its large engine, and the policy to ask with."""
    large = ScriptedEngine([SURE], name="large")
    checking = await _checking(
        embedder, tmp_path, ScriptedEngine([SURE], name="small"), large,
        shares={"large_route": 0.0},
    )  # fmt: skip
    policy = checking.gateway.policy(
        router_threshold=ALL_LARGE, control=CacheControl(lookup=False, store=False)
    )
    return checking, large, policy


async def test_an_early_stop_is_checked_against_the_loop_run_on_to_its_budget(
    embedder: tuple[Embedder, Router], tmp_path: Path
) -> None:
    checking, large, policy = await _early_stops(embedder, tmp_path)
    gateway = checking.gateway
    settled = await gateway.settled_for(await gateway.ask(_request("auto"), policy))
    assert settled.decision.loop is not None and settled.decision.loop.stop == "confident"
    assert len(settled.decision.loop.rounds) == 1
    (record,) = await checking.recorded(1)
    assert (record.shortcut, record.reference_route, record.agree) == (
        "early_stop", "loop_to_budget", True,
    )  # fmt: skip
    assert record.stop == "confident" and record.confidence is not None
    # The check ran every round the live request's loop skipped: 2 rounds of 2 branches.
    assert len(large.calls) == 2 + 4


async def test_a_greedy_first_stop_is_checked_against_the_loop_without_it(
    embedder: tuple[Embedder, Router], tmp_path: Path
) -> None:
    checking, large, policy = await _early_stops(embedder, tmp_path)
    gateway = checking.gateway
    assert policy.loop is not None
    policy = msgspec.structs.replace(
        policy, loop=msgspec.structs.replace(policy.loop, greedy_first=True)
    )
    settled = await gateway.settled_for(await gateway.ask(_request("auto"), policy))
    loop = settled.decision.loop
    assert loop is not None and loop.stop == "greedy"
    assert [r.greedy for r in loop.rounds] == [True]
    (record,) = await checking.recorded(1)
    assert (record.shortcut, record.agree, record.stop) == ("early_stop", True, "greedy")
    # The greedy pass that stopped the live loop would stop its reference at once too:
    # the check runs the loop's rounds without it, 2 rounds of 2 branches.
    assert len(large.calls) == 1 + 4
    assert all(c.params.temperature > 0 for c in large.calls[1:])


async def test_a_large_answer_is_checked_against_the_small_engine_for_the_router_to_learn(
    embedder: tuple[Embedder, Router], tmp_path: Path
) -> None:
    small = ScriptedEngine([WRONG], name="small")
    checking = await _checking(embedder, tmp_path, small, ScriptedEngine([SURE], name="large"))
    gateway = checking.gateway
    policy = gateway.policy(
        router_threshold=ALL_LARGE, loop=None, control=CacheControl(lookup=False, store=False)
    )
    settled = await gateway.settled_for(await gateway.ask(_request("auto"), policy))
    assert settled.decision.route == "large"
    # A request that named its engine took no route, and is not drawn.
    await gateway.settled_for(await gateway.ask(_request("large"), policy))
    (record,) = await checking.recorded(1)
    assert (record.shortcut, record.reference_route, record.agree) == (
        "large_route",
        "small",
        False,
    )
    assert record.difficulty is not None and len(small.calls) == 1


async def test_a_live_request_stops_a_running_check_at_once(
    embedder: tuple[Embedder, Router], tmp_path: Path
) -> None:
    slow = script("The answer is 42, after a long think " * 20, seconds_per_token=0.02)
    large = ScriptedEngine([slow], name="large", concurrency=1)
    checking = await _checking(
        embedder, tmp_path, ScriptedEngine([SURE], name="small"), large,
        shares={"small_route": 1.0, "exact_hit": 0.0},
    )  # fmt: skip
    gateway = checking.gateway
    policy = gateway.policy(router_threshold=ALL_SMALL, loop=None)
    await gateway.settled_for(await gateway.ask(_request("auto"), policy))
    async with asyncio.timeout(5):  # the check begins on the large engine
        while not large.calls:  # noqa: ASYNC110
            await asyncio.sleep(0.005)
    started = time.monotonic()
    live = msgspec.structs.replace(policy, control=CacheControl(lookup=False, store=False))
    answered = await gateway.settled_for(await gateway.ask(_request("large"), live))
    # The live request waited for no check: its own answer takes len(slow.tokens) tokens
    # of 0.02 s, and waiting for the check's whole answer first would have doubled that.
    assert answered.status == 200
    assert time.monotonic() - started < 2 * 0.02 * len(slow.tokens)
    records = await checking.recorded(1)
    assert [(r.shortcut, r.status, r.reason) for r in records[:1]] == [
        ("small_route", "dropped", "preempted")
    ]


async def test_a_full_queue_drops_and_says_so(
    embedder: tuple[Embedder, Router], tmp_path: Path
) -> None:
    checking = await _checking(
        embedder, tmp_path, ScriptedEngine([SURE], name="small"),
        ScriptedEngine([SURE], name="large"), max_queue=1, max_live=0,
    )  # fmt: skip
    gateway = checking.gateway
    policy = gateway.policy(
        router_threshold=ALL_SMALL, loop=None, control=CacheControl(lookup=False, store=False)
    )
    # While a live request generates, no check starts: the first one drawn waits for
    # room, the second in the queue, and the third finds the queue full.
    gateway.pipeline.live.begin()
    for _ in range(3):
        await gateway.settled_for(await gateway.ask(_request("auto"), policy))
    await asyncio.sleep(0.05)
    assert [r.reason for r in checking.records] == ["queue_full"]
    await checking.checks.close()
    assert [r.reason for r in checking.records] == ["queue_full", "stopped", "stopped"]
    shortcuts: set[Shortcut | None] = {r.shortcut for r in checking.records}
    assert shortcuts == {"small_route"}


async def test_a_record_keeps_a_bounded_share_of_a_huge_prompt_and_answer(
    embedder: tuple[Embedder, Router], tmp_path: Path
) -> None:
    long_answer = script("The answer is 42. " + "More words. " * 2000)
    checking = await _checking(
        embedder, tmp_path, ScriptedEngine([long_answer], name="small"),
        ScriptedEngine([long_answer], name="large"),
    )  # fmt: skip
    gateway = checking.gateway
    policy = gateway.policy(router_threshold=ALL_SMALL, loop=None)
    request = msgspec.structs.replace(
        _request("auto", text=QUESTION + " Explain. " * 3000),
        params=SamplingParams(max_tokens=10_000, temperature=0.0),
    )
    await gateway.settled_for(await gateway.ask(request, policy))
    (record,) = await checking.recorded(1)
    assert record.status == "checked" and record.agree is True  # compared whole
    assert len(record.prompt) == len(record.answer) == len(record.reference or "") == KEPT_CHARS
