"""The router's parts on the real bundled embedder: embedding, index, scorers, files."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import numpy as np
import pytest

from router import calibrate
from router.embedder import Embedder, EmbedderOverloaded, Embedding
from router.index import VectorIndex
from router.model_file import RouterFileError, read_router, write_router
from router.outcomes import Outcome, OutcomeError, read_outcomes
from router.router import Router
from router.scorers import Kind, fit, scorer_for
from router.settings import RouterSettings
from tests.support import bench_script

convert_datasets = bench_script("convert_datasets")
DATA = Path(__file__).resolve().parent.parent / ".." / "shared" / "data"

EASY = ["What is 2+2?", "Say hello.", "What colour is the sky?", "Name a fruit."]
HARD = [
    "Prove that there are infinitely many prime numbers congruent to 3 mod 4.",
    "Derive the closed form of the sum of k squared for k from 1 to n, step by step.",
    "A train leaves at 3:15 going 72 km/h; another at 4:05 at 96 km/h. When does it catch up?",
    "Explain why the halting problem is undecidable, with a diagonal argument.",
]


def outcomes() -> list[Outcome]:
    return [Outcome(p, True, True) for p in EASY] + [Outcome(p, False, True) for p in HARD]


async def test_embeddings_are_normalised_and_fingerprinted(embedder: Embedder) -> None:
    embedding = await embedder.embed("What is the capital of France?")
    assert embedding.model == embedder.fingerprint
    vector = embedding.vector
    assert vector.shape == (384,) and vector.dtype == np.float32
    assert np.linalg.norm(vector) == pytest.approx(1.0, abs=1e-5)
    assert embedder.fingerprint.startswith("all-minilm-l6-v2:")


async def test_concurrent_embeds_batch_and_match_single_encoding(embedder: Embedder) -> None:
    texts = [f"question number {i} about the weather" for i in range(40)]
    together = await asyncio.gather(*(embedder.embed(t) for t in texts))
    alone = embedder.encode(texts)
    vectors = np.stack([e.vector for e in together])
    assert np.allclose(vectors, alone, atol=1e-5)
    similar = float(vectors[0] @ vectors[1])
    different = float(vectors[0] @ (await embedder.embed("Bake bread with yeast.")).vector)
    assert similar > different


async def test_a_full_embedder_queue_refuses_at_once(embedder: Embedder) -> None:
    """Beyond queue_size prompts waiting behind the batch in progress, embed() raises
    without waiting; the admitted ones are embedded as usual."""
    kept = embedder.settings
    embedder.settings = msgspec.structs.replace(kept, queue_size=2)
    try:
        calls = [embedder.embed(f"question number {i}") for i in range(8)]
        results = await asyncio.gather(*calls, return_exceptions=True)
    finally:
        embedder.settings = kept
    refused = [r for r in results if isinstance(r, EmbedderOverloaded)]
    embedded = [r for r in results if isinstance(r, Embedding)]
    # The first starts a batch; two wait for the next; the other five are refused.
    assert (len(embedded), len(refused)) == (3, 5)
    assert "queue is full (2 prompts waiting)" in str(refused[0])


def test_index_adds_removes_and_switches_to_hnsw(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    vectors = rng.normal(size=(300, 16)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    index = VectorIndex(16, hnsw_above=200)
    index.add(np.arange(150), vectors[:150])
    assert not index.is_hnsw
    index.add(np.arange(150, 300), vectors[150:])
    assert index.is_hnsw and len(index) == 300
    _, ids = index.search(vectors[:3], 1)
    assert ids[:, 0].tolist() == [0, 1, 2]
    index.remove(np.array([0, 1]))
    _, ids = index.search(vectors[:2], 5)
    assert 0 not in ids and 1 not in ids and len(index) == 298
    index.save(tmp_path / "index.faiss")
    loaded = VectorIndex.load(tmp_path / "index.faiss")
    assert len(loaded) == 298 and loaded.is_hnsw
    assert loaded.search(vectors[2], 1)[1][0, 0] == 2


@pytest.mark.parametrize("kind", ["knn", "logistic"])
async def test_scorer_separates_easy_from_hard(embedder: Embedder, kind: Kind) -> None:
    data = outcomes()
    prompts = [o.prompt for o in data]
    model = fit(kind, data, embedder.encode(prompts), embedding=embedder.fingerprint, k=3)
    scorer = scorer_for(model)
    easy = ["What is 3+3?", "Say goodbye."]
    hard = ["Prove that the square root of 2 is irrational, step by step."]
    scores = scorer.score(embedder.encode(easy + hard), easy + hard)
    assert ((scores >= 0) & (scores <= 1)).all()
    assert scores[2] > max(scores[:2])


async def test_router_file_round_trip_and_refusals(embedder: Embedder, tmp_path: Path) -> None:
    data = outcomes()
    vectors = embedder.encode([o.prompt for o in data])
    model = fit("knn", data, vectors, embedding=embedder.fingerprint, k=3)
    path = tmp_path / "r.router"
    write_router(model, path)
    assert read_router(path, embedding=embedder.fingerprint) == model

    with pytest.raises(RouterFileError, match="fitted on embeddings of 'other-model:1'"):
        write_router(msgspec.structs.replace(model, embedding="other-model:1"), path)
        read_router(path, embedding=embedder.fingerprint)

    path.write_bytes(b"\x93not a router")
    with pytest.raises(RouterFileError, match=f"{path}: not a usable satisfice-router file"):
        read_router(path)

    torn = msgspec.structs.replace(model, labels=model.labels[:-1])
    write_router(torn, path)
    with pytest.raises(RouterFileError, match="corrupt"):
        read_router(path)

    with pytest.raises(RouterFileError, match="cannot read"):
        read_router(tmp_path / "missing.router")


def test_outcome_file_errors_name_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "outcomes.jsonl"
    path.write_text(
        '{"prompt": "a", "small_correct": true, "large_correct": false}\n'
        "{not json\n"
        '{"prompt": "b", "small_correct": 0.5, "large_correct": 2.0}\n'
        '{"prompt": "c", "small_correct": false, "large_correct": true}\n'
    )
    with pytest.raises(OutcomeError, match=f"{path}:2: .*--skip-bad"):
        read_outcomes(path)
    loaded = read_outcomes(path, skip_bad=True)
    assert [o.prompt for o in loaded.outcomes] == ["a", "c"]
    assert [s.split(": ")[0] for s in loaded.skipped] == [f"{path}:2", f"{path}:3"]
    assert "<= 1.0" in loaded.skipped[1]

    path.write_text("\n")
    with pytest.raises(OutcomeError, match="no usable outcome lines"):
        read_outcomes(path)


def test_calibration_by_traffic_share_and_by_quality() -> None:
    scores = np.array([0.9, 0.8, 0.7, 0.2, 0.1])
    assert calibrate.for_large_fraction(scores, 0.4).threshold == 0.8
    assert calibrate.for_large_fraction(scores, 0.4).large_fraction == 0.4
    assert calibrate.for_large_fraction(scores, 0.0).large_fraction == 0.0
    data = [
        Outcome("a", False, True),
        Outcome("b", False, True),
        Outcome("c", True, True),
        Outcome("d", True, True),
        Outcome("e", False, False),
    ]
    cheapest = calibrate.for_quality(scores, data, 0.8)
    assert (cheapest.threshold, cheapest.large_fraction, cheapest.quality) == (0.8, 0.4, 0.8)
    with pytest.raises(ValueError, match="no threshold reaches"):
        calibrate.for_quality(scores, data, 0.95)


async def test_router_decides_and_refuses_foreign_vectors(
    embedder: Embedder, tmp_path: Path
) -> None:
    data = outcomes()
    model = fit(
        "knn", data, embedder.encode([o.prompt for o in data]), embedding=embedder.fingerprint, k=3
    )
    write_router(msgspec.structs.replace(model, threshold=0.5), tmp_path / "r.router")
    router = Router(RouterSettings(model_file=str(tmp_path / "r.router")), embedder)
    await router.start()
    prompt = "Prove that the square root of 2 is irrational, step by step."
    decision = await router.decide(prompt, await embedder.embed(prompt), 1.0)
    assert decision.tier == ("large" if decision.score >= 0.5 else "small")
    assert decision.engine == decision.tier and len(decision.neighbours) == 5
    foreign = Embedding(np.zeros(384, dtype=np.float32), "other-model:1")
    with pytest.raises(ValueError, match="other-model:1"):
        await router.decide(prompt, foreign, 1.0)


async def test_shipped_router_sends_word_problems_large_and_facts_small(
    embedder: Embedder,
) -> None:
    """The embedded default's router on public questions it was not fitted on: most
    GSM8K word problems go to the large model, most TriviaQA facts stay small (the
    Qwen pair's outcomes: the 0.5B solves 30% of GSM8K, the 1.5B 62%; on TriviaQA both
    fail). What a new user's first requests meet."""
    if not DATA.is_dir():
        pytest.skip(f"no shared data at {DATA}")
    router = Router(RouterSettings(), embedder)
    await router.start()
    assert router.model is not None
    fitted_on = set(router.model.prompts)
    shares = {}
    for source in ("gsm8k", "triviaqa"):
        pool = convert_datasets.load_pools(DATA, [source])[source].questions
        unseen = [q for q in map(convert_datasets.as_asked, pool) if q.prompt not in fitted_on]
        prompts = [q.prompt for q in unseen[:40]]
        tiers = [(await router.decide(p, await embedder.embed(p), 1.0)).tier for p in prompts]
        shares[source] = tiers.count("large") / len(tiers)
    assert shares["gsm8k"] >= 0.5 and shares["triviaqa"] <= 0.3, shares
