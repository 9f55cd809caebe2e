"""What a request asks of an answer's form, read from its tools, tool choice and
response format, as an in-process engine needs it: the tools its template shows the
model, the tools whose calls are read from the answer, and the grammar that holds the
answer to its form.

- ``response_format`` json_object or json_schema: the grammar holds the whole answer.
- ``tool_choice`` "required": one or more calls, forced by the grammar; a named
  function: one call of it.
- "auto" (or none given): the model may call or answer; its calls are read from its
  text. With a response format too, the grammar allows either.
- "none": the tools are not shown at all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import msgspec

from engines.base import CannotFollow, SamplingParams
from engines.grammars import GrammarError, calls_grammar, json_grammar

# OpenAI's parameters of a function that sets none: it takes no arguments.
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class InvalidShape(CannotFollow):
    """A request's tools, tool choice or response format cannot be followed; ``param``
    names the one to change."""


class _Function(msgspec.Struct, frozen=True):
    name: str
    parameters: dict[str, Any] | None = None


class _Tool(msgspec.Struct, frozen=True):
    function: _Function
    type: str = "function"


class _Named(msgspec.Struct, frozen=True):
    name: str


class _Choice(msgspec.Struct, frozen=True):
    function: _Named
    type: str = "function"


class _JSONSchema(msgspec.Struct, frozen=True):
    name: str = "answer"
    # Left out: any JSON object, as json_object asks.
    schema: dict[str, Any] | None = None


class _ResponseFormat(msgspec.Struct, frozen=True):
    type: str
    json_schema: _JSONSchema | None = None


class Shape(NamedTuple):
    """How one request's answer is asked for and read."""

    # The request's tools as the chat template gets them; None: the prompt shows none.
    tools: list[dict[str, Any]] | None
    # Tools whose calls are read out of the answer; empty: the answer is all text.
    names: frozenset[str]
    # GBNF the whole answer must match; None: any text.
    grammar: str | None


PLAIN = Shape(None, frozenset(), None)


def shape_of(params: SamplingParams, engine: str) -> Shape:
    """The shape ``params`` ask for; InvalidShape says what cannot be followed."""
    answer = _answer_schema(params.response_format, engine)
    # Built alone first, so that what it cannot follow is blamed on the response format.
    alone = None
    if answer is not None:
        alone = _grammar(engine, "response_format", lambda: json_grammar(answer))
    if params.tools is None:
        return Shape(None, frozenset(), alone)
    try:
        shown = msgspec.json.decode(params.tools, type=list[dict[str, Any]])
        tools = msgspec.json.decode(params.tools, type=list[_Tool])
    except msgspec.ValidationError as exc:
        raise InvalidShape(engine, "tools", str(exc)) from None
    choice = _choice(params.tool_choice, engine)
    if choice == "none" or not tools:
        return Shape(None, frozenset(), alone)
    names = frozenset(t.function.name for t in tools)
    specs = [(t.function.name, t.function.parameters or _NO_PARAMETERS) for t in tools]
    if choice == "auto":
        if answer is None:
            return Shape(shown, names, None)
        grammar = _grammar(engine, "tools", lambda: calls_grammar(specs, True, answer))
        return Shape(shown, names, grammar)
    if isinstance(choice, str):  # "required"
        return Shape(shown, names, _grammar(engine, "tools", lambda: calls_grammar(specs, True)))
    wanted = choice.function.name
    named = [spec for spec in specs if spec[0] == wanted]
    if not named:
        message = f"names {wanted!r}, which is not one of the tools"
        raise InvalidShape(engine, "tool_choice", message)
    return Shape(shown, names, _grammar(engine, "tools", lambda: calls_grammar(named, False)))


def _answer_schema(text: str | None, engine: str) -> dict[str, Any] | None:
    """The schema a response format holds the answer to; None: free text."""
    if text is None:
        return None
    try:
        form = msgspec.json.decode(text, type=_ResponseFormat)
    except msgspec.ValidationError as exc:
        raise InvalidShape(engine, "response_format", str(exc)) from None
    if form.type == "text":
        return None
    if form.type == "json_object":
        return {"type": "object"}
    if form.type == "json_schema" and form.json_schema is not None:
        return form.json_schema.schema or {"type": "object"}
    raise InvalidShape(engine, "response_format", f"type {form.type!r} is not supported")


def _choice(text: str | None, engine: str) -> str | _Choice:
    if text is None:
        return "auto"
    try:
        choice = msgspec.json.decode(text, type=str | _Choice)
    except msgspec.ValidationError as exc:
        raise InvalidShape(engine, "tool_choice", str(exc)) from None
    if isinstance(choice, str) and choice not in ("none", "auto", "required"):
        raise InvalidShape(engine, "tool_choice", f"{choice!r} is not none, auto or required")
    return choice


def _grammar(engine: str, param: str, build: Callable[[], str]) -> str:
    try:
        return build()
    except GrammarError as exc:
        raise InvalidShape(engine, param, str(exc)) from None
