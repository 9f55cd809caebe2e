"""Stop sequences over streamed text."""

from __future__ import annotations


class StopMatcher:
    """Finds stop sequences in text that arrives piece by piece.

    Text that could still turn out to be the start of a stop sequence is held back,
    so a stream never shows a client part of a stop sequence it then cuts off.
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Return the text that is safe to emit and whether a stop sequence ended it."""
        held = self._held + text
        # Generation stops where the first stop sequence is complete: the earliest end
        # wins, whichever pieces the text arrived in.
        found = [(i + len(s), i) for s in self._stops if (i := held.find(s)) >= 0]
        if found:
            self._held = ""
            return held[: min(found)[1]], True
        keep = self._partial_suffix(held)
        self._held = held[len(held) - keep :] if keep else ""
        return held[: len(held) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that begins some stop sequence."""
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
