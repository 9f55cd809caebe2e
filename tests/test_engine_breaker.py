"""The circuit breaker's state machine, on a clock the test moves by hand, and the
HTTP engine behind it."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import pytest

from engines.base import EngineUnavailable, Message, SamplingParams
from engines.breaker import Breaker, BreakerOpen
from engines.openai_http import OpenAIHTTPEngine
from engines.settings import BreakerSettings, OpenAIHTTPSettings


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def state(breaker: Breaker) -> str:
    return breaker.state  # read afresh each time (mypy would narrow a property)


def fail(breaker: Breaker, times: int) -> None:
    for _ in range(times):
        breaker.failed(breaker.admit())


def test_opens_after_consecutive_failures_only(clock: Clock) -> None:
    breaker = Breaker(failures=3, open_s=10, clock=clock)
    fail(breaker, 2)
    breaker.succeeded(breaker.admit())  # a success in between starts the count again
    fail(breaker, 2)
    assert state(breaker) == "closed"
    fail(breaker, 1)
    assert state(breaker) == "open" and breaker.opened == 1
    clock.now += 4
    with pytest.raises(BreakerOpen, match="circuit open, retry in 6 s") as refused:
        breaker.admit()
    assert refused.value.retry_in_s == pytest.approx(6)


def test_half_open_lets_one_trial_through_and_its_success_closes(clock: Clock) -> None:
    breaker = Breaker(failures=1, open_s=10, clock=clock)
    fail(breaker, 1)
    clock.now += 10
    assert state(breaker) == "half_open"
    trial = breaker.admit()
    with pytest.raises(BreakerOpen):  # one trial at a time
        breaker.admit()
    breaker.succeeded(trial)
    assert state(breaker) == "closed"
    breaker.admit()


def test_a_failed_trial_opens_again_for_a_whole_period(clock: Clock) -> None:
    breaker = Breaker(failures=1, open_s=10, clock=clock)
    fail(breaker, 1)
    clock.now += 15
    breaker.failed(breaker.admit())
    assert state(breaker) == "open" and breaker.opened == 2
    clock.now += 9.9
    with pytest.raises(BreakerOpen):
        breaker.admit()
    clock.now += 0.1
    assert breaker.admit().trial


def test_an_abandoned_trial_frees_the_half_open_slot(clock: Clock) -> None:
    breaker = Breaker(failures=1, open_s=10, clock=clock)
    fail(breaker, 1)
    clock.now += 10
    breaker.abandoned(breaker.admit())
    assert state(breaker) == "half_open"
    breaker.succeeded(breaker.admit())
    assert state(breaker) == "closed"


def test_verdicts_of_calls_let_in_before_a_change_are_ignored(clock: Clock) -> None:
    breaker = Breaker(failures=2, open_s=10, clock=clock)
    slow = [breaker.admit() for _ in range(4)]  # streams in flight when the server dies
    breaker.failed(slow[0])
    breaker.failed(slow[1])
    assert state(breaker) == "open"
    breaker.succeeded(slow[2])  # began before the breaker opened: proves nothing now
    assert state(breaker) == "open"
    clock.now += 10
    trial = breaker.admit()
    breaker.failed(slow[3])  # nor does a stale failure fail the trial
    assert state(breaker) == "half_open"
    breaker.succeeded(trial)
    assert state(breaker) == "closed"
    breaker.failed(breaker.admit())
    assert state(breaker) == "closed"  # a fresh count after closing


def test_verdicts_say_when_an_outage_begins_and_ends(clock: Clock) -> None:
    breaker = Breaker(failures=2, open_s=10, clock=clock)
    assert not breaker.failed(breaker.admit())  # one of two: still closed
    assert breaker.failed(breaker.admit())  # opened: the outage begins
    clock.now += 10
    assert not breaker.failed(breaker.admit())  # a failed trial: the same outage
    clock.now += 10
    trial = breaker.admit()
    assert breaker.succeeded(trial)  # closed: the outage ends
    assert not breaker.succeeded(breaker.admit())  # an ordinary answer


@pytest.fixture
def unanswered_port() -> Iterator[int]:
    """A port whose listener never accepts and whose backlog is full, so a connection
    attempt hears nothing until its timeout: a server host that has gone away."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = int(listener.getsockname()[1])
    fillers = []
    for _ in range(4):
        filler = socket.socket()
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            filler.connect(("127.0.0.1", port))
        fillers.append(filler)
    yield port
    for sock in [*fillers, listener]:
        sock.close()


async def test_http_engine_fails_fast_once_open(unanswered_port: int) -> None:
    """Each call waits out the connect timeout until the breaker opens; then calls are
    refused by the breaker, without a connection attempt. (How fast each is: the fault
    benchmarks, bench/.)"""
    settings = OpenAIHTTPSettings(
        base_url=f"http://127.0.0.1:{unanswered_port}/v1", model="none",
        connect_timeout_s=0.3, connect_retries=0,
        breaker=BreakerSettings(failures=2, open_s=60),
    )  # fmt: skip
    engine = OpenAIHTTPEngine("remote", settings)
    question = (Message("user", "What is 2+2?"),)
    try:
        for _ in range(2):
            # Not refused by the listener: the connect timeout ran out.
            with pytest.raises(EngineUnavailable, match=r"cannot connect .*ConnectTimeout"):
                await engine.generate(question, SamplingParams(max_tokens=4))
        assert engine.breaker is not None and state(engine.breaker) == "open"
        for _ in range(3):
            with pytest.raises(EngineUnavailable, match="circuit open, retry in 60 s"):
                await engine.generate(question, SamplingParams(max_tokens=4))
        # Refusals are neither failures nor trials: the breaker stays opened once.
        assert state(engine.breaker) == "open" and engine.breaker.opened == 1
    finally:
        await engine.close()
