"""llama.cpp's own log lines, into Python's logging.

llama-cpp-python prints what llama.cpp logs straight to stderr, outside any log
format: in the gateway's JSON logs a bare line breaks every parser. Routed here, they
go to the logger ``satisfice.llama_cpp``: llama.cpp's warnings and errors as such, its
information (hundreds of lines per model load) as debug. A decode that
``engines.llama_prefill`` stopped on purpose is no error: llama.cpp's lines about it go
to debug too.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import re

import llama_cpp

log = logging.getLogger("satisfice.llama_cpp")

# ggml's levels (none, debug, info, warn, error) as logging's, its information as debug;
# 5 continues the last line. (llama-cpp-python's own table predates ggml's reordering.)
_LEVELS = {3: logging.WARNING, 4: logging.ERROR}
_CONTINUES = 5
# What llama.cpp logs, as errors and a warning, of a decode its abort callback stopped
# (ggml's status 1 is "aborted", llama_decode's 2 the same); only engines.llama_prefill
# sets that callback, so each of these is a stop asked for.
_STOPPED_ON_PURPOSE = re.compile(
    rb"failed with error 1$|compute status: 1$|failed to decode, ret = 2$"
    rb"|^decode: removing memory module entries"
)


@functools.cache
def route_to_logging() -> object:
    """Send llama.cpp's log to ``satisfice.llama_cpp`` from now on (the callback is the
    process's, as llama.cpp's log is; the one returned is kept alive by the cache)."""
    last = [logging.DEBUG]

    def forward(level: int, text: bytes, _: ctypes.c_void_p) -> None:
        if level != _CONTINUES:
            last[0] = _LEVELS.get(level, logging.DEBUG)
        if _STOPPED_ON_PURPOSE.search(text.rstrip()):
            last[0] = logging.DEBUG
        line = text.decode("utf-8", "replace").rstrip()
        if line and log.isEnabledFor(last[0]):
            log.log(last[0], "%s", line)

    callback = llama_cpp.llama_log_callback(forward)
    llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))
    return callback
