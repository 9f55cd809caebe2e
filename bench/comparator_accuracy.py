"""How often the shadow checks' comparator (evaluator/agreement.py) is right, per kind.

Each pair is two models' answers to one question: a "shortcut" side (the weaker or
cheaper answer) and a "reference" side (the answer of the path a shortcut skips). The
labels come from the sources' own grading against gold, never from this project:

  agree     both answers were graded correct, so they give the same answer;
  disagree  exactly one was graded correct, so they give different answers;
  (neither) both were graded wrong: they may or may not agree. Reported apart, with
            how often the comparator says they agree.

Sources, read from the shared data folder (``../shared/data`` unless --data says):

  number  routellm_gsm8k: Mixtral-8x7B-Instruct vs GPT-4-1106 on GSM8K test (RouteLLM's
          grading). zeroshot_cot_logs: text-davinci-002 answering at once vs after
          "Let's think step by step" (Kojima et al.'s logs; correct = pred equals GT),
          on GSM8K and MultiArith. GSM8K's questions are in both, answered by
          different models.
  choice  routerbench_subset ARC-Challenge and Winogrande: mixtral-8x7b-chat vs
          GPT-4-1106 (RouterBench's grading), one pair per question. Also, apart, each
          of its other ten models vs GPT-4: those pairs share questions, so that row's
          intervals treat dependent pairs as independent and are too narrow.
          routellm_mmlu has no responses, only correctness: it cannot be used.
  yesno   none: no source here has model responses to yes/no questions. Not measured.
  text    no source here has model responses to short free-text questions. The labels
          are gold answers instead: two accepted answers of one TriviaQA or NQ-open
          question (TriviaQA aliases are often Wikipedia redirects: "onion" and
          "allium cepa") = agree; an accepted answer of another question = disagree,
          the one of 20 random other questions' answers sharing the most words with it
          (no accepted answer in common). NQ's accepted answers to one question are
          sometimes different answers ("1960", "1980"), so some "agree" labels are not
          one answer in two wordings. The free-text rule is chosen on a fitting
          half of these questions (seeded, by question) by balanced accuracy, and
          reported on the other half only. Also, apart: routerbench MBPP code,
          mixtral-8x7b-chat vs GPT-4 (both pass the tests = agree), which the
          comparator declines to judge (too long); what word overlap would have said
          there is shown as a diagnostic.

Every pair goes through ``compare(question, answer, reference)`` with no kind, as the
gateway calls it: the kind is inferred, and a pair compared as another kind than its
source's is counted. Accuracy is over the pairs the comparator decided (agree is not
None); undecided pairs are counted apart. Intervals are 95% Wilson.

    .venv/bin/python bench/comparator_accuracy.py [--data DIR] [--seed 0] [--json FILE]
"""

from __future__ import annotations

import argparse
import ast
import csv
import hashlib
import json
import random
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

import msgspec

from evaluator import agreement
from evaluator.agreement import compare, contained, token_f1
from evaluator.answers import AnswerKind, _numbers_close, normalise_text
from evaluator.replay_report import wilson

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA = ROOT / ".." / "shared" / "data"

csv.field_size_limit(sys.maxsize)

Label = Literal["agree", "disagree"] | None

ROUTELLM_WEAK = "mistralai/Mixtral-8x7B-Instruct-v0.1"
ROUTELLM_STRONG = "gpt-4-1106-preview"
ROUTERBENCH_WEAK = "mistralai/mixtral-8x7b-chat"
ROUTERBENCH_STRONG = "gpt-4-1106-preview"
# Candidates for the most-similar negative of a text question.
NEGATIVE_POOL = 20
F1_GRID = tuple(round(0.1 * i, 1) for i in range(1, 10))


class Pair(msgspec.Struct, frozen=True):
    source: str
    kind: AnswerKind  # the source's
    question: str
    answer: str  # the shortcut side
    reference: str
    label: Label  # None: both graded wrong
    gold: str | None = None  # the gold answer, where the source has one


