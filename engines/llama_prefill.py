"""Reading a prompt within its deadline: how fast a model instance reads prompts, and
stopping llama.cpp in the middle of one.

Generation checks for a cancel and the deadline between tokens, but the prompt is read
in one ``llama_decode`` per 512 tokens, seconds each on a CPU: a long prompt with a
short deadline, or whose client left, kept its slot for as long as the whole prompt
took. llama.cpp asks an abort callback between any two nodes of its compute graph (a
few milliseconds apart); while a prompt is read, that callback says whether to stop,
and ``llama_decode`` then returns 2. Before reading, the speed measured on earlier
prompts says whether the prompt can be read in time at all, so one that cannot is
refused at once instead of holding the slot until the deadline.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterator

import llama_cpp

# Reads shorter than this are mostly fixed cost and say little about the speed.
_MEASURED_FROM_TOKENS = 64
# The speeds of the last reads kept; the fastest of them decides (below).
_SPEEDS_KEPT = 8
_NO_CALLBACK = llama_cpp.ggml_abort_callback()


class PrefillSpeed:
    """How many prompt tokens a second one model instance has read lately."""

    def __init__(self) -> None:
        self._recent: deque[float] = deque(maxlen=_SPEEDS_KEPT)

    @property
    def tokens_per_s(self) -> float | None:
        """The fastest recent read: the CPU is shared with other slots and engines, so a
        read is often slower than the next one can be; judged by the fastest, a prompt
        is refused only when even that speed could not read it in time."""
        return max(self._recent, default=None)

    def note(self, tokens: int, seconds: float) -> None:
        if tokens >= _MEASURED_FROM_TOKENS and seconds > 0:
            self._recent.append(tokens / seconds)

    def cannot_read(self, tokens: int, deadline: float | None) -> bool:
        """Whether ``tokens`` more prompt tokens cannot be read before ``deadline``
        (``time.monotonic()`` seconds), at the fastest recent speed. Unknown until a
        prompt of some length has been read: then the abort callback stops it."""
        speed = self.tokens_per_s
        if deadline is None or speed is None or tokens < _MEASURED_FROM_TOKENS:
            return False
        return tokens / speed > deadline - time.monotonic()


@contextlib.contextmanager
def interruptible(ctx: llama_cpp.llama_context_p, stop: Callable[[], bool]) -> Iterator[None]:
    """Within the block, a ``llama_decode`` on ``ctx`` stops (returning 2) once ``stop()``
    is true. Only around a prompt's reading: the callback takes the GIL at every node,
    which costs nothing next to reading 512 tokens but would slow each generated one."""

    def asked(_: object) -> bool:
        return stop()

    callback = llama_cpp.ggml_abort_callback(asked)  # kept alive by this frame
    llama_cpp.llama_set_abort_callback(ctx, callback, None)
    try:
        yield
    finally:
        llama_cpp.llama_set_abort_callback(ctx, _NO_CALLBACK, None)


def past(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline
