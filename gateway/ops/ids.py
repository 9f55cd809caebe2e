"""Random ids for requests and responses, from the OS's random source a page at a time:
asked for 16 bytes per id, it costs a system call each, which in a virtual machine
was a tenth of an exact hit's time."""

from __future__ import annotations

import os
import threading

_PAGE = 4096


class RandomHex:
    """32 hex digits (128 random bits) per call, as uuid4().hex gives, from a buffer of
    os.urandom refilled a page at a time. Safe across threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buffer = b""
        self._at = 0

    def __call__(self) -> str:
        with self._lock:
            if self._at + 16 > len(self._buffer):
                self._buffer, self._at = os.urandom(_PAGE), 0
            start = self._at
            self._at += 16
            return self._buffer[start : self._at].hex()
