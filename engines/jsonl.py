"""JSON Lines read into typed records, each bad line named by its number.

Outcome, run, question, pair and warm-up files all share this shape, and each used to
read it with a loop of its own. A shared lowest-level module: it imports nothing of
ours, so every package may import it (README, "Develop").
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Generic, TypeVar

import msgspec

T = TypeVar("T")


class JsonlError(ValueError):
    """A JSON Lines file that cannot be used; the message names the file and line."""


class BadLine(msgspec.Struct, frozen=True):
    line: int  # 1-based, counting blank lines
    error: str


def decode_lines(lines: Iterable[bytes], kind: type[T]) -> Iterator[T | BadLine]:
    """Each non-blank line as a ``kind``, or as the ``BadLine`` that says why it is not
    one; lazily, so that a caller who stops at the first bad line reads no further."""
    decoder = msgspec.json.Decoder(kind)
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            yield decoder.decode(line)
        except msgspec.DecodeError as exc:
            yield BadLine(number, str(exc))
        except RecursionError:  # the parser's own limit: a bad line, not a crash
            yield BadLine(number, "arrays or objects nested too deeply")


class Loaded(msgspec.Struct, Generic[T], frozen=True):
    records: list[T]
    skipped: list[str]  # "FILE:LINE: why", one per malformed line skipped


def read_jsonl(
    path: str | Path,
    kind: type[T],
    *,
    skip_bad: bool = False,
    error: type[ValueError] = JsonlError,
    skip_flag: str | None = None,
) -> Loaded[T]:
    """The ``kind`` records of a file. A malformed line raises ``error`` naming
    FILE:LINE (and ``skip_flag``, the caller's command-line option for ``skip_bad``)
    unless ``skip_bad``: then it is skipped and listed in ``skipped``. An unreadable
    file raises ``error`` too; an empty one is the caller's to judge."""
    hint = "" if skip_flag is None else f" (pass {skip_flag} to skip malformed lines)"
    records: list[T] = []
    skipped: list[str] = []
    try:
        with Path(path).open("rb") as file:
            for item in decode_lines(file, kind):
                if not isinstance(item, BadLine):
                    records.append(item)
                    continue
                problem = f"{path}:{item.line}: {item.error}"
                if not skip_bad:
                    raise error(f"{problem}{hint}")
                skipped.append(problem)
    except OSError as exc:
        raise error(f"{path}: cannot read: {exc}") from exc
    return Loaded(records, skipped)
