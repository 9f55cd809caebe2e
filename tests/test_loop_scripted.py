"""The reasoning loop, decision by decision, on a scripted engine.

Each branch replays a script (engines/scripted.py): what it answers, how sure each of
its tokens is, how long each takes. The calibrators are tiny ones written here, so
every P(correct) is a number the test can compute, and time is a virtual clock
(tests/support.py), so deadlines fall on the same token on every run. The same rules
on the bundled models are in tests/test_loop.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from typing import TypedDict

import msgspec
import pytest

from engines.base import EngineOverloaded, Message, SamplingParams
from engines.scripted import Script, ScriptCall, ScriptedEngine, script
from evaluator.calibration import Calibrator, for_every_kind
from evaluator.loop import DEFAULT_FALLBACK, FallbackSettings, LoopResult, ReasoningLoop
from evaluator.policy import LoopSettings
from evaluator.shown import FIRST_ANSWER_LABEL, Thinking, ThoughtKind
from evaluator.signals import SignalSettings
from tests.support import VirtualClock

QUESTION = [Message("user", "What is 6 * 7?")]
# Token confidence is the mean of the top-2 log-probs, negated; one group is 4 tokens.
SIGNALS = SignalSettings(top_k=2, group_window=4)


class Confidence(TypedDict):
    """How sure a scripted token is: its logprob and its alternatives'."""

    logprob: float
    alternatives: tuple[float, ...]


SURE: Confidence = {"logprob": -0.1, "alternatives": (-3.9,)}  # token confidence 2.0
UNSURE: Confidence = {"logprob": -0.7, "alternatives": (-0.7,)}  # token confidence 0.7


def sure(text: str, pace: float = 0.0) -> Script:
    return script(text, **SURE, seconds_per_token=pace)


def unsure(text: str, pace: float = 0.0) -> Script:
    return script(text, **UNSURE, seconds_per_token=pace)


SAYS_42 = sure("The answer is 42.")  # four tokens
SAYS_41 = sure("The answer is 41.")
DOUBTS_41 = unsure("The answer is 41.")
# Four tokens of 0.1 s: a round takes 0.4 s on the virtual clock.
PACED_42 = sure("The answer is 42.", pace=0.1)
PACED_41 = sure("The answer is 41.", pace=0.1)


def calibrator(weight: float, bias: float) -> Calibrator:
    """P(correct) = sigmoid(weight * vote share + bias), with SIGNALS."""
    return Calibrator(
        features=["vote_share"],
        signals=SIGNALS,
        mean=[0.0],
        scale=[1.0],
        weights=[weight],
        bias=bias,
    )


def p(share: float) -> float:
    """What BY_SHARE says for a vote share."""
    return 1 / (1 + math.exp(-(8 * share - 4)))


BY_SHARE = calibrator(8.0, -4.0)
DOUBTFUL = calibrator(0.0, 0.0)  # 0.5 whatever the branches say


class Seen(msgspec.Struct, frozen=True):
    """Something the loop showed, and when (virtual seconds from its start)."""

    kind: ThoughtKind
    text: str
    at: float


class Thought(msgspec.Struct, frozen=True):
    seen: list[Seen]
    result: LoopResult
    seconds: float  # on the virtual clock, from the start to the result

    @property
    def notes(self) -> list[str]:
        return [s.text for s in self.seen if s.kind == "note"]

    def text(self, kind: ThoughtKind) -> str:
        return "".join(s.text for s in self.seen if s.kind == kind)


def think(
    loop: ReasoningLoop,
    *,
    deadline_s: float | None = None,
    fallback: FallbackSettings = DEFAULT_FALLBACK,
    difficulty: float | None = None,
    first_answer: bool = False,
) -> Thought:
    async def main() -> Thought:
        started = time.monotonic()
        deadline = None if deadline_s is None else started + deadline_s
        seen: list[Seen] = []
        result = None
        events = loop.run(
            QUESTION,
            deadline=deadline,
            fallback=fallback,
            difficulty=difficulty,
            first_answer=first_answer,
        )
        async for event in events:
            if isinstance(event, Thinking):
                seen.append(Seen(event.kind, event.text, time.monotonic() - started))
            else:
                result = event
        assert result is not None
        return Thought(seen, result, time.monotonic() - started)

    return VirtualClock().run(main())


def settings(**overrides: object) -> LoopSettings:
    return LoopSettings(**{"calibrator": None, **overrides})  # type: ignore[arg-type]


def answers(thought: Thought) -> list[list[str | None]]:
    return [[b.answer for b in r.branches] for r in thought.result.trace.rounds]


# --- branches per round ----------------------------------------------------------------


@pytest.mark.parametrize(("difficulty", "k"), [(None, 3), (0.5, 3), (0.8, 5), (0.95, 5)])
def test_each_round_starts_its_branches_at_once(difficulty: float | None, k: int) -> None:
    engine = ScriptedEngine([PACED_42])
    loop_settings = settings(
        branches=3, hard_branches=5, hard_difficulty=0.8, max_rounds=2, round_tokens=16
    )
    thought = think(ReasoningLoop(engine, loop_settings, DOUBTFUL), difficulty=difficulty)
    trace = thought.result.trace
    assert [len(r.branches) for r in trace.rounds] == [k, k]
    assert len(engine.calls) == 2 * k
    # A round's branches run side by side: the second round starts 0.4 s later, when
    # the first round's four tokens of 0.1 s are done.
    begun = [round(c.started - engine.calls[0].started, 6) for c in engine.calls]
    assert begun == [0.0] * k + [0.4] * k
    for call in engine.calls:
        assert call.prompt == QUESTION and call.params.n == 1
        assert call.params.max_tokens == 16 and call.params.temperature == 0.7
        assert call.params.logprobs and call.params.top_logprobs == SIGNALS.top_k
    assert trace.tokens == 2 * k * 4 == sum(r.tokens for r in trace.rounds)
    assert thought.result.completion_tokens == trace.tokens
    assert thought.result.answer_tokens == 4
    assert f"up to 2 rounds of {k} branches" in thought.notes[0]
    assert len(thought.notes) == 1 + len(trace.rounds)


