"""Labelled runs: a question, its gold answers and the samples a model gave for it.

What the calibrator is fitted on and what the trace bank writes, one JSON object per
line::

    {"id": "gsm8k-17", "kind": "number", "answers": ["18"],
     "samples": [{"text": "... The answer is 18.",
                  "logprobs": [["18", -0.02, [["18", -0.02], ["16", -4.1]]], ...]}]}

A token is ``[token, logprob, [[alternative, logprob], ...]]`` (the alternatives may be
left out), so that a bank of thousands of samples stays a readable size.
"""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Annotated

import msgspec

from engines.jsonl import read_jsonl
from evaluator.answers import AnswerKind, LabelledQuestion


class RunAlternative(msgspec.Struct, frozen=True, array_like=True):
    token: str
    logprob: float


class RunToken(msgspec.Struct, frozen=True, array_like=True):
    token: str
    logprob: float
    top: tuple[RunAlternative, ...] = ()


class RunSample(msgspec.Struct, frozen=True, kw_only=True):
    text: str
    logprobs: tuple[RunToken, ...] = ()
    # Tokens the sample cost; None where the source did not say.
    completion_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = None


class Run(msgspec.Struct, frozen=True, kw_only=True):
    id: Annotated[str, msgspec.Meta(min_length=1)]
    kind: AnswerKind
    answers: Annotated[list[str], msgspec.Meta(min_length=1)]  # gold, aliases for text
    samples: Annotated[tuple[RunSample, ...], msgspec.Meta(min_length=1)]
    prompt: str = ""
    source: str = ""

    @property
    def question(self) -> LabelledQuestion:
        return LabelledQuestion(self.prompt, self.answers, self.kind, self.source)


class RunFileError(ValueError):
    """A runs file that cannot be used; the message names the file and line."""


class LoadedRuns(msgspec.Struct, frozen=True):
    runs: list[Run]
    skipped: list[str]  # "FILE:LINE: why", one per malformed line skipped


def read_runs(path: str | Path, *, skip_bad: bool = False) -> LoadedRuns:
    """Read a runs file. A malformed line is an error unless ``skip_bad``, in which case
    it is skipped and reported; a file with no usable run is always an error."""
    loaded = read_jsonl(path, Run, skip_bad=skip_bad, error=RunFileError, skip_flag="--skip-bad")
    if not loaded.records:
        raise RunFileError(f"{path}: no usable runs")
    return LoadedRuns(loaded.records, loaded.skipped)


def write_runs(runs: list[Run], path: str | Path) -> None:
    encoder = msgspec.json.Encoder()
    with Path(path).open("wb") as out:
        for run in runs:
            out.write(encoder.encode(run) + b"\n")


def take_per_source(runs: Iterable[Run], count: int, skip: int = 0) -> list[Run]:
    """``count`` runs of each source, in order, after that source's first ``skip``: a
    second benchmark run with ``skip`` set asks other questions than the first."""
    seen: Counter[str] = Counter()
    chosen = []
    for run in runs:
        seen[run.source] += 1
        if skip < seen[run.source] <= skip + count:
            chosen.append(run)
    return chosen


def split_by_source(runs: Sequence[Run], share: float, seed: int) -> tuple[list[Run], list[Run]]:
    """(fitting, held out): ``share`` of each source's runs, rounded, held out."""
    by_source: dict[str, list[Run]] = defaultdict(list)
    for run in runs:
        by_source[run.source].append(run)
    fitting: list[Run] = []
    held: list[Run] = []
    for source in sorted(by_source):
        shuffled = list(by_source[source])
        # Seeded by the source too, so adding a source leaves the others' split alone.
        random.Random(f"{seed}:{source}").shuffle(shuffled)
        cut = round(len(shuffled) * share)
        held.extend(shuffled[:cut])
        fitting.extend(shuffled[cut:])
    return fitting, held
