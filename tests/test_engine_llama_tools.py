"""Tool calls and structured output of the in-process llama.cpp engine.

The parser, grammar and shape tests need no model. The model tests (slow) run the
embedded default's engines, Qwen2.5-Coder 0.5B ("small") and 1.5B ("large") and
SmolLM2 ("tiny"), as `make serve` starts them.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import jsonschema
import llama_cpp
import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from engines.base import (
    Delta,
    Generation,
    Message,
    SamplingParams,
    ToolCall,
    ToolCallDelta,
)
from engines.bundled import SMOLLM2, model_file
from engines.grammars import (
    MAX_GRAMMAR_DEPTH,
    GrammarError,
    check_bounded,
    check_grammar,
    digit_patterns,
    integer_range,
    json_grammar,
    nesting,
)
from engines.llama_cpp import LlamaCppEngine
from engines.settings import LlamaCppSettings
from engines.structured import InvalidShape, Shape, shape_of
from engines.tool_calls import CallParser, renders_tool_calls
from gateway.config import load_config

WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city"],
}
TIME: dict[str, Any] = {
    "type": "object",
    "properties": {"timezone": {"type": "string"}},
    "required": ["timezone"],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The current time in a timezone.",
            "parameters": TIME,
        },
    },
]
PARAMETERS = {"get_weather": WEATHER, "get_time": TIME}
NAMES = frozenset(PARAMETERS)


def _fixed_ids() -> Iterator[str]:
    return iter(f"call_{n}" for n in range(100))


def _parsed(
    pieces: Sequence[str], names: frozenset[str] = NAMES, bare: bool = False
) -> tuple[list[str], list[ToolCallDelta], tuple[ToolCall, ...]]:
    """Feed ``pieces`` one by one: the texts and call parts given out, and the calls."""
    ids = _fixed_ids()
    parser = CallParser(names, bare=bare, new_id=lambda: next(ids))
    texts: list[str] = []
    parts: list[ToolCallDelta] = []
    for piece in pieces:
        text, new = parser.feed(piece)
        texts.append(text)
        parts += new
    text, new = parser.finish()
    texts.append(text)
    parts += new
    return texts, parts, parser.calls


def _joined(parts: Sequence[ToolCallDelta]) -> list[ToolCall]:
    """Call parts put together as a client does: id and name once, arguments joined."""
    calls: dict[int, list[str]] = {}
    for part in parts:
        if part.id is not None:
            assert part.index not in calls, "a call's id and name come once"
            assert part.name is not None
            calls[part.index] = [part.id, part.name, ""]
        calls[part.index][2] += part.arguments
    return [ToolCall(*calls[i]) for i in sorted(calls)]


TAGGED = (
    "Let me look.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": '
    '{"city": "Paris", "note": "a } and \\" and ]"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}\n</tool_call>'
)


def test_text_before_a_call_streams_and_the_call_is_read() -> None:
    texts, parts, calls = _parsed([TAGGED])
    assert "".join(texts) == "Let me look."
    assert calls == (
        ToolCall("call_0", "get_weather", '{"city": "Paris", "note": "a } and \\" and ]"}'),
        ToolCall("call_1", "get_time", '{"timezone": "Europe/Paris"}'),
    )
    assert _joined(parts) == list(calls)


def test_arguments_stream_as_they_are_written() -> None:
    """Fed a character at a time, the text goes out before the markup starts, and each
    call's arguments come in many parts before the call ends."""
    pieces = list(TAGGED)
    texts, parts, calls = _parsed(pieces)
    opening = TAGGED.index("<tool_call>")
    assert "".join(texts[:opening]) == "Let me look."  # only the newline waited
    first = [p for p in parts if p.index == 0]
    assert first[0].name == "get_weather" and first[0].id == "call_0"
    assert len(first) > 10
    assert _joined(parts) == list(calls)


