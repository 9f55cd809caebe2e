"""False-hit guards: cheap checks that veto a semantic hit between two prompts that
embed close together but ask different things.

Sentence embeddings are nearly blind to the details that change an answer: "What
is 15% of 80?" and "What is 15% of 90?" are neighbours, so are "enable" and "disable
2FA", and so are "A beat B" and "B beat A", which hold the same words in another
order. A semantic hit is served only when every enabled guard agrees that the cached
prompt and the new one are the same question.

Every guard is a pure function of the two texts, a few tens of microseconds, and
names the words that made it veto when asked (``explain``). Each one errs towards
letting a hit through when the texts were rephrased rather than edited: a guard that
vetoes a true paraphrase does not only lose that hit, it hands the lookup to the next
candidate, which is then usually wrong.
"""

from __future__ import annotations

import difflib
import re
from collections import Counter
from collections.abc import Callable, Sequence
from typing import NamedTuple

import msgspec

_NUMBER = re.compile(r"(?<![\w.])[-+]?\d[\d,]*(?:\.\d+)?(?![\w])|\b\d+(?:st|nd|rd|th)\b")
# "one" is left out: "how can one learn" and "one of the formats" name no number.
_NUMBER_WORDS = {
    "zero": "0", "two": "2", "three": "3", "four": "4", "five": "5", "six": "6",
    "seven": "7", "eight": "8", "nine": "9", "ten": "10", "eleven": "11", "twelve": "12",
    "twenty": "20", "thirty": "30", "forty": "40", "fifty": "50", "hundred": "100",
    "thousand": "1000", "million": "1000000", "billion": "1000000000",
    "first": "first", "second": "second", "third": "third", "last": "last",
    "half": "half", "double": "double", "twice": "twice", "triple": "triple",
}  # fmt: skip
_NEGATIONS = {
    "not", "no", "never", "none", "nobody", "nothing", "neither", "nor", "without",
    "cannot", "can't", "don't", "doesn't", "didn't", "isn't", "aren't", "wasn't",
    "weren't", "won't", "wouldn't", "shouldn't", "couldn't", "hasn't", "haven't",
}  # fmt: skip
# "Why or why not?" and "if not, ..." ask no negative question.
_IDLE_NOT = re.compile(r"\b(?:why|or|if)\s+not\b", re.IGNORECASE)
# Scales whose two ends flip an answer while embedding almost alike: a word of one end
# in one prompt only, against a word of the other end in the other prompt only. Each
# end holds the forms and near synonyms of one meaning ("safe", "harmless"), so that a
# synonym of the same end ("unsafe", "dangerous") is no flip. One scale a line (a
# backslash goes on), its ends apart by "|".
_SCALES = """
enable enabled enables activate activated | disable disabled disables deactivate deactivated
allow allowed allows permit permitted permits permissible accept accepted accepts approve \
    approved | deny denied denies forbid forbidden forbids prohibit prohibited ban banned disallow \
    disallowed reject rejected rejects refuse refused decline declined
legal lawful legally | illegal unlawful illegally
safe safer safest harmless secure | unsafe dangerous hazardous harmful risky toxic deadly poisonous
add added adds insert include includes included including cover covers covered | remove \
    removed removes delete deleted exclude excludes excluded excluding
increase increases increased raise raises raised rise rises boost boosts grow grows gain gains \
    | decrease decreases decreased lower lowers lowered reduce reduces reduced drop drops fall \
    falls shrink shrinks cut cuts lose loses
high higher highest tall taller tallest above over upper | low lower lowest below under beneath
big bigger biggest large larger largest huge greater greatest | small smaller smallest little \
    tiny lesser
more most | less least fewer fewest
long longer longest | short shorter shortest brief
fast faster fastest quick quicker quickest rapid rapidly quickly | slow slower slowest slowly \
    sluggish
old older oldest elder | young younger youngest new newer newest
heavy heavier heaviest | light lighter lightest
hot hotter hottest warm warmer | cold colder coldest cool cooler
deep deeper deepest | shallow shallower shallowest
expensive pricey pricier costly | cheap cheaper cheapest inexpensive affordable
good better best superior | bad worse worst inferior
easy easier easiest simple simpler | hard harder hardest difficult tough
strong stronger strongest | weak weaker weakest
true correct right | false wrong incorrect
win wins won succeed succeeds success pass passes passed | lose loses lost fail fails failed \
    failure
before prior earlier until till within | after later since beyond past
early earlier | late later
inside indoors internal inner inbound incoming import | outside outdoors external outer \
    outbound outgoing export
on | off
open opened opens | close closed closes shut
start started starts begin | stop stopped stops end
buy bought buys | sell sold sells
encrypt encrypted encode encoded | decrypt decrypted decode decoded
upload uploaded | download downloaded
max maximum | min minimum
yes | no
left | right
first | last
advantages pros benefits | disadvantages cons drawbacks
positive plus profit | negative minus loss deficit
required mandatory compulsory obligatory | optional voluntary
public | private
free | paid
stable reliable | unstable flaky unreliable
stateful | stateless
full | empty
rich wealthy | poor
same similar identical | different distinct
wide wider | narrow narrower
thick thicker | thin thinner
north northern | south southern
east eastern | west western
ascending | descending
uppercase | lowercase
synchronous sync | asynchronous async
lock locked | unlock unlocked
present available | absent unavailable missing
agree agrees support supports | disagree disagrees oppose opposes against
attach attached | detach detached
join joined | leave left
arrive arrives arrival | depart departs departure
push | pull
import | export
input | output
healthy | unhealthy sick
valid | invalid
during while | before after
# Quantifiers: "all", "most" and "some" ask three things. "any" counts only against
# "all": "is there any way" asks what "is there a way" does.
all every always everyone everybody everything | some sometimes several someone somebody \
    something any anyone anybody anything
all every always everyone everybody everything | most usually often mostly many
most usually often mostly | few rarely seldom
"""