class Judged(msgspec.Struct, frozen=True):
    pair: Pair
    verdict: agreement.Agreement


def label(weak_correct: bool, strong_correct: bool) -> Label:
    if weak_correct and strong_correct:
        return "agree"
    return "disagree" if weak_correct != strong_correct else None


# --- sources ---------------------------------------------------------------------------


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def _gsm8k_gold(data: Path) -> dict[str, str]:
    path = data / "gsm8k" / "test.jsonl"
    if not path.is_file():
        return {}
    gold = {}
    for line in _lines(path):
        row = json.loads(line)
        gold[row["question"].strip()] = row["answer"].rsplit("####", 1)[1].strip()
    return gold


def routellm_gsm8k(data: Path) -> Iterator[Pair]:
    gold = _gsm8k_gold(data)
    for row in _rows(data / "routellm_gsm8k" / "gsm8k_responses.csv"):
        yield Pair(
            "routellm_gsm8k",
            "number",
            row["prompt"],
            row[f"{ROUTELLM_WEAK}_response"],
            row[f"{ROUTELLM_STRONG}_response"],
            label(row[ROUTELLM_WEAK] == "True", row[ROUTELLM_STRONG] == "True"),
            gold.get(row["prompt"].strip()),
        )


class _Logged(msgspec.Struct, frozen=True):
    question: str
    response: str
    correct: bool
    gold: str


_LOG_ITEM = re.compile(
    r"^Q: (?P<question>.*?)\nA: (?P<response>.*?)\npred_before : .*?"
    r"^pred_mode : (?P<pred>[^\n]*)\nGT : (?P<gold>[^\n]*)$",
    re.DOTALL | re.MULTILINE,
)


def _same_number(pred: str, gold: str) -> bool:
    try:
        return float(pred.replace(",", "")) == float(gold.replace(",", ""))
    except ValueError:
        return False


def _read_log(path: Path) -> dict[str, _Logged]:
    items = {}
    for match in _LOG_ITEM.finditer(path.read_text(encoding="utf-8")):
        question = match["question"].strip()
        correct = _same_number(match["pred"].strip(), match["gold"].strip())
        items[question] = _Logged(question, match["response"], correct, match["gold"].strip())
    return items


def zeroshot_cot(dataset: str) -> Callable[[Path], Iterator[Pair]]:
    def load(data: Path) -> Iterator[Pair]:
        folder = data / "zeroshot_cot_logs"
        direct = _read_log(folder / f"{dataset}_zero_shot.log")
        reasoned = _read_log(folder / f"{dataset}_zero_shot_cot.log")
        for question, quick in direct.items():
            slow = reasoned.get(question)
            if slow is not None:
                yield Pair(
                    f"zeroshot_cot_{dataset}",
                    "number",
                    question,
                    quick.response,
                    slow.response,
                    label(quick.correct, slow.correct),
                    quick.gold.replace(",", ""),
                )

    return load


