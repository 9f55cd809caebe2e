"""evaluator.replay and evaluator.replay_report, and bench/loop_replay.py over them, on
small synthetic trace banks: no model, exact numbers."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest

from evaluator import replay, replay_report
from evaluator.calibration import Calibrator
from evaluator.policy import LoopSettings
from evaluator.runs import Run, RunAlternative, RunSample, RunToken, read_runs, write_runs
from evaluator.signals import (
    DEFAULT_FEATURES,
    DEFAULT_SETTINGS,
    FeatureName,
    SignalSettings,
    majority,
)

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "loop_replay.py"


def sample(
    text: str, confidences: Sequence[float], tokens: Sequence[str] | None = None
) -> RunSample:
    """A sample whose token i has token confidence ``confidences[i]``: all five top
    alternatives carry log-prob -c, and DeepConf's confidence is minus their mean."""
    pieces = list(tokens) if tokens is not None else [text] * len(confidences)
    return RunSample(
        text=text,
        logprobs=tuple(
            RunToken(piece, -c, tuple(RunAlternative(f"t{j}", -c) for j in range(5)))
            for piece, c in zip(pieces, confidences, strict=True)
        ),
        completion_tokens=len(pieces),
    )


def number_run(answers: Sequence[str], gold: str = "7", tokens: int = 3, rid: str = "q") -> Run:
    return Run(
        id=rid,
        kind="number",
        answers=[gold],
        samples=tuple(sample(a, [2.0] * tokens) for a in answers),
        prompt="What is 3 + 4?",
        source="synthetic",
    )


def question(
    run: Run, cutoffs: Sequence[float] = (), settings: SignalSettings = DEFAULT_SETTINGS
) -> Any:
    return replay.Question(0, run, settings, list(cutoffs))


def vote_share_calibrator() -> Calibrator:
    """P = sigmoid(10 * vote_share - 5): 0.993 when all agree, 0.5 at an even split."""
    width = len(DEFAULT_FEATURES)
    return Calibrator(
        features=list(DEFAULT_FEATURES),
        signals=DEFAULT_SETTINGS,
        mean=[0.0] * width,
        scale=[1.0] * width,
        weights=[10.0] + [0.0] * (width - 1),
        bias=-5.0,
    )


def loop(threshold: float = 0.9, rounds: int = 2, prune_below: float | None = None) -> Any:
    settings = LoopSettings(
        threshold=threshold,
        branches=4,
        max_rounds=rounds,
        token_budget=replay.NO_BUDGET,
        prune_below=prune_below,
    )
    return replay.loop_rule(settings, rounds)


# --- the loop's rule -------------------------------------------------------------------


def test_a_unanimous_question_stops_after_one_round_and_costs_its_branches() -> None:
    q = question(number_run(["7"] * 8, tokens=3))
    q.calibrator = vote_share_calibrator()
    outcome = loop()(q)
    assert outcome.branches == 4
    assert outcome.tokens == 12  # 4 branches of 3 tokens
    assert outcome.answer == "7" and outcome.correct
    assert outcome.probability == pytest.approx(1 / (1 + math.exp(-5)))


def test_a_split_question_runs_to_max_rounds() -> None:
    q = question(number_run(["7", "5"] * 4, tokens=3))
    q.calibrator = vote_share_calibrator()
    outcome = loop()(q)  # P = 0.5 after each round: below 0.9
    assert (outcome.branches, outcome.tokens) == (8, 24)
    # At a threshold of 0.5 the even split is confident enough.
    assert loop(threshold=0.5)(q).branches == 4


# --- DeepConf's filter in replay -------------------------------------------------------

WINDOW4 = SignalSettings(group_window=4)