def _read_scales(text: str) -> tuple[tuple[frozenset[str], frozenset[str]], ...]:
    """The scales of ``text``; a line beginning "#" is a comment."""
    lines = (line for line in text.strip().splitlines() if not line.startswith("#"))
    return tuple(
        (frozenset(low.split()), frozenset(high.split()))
        for low, high in (line.split("|") for line in lines)
    )


_POLES = _read_scales(_SCALES)


def _scales_by_word() -> dict[str, list[tuple[int, int]]]:
    """Each word of a scale: the scales it is on (by index) and at which end (0 or 1)."""
    ends: dict[str, list[tuple[int, int]]] = {}
    for scale, both_ends in enumerate(_POLES):
        for end, words in enumerate(both_ends):
            for word in words:
                ends.setdefault(word, []).append((scale, end))
    return ends


_ENDS = _scales_by_word()
# Prefixes that turn a word into its opposite ("safe", "unsafe"), each with the shortest
# stem it counts on ("unit" is no "it" undone; "de" prefixes too many words of its own).
_NEGATING_PREFIXES = {
    "un": 4, "in": 4, "im": 4, "il": 4, "ir": 4, "dis": 4, "non": 4, "mis": 4, "anti": 4, "de": 5,
}  # fmt: skip
# Prefixes written apart ("non-toxic" reads as "non toxic").
_NEGATING_PARTICLES = {"non", "anti", "un"}
# Units that are also everyday words ("in", "a day") count only right after a number
# (or "many", "per"): "5 in" is a length, "in 1943" is not.
_UNITS_AFTER_NUMBER = {
    "in", "m", "s", "c", "f", "g", "l", "h", "t", "k", "min", "sec", "hr", "mi", "yd", "ft",
    "oz", "lb", "lbs", "second", "seconds", "minute", "minutes", "hour", "hours", "day",
    "days", "week", "weeks", "month", "months", "year", "years", "pound", "pounds",
}  # fmt: skip
_UNITS = {
    "mm", "cm", "km", "mile", "miles", "meter", "meters", "metre", "metres", "feet", "foot",
    "inch", "inches", "kg", "mg", "ounce", "ounces", "ton", "tons", "ml", "liter", "liters",
    "litre", "litres", "gallon", "gallons", "celsius", "fahrenheit", "kelvin", "usd", "eur",
    "gbp", "inr", "rs", "dollars", "euros", "rupees", "percent", "%", "$", "€", "£", "kb",
    "mb", "gb", "tb", "kbps", "mbps", "ghz", "mhz",
}  # fmt: skip
# Words that carry no topic of their own: they never count as a swapped or substituted
# word, and a capitalised one ("The", "In") names nothing.
_STOPWORDS = frozenset({
    "a", "an", "the", "and", "or", "but", "nor", "so", "yet", "if", "then", "than", "that",
    "this", "these", "those", "there", "here", "of", "in", "on", "at", "to", "for", "from",
    "by", "with", "without", "about", "into", "onto", "over", "under", "up", "down", "out",
    "off", "as", "is", "are", "was", "were", "be", "been", "being", "am", "do", "does", "did",
    "doing", "done", "have", "has", "had", "having", "will", "would", "shall", "should", "can",
    "could", "may", "might", "must", "i", "me", "my", "mine", "we", "us", "our", "ours", "you",
    "your", "yours", "he", "him", "his", "she", "her", "hers", "it", "its", "they", "them",
    "their", "theirs", "what", "which", "who", "whom", "whose", "when", "where", "why", "how",
    "all", "any", "each", "every", "some", "such", "no", "not", "only", "own", "same", "too",
    "very", "just", "also", "both", "either", "neither", "other", "others", "another", "more",
    "most", "much", "many", "few", "less", "least", "one", "ones", "way", "ways", "thing",
    "things", "get", "got", "via", "per", "like",
})  # fmt: skip
# What separates the items of a list: "A , B and C" may list them in any order.
_LIST_MARKS = {",", "and", "or", "&", "/", ";"}
_LIST_FILLERS = _LIST_MARKS | {"the", "a", "an", "as", "well"}
_WORD = re.compile(r"[\w'\u2019%$€£]+")
_TOKEN = re.compile(r"[\w'\u2019%$€£]+|[^\w\s]")
_SENTENCE = re.compile(r"(?<=[.!?])\s+")
# "5!" asks for 120; "5 != 3" and "5!=3" compare.
_FACTORIAL = re.compile(r"\d!(?!=)")
# A short word right after a number (a space at most between): a unit, whose case counts.
_UNIT_AFTER_NUMBER = re.compile(r"(?<![\w.])\d+(?:[.,]\d+)* ?([A-Za-z]{2,4})\b")


class GuardSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    numbers: bool = True  # numbers (digits, number words) must match, in the same roles
    # Marks the embedding barely sees must match: a factorial ("5!" is not "5"), the case
    # of a unit ("1 MB" is not "1 Mb") and the indentation of text on several lines
    # (code).
    form: bool = True
    negation: bool = True  # negations (not, never, n't, without...) must match in number
    # Neither prompt may hold the opposite of a word of the other: the other end of a
    # scale (safe/dangerous, faster/slower, all/some, within/after), or the word with a
    # negating prefix (legal/illegal, toxic/non-toxic).
    polarity: bool = True
    entities: bool = True  # names and units of each must be in the other, in the same roles
    order: bool = True  # shared words must not trade places ("A beat B", "B beat A")
    # Near-identical prompts must not differ in one content word ("square face", "oval
    # face"). Off by default: on Quora pairs it vetoes true duplicates ("best way",
    # "best method") about as often as near misses, and costs a third of the hits on
    # rephrased prompts; for traffic of templated prompts it is worth turning on.
    substitution: bool = False


def _plain(word: str) -> str:
    return word.lower().replace("\u2019", "'").removesuffix("'s")


def _words(text: str) -> list[str]:
    return [_plain(w) for w in _WORD.findall(text)]


def _tokens(text: str) -> list[str]:
    """Words and marks, lowercased, with runs of capitalised words joined into one
    token: "Tien Hogue and Kenneth Brampton" swaps two names, not four words."""
    out: list[str] = []
    joining = False
    for token in _TOKEN.findall(text):
        plain = _plain(token)
        capital = token[0].isupper() and plain not in _STOPWORDS
        if capital and joining:
            out[-1] += "_" + plain
        else:
            out.append(plain)
        joining = capital
    return out


def _is_content(word: str) -> bool:
    return word not in _STOPWORDS and not word.endswith("n't") and any(c.isalnum() for c in word)


def _stem(word: str) -> str:
    for suffix, replacement in (("ies", "y"), ("es", "e"), ("s", ""), ("ing", ""), ("ed", "")):
        if word.endswith(suffix) and len(word) - len(suffix) >= 3 and not word.endswith("ss"):
            return word[: len(word) - len(suffix)] + replacement
    return word


def _same_word(u: str, v: str) -> bool:
    """Light morphology: "India" and "Indians", "spider" and "spiders", "educational"
    and "education" are one word here."""
    if u == v or _stem(u) == _stem(v):
        return True
    short, long = sorted((u, v), key=len)
    return len(short) >= 4 and long.startswith(short) and len(long) - len(short) <= 3


