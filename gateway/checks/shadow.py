"""Shadow checks: a random share of the shortcuts the gateway took, answered again in
the background by the path each skipped, compared, and kept in the outcome store.

A request is drawn when it settles, with the probability its tenant's share of its
shortcut gives; that probability goes into its record, so estimates over the records
are unbiased and logged traffic can be re-weighed offline. Checks never delay live
traffic: a drawn check waits in a bounded queue (one more is dropped) until no more
than ``max_live`` live requests are generating, and a live request that begins while a
check runs stops it at once (dropped: preempted). Every drop is counted and recorded
with its reason. A reference answer is never served or cached (``Pipeline.reference``).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import Callable

import msgspec

from engines.base import EngineOverloaded
from evaluator.agreement import Agreement, compare
from gateway.checks.record import KEPT_CHARS, CheckRecord, CheckStatus
from gateway.checks.store import OutcomeStore
from gateway.config.shadow import ShadowSettings, Shortcut
from gateway.pipeline.exchange import Settled
from gateway.pipeline.outcome import Decision
from gateway.pipeline.pipeline import Pipeline, Reference
from gateway.pipeline.request import ChatRequest
from router.router import Tier

log = logging.getLogger("satisfice.checks")


def shortcuts_of(settled: Settled) -> tuple[Shortcut, ...]:
    """The shortcuts a settled request's answer took (each drawn for a check on its
    own), when a check can judge its answer: a whole, single answer, served with 200."""
    answer, request = settled.answer, settled.request
    if settled.status != 200 or answer is None or request is None or settled.policy is None:
        return ()
    if len(answer.texts) != 1 or answer.finish_reasons != ("stop",):
        return ()
    if request.params.tools is not None:  # the comparator reads text, not tool calls
        return ()
    return shortcuts_taken(settled.decision)


def shortcuts_taken(decision: Decision) -> tuple[Shortcut, ...]:
    """The shortcuts ``decision`` took, whatever became of its answer."""
    if decision.cache == "exact":
        return ("exact_hit",)
    if decision.cache == "semantic":
        return ("semantic_hit",)
    if decision.difficulty is None:  # the client named its engine: nothing was routed
        return ()
    trace = decision.loop
    if trace is not None and trace.fallback != "none":
        return ("deadline_fallback",)
    if trace is not None and trace.stop in ("confident", "no_gain", "greedy"):
        return ("early_stop", "large_route")
    if decision.route in ("loop", "large"):
        return ("large_route",)
    if decision.route == "small" and decision.escalated_from is None:
        return ("small_route",)
    return ()


# The tier that answers a check of each shortcut (None: as the router decides).
_REFERENCE_TIER: dict[Shortcut, Tier | None] = {
    "semantic_hit": None,
    "exact_hit": None,
    "small_route": "large",
    "early_stop": "large",
    "deadline_fallback": "large",
    "large_route": "small",
}


class Drawn(msgspec.Struct, frozen=True):
    """A request drawn for a check, and with what probability."""

    settled: Settled
    shortcut: Shortcut
    probability: float
    drawn_at: float  # time.monotonic()


class ShadowChecks:
    """The sampler (a subscriber to settled requests) and the background worker that
    runs its checks on the capacity live requests leave free."""

    def __init__(
        self,
        pipeline: Pipeline,
        store: OutcomeStore,
        settings: ShadowSettings,
        *,
        share_of: Callable[[str, Shortcut], float],
        recorded: Callable[[CheckRecord], None],
        rng: random.Random | None = None,
    ) -> None:
        self._pipeline = pipeline
        self._store = store
        self.settings = settings
        self.share_of = share_of  # the tenant's share of a shortcut, as configured now
        self._recorded = recorded  # told of every record (metrics)
        self._rng = rng or random.Random()
        # Bounded by settings.max_queue as it is when a check is drawn (a reload may
        # change it), not by the queue itself.
        self._queue: asyncio.Queue[Drawn] = asyncio.Queue()
        # Set when live work or a check ends or begins: the worker looks for room again.
        self._changed = asyncio.Event()
        self._running: dict[asyncio.Task[None], Drawn] = {}
        self._preempted: set[asyncio.Task[None]] = set()
        self._writes: set[asyncio.Task[None]] = set()
        self._worker: asyncio.Task[None] | None = None
        self._next: Drawn | None = None  # taken from the queue, waiting for room
        pipeline.live.watch(self._live_changed)

    # -- drawing -------------------------------------------------------------------

    def settled(self, settled: Settled) -> None:
        """A settlement subscriber: draw the request for a check, or not."""
        for shortcut in shortcuts_of(settled):
            share = self.share_of(settled.decision.tenant, shortcut)
            if share <= 0.0 or self._rng.random() >= share:
                continue
            drawn = Drawn(settled, shortcut, share, time.monotonic())
            if self._worker is None:
                self._dropped(drawn, "stopped")
            elif self._queue.qsize() >= self.settings.max_queue:
                self._dropped(drawn, "queue_full")
            else:
                self._queue.put_nowait(drawn)

    # -- running ---------------------------------------------------------------------

    def start(self) -> None:
        self._worker = asyncio.get_running_loop().create_task(self._work())

    async def close(self) -> None:
        """Stop the worker and any check under way; what was drawn and not checked is
        recorded as dropped (stopped), and the records being written are waited for."""
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.cancel()
            await asyncio.gather(worker, return_exceptions=True)
        for task in list(self._running):
            task.cancel()
        await asyncio.gather(*self._running, return_exceptions=True)
        if self._next is not None:
            self._dropped(self._next, "stopped")
            self._next = None
        while not self._queue.empty():
            self._dropped(self._queue.get_nowait(), "stopped")
        if self._writes:
            await asyncio.wait(self._writes, timeout=5)

    @property
    def pending(self) -> int:
        """Checks drawn and not yet recorded: queued, waiting for room, or running."""
        return self._queue.qsize() + len(self._running) + (self._next is not None)

    async def drained(self) -> None:
        """Return once no check drawn is pending (for benchmarks and tests)."""
        while self.pending:
            self._changed.clear()
            await self._changed.wait()

    def _live_changed(self, generating: int) -> None:
        """Live requests began or settled: checks wait, or go on; a live request that
        begins while checks run stops them (their engines' slots are the live one's)."""
        self._changed.set()
        if generating <= self.settings.max_live:
            return
        for task in self._running:
            if task not in self._preempted:
                self._preempted.add(task)
                task.cancel()

    async def _work(self) -> None:
        while True:
            self._next = drawn = await self._queue.get()
            while not self._room():
                self._changed.clear()
                await self._changed.wait()
            self._next = None
            if time.monotonic() - drawn.drawn_at > self.settings.max_wait_s:
                self._dropped(drawn, "stale")
                continue
            task = asyncio.get_running_loop().create_task(self._check(drawn))
            self._running[task] = drawn
            task.add_done_callback(self._ended)

    def _room(self) -> bool:
        """Whether a check may start now: few enough live requests generate, and
        fewer checks run than ``concurrency``."""
        settings = self.settings
        return (
            self._pipeline.live.generating <= settings.max_live
            and len(self._running) < settings.concurrency
        )

    def _ended(self, task: asyncio.Task[None]) -> None:
        self._running.pop(task, None)
        self._preempted.discard(task)
        self._changed.set()

    async def _check(self, drawn: Drawn) -> None:
        started = time.monotonic()
        task = asyncio.current_task()
        try:
            reference = await self._reference(drawn, started)
        except asyncio.CancelledError:
            if task in self._preempted:
                self._preempted.discard(task)
                self._dropped(drawn, "preempted")
                return
            self._dropped(drawn, "stopped")
            raise
        except EngineOverloaded:  # live requests fill the engine's queue after all
            self._dropped(drawn, "busy")
            return
        except Exception as exc:  # the reference path failed: the check says why
            self._record(drawn, "failed", reason=f"{type(exc).__name__}: {exc}"[:300])
            return
        self._compared(drawn, reference, (time.monotonic() - started) * 1000)

    async def _reference(self, drawn: Drawn, started: float) -> Reference:
        """The skipped path's answer: the engine's for a cache hit, the large path's for
        a small engine's answer, the loop on to its budget for an early stop, the loop
        with no deadline but the check's own for a fallback, and the small engine's
        for the large path's answer."""
        settled = drawn.settled
        request, policy = settled.request, settled.policy
        assert request is not None and policy is not None
        timeout_ms = round(self.settings.timeout_s * 1000)
        loop = policy.loop
        if drawn.shortcut == "early_stop" and loop is not None:
            # No greedy_first pass either: greedy_stop would stop the reference where
            # the checked loop stopped, and always agree with it.
            loop = msgspec.structs.replace(loop, threshold=1.0, min_gain=None, greedy_first=False)
        reference_policy = msgspec.structs.replace(
            policy,
            arrived=started,
            deadline_ms=dict.fromkeys(policy.deadline_ms, timeout_ms),
            loop=loop,
        )
        tier = _REFERENCE_TIER[drawn.shortcut]
        async with asyncio.timeout(self.settings.timeout_s):
            return await self._pipeline.reference(request, reference_policy, tier=tier)

    # -- recording -------------------------------------------------------------------

    def _compared(self, drawn: Drawn, reference: Reference, ms: float) -> None:
        request, answer = drawn.settled.request, drawn.settled.answer
        assert request is not None and answer is not None
        agreement = compare(request.last_user_turn, answer.texts[0], reference.text)
        self._record(drawn, "checked", checked=Checked(reference, agreement, ms))

    def _dropped(self, drawn: Drawn, reason: str) -> None:
        self._record(drawn, "dropped", reason=reason)

    def _record(
        self,
        drawn: Drawn,
        status: CheckStatus,
        *,
        reason: str | None = None,
        checked: Checked | None = None,
    ) -> None:
        record = record_of(drawn, status, reason=reason, checked=checked)
        self._recorded(record)
        self._changed.set()
        write = asyncio.get_running_loop().create_task(self._write(record))
        self._writes.add(write)
        write.add_done_callback(self._writes.discard)

    async def _write(self, record: CheckRecord) -> None:
        try:
            await self._store.add(record)
        except Exception:
            log.exception("a check's record could not be written to the outcome store")