def test_stop_point_is_the_first_full_window_below_the_cutoff() -> None:
    # Windows of 4 ending at token 7: [3, 3, 1.5, 1.5] = 2.25; at token 8: 1.875 < 2.
    dropping = sample("x", [3.0] * 6 + [1.5] * 6)
    assert replay.stop_point(dropping, 2.0, WINDOW4) == 9
    assert replay.stop_point(dropping, 1.0, WINDOW4) is None
    # Shorter than one window: never stopped mid-generation, however low.
    assert replay.stop_point(sample("x", [0.1] * 3), 2.0, WINDOW4) is None


def test_pruning_cuts_the_tokens_and_the_votes_of_branches_that_lose_confidence() -> None:
    words = ["The", " answer", " is", " 5", ".", " I", " am", " not", " so", " sure", ".", "."]
    sure = sample("The answer is 7.", [3.0] * 12, ["The", " answer", " is", " 7"] + ["."] * 8)
    unsure = sample("The answer is 5. I am not so sure..", [3.0] * 6 + [1.5] * 6, words)
    run = Run(
        id="q",
        kind="number",
        answers=["7"],
        samples=(sure, unsure, unsure, unsure),
        prompt="What is 3 + 4?",
    )
    q = question(run, cutoffs=[2.0], settings=WINDOW4)
    # Unfiltered, three branches outvote the sure one: 3 x 1.5 against 1 x 3.
    plain = replay.by_verdict(q, 4, q.verdict(4))
    assert (plain.answer, plain.tokens, plain.correct) == ("5", 48, False)
    # Filtered, each unsure branch stops after 9 tokens and does not vote.
    cut = q.cut[2.0]
    assert [b.tokens for b in cut] == [12, 9, 9, 9]
    assert [b.stopped for b in cut] == [False, True, True, True]
    verdict = q.verdict(4, 2.0)
    assert (verdict.answer, verdict.kept, verdict.pruned) == ("7", 1, 0)
    pruned = replay.by_verdict(q, 4, verdict, 2.0)
    assert (pruned.answer, pruned.tokens, pruned.correct) == ("7", 39, True)
    # With only unsure branches there is no vote at all, and no answer.
    unsure_only = question(msgspec.structs.replace(run, samples=(unsure,) * 4), [2.0], WINDOW4)
    assert unsure_only.verdict(4, 2.0) is None
    assert replay.loop_rule(LoopSettings(threshold=0.5, max_rounds=1, prune_below=2.0), 1)(
        unsure_only
    ) == replay.PolicyOutcome(None, False, 36, 4, 0.0)
    # The loop's rule costs the same under the filter: one round of four.
    outcome = loop(threshold=0.5, rounds=1, prune_below=2.0)(q)
    assert (outcome.tokens, outcome.answer) == (39, "7")


def test_a_finished_branch_below_the_cutoff_is_left_out_by_tally() -> None:
    # Two tokens: never a full window of 16, so never stopped, but its lowest group
    # (the mean of both) is 1.0 and the filter at 1.5 leaves it out of the vote.
    low = sample("5", [1.0, 1.0], ["5", "\n"])
    high = sample("7", [2.0, 2.0], ["7", "\n"])
    run = Run(id="q", kind="number", answers=["7"], samples=(low, low, high, high))
    q = question(run, cutoffs=[1.5])
    assert [b.stopped for b in q.cut[1.5]] == [False] * 4
    verdict = q.verdict(4, 1.5)
    assert (verdict.answer, verdict.kept, verdict.pruned) == ("7", 2, 2)
    assert replay.by_verdict(q, 4, verdict, 1.5).tokens == 8


# --- the other policies ----------------------------------------------------------------


def test_esc_stops_at_the_first_unanimous_window() -> None:
    q = question(number_run(["7", "5", "7", "7", "5", "5", "7", "7"]))
    assert replay.esc(2, 8)(q).branches == 4
    assert replay.esc(4, 8)(q).branches == 8  # neither window of four is unanimous
    # An unanswered sample breaks unanimity.
    empty = question(number_run(["", "", "7", "7"]))
    assert replay.esc(2, 4)(empty).branches == 4


