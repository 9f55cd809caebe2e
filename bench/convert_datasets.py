"""Turn the public question sets into LabelledQuestion JSONL (see evaluator/answers.py).

Each output line is ``{"prompt", "answers", "kind", "source"}``: what a user would ask a
chat model, the gold answers that grade its reply, and how to grade. Sources, all read
from the shared data folder (``../shared/data`` from the project root unless --data):

  number  gsm8k (gold after "####"), multiarith, addsub, singleeq (lSolutions),
          simple_arithmetic (context "25-759=", continuation "-734")
  choice  arc_easy, arc_challenge, openbookqa (LLM-Adapters' "Answer1: ..." form),
          mmlu_stem (a choices list and the answer's index)
  yesno   boolq (LLM-Adapters' true/false form; the passage is not in the file)
  text    triviaqa (answer and aliases), nq_open (answer list)

Prompts are phrased so that a tiny model has a chance: the question, choices as "A. ..."
lines, and one line on the form of the answer. A question that repeats, within a source
or across sources (110 of SingleEq's are AddSub's), is kept once, by the first source in
the order above, so a router fitted on the mix is never scored on a copy of a training
question. Gold answers that cannot be graded (NQ's "---") drop their row. Up to
--per-source questions are sampled per source, reproducibly from --seed and the source
name alone, and written in file order; --then-rest follows them with every other
question of the source, in file order, so that a bank of the sample can be resumed into
a bank of the whole set. Run:
    .venv/bin/python bench/convert_datasets.py --out FILE.jsonl [--data DIR]
        [--per-source 200] [--seed 0] [--sources gsm8k,arc_easy,...] [--as-asked]
        [--then-rest]
"""

from __future__ import annotations

import argparse
import json
import random
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import msgspec

from evaluator.answers import LabelledQuestion, extract, normalise_text

ROOT = Path(__file__).resolve().parent.parent

DEFAULT_DATA = ROOT / ".." / "shared" / "data"

NUMBER_ONLY = "Answer with the number only."
LETTER_ONLY = "Answer with the letter only."
YES_OR_NO = "Answer yes or no."
FEW_WORDS = "Answer in a few words."

LETTERS = "ABCDE"


class DataError(ValueError):
    """A data file is not in the form its loader expects."""


def _read_json(path: Path) -> Any:
    with open(path, encoding="utf-8") as file:
        return json.load(file)


def _read_jsonl(path: Path) -> Iterator[Any]:
    with open(path, encoding="utf-8") as file:
        for line in file:
            if line.strip():
                yield json.loads(line)


def _tidy(text: str) -> str:
    """Undo MAWPS' tokenisation ("beach . she", "Dan 's", "$ 5.84"): one space between
    words, none before punctuation or a possessive, none after a dollar sign."""
    text = re.sub(r" ([.,?!:;])(?= |$)", r"\1", " ".join(text.split()))
    return re.sub(r" (?='s\b)|(?<=\$) (?=\d)", "", text)


def _sentence(text: str) -> str:
    """BoolQ and NQ questions are lowercase, and NQ's have no question mark."""
    text = _tidy(text)
    text = text[:1].upper() + text[1:]
    return text if text.endswith(("?", ".", ":")) else f"{text}?"


# --- one helper per answer kind ----------------------------------------------------------


def _math(question: str, gold: object, source: str) -> LabelledQuestion:
    answer = extract("number", str(gold))
    if answer is None:
        raise DataError(f"{source}: gold answer {gold!r} is not a number")
    return LabelledQuestion(f"{_tidy(question)}\n\n{NUMBER_ONLY}", [answer], "number", source)


def _choice(question: str, choices: list[str], index: int, source: str) -> LabelledQuestion:
    if not 0 <= index < len(choices) <= len(LETTERS):
        raise DataError(f"{source}: answer {index} of {len(choices)} choices in {question!r}")
    lines = "\n".join(f"{LETTERS[i]}. {_tidy(choice)}" for i, choice in enumerate(choices))
    prompt = f"{_tidy(question)}\n\n{lines}\n\n{LETTER_ONLY}"
    return LabelledQuestion(prompt, [LETTERS[index]], "choice", source)


def _text(
    question: str, answers: list[str], aliases: list[str], source: str
) -> LabelledQuestion | None:
    """Text that normalises to nothing ("---", "A+") would match any reply, so a row
    whose own answers include one is dropped, and such an extra alias left out."""
    if not answers or any(not normalise_text(answer) for answer in answers):
        return None
    kept: dict[str, str] = {}
    for alias in [*answers, *aliases]:
        kept.setdefault(normalise_text(alias), alias)
    kept.pop("", None)
    prompt = f"{_sentence(question)}\n\n{FEW_WORDS}"
    return LabelledQuestion(prompt, list(kept.values()), "text", source)


