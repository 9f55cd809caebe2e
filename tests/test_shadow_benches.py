"""The bookkeeping of bench/bank_greedy.py, bench/shadow_stream.py,
bench/shadow_estimates.py and bench/shadow_learning.py: a greedy bank that resumes past
a torn write, the held-out questions, the loop's replay with its stop reason, which
checks a request draws, and what the benches count. (The benches themselves run the
bank and the models' answers: benchmarks, not tests.)"""

from __future__ import annotations

import lzma
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest

from evaluator.calibration import calibrator_file, read_calibrator
from evaluator.replay import replay_loop
from evaluator.runs import Run, RunSample
from gateway.checks.estimates import LiveEstimates
from gateway.config import load_config
from tests.support import ROOT, bench_script

bank_greedy = bench_script("bank_greedy")
# msgspec resolves a Struct's annotations through its module in sys.modules.
sys.modules.setdefault("bank_greedy", bank_greedy)
shadow_estimates = bench_script("shadow_estimates")
shadow_learning = bench_script("shadow_learning")
# The helper the two benches import (and so sys.modules holds), not a copy of it.
shadow_stream = shadow_estimates.shadow_stream

BANK = ROOT / "bench" / "banks"
needs_bank = pytest.mark.skipif(
    not (BANK / "arc_challenge").is_dir(), reason="no trace bank under bench/banks"
)


def record(number: int, finish: str = "stop") -> bytes:
    greedy = bank_greedy.GreedyRecord(
        id=f"arc_challenge-{number}",
        kind="choice",
        answers=["A"],
        prompt=f"question {number}",
        source="arc_challenge",
        engine="small",
        model="m",
        max_tokens=16,
        samples=(
            bank_greedy.GreedySample(
                text="A", completion_tokens=1, finish_reason=finish, seconds=0.1, prompt_tokens=9
            ),
        ),
    )
    return bytes(msgspec.json.encode(greedy) + b"\n")


def test_a_greedy_bank_keeps_its_whole_records_and_cuts_off_a_torn_one(tmp_path: Path) -> None:
    path = tmp_path / "arc_challenge.jsonl.xz"
    whole = lzma.compress(record(1)) + lzma.compress(record(2))
    path.write_bytes(whole + lzma.compress(record(3))[:20])
    assert [r.id for r in bank_greedy.read_greedy(path)] == ["arc_challenge-1", "arc_challenge-2"]
    assert path.stat().st_size > len(whole)  # reading alone leaves the file as it is
    bank_greedy.read_greedy(path, repair=True)
    assert path.read_bytes() == whole
    # A banked source is rewritten as one stream, its records unchanged, in bank order.
    bank_greedy.compact(path, ["arc_challenge-2", "arc_challenge-1"])
    assert lzma.decompress(path.read_bytes()) == record(2) + record(1)
    assert len(bank_greedy.read_greedy(path)) == 2


def test_an_answer_cut_off_by_the_deadline_is_banked_again_and_the_last_one_counts(
    tmp_path: Path,
) -> None:
    path = tmp_path / "gsm8k.jsonl.xz"
    path.write_bytes(lzma.compress(record(1, "deadline")) + lzma.compress(record(2)))
    records = bank_greedy.read_greedy(path)
    assert [bank_greedy.unfinished(r) for r in records] == [True, False]
    path.write_bytes(path.read_bytes() + lzma.compress(record(1)))
    final = bank_greedy.latest(bank_greedy.read_greedy(path))
    assert not bank_greedy.unfinished(final["arc_challenge-1"])
    bank_greedy.compact(path, ["arc_challenge-1", "arc_challenge-2"])
    assert lzma.decompress(path.read_bytes()) == record(1) + record(2)


def test_greedy_answers_read_the_bank_by_question_id(tmp_path: Path) -> None:
    folder = tmp_path / "greedy_small"
    folder.mkdir()
    (folder / "arc_challenge.jsonl.xz").write_bytes(lzma.compress(record(1) + record(2)))
    answers = shadow_stream.greedy_answers(banks=tmp_path)
    assert set(answers) == {"arc_challenge-1", "arc_challenge-2"}
    assert answers["arc_challenge-1"].text == "A"


