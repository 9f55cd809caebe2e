"""The scripted engine keeps the engine contract as the real backends do: n samples,
token limits, stop sequences, logprobs as asked, the deadline, cancellation, its
queue, timings and counts. Times are a virtual clock's, so they are exact."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from engines.base import Delta, EngineOverloaded, Generation, Message, SamplingParams
from engines.scripted import Script, ScriptCall, ScriptedEngine, script
from tests.support import VirtualClock

ANSWER = script("The answer is 42.", logprob=-0.1, alternatives=(-3.0, -4.0))
SLOW = script("one two three four five six", seconds_per_token=0.5)


def test_a_script_cuts_text_into_word_tokens_with_their_alternatives() -> None:
    assert [t.token for t in ANSWER.tokens] == ["The", " answer", " is", " 42."]
    assert ANSWER.text == "The answer is 42."
    first = ANSWER.tokens[0]
    assert first.logprob == -0.1
    assert [(a.token, a.logprob) for a in first.top] == [
        ("The", -0.1),
        ("<alt1>", -3.0),
        ("<alt2>", -4.0),
    ]
    # Alternatives more likely than the chosen token come before it, as a model's do.
    unsure = script(["x"], logprob=-2.0, alternatives=(-1.0,))
    assert [a.token for a in unsure.tokens[0].top] == ["<alt1>", "x"]
    both = ANSWER + unsure
    assert both.text == "The answer is 42.x" and len(both.tokens) == 5


def test_samples_follow_their_scripts_in_turn() -> None:
    engine = ScriptedEngine([ANSWER, script("It is 41.")])
    params = SamplingParams(n=3, seed=7, logprobs=True, top_logprobs=2)
    prompt = [Message("user", "What is 6 * 7?")]
    generation = VirtualClock().run(engine.generate(prompt, params))
    assert [s.text for s in generation.samples] == [
        "The answer is 42.",
        "It is 41.",
        "The answer is 42.",
    ]
    assert all(s.finish_reason == "stop" for s in generation.samples)
    assert [s.completion_tokens for s in generation.samples] == [4, 3, 4]
    assert generation.completion_tokens == 11
    assert generation.prompt_tokens == 6  # five words and the message
    # Each sample its own seed, as every FanOutEngine gives them.
    assert [c.params.seed for c in engine.calls] == [7, 8, 9]
    assert [c.number for c in engine.calls] == [0, 1, 2]
    assert [c.index for c in engine.calls] == [0, 1, 2]
    logprobs = generation.samples[0].logprobs
    assert len(logprobs) == 4 and all(len(t.top) == 2 for t in logprobs)
    assert engine.counters.completion_tokens == 11 and engine.counters.prompt_tokens == 18


def test_a_function_chooses_by_prompt_and_seed() -> None:
    def choose(call: ScriptCall) -> Script:
        asked = call.prompt if isinstance(call.prompt, str) else call.prompt[-1].content
        return script(f"{asked} #{call.params.seed}")

    engine = ScriptedEngine(choose)
    generation = VirtualClock().run(engine.generate("Hi", SamplingParams(n=2, seed=3)))
    assert [s.text for s in generation.samples] == ["Hi #3", "Hi #4"]


def test_logprobs_only_when_asked() -> None:
    engine = ScriptedEngine([ANSWER])
    plain = VirtualClock().run(engine.generate("q", SamplingParams()))
    assert plain.samples[0].logprobs == ()
    chosen = VirtualClock().run(engine.generate("q", SamplingParams(logprobs=True)))
    assert [t.top for t in chosen.samples[0].logprobs] == [()] * 4


def test_max_tokens_cuts_a_sample_with_length() -> None:
    engine = ScriptedEngine([ANSWER])
    generation = VirtualClock().run(engine.generate("q", SamplingParams(max_tokens=2)))
    sample = generation.samples[0]
    assert (sample.text, sample.finish_reason, sample.completion_tokens) == (
        "The answer",
        "length",
        2,
    )
    # The script's last token reached exactly at the limit: the model never said it
    # had ended, so the limit did.
    whole = VirtualClock().run(engine.generate("q", SamplingParams(max_tokens=4)))
    assert whole.samples[0].finish_reason == "length"


async def _collect(engine: ScriptedEngine, params: SamplingParams) -> list[Delta | Generation]:
    return [item async for item in engine.stream("q", params)]


def test_a_stop_sequence_split_over_tokens_is_never_shown() -> None:
    engine = ScriptedEngine([script(["Yes", ".\n", "\nQuestion", ": more"])])
    params = SamplingParams(stop=("\n\nQuestion",), logprobs=True)
    items = VirtualClock().run(_collect(engine, params))
    deltas = [item for item in items if isinstance(item, Delta)]
    final = items[-1]
    assert isinstance(final, Generation)
    shown = "".join(d.text for d in deltas)
    assert shown == final.samples[0].text == "Yes."
    assert final.samples[0].finish_reason == "stop"
    # The stop's tokens were generated (and counted), their text never sent.
    assert final.samples[0].completion_tokens == 3
    # Each delta carries exactly the logprobs of the tokens behind its text.
    assert [len(d.logprobs) for d in deltas] == [1, 1]


def test_held_back_text_that_is_no_stop_sequence_is_sent_at_the_end() -> None:
    engine = ScriptedEngine([script(["Yes", ".\n"])])
    items = VirtualClock().run(_collect(engine, SamplingParams(stop=("\n\n",))))
    final = items[-1]
    assert isinstance(final, Generation)
    assert final.samples[0].text == "Yes.\n" and final.samples[0].finish_reason == "stop"


def test_the_deadline_is_checked_before_every_token() -> None:
    engine = ScriptedEngine([SLOW])
    clock = VirtualClock()
    deadline = clock.now + 1.2

    generation = clock.run(engine.generate("q", SamplingParams(), deadline))
    sample = generation.samples[0]
    # Tokens at 0.5 and 1.0 s; the third, begun before 1.2 s, ends at 1.5 s.
    assert (sample.text, sample.finish_reason) == ("one two three", "deadline")
    assert sample.timings.first_token_s == 0.5 and sample.timings.total_s == 1.5


def test_the_engine_timeout_is_a_deadline_too() -> None:
    engine = ScriptedEngine([SLOW], timeout_s=0.9)
    generation = VirtualClock().run(engine.generate("q", SamplingParams()))
    assert generation.samples[0].finish_reason == "deadline"
    assert generation.samples[0].completion_tokens == 2


def test_closing_the_stream_stops_every_sample_before_its_next_token() -> None:
    engine = ScriptedEngine([SLOW])

    async def main() -> None:
        stream = engine.stream("q", SamplingParams(n=2))
        seen = 0
        async for item in stream:
            assert isinstance(item, Delta)
            seen += 1
            if seen == 4:  # two tokens of each sample
                break
        await stream.aclose()
        assert engine.busy_slots == 0
        await asyncio.sleep(10)  # nothing goes on behind the caller's back

    VirtualClock().run(main())
    assert engine.tokens_generated == 4
    assert [s.finish_reason for s in engine.samples] == ["cancelled", "cancelled"]
    assert [s.completion_tokens for s in engine.samples] == [2, 2]


def test_cancelling_the_awaiting_task_stops_generation() -> None:
    engine = ScriptedEngine([SLOW])
    clock = VirtualClock()

    async def main() -> None:
        task = asyncio.create_task(engine.generate("q", SamplingParams()))
        await asyncio.sleep(1.25)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    clock.run(main())
    assert engine.tokens_generated == 2 and engine.busy_slots == 0
    assert engine.samples[0].finish_reason == "cancelled"


def test_a_full_queue_refuses_and_a_waiting_sample_counts_its_queue_time() -> None:
    engine = ScriptedEngine([script("a b", seconds_per_token=1.0)], concurrency=1, queue_size=1)

    async def main() -> tuple[Generation, BaseException | Generation]:
        first = asyncio.create_task(engine.generate("q", SamplingParams(n=2)))
        await asyncio.sleep(0)  # both samples taken in: one runs, one waits
        refused = await asyncio.gather(
            engine.generate("q", SamplingParams()), return_exceptions=True
        )
        return await first, refused[0]

    generation, refused = VirtualClock().run(main())
    assert isinstance(refused, EngineOverloaded) and refused.retry_after_s == 1.0
    assert engine.counters.overloads == 1
    waited = [s.timings.queue_s for s in generation.samples]
    assert waited == [0.0, 2.0]  # the second waited for the first's two tokens


def test_virtual_time_is_time_monotonic_while_it_runs() -> None:
    clock = VirtualClock(start=50.0)
    real = time.monotonic

    async def main() -> float:
        before = time.monotonic()
        await asyncio.sleep(3600)
        return time.monotonic() - before

    assert clock.run(main()) == 3600.0
    assert clock.now == 3650.0 and time.monotonic is real


@pytest.mark.parametrize("scripts", [[]])
def test_an_engine_needs_a_script(scripts: list[Script]) -> None:
    with pytest.raises(ValueError, match="at least one script"):
        ScriptedEngine(scripts)
