"""Structured output and tool calls of the bundled models, in-process.

For the embedded default's small and large engines (Qwen2.5-Coder 0.5B and 1.5B):
  json grammar   10 JSON schemas of varied shape (nested objects, arrays with bounds,
                 enums, bounded integers, a date, a pattern, required and optional
                 fields) x 2 prompts, each asked with response_format json_schema:
                 the grammar holds the answer
  json prompt    each schema's first prompt, which spells out the schema, without the
                 grammar: what the model does asked in words alone (run right after
                 its grammar twin, so their speeds compare); "unfenced" counts the
                 answers that validate once a Markdown code fence is taken off
  tools forced   tool_choice "required" or a named function
  tools auto     tool_choice auto on questions a tool answers, and on questions none
                 does (those should be answered in text)
An answer counts when it parses and validates against its schema (jsonschema); a call
when its tool is the one wanted (forced, named) or any offered (required, auto) and its
arguments validate against that tool's parameters. Greedy decoding throughout, so a
rerun gives the same answers; the seconds depend on the machine (4 minutes in all on
2 cores: 1 for the small engine, 3 for the large). Run:
    .venv/bin/python bench/structured_output.py [--engines small,large]
        [--max-tokens 96] [--prompts 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
from pathlib import Path
from typing import Any

import jsonschema
import msgspec

from engines.base import Message, Sample, SamplingParams
from engines.llama_cpp import LlamaCppEngine
from engines.settings import LlamaCppSettings
from gateway.config import load_config


def _object(required: list[str] | None = None, **properties: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
    }


STRING = {"type": "string"}
SCHEMAS: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "person": (
        _object(name=STRING, age={"type": "integer", "minimum": 0, "maximum": 120}, email=STRING),
        ("Invent a software engineer who lives in Lisbon.", "Describe Ada Lovelace."),
    ),
    "rating": (
        {
            **_object(
                city=STRING, country=STRING, rating={"type": "integer", "minimum": 1, "maximum": 5}
            ),
            "additionalProperties": False,
        },
        ("Rate Paris as a city to visit.", "Rate a small town you like."),
    ),
    "product": (
        _object(
            ["name", "price", "in_stock"],
            name=STRING,
            price={"type": "number"},
            in_stock={"type": "boolean"},
            tags={"type": "array", "items": STRING, "maxItems": 4},
        ),
        ("A listing for a used bicycle.", "A listing for noise-cancelling headphones."),
    ),
    "event": (
        _object(
            title=STRING,
            date={"type": "string", "format": "date"},
            attendees={
                "type": "array",
                "items": _object(name=STRING, role={"enum": ["speaker", "guest", "host"]}),
                "minItems": 1,
                "maxItems": 3,
            },
        ),
        ("A small Python meetup in Berlin.", "A book launch party."),
    ),
    "sentiment": (
        _object(
            label={"enum": ["positive", "negative", "neutral"]},
            confidence={"type": "number"},
        ),
        (
            "Classify: 'The battery died after two days, very disappointed.'",
            "Classify: 'Fast delivery and it works great!'",
        ),
    ),
    "recipe": (
        _object(
            title=STRING,
            servings={"type": "integer", "minimum": 1, "maximum": 12},
            ingredients={
                "type": "array",
                "items": _object(item=STRING, quantity=STRING),
                "minItems": 1,
                "maxItems": 4,
            },
        ),
        ("A simple pancake recipe.", "A tomato salad."),
    ),
    "contact": (
        _object(
            ["name", "address"],
            name=STRING,
            address=_object(
                street=STRING, city=STRING, zip={"type": "string", "pattern": "^[0-9]{5}$"}
            ),
            phone=STRING,
        ),
        ("The contact card of a bakery in Munich.", "The contact card of a dentist."),
    ),
    "arithmetic": (
        _object(
            steps={"type": "array", "items": STRING, "maxItems": 3},
            answer={"type": "integer"},
        ),
        ("What is 17 times 3, plus 4?", "A box holds 12 eggs. How many eggs are in 5 boxes?"),
    ),
    "order": (
        _object(
            order_id={"type": "integer", "minimum": 1},
            status={"enum": ["pending", "shipped", "delivered"]},
            items={
                "type": "array",
                "items": _object(
                    sku=STRING, quantity={"type": "integer", "minimum": 1, "maximum": 99}
                ),
                "minItems": 1,
                "maxItems": 3,
            },
        ),
        ("An order of two books that has shipped.", "A pending order of paint and brushes."),
    ),
    "translation": (
        _object(
            source={"enum": ["en", "fr", "de", "es"]},
            target={"enum": ["en", "fr", "de", "es"]},
            text=STRING,
        ),
        ("Translate 'good morning' into French.", "Translate 'danke schön' into English."),
    ),
}

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": _object(["city"], city=STRING, unit={"enum": ["celsius", "fahrenheit"]}),
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The current time in an IANA timezone.",
            "parameters": _object(timezone=STRING),
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_flights",
            "description": "Flights between two cities on a date.",
            "parameters": _object(
                origin=STRING,
                destination=STRING,
                date={"type": "string", "format": "date"},
                passengers={"type": "integer", "minimum": 1, "maximum": 9},
            ),
        },
    },
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


# (prompt, tool_choice, the tool wanted: None for any offered, "" for no call)
TOOL_CASES: dict[str, list[tuple[str, Any, str | None]]] = {
    "tools forced": [
        ("What's the weather in Berlin?", "required", None),
        ("Find me a flight from Paris to Rome on 2025-06-01 for two people.", "required", None),
        ("What time is it in Sydney?", _named("get_time"), "get_time"),
        ("Fly me from Boston to Denver on 2025-09-12.", _named("search_flights"), "search_flights"),
    ],
    "tools auto, a tool answers": [
        ("Is it sunny in Madrid right now?", None, None),
        ("What time is it in New York?", None, None),
        ("Find flights from London to Dublin on 2025-07-14 for one passenger.", None, None),
        ("How warm is it in Cairo, in fahrenheit?", None, None),
    ],
    "tools auto, none does": [
        ("What is the capital of Japan?", None, ""),
        ("Write a haiku about autumn.", None, ""),
    ],
}  # fmt: skip


def _valid(value: Any, schema: dict[str, Any]) -> bool:
    try:
        jsonschema.validate(value, schema, format_checker=jsonschema.FormatChecker())
    except jsonschema.ValidationError:
        return False
    return True


def _answer_ok(text: str, schema: dict[str, Any]) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return _valid(value, schema)


def _unfenced(text: str) -> str:
    """``text`` without the Markdown code fence a chat model puts JSON in."""
    lines = text.strip().splitlines()
    if len(lines) >= 2 and lines[0].startswith("```") and lines[-1].strip() == "```":
        return "\n".join(lines[1:-1])
    return text


def _calls_ok(sample: Sample, wanted: str | None) -> bool:
    if wanted == "":  # no tool answers this: text, no call
        return not sample.tool_calls and bool(sample.text.strip())
    if not sample.tool_calls or sample.finish_reason != "tool_calls":
        return False
    for call in sample.tool_calls:
        if call.name not in PARAMETERS or (wanted is not None and call.name != wanted):
            return False
        try:
            arguments = json.loads(call.arguments)
        except ValueError:
            return False
        if not _valid(arguments, PARAMETERS[call.name]):
            return False
    return True


def _row(kind: str, prompt: str, sample: Sample, ok: bool, **more: Any) -> dict[str, Any]:
    decode_s = sample.timings.total_s - (sample.timings.first_token_s or 0.0)
    return {
        "kind": kind,
        "prompt": prompt,
        "ok": ok,
        **more,
        "tokens": sample.completion_tokens,
        "seconds": round(sample.timings.total_s, 3),
        "decode_s": round(decode_s, 3),
        "finish": sample.finish_reason,
        "text": sample.text,
        "tool_calls": [msgspec.to_builtins(c) for c in sample.tool_calls],
    }


async def _json_cases(
    engine: LlamaCppEngine, max_tokens: int, prompts: int
) -> list[dict[str, Any]]:
    rows = []
    for name, (schema, asks) in SCHEMAS.items():
        form = json.dumps({"type": "json_schema", "json_schema": {"name": name, "schema": schema}})
        for at, ask in enumerate(asks[:prompts]):
            # The same words either way: the schema is spelled out in the prompt, and
            # only the grammar differs.
            text = f"{ask}\nReply with JSON only, following this JSON schema:\n{json.dumps(schema)}"
            prompt = (Message("user", text),)
            params = SamplingParams(max_tokens=max_tokens, temperature=0, response_format=form)
            sample = (await engine.generate(prompt, params)).samples[0]
            rows.append(_row("json grammar", ask, sample, _answer_ok(sample.text, schema)))
            if at == 0:
                params = msgspec.structs.replace(params, response_format=None)
                sample = (await engine.generate(prompt, params)).samples[0]
                ok = _answer_ok(sample.text, schema)
                unfenced = _answer_ok(_unfenced(sample.text), schema)
                rows.append(_row("json prompt", ask, sample, ok, unfenced=unfenced))
    return rows


async def _tool_cases(engine: LlamaCppEngine, max_tokens: int) -> list[dict[str, Any]]:
    rows = []
    for kind, cases in TOOL_CASES.items():
        for ask, choice, wanted in cases:
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=0,
                tools=json.dumps(TOOLS),
                tool_choice=None if choice is None else json.dumps(choice),
            )
            sample = (await engine.generate((Message("user", ask),), params)).samples[0]
            rows.append(_row(kind, ask, sample, _calls_ok(sample, wanted)))
    return rows


def _summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    kinds: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        kinds.setdefault(row["kind"], []).append(row)
    return {
        kind: {
            "ok": sum(r["ok"] for r in runs),
            "n": len(runs),
            "mean_tokens": round(statistics.mean(r["tokens"] for r in runs), 1),
            "mean_s": round(statistics.mean(r["seconds"] for r in runs), 2),
            "tokens_per_s": round(
                sum(r["tokens"] for r in runs) / sum(r["decode_s"] for r in runs), 1
            ),
            "hit_max_tokens": sum(r["finish"] == "length" for r in runs),
            **({"ok_unfenced": sum(r["unfenced"] for r in runs)} if "unfenced" in runs[0] else {}),
        }
        for kind, runs in kinds.items()
    }


async def bench_engine(
    name: str, settings: LlamaCppSettings, models_dir: Path, max_tokens: int, prompts: int
) -> dict[str, Any]:
    engine = LlamaCppEngine(name, settings, models_dir)
    await engine.start()
    try:
        rows = await _json_cases(engine, max_tokens, prompts)
        rows += await _tool_cases(engine, max_tokens)
    finally:
        await engine.close()
    return {
        "engine": name,
        "model": settings.model,
        "features": sorted(engine.features),
        "summary": _summary(rows),
        "grammar_speed_ratio": _speed_ratio(rows),
        "cases": rows,
    }


def _speed_ratio(rows: list[dict[str, Any]]) -> float:
    """Median over prompts of the decode speed under the grammar over the speed of the
    same prompt without it, the two run back to back: what the grammar costs."""
    ratios: list[float] = [
        (grammar["tokens"] / grammar["decode_s"]) / (row["tokens"] / row["decode_s"])
        for grammar, row in itertools.pairwise(rows)
        if grammar["kind"] == "json grammar" and row["kind"] == "json prompt"
    ]
    return round(statistics.median(ratios), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="small,large", help="the default config's engines")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--prompts", type=int, choices=(1, 2), default=2, help="per schema")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    config = load_config()
    models_dir = Path(config.models_dir).expanduser()
    report = []
    for name in args.engines.split(","):
        settings = config.engines[name]
        assert isinstance(settings, LlamaCppSettings)
        result = asyncio.run(
            bench_engine(name, settings, models_dir, args.max_tokens, args.prompts)
        )
        report.append(result)
        print(f"{name} ({result['model']}), features: {', '.join(result['features'])}")
        print(
            f"  decode speed under the grammar / without, paired: {result['grammar_speed_ratio']}"
        )
        for kind, line in result["summary"].items():
            unfenced = f" ({line['ok_unfenced']} unfenced)" if "ok_unfenced" in line else ""
            print(
                f"  {kind:28} {line['ok']:>2}/{line['n']:<2} ok{unfenced:15} "
                f"{line['mean_tokens']:6.1f} tokens  {line['mean_s']:6.2f} s  "
                f"{line['tokens_per_s']:5.1f} tokens/s  {line['hit_max_tokens']} hit max_tokens"
            )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
