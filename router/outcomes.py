"""Outcome data: how well the small and the large model did on each prompt.

One JSON object per line: ``{"prompt": str, "small_correct": bool, "large_correct": bool}``;
either score may instead be a float in [0, 1] (a graded score). This is what the
router is fitted, calibrated and evaluated on. `satisfice eval collect` adds where
the prompt came from and what each model answered, which fitting ignores.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import msgspec

from engines.jsonl import read_jsonl

Score = bool | Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]


class Outcome(msgspec.Struct, frozen=True, omit_defaults=True):
    prompt: Annotated[str, msgspec.Meta(min_length=1)]
    small_correct: Score
    large_correct: Score
    # For a person reading the file: the dataset, and the answers that were graded.
    source: str = ""
    small_output: str | None = None
    large_output: str | None = None

    @property
    def small(self) -> float:
        return float(self.small_correct)

    @property
    def large(self) -> float:
        return float(self.large_correct)


class OutcomeError(ValueError):
    """An outcome file that cannot be used; the message names the file and line."""


class LoadedOutcomes(msgspec.Struct, frozen=True):
    outcomes: list[Outcome]
    skipped: list[str]  # "FILE:LINE: why", one per malformed line skipped


def read_outcomes(path: str | Path, *, skip_bad: bool = False) -> LoadedOutcomes:
    """Read an outcome file. A malformed line is an error unless ``skip_bad``, in which
    case it is skipped and reported in ``skipped``; an empty result is always an error."""
    loaded = read_jsonl(
        path, Outcome, skip_bad=skip_bad, error=OutcomeError, skip_flag="--skip-bad"
    )
    if not loaded.records:
        raise OutcomeError(f"{path}: no usable outcome lines")
    return LoadedOutcomes(loaded.records, loaded.skipped)


class _Prompt(msgspec.Struct):
    prompt: str


def read_prompts(path: str | Path) -> list[str]:
    """The prompts of a JSONL file with a "prompt" key per line (outcome and question
    files qualify); a malformed line is an error naming it."""
    return [line.prompt for line in read_jsonl(path, _Prompt, error=OutcomeError).records]
