"""Surface features of a prompt's text that an embedding does not carry well.

Sentence embeddings say what a prompt is about; how hard it is also shows in how
long it is, how many quantities it juggles and how many operations its words ask
for (a word problem with six numbers and "each ... per ... twice" takes more steps
than one with two numbers). The logistic scorer uses both.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

FEATURES = (
    "log_chars",
    "log_words",
    "log_numbers",
    "log_distinct_numbers",
    "sentences",
    "percent_or_currency",
    "log_largest_number",
    "decimals",
    "log_operation_words",
    "commas",
    "log_capitalised_words",
)

_NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")
# Words that each stand for a step of arithmetic in a word problem.
_OPERATION = re.compile(
    r"\b(each|per|every|times|twice|half|percent|total|remaining|left|more than|less than"
    r"|fewer|average|ratio|fraction|third|quarter|double|triple)\b",
    re.IGNORECASE,
)
_CAPITALISED = re.compile(r"\b[A-Z][a-z]+")


def text_features(prompts: Sequence[str]) -> npt.NDArray[np.float64]:
    rows = []
    for prompt in prompts:
        numbers = [float(n.replace(",", "")) for n in _NUMBER.findall(prompt)]
        rows.append(
            [
                np.log1p(len(prompt)),
                np.log1p(len(prompt.split())),
                np.log1p(len(numbers)),
                np.log1p(len(set(numbers))),
                prompt.count("."),
                prompt.count("%") + prompt.count("$"),
                np.log1p(max(numbers, default=0.0)),
                sum(1 for n in numbers if n != int(n)),
                np.log1p(len(_OPERATION.findall(prompt))),
                prompt.count(","),
                np.log1p(len(_CAPITALISED.findall(prompt))),
            ]
        )
    return np.array(rows, dtype=np.float64).reshape(-1, len(FEATURES))