# --- the vote --------------------------------------------------------------------------


def test_a_confident_branch_outvotes_two_doubtful_ones() -> None:
    engine = ScriptedEngine([SAYS_42, DOUBTS_41, DOUBTS_41])
    loop_settings = settings(branches=3, max_rounds=1)
    thought = think(ReasoningLoop(engine, loop_settings, DOUBTFUL))
    trace = thought.result.trace
    assert answers(thought) == [["42", "41", "41"]]
    # Weighed by their confidence: 2.0 for 42 against 0.7 + 0.7 for 41.
    confidences = [b.confidence for b in trace.rounds[0].branches]
    assert confidences == pytest.approx([2.0, 0.7, 0.7])
    assert trace.rounds[0].answer == "42"
    assert thought.result.text == "The answer is 42."
    assert trace.stop == "max_rounds" and trace.confidence == 0.5


def test_without_a_calibrator_the_vote_share_is_the_probability() -> None:
    engine = ScriptedEngine([SAYS_42, DOUBTS_41, DOUBTS_41])
    loop = ReasoningLoop(engine, settings(branches=3, max_rounds=1), None)
    trace = think(loop).result.trace
    assert trace.rounds[0].answer == "42"
    assert trace.rounds[0].probability == pytest.approx(1 / 3)


def test_two_sure_branches_outvote_one() -> None:
    engine = ScriptedEngine([SAYS_42, SAYS_41, SAYS_41])
    thought = think(ReasoningLoop(engine, settings(branches=3, max_rounds=1), DOUBTFUL))
    assert thought.result.trace.rounds[0].answer == "41"
    assert thought.result.text == "The answer is 41."


def test_the_vote_counts_every_round_so_far() -> None:
    # Round 1: 42 and 41; round 2: 42 and 42, so 42 leads 3 to 1 over both rounds.
    engine = ScriptedEngine([SAYS_42, SAYS_41, SAYS_42, SAYS_42])
    thought = think(ReasoningLoop(engine, settings(branches=2, max_rounds=2), BY_SHARE))
    rounds = thought.result.trace.rounds
    assert [r.probability for r in rounds] == pytest.approx([p(1 / 2), p(3 / 4)])
    assert thought.result.trace.confidence == pytest.approx(p(3 / 4))


# --- DeepConf's filter -----------------------------------------------------------------

# Three sure tokens, then doubtful ones: the mean over the last 4 tokens falls from 2.0
# to 1.675, 1.35, 1.025 and, at the 7th token, 0.7.
WANDERS = sure("Let me think") + unsure(" about it for a long while and then say 41 or so")


def test_a_branch_that_loses_confidence_is_pruned_mid_generation() -> None:
    engine = ScriptedEngine([SAYS_42, WANDERS])
    loop_settings = settings(branches=2, max_rounds=1, prune_below=1.0, round_tokens=64)
    thought = think(ReasoningLoop(engine, loop_settings, DOUBTFUL))
    first, wandering = thought.result.trace.rounds[0].branches
    assert (first.finish_reason, first.tokens, first.answer) == ("stop", 4, "42")
    # Stopped at the 7th of its 15 tokens, without a vote.
    assert (wandering.finish_reason, wandering.tokens, wandering.answer) == ("pruned", 7, None)
    assert wandering.confidence == pytest.approx(0.7)
    assert len(WANDERS.tokens) == 15
    # The engine stopped generating it within a token of the cut.
    generated = [s for s in engine.samples if s.finish_reason == "cancelled"]
    assert len(generated) == 1 and generated[0].completion_tokens in (7, 8)
    # The pruned branch's tokens are spent all the same.
    assert thought.result.trace.tokens == 4 + 7
    assert thought.result.text == "The answer is 42."


def test_no_branch_is_pruned_above_the_cut_off() -> None:
    engine = ScriptedEngine([SAYS_42, WANDERS])
    loop_settings = settings(branches=2, max_rounds=1, prune_below=0.5, round_tokens=64)
    branches = think(ReasoningLoop(engine, loop_settings, DOUBTFUL)).result.trace.rounds[0]
    assert [b.finish_reason for b in branches.branches] == ["stop", "stop"]
    assert [b.tokens for b in branches.branches] == [4, 15]


# --- stop rules ------------------------------------------------------------------------


def test_stops_when_confident() -> None:
    engine = ScriptedEngine([SAYS_42])
    loop_settings = settings(branches=2, max_rounds=4, threshold=0.95)
    thought = think(ReasoningLoop(engine, loop_settings, BY_SHARE))
    trace = thought.result.trace
    assert trace.stop == "confident" and trace.fallback == "none"
    assert len(trace.rounds) == 1 and len(engine.calls) == 2
    assert trace.confidence == pytest.approx(p(1.0)) and p(1.0) >= 0.95
    assert thought.result.text == "The answer is 42."