def runs_of(source: str, count: int) -> list[Run]:
    sample = (RunSample(text="4"),)
    return [
        Run(
            id=f"{source}-{i}",
            kind="number",
            answers=["4"],
            samples=sample,
            prompt=f"{source} {i}",
            source=source,
        )
        for i in range(1, count + 1)
    ]


def test_held_out_is_the_split_s_held_half_and_everything_past_the_first_240() -> None:
    runs = runs_of("arc_challenge", 300) + runs_of("gsm8k", 200)
    held = shadow_stream.held_out(runs)
    arc = [r for r in held if r.source == "arc_challenge"]
    gsm = [r for r in held if r.source == "gsm8k"]
    assert len(gsm) == 100
    assert len(arc) == 120 + 60
    assert all(r in arc for r in runs[240:300])
    # bench/split_runs.py's split: what it fits on is never held out.
    from evaluator.runs import split_by_source, take_per_source

    fitting, _ = split_by_source(take_per_source(runs, 240), 0.5, 0)
    assert not {r.id for r in fitting} & {r.id for r in held}


@needs_bank
def test_the_loop_replayed_with_its_stop_reason_is_evaluator_replay_s_loop() -> None:
    runs = shadow_stream.bank_runs("gsm8k")[:12] + shadow_stream.bank_runs("arc_challenge")[:12]
    config = load_config()
    assert config.loop is not None
    loop = config.loop.sampling()
    calibrator = read_calibrator(calibrator_file("bundled"))
    theirs = replay_loop(runs, loop, calibrator, shadow_stream.ORDERS)
    ours = [
        outcome
        for index, run in enumerate(runs)
        for outcome in shadow_stream.replay_orders(run, index, loop, calibrator)
    ]
    assert [o.answer for o in ours] == [o.answer for _, o in theirs]
    assert [o.correct for o in ours] == [o.correct for _, o in theirs]
    assert [o.tokens for o in ours] == [o.tokens for _, o in theirs]
    assert [o.probability for o in ours] == pytest.approx([o.probability for _, o in theirs])
    for o in ours:
        assert (o.stop == "confident") == (o.probability >= config.loop.threshold)
        assert (o.text == "") == (o.answer is None)


def item(route: str, early: bool, agree: bool | None = True) -> object:
    stop = "confident" if early else "max_rounds"
    loop = shadow_stream.LoopOutcome("B", "B", True, stop, 0.7, 10, 1)
    budget = shadow_stream.LoopOutcome("C", "C", False, "max_rounds", 0.3, 40, 4)
    return shadow_stream.QuestionItem(
        id="q", source="arc_challenge", prompt="Which? A. x B. y", answers=["B"], kind="choice",
        score=0.5, route=route, small_text="A", small_correct=False, small_tokens=1,
        loop=[loop], budget=[budget], small_vs_loop=[agree], loop_vs_budget=[False],
        loop_vs_small=[False],
    )  # fmt: skip


def stream_of(questions: list[object], pairs: list[object]) -> object:
    return shadow_stream.Stream(
        questions=questions, pairs=pairs, router_threshold=0.2, router_embedding="e",
        operating_point=0.9, max_false_hit_rate=0.1, signature="s",
    )  # fmt: skip


def test_each_request_draws_the_checks_the_gateway_would() -> None:
    pairs = [
        shadow_stream.PairItem(source="qqp", a="a", b="b", duplicate=True, score=0.95),
        shadow_stream.PairItem(source="paws", a="c", b="d", duplicate=False, score=0.5),
        shadow_stream.PairItem(source="qqp", a="e", b="e", duplicate=True, score=float("inf")),
    ]
    stream = stream_of([item("small", False), item("loop", True), item("loop", False)], pairs)
    requests = [("q", 0, 0), ("q", 1, 0), ("q", 2, 0), ("p", 0, 0), ("p", 1, 0), ("p", 2, 0)]
    found = shadow_stream.entries(requests, stream)
    assert [e.shortcut for e in found] == [
        "small_route", "early_stop", "large_route", "large_route", "semantic_hit",
    ]  # fmt: skip
    small, early = found[0], found[1]
    assert (small.answer, small.reference, small.agree) == ("A", "B", True)
    assert (early.answer, early.reference, early.confidence) == ("B", "C", 0.7)
    assert found[-1].cache_score == 0.95 and found[-1].tenant == "arc"
    record = shadow_stream.record_of(early, 0.25)
    assert (record.shortcut, record.route, record.probability) == ("early_stop", "loop", 0.25)


