"""How far a stop that reads only the votes can go on a trace bank.

For each round of ``--branches`` samples, the questions are grouped by the vote so far
(the answers' counts, largest first, and how many samples gave none): how often the
round's majority is right, against the majority of all the bank's samples (the fixed-k
reference). Then the best rule that decides from that vote alone whether to draw
another round: for each price of a token, the rule that maximises accuracy less
tokens' cost on these very questions (backward induction over the rounds), and of
those the one that spends fewest tokens without falling below the reference's accuracy.

    .venv/bin/python bench/vote_patterns.py --runs bench/out/bank_qwen_fit.jsonl --branches 2

That rule is fitted and scored on the same questions, so it is optimistic: it bounds
what any stop that sees only the vote counts, in rounds of this size, saves at the
reference's accuracy on these questions. It is not a policy to ship.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter, defaultdict
from collections.abc import Sequence

import msgspec
import numpy as np

from evaluator.replay import DEFAULT_ORDERS, Question, branch_orders
from evaluator.runs import read_runs
from evaluator.signals import DEFAULT_SETTINGS, majority

# (round, answer counts largest first, samples without an answer)
Pattern = tuple[int, tuple[int, ...], int]
# Prices of a token, in accuracy, that the search tries (0: never stop early).
PRICES = (0.0, *np.geomspace(1e-6, 1e-2, 60))


class Case(msgspec.Struct, frozen=True):
    """One question in one order, round by round: the vote, whether the majority so
    far is right, and what the round's samples cost."""

    patterns: list[Pattern]
    right: list[bool]
    tokens: list[int]

    @classmethod
    def of(cls, q: Question, branches: int, rounds: int) -> Case:
        ends = [r * branches for r in range(1, rounds + 1)]
        return cls(
            patterns=[pattern(r, q.answers[:n]) for r, n in enumerate(ends, 1)],
            right=[q.correct(majority(q.answers[:n])) for n in ends],
            tokens=[sum(q.tokens[n - branches : n]) for n in ends],
        )


class Outcome(msgspec.Struct, frozen=True):
    accuracy: float
    tokens: float  # per question


class Tally(msgspec.Struct):
    cases: int = 0
    right_now: int = 0  # the majority of the samples so far
    right_at_full: int = 0  # the majority of all the samples


def pattern(round_: int, answers: Sequence[str | None]) -> Pattern:
    counts = Counter(a for a in answers if a is not None)
    return round_, tuple(sorted(counts.values(), reverse=True)), answers.count(None)


def best_rule(cases: Sequence[Case], rounds: int, price: float) -> set[Pattern]:
    """The votes after which to stop that maximise mean accuracy less ``price`` per
    token, deciding from the vote alone: from the last round back, a vote stops when
    its questions' majority now is worth more than what drawing on is worth to them.
    A vote's decision weighs every question that shows it, also those an earlier stop
    would have ended first (which are only decided later, going back): near the best
    rule of its kind, not exactly it."""
    # What each case is worth once the next round is drawn, under the rule so far.
    worth = [float(c.right[-1]) for c in cases]
    stop: set[Pattern] = set()
    for r in reversed(range(rounds - 1)):
        by_vote: dict[Pattern, list[int]] = defaultdict(list)
        for i, c in enumerate(cases):
            by_vote[c.patterns[r]].append(i)
        for vote, members in by_vote.items():
            drawing_on = [worth[i] - price * cases[i].tokens[r + 1] for i in members]
            if np.mean([cases[i].right[r] for i in members]) >= np.mean(drawing_on):
                stop.add(vote)
                for i in members:
                    worth[i] = float(cases[i].right[r])
            else:
                for i, w in zip(members, drawing_on, strict=True):
                    worth[i] = w
    return stop


def play(cases: Sequence[Case], stop: set[Pattern]) -> Outcome:
    right: list[bool] = []
    tokens: list[int] = []
    for c in cases:
        end = next((r for r, p in enumerate(c.patterns[:-1]) if p in stop), len(c.patterns) - 1)
        right.append(c.right[end])
        tokens.append(sum(c.tokens[: end + 1]))
    return Outcome(accuracy=float(np.mean(right)), tokens=float(np.mean(tokens)))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", required=True, help="trace bank: JSONL of labelled runs")
    parser.add_argument("--branches", type=int, default=2, help="samples per round")
    parser.add_argument("--orders", type=int, default=DEFAULT_ORDERS)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    runs = read_runs(args.runs).runs
    samples = min(len(r.samples) for r in runs)
    rounds = samples // args.branches
    if rounds < 2:
        raise SystemExit(f"error: {samples} samples make fewer than 2 rounds of {args.branches}")
    full = rounds * args.branches
    questions = [
        Question(index, shuffled, DEFAULT_SETTINGS, [])
        for index, run in enumerate(runs)
        for shuffled in branch_orders(run, full, args.orders, args.seed + index)
    ]

    cases = [Case.of(q, args.branches, rounds) for q in questions]
    tallies: dict[Pattern, Tally] = defaultdict(Tally)
    for case in cases:
        for r in range(rounds - 1):
            tally = tallies[case.patterns[r]]
            tally.cases += 1
            tally.right_now += case.right[r]
            tally.right_at_full += case.right[-1]
    reference = Outcome(
        accuracy=float(np.mean([c.right[-1] for c in cases])),
        tokens=float(np.mean([sum(c.tokens) for c in cases])),
    )
    best: tuple[Outcome, set[Pattern]] | None = None
    for price in PRICES:
        stop = best_rule(cases, rounds, price)
        outcome = play(cases, stop)
        if outcome.accuracy >= reference.accuracy and (
            best is None or outcome.tokens < best[0].tokens
        ):
            best = outcome, stop
    assert best is not None  # at price 0 the rule never stops early: the reference itself
    outcome, stop = best

    print(
        f"{len(runs)} questions x {args.orders or 1} orders; rounds of {args.branches}, "
        f"reference: majority of {full}"
    )
    print(
        "\n| after round | vote (counts; unanswered) | share | right now | right at full | stop |"
    )
    print("|---|---|---|---|---|---|")
    for p in sorted(tallies, key=lambda p: (p[0], -tallies[p].cases)):
        t = tallies[p]
        counts = "-".join(map(str, p[1])) or "none"
        print(
            f"| {p[0]} | {counts}; {p[2]} | {t.cases / len(questions):.1%} | "
            f"{t.right_now / t.cases:.1%} | {t.right_at_full / t.cases:.1%} | "
            f"{'yes' if p in stop else ''} |"
        )
    print(
        f"\nreference: {reference.accuracy:.1%} right, {reference.tokens:.1f} tokens"
        f"\nthe best vote-only rule at its accuracy (in-sample): {outcome.accuracy:.1%} right, "
        f"{outcome.tokens:.1f} tokens, {1 - outcome.tokens / reference.tokens:.1%} fewer"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