def test_just_below_the_threshold_goes_on() -> None:
    engine = ScriptedEngine([SAYS_42])
    loop_settings = settings(branches=2, max_rounds=2, threshold=p(1.0) + 1e-6)
    trace = think(ReasoningLoop(engine, loop_settings, BY_SHARE)).result.trace
    assert trace.stop == "max_rounds" and len(trace.rounds) == 2


def test_stops_after_max_rounds() -> None:
    engine = ScriptedEngine([SAYS_42, SAYS_41])
    loop_settings = settings(branches=2, max_rounds=3)
    thought = think(ReasoningLoop(engine, loop_settings, DOUBTFUL))
    trace = thought.result.trace
    assert trace.stop == "max_rounds" and trace.fallback == "none"
    assert len(trace.rounds) == 3 and len(engine.calls) == 6
    assert trace.confidence == 0.5  # its own answer, at its limits


def test_a_round_the_token_budget_cannot_afford_is_not_started() -> None:
    # 8 tokens a round: after two rounds, 16 + 8 more would pass 20.
    engine = ScriptedEngine([SAYS_42, SAYS_41])
    loop_settings = settings(branches=2, max_rounds=10, token_budget=20)
    trace = think(ReasoningLoop(engine, loop_settings, DOUBTFUL)).result.trace
    assert trace.stop == "token_budget"
    assert len(trace.rounds) == 2 and trace.tokens == 16 and len(engine.calls) == 4


# Over rounds of two branches: 42 41 | 42 42 | 42 41 | ...: P(correct) of 42 goes
# p(1/2) = 0.5, p(3/4) = 0.88, p(4/6) = 0.79: the third round gained nothing.
SWINGS = [SAYS_42, SAYS_41, SAYS_42, SAYS_42, SAYS_42, SAYS_41]


def test_stops_when_a_round_gains_less_than_min_gain() -> None:
    engine = ScriptedEngine(SWINGS)
    loop_settings = settings(branches=2, max_rounds=5, threshold=0.99, min_gain=0.05)
    trace = think(ReasoningLoop(engine, loop_settings, BY_SHARE)).result.trace
    assert [r.probability for r in trace.rounds] == pytest.approx([p(1 / 2), p(3 / 4), p(4 / 6)])
    assert trace.stop == "no_gain" and len(trace.rounds) == 3
    assert trace.confidence == pytest.approx(p(4 / 6))  # the verdict of the last round


def test_without_min_gain_the_same_rounds_go_on() -> None:
    engine = ScriptedEngine(SWINGS)
    loop_settings = settings(branches=2, max_rounds=5, threshold=0.99)
    trace = think(ReasoningLoop(engine, loop_settings, BY_SHARE)).result.trace
    assert trace.stop == "max_rounds" and len(trace.rounds) == 5


# --- the deadline ----------------------------------------------------------------------

UNDECIDED = settings(branches=2, max_rounds=10, token_budget=10_000, threshold=0.99)


def test_a_round_that_cannot_finish_is_not_started() -> None:
    engine = ScriptedEngine([PACED_42, PACED_41])
    thought = think(ReasoningLoop(engine, UNDECIDED, BY_SHARE), deadline_s=0.7)
    trace = thought.result.trace
    # After one round at 0.4 s, 0.3 s are left and a round takes 0.4 s.
    assert trace.stop == "deadline" and len(trace.rounds) == 1
    assert len(engine.calls) == 2
    assert [b.finish_reason for b in trace.rounds[0].branches] == ["stop", "stop"]
    assert thought.seconds == pytest.approx(0.4)  # answered before the deadline
    assert trace.deadline_ms == pytest.approx(700) and trace.elapsed_ms == pytest.approx(400)


def test_a_round_that_can_finish_is_started() -> None:
    engine = ScriptedEngine([PACED_42, PACED_41])
    thought = think(ReasoningLoop(engine, UNDECIDED, BY_SHARE), deadline_s=0.85)
    trace = thought.result.trace
    assert trace.stop == "deadline" and len(trace.rounds) == 2
    assert all(b.finish_reason == "stop" for r in trace.rounds for b in r.branches)
    assert thought.seconds == pytest.approx(0.8)


def test_a_deadline_already_past_does_no_work() -> None:
    engine = ScriptedEngine([PACED_42])
    thought = think(ReasoningLoop(engine, UNDECIDED, BY_SHARE), deadline_s=-1.0)
    trace = thought.result.trace
    assert trace.stop == "deadline" and trace.rounds == [] and engine.calls == []
    assert trace.fallback == "error" and thought.result.text == ""


def test_a_round_cut_by_the_deadline_stops_at_it() -> None:
    engine = ScriptedEngine([PACED_42, PACED_41])
    thought = think(ReasoningLoop(engine, UNDECIDED, BY_SHARE), deadline_s=0.25)
    trace = thought.result.trace
    branches = trace.rounds[0].branches
    assert [(b.finish_reason, b.tokens, b.answer) for b in branches] == [("deadline", 2, None)] * 2
    assert thought.seconds == pytest.approx(0.25)
    # Nothing answered: the best answer so far is none, so the fallback is an error.
    assert trace.stop == "deadline" and trace.fallback == "error"
    assert thought.result.text == "" and trace.confidence == 0.0
    # The branches were closed mid-token, at the deadline: their third never came.
    assert [(s.finish_reason, s.completion_tokens) for s in engine.samples] == [
        ("cancelled", 2)
    ] * 2