def test_beta_stopping_follows_adaptive_consistency() -> None:
    q = question(number_run(["7"] * 8))
    # P(leader stays ahead) after n unanimous votes is 1 - 2^-(n+1).
    assert replay.beta(0.95, 8)(q).branches == 4
    assert replay.beta(0.75, 8)(q).branches == 1


def test_answer_change_rate_and_accuracy_of_a_point() -> None:
    questions = [
        question(number_run(["7", "5", "7", "7"], rid="a")),
        question(number_run(["5", "7", "7", "7"], rid="b")),
        question(number_run(["5", "5", "5", "7"], rid="c")),
    ]
    reference = [majority(q.answers) for q in questions]
    assert reference == ["7", "7", "5"]
    first = replay_report.point(questions, replay.fixed_plain(1), "k=1", 1, reference)
    assert first.answer_change == pytest.approx(1 / 3)  # only b's first sample differs
    assert (first.correct, first.mean_tokens, first.mean_branches) == (1, 3.0, 1.0)
    whole = replay_report.point(questions, replay.fixed_plain(4), "k=4", 4, reference)
    assert (whole.answer_change, whole.correct, whole.mean_tokens) == (0.0, 2, 12.0)


def _point(setting: str, correct: int, tokens: float) -> Any:
    return replay_report.Point(
        setting=setting,
        value=0.0,
        accuracy=correct / 100,
        correct=correct,
        mean_tokens=tokens,
        mean_branches=0.0,
        ece=None,
        brier=None,
        roc_auc=None,
        answer_change=0.0,
    )


def test_tokens_saved_at_the_reference_accuracy_and_within_one_point() -> None:
    reference = _point("k=16", 50, 100.0)
    points = [_point("a", 50, 40.0), _point("b", 49, 20.0), _point("c", 47, 5.0), reference]
    saved, at = replay_report.tokens_saved(points, reference)
    assert saved == pytest.approx(0.6) and at == "a"
    saved, at = replay_report.tokens_saved(points, reference, slack=1)
    assert saved == pytest.approx(0.8) and at == "b"
    assert replay_report.tokens_saved([_point("d", 49, 10.0)], reference) == (None, None)
    curve = replay_report.curve("p", points, reference, questions=100)
    assert curve.saved == pytest.approx(0.6)
    assert curve.saved_within_1pt == pytest.approx(0.8)


def test_chance_levels() -> None:
    choice = Run(
        id="c",
        kind="choice",
        answers=["B"],
        samples=(sample("B", [1.0]),),
        prompt="Which?\n\nA. one\nB. two\nC. three\nD. four\n\nAnswer with the letter only.",
    )
    assert replay_report.chance_level([choice]) == 0.25
    yes, no = (
        Run(id=a, kind="yesno", answers=[a], samples=(sample(a, [1.0]),)) for a in ("yes", "no")
    )
    assert replay_report.chance_level([yes, yes, yes, no]) == 0.75
    assert replay_report.chance_level([number_run(["7"])]) == 0.0


def test_branch_orders_shuffle_each_question_or_keep_the_banks_order() -> None:
    run = number_run([str(i) for i in range(8)])
    assert replay.branch_orders(run, 4, 0, seed=1)[0].samples == run.samples[:4]
    orders = replay.branch_orders(run, 8, 3, seed=1)
    assert len(orders) == 3
    for shuffled in orders:
        assert sorted(s.text for s in shuffled.samples) == [str(i) for i in range(8)]
    assert len({tuple(s.text for s in o.samples) for o in orders}) > 1


# --- the whole bench -------------------------------------------------------------------


