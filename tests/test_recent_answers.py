"""The answers a replica remembers for verdicts come back whole and by name: they are
kept as plain tuples in Answered's field order, which a reordered field would break."""

from __future__ import annotations

import time

from engines.base import Message, SamplingParams
from evaluator.loop import LoopTrace
from gateway.checks.recent import Answered, RecentAnswers
from gateway.config import load_config
from gateway.pipeline.exchange import Served, Settled
from gateway.pipeline.outcome import Decision
from gateway.pipeline.request import ChatRequest
from gateway.pipeline.request_policy import resolve


def _settled(request_id: str, decision: Decision, status: int = 200) -> Settled:
    config = load_config()
    request = ChatRequest(
        model=decision.model, messages=(Message("user", "What is 6 * 7?"),),
        params=SamplingParams(max_tokens=16), include_usage=False, prompt_tokens=4,
    )  # fmt: skip
    return Settled(
        request_id=request_id, key=None, request=request,
        policy=resolve(config, decision.tenant, arrived=time.monotonic()), decision=decision,
        answer=Served(texts=("42",), finish_reasons=("stop",)), status=status, error=None,
        seconds=0.1, ended=time.monotonic(), first_byte_s=None, kept=None,
    )  # fmt: skip


def test_an_answer_comes_back_with_every_field_by_name() -> None:
    trace = LoopTrace(
        kind="number", rounds=[], stop="confident", fallback="none", confidence=0.93,
        tokens=10, probe_tokens=0, deadline_ms=None, elapsed_ms=5.0,
    )  # fmt: skip
    decision = Decision(
        tenant="acme", model="auto", route="loop", cache="miss", difficulty=0.7,
        confidence=0.93, similarity=0.5, cache_score=0.2, loop=trace, policy="p-1",
    )  # fmt: skip
    recent = RecentAnswers(capacity=2)
    recent.settled(_settled("r1", decision))
    assert recent.get("acme", "r1") == Answered(
        route="loop", model="auto", shortcut="early_stop", prompt="What is 6 * 7?",
        answer="42", confidence=0.93, difficulty=0.7, similarity=0.5, cache_score=0.2,
        stop="confident", policy="p-1",
    )  # fmt: skip
    assert recent.get("other-tenant", "r1") is None


def test_the_oldest_is_forgotten_and_failures_are_not_kept() -> None:
    decision = Decision(tenant="t", model="small", route="small", cache="miss")
    recent = RecentAnswers(capacity=2)
    for rid in ("a", "b", "c"):
        recent.settled(_settled(rid, decision))
    recent.settled(_settled("failed", decision, status=500))
    assert [recent.get("t", rid) is not None for rid in ("a", "b", "c", "failed")] == [
        False, True, True, False,
    ]  # fmt: skip