# --- fallbacks at the deadline ---------------------------------------------------------


def test_fallback_best_answers_with_the_best_so_far() -> None:
    engine = ScriptedEngine([PACED_42, PACED_42])
    fallback = FallbackSettings(policy="best")
    thought = think(ReasoningLoop(engine, UNDECIDED, BY_SHARE), deadline_s=0.7, fallback=fallback)
    result = thought.result
    assert result.trace.fallback == "best" and result.engine == "scripted"
    assert result.text == "The answer is 42."
    assert result.trace.confidence == pytest.approx(p(1.0))


def small_engine(text: str = "42", pace: float = 0.01) -> ScriptedEngine:
    return ScriptedEngine([sure(text, pace=pace)], name="small", model="small-model")


@pytest.mark.parametrize("hedge", [False, True])
def test_fallback_small_answers_with_the_small_engine(hedge: bool) -> None:
    engine, small = ScriptedEngine([PACED_42, PACED_41]), small_engine()
    loop = ReasoningLoop(engine, UNDECIDED, BY_SHARE, small=small)
    fallback = FallbackSettings(policy="small", hedge=hedge)
    thought = think(loop, deadline_s=0.7, fallback=fallback)
    result = thought.result
    assert result.trace.fallback == "small" and result.engine == "small"
    assert result.text == "42" and result.trace.confidence == 0.0
    assert len(small.calls) == 1
    started = small.calls[0].started - engine.calls[0].started
    # Hedged, it started with the loop; otherwise once the loop gave up, after round 1.
    assert started == pytest.approx(0.0 if hedge else 0.4)
    assert thought.seconds == pytest.approx(0.4 if hedge else 0.41)


def test_fallback_small_too_slow_for_the_deadline_gives_the_best_so_far() -> None:
    engine = ScriptedEngine([PACED_42, PACED_41])
    small = small_engine("It is forty two", pace=1.0)
    loop = ReasoningLoop(engine, UNDECIDED, BY_SHARE, small=small)
    thought = think(loop, deadline_s=0.7, fallback=FallbackSettings(policy="small"))
    result = thought.result
    assert result.trace.fallback == "best" and result.engine == "scripted"
    assert result.text == "The answer is 42."
    assert small.samples[0].finish_reason == "deadline"
    assert thought.seconds == pytest.approx(1.4)  # its one token began before 0.7 s


def test_fallback_best_without_an_answer_takes_the_small_engine_s() -> None:
    """Issue 32: under "best", a loop with no answer yet at its deadline answered 504;
    the small engine's answer in the time left is what the policy promises."""
    engine, small = ScriptedEngine([PACED_42, PACED_41]), small_engine()
    loop = ReasoningLoop(engine, UNDECIDED, BY_SHARE, small=small)
    thought = think(loop, deadline_s=0.25, fallback=FallbackSettings(policy="best"))
    result = thought.result
    # The round was cut at the deadline without an answer; the small engine had no
    # time left either: nothing to answer with, so an error after all.
    assert result.trace.fallback == "error" and len(small.calls) == 1
    engine, small = ScriptedEngine([PACED_42, PACED_41]), small_engine()
    loop = ReasoningLoop(
        engine, settings(branches=2, max_rounds=10, round_tokens=2, threshold=0.99),
        BY_SHARE, small=small,
    )  # fmt: skip
    thought = think(loop, deadline_s=0.5, fallback=FallbackSettings(policy="best"))
    result = thought.result
    # Rounds of two tokens leave no answer; once another cannot finish, the small
    # engine answers in the time left.
    assert result.trace.stop == "deadline" and result.trace.rounds
    assert result.trace.fallback == "small" and result.engine == "small"
    assert result.text == "42" and thought.seconds < 0.5


def test_fallback_error_gives_no_answer() -> None:
    engine = ScriptedEngine([PACED_42, PACED_42])
    fallback = FallbackSettings(policy="error")
    thought = think(ReasoningLoop(engine, UNDECIDED, BY_SHARE), deadline_s=0.7, fallback=fallback)
    result = thought.result
    assert result.trace.fallback == "error" and result.text == ""
    assert result.trace.confidence == 0.0
    assert len(result.trace.rounds) == 1  # it had an answer, and the policy refused it


def test_a_hedge_is_stopped_when_the_loop_answers_in_time() -> None:
    engine, small = ScriptedEngine([SAYS_42]), small_engine(pace=1.0)
    loop = ReasoningLoop(engine, settings(branches=2, threshold=0.95), BY_SHARE, small=small)
    thought = think(loop, deadline_s=5.0, fallback=FallbackSettings(policy="small", hedge=True))
    assert thought.result.trace.stop == "confident" and thought.result.engine == "scripted"
    assert [s.finish_reason for s in small.samples] == ["cancelled"]


# --- what the loop shows while it thinks ------------------------------------------------


def test_the_first_branch_is_shown_token_by_token_while_the_round_runs() -> None:
    engine = ScriptedEngine([PACED_42, PACED_41])
    loop = ReasoningLoop(engine, settings(branches=2, max_rounds=1), DOUBTFUL)
    thought = think(loop)
    thoughts = [s for s in thought.seen if s.kind == "thought"]
    # One branch, whole, each token when it came: not the other branch, not at the end.
    assert thought.text("thought") == "Round 1, branch 1 of 2:\nThe answer is 42.\n"
    assert [s.at for s in thoughts[:4]] == pytest.approx([0.1, 0.2, 0.3, 0.4])
    assert thought.notes[-1].startswith("Round 1: '42', '41'")  # the others, summarised
    trace = thought.result.trace
    assert trace.first_shown_ms == pytest.approx(100)
    assert trace.first_answer is None
    assert trace.thought_to_output == pytest.approx(2.0)  # 8 tokens for an answer of 4


