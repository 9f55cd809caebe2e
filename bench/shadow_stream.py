"""The replayed request stream that bench/shadow_estimates.py and bench/shadow_learning.py
measure the gateway's shadow checks on: per banked question, the shortcut the embedded
default's `auto` takes and, for each, the label a shadow check would record; per
held-out paraphrase pair, whether the cache serves a semantic hit and whether serving
it was right.

Questions (the trace bank's, each with the small engine's greedy answer banked by
bench/bank_greedy.py), held out from everything the shipped defaults were fitted on:
ARC-Challenge's 932 questions past the bank's first 240 and the held-out halves
(bench/split_runs.py's split) of the first 240 and of GSM8K's 200, less any question the
bundled router holds among its examples. Each is scored by the bundled router (the
bundled embedder, the router file's threshold): below it, `small_route`; at or above it,
the loop (the default config's loop settings and the bundled calibrator), replayed on
the bank's 8 samples in 8 seeded branch orders (evaluator.replay's), which stands for
the loop's own randomness. Per order:

- small_route: compare(question, small greedy answer, the loop's answer);
- early_stop (the loop stopped `confident` or `no_gain`, as gateway.checks.shadow
  reads a trace): compare(question, the loop's answer, the loop's answer on the same
  branches run on to its budget, threshold 1.0). The gateway's check runs a fresh loop
  to the budget; the bank has 8 samples, so here the reference continues the branches
  the early stop saw (the question "would running on have changed the answer");
- large_route (every loop answer): compare(question, the loop's answer, the small
  engine's greedy answer).

Pairs (QQP's report sample and PAWS-Wiki's held part, bench/verifier_data.py: pairs the
verifier was neither trained nor calibrated on), each `a` cached alone and `b` asked,
through the cache's own lookup with the shipped verifier (cache.pairs.sweep, pairwise):
a semantic hit where the verifier's P reaches the operating point of the default
`cache.max_false_hit_rate`, labelled agree when the pair is a duplicate/paraphrase.
That label is a proxy: a duplicate is taken to get the same answer from the engine,
a non-duplicate a different one.

Computed once and kept in bench/out/shadow_stream.msgpack (and the questions' embeddings
in shadow_vectors.npy); `--rebuild` in the benches computes them again.
"""

from __future__ import annotations

import hashlib
import lzma
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import msgspec
import numpy as np
import numpy.typing as npt

from evaluator.agreement import compare
from evaluator.answers import is_correct
from evaluator.calibration import Calibrator, calibrator_file, read_calibrator
from evaluator.policy import LoopSettings, StopReason, Verdict, stop_reason
from evaluator.replay import Question, branch_orders
from evaluator.runs import Run, split_by_source, take_per_source
from gateway.checks.record import CheckRecord
from gateway.config.shadow import Shortcut

ROOT = Path(__file__).resolve().parent.parent
BANKS = ROOT / "bench" / "banks"
OUT = ROOT / "bench" / "out"
DATA = ROOT.parent / "shared" / "data"
SOURCES = ("arc_challenge", "gsm8k")
# bench/split_runs.py as the Makefile's default-calibrator runs it.
SPLIT_PER_SOURCE, SPLIT_SHARE, SPLIT_SEED = 240, 0.5, 0
ORDERS = 8
# The loop stops that gateway.checks.shadow files as an early stop.
EARLY = ("confident", "no_gain")

Vectors = npt.NDArray[np.float32]


# --- one question's loop, replayed -----------------------------------------------------


class LoopOutcome(msgspec.Struct, frozen=True, array_like=True):
    """The loop on one branch order of a question."""

    text: str  # a branch's text that gave the answer ("" without one)
    answer: str | None
    correct: bool
    stop: str
    probability: float
    tokens: int
    rounds: int


def _text_of(q: Question, answer: str | None) -> str:
    if answer is None:
        return ""
    return next(b.sample.text for b in q.whole if b.answer == answer)