@given(st.lists(st.integers(min_value=0, max_value=len(TAGGED)), max_size=12))
def test_any_split_of_the_text_reads_the_same(cuts: list[int]) -> None:
    bounds = [0, *sorted(cuts), len(TAGGED)]
    pieces = [TAGGED[a:b] for a, b in itertools.pairwise(bounds)]
    texts, parts, calls = _parsed(pieces)
    whole_texts, _, whole_calls = _parsed([TAGGED])
    assert "".join(texts) == "".join(whole_texts)
    assert calls == whole_calls
    assert _joined(parts) == list(calls)


def test_a_possible_start_of_the_markup_is_held_back_until_it_is_not() -> None:
    texts, _, calls = _parsed(["The sign <tool", "box> is shown.  "])
    assert texts == ["The sign", " <toolbox> is shown.", "  "]
    assert calls == ()


def test_keys_in_another_order_are_read_whole_at_the_call_end() -> None:
    text = '<tool_call>{"arguments": {"city": "Rome"}, "name": "get_weather"}</tool_call>'
    _, parts, calls = _parsed(list(text))
    assert calls == (ToolCall("call_0", "get_weather", '{"city": "Rome"}'),)
    assert parts == [ToolCallDelta(0, "call_0", "get_weather", '{"city": "Rome"}')]


def test_arguments_written_as_a_json_string_are_decoded() -> None:
    text = '<tool_call>{"arguments": "{\\"city\\": \\"Oslo\\"}", "name": "get_weather"}</tool_call>'
    _, _, calls = _parsed([text])
    assert calls == (ToolCall("call_0", "get_weather", '{"city": "Oslo"}'),)


@pytest.mark.parametrize(
    "markup",
    [
        '<tool_call>\n{"name": "send_email", "arguments": {"to": "x"}}\n</tool_call>',
        "<tool_call>\nnot json at all\n</tool_call>",
        '<tool_call>\n{"name": "get_weather", "arguments": [1, 2]}\n</tool_call>',
        '<tool_call>\n{"arguments": {"city": "Par',  # cut off, in another order
    ],
    ids=["unknown tool", "not json", "arguments not an object", "cut off before"],
)
def test_markup_the_tools_cannot_explain_is_text(markup: str) -> None:
    """Under tool_choice auto the model may write markup that is no call of the
    request's tools: the client gets it as the text it is, and no call."""
    texts, parts, calls = _parsed(["Sure. ", *markup, " Done."])
    assert "".join(texts) == "Sure. " + markup + " Done."
    assert (parts, calls) == ([], ())


def test_a_call_cut_short_keeps_what_was_written() -> None:
    """Once its name is read the call stands: max_tokens cutting it ends the sample
    with its arguments unfinished, as the stream has already sent them."""
    _, parts, calls = _parsed(['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Li'])
    assert calls == (ToolCall("call_0", "get_weather", '{"city": "Li'),)
    assert _joined(parts) == list(calls)


def test_a_call_without_its_closing_tag_is_whole() -> None:
    _, _, calls = _parsed(['<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}'])
    assert calls == (ToolCall("call_0", "get_time", '{"timezone": "UTC"}'),)


def test_whitespace_around_calls_is_markup_and_text_keeps_its_own() -> None:
    texts, _, calls = _parsed([TAGGED + "\n\nThat is all.\n"])
    assert "".join(texts) == "Let me look.\nThat is all.\n"
    assert len(calls) == 2
    plain, _, none = _parsed(["  Just text, \n", "nothing else.\n\n"])
    assert "".join(plain) == "  Just text, \nnothing else.\n\n"
    assert none == ()