def test_direct_rates_and_pool_rates_count_decided_checks_only() -> None:
    stream = stream_of(
        [item("small", False, True), item("small", False, False), item("small", False, None)], []
    )
    found = shadow_stream.entries([("q", 0, 0), ("q", 1, 0), ("q", 2, 0)], stream)
    rates = shadow_estimates.direct_rates(found, by_tenant=True)
    assert rates[("arc", "small_route")] == 0.5
    assert rates[(shadow_estimates.ALL, "small_route")] == 0.5
    assert shadow_estimates.pool_rates(stream)[(shadow_estimates.ALL, "small_route")] == 0.5


def test_mixed_shares_differ_by_tenant_and_change_halfway() -> None:
    mixed = shadow_estimates.mixed
    assert mixed("arc", "small_route", 0.1) == 0.05
    assert mixed("arc", "small_route", 0.9) == pytest.approx(0.15)
    assert mixed("gsm", "small_route", 0.9) == 0.5


def test_weighted_checks_cover_a_known_rate_about_as_often_as_they_say() -> None:
    """The estimator the bench measures, on a synthetic stream whose checks are drawn
    with shares that differ by half: about 95% of intervals cover the stream's rate."""
    rng = np.random.default_rng(0)
    covered = 0
    runs = 300
    for _ in range(runs):
        wrong = rng.random(400) < np.r_[np.full(200, 0.1), np.full(200, 0.4)]
        share = np.r_[np.full(200, 0.1), np.full(200, 0.4)]
        drawn = rng.random(400) < share
        records = [
            shadow_stream.record_of(
                shadow_stream.Entry(shortcut="small_route", tenant="t", position=0.0, index=i,
                                    order=0, agree=not wrong[i], prompt="p", answer="a",
                                    reference="r"),
                float(share[i]),
            )
            for i in np.flatnonzero(drawn)
        ]  # fmt: skip
        estimate = LiveEstimates.fold(records).snapshot()[0]
        assert estimate.low is not None and estimate.high is not None
        covered += estimate.low <= wrong.mean() <= estimate.high
    assert 0.9 <= covered / runs <= 0.99


def test_routing_figures_compare_at_the_shipped_routers_large_share() -> None:
    scores = np.array([0.9, 0.8, 0.1, 0.2])
    small = np.array([0.0, 1.0, 1.0, 0.0])
    large = np.array([1.0, 1.0, 1.0, 1.0])
    figures = shadow_learning.routing_figures(scores, 0.5, small, large, at_share=0.25)
    assert figures["large_share"] == 0.5
    assert figures["accuracy"] == 0.75
    assert figures["accuracy_at_shipped_share"] == 0.75  # only the top score goes large


def test_hits_at_an_operating_point_count_semantic_hits_only() -> None:
    pairs = [
        shadow_stream.PairItem(source="qqp", a="a", b="b", duplicate=True, score=0.95),
        shadow_stream.PairItem(source="qqp", a="c", b="d", duplicate=False, score=0.97),
        shadow_stream.PairItem(source="qqp", a="e", b="e", duplicate=True, score=float("inf")),
        shadow_stream.PairItem(source="qqp", a="f", b="g", duplicate=False, score=0.5),
    ]
    figures = shadow_learning.hits_at(stream_of([], pairs), [0, 1, 2, 3], 0.9)
    assert (figures["hits"], figures["wrong"], figures["hit_rate"]) == (2, 1, 0.5)