def _listed(text: str) -> str | None:
    """RouterBench keeps each prompt and response as a Python list of strings."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return None
    return "".join(value) if isinstance(value, list) else str(value)


def _score(text: str) -> bool | None:
    return float(text) > 0.5 if text.strip() else None


def routerbench(
    file: str, kind: AnswerKind, weak: Iterable[str] | None = None
) -> Callable[[Path], Iterator[Pair]]:
    """Pairs (each weak model, GPT-4) from one RouterBench file; RouteLLM's pair alone
    unless ``weak`` names others."""

    def load(data: Path) -> Iterator[Pair]:
        rows = _rows(data / "routerbench_subset" / f"{file}.csv")
        models = list(weak) if weak is not None else [ROUTERBENCH_WEAK]
        for row in rows:
            question = _listed(row["prompt"]) or row["prompt"]
            strong = _score(row[ROUTERBENCH_STRONG])
            reference = _listed(row[f"{ROUTERBENCH_STRONG}|model_response"])
            for model in models:
                mine = _score(row[model])
                answer = _listed(row[f"{model}|model_response"])
                if None in (strong, mine, answer, reference):
                    continue  # a model has no result for this row
                yield Pair(
                    file if weak is None else f"{file}_all",
                    kind,
                    question,
                    answer or "",
                    reference or "",
                    label(bool(mine), bool(strong)),
                )

    return load


def _routerbench_models(data: Path) -> list[str]:
    header = _rows(data / "routerbench_subset" / "arc_challenge_test.csv")[0]
    suffix = "|model_response"
    models = [key.removesuffix(suffix) for key in header if key.endswith(suffix)]
    return [model for model in models if model != ROUTERBENCH_STRONG]


# --- free text: gold answers of the same question and of others -----------------------


class _Accepted(msgspec.Struct, frozen=True):
    question: str
    answers: list[str]  # one spelling per distinct normalised form, first seen first
    normalised: list[str]  # the same, normalised


def _accepted(question: str, answers: Iterable[str]) -> _Accepted | None:
    kept: dict[str, str] = {}
    for answer in answers:
        norm = normalise_text(answer)
        if norm:
            kept.setdefault(norm, answer)
    return _Accepted(question, list(kept.values()), list(kept)) if kept else None


def _lines(path: Path) -> list[str]:
    # Not splitlines(): it also splits at U+2028, which a JSON string may hold.
    return [line for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]


def _trivia_questions(data: Path) -> Iterator[_Accepted | None]:
    for line in _lines(data / "triviaqa" / "triviaqa_sm_sub.jsonl"):
        row = json.loads(line)
        question = row["context"].removeprefix("Question: ").removesuffix("\nAnswer:")
        yield _accepted(question, [row["answer"], *row["aliases"]])


def _nq_questions(data: Path) -> Iterator[_Accepted | None]:
    for line in _lines(data / "nq_open" / "NQ-open.dev.jsonl"):
        row = json.loads(line)
        yield _accepted(row["question"], row["answer"])


def _nearest_other(
    i: int, questions: list[_Accepted], rng: random.Random
) -> tuple[str, str] | None:
    """(this question's first answer, the most word-sharing answer of another)."""
    own = set(questions[i].normalised)
    words = set(questions[i].normalised[0].split())
    best: tuple[int, float, str] | None = None
    for j in rng.sample(range(len(questions)), min(NEGATIVE_POOL, len(questions))):
        other = questions[j]
        if j == i or own.intersection(other.normalised):
            continue
        for spelling, norm in zip(other.answers, other.normalised, strict=True):
            key = (len(words.intersection(norm.split())), rng.random(), spelling)
            best = max(best, key) if best else key
    return (questions[i].answers[0], best[2]) if best else None


def gold_text(
    name: str, read: Callable[[Path], Iterator[_Accepted | None]]
) -> Callable[[Path, int], Iterator[Pair]]:
    def load(data: Path, seed: int) -> Iterator[Pair]:
        questions = [q for q in read(data) if q is not None]
        rng = random.Random(f"{seed}:{name}")
        for i, accepted in enumerate(questions):
            first, *others = accepted.answers
            if others:
                other = rng.choice(others)
                yield Pair(name, "text", accepted.question, first, other, "agree")
            negative = _nearest_other(i, questions, rng)
            if negative is not None:
                yield Pair(name, "text", accepted.question, *negative, "disagree")

    return load


# --- scoring ---------------------------------------------------------------------------


def fitting(question: str, seed: int) -> bool:
    """Which half a question is in: fitting (True) or held out, by a seeded hash."""
    digest = hashlib.sha256(f"{seed}\0{question}".encode()).digest()
    return digest[0] % 2 == 0


def _rate(k: int, n: int) -> dict[str, Any]:
    low, high = wilson(k, n)
    if n:  # the formula's bounds can stray past 0 or 1 by a rounding error
        low, high = max(0.0, low), min(1.0, high)
    return {"k": k, "n": n, "rate": k / n if n else None, "low": low, "high": high}


def score(judged: list[Judged]) -> dict[str, Any]:
    labelled = [j for j in judged if j.pair.label is not None]
    decided = [j for j in labelled if j.verdict.agree is not None]
    right = sum((j.verdict.agree is True) == (j.pair.label == "agree") for j in decided)
    on_disagree = [j for j in decided if j.pair.label == "disagree"]
    on_agree = [j for j in decided if j.pair.label == "agree"]
    both_wrong = [j for j in judged if j.pair.label is None]
    return {
        "labelled": len(labelled),
        "undecided": len(labelled) - len(decided),
        "other_kind": sum(j.verdict.kind != j.pair.kind for j in labelled),
        "accuracy": _rate(right, len(decided)),
        "false_agree": _rate(sum(j.verdict.agree is True for j in on_disagree), len(on_disagree)),
        "false_disagree": _rate(sum(j.verdict.agree is False for j in on_agree), len(on_agree)),
        "both_wrong": {
            "n": len(both_wrong),
            "undecided": sum(j.verdict.agree is None for j in both_wrong),
            "said_agree": _rate(
                sum(j.verdict.agree is True for j in both_wrong),
                sum(j.verdict.agree is not None for j in both_wrong),
            ),
        },
    }


def gold_check(judged: list[Judged]) -> dict[str, int]:
    """Label noise, where a source has gold: a false agree whose two answers both read
    as the gold answer, or a false disagree where only one does, says the source's
    grader and this project's extraction differ on an answer, not that the comparator
    misread the pair."""

    def is_gold(text: str | None, gold: str | None) -> bool:
        return text is not None and gold is not None and _numbers_close(text, gold)

    false_agree = [j for j in judged if j.pair.label == "disagree" and j.verdict.agree is True]
    false_disagree = [j for j in judged if j.pair.label == "agree" and j.verdict.agree is False]
    return {
        "false_agree": len(false_agree),
        "false_agree_both_gold": sum(
            is_gold(j.verdict.answer, j.pair.gold) and is_gold(j.verdict.reference, j.pair.gold)
            for j in false_agree
        ),
        "false_disagree": len(false_disagree),
        "false_disagree_one_gold": sum(
            is_gold(j.verdict.answer, j.pair.gold) != is_gold(j.verdict.reference, j.pair.gold)
            for j in false_disagree
        ),
    }


# --- the free-text rule, fitted --------------------------------------------------------

TextRule = tuple[str, float | None]  # ("f1" | "contained" | "contained_or_f1", threshold)


def _rule_says(rule: TextRule, a: str, b: str) -> bool:
    name, threshold = rule
    if name == "contained":
        return contained(a, b)
    overlap = token_f1(a, b) >= (threshold or 0.0)
    return overlap if name == "f1" else overlap or contained(a, b)


def _balanced(rule: TextRule, pairs: list[tuple[str, str, bool]]) -> float:
    hits = {True: [0, 0], False: [0, 0]}
    for a, b, agree in pairs:
        hits[agree][0] += _rule_says(rule, a, b) == agree
        hits[agree][1] += 1
    return sum(k / n for k, n in hits.values() if n) / sum(1 for _, n in hits.values() if n)


def fit_text_rule(pairs: list[Pair]) -> dict[str, Any]:
    normalised = [
        (normalise_text(p.answer), normalise_text(p.reference), p.label == "agree") for p in pairs
    ]
    rules: list[TextRule] = [("contained", None)]
    rules += [(name, t) for name in ("f1", "contained_or_f1") for t in F1_GRID]
    scored = sorted(((_balanced(r, normalised), r) for r in rules), key=lambda s: -s[0])
    best_score, best = scored[0]
    shipped: TextRule = ("contained_or_f1", agreement.TEXT_F1)
    return {
        "rule": best[0],
        "threshold": best[1],
        "fitting_balanced_accuracy": best_score,
        "fitting_pairs": len(pairs),
        "shipped": {"rule": shipped[0], "threshold": shipped[1]},
        "matches_shipped": best == shipped,
        "candidates": [{"rule": r[0], "threshold": r[1], "balanced": s} for s, r in scored],
    }


def overlap_diagnostic(pairs: list[Pair]) -> dict[str, Any]:
    """What the shipped text rule would say without the length limit."""
    judged = [
        (
            _rule_says(
                ("contained_or_f1", agreement.TEXT_F1),
                normalise_text(p.answer),
                normalise_text(p.reference),
            ),
            p.label == "agree",
        )
        for p in pairs
        if p.label is not None
    ]
    return {
        "accuracy": _rate(sum(said == truth for said, truth in judged), len(judged)),
        "agree_share": _rate(sum(truth for _, truth in judged), len(judged)),
    }


# --- the run ---------------------------------------------------------------------------


def judge(pairs: Iterable[Pair]) -> tuple[list[Judged], float]:
    pairs = list(pairs)
    start = time.perf_counter()
    verdicts = [compare(p.question, p.answer, p.reference) for p in pairs]
    seconds = time.perf_counter() - start
    judged = [Judged(p, v) for p, v in zip(pairs, verdicts, strict=True)]
    return judged, seconds / max(len(pairs), 1)


def _interval(r: dict[str, Any]) -> str:
    if not r["n"]:
        return "     -          "
    return f"{r['rate']:6.1%} [{r['low']:.1%}, {r['high']:.1%}] ({r['k']}/{r['n']})"


def render(kind: str, name: str, s: dict[str, Any]) -> str:
    bw = s["both_wrong"]
    return (
        f"{kind:7} {name:26} n={s['labelled']:5} undecided={s['undecided']:4}"
        f" other-kind={s['other_kind']:3}\n"
        f"    accuracy       {_interval(s['accuracy'])}\n"
        f"    false agree    {_interval(s['false_agree'])}\n"
        f"    false disagree {_interval(s['false_disagree'])}\n"
        f"    both wrong (unlabelled): {bw['n']}, undecided {bw['undecided']},"
        f" said agree {_interval(bw['said_agree'])}"
    )


class Row(msgspec.Struct):
    kind: str
    name: str
    judged: list[Judged]
    note: str = ""


def _present(data: Path, folder: str, notes: list[str]) -> bool:
    if (data / folder).is_dir():
        return True
    notes.append(f"{folder}: not in {data}, left out")
    return False


def number_rows(data: Path, notes: list[str]) -> list[Row]:
    rows = []
    if _present(data, "routellm_gsm8k", notes):
        rows.append(Row("number", "routellm_gsm8k", judge(routellm_gsm8k(data))[0]))
    if _present(data, "zeroshot_cot_logs", notes):
        for dataset in ("gsm8k", "multiarith"):
            judged = judge(zeroshot_cot(dataset)(data))[0]
            rows.append(Row("number", f"zeroshot_cot_{dataset}", judged))
    return rows


def choice_rows(data: Path, notes: list[str]) -> tuple[list[Row], list[Row]]:
    if not _present(data, "routerbench_subset", notes):
        return [], []
    pooled, apart = [], []
    for file in ("arc_challenge_test", "winograde_test"):
        pooled.append(Row("choice", file, judge(routerbench(file, "choice")(data))[0]))
    weak = _routerbench_models(data)
    for file in ("arc_challenge_test", "winograde_test"):
        judged = judge(routerbench(file, "choice", weak)(data))[0]
        note = f"{len(weak)} models vs GPT-4: pairs share questions, intervals too narrow"
        apart.append(Row("choice", f"{file} (all models)", judged, note))
    return pooled, apart


def text_rows(data: Path, seed: int, notes: list[str]) -> tuple[list[Row], dict[str, Any]]:
    sources = [("triviaqa", _trivia_questions), ("nq_open", _nq_questions)]
    pairs: dict[str, list[Pair]] = {}
    for name, read in sources:
        if _present(data, name, notes):
            pairs[name] = list(gold_text(name, read)(data, seed))
    fit = [p for ps in pairs.values() for p in ps if fitting(p.question, seed)]
    fitted = fit_text_rule(fit) if fit else {}
    rows = []
    for name, ps in pairs.items():
        held_out = [p for p in ps if not fitting(p.question, seed)]
        rows.append(Row("text", f"{name} (held out)", judge(held_out)[0]))
    return rows, fitted


def pooled(kind: str, rows: list[Row]) -> Row:
    return Row(kind, "all of the above", [j for r in rows for j in r.judged])


def run(data: Path, seed: int) -> dict[str, Any]:
    notes: list[str] = [
        "routellm_mmlu: correctness only, no responses: cannot be compared",
        "yesno: no source here has model responses to yes/no questions: not measured",
    ]
    numbers = number_rows(data, notes)
    choices, choices_apart = choice_rows(data, notes)
    texts, fitted = text_rows(data, seed, notes)
    table = [*numbers]
    if numbers:
        table.append(pooled("number", numbers))
    table += choices
    if choices:
        table.append(pooled("choice", choices))
    table += choices_apart + texts
    if texts:
        table.append(pooled("text", texts))
    code: dict[str, Any] = {}
    if _present(data, "routerbench_subset", notes):
        mbpp = judge(routerbench("mbpp_test", "text")(data))[0]
        table.append(Row("text", "mbpp code", mbpp, "both pass the tests = agree"))
        code = overlap_diagnostic([j.pair for j in mbpp])
    everything = [j for r in table for j in r.judged]
    _, per_pair = judge(j.pair for j in everything)
    return {
        "seed": seed,
        "rows": [
            {"kind": r.kind, "source": r.name, "note": r.note, **score(r.judged)}
            | ({"gold_check": gold_check(r.judged)} if r.kind == "number" else {})
            for r in table
        ],
        "text_rule": fitted,
        "mbpp_without_length_limit": code,
        "microseconds_per_compare": per_pair * 1e6,
        "notes": notes,
    }


def print_report(report: dict[str, Any]) -> None:
    for row in report["rows"]:
        print(render(row["kind"], row["source"], row))
        if row["note"]:
            print(f"    note: {row['note']}")
        if "gold_check" in row:
            g = row["gold_check"]
            print(
                f"    gold check: {g['false_agree_both_gold']} of {g['false_agree']} false"
                f" agrees have both answers equal to gold; {g['false_disagree_one_gold']} of"
                f" {g['false_disagree']} false disagrees have exactly one"
            )
    rule = report["text_rule"]
    if rule:
        shipped = rule["shipped"]
        print(
            f"\ntext rule fitted on {rule['fitting_pairs']} fitting pairs: {rule['rule']}"
            f" threshold {rule['threshold']} (balanced accuracy"
            f" {rule['fitting_balanced_accuracy']:.3f}); evaluator/agreement.py ships"
            f" {shipped['rule']} {shipped['threshold']}"
            + ("" if rule["matches_shipped"] else "  <-- DIFFERS: update TEXT_F1")
        )
        runners_up = ", ".join(
            f"{c['rule']} {c['threshold']}: {c['balanced']:.3f}" for c in rule["candidates"][1:4]
        )
        print(f"    next best on the fitting half: {runners_up}")
    code = report["mbpp_without_length_limit"]
    if code:
        print(
            f"mbpp without the length limit, the text rule's accuracy"
            f" {_interval(code['accuracy'])}; always saying agree would score"
            f" {_interval(code['agree_share'])}"
        )
    print(f"\n{report['microseconds_per_compare']:.1f} µs per compare (mean, all pairs)")
    for note in report["notes"]:
        print(f"note: {note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--seed", type=int, default=0, help="the fitting/held-out split")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args()
    report = run(args.data, args.seed)
    print_report(report)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2, allow_nan=True))


if __name__ == "__main__":
    main()