@pytest.mark.parametrize(
    "answer",
    [
        '{"name": "get_weather", "arguments": {"city": "Paris"}}',
        '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```',
        '\n```\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```\n',
    ],
    ids=["bare", "fenced json", "fenced"],
)
def test_a_bare_call_at_the_start_is_read_when_asked(answer: str) -> None:
    texts, parts, calls = _parsed(list(answer), bare=True)
    assert "".join(texts) == ""
    assert [c.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
    assert _joined(parts) == list(calls)
    # Without ``bare`` (a grammar holds the answer) the same text is text.
    texts, _, calls = _parsed([answer])
    assert ("".join(texts), calls) == (answer, ())


def test_an_answer_that_only_looks_like_a_bare_call_goes_out_at_once() -> None:
    ids = _fixed_ids()
    parser = CallParser(NAMES, bare=True, new_id=lambda: next(ids))
    assert parser.feed("Hello") == ("Hello", ())
    parser = CallParser(NAMES, bare=True)
    assert parser.feed('{"name": "get_weather"') == ("", ())  # may still be a call
    assert parser.feed(", 3]") == ('{"name": "get_weather", 3]', ())
    texts, _, calls = _parsed(['{"name": "joke", "arguments": {}}'], bare=True)
    assert ("".join(texts), calls) == ('{"name": "joke", "arguments": {}}', ())


QWEN_LIKE = (
    "{% if tools %}<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>"
    "Call as <tool_call>...</tool_call>{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    "{% for call in m.tool_calls or [] %}\n<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}{% endfor %}"
)
PLAIN_TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"


@pytest.mark.parametrize(("template", "renders"), [(QWEN_LIKE, True), (PLAIN_TEMPLATE, False)])
def test_a_template_is_known_to_write_tool_calls_by_rendering_one(
    template: str, renders: bool
) -> None:
    formatter = Jinja2ChatFormatter(template=template, eos_token="", bos_token="")
    assert renders_tool_calls(lambda m, t: formatter(messages=m, tools=t).prompt) is renders  # type: ignore[arg-type]


def test_digit_patterns_match_exactly_their_range() -> None:
    for low, high in [(0, 0), (0, 9), (1, 5), (5, 12), (7, 130), (19, 2001), (100, 999)]:
        regex = re.compile(
            "|".join("".join(f"[{a}-{b}]" for a, b in p) for p in digit_patterns(low, high))
        )
        for number in range(0, high + 200):
            assert bool(regex.fullmatch(str(number))) is (low <= number <= high), number


def test_integer_bounds_become_grammar() -> None:
    assert integer_range(1, 5) == "[1-5]"
    assert integer_range(-12, -3) == '"-" ([3-9] | "1" [0-2])'
    assert integer_range(-2, None) == '"-" ([1-2]) | [0-9] | [1-9] [0-9]{1,15}'
    grammar = json_grammar({"type": "integer", "exclusiveMinimum": 0, "maximum": 10})
    assert 'answer ::= ([1-9] | "1" "0") space' in grammar


def _shape(tools: Any = None, tool_choice: Any = None, response_format: Any = None) -> Shape:
    """The shape of a request that sends these (as JSON)."""

    def text(value: Any) -> str | None:
        return None if value is None else json.dumps(value)

    params = SamplingParams(
        tools=text(tools), tool_choice=text(tool_choice), response_format=text(response_format)
    )
    return shape_of(params, "test")


# No integer lies in it: no grammar can be built.
EMPTY_RANGE: dict[str, Any] = {
    "type": "json_schema",
    "json_schema": {"name": "answer", "schema": {"type": "integer", "minimum": 5, "maximum": 1}},
}


def _named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