def numbers(text: str) -> tuple[str, ...]:
    digits = [n.replace(",", "").lstrip("+") for n in _NUMBER.findall(text)]
    return (*digits, *(_NUMBER_WORDS[w] for w in _words(text) if w in _NUMBER_WORDS))


def negations(text: str) -> int:
    words = _words(_IDLE_NOT.sub(" ", text))
    return sum(1 for w in words if w in _NEGATIONS or w.endswith("n't"))


def entities(text: str) -> tuple[str, ...]:
    """Names and units, in order: capitalised words that do not open a sentence, words
    in capitals or with an inner capital (NASA, iPhone), and units of measure."""
    found = []
    for sentence in _SENTENCE.split(text.strip()):
        previous = ""
        for position, word in enumerate(_WORD.findall(sentence)):
            plain = _plain(word)
            named = (
                plain not in _STOPWORDS
                and word != "I"
                and (
                    (position > 0 and word[0].isupper())
                    or (len(word) > 1 and word.isupper())
                    or any(c.isupper() for c in word[1:])
                )
            )
            after_number = previous in {"many", "per"} or bool(_NUMBER.fullmatch(previous))
            if named or plain in _UNITS or (after_number and plain in _UNITS_AFTER_NUMBER):
                found.append(plain)
            previous = plain
    return tuple(found)


def _squash(text: str) -> str:
    return re.sub(r"[\W_]+", "", text.lower())


def _missing_entity(text: str, other: str) -> str | None:
    """A name or unit of ``text`` that ``other`` does not mention in any spelling
    ("Mu Sigma" is "Mu-Sigma", "India" is "Indian")."""
    words = set(_words(other))
    squashed = _squash(other)
    for entity in entities(text):
        if entity in words or _squash(entity) in squashed:
            continue
        if not any(_same_word(entity, w) for w in words):
            return entity
    return None


def _slot_score(tokens: Sequence[str], i: int, others: Sequence[str], j: int) -> float:
    """How much token ``i`` of one text and token ``j`` of the other share their place:
    each equal neighbour counts 1 when it is a content word, 0.5 when it is a function
    word or a mark (those are too common to say much)."""
    score = 0.0
    for step in (-1, 1):
        mine = tokens[i + step] if 0 <= i + step < len(tokens) else "^$"
        theirs = others[j + step] if 0 <= j + step < len(others) else "^$"
        if mine == theirs:
            score += 1.0 if _is_content(mine) else 0.5
    return score


def _listed(tokens: Sequence[str], i: int, j: int) -> bool:
    """Tokens i < j are items of one short list ("Blackpool , York and Liverpool")."""
    between = tokens[i + 1 : j]
    if len(between) > 15 or not _LIST_MARKS.intersection(between):
        return False
    # Items end at a mark: "Kenneth and actress Tien" is no list of Kenneth and Tien.
    if between[0] not in _LIST_FILLERS or between[-1] not in _LIST_FILLERS:
        return False
    run = 0
    for token in between:
        run = 0 if token in _LIST_FILLERS else run + 1
        if run > 3:
            return False
    return True


def _compound(first: Sequence[str], second: Sequence[str]) -> bool:
    """The words between two tokens in each text: next to each other in one, joined
    by "of" in the other. "The generate_examples method" is "the method of
    generate_examples"; "dog food" is not "food dog"."""
    joined, apart = sorted((first, second), key=len)
    return not joined and "of" in apart and set(apart) <= {"of", "the", "a", "an"}


