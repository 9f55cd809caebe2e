"""False-hit guards: cheap checks that veto a semantic hit between two prompts that
embed close together but ask different things.

Sentence embeddings are nearly blind to the details that change an answer: "What
is 15% of 80?" and "What is 15% of 90?" are neighbours, so are "enable" and "disable
2FA". A semantic hit is served only when every enabled guard agrees that the cached
prompt and the new one are the same question.
"""

from __future__ import annotations

import re

import msgspec

_NUMBER = re.compile(r"(?<![\w.])[-+]?\d[\d,]*(?:\.\d+)?(?![\w])|\b\d+(?:st|nd|rd|th)\b")
_NUMBER_WORDS = {
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve", "twenty", "thirty", "forty", "fifty", "hundred", "thousand",
    "million", "billion", "first", "second", "third", "half", "double", "twice", "triple",
}  # fmt: skip
_NEGATIONS = {
    "not", "no", "never", "none", "nobody", "nothing", "neither", "nor", "without",
    "cannot", "can't", "don't", "doesn't", "didn't", "isn't", "aren't", "wasn't",
    "weren't", "won't", "wouldn't", "shouldn't", "couldn't", "hasn't", "haven't",
}  # fmt: skip
# Pairs whose members flip an answer while embedding almost alike.
_OPPOSITES = [
    ("enable", "disable"), ("allow", "deny"), ("add", "remove"), ("increase", "decrease"),
    ("before", "after"), ("above", "below"), ("max", "min"), ("maximum", "minimum"),
    ("more", "less"), ("most", "least"), ("buy", "sell"), ("import", "export"),
    ("encrypt", "decrypt"), ("upload", "download"), ("start", "stop"), ("open", "close"),
    ("true", "false"), ("yes", "no"), ("left", "right"), ("first", "last"),
]  # fmt: skip
_OPPOSITE_OF = {a: b for a, b in _OPPOSITES} | {b: a for a, b in _OPPOSITES}
_UNITS = {
    "mm", "cm", "m", "km", "in", "ft", "yd", "mi", "mile", "miles", "meter", "meters",
    "kg", "g", "mg", "lb", "lbs", "pound", "pounds", "oz", "ounce", "ounces", "ton", "tons",
    "l", "ml", "liter", "liters", "litre", "litres", "gallon", "gallons",
    "s", "sec", "second", "seconds", "min", "minute", "minutes", "h", "hr", "hour", "hours",
    "day", "days", "week", "weeks", "month", "months", "year", "years",
    "c", "f", "celsius", "fahrenheit", "kelvin", "usd", "eur", "gbp", "dollars", "euros",
    "percent", "%", "$", "€", "£", "kb", "mb", "gb", "tb", "kbps", "mbps", "ghz", "mhz",
}  # fmt: skip
_WORD = re.compile(r"[\w'\u2019%$€£]+")
_SENTENCE = re.compile(r"(?<=[.!?])\s+")


class GuardSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    numbers: bool = True  # numbers (digits, number words) must match
    negation: bool = True  # negations and opposite verbs must match
    entities: bool = True  # capitalised names and units must match


def _words(text: str) -> list[str]:
    return [w.lower() for w in _WORD.findall(text)]


# Each feature is a sequence, not a set: "6 divided by 3", "5 km in miles" and "is
# Paris bigger than London" change their answer when the order changes.


def numbers(text: str) -> tuple[str, ...]:
    digits = [n.replace(",", "").lstrip("+") for n in _NUMBER.findall(text)]
    return (*digits, *(w for w in _words(text) if w in _NUMBER_WORDS))


def polarity(text: str) -> tuple[str, ...]:
    return tuple(
        "not" if w in _NEGATIONS or w.endswith("n't") else w
        for w in _words(text)
        if w in _NEGATIONS or w.endswith("n't") or w in _OPPOSITE_OF
    )


def entities(text: str) -> tuple[str, ...]:
    """Names (capitalised words that do not open a sentence) and units, in order."""
    found = []
    for sentence in _SENTENCE.split(text.strip()):
        for position, word in enumerate(_WORD.findall(sentence)):
            named = position > 0 and word[0].isupper() and word != "I"
            if named or word.lower() in _UNITS:
                # "France's capital" names the same thing as "the capital of France".
                found.append(word.lower().removesuffix("'s").removesuffix("\u2019s"))
    return tuple(found)


def veto(cached: str, query: str, settings: GuardSettings) -> str | None:
    """Why a semantic hit between the two prompts must not be served, or None."""
    if settings.numbers and numbers(cached) != numbers(query):
        return "numbers"
    if settings.negation and polarity(cached) != polarity(query):
        return "negation"
    if settings.entities and entities(cached) != entities(query):
        return "entities"
    return None