def synthetic_bank(path: Path) -> None:
    """12 questions of 8 samples. Six have a right majority (5 of 8) and six a wrong one,
    whatever the order; confidence runs with correctness, so the calibrator has a signal."""
    runs = []
    for i in range(12):
        right_majority = i % 2 == 0
        right, wrong = (5, 3) if right_majority else (3, 5)
        texts = ["7"] * right + ["5"] * wrong
        samples = tuple(
            sample(t, [2.5 if t == "7" else 1.5, 2.0 + 0.05 * i], [t, "\n"]) for t in texts
        )
        runs.append(
            Run(id=f"q{i}", kind="number", answers=["7"], samples=samples, source="synthetic")
        )
    write_runs(runs, path)


def test_the_script_runs_end_to_end_on_a_tiny_bank(tmp_path: Path) -> None:
    bank, out, png = tmp_path / "bank.jsonl", tmp_path / "replay.json", tmp_path / "replay.png"
    synthetic_bank(bank)
    args = ["--runs", str(bank), "--folds", "2", "--k", "1", "4", "8", "--orders", "2"]
    script = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--out-json", str(out), "--plot", str(png)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert script.returncode == 0, script.stderr
    report = json.loads(out.read_text())
    assert (report["runs"], report["samples"], report["rounds"], report["orders"]) == (12, 8, 2, 2)
    assert report["calibration"]["kind"] == "cross-fitted"
    assert report["calibration"]["rows"] == 12 * 2 * 3
    assert report["probe_tokens"] == 0
    reference = report["reference"]
    assert reference["setting"] == "k=8"
    assert reference["accuracy"] == 0.5
    assert reference["mean_tokens"] == 16.0  # 8 samples of 2 tokens
    (source,) = report["sources"]
    assert (source["per_sample"], source["majority_at_8"], source["chance"]) == (0.5, 0.5, 0.0)
    names = [c["name"] for c in report["curves"]]
    assert names[:4] == [
        "fixed-k majority",
        "fixed-k weighted vote",
        "Beta stopping",
        "ESC windows",
    ]
    assert "loop rule" in names and "vote_share alone" in names
    plain = report["curves"][0]
    assert [p["mean_tokens"] for p in plain["points"]] == [2.0 * k for k in range(1, 9)]
    assert plain["saved"] is not None and plain["saved"] >= 0.0
    for c in report["curves"]:
        for p in c["points"]:
            assert 0.0 <= p["ece"] <= 1.0
            assert 0.0 <= p["answer_change"] <= 1.0
    assert png.stat().st_size > 10_000
    assert "fixed-k majority" in script.stdout


def test_the_proposed_settled_vote_stop_ends_a_unanimous_round_however_unlikely() -> None:
    q = question(number_run(["5"] * 8))  # unanimous and wrong
    q.calibrator = Calibrator(  # P = sigmoid(-5) whatever the signals
        features=list(DEFAULT_FEATURES),
        signals=DEFAULT_SETTINGS,
        mean=[0.0] * len(DEFAULT_FEATURES),
        scale=[1.0] * len(DEFAULT_FEATURES),
        weights=[0.0] * len(DEFAULT_FEATURES),
        bias=-5.0,
    )
    settings = LoopSettings(threshold=0.9, max_rounds=2, token_budget=replay.NO_BUDGET)
    assert replay.loop_rule(settings, 2)(q).branches == 8
    # Four votes to none: P(the leader stays ahead) = 1 - 2^-5 = 0.97.
    assert replay.loop_rule(settings, 2, stable=0.95)(q).branches == 4
    assert replay.loop_rule(settings, 2, stable=0.99)(q).branches == 8