def small_says(text: str, pace: float) -> ScriptedEngine:
    return ScriptedEngine([sure(text, pace=pace)], name="small", model="small-model")


CONFIDENT_AT_ONCE = settings(branches=2, threshold=0.95)  # two sure votes: P 0.98


@pytest.mark.parametrize(
    ("says", "verdict", "answer"), [("42", "confirmed", "42"), ("41", "replaced", "41")]
)
def test_a_first_answer_comes_first_and_the_loop_confirms_or_replaces_it(
    says: str, verdict: str, answer: str
) -> None:
    engine, small = ScriptedEngine([PACED_42]), small_says(f"It is {says}.", pace=0.05)
    loop = ReasoningLoop(engine, CONFIDENT_AT_ONCE, BY_SHARE, small=small)
    thought = think(loop, first_answer=True)
    result = thought.result
    assert result.text == "The answer is 42." and result.trace.stop == "confident"
    judged = result.trace.first_answer
    assert judged is not None
    assert (judged.verdict, judged.answer, judged.tokens) == (verdict, answer, 3)
    assert judged.whole_ms == pytest.approx(150)
    assert result.trace.first_shown_ms == pytest.approx(50)
    # The first answer, labelled, in one piece; the branch's tokens, held while it
    # streamed, follow it whole; the verdict last.
    kinds = [s.kind for s in thought.seen]
    assert kinds.index("first_answer") < kinds.index("thought")
    first = [i for i, k in enumerate(kinds) if k == "first_answer"]
    assert first == list(range(first[0], first[-1] + 1))
    assert thought.text("first_answer") == FIRST_ANSWER_LABEL + f"It is {says}.\n"
    assert thought.text("thought") == "Round 1, branch 1 of 2:\nThe answer is 42.\n"
    assert thought.notes[-1].startswith("The loop's answer")
    assert ("confirms" in thought.notes[-1]) == (verdict == "confirmed")


def test_a_first_answer_the_loop_outpaces_is_stopped_unfinished() -> None:
    engine, small = ScriptedEngine([PACED_42]), small_says("It is forty two", pace=1.0)
    loop = ReasoningLoop(engine, CONFIDENT_AT_ONCE, BY_SHARE, small=small)
    thought = think(loop, first_answer=True)
    judged = thought.result.trace.first_answer
    assert judged is not None and judged.verdict == "unfinished" and judged.whole_ms is None
    assert [s.finish_reason for s in small.samples] == ["cancelled"]
    assert thought.seconds == pytest.approx(0.4)  # the loop did not wait for it
    assert (
        thought.text("thought") == "Round 1, branch 1 of 2:\nThe answer is 42.\n"
    )  # held, then shown


def test_a_first_answer_is_the_hedge_the_deadline_falls_back_on() -> None:
    engine, small = ScriptedEngine([PACED_42, PACED_41]), small_says("It is 42.", pace=0.01)
    loop = ReasoningLoop(engine, UNDECIDED, BY_SHARE, small=small)
    fallback = FallbackSettings(policy="small")
    thought = think(loop, deadline_s=0.7, fallback=fallback, first_answer=True)
    result = thought.result
    assert result.trace.fallback == "small" and result.text == "It is 42."
    assert len(small.calls) == 1  # the first answer's call, not a second one
    assert result.trace.first_answer is not None
    assert result.trace.first_answer.verdict == "confirmed"


def test_a_first_answer_is_withdrawn_when_the_loop_has_none() -> None:
    engine, small = ScriptedEngine([PACED_42, PACED_41]), small_says("It is 42.", pace=0.01)
    loop = ReasoningLoop(engine, UNDECIDED, BY_SHARE, small=small)
    thought = think(
        loop, deadline_s=0.7, fallback=FallbackSettings(policy="error"), first_answer=True
    )
    judged = thought.result.trace.first_answer
    assert thought.result.trace.fallback == "error"
    assert judged is not None and judged.verdict == "withdrawn"
    assert "withdrawn" in thought.notes[-1]


def test_without_a_small_engine_there_is_no_first_answer() -> None:
    loop = ReasoningLoop(ScriptedEngine([SAYS_42]), CONFIDENT_AT_ONCE, BY_SHARE)
    thought = think(loop, first_answer=True)
    assert thought.result.trace.first_answer is None
    assert thought.text("first_answer") == ""


# --- cancellation and overload ---------------------------------------------------------


def test_closing_the_loop_stops_every_branch() -> None:
    long_story = sure(" ".join(["word"] * 50), pace=0.1)
    engine = ScriptedEngine([long_story])
    loop = ReasoningLoop(engine, settings(branches=3, round_tokens=64), DOUBTFUL)

    async def main() -> None:
        events = loop.run(QUESTION, deadline=None)
        assert isinstance(await anext(events), Thinking)
        task = asyncio.ensure_future(anext(events))
        await asyncio.sleep(1.05)  # ten tokens of each branch
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await events.aclose()
        assert engine.busy_slots == 0
        await asyncio.sleep(10)

    VirtualClock().run(main())
    assert engine.tokens_generated == 30
    assert [s.finish_reason for s in engine.samples] == ["cancelled"] * 3


