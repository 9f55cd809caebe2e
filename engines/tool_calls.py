"""Tool calls in the Hermes/Qwen markup, read from generated text as it streams.

Qwen2.5's chat template (and Hermes-style ones) asks for each call as
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``. ``CallParser`` turns
a sample's text into the text outside that markup and the calls inside it, piece by
piece: text streams on at once but for what could still be the start of the markup,
and a call's arguments stream as the model writes them.

Qwen2.5-Coder's 0.5B and 1.5B, offered tools without being made to call one, answer
with the call's JSON alone, bare or in a ```json fence, without the tags (every call of
bench/structured_output.py's tool_choice auto prompts). With ``bare`` on, an answer
that opens that way with a tool of the request is read as a call too (once, at its
start); anything else there is text at once, so only an answer that begins like a call
waits to be read.

Markup the request's tools cannot explain (JSON that does not parse, a tool the request
did not offer) is text: the client sees what the model wrote, and the sample ends as
plain text would. The decision is made as soon as the call's name is read; from then on
the call stands, its arguments as the model writes them (a sample cut short by
``max_tokens`` ends with them unfinished, as OpenAI's do).
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable, Collection, Sequence
from typing import Any, Literal

import msgspec

from engines.base import ToolCall, ToolCallDelta

OPEN = "<tool_call>"
CLOSE = "</tool_call>"

_ID_ALPHABET = string.ascii_letters + string.digits

# What a call opens with, in the order Qwen's template writes it; None is the name.
_OPENING: tuple[str | None, ...] = ("{", '"name"', ":", None, ",", '"arguments"', ":")

_Mode = Literal["start", "text", "opening", "arguments", "closing", "whole"]

# The fences a bare call may come in at the answer's start.
_FENCES = ("```json\n", "```\n")


def new_call_id() -> str:
    """An id in OpenAI's form: ``call_`` and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


class _Call:
    """The call being read: its id, name and the arguments' text so far."""

    __slots__ = ("arguments", "id", "index", "name")

    def __init__(self, index: int, id: str, name: str) -> None:
        self.index = index
        self.id = id
        self.name = name
        self.arguments: list[str] = []

    def done(self) -> ToolCall:
        return ToolCall(self.id, self.name, "".join(self.arguments))