def _slot_swap(
    cached: Sequence[str], query: Sequence[str], keep: Callable[[str], bool]
) -> tuple[str, str] | None:
    """Two words (each once in each text) whose order flips and where one took the
    other's place: "the fictional plot ... the medieval kingdoms" against "the
    medieval plot ... the fictional kingdoms". A clause moved whole ("In 1943, X had
    a son" against "X had a son in 1943") flips the order of many words but puts no
    word between another's neighbours, and lists may be reordered freely."""
    counts_c, counts_q = Counter(cached), Counter(query)
    at_c = {t: i for i, t in enumerate(cached) if counts_c[t] == 1 and keep(t)}
    at_q = {t: i for i, t in enumerate(query) if counts_q[t] == 1 and keep(t)}
    shared = sorted((t for t in at_c if t in at_q), key=at_c.__getitem__)
    for n, x in enumerate(shared):
        for y in shared[n + 1 :]:
            if at_q[x] < at_q[y]:
                continue
            if _listed(cached, at_c[x], at_c[y]) and _listed(query, at_q[y], at_q[x]):
                continue
            if _compound(cached[at_c[x] + 1 : at_c[y]], query[at_q[y] + 1 : at_q[x]]):
                continue
            took_y = _slot_score(query, at_q[x], cached, at_c[y])  # x now where y was
            took_x = _slot_score(query, at_q[y], cached, at_c[x])
            # One place taken over outright, or both places half taken over.
            if max(took_y, took_x) >= 1.5 or (min(took_y, took_x) > 0 and max(took_y, took_x) >= 1):
                return x, y
    return None


def _aligned_swap(cached: Sequence[str], query: Sequence[str]) -> tuple[str, str] | None:
    """Two short edits of an otherwise aligned pair of texts that trade words: x is
    replaced by y here and y by x there ("small municipality and civil village",
    "civil parish and small village"). Catches swaps whose neighbours changed too."""
    ops = difflib.SequenceMatcher(None, cached, query, autojunk=False).get_opcodes()
    edits = [
        ({w for w in cached[i1:i2] if _is_content(w)}, {w for w in query[j1:j2] if _is_content(w)})
        for op, i1, i2, j1, j2 in ops
        if op == "replace" and i2 - i1 <= 3 and j2 - j1 <= 3
    ]
    for n, (was_here, now_here) in enumerate(edits):
        for m, (was_there, now_there) in enumerate(edits):
            if n != m and (moved := was_here & now_there) and (back := was_there & now_here):
                return min(moved), min(back)
    return None


def _substituted(cached: Sequence[str], query: Sequence[str]) -> tuple[str, str] | None:
    """The one edit between two otherwise identical texts replaces a content word by an
    unrelated one (not another form of it): "square face" and "oval face"."""
    ops = difflib.SequenceMatcher(None, cached, query, autojunk=False).get_opcodes()
    changed = [(i1, i2, j1, j2) for op, i1, i2, j1, j2 in ops if op != "equal"]
    if len(changed) > 2 or any(i2 - i1 > 2 or j2 - j1 > 2 for i1, i2, j1, j2 in changed):
        return None
    edits = [
        ([w for w in cached[i1:i2] if _is_content(w)], [w for w in query[j1:j2] if _is_content(w)])
        for i1, i2, j1, j2 in changed
    ]
    edits = [(was, now) for was, now in edits if was or now]
    if len(edits) != 1:
        return None
    (was, now) = edits[0]
    if was and now and not any(_same_word(u, v) for u in was for v in now):
        return was[0], now[0]
    return None


def explain(cached: str, query: str, settings: GuardSettings) -> tuple[str, str] | None:
    """The first guard that vetoes a hit between the two prompts and the words that
    made it, or None when every enabled guard accepts."""
    pair = _Pair(cached, query, _tokens(cached), _tokens(query), _words(cached), _words(query))
    guards: tuple[tuple[str, bool, Callable[[_Pair], str | None]], ...] = (
        ("numbers", settings.numbers, _numbers_differ),
        ("form", settings.form, _form_differs),
        ("negation", settings.negation, _negation_differs),
        ("polarity", settings.polarity, _polarity_differs),
        ("entities", settings.entities, _entities_differ),
        ("order", settings.order, _order_differs),
        ("substitution", settings.substitution, _word_substituted),
    )
    for guard, enabled, check in guards:
        if enabled and (words := check(pair)) is not None:
            return guard, words
    return None


class _Pair(NamedTuple):
    """A cached prompt and a query, read once for every guard."""

    cached: str
    query: str
    cached_tokens: list[str]
    query_tokens: list[str]
    cached_words: list[str]
    query_words: list[str]


def _numbers_differ(pair: _Pair) -> str | None:
    mine, theirs = Counter(numbers(pair.cached)), Counter(numbers(pair.query))
    if mine != theirs:
        return " ".join(sorted((mine - theirs) + (theirs - mine)))
    # "6 divided by 3" is not "3 divided by 6".
    swap = _slot_swap(pair.cached_tokens, pair.query_tokens, lambda t: any(c.isdigit() for c in t))
    return " <-> ".join(swap) if swap else None


