"""GBNF grammars that hold an answer to a JSON schema, or to calls of a request's tools.

llama.cpp constrains sampling to a grammar token by token, so an answer under one is
valid by construction rather than checked after the fact. llama-cpp-python's converter
turns a JSON schema into GBNF; it leaves out integer bounds, which are added here
(a rating from 1 to 5 is the common case of a schema a small model breaks).

Building is cheap (about 0.2 ms for a nested schema, and llama.cpp parses the result in
0.04 ms on these cores), so grammars are built per request and nothing is cached.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import llama_cpp
from llama_cpp.llama_grammar import RESERVED_NAMES, SchemaConverter

from engines.tool_calls import CLOSE, OPEN

# The converter writes integers of at most 16 digits; so do bounds without an end.
_MAX_DIGITS = 16

# Keywords that make an integer schema more than its bounds: the converter's own.
_NOT_JUST_BOUNDS = ("enum", "const", "$ref", "anyOf", "oneOf", "allOf")


class GrammarError(ValueError):
    """A schema no grammar can be built for; the message says why."""


# llama-cpp-python's converter is untyped: its calls below are marked as such.
class _Converter(SchemaConverter):
    """llama-cpp-python's converter, with integer bounds (``minimum``, ``maximum`` and
    their exclusive forms) written into the grammar."""

    def __init__(self) -> None:
        super().__init__(  # type: ignore[no-untyped-call]
            prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False
        )

    def visit(self, schema: dict[str, Any], name: str) -> str:
        bounds = _integer_bounds(schema)
        if bounds is None:
            return str(super().visit(schema, name))  # type: ignore[no-untyped-call]
        rule_name = name + "-" if name in RESERVED_NAMES else name or "root"
        return self.rule(rule_name, f"({integer_range(*bounds)}) space")

    def rule(self, name: str, body: str) -> str:
        """Add a rule of our own; its name (made unique if taken)."""
        return str(self._add_rule(name, body))  # type: ignore[no-untyped-call]

    def schema(self, schema: Mapping[str, Any], name: str) -> str:
        """Add the rules of one schema under ``name``; the rule of its value."""
        # resolve_refs rewrites "$ref"s in place, keyed by ``name``: a copy of its own.
        own = json.loads(json.dumps(schema))
        return self.visit(self.resolve_refs(own, name), name)


# The converter writes out every repetition a schema allows: maxLength: 10**9 (a body
# of forty bytes) took 19 GB and a minute before it was stopped. Counts are bounded
# before it starts; a pattern's quantifiers multiply where they nest, so theirs are
# bounded as a product.
MAX_REPETITIONS = 1000
# An enum is one alternative per value, and each step of decoding that breaks the
# grammar filters the vocabulary against all of them: 20,000 values took 34 s for 24
# tokens. OpenAI's structured outputs allow 1,000 values; so does this.
MAX_ENUM_VALUES = 1000
# Values, not schemas: nothing in them is a count to bound.
_DATA = frozenset({"enum", "const", "default", "examples"})
_COUNTS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties",
           "maxProperties", "minContains", "maxContains")  # fmt: skip
_QUANTIFIER = re.compile(r"\{(\d+)(?:,(\d*))?\}")


def check_bounded(schema: object, where: str = "schema") -> None:
    """Raise GrammarError where ``schema`` asks for more repetitions (or enum values)
    than a grammar is written out for."""
    if isinstance(schema, list):
        for i, part in enumerate(schema):
            check_bounded(part, f"{where}[{i}]")
        return
    if not isinstance(schema, Mapping):
        return
    for key, value in schema.items():
        if key == "enum" and isinstance(value, list) and len(value) > MAX_ENUM_VALUES:
            raise GrammarError(
                f"{where}.enum has {len(value)} values; a grammar is written for at most "
                f"{MAX_ENUM_VALUES}"
            )
        if key in _DATA:
            continue
        if key in _COUNTS and isinstance(value, int) and value > MAX_REPETITIONS:
            raise GrammarError(
                f"{where}.{key} is {value}; a grammar is written for at most "
                f"{MAX_REPETITIONS} repetitions"
            )
        if key == "pattern" and isinstance(value, str):
            product = 1
            for low, high in _QUANTIFIER.findall(value):
                product *= max(int(low), int(high or 0))
            if product > MAX_REPETITIONS:
                raise GrammarError(
                    f"{where}.pattern repeats {product} times where its quantifiers "
                    f"nest; a grammar is written for at most {MAX_REPETITIONS}"
                )
        check_bounded(value, f"{where}.{key}")


def json_grammar(schema: Mapping[str, Any]) -> str:
    """A grammar of one JSON value that holds to ``schema``."""
    check_bounded(schema)
    converter = _Converter()
    _converted(lambda: converter.rule("root", converter.schema(schema, "answer")))
    return str(converter.format_grammar())  # type: ignore[no-untyped-call]


def calls_grammar(
    tools: Sequence[tuple[str, Mapping[str, Any]]],
    many: bool,
    answer: Mapping[str, Any] | None = None,
) -> str:
    """A grammar of calls of ``tools`` (name, parameters' schema) in Qwen's markup: one
    call, or (``many``) one or more; with ``answer``, a JSON value of that schema is
    the other way to answer."""
    for name, parameters in tools:
        check_bounded(parameters, f"{name}.parameters")
    if answer is not None:
        check_bounded(answer)
    converter = _Converter()

    def build() -> None:
        calls = []
        for at, (name, parameters) in enumerate(tools):
            arguments = converter.schema(parameters, f"tool{at}-arguments")
            opening = f'{OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '
            body = f"{_literal(opening)} {arguments} {_literal('}' + chr(10) + CLOSE)}"
            calls.append(converter.rule(f"tool{at}-call", body))
        call = converter.rule("tool-call", " | ".join(calls))
        root = f'{call} ("\\n" {call})*' if many else call
        if answer is not None:
            root = f"{root} | {converter.schema(answer, 'answer')}"
        converter.rule("root", root)

    _converted(build)
    return str(converter.format_grammar())  # type: ignore[no-untyped-call]


# llama.cpp's grammar parser recurses once per nested group: a schema that asks for
# tens of thousands of repetitions (a pattern's a{1,20000}, minItems: 50000) nests as
# deep, and the parser overflowed the worker's stack and killed the process (seen here
# at 20,000 and 50,000 deep; 2,000 and 10,000 were refused cleanly). Refused before.
MAX_GRAMMAR_DEPTH = 1000
MAX_GRAMMAR_CHARS = 256 * 1024


def check_grammar(vocab: llama_cpp.llama_vocab_p, grammar: str) -> None:
    """Raise GrammarError unless llama.cpp parses ``grammar`` (it would otherwise hand
    a null sampler to the sampler chain), and before it tries, unless the grammar is
    small and shallow enough for its parser to try safely."""
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise GrammarError(
            f"the schema makes a grammar of {len(grammar)} characters; this engine takes "
            f"at most {MAX_GRAMMAR_CHARS} (ask for fewer repetitions or properties)"
        )
    depth = nesting(grammar)
    if depth > MAX_GRAMMAR_DEPTH:
        raise GrammarError(
            f"the schema makes a grammar nested {depth} deep; this engine takes at most "
            f"{MAX_GRAMMAR_DEPTH} (bound repetitions such as minItems, maxLength or a "
            "pattern's {m,n} lower)"
        )
    sampler = llama_cpp.llama_sampler_init_grammar(vocab, grammar.encode("utf-8"), b"root")
    if not sampler:
        raise GrammarError("llama.cpp could not parse the grammar built for it")
    llama_cpp.llama_sampler_free(sampler)


def _converted(build: Callable[[], object]) -> None:
    try:
        build()
    except GrammarError:
        raise
    # The converter signals a schema it cannot follow with assertions and with whatever
    # its code trips on; either way the schema is what the client must change.
    except Exception as exc:
        raise GrammarError(f"unsupported JSON schema: {exc}") from exc


def _literal(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + escaped.replace("\n", "\\n").replace("\r", "\\r") + '"'


def _integer_bounds(schema: Mapping[str, Any]) -> tuple[int | None, int | None] | None:
    """The inclusive bounds of an integer schema that sets any; None otherwise."""
    if schema.get("type") != "integer" or any(key in schema for key in _NOT_JUST_BOUNDS):
        return None
    low, high = schema.get("minimum"), schema.get("maximum")
    low = None if low is None else math.ceil(low)
    high = None if high is None else math.floor(high)
    # Draft 4 spells exclusive bounds as booleans beside the bound; later drafts as numbers.
    above, below = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
    if above is True and low is not None and low == schema["minimum"]:
        low += 1
    elif isinstance(above, int | float) and not isinstance(above, bool):
        low = max(low, math.floor(above) + 1) if low is not None else math.floor(above) + 1
    if below is True and high is not None and high == schema["maximum"]:
        high -= 1
    elif isinstance(below, int | float) and not isinstance(below, bool):
        high = min(high, math.ceil(below) - 1) if high is not None else math.ceil(below) - 1
    if low is None and high is None:
        return None
    if low is not None and high is not None and low > high:
        raise GrammarError(f"no integer lies between {low} and {high}")
    return low, high


def integer_range(low: int | None, high: int | None) -> str:
    """GBNF alternatives of the integers from ``low`` to ``high`` (None: no end), written
    as JSON writes them."""
    alternatives = []
    if low is None or low < 0:  # negatives: "-" and a magnitude
        least = 1 if high is None or high >= 0 else -high
        most = None if low is None else -low
        alternatives.append(f'"-" ({_magnitudes(least, most)})')
    if high is None or high >= 0:
        alternatives.append(_magnitudes(max(low or 0, 0), high))
    return " | ".join(alternatives)


def _magnitudes(low: int, high: int | None) -> str:
    """The non-negative integers from ``low`` to ``high`` (None: no end)."""
    if high is not None:
        return " | ".join(_pattern(p) for p in digit_patterns(low, high))
    digits = len(str(low))
    spans = [_pattern(p) for p in digit_patterns(low, 10**digits - 1)]
    if digits < _MAX_DIGITS:  # every longer number
        spans.append(f"[1-9] [0-9]{{{digits},{_MAX_DIGITS - 1}}}")
    return " | ".join(spans)


def digit_patterns(low: int, high: int) -> list[list[tuple[str, str]]]:
    """The integers from ``low`` to ``high`` (0 <= low <= high) as patterns of digit
    ranges, one range per digit: the way regular expressions match numeric ranges."""
    patterns = []
    start = low
    for stop in _range_stops(low, high):
        patterns.append(list(zip(str(start), str(stop), strict=True)))
        start = stop + 1
    return patterns


def _range_stops(low: int, high: int) -> list[int]:
    """Where to cut [low, high] so that each piece has one digit count and differs only
    in a digit range followed by any digits."""
    stops = {high}
    nines = 1
    stop = _nines(low, nines)
    while low <= stop < high:
        stops.add(stop)
        nines += 1
        stop = _nines(low, nines)
    zeros = 1
    stop = (high + 1) - (high + 1) % 10**zeros - 1
    while low < stop <= high:
        stops.add(stop)
        zeros += 1
        stop = (high + 1) - (high + 1) % 10**zeros - 1
    return sorted(stops)


def _nines(number: int, count: int) -> int:
    """``number`` with its last ``count`` digits made nines."""
    head = str(number)[:-count] if count < len(str(number)) else ""
    return int(head + "9" * count)


def _pattern(digits: list[tuple[str, str]]) -> str:
    return " ".join(f'"{a}"' if a == b else f"[{a}-{b}]" for a, b in digits)


def nesting(grammar: str) -> int:
    """How deep ``grammar``'s groups nest: parentheses outside its literals ("...") and
    character classes ([...]), where they are text."""
    deepest = depth = 0
    closing = ""  # the quote or bracket that ends the literal or class we are in
    escaped = False
    for char in grammar:
        if closing:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == closing:
                closing = ""
        elif char == '"':
            closing = '"'
        elif char == "[":
            closing = "]"
        elif char == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif char == ")":
            depth -= 1
    return deepest