def loop_on(q: Question, settings: LoopSettings) -> LoopOutcome:
    """evaluator.replay.loop_rule, keeping why it stopped (a check needs to know)."""
    best: Verdict | None = None
    last: Verdict | None = None
    rounds = min(settings.max_rounds, len(q.whole) // settings.branches)
    for r in range(1, rounds + 1):
        n = r * settings.branches
        spent = sum(q.tokens[:n])
        verdict = q.verdict(n)
        if verdict is not None and (best is None or verdict.probability >= best.probability):
            best = verdict
        reason: StopReason | None = stop_reason(
            verdict,
            rounds=r,
            tokens=spent,
            next_round_tokens=settings.branches * spent / n,
            settings=msgspec.structs.replace(settings, max_rounds=rounds),
            previous=last,
        )
        last = verdict
        if reason is not None:
            final = verdict if verdict is not None and verdict.answer is not None else best
            answer = final.answer if final is not None else None
            return LoopOutcome(
                text=_text_of(q, answer),
                answer=answer,
                correct=q.correct(answer),
                stop=reason,
                probability=final.probability if final is not None else 0.0,
                tokens=spent,
                rounds=r,
            )
    raise AssertionError("stop_reason stops at max_rounds")


def replay_orders(
    run: Run, index: int, settings: LoopSettings, calibrator: Calibrator, orders: int = ORDERS
) -> list[LoopOutcome]:
    """The loop on ``orders`` seeded branch orders of ``run`` (evaluator.replay's seeds:
    the run's ``index``), one outcome each."""
    outcomes = []
    for shuffled in branch_orders(run, len(run.samples), orders, index):
        q = Question(index, shuffled, calibrator.signals, [])
        q.calibrator = calibrator
        outcomes.append(loop_on(q, settings))
    return outcomes


# --- the stream's items ----------------------------------------------------------------


Route = Literal["small", "loop"]


class QuestionItem(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    source: str
    prompt: str
    answers: list[str]
    kind: str
    score: float  # the bundled router's difficulty
    route: Route  # at the router file's threshold
    small_text: str
    small_correct: bool
    small_tokens: int
    loop: list[LoopOutcome]  # per branch order, shipped settings
    budget: list[LoopOutcome]  # the same orders run on to the budget (threshold 1.0)
    small_vs_loop: list[bool | None]  # compare(q, small, loop): small_route's label
    loop_vs_budget: list[bool | None]  # compare(q, loop, budget): early_stop's
    loop_vs_small: list[bool | None]  # compare(q, loop, small): large_route's

    def early(self, order: int) -> bool:
        return self.loop[order].stop in EARLY


class PairItem(msgspec.Struct, frozen=True, kw_only=True):
    source: str  # qqp or paws
    a: str  # cached
    b: str  # asked
    duplicate: bool
    score: float  # the verifier's P of what the cache would serve; -1: nothing passes


class Stream(msgspec.Struct, frozen=True, kw_only=True):
    questions: list[QuestionItem]
    pairs: list[PairItem]
    router_threshold: float
    router_embedding: str
    operating_point: float  # the verifier's, for the default max_false_hit_rate
    max_false_hit_rate: float
    signature: str  # what it was built from

    def hits(self) -> list[PairItem]:
        return [p for p in self.pairs if self.operating_point <= p.score < np.inf]


# --- reading the banks -----------------------------------------------------------------


def bank_runs(source: str, banks: Path = BANKS) -> list[Run]:
    decoder = msgspec.json.Decoder(Run)
    runs = []
    for shard in sorted((banks / source).glob("*.jsonl.xz")):
        for line in lzma.decompress(shard.read_bytes()).splitlines():
            if line.strip():
                runs.append(decoder.decode(line))
    return runs


def held_out(runs: Sequence[Run]) -> list[Run]:
    """The runs nothing shipped was fitted on: the held-out half of each source's first
    240 (bench/split_runs.py's split, seed 0) and everything past them."""
    first = take_per_source(runs, SPLIT_PER_SOURCE)
    _, held = split_by_source(first, SPLIT_SHARE, SPLIT_SEED)
    rest = take_per_source(runs, len(runs), skip=SPLIT_PER_SOURCE)
    ids = {r.id for r in held} | {r.id for r in rest}
    return [r for r in runs if r.id in ids]


class _GreedySample(msgspec.Struct, frozen=True):
    text: str
    completion_tokens: int


class _Greedy(msgspec.Struct, frozen=True):
    id: str
    prompt: str
    samples: tuple[_GreedySample, ...]


def greedy_answers(engine: str = "small", banks: Path = BANKS) -> dict[str, _GreedySample]:
    """bench/bank_greedy.py's answers by question id (whole xz streams only)."""
    out: dict[str, _GreedySample] = {}
    decoder = msgspec.json.Decoder(_Greedy)
    for path in sorted((banks / f"greedy_{engine}").glob("*.jsonl.xz")):
        data, offset = path.read_bytes(), 0
        while offset < len(data):
            d = lzma.LZMADecompressor()
            try:
                text = d.decompress(data[offset:])
            except lzma.LZMAError:
                break
            if not d.eof:
                break
            offset = len(data) - len(d.unused_data)
            while offset < len(data) and data[offset] == 0:
                offset += 1
            for line in text.splitlines():
                if line.strip():
                    record = decoder.decode(line)
                    out[record.id] = record.samples[0]
    return out


# --- building --------------------------------------------------------------------------


def _labels(prompt: str, answers: Sequence[str], references: Sequence[str]) -> list[bool | None]:
    return [compare(prompt, a, r).agree for a, r in zip(answers, references, strict=True)]


def question_items(
    runs: Sequence[Run],
    greedy: dict[str, _GreedySample],
    scores: npt.NDArray[np.float64],
    threshold: float,
    settings: LoopSettings,
    calibrator: Calibrator,
) -> list[QuestionItem]:
    to_budget = msgspec.structs.replace(settings, threshold=1.0, min_gain=None)
    items = []
    for index, (run, score) in enumerate(zip(runs, scores, strict=True)):
        small = greedy[run.id]
        loop = replay_orders(run, index, settings, calibrator)
        budget = replay_orders(run, index, to_budget, calibrator)
        loop_texts = [o.text for o in loop]
        items.append(
            QuestionItem(
                id=run.id,
                source=run.source,
                prompt=run.prompt,
                answers=run.answers,
                kind=run.kind,
                score=float(score),
                route="loop" if score >= threshold else "small",
                small_text=small.text,
                small_correct=is_correct(run.question, small.text),
                small_tokens=small.completion_tokens,
                loop=loop,
                budget=budget,
                small_vs_loop=_labels(run.prompt, [small.text] * len(loop), loop_texts),
                loop_vs_budget=_labels(run.prompt, loop_texts, [o.text for o in budget]),
                loop_vs_small=_labels(run.prompt, loop_texts, [small.text] * len(loop)),
            )
        )
        if (index + 1) % 200 == 0:
            print(f"  replayed {index + 1}/{len(runs)} questions", file=sys.stderr, flush=True)
    return items


def pair_items(data: Path, encode: object, embedding: str) -> list[PairItem]:
    """Held-out QQP and PAWS pairs through the cache's lookup, pairwise, at operating
    point 0 (any operating point's hits follow from the scores)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from verifier_data import paws_splits, qqp_splits

    from cache.pairs import Pair, sweep
    from gateway.config import load_config

    settings = load_config().cache
    assert settings is not None, "the default config has a cache"
    items: list[PairItem] = []
    for source, pairs in (
        ("qqp", qqp_splits(data)["report"]),
        ("paws", paws_splits(data)["held"]),
    ):
        typed = [Pair(p["a"], p["b"], int(p["label"])) for p in pairs]
        result = sweep(typed, settings, encode=encode, embedding_model=embedding, pairwise=True)  # type: ignore[arg-type]
        items.extend(
            PairItem(source=source, a=p.a, b=p.b, duplicate=bool(p.label), score=float(s))
            for p, s in zip(typed, result.score, strict=True)
        )
    return items


def signature(greedy_count: int, with_pairs: bool) -> str:
    calibrator = calibrator_file("bundled").read_bytes()
    parts = [str(greedy_count), str(with_pairs), hashlib.sha256(calibrator).hexdigest()[:12]]
    return ":".join(parts)


def build(data: Path = DATA, *, with_pairs: bool = True) -> tuple[Stream, Vectors]:
    from cache.calibration import OperatingPoints, read_calibration
    from gateway.config import load_config
    from router.embedder import Embedder, EmbedderSettings
    from router.model_file import read_router
    from router.router import router_file
    from router.scorers import scorer_for
    from router.settings import RouterSettings

    started = time.perf_counter()
    config = load_config()
    assert config.loop is not None
    calibrator = read_calibrator(calibrator_file(config.loop.calibrator or "bundled"))
    greedy = greedy_answers()
    model = read_router(router_file(RouterSettings()))
    fitted_on = set(model.prompts)
    runs = [
        r
        for source in SOURCES
        for r in held_out(bank_runs(source))
        if r.id in greedy and r.prompt not in fitted_on
    ]
    embedder = Embedder(EmbedderSettings(threads=2, max_batch=128))
    embedder.load()
    vectors = embedder.encode([r.prompt for r in runs]).astype(np.float32)
    scores = np.asarray(scorer_for(model).score(vectors, [r.prompt for r in runs]), np.float64)
    print(f"  {len(runs)} held-out questions with a greedy answer", file=sys.stderr)
    # The sampling loop's shortcuts (early stops): the stream was built before the
    # default's large path became one greedy pass, and measures the checks on those.
    loop = config.loop.sampling()
    questions = question_items(runs, greedy, scores, model.threshold, loop, calibrator)
    assert config.cache is not None, "the default config has a cache"
    bound = config.cache.max_false_hit_rate
    point = OperatingPoints(read_calibration()).threshold(bound)
    pairs = pair_items(data, embedder.encode, embedder.fingerprint) if with_pairs else []
    print(f"  built in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    stream = Stream(
        questions=questions,
        pairs=pairs,
        router_threshold=model.threshold,
        router_embedding=model.embedding,
        operating_point=point,
        max_false_hit_rate=bound,
        signature=signature(len(greedy), with_pairs),
    )
    return stream, vectors


def load(
    *, rebuild: bool = False, as_built: bool = False, data: Path = DATA, out: Path = OUT
) -> tuple[Stream, Vectors]:
    """The stream, from bench/out when it was built from the banks as they are now (or,
    with ``as_built``, whatever they held then: a greedy bank still being banked)."""
    path, vectors_path = out / "shadow_stream.msgpack", out / "shadow_vectors.npy"
    with_pairs = data.is_dir()
    wanted = signature(len(greedy_answers()), with_pairs)
    if not rebuild and path.exists() and vectors_path.exists():
        stream = msgspec.msgpack.decode(path.read_bytes(), type=Stream)
        if stream.signature == wanted or as_built:
            if stream.signature != wanted:
                print(f"{path}: built from other banks ({stream.signature}, now {wanted})",
                      file=sys.stderr)  # fmt: skip
            return stream, np.load(vectors_path)
    print("building the stream (replays, embeddings, pair sweeps)", file=sys.stderr)
    stream, vectors = build(data, with_pairs=with_pairs)
    out.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.msgpack.encode(stream))
    np.save(vectors_path, vectors)
    return stream, vectors


# --- the checks a stream's requests would draw -----------------------------------------


def tenant_of(source: str) -> str:
    """A tenant per kind of traffic: ARC-Challenge questions and QQP pairs are one,
    GSM8K questions and PAWS pairs the other."""
    return "arc" if source in ("arc_challenge", "qqp") else "gsm"


ROUTE: dict[Shortcut, str] = {
    "semantic_hit": "semantic",
    "small_route": "small",
    "early_stop": "loop",
    "large_route": "loop",
}


class Entry(msgspec.Struct, frozen=True, kw_only=True):
    """One shortcut a request of the stream took, and what its check would record."""

    shortcut: Shortcut
    tenant: str
    position: float  # where in the stream, 0..1 (a reload takes effect halfway)
    index: int  # the question's (or pair's) place in the stream's pool
    order: int  # the question's branch order (0 for a pair)
    agree: bool | None
    prompt: str
    answer: str
    reference: str
    confidence: float | None = None
    difficulty: float | None = None
    cache_score: float | None = None


# A request: ("q", question index, branch order) or ("p", pair index, 0).
Request = tuple[str, int, int]


def entries(requests: Sequence[Request], stream: Stream) -> list[Entry]:
    """The shortcuts ``requests`` take, in their order, each with its check's label:
    a question routed small takes small_route; one routed to the loop takes large_route,
    and early_stop as well where the loop stopped early; a pair takes semantic_hit where
    the verifier serves it (a miss takes none: its answers are not banked)."""
    out = []
    last = max(1, len(requests) - 1)
    for place, (kind, index, order) in enumerate(requests):
        at = place / last
        if kind == "p":
            pair = stream.pairs[index]
            if stream.operating_point <= pair.score < np.inf:
                out.append(Entry(shortcut="semantic_hit", tenant=tenant_of(pair.source),
                                 position=at, index=index, order=0, agree=pair.duplicate,
                                 prompt=pair.b, answer=pair.a, reference=pair.a,
                                 cache_score=pair.score))  # fmt: skip
            continue
        item = stream.questions[index]
        loop = item.loop[order]
        common = {"tenant": tenant_of(item.source), "position": at, "index": index,
                  "order": order, "prompt": item.prompt, "difficulty": item.score}  # fmt: skip
        if item.route == "small":
            out.append(Entry(shortcut="small_route", agree=item.small_vs_loop[order],
                             answer=item.small_text, reference=loop.text, **common))  # type: ignore[arg-type]  # fmt: skip
            continue
        if item.early(order):
            out.append(Entry(shortcut="early_stop", agree=item.loop_vs_budget[order],
                             answer=loop.text, reference=item.budget[order].text,
                             confidence=loop.probability, **common))  # type: ignore[arg-type]  # fmt: skip
        out.append(Entry(shortcut="large_route", agree=item.loop_vs_small[order],
                         answer=loop.text, reference=item.small_text, **common))  # type: ignore[arg-type]  # fmt: skip
    return out


def record_of(entry: Entry, probability: float, tenant: str | None = None) -> CheckRecord:
    """The CheckRecord a check of ``entry`` drawn with ``probability`` writes, filed
    under ``tenant`` (its own when None)."""
    return CheckRecord(
        id=uuid.uuid4().hex,
        at=0.0,
        source="shadow",
        tenant=tenant or entry.tenant,
        shortcut=entry.shortcut,
        route=ROUTE[entry.shortcut],
        model="auto",
        probability=probability,
        policy="shipped",
        prompt=entry.prompt,
        answer=entry.answer,
        reference=entry.reference,
        agree=entry.agree,
        confidence=entry.confidence,
        difficulty=entry.difficulty,
        cache_score=entry.cache_score,
    )