def test_min_gain_ends_the_loop_when_a_round_does_not_raise_p() -> None:
    q = question(number_run(["7", "5"] * 8))
    q.calibrator = vote_share_calibrator()  # P = 0.5 after every round
    settings = LoopSettings(threshold=0.9, max_rounds=4, token_budget=replay.NO_BUDGET)

    def gaining(least: float) -> LoopSettings:
        return msgspec.structs.replace(settings, min_gain=least)

    assert replay.loop_rule(settings, 4)(q).branches == 16
    # Round 2 leaves P where round 1 had it: stop there, not after round 1.
    assert replay.loop_rule(gaining(0.01), 4)(q).branches == 8
    # A rising P goes on while each round raises it enough: vote shares 2/4, 5/8,
    # 8/12, 11/16 give P = 0.5, 0.78, 0.84, 0.87.
    rising = question(number_run(["7", "7", "5", "5"] + ["7", "7", "7", "5"] * 3))
    rising.calibrator = vote_share_calibrator()
    assert replay.loop_rule(gaining(0.05), 4)(rising).branches == 16
    assert replay.loop_rule(gaining(0.1), 4)(rising).branches == 12


def test_stopping_rules_take_no_more_rounds_than_the_config_allows(tmp_path: Path) -> None:
    """A loop of at most 3 rounds of 2 branches, replayed over 8 samples a question: the
    loop's rules (and each signal alone, in the same rounds) spend at most 6 branches;
    the fixed-k reference still votes all 8, and the baselines keep the whole bank."""
    bank = tmp_path / "bank.jsonl"
    synthetic_bank(bank)
    runs = read_runs(bank).runs
    report = replay_report.replay_bank(
        runs,
        calibrator=vote_share_calibrator(),
        folds=2,
        ks=[1, 2],
        seed=0,
        branches=2,
        orders=2,
        max_rounds=3,
    )
    assert (report["rounds"], report["reference"]["setting"]) == (3, "k=8")
    most = {c["name"]: max(p["mean_branches"] for p in c["points"]) for c in report["curves"]}
    assert most["fixed-k majority"] == 8
    in_rounds = [name for name in most if name.startswith("loop rule") or name.endswith("alone")]
    assert in_rounds and all(most[name] <= 6 for name in in_rounds), most
    with pytest.raises(ValueError, match="max_rounds"):
        replay_report.replay_bank(
            runs, calibrator=None, folds=2, ks=[1], seed=0, branches=2, orders=1, max_rounds=0
        )


def test_fold_calibrators_take_the_signals_and_isotonic_step_they_are_given(
    tmp_path: Path,
) -> None:
    """Settings are chosen with calibrators like the one that will ship."""
    bank = tmp_path / "bank.jsonl"
    synthetic_bank(bank)
    runs = read_runs(bank).runs
    questions = [replay.Question(i, run, DEFAULT_SETTINGS, []) for i, run in enumerate(runs)]
    features: tuple[FeatureName, ...] = ("vote_share", "kind_number")
    report = replay_report.cross_fit(questions, [1, 4, 8], 2, 0, features, isotonic_min=1)
    assert (report["features"], report["isotonic_min"]) == (list(features), 1)
    calibrators = [q.calibrator for q in questions if q.calibrator is not None]
    assert len(calibrators) == len(questions)
    assert all(c.features == list(features) and c.isotonic_x for c in calibrators)
    replay_report.cross_fit(questions, [1, 4, 8], 2, 0, features, isotonic_min=10**6)
    assert not any(q.calibrator is None or q.calibrator.isotonic_x for q in questions)


def test_prune_cutoffs_come_from_samples_long_enough_to_be_cut() -> None:
    """A letter answer's lone partial window is not a trace the filter could stop; it
    must not set the cut-off that long traces are held to."""
    window = DEFAULT_SETTINGS.group_window
    long = [sample("7", [c] * window) for c in (1.0, 2.0, 3.0, 4.0)]
    short = [sample("7", [0.1]) for _ in range(4)]
    run = Run(id="q", kind="number", answers=["7"], samples=tuple(long + short))
    report = replay_report.replay_bank(
        [run],
        calibrator=vote_share_calibrator(),
        folds=2,
        ks=[1],
        seed=0,
        branches=2,
        orders=1,
    )
    assert report["prune_cutoffs"]["p10"] == pytest.approx(1.3)  # of 1, 2, 3 and 4 alone
