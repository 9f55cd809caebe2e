"""One checked decision: what the outcome store keeps, one record per line or entry."""

from __future__ import annotations

from typing import Literal

import msgspec

from gateway.config.shadow import Shortcut

# The longest text (prompt, earlier turns, either answer) a record keeps, in characters:
# a record stays a few KB whatever a client sends, so the store's bound in records is
# a bound in bytes too. The comparator sees the whole answers.
KEPT_CHARS = 4_000

# checked: both answers are in and compared; dropped: sampled, but the engines had no
# spare capacity (or the check waited too long, or live traffic preempted it); failed:
# the reference path raised. Only checked records count in estimates; the others say
# how much of the sample was lost, and why.
CheckStatus = Literal["checked", "dropped", "failed"]

# shadow: drawn at random by the gateway; feedback: a verdict a caller sent on a
# response (POST /v1/feedback), which is not a random sample.
Source = Literal["shadow", "feedback"]


class CheckRecord(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A shortcut and what the path it skipped said; or a caller's verdict on an answer."""

    id: str  # unique: a uuid4's hex
    at: float  # unix seconds, when the record was made
    source: Source
    status: CheckStatus = "checked"
    reason: str | None = None  # why dropped or failed
    tenant: str
    request_id: str | None = None
    shortcut: Shortcut | None = None  # None: feedback on an answer that took none
    route: str  # the decision's route: exact, semantic, small, large, loop, fallback, ...
    model: str  # the name the client asked for
    # The probability with which this request was drawn for checking, given its
    # shortcut and tenant (a Horvitz-Thompson weight is 1/probability). 1.0 for feedback.
    probability: float
    policy: str  # the policy version that decided
    prompt: str  # the last user turn
    context: str | None = None  # the turns before it (role: text, a line each), if any
    answer: str  # the shortcut's answer, as served
    reference: str | None = None  # the skipped path's answer
    reference_route: str | None = None  # what answered it: large, loop, loop_to_budget, ...
    reference_tokens: int | None = None
    reference_ms: float | None = None
    # The comparator's: the answer kind it compared as (number, choice, yesno, text),
    # each side's extracted answer and whether they agree (None: it could not tell).
    kind: str | None = None
    answer_extracted: str | None = None
    reference_extracted: str | None = None
    agree: bool | None = None
    # What the shortcut was decided on.
    confidence: float | None = None  # the evaluator's calibrated P(correct)
    difficulty: float | None = None  # the router's score
    similarity: float | None = None  # a semantic hit's
    cache_score: float | None = None  # the verifier's P(same answer)
    stop: str | None = None  # the loop's stop reason
    # A caller's verdict (feedback): the answer was right or wrong.
    verdict: Literal["right", "wrong"] | None = None
