"""``Decision.view()`` fills the view's fields by position, for speed: every field of a
decision reaches the view field of its name (a reordered field would not)."""

from __future__ import annotations

import msgspec

from evaluator.loop import BranchTrace, LoopTrace, RoundTrace
from gateway.pipeline.outcome import Decision, DecisionView


def _round(branches: int) -> RoundTrace:
    branch = BranchTrace(answer="4", tokens=3, finish_reason="stop", confidence=0.5)
    return RoundTrace(
        round=1, branches=[branch] * branches, answer="4", probability=0.7, tokens=9, seconds=0.1
    )


def test_every_field_reaches_its_name() -> None:
    trace = LoopTrace(
        kind="number",
        rounds=[_round(2), _round(3)],
        stop="confident",
        fallback="best",
        confidence=0.91,
        tokens=77,
        probe_tokens=5,
        deadline_ms=None,
        elapsed_ms=12.0,
    )
    decision = Decision(
        tenant="t",
        model="m",
        route="loop",
        cache="miss",
        cache_entry=12345678901234567890,
        similarity=0.11,
        cache_score=0.22,
        cache_stage="verifier",
        difficulty=0.33,
        engine="large",
        failover="spare",
        escalated_from="small",
        confidence=0.44,
        loop=trace,
        superseded_ms=5.5,
        deadline=99.0,
        engine_s=0.25,
        policy="p-1",
        single_pass="tools",
        sticky="large",
    )
    assert msgspec.structs.asdict(decision.view()) == {
        "tenant": "t",
        "model": "m",
        "route": "loop",
        "cache": "miss",
        "cache_stage": "verifier",
        "cache_entry": "12345678901234567890",
        "similarity": 0.11,
        "cache_score": 0.22,
        "difficulty": 0.33,
        "engine": "large",
        "failover": "spare",
        "escalated_from": "small",
        "confidence": 0.44,
        "superseded_ms": 5.5,
        "engine_ms": 250.0,
        "stop": "confident",
        "fallback": "best",
        "rounds": 2,
        "branches": 5,
        "tokens": 77,
        "policy": "p-1",
        "single_pass": "tools",
        "sticky": "large",
    }


def test_a_plain_decision_shows_only_what_it_has() -> None:
    view = Decision(tenant="t", model="m").view()
    assert msgspec.to_builtins(view) == {
        "tenant": "t", "model": "m", "route": "error", "cache": "off", "policy": "shipped"
    }  # fmt: skip
    assert set(msgspec.structs.asdict(view)) == set(DecisionView.__struct_fields__)