class CallParser:
    """Splits a sample's text into plain text and calls of the tools ``names``.

    ``feed`` takes each new piece of text and returns the text and call parts that are
    final now; ``finish`` returns what is left at the sample's end. The whitespace
    around a run of calls is the markup's: text after the run gets only what was
    before it ("Let me look.\n<tool_call>...</tool_call>\n\nDone." reads as
    "Let me look.\nDone."), and nothing when no text follows.
    """

    def __init__(
        self,
        names: Collection[str],
        bare: bool = False,
        new_id: Callable[[], str] = new_call_id,
    ) -> None:
        self._names = frozenset(names)
        self._new_id = new_id
        self._mode: _Mode = "start" if bare else "text"
        self._held = ""  # text read but not decided yet
        # What ends the call being read after its JSON: the closing tag, a bare call's
        # fence, or nothing; and whether the call's own "}" was read.
        self._closer = CLOSE
        self._braced = False
        self._gap = ""  # whitespace before the markup being read: text again if it is text
        self._after_call = False  # whitespace that follows a call is dropped
        self._space = ""  # the whitespace before the run of calls, for text after it
        self._call: _Call | None = None
        self._calls: list[ToolCall] = []
        # Where the arguments' JSON stands: nesting depth, inside a string, after a "\".
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._text: list[str] = []  # what this feed gives out
        self._parts: list[ToolCallDelta] = []

    @property
    def calls(self) -> tuple[ToolCall, ...]:
        """The calls read so far, finished or (after ``finish``) cut short."""
        return tuple(self._calls)

    def feed(self, text: str) -> tuple[str, tuple[ToolCallDelta, ...]]:
        """The text and call parts that ``text`` makes final."""
        self._held += text
        while self._step():
            pass
        return self._take()

    def finish(self) -> tuple[str, tuple[ToolCallDelta, ...]]:
        """What is left at the sample's end: held text, and the call it cut short."""
        mode, held = self._mode, self._held
        self._held = ""
        if mode in ("start", "text"):
            self._say(held)
        elif mode in ("opening", "whole"):
            self._whole(held)
        else:  # the call stands, finished or not
            self._end_call()
        self._mode = "text"
        return self._take()

    def _step(self) -> bool:
        """Read what the current mode can decide; False: it needs more text."""
        if self._mode == "start":
            return self._read_start()
        if self._mode == "text":
            return self._read_text()
        if self._mode == "opening":
            return self._read_opening()
        if self._mode == "arguments":
            return self._read_arguments()
        if self._mode == "closing":
            return self._read_closing()
        return self._read_whole()

    def _read_text(self) -> bool:
        held = self._held
        start = held.find(OPEN)
        if start >= 0:
            before = held[:start]
            text = before.rstrip()
            self._gap = before[len(text) :]
            self._say(text)
            self._held = held[start + len(OPEN) :]
            self._mode = "opening"
            return True
        # Hold back what could be the start of the markup, and the whitespace before it.
        keep = _partial_suffix(held, OPEN)
        text = held[: len(held) - keep].rstrip()
        self._say(text)
        self._held = held[len(text) :]
        return False

    def _read_start(self) -> bool:
        found, name, end, fence = _bare_opening(self._held)
        if found == "more":
            return False
        if found == "call" and name in self._names:
            self._open_call(name, end, "```" if fence else "")
        else:  # text, which may still hold tagged calls
            self._mode = "text"
        return True

    def _read_opening(self) -> bool:
        found, name, end = _opening(self._held)
        if found == "more":
            return False
        if found == "no":  # another order or shape: read the call whole at its end
            self._mode = "whole"
            return True
        if name not in self._names:  # not a call of this request's tools: text
            self._say(self._gap + OPEN + self._held[:end])
            self._held = self._held[end:]
            self._mode = "text"
            return True
        self._open_call(name, end, CLOSE)
        return True

    def _open_call(self, name: str, end: int, closer: str) -> None:
        """A call of ``name`` opens; its arguments start at ``held[end]``."""
        if not self._after_call:  # the first of a run of calls
            self._space = self._gap
        self._call = _Call(len(self._calls), self._new_id(), name)
        self._parts.append(ToolCallDelta(self._call.index, self._call.id, name))
        self._depth, self._in_string, self._escaped = 0, False, False
        self._closer, self._braced = closer, False
        self._held = self._held[end:]
        self._mode = "arguments"

    def _read_arguments(self) -> bool:
        held = self._held
        end = self._arguments_end(held)
        self._arguments(held if end < 0 else held[:end])
        self._held = "" if end < 0 else held[end:]
        if end < 0:
            return False
        self._mode = "closing"
        return True

    def _read_closing(self) -> bool:
        # After the arguments: the call's own "}", then its closer; anything else ends
        # the call there and is text again.
        if not self._braced:
            rest = self._held.lstrip()
            if not rest:
                return False
            if rest.startswith("}"):
                self._braced = True
                self._held = rest[1:]
        closer = self._closer
        if closer:
            rest = self._held.lstrip()
            if not rest or (closer.startswith(rest) and rest != closer):
                return False
            self._held = rest[len(closer) :] if rest.startswith(closer) else rest
        self._end_call()
        self._mode = "text"
        return True

    def _read_whole(self) -> bool:
        end = self._held.find(CLOSE)
        if end < 0:
            return False
        body = self._held[:end]
        self._held = self._held[end + len(CLOSE) :]
        self._whole(body, closed=True)
        self._mode = "text"
        return True

    def _whole(self, body: str, closed: bool = False) -> None:
        """A call read whole: one part with its id, name and arguments; or, when it
        is no call of this request's tools, its markup as text."""
        call = _whole_call(body, self._names)
        if call is None:
            self._say(self._gap + OPEN + body + (CLOSE if closed else ""))
            return
        name, arguments = call
        self._call = _Call(len(self._calls), self._new_id(), name)
        self._call.arguments.append(arguments)
        self._parts.append(ToolCallDelta(self._call.index, self._call.id, name, arguments))
        self._end_call()

    def _end_call(self) -> None:
        if self._call is not None:
            self._calls.append(self._call.done())
            self._call = None
            self._after_call = True

    def _arguments_end(self, text: str) -> int:
        """Where the arguments' JSON value ends in ``text`` (-1: not in it); the nesting
        state carries over to the next piece."""
        depth, in_string, escaped = self._depth, self._in_string, self._escaped
        end = -1
        for at, char in enumerate(text):
            if in_string:
                if escaped:
                    escaped = False
                elif char == "\\":
                    escaped = True
                elif char == '"':
                    in_string = False
            elif char == '"':
                in_string = True
            elif char in "{[":
                depth += 1
            elif char in "}]":
                depth -= 1
                if depth == 0:
                    end = at + 1
                    break
        self._depth, self._in_string, self._escaped = depth, in_string, escaped
        return end

    def _arguments(self, piece: str) -> None:
        call = self._call
        if not piece or call is None:
            return
        call.arguments.append(piece)
        last = self._parts[-1] if self._parts else None
        if last is not None and last.index == call.index:  # one part per call per feed
            self._parts[-1] = msgspec.structs.replace(last, arguments=last.arguments + piece)
        else:
            self._parts.append(ToolCallDelta(call.index, arguments=piece))

    def _say(self, text: str) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            text, self._space, self._after_call = self._space + text, "", False
        if text:
            self._text.append(text)

    def _take(self) -> tuple[str, tuple[ToolCallDelta, ...]]:
        text, parts = "".join(self._text), tuple(self._parts)
        self._text.clear()
        self._parts.clear()
        return text, parts


