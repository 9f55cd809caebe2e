"""The trace bank: an engine samples each labelled question k times, with token
logprobs, into runs (evaluator.runs) that calibrators are fitted on and stopping
policies replayed over."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import msgspec

from engines.base import Engine, Generation, Message, SamplingParams
from evaluator.answers import LabelledQuestion
from evaluator.runs import Run, RunAlternative, RunSample, RunToken


async def bank(
    engine: Engine, questions: Sequence[LabelledQuestion], params: SamplingParams
) -> AsyncIterator[Run]:
    """One run of ``params.n`` samples per question, in order, from a started engine;
    each is yielded as soon as it is known, so that a long bank that stops keeps them."""
    for number, question in enumerate(questions, start=1):
        own = params
        if params.seed is not None:
            # Seeds of their own per question: with one seed list for all, sample i
            # would draw the same random numbers in every question.
            own = msgspec.structs.replace(params, seed=params.seed + (number - 1) * params.n)
        generation = await engine.generate((Message("user", question.prompt),), own)
        yield run_of(question, number, generation)


def run_of(question: LabelledQuestion, number: int, generation: Generation) -> Run:
    """The run a question's generation makes, the ``number``-th of its bank."""
    return Run(
        id=f"{question.source or 'question'}-{number}",
        kind=question.kind,
        answers=question.answers,
        prompt=question.prompt,
        source=question.source,
        samples=tuple(
            RunSample(
                text=sample.text,
                logprobs=tuple(
                    RunToken(
                        t.token, t.logprob, tuple(RunAlternative(a.token, a.logprob) for a in t.top)
                    )
                    for t in sample.logprobs
                ),
                completion_tokens=sample.completion_tokens,
            )
            for sample in generation.samples
        ),
    )