# --- the sources -------------------------------------------------------------------------

Loader = Callable[[Path], Iterable[LabelledQuestion | None]]


def gsm8k(data: Path) -> Iterator[LabelledQuestion]:
    for row in _read_jsonl(data / "gsm8k" / "test.jsonl"):
        yield _math(row["question"], row["answer"].rsplit("####", 1)[1], "gsm8k")


def _mawps(folder: str, file: str) -> Loader:
    def load(data: Path) -> Iterator[LabelledQuestion]:
        for row in _read_json(data / folder / file):
            (solution,) = row["lSolutions"]
            yield _math(row["sQuestion"], solution, folder)

    return load


def simple_arithmetic(data: Path) -> Iterator[LabelledQuestion]:
    for row in _read_jsonl(data / "simple_arithmetic" / "simple_arithmetic_nospaces.jsonl"):
        # "25 - 759" rather than "25-759": tiny models read spaced operators far better.
        expression = re.sub(r"(?<=\d)([-+*/])", r" \1 ", row["context"].rstrip("= "))
        yield _math(f"What is {expression}?", row["continuation"], "simple_arithmetic")


# LLM-Adapters' instruction form: "Please choose the correct answer to the question:
# {question}\n\nAnswer1: ... Answer2: ...\n\nAnswer format: answer1/answer2/...".
_ADAPTERS_CHOICE = re.compile(
    r"Please choose the correct answer to the question: (?P<question>.*?)\n\n"
    r"(?P<choices>Answer1: .*?)\n\nAnswer format: [a-z0-9/]+",
    re.DOTALL,
)
_ADAPTERS_NUMBERED = re.compile(r"(?:^|\s)Answer(\d):\s*")
_ADAPTERS_ANSWER = re.compile(r"answer(\d)")


def _adapters_choice(folder: str) -> Loader:
    def load(data: Path) -> Iterator[LabelledQuestion]:
        for row in _read_json(data / folder / "test.json"):
            form = _ADAPTERS_CHOICE.fullmatch(row["instruction"])
            answer = _ADAPTERS_ANSWER.fullmatch(row["answer"])
            if form is None or answer is None:
                raise DataError(f"{folder}: unexpected row {row!r}")
            # re.split with a group gives ["", "1", text, "2", text, ...].
            parts = _ADAPTERS_NUMBERED.split(form["choices"])[1:]
            numbers, choices = parts[0::2], parts[1::2]
            if numbers != [str(n) for n in range(1, len(choices) + 1)]:
                raise DataError(f"{folder}: choices out of order in {row['instruction']!r}")
            yield _choice(form["question"], choices, int(answer[1]) - 1, folder)

    return load


_ADAPTERS_BOOLQ = re.compile(
    r"Please answer the following question with true or false, question: (?P<question>.*?)"
    r"\n\nAnswer format: true/false",
    re.DOTALL,
)


def boolq(data: Path) -> Iterator[LabelledQuestion]:
    for row in _read_json(data / "boolq" / "test.json"):
        form = _ADAPTERS_BOOLQ.fullmatch(row["instruction"])
        if form is None or row["answer"] not in ("true", "false"):
            raise DataError(f"boolq: unexpected row {row!r}")
        gold = "yes" if row["answer"] == "true" else "no"
        prompt = f"{_sentence(form['question'])}\n\n{YES_OR_NO}"
        yield LabelledQuestion(prompt, [gold], "yesno", "boolq")


def mmlu_stem(data: Path) -> Iterator[LabelledQuestion]:
    for row in _read_jsonl(data / "mmlu_stem" / "test.jsonl"):
        yield _choice(row["question"], row["choices"], row["answer"], "mmlu_stem")


_TRIVIA_CONTEXT = re.compile(r"Question: (?P<question>.*)\nAnswer:", re.DOTALL)


def triviaqa(data: Path) -> Iterator[LabelledQuestion | None]:
    for row in _read_jsonl(data / "triviaqa" / "triviaqa_sm_sub.jsonl"):
        form = _TRIVIA_CONTEXT.fullmatch(row["context"])
        if form is None:
            raise DataError(f"triviaqa: unexpected context {row['context']!r}")
        yield _text(form["question"], [row["answer"]], row["aliases"], "triviaqa")