def test_closing_the_loop_stops_its_first_answer() -> None:
    engine = ScriptedEngine([sure(" ".join(["word"] * 50), pace=0.1)])
    small = small_says(" ".join(["small"] * 50), pace=0.1)
    loop = ReasoningLoop(engine, settings(branches=2, round_tokens=64), DOUBTFUL, small=small)

    async def main() -> list[Thinking]:
        seen = []
        events = loop.run(QUESTION, deadline=None, first_answer=True)
        async for event in events:
            assert isinstance(event, Thinking)
            seen.append(event)
            if len(seen) == 6:
                break
        await events.aclose()
        assert engine.busy_slots == 0 and small.busy_slots == 0
        return seen

    seen = VirtualClock().run(main())
    assert [t.kind for t in seen] == ["note", *["first_answer"] * 5]
    assert [s.finish_reason for s in small.samples] == ["cancelled"]
    assert [s.finish_reason for s in engine.samples] == ["cancelled"] * 2


def test_an_engine_that_is_full_refuses_the_first_round() -> None:
    engine = ScriptedEngine([SAYS_42], concurrency=1, queue_size=0)
    with pytest.raises(EngineOverloaded):
        think(ReasoningLoop(engine, settings(branches=2), DOUBTFUL))


def test_an_engine_full_after_a_round_ends_the_loop_with_its_answer() -> None:
    def choose(call: ScriptCall) -> Script:
        return sure("busy " * 20, pace=1.0) if call.prompt == "another client" else SAYS_42

    engine = ScriptedEngine(choose, concurrency=2, queue_size=0)
    loop = ReasoningLoop(engine, settings(branches=2, max_rounds=3), DOUBTFUL)

    async def main() -> LoopResult:
        result = None
        other = engine.stream("another client", SamplingParams(n=2))
        async for event in loop.run(QUESTION, deadline=None):
            if isinstance(event, Thinking) and event.kind == "note" and "Round 1" in event.text:
                # Another client takes both slots before round 2, and nothing may wait.
                await anext(other)
                assert engine.busy_slots == 2
            elif isinstance(event, LoopResult):
                result = event
        await other.aclose()
        assert result is not None
        return result

    result = VirtualClock().run(main())
    assert result.trace.stop == "overloaded" and len(result.trace.rounds) == 1
    assert result.text == "The answer is 42." and result.trace.confidence == 0.5


# --- greedy-first ----------------------------------------------------------------------


def greedy_calibrator(signals: SignalSettings = SIGNALS) -> Calibrator:
    """P(greedy right) = sigmoid(4 * mean token confidence - 4): 0.98 for a sure pass
    (confidence 2.0), 0.23 for a doubtful one (0.7)."""
    return Calibrator(
        features=["mean_confidence"],
        signals=signals,
        mean=[0.0],
        scale=[1.0],
        weights=[4.0],
        bias=-4.0,
    )


GREEDY = greedy_calibrator()
P_SURE = 1 / (1 + math.exp(-4.0))  # GREEDY on a sure pass
P_DOUBTFUL = 1 / (1 + math.exp(-(4 * 0.7 - 4)))  # and on a doubtful one
# A greedy_stop no sigmoid reaches: sampling always follows (with a greedy calibrator;
# without one, an answered pass has P 1).
NEVER_STOPS = 1.0


def greedy_then(greedy: Script, *samples: Script, concurrency: int = 16) -> ScriptedEngine:
    """The greedy pass (asked at temperature 0) says ``greedy``; the sampled branches
    say ``samples`` in turn."""

    def choose(call: ScriptCall) -> Script:
        if call.params.temperature == 0.0:
            return greedy
        return samples[(call.number - 1) % len(samples)]

    return ScriptedEngine(choose, concurrency=concurrency, queue_size=0)


def greedy_first(**overrides: object) -> LoopSettings:
    return settings(**{"greedy_first": True, "greedy_stop": NEVER_STOPS, **overrides})


def test_the_greedy_pass_is_one_branch_at_temperature_0_then_rounds_sample() -> None:
    engine = greedy_then(DOUBTS_41, SAYS_42)
    loop_settings = greedy_first(branches=3, max_rounds=1, round_tokens=16)
    # P(greedy right)'s own signals read three alternatives; the vote's two.
    three = greedy_calibrator(msgspec.structs.replace(SIGNALS, top_k=3))
    thought = think(
        ReasoningLoop(engine, loop_settings, DOUBTFUL, greedy_calibrators=for_every_kind(three))
    )
    greedy, *sampled = engine.calls
    assert greedy.params.temperature == 0.0 and greedy.params.n == 1
    assert greedy.params.logprobs and greedy.params.top_logprobs == 3
    assert greedy.params.max_tokens == 16
    assert len(sampled) == 3
    assert all(c.params.temperature == 0.7 and c.params.top_logprobs == 2 for c in sampled)
    trace = thought.result.trace
    assert [len(r.branches) for r in trace.rounds] == [1, 3]
    assert [r.greedy for r in trace.rounds] == [True, False]
    assert answers(thought) == [["41"], ["42", "42", "42"]]
    # max_rounds is one sampling round: the greedy pass is not counted.
    assert trace.stop == "max_rounds" and trace.tokens == 4 * 4
    assert "a greedy pass, then up to 1 rounds of 3 branches" in thought.notes[0]
    assert thought.notes[1].startswith("Round 1, the greedy pass: '41'; P(greedy right) ")
    assert thought.notes[2].startswith("Round 2: '42', '42', '42'; leading answer '42'")
    assert thought.text("thought").startswith(
        "Round 1, the greedy pass:\nThe answer is 41.\nRound 2, branch 1 of 3:\n"
    )