def _form(schema: dict[str, Any]) -> dict[str, Any]:
    """A json_schema response format."""
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def test_shapes_of_each_tool_choice() -> None:
    auto = _shape(tools=TOOLS)
    assert (auto.tools, auto.names, auto.grammar) == (TOOLS, NAMES, None)
    none = _shape(tools=TOOLS, tool_choice="none")
    assert (none.tools, none.names, none.grammar) == (None, frozenset(), None)
    required = _shape(tools=TOOLS, tool_choice="required")
    assert required.grammar is not None
    assert "get_time" in required.grammar and "get_weather" in required.grammar
    named = _shape(tools=TOOLS, tool_choice=_named("get_time"))
    assert named.grammar is not None
    assert "get_time" in named.grammar and "get_weather" not in named.grammar
    either = _shape(tools=TOOLS, response_format={"type": "json_object"})
    assert either.names == NAMES and "| answer" in (either.grammar or "")
    plain = _shape(response_format={"type": "text"})
    assert (plain.tools, plain.grammar) == (None, None)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": TOOLS, "tool_choice": _named("x")}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"response_format": EMPTY_RANGE}, "response_format"),
        ({"response_format": _form({"type": "frog"})}, "response_format"),
    ],
    ids=["unknown tool", "unknown choice", "no function", "unknown format", "no int", "no type"],
)  # fmt: skip
def test_what_cannot_be_followed_is_refused_with_its_param(
    fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(InvalidShape) as caught:
        _shape(**fields)
    assert caught.value.param == param


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "maxLength": 10**9},
        {"type": "array", "items": {"type": "integer"}, "minItems": 50_000},
        {"type": "object", "properties": {"a": {"type": "string", "pattern": "^a{1,20000}$"}}},
        {"type": "string", "pattern": "^((a{10}){10}){11}$"},
        {"enum": [f"v{i}" for i in range(1001)]},
    ],
    ids=["maxLength", "minItems", "pattern", "nested-quantifiers", "enum"],
)
def test_repetitions_a_grammar_cannot_be_written_for_are_refused_first(
    schema: dict[str, Any],
) -> None:
    """Written out, maxLength: 10**9 took 19 GB before it was stopped, and a grammar
    nested 20,000 deep overflowed llama.cpp's parser and killed the process."""
    with pytest.raises(GrammarError, match="at most 1000"):
        check_bounded(schema)
    # The same numbers as data (an enum's values, a default) bound nothing.
    check_bounded({"enum": [schema], "default": schema, "type": "object"})
    with pytest.raises(InvalidShape) as caught:
        _shape(response_format=_form(schema))
    assert caught.value.param == "response_format"


def test_a_grammar_nested_too_deep_is_refused_before_llama_cpp_reads_it() -> None:
    deep = "root ::= " + "(" * (MAX_GRAMMAR_DEPTH + 1) + '"a"' + ")" * (MAX_GRAMMAR_DEPTH + 1)
    assert nesting(deep) == MAX_GRAMMAR_DEPTH + 1
    assert nesting('root ::= "((" [(] ("a")') == 1  # literals and classes are text
    with pytest.raises(GrammarError, match="nested"):
        check_grammar(llama_cpp.llama_vocab_p(0), deep)  # no vocabulary is ever asked


def test_llama_cpp_parses_every_grammar_built(models_dir: Path) -> None:
    """The grammars are llama.cpp's GBNF (checked with SmolLM2's vocabulary alone)."""
    llm = llama_cpp.Llama(
        model_path=str(model_file(SMOLLM2, models_dir)), vocab_only=True, verbose=False
    )
    shapes = [
        _shape(tools=TOOLS, tool_choice="required"),
        _shape(tools=TOOLS, tool_choice=_named("get_weather")),
        _shape(tools=TOOLS, response_format={"type": "json_object"}),
        _shape(tools=TOOLS, response_format=_form(SCHEMAS[1])),
        *(_shape(response_format=_form(schema)) for schema in SCHEMAS),
    ]
    try:
        for shape in shapes:
            assert shape.grammar is not None
            check_grammar(llm._model.vocab, shape.grammar)
    finally:
        llm.close()


# Model tests: the embedded default's engines.

SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "country": {"type": "string"},
            "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        },
        "required": ["city", "country", "rating"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 40},
            "tags": {
                "type": "array",
                "items": {"enum": ["python", "rust", "web", "data"]},
                "minItems": 1,
                "maxItems": 3,
            },
            "author": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                },
                "required": ["name"],
            },
        },
        "required": ["title", "tags", "author"],
    },
]


