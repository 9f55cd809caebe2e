"""Outcome collection: both engines answer each labelled question once, greedily, and
each answer is graded. What the router learns where the large model is needed from
(the gateway writes these as the router's outcome records)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import msgspec

from engines.base import Engine, Message, SamplingParams
from evaluator.answers import LabelledQuestion, is_correct


class GradedPair(msgspec.Struct, frozen=True, kw_only=True):
    """One question, answered by the small and the large engine, each answer graded."""

    prompt: str
    source: str
    small_output: str
    large_output: str
    small_correct: bool
    large_correct: bool


async def collect(
    small: Engine, large: Engine, questions: Sequence[LabelledQuestion], params: SamplingParams
) -> AsyncIterator[GradedPair]:
    """Each question's graded answers from two started engines, asked one after the
    other; yielded as soon as both answered, so that a long collection that stops keeps
    them. Not at the same time: two in-process llama.cpp engines would share the cores,
    and their threads spin while they wait for each other (several times slower)."""
    for question in questions:
        prompt = (Message("user", question.prompt),)
        answers = [await small.generate(prompt, params), await large.generate(prompt, params)]
        yield GradedPair(
            prompt=question.prompt,
            source=question.source,
            small_output=answers[0].text,
            large_output=answers[1].text,
            small_correct=is_correct(question, answers[0].text),
            large_correct=is_correct(question, answers[1].text),
        )