def test_the_greedy_pass_may_spend_what_the_client_allows_a_plain_request() -> None:
    engine = greedy_then(DOUBTS_41, SAYS_42)
    loop = ReasoningLoop(
        engine,
        greedy_first(branches=2, max_rounds=1, round_tokens=16),
        DOUBTFUL,
        greedy_calibrators=for_every_kind(GREEDY),
    )

    async def main() -> None:
        async for _ in loop.run(QUESTION, deadline=None, max_tokens=100):
            pass

    asyncio.run(main())
    greedy, *sampled = engine.calls
    # With greedy_stop 0 the pass is the plain request's answer: the client's limit,
    # not a round's; the sampling rounds keep round_tokens.
    assert greedy.params.max_tokens == 100
    assert [c.params.max_tokens for c in sampled] == [16, 16]


@pytest.mark.parametrize(("greedy_stop", "stops"), [(0.98, True), (0.99, False)])
def test_stops_after_the_greedy_pass_when_its_p_reaches_greedy_stop(
    greedy_stop: float, stops: bool
) -> None:
    engine = greedy_then(SAYS_42, SAYS_41)
    # The vote's threshold, reached by any verdict here, is not for the greedy pass.
    loop_settings = greedy_first(greedy_stop=greedy_stop, threshold=0.1, branches=2)
    thought = think(
        ReasoningLoop(engine, loop_settings, BY_SHARE, greedy_calibrators=for_every_kind(GREEDY))
    )
    result = thought.result
    first = result.trace.rounds[0]
    assert first.greedy and first.answer == "42"
    assert first.probability == pytest.approx(P_SURE) and 0.98 < P_SURE < 0.99
    assert f"P(greedy right) {P_SURE:.2f} (greedy_stop {greedy_stop:.2f})" in thought.notes[1]
    assert result.trace.stop == ("greedy" if stops else "confident")
    if stops:
        assert len(engine.calls) == 1 and len(result.trace.rounds) == 1
        assert result.text == "The answer is 42."
        assert result.trace.confidence == pytest.approx(P_SURE)
    else:
        # One sampling round, whose vote (the greedy 42 against two 41s) the threshold stops.
        assert len(engine.calls) == 3 and len(result.trace.rounds) == 2
        assert result.text == "The answer is 41."
        assert result.trace.confidence == pytest.approx(p(2 / 3))


def test_without_a_greedy_calibrator_an_answered_pass_has_p_1() -> None:
    engine = greedy_then(DOUBTS_41, SAYS_42)
    result = think(ReasoningLoop(engine, greedy_first(), BY_SHARE)).result
    assert len(engine.calls) == 1 and result.trace.stop == "greedy"
    assert result.trace.confidence == 1.0 and result.text == "The answer is 41."


UNANSWERED = unsure("I am not sure about that one.")


def test_greedy_stop_0_is_one_greedy_pass_even_without_an_answer() -> None:
    engine = greedy_then(UNANSWERED, SAYS_42)
    loop = ReasoningLoop(
        engine, greedy_first(greedy_stop=0.0), BY_SHARE, greedy_calibrators=for_every_kind(GREEDY)
    )
    result = think(loop).result
    assert len(engine.calls) == 1 and result.trace.stop == "greedy"
    assert result.trace.rounds[0].answer is None and result.trace.confidence == 0.0
    assert result.text == UNANSWERED.text  # its own text: nothing better was asked for


def test_an_unanswered_greedy_pass_goes_on_to_sample_above_greedy_stop_0() -> None:
    engine = greedy_then(UNANSWERED, SAYS_42)
    loop_settings = greedy_first(greedy_stop=0.01, threshold=0.75, branches=2)
    loop = ReasoningLoop(engine, loop_settings, BY_SHARE, greedy_calibrators=for_every_kind(GREEDY))
    result = think(loop).result
    assert len(engine.calls) == 3 and answers_of(result) == [[None], ["42", "42"]]
    assert result.text == "The answer is 42." and result.trace.stop == "confident"
    # The unanswered greedy pass votes nothing, but it is one of the branches.
    assert result.trace.confidence == pytest.approx(p(2 / 3))


def answers_of(result: LoopResult) -> list[list[str | None]]:
    return [[b.answer for b in r.branches] for r in result.trace.rounds]


@pytest.mark.parametrize(
    ("weight", "answer", "share"),
    [
        (0.0, "41", 2 / 2),  # left out: the two 41s alone
        (1.0, "41", 2 / 3),  # a sure 42 against two sure 41s
        (4.0, "42", 1 / 3),  # weighing four branches' confidence, it outvotes them
    ],
)
def test_the_greedy_answer_votes_in_later_rounds_at_greedy_weight(
    weight: float, answer: str, share: float
) -> None:
    engine = greedy_then(SAYS_42, SAYS_41)
    loop_settings = greedy_first(greedy_weight=weight, branches=2, max_rounds=1)
    thought = think(
        ReasoningLoop(engine, loop_settings, BY_SHARE, greedy_calibrators=for_every_kind(GREEDY))
    )
    result = thought.result
    # Below greedy_stop, so a sampling round follows; its tally is the vote's own
    # calibrator's, over the greedy pass and the samples.
    assert answers(thought) == [["42"], ["41", "41"]]
    assert result.trace.rounds[1].answer == answer
    assert result.trace.rounds[1].probability == pytest.approx(p(share))
    assert result.text == f"The answer is {answer}."