@pytest.fixture(scope="module")
def default_engines() -> dict[str, LlamaCppSettings]:
    engines = {}
    for name, settings in load_config().engines.items():
        assert isinstance(settings, LlamaCppSettings)
        engines[name] = settings
    return engines


@pytest.fixture(scope="module")
async def qwen(
    default_engines: dict[str, LlamaCppSettings], models_dir: Path
) -> AsyncIterator[LlamaCppEngine]:
    """The default's small engine with batching on: requests with tools or a response
    format must still take the single path that honours them."""
    # No timeout of its own: a slow or busy host makes these tests slower, not wrong.
    settings = msgspec.structs.replace(default_engines["small"], batch_samples=True, timeout_s=None)
    engine = LlamaCppEngine("small", settings, models_dir)
    await engine.start()
    yield engine
    await engine.close()


async def _streamed(
    engine: LlamaCppEngine, prompt: Sequence[Message], params: SamplingParams
) -> tuple[dict[int, str], dict[int, list[ToolCallDelta]], dict[int, int], Generation]:
    texts: dict[int, str] = {}
    parts: dict[int, list[ToolCallDelta]] = {}
    counted: dict[int, int] = {}
    async for item in engine.stream(prompt, params):
        if isinstance(item, Delta):
            texts[item.index] = texts.get(item.index, "") + item.text
            parts.setdefault(item.index, []).extend(item.tool_calls)
            counted[item.index] = counted.get(item.index, 0) + len(item.logprobs)
        else:
            return texts, parts, counted, item
    raise AssertionError("no Generation")


WEATHER_QUESTION = (Message("user", "What's the weather like in Paris today?"),)


@pytest.mark.slow
async def test_features_follow_the_chat_template(
    default_engines: dict[str, LlamaCppSettings], qwen: LlamaCppEngine, models_dir: Path
) -> None:
    json_only = frozenset({"json_object", "json_schema"})
    assert qwen.features == json_only | {"tools"}
    for name, expected in [("large", json_only | {"tools"}), ("tiny", json_only)]:
        engine = LlamaCppEngine(name, default_engines[name], models_dir)
        assert engine.features == json_only  # tools only once the template is read
        await engine.start()
        try:
            assert engine.features == expected, name
        finally:
            await engine.close()


async def test_a_completion_template_offers_no_tools(large_engine: LlamaCppEngine) -> None:
    assert large_engine.features == frozenset({"json_object", "json_schema"})


@pytest.mark.slow
@pytest.mark.parametrize("schema", SCHEMAS, ids=["flat", "nested"])
async def test_a_json_schema_answer_holds_to_its_schema(
    qwen: LlamaCppEngine, schema: dict[str, Any]
) -> None:
    form = json.dumps(_form(schema))
    params = SamplingParams(max_tokens=120, temperature=0, response_format=form)
    prompt = (Message("user", "Describe a city you like, or a blog post about Python, as JSON."),)
    texts, _, _, generation = await _streamed(qwen, prompt, params)
    sample = generation.samples[0]
    assert sample.finish_reason == "stop"
    jsonschema.validate(json.loads(sample.text), schema)
    assert texts[0] == sample.text


@pytest.mark.slow
async def test_json_object_answers_are_objects(qwen: LlamaCppEngine) -> None:
    params = SamplingParams(
        max_tokens=120, temperature=0.7, seed=3, n=2, response_format='{"type": "json_object"}'
    )
    prompt = (Message("user", 'One fact about owls, as JSON with the keys "animal" and "fact".'),)
    generation = await qwen.generate(prompt, params)
    for sample in generation.samples:
        assert sample.finish_reason == "stop", sample.text
        assert isinstance(json.loads(sample.text), dict)


