"""The trace bank: an engine samples each labelled question k times, with token
logprobs, into runs (evaluator.runs) that calibrators are fitted on and stopping
policies replayed over."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import msgspec

from engines.base import Engine, Generation, Message, SamplingParams
from evaluator.answers import LabelledQuestion
from evaluator.runs import Run, RunAlternative, RunSample, RunToken


async def bank(
    engine: Engine,
    questions: Sequence[LabelledQuestion],
    params: SamplingParams,
    *,
    first: int = 1,
) -> AsyncIterator[Run]:
    """One run of ``params.n`` samples per question, in order, from a started engine;
    each is yielded as soon as it is known, so that a long bank that stops keeps them.
    ``first`` is the number of ``questions[0]`` in the whole bank: a bank resumed at
    question 71 names and seeds its runs as one banked in a single go would."""
    for number, question in enumerate(questions, start=first):
        own = params
        if params.seed is not None:
            # Seeds of their own per question: with one seed list for all, sample i
            # would draw the same random numbers in every question.
            own = msgspec.structs.replace(params, seed=params.seed + (number - 1) * params.n)
        generation = await engine.generate((Message("user", question.prompt),), own)
        yield run_of(question, number, generation)


def banked_so_far(path: Path, questions: Sequence[LabelledQuestion]) -> int:
    """How many of ``questions`` a bank at ``path`` holds already, checked run by run
    against the questions so that a bank is never continued from another dataset.
    A last line cut off by a stopped bank is dropped from the file."""
    if not path.exists():
        return 0
    data = path.read_bytes()
    whole = data[: data.rfind(b"\n") + 1]
    if len(whole) < len(data):
        path.write_bytes(whole)
    decoder = msgspec.json.Decoder(Run)
    lines = whole.splitlines()
    if len(lines) > len(questions):
        raise ValueError(
            f"{path} holds {len(lines)} runs, more than the {len(questions)} questions"
        )
    for number, (line, question) in enumerate(zip(lines, questions, strict=False), start=1):
        try:
            run = decoder.decode(line)
        except msgspec.DecodeError as exc:
            raise ValueError(f"{path}:{number}: {exc}") from exc
        expected = f"{question.source or 'question'}-{number}"
        if run.id != expected or run.prompt != question.prompt:
            raise ValueError(
                f"{path}:{number}: run {run.id!r} is not question {number} of the dataset "
                f"({expected!r}); bank into a new file"
            )
    return len(lines)


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