def test_max_rounds_counts_sampling_rounds_only() -> None:
    engine = greedy_then(DOUBTS_41, SAYS_42, SAYS_41)
    loop_settings = greedy_first(branches=2, max_rounds=2)
    loop = ReasoningLoop(engine, loop_settings, DOUBTFUL, greedy_calibrators=for_every_kind(GREEDY))
    trace = think(loop).result.trace
    assert trace.stop == "max_rounds"
    assert [len(r.branches) for r in trace.rounds] == [1, 2, 2] and len(engine.calls) == 5


def test_min_gain_is_not_measured_against_the_greedy_pass() -> None:
    # P(greedy right) 0.98, then the vote's p(2/3) = 0.79 and p(4/5) = 0.92: another
    # calibrator's P is no round before, so only the third round's gain is measured.
    engine = greedy_then(SAYS_42, SAYS_41)
    loop_settings = greedy_first(branches=2, max_rounds=2, threshold=0.99, min_gain=0.05)
    loop = ReasoningLoop(engine, loop_settings, BY_SHARE, greedy_calibrators=for_every_kind(GREEDY))
    trace = think(loop).result.trace
    assert [r.probability for r in trace.rounds] == pytest.approx([P_SURE, p(2 / 3), p(4 / 5)])
    assert trace.stop == "max_rounds"


@pytest.mark.parametrize(
    ("budget", "rounds", "stop"),
    [
        # After the greedy pass (4) and a round (8), another round (8) passes 19;
        # without the greedy pass's tokens it would not (16).
        (19, 2, "token_budget"),
        (20, 3, "max_rounds"),
        # The greedy pass's 4 and a round's 8 pass 11: no sampling at all.
        (11, 1, "token_budget"),
    ],
)
def test_the_token_budget_counts_the_greedy_pass(budget: int, rounds: int, stop: str) -> None:
    engine = greedy_then(SAYS_42, SAYS_41)
    loop_settings = greedy_first(branches=2, max_rounds=2, token_budget=budget)
    loop = ReasoningLoop(engine, loop_settings, DOUBTFUL, greedy_calibrators=for_every_kind(GREEDY))
    result = think(loop).result
    trace = result.trace
    assert trace.stop == stop and len(trace.rounds) == rounds
    assert trace.tokens == 4 + 8 * (rounds - 1) == sum(r.tokens for r in trace.rounds)
    if rounds == 1:
        assert result.text == "The answer is 42." and trace.confidence == pytest.approx(P_SURE)


def test_the_deadline_during_sampling_answers_with_the_greedy_pass_as_best_so_far() -> None:
    # A quick greedy pass (0.04 s) promises a round of 0.08 s; its branches take 0.4 s
    # and the deadline cuts them at 0.3 s, before any votes. Left out of the vote
    # (weight 0), the greedy answer is still the best so far.
    engine = greedy_then(sure("The answer is 42.", pace=0.01), PACED_41)
    loop_settings = greedy_first(branches=2, greedy_weight=0.0, token_budget=10_000)
    loop = ReasoningLoop(engine, loop_settings, BY_SHARE, greedy_calibrators=for_every_kind(GREEDY))
    thought = think(loop, deadline_s=0.3)
    result = thought.result
    trace = result.trace
    assert [b.finish_reason for b in trace.rounds[1].branches] == ["deadline", "deadline"]
    assert trace.stop == "deadline" and trace.fallback == "best"
    assert result.text == "The answer is 42." and trace.confidence == pytest.approx(P_SURE)
    assert thought.seconds == pytest.approx(0.3)


def test_a_deadline_before_the_greedy_pass_is_whole_cuts_it_like_any_round() -> None:
    engine = greedy_then(PACED_42, PACED_41)
    loop = ReasoningLoop(
        engine, greedy_first(greedy_stop=0.0), BY_SHARE, greedy_calibrators=for_every_kind(GREEDY)
    )
    thought = think(loop, deadline_s=0.25)
    trace = thought.result.trace
    assert [(b.finish_reason, b.tokens) for b in trace.rounds[0].branches] == [("deadline", 2)]
    # Nothing answered, not even greedy_stop 0's pass: the fallback's error.
    assert trace.stop == "deadline" and trace.fallback == "error" and len(engine.calls) == 1


def test_an_engine_full_after_the_greedy_pass_answers_with_it() -> None:
    def choose(call: ScriptCall) -> Script:
        return sure("busy " * 20, pace=1.0) if call.prompt == "another client" else SAYS_42

    engine = ScriptedEngine(choose, concurrency=2, queue_size=0)
    loop = ReasoningLoop(
        engine, greedy_first(branches=2), DOUBTFUL, greedy_calibrators=for_every_kind(GREEDY)
    )

    async def main() -> LoopResult:
        result = None
        other = engine.stream("another client", SamplingParams(n=2))
        async for event in loop.run(QUESTION, deadline=None):
            if isinstance(event, Thinking) and "the greedy pass:" in event.text:
                if event.kind == "note":  # both slots taken before the sampling round
                    await anext(other)
            elif isinstance(event, LoopResult):
                result = event
        await other.aclose()
        assert result is not None
        return result

    result = VirtualClock().run(main())
    assert result.trace.stop == "overloaded" and len(result.trace.rounds) == 1
    assert result.text == "The answer is 42."
    assert result.trace.confidence == pytest.approx(P_SURE)