def _valid_calls(calls: Sequence[ToolCall]) -> None:
    for call in calls:
        assert re.fullmatch(r"call_[A-Za-z0-9]{24}", call.id)
        jsonschema.validate(json.loads(call.arguments), PARAMETERS[call.name])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("choice", "names"),
    [("required", {"get_weather"}), (_named("get_time"), {"get_time"})],
    ids=["required", "named"],
)
async def test_a_forced_call_names_the_tool_and_its_arguments_hold(
    qwen: LlamaCppEngine, choice: Any, names: set[str]
) -> None:
    params = SamplingParams(
        max_tokens=80,
        temperature=0,
        logprobs=True,
        tools=json.dumps(TOOLS),
        tool_choice=json.dumps(choice),
    )
    texts, parts, counted, generation = await _streamed(qwen, WEATHER_QUESTION, params)
    sample = generation.samples[0]
    assert sample.finish_reason == "tool_calls"
    assert {c.name for c in sample.tool_calls} == names
    _valid_calls(sample.tool_calls)
    assert (sample.text, texts.get(0, "")) == ("", "")
    assert _joined(parts[0]) == list(sample.tool_calls)
    # Every token's logprob goes out once, the markup's with the call's parts.
    assert counted[0] == len(sample.logprobs) == sample.completion_tokens


@pytest.mark.slow
async def test_a_call_the_model_chooses_to_make_is_read(qwen: LlamaCppEngine) -> None:
    """tool_choice auto: no grammar; the 0.5B writes its call as bare JSON."""
    params = SamplingParams(max_tokens=80, temperature=0, tools=json.dumps(TOOLS))
    texts, parts, _, generation = await _streamed(qwen, WEATHER_QUESTION, params)
    sample = generation.samples[0]
    assert sample.finish_reason == "tool_calls"
    assert [c.name for c in sample.tool_calls] == ["get_weather"]
    _valid_calls(sample.tool_calls)
    assert texts.get(0, "") == sample.text
    assert _joined(parts[0]) == list(sample.tool_calls)
    whole = (await qwen.generate(WEATHER_QUESTION, params)).samples[0]
    assert [(c.name, c.arguments) for c in whole.tool_calls] == [
        (c.name, c.arguments) for c in sample.tool_calls
    ]


@pytest.mark.slow
async def test_n_forced_samples_each_call(qwen: LlamaCppEngine) -> None:
    params = SamplingParams(
        max_tokens=80,
        temperature=0.8,
        seed=5,
        n=2,
        tools=json.dumps(TOOLS),
        tool_choice='"required"',
    )
    generation = await qwen.generate(WEATHER_QUESTION, params)
    for sample in generation.samples:
        assert sample.finish_reason == "tool_calls", sample.text
        _valid_calls(sample.tool_calls)


@pytest.mark.slow
async def test_a_conversation_with_calls_renders_them_as_the_template_does(
    qwen: LlamaCppEngine,
) -> None:
    call = ToolCall("call_abc", "get_weather", '{"city": "Paris"}')
    conversation = (
        *WEATHER_QUESTION,
        Message("assistant", "", tool_calls=(call,)),
        Message("tool", '{"temperature_c": 18, "sky": "sunny"}', tool_call_id="call_abc"),
    )
    params = SamplingParams(max_tokens=40, temperature=0, tools=json.dumps(TOOLS))
    prompt, _, _ = qwen._render(conversation, shape_of(params, "small"))
    # The arguments written once, as JSON: not a JSON string of JSON.
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        in prompt
    )
    assert '<tool_response>\n{"temperature_c": 18, "sky": "sunny"}\n</tool_response>' in prompt
    assert '"name": "get_time"' in prompt  # the tools are offered
    # The tool's answer reaches the model (the 0.5B mostly echoes it).
    answer = msgspec.structs.replace(params, tool_choice='"none"')
    sample = (await qwen.generate(conversation, answer)).samples[0]
    assert (sample.finish_reason, sample.tool_calls) == ("stop", ())
    assert "18" in sample.text