def _form_differs(pair: _Pair) -> str | None:
    if _factorials(pair.cached) != _factorials(pair.query):
        return "!"
    cased = _cased(pair.cached, pair.query)
    if cased is not None:
        return cased
    if _indents(pair.cached) != _indents(pair.query):
        return "indentation"
    return None


def _factorials(text: str) -> list[str]:
    return _FACTORIAL.findall(text)


def _cased(cached: str, query: str) -> str | None:
    """A unit right after a number, written with other capitals in the other text:
    units are case-sensitive ("1 MB" is not "1 Mb", "5 mW" not "5 MW"). Elsewhere
    capitals say little: Quora writes "tv" for "TV", and a sentence may start with
    "They" or "they"."""
    theirs: dict[str, set[str]] = {}
    for unit in _UNIT_AFTER_NUMBER.findall(query):
        theirs.setdefault(unit.lower(), set()).add(unit)
    for unit in _UNIT_AFTER_NUMBER.findall(cached):
        for other in sorted(theirs.get(unit.lower(), ())):
            if unit != other:
                return f"{unit} <-> {other}"
    return None


def _indents(text: str) -> list[int]:
    """The indentation of each line of text on several lines (none for one line)."""
    lines = [line for line in text.splitlines() if line.strip()]
    return [len(line) - len(line.lstrip()) for line in lines] if len(lines) > 1 else []


def _negation_differs(pair: _Pair) -> str | None:
    return "not" if negations(pair.cached) != negations(pair.query) else None


def _polarity_differs(pair: _Pair) -> str | None:
    """A word at one end of a scale in one prompt only, against a word at the other end
    in the other only; a word and its negating-prefix form; a prefix written apart."""
    cached_only = set(pair.cached_words) - set(pair.query_words)
    query_only = set(pair.query_words) - set(pair.cached_words)
    # An end counts only against the other end: "attract more girls" and "attract
    # girls" ask the same; "more" against "less" does not.
    theirs = {(scale, end): word for word, scale, end in _scale_ends(pair.query_words, query_only)}
    for word, scale, end in _scale_ends(pair.cached_words, cached_only):
        if (opposite := theirs.get((scale, 1 - end))) is not None:
            return f"{word} <-> {opposite}"
    for word, others in sorted(
        [(w, query_only) for w in cached_only] + [(w, cached_only) for w in query_only]
    ):
        for prefix, shortest in _NEGATING_PREFIXES.items():
            stem = word.removeprefix(prefix)
            if len(stem) >= shortest and stem != word and any(_same_word(stem, w) for w in others):
                return f"{word} <-> {stem}"
    particles = (cached_only | query_only) & _NEGATING_PARTICLES
    return min(particles) if particles else None


def _scale_ends(words: list[str], only: set[str]) -> list[tuple[str, int, int]]:
    """(word, scale, end) of each word of ``only`` that sits at an end of a scale; after
    "less" it counts at the other end ("less expensive" is "cheaper")."""
    found = []
    for i, word in enumerate(words):
        if word in only:
            flipped = i > 0 and words[i - 1] in ("less", "least")
            found += [(word, scale, end ^ flipped) for scale, end in _ENDS.get(word, ())]
    return found


def _entities_differ(pair: _Pair) -> str | None:
    missing = _missing_entity(pair.cached, pair.query) or _missing_entity(pair.query, pair.cached)
    if missing:
        return missing
    # "Is Paris bigger than London?" is not "Is London bigger than Paris?".
    named = set(entities(pair.cached) + entities(pair.query))
    swap = _slot_swap(
        pair.cached_tokens, pair.query_tokens, lambda t: any(p in named for p in t.split("_"))
    )
    return " <-> ".join(swap) if swap else None


def _order_differs(pair: _Pair) -> str | None:
    swap = _slot_swap(pair.cached_tokens, pair.query_tokens, _is_content) or _aligned_swap(
        pair.cached_words, pair.query_words
    )
    return " <-> ".join(swap) if swap else None


def _word_substituted(pair: _Pair) -> str | None:
    changed = _substituted(pair.cached_words, pair.query_words)
    return " -> ".join(changed) if changed else None


def veto(cached: str, query: str, settings: GuardSettings) -> str | None:
    """Why a semantic hit between the two prompts must not be served, or None."""
    found = explain(cached, query, settings)
    return None if found is None else found[0]