def nq_open(data: Path) -> Iterator[LabelledQuestion | None]:
    for row in _read_jsonl(data / "nq_open" / "NQ-open.dev.jsonl"):
        yield _text(row["question"], row["answer"], [], "nq_open")


# In precedence order: a question found in two sources stays with the first.
SOURCES: dict[str, Loader] = {
    "gsm8k": gsm8k,
    "multiarith": _mawps("multiarith", "MultiArith.json"),
    "addsub": _mawps("addsub", "AddSub.json"),
    "singleeq": _mawps("singleeq", "SingleEq.json"),
    "simple_arithmetic": simple_arithmetic,
    "arc_easy": _adapters_choice("arc_easy"),
    "arc_challenge": _adapters_choice("arc_challenge"),
    "openbookqa": _adapters_choice("openbookqa"),
    "mmlu_stem": mmlu_stem,
    "boolq": boolq,
    "triviaqa": triviaqa,
    "nq_open": nq_open,
}


class Pool(msgspec.Struct):
    """One source's distinct, gradeable questions and what was left out on the way."""

    questions: list[LabelledQuestion]
    rows: int = 0
    repeated: int = 0
    ungradeable: int = 0


def _key(question: LabelledQuestion) -> str:
    return " ".join(question.prompt.lower().split())


def load_pools(data: Path, sources: list[str]) -> dict[str, Pool]:
    """Every requested source, and those before it whose questions take precedence."""
    last = max(list(SOURCES).index(name) for name in sources)
    seen: set[str] = set()
    pools: dict[str, Pool] = {}
    for name in list(SOURCES)[: last + 1]:
        pool = Pool([])
        for question in SOURCES[name](data):
            pool.rows += 1
            if question is None:
                pool.ungradeable += 1
            elif _key(question) in seen:
                pool.repeated += 1
            else:
                seen.add(_key(question))
                pool.questions.append(question)
        pools[name] = pool
    return {name: pools[name] for name in sources}


WORD_PROBLEMS = frozenset({"gsm8k", "multiarith", "addsub", "singleeq"})


def as_asked(question: LabelledQuestion) -> LabelledQuestion:
    """A word problem as a user would ask it, without the request to answer with the
    number only: a chat model then reasons before it answers (and needs the tokens)."""
    if question.source not in WORD_PROBLEMS:
        return question
    prompt = question.prompt.removesuffix(f"\n\n{NUMBER_ONLY}")
    return msgspec.structs.replace(question, prompt=prompt)


def sample(questions: list[LabelledQuestion], n: int, seed: int, source: str) -> list[int]:
    """Indices of up to n questions, in file order; the same whichever sources are asked."""
    rng = random.Random(f"{seed}:{source}")
    return sorted(rng.sample(range(len(questions)), min(n, len(questions))))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", type=Path, required=True, help="JSONL file to write")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="shared data folder")
    parser.add_argument("--per-source", type=int, default=200, help="most questions a source")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--sources", default=",".join(SOURCES), help=f"comma-separated, of: {','.join(SOURCES)}"
    )
    parser.add_argument(
        "--as-asked",
        action="store_true",
        help="word problems without 'Answer with the number only.' (models reason first)",
    )
    parser.add_argument(
        "--then-rest",
        action="store_true",
        help="after each source's sample, every other question of it, in file order",
    )
    args = parser.parse_args(argv)
    sources = [name.strip() for name in args.sources.split(",") if name.strip()]
    unknown = [name for name in sources if name not in SOURCES]
    if unknown or not sources:
        parser.error(f"unknown sources {unknown}; choose from {', '.join(SOURCES)}")
    if args.per_source < 1:
        parser.error("--per-source must be at least 1")
    if not args.data.is_dir():
        parser.error(f"no data folder at {args.data}")

    pools = load_pools(args.data, list(dict.fromkeys(sources)))
    encoder = msgspec.json.Encoder()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    total = 0
    with open(args.out, "wb") as out:
        for name, pool in pools.items():
            chosen = sample(pool.questions, args.per_source, args.seed, name)
            if args.then_rest:
                sampled = set(chosen)
                chosen += [i for i in range(len(pool.questions)) if i not in sampled]
            for index in chosen:
                question = pool.questions[index]
                out.write(encoder.encode(as_asked(question) if args.as_asked else question) + b"\n")
            total += len(chosen)
            print(
                f"{name:18} {len(chosen):5} of {len(pool.questions):5} "
                f"({pool.rows} rows, {pool.repeated} repeated, {pool.ungradeable} ungradeable)"
            )
    print(f"{'total':18} {total:5} -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