def _partial_suffix(text: str, markup: str) -> int:
    """Length of the longest end of ``text`` that begins ``markup``."""
    for length in range(min(len(markup) - 1, len(text)), 0, -1):
        if text.endswith(markup[:length]):
            return length
    return 0


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def _string_end(text: str, at: int) -> int:
    """Where the JSON string opening at ``text[at]`` ends (after its quote); -1: not
    in ``text`` yet."""
    escaped = False
    for end in range(at + 1, len(text)):
        char = text[end]
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == '"':
            return end + 1
    return -1


def _opening(text: str) -> tuple[Literal["more", "no", "call"], str, int]:
    """Whether ``text`` opens a call as Qwen's template writes it, up to the ``{`` of
    its arguments: "call" with the name and where the arguments start, "more" when
    it may still, "no" when it cannot."""
    at, name = 0, ""
    for part in _OPENING:
        at = _skip_space(text, at)
        if at == len(text):
            return "more", "", 0
        if part is None:
            if text[at] != '"':
                return "no", "", 0
            end = _string_end(text, at)
            if end < 0:
                return "more", "", 0
            try:
                name = json.loads(text[at:end])
            except ValueError:
                return "no", "", 0
            at = end
            continue
        seen = text[at : at + len(part)]
        if seen != part:
            cut_short = at + len(seen) == len(text) and part.startswith(seen)
            return ("more" if cut_short else "no"), "", 0
        at += len(part)
    at = _skip_space(text, at)
    if at == len(text):
        return "more", "", 0
    return ("call", name, at) if text[at] == "{" else ("no", "", 0)


def _bare_opening(text: str) -> tuple[Literal["more", "no", "call"], str, int, str]:
    """``_opening`` of a call written bare at the answer's start, maybe fenced; also
    the fence it opens with ("" for none)."""
    at = _skip_space(text, 0)
    rest = text[at:]
    if not rest:
        return "more", "", 0, ""
    fence = ""
    if rest.startswith("`"):
        fence = next((f for f in _FENCES if rest.startswith(f)), "")
        if not fence:
            maybe = any(f.startswith(rest) for f in _FENCES)
            return ("more" if maybe else "no"), "", 0, ""
    found, name, end = _opening(rest[len(fence) :])
    return found, name, at + len(fence) + end, fence


def _whole_call(body: str, names: frozenset[str]) -> tuple[str, str] | None:
    """The name and arguments' JSON text of a call's markup read whole, in any order
    of its keys and with arguments written as a JSON string too; None: no call of
    ``names``."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or call.get("name") not in names:
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return call["name"], json.dumps(arguments, ensure_ascii=False)


def renders_tool_calls(render: Callable[[Sequence[dict[str, Any]], list[Any] | None], str]) -> bool:
    """Whether a chat template (``render(messages, tools)``) offers the tools it is given
    and writes a conversation's calls in the markup ``CallParser`` reads: a model
    trained on that template answers in it."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "lookup_probe",
                "description": "Looks a query up.",
                "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
            },
        }
    ]
    ask: dict[str, Any] = {"role": "user", "content": "Look it up."}
    call = {"name": "lookup_probe", "arguments": {"query": "probe"}}
    history: list[dict[str, Any]] = [
        ask,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "call_probe", "type": "function", "function": call}],
        },
        {"role": "tool", "content": "found", "tool_call_id": "call_probe"},
    ]
    try:
        offered, plain, answered = render([ask], tools), render([ask], None), render(history, tools)
    except Exception:  # a template that cannot take tools or tool turns at all
        return False
    written = re.search(
        re.escape(OPEN)
        + r'\s*\{"name":\s*"lookup_probe",\s*"arguments":\s*\{"query":\s*"probe"\}\}\s*'
        + re.escape(CLOSE),
        answered,
    )
    return "lookup_probe" in offered and "lookup_probe" not in plain and written is not None
