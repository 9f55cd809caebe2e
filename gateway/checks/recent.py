"""The answers a replica gave lately, so that a verdict on one can name it by the
request id it came with (POST /v1/feedback)."""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict

import msgspec

from gateway.checks.record import KEPT_CHARS, CheckRecord
from gateway.checks.shadow import shortcuts_taken
from gateway.config.shadow import Shortcut
from gateway.pipeline.exchange import Settled

# Answers remembered per tenant and replica: a few KB each at most (texts are cut), so
# a tenant's memory stays under ~50 MB; per tenant, so one tenant's traffic never
# pushes out another's.
RECENT_ANSWERS_PER_TENANT = 5_000


class Answered(msgspec.Struct, frozen=True, kw_only=True):
    """What a verdict on an answer is recorded with."""

    route: str
    model: str
    shortcut: Shortcut | None
    prompt: str
    answer: str
    confidence: float | None
    difficulty: float | None
    similarity: float | None
    cache_score: float | None
    stop: str | None
    policy: str  # the policy version that decided it


class RecentAnswers:
    """Each tenant's last answers on this replica, by request id; oldest forgotten first.
    A settlement subscriber, on every request's way out: it keeps each answer as one
    tuple of plain values, not the decision itself, whose loop trace may hold every
    branch of every round."""

    def __init__(self, capacity: int = RECENT_ANSWERS_PER_TENANT) -> None:
        self.capacity = capacity
        self._answers: dict[str, OrderedDict[str, tuple[object, ...]]] = {}

    def settled(self, settled: Settled) -> None:
        answer, request, rid = settled.answer, settled.request, settled.request_id
        if settled.status != 200 or answer is None or request is None or rid is None:
            return
        decision = settled.decision
        answers = self._answers.get(decision.tenant)
        if answers is None:
            answers = self._answers[decision.tenant] = OrderedDict()
        trace = decision.loop
        answers[rid] = (
            decision.route,
            decision.model,
            next(iter(shortcuts_taken(decision)), None),
            request.last_user_turn[:KEPT_CHARS],
            answer.texts[0][:KEPT_CHARS] if answer.texts else "",
            decision.confidence,
            decision.difficulty,
            decision.similarity,
            decision.cache_score,
            None if trace is None else trace.stop,
            decision.policy,
        )
        answers.move_to_end(rid)
        if len(answers) > self.capacity:
            answers.popitem(last=False)

    def get(self, tenant: str, request_id: str) -> Answered | None:
        answers = self._answers.get(tenant)
        kept = None if answers is None else answers.get(request_id)
        if kept is None:
            return None
        # The tuple is Answered's fields in their order (tests/test_recent_answers.py).
        return msgspec.convert(dict(zip(Answered.__struct_fields__, kept, strict=True)), Answered)


def verdict_record(tenant: str, request_id: str, verdict: str, answered: Answered) -> CheckRecord:
    """A caller's verdict on an answer, as the outcome store keeps it: under the policy
    version that decided the answer, not one put in force since."""
    return CheckRecord(
        id=uuid.uuid4().hex,
        at=time.time(),
        source="feedback",
        tenant=tenant,
        request_id=request_id,
        shortcut=answered.shortcut,
        route=answered.route,
        model=answered.model,
        probability=1.0,
        policy=answered.policy,
        prompt=answered.prompt,
        answer=answered.answer,
        confidence=answered.confidence,
        difficulty=answered.difficulty,
        similarity=answered.similarity,
        cache_score=answered.cache_score,
        stop=answered.stop,
        verdict="right" if verdict == "right" else "wrong",
    )
