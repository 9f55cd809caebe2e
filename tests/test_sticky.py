"""Conversations that stay where they escalated: once a turn is answered by the large
path, the conversation's next turns stay there for the configured turns and time, and
their decisions say so. Through the pipeline, on the bundled models."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import msgspec
import pytest

from engines.base import Message
from gateway.api.validate import chat_request
from gateway.api.wire import ChatCompletionRequest, ChatMessage
from gateway.config import parse_config
from gateway.pipeline.outcome import Decision
from gateway.pipeline.request_policy import CacheControl, Policy, resolve
from gateway.pipeline.sticky import Escalations, Stickiness, first_turn_key
from gateway.runtime import Runtime
from tests.support import exchange_for

# No cache (each turn is answered afresh); the router's threshold is set per turn in
# the policy: 0 sends a turn large, 1.5 small.
CONFIG = """
router: {model_file: bundled, sticky_turns: 2, sticky_s: 600}
loop: {calibrator: bundled, escalate_below: 0.000001, max_rounds: 1, branches: 2,
       round_tokens: 8}
engines:
  small: {backend: llama_cpp, model: smollm2-135m-instruct}
  large:
    backend: llama_cpp
    model: gemma3-270m
    template: {preamble: "", stop: ["\\n"]}
"""
LARGE, SMALL = 0.0, 1.5


@pytest.fixture(scope="module")
async def runtime() -> AsyncIterator[Runtime]:
    runtime = Runtime(parse_config(CONFIG))
    await runtime.start()
    assert runtime.ready, runtime.failure
    yield runtime
    await runtime.close()


async def _turn(
    runtime: Runtime,
    turns: list[str],
    threshold: float,
    *,
    conversation: str | None,
    tenant: str = "default",
    **changes: object,
) -> Decision:
    """One turn of a conversation whose user said ``turns`` (each answered "ok"),
    routed with ``threshold``, the policy changed by ``changes``; its decision."""
    messages = [ChatMessage("system", "Be brief.")]
    for i, said in enumerate(turns):
        messages.append(ChatMessage("user", said))
        if i < len(turns) - 1:
            messages.append(ChatMessage("assistant", "ok"))
    wire = ChatCompletionRequest(model="auto", messages=messages, max_tokens=4, temperature=0)
    request = chat_request(wire, runtime.engines, routing=True, limits=runtime.config.server)
    policy = resolve(
        runtime.config,
        tenant,
        arrived=time.monotonic(),
        control=CacheControl(lookup=False, store=False),
        conversation=conversation,
    )
    # No loop unless a test gives one: a large route is then one pass, "large".
    changes = {"loop": None, **changes}
    policy = msgspec.structs.replace(policy, router_threshold=threshold, **changes)
    exchange = exchange_for(runtime, request, tenant)
    answering = await runtime.pipeline.run(request, policy, exchange)
    _ = [event async for event in answering.events]
    exchange.end(200)
    return exchange.decision


async def test_a_conversation_stays_large_for_its_turns_then_is_routed_again(
    runtime: Runtime,
) -> None:
    said = ["Prove Fermat's last theorem."]
    first = await _turn(runtime, said, LARGE, conversation="c-1")
    assert first.route == "large" and first.sticky is None
    for turn in (2, 3):  # sticky_turns: 2
        said.append(f"Thanks. And turn {turn}?")
        decision = await _turn(runtime, said, SMALL, conversation="c-1")
        assert decision.route == "large" and decision.engine == "large"
        assert decision.sticky == "large"
        assert decision.difficulty is not None  # the router's own score is still shown
    said.append("And now?")
    fourth = await _turn(runtime, said, SMALL, conversation="c-1")
    assert fourth.route == "small" and fourth.sticky is None


async def test_a_turn_routed_large_again_renews_the_stay(runtime: Runtime) -> None:
    await _turn(runtime, ["Hard."], LARGE, conversation="c-renew")
    assert (await _turn(runtime, ["Hard.", "Easy."], SMALL, conversation="c-renew")).sticky
    await _turn(runtime, ["Hard.", "Easy.", "Hard again."], LARGE, conversation="c-renew")
    for n in (4, 5):
        decision = await _turn(runtime, ["Hard."] * n, SMALL, conversation="c-renew")
        assert decision.sticky == "large"
    assert (await _turn(runtime, ["Hard."] * 6, SMALL, conversation="c-renew")).route == "small"


async def test_other_conversations_and_tenants_are_routed_on_their_own(runtime: Runtime) -> None:
    await _turn(runtime, ["Hard."], LARGE, conversation="c-own")
    assert (await _turn(runtime, ["Easy."], SMALL, conversation="c-other")).route == "small"
    other_tenant = await _turn(runtime, ["Easy."], SMALL, conversation="c-own", tenant="t2")
    assert other_tenant.route == "small" and other_tenant.sticky is None
    assert (await _turn(runtime, ["Easy."], SMALL, conversation=None)).route == "small"


async def test_a_turn_escalated_from_the_small_engine_makes_the_conversation_stay(
    runtime: Runtime,
) -> None:
    loop = runtime.config.loop
    assert loop is not None
    always = msgspec.structs.replace(loop, escalate_below=1.0)
    first = await _turn(runtime, ["What is 2+2?"], SMALL, conversation="c-esc", loop=always)
    assert first.route in ("loop", "fallback") and first.escalated_from == "small"
    second = await _turn(
        runtime, ["What is 2+2?", "And 3+3?"], SMALL, conversation="c-esc", loop=loop
    )
    assert second.sticky == "large" and second.route in ("loop", "fallback")


async def test_a_conversation_known_by_its_first_turn(runtime: Runtime) -> None:
    said = [f"Opening question {time.time_ns()}"]
    first = await _turn(runtime, said, LARGE, conversation=None, sticky_by_first_turn=True)
    assert first.route == "large"
    said.append("Follow-up.")
    follow = await _turn(runtime, said, SMALL, conversation=None, sticky_by_first_turn=True)
    assert follow.sticky == "large"
    # The header way alone does not know it.
    said.append("Again.")
    assert (await _turn(runtime, said, SMALL, conversation=None)).route == "small"


async def test_stickiness_off_for_a_tenant_routes_every_turn_alone(runtime: Runtime) -> None:
    await _turn(runtime, ["Hard."], LARGE, conversation="c-off", stickiness=None)
    again = await _turn(runtime, ["Hard.", "x"], SMALL, conversation="c-off", stickiness=None)
    assert again.sticky is None


def test_a_tenant_can_turn_it_off_or_change_it() -> None:
    config = parse_config(
        CONFIG + "tenants:\n  quiet: {sticky_turns: 0}\n  long: {sticky_turns: 9, sticky_s: 5}\n"
    )
    arrived = time.monotonic()
    assert resolve(config, "default", arrived=arrived).stickiness == Stickiness(2, 600.0)
    assert resolve(config, "quiet", arrived=arrived).stickiness is None
    assert resolve(config, "long", arrived=arrived).stickiness == Stickiness(9, 5.0)
    assert isinstance(resolve(config, "long", arrived=arrived), Policy)


def test_the_stay_ends_with_its_time_and_the_oldest_are_forgotten_first() -> None:
    now = [0.0]
    held = Escalations(max_conversations=2, clock=lambda: now[0])
    held.escalated("a", Stickiness(turns=5, seconds=10))
    now[0] = 9.9
    assert held.stays("a")
    now[0] = 10.0
    assert not held.stays("a")
    for name in ("b", "c", "d"):
        held.escalated(name, Stickiness(turns=1, seconds=10))
    assert len(held) == 2 and not held.stays("b") and held.stays("c") and held.stays("d")
    assert not held.stays("c")  # its one turn is used


def test_the_first_turn_names_a_conversation_within_its_tenant() -> None:
    opening = [Message("system", "s"), Message("user", "q")]
    later = [*opening, Message("assistant", "a"), Message("user", "q2")]
    assert first_turn_key("t", opening) == first_turn_key("t", later)
    assert first_turn_key("t", opening) != first_turn_key("u", opening)
    assert first_turn_key("t", [Message("system", "s")]) is None