class Checked(msgspec.Struct, frozen=True):
    """What a check found: the skipped path's answer, how it compares, how long it took."""

    reference: Reference
    agreement: Agreement
    ms: float


def record_of(
    drawn: Drawn,
    status: CheckStatus,
    *,
    reason: str | None = None,
    checked: Checked | None = None,
) -> CheckRecord:
    """The record of a drawn check: the request's side, and what the check found."""
    settled = drawn.settled
    request, answer, decision = settled.request, settled.answer, settled.decision
    assert request is not None and answer is not None
    trace = decision.loop
    record = CheckRecord(
        id=uuid.uuid4().hex,
        at=time.time(),
        source="shadow",
        status=status,
        reason=reason,
        tenant=decision.tenant,
        request_id=settled.request_id,
        shortcut=drawn.shortcut,
        route=decision.route,
        model=decision.model,
        probability=drawn.probability,
        # The version that decided the shortcut, not one put in force since.
        policy=decision.policy,
        prompt=request.last_user_turn[:KEPT_CHARS],
        context=_context_of(request),
        answer=answer.texts[0][:KEPT_CHARS],
        confidence=decision.confidence,
        difficulty=decision.difficulty,
        similarity=decision.similarity,
        cache_score=decision.cache_score,
        stop=None if trace is None else trace.stop,
    )
    if checked is None:
        return record
    reference, agreement = checked.reference, checked.agreement
    return msgspec.structs.replace(
        record,
        reference=reference.text[:KEPT_CHARS],
        reference_route=_reference_route(drawn.shortcut, reference),
        reference_tokens=reference.completion_tokens,
        reference_ms=checked.ms,
        kind=agreement.kind,
        answer_extracted=agreement.answer,
        reference_extracted=agreement.reference,
        agree=agreement.agree,
    )


def _context_of(request: ChatRequest) -> str | None:
    """The turns before the last, one line each (role: text), when there are any."""
    earlier = request.messages[:-1]
    if not earlier:
        return None
    return "\n".join(f"{m.role}: {m.content[:KEPT_CHARS]}" for m in earlier)[:KEPT_CHARS]


def _reference_route(shortcut: Shortcut, reference: Reference) -> str:
    if shortcut == "early_stop" and reference.route == "loop":
        return "loop_to_budget"
    return reference.route
