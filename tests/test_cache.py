"""The semantic cache on the real embedder: exact and semantic hits, guards, scopes."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import hypothesis
import pytest
from hypothesis import strategies as st

from cache.entry import Namespace
from cache.memory_store import MemoryStore
from cache.semantic_cache import Hit, Miss, SemanticCache
from cache.settings import CacheSettings, IndexSettings, MemoryStoreSettings, VerifierSettings
from router.embedder import Embedder, Embedding
from tests.support import satisfice


@contextlib.asynccontextmanager
async def make_cache(
    max_entries: int = 100, snapshot: Path | None = None, **settings: object
) -> AsyncIterator[SemanticCache]:
    """A memory cache; by default without the verifier, so the tests of lookup, guards,
    scopes and snapshots here are decided by the similarity threshold alone (the
    verifier's decisions: test_cache_verifier)."""
    store = MemoryStoreSettings(
        max_entries=max_entries, snapshot=None if snapshot is None else str(snapshot)
    )
    settings.setdefault("verifier", None)
    cache = SemanticCache(CacheSettings(store=store, **settings), MemoryStore(store))  # type: ignore[arg-type]
    await cache.start()
    try:
        yield cache
    finally:
        await cache.close()


def scope(embedder: Embedder, tenant: str = "a") -> Namespace:
    return Namespace(tenant=tenant, model="small", embedding=embedder.fingerprint)


async def put(
    cache: SemanticCache, embedder: Embedder, ns: Namespace, prompt: str, confidence: float = 0.9
) -> bool:
    entry = cache.entry(ns, prompt, await embedder.embed(prompt), response=f"answer to {prompt}",
                        model="small", tier="small", confidence=confidence)  # fmt: skip
    return bool(await cache.put([entry]))


async def semantic(
    cache: SemanticCache, embedder: Embedder, ns: Namespace, prompt: str
) -> Hit | Miss:
    return await cache.semantic(ns, prompt, await embedder.embed(prompt))


async def test_exact_then_semantic_then_guarded(embedder: Embedder) -> None:
    ns = scope(embedder)
    async with make_cache() as cache:
        await put(cache, embedder, ns, "What is the capital of France?")
        exact = await cache.exact(ns, "  What is the capital of France?\n")
        assert exact is not None and exact.path == "exact"
        # Only the whitespace around a prompt is folded: case and punctuation may
        # change the answer ("1 MB", "1 Mb"; "5?", "5!").
        assert await cache.exact(ns, "what is the capital of France?") is None
        assert await cache.exact(ns, "What is the capital of France") is None

        hit = await semantic(cache, embedder, ns, "Which city is the capital of France?")
        assert isinstance(hit, Hit) and hit.entry.prompt == "What is the capital of France?"
        assert hit.similarity >= 0.92

        miss = await semantic(cache, embedder, ns, "What is the capital of Germany?")
        assert isinstance(miss, Miss) and miss.reason in ("guard:entities", "below_threshold")

        far = await semantic(cache, embedder, ns, "How do I bake sourdough bread?")
        assert isinstance(far, Miss) and far.reason == "below_threshold"
        stats = await cache.stats()
        assert stats.counters.exact_hits == 1 and stats.counters.semantic_hits == 1
        assert stats.counters.misses == 2 and stats.indexed == 1


async def test_lookup_embeds_only_when_the_exact_path_misses(embedder: Embedder) -> None:
    ns = scope(embedder)
    calls = []

    async def embed() -> Embedding:
        calls.append(1)
        return await embedder.embed("Which city is the capital of France?")

    async with make_cache() as cache:
        await put(cache, embedder, ns, "What is the capital of France?")
        found = await cache.lookup(ns, "What is the capital of France? ", embed)
        assert isinstance(found, Hit) and found.path == "exact" and not calls
        found = await cache.lookup(ns, "Which city is the capital of France?", embed)
        assert isinstance(found, Hit) and found.path == "semantic"
        assert calls == [1]


async def test_changed_number_is_vetoed_not_served(embedder: Embedder) -> None:
    ns = scope(embedder)
    async with make_cache(similarity_threshold=0.8) as cache:
        await put(cache, embedder, ns, "What is 15% of 80?")
        miss = await semantic(cache, embedder, ns, "What is 15% of 90?")
        assert isinstance(miss, Miss) and miss.reason == "guard:numbers"
        assert miss.best_similarity is not None and miss.best_similarity >= 0.8
        assert (await cache.stats()).counters.guard_rejections == {"numbers": 1}


async def test_namespaces_do_not_leak(embedder: Embedder) -> None:
    tenant_a, tenant_b = scope(embedder, "a"), scope(embedder, "b")
    prompt = "What is the capital of France?"
    async with make_cache() as cache:
        await put(cache, embedder, tenant_a, prompt)
        assert await cache.exact(tenant_b, prompt) is None
        assert await semantic(cache, embedder, tenant_b, prompt) == Miss("empty")
        assert await cache.invalidate("b") == 0
        assert await cache.invalidate("a") == 1  # a tenant selects all of its namespaces
        assert await cache.exact(tenant_a, prompt) is None
        assert await semantic(cache, embedder, tenant_a, prompt) == Miss("empty")


async def test_write_confidence_ttl_and_eviction(embedder: Embedder) -> None:
    ns = scope(embedder)
    async with make_cache(max_entries=2, write_confidence=0.5, ttl_s=0.3) as cache:
        assert not await put(cache, embedder, ns, "Name a fruit.", confidence=0.4)
        assert await cache.exact(ns, "Name a fruit.") is None
        for prompt in ("Name a colour.", "Name an animal.", "Name a planet."):
            assert await put(cache, embedder, ns, prompt)
        assert await cache.exact(ns, "Name a colour.") is None  # the oldest was evicted
        assert isinstance(await semantic(cache, embedder, ns, "Name a colour."), Miss)
        assert not cache.contains(cache.entry(ns, "Name a colour.", await embedder.embed("x"),
                                  response="", model="", tier="", confidence=1).id)  # fmt: skip
        assert await cache.exact(ns, "Name a planet.") is not None
        await asyncio.sleep(0.35)
        assert await cache.exact(ns, "Name a planet.") is None
        assert isinstance(await semantic(cache, embedder, ns, "Name a planet."), Miss)


async def test_snapshot_keeps_the_cache_across_a_restart(
    embedder: Embedder, tmp_path: Path
) -> None:
    ns, snapshot = scope(embedder), tmp_path / "cache.snapshot"
    async with make_cache(snapshot=snapshot) as cache:
        await put(cache, embedder, ns, "What is the capital of France?")
    assert snapshot.stat().st_size > 0
    async with make_cache(snapshot=snapshot) as cache:
        hit = await semantic(cache, embedder, ns, "Which city is the capital of France?")
        assert (
            isinstance(hit, Hit)
            and hit.entry.response == "answer to What is the capital of France?"
        )
    snapshot.write_bytes(b"not a snapshot")  # damaged: the cache starts empty, and says so
    async with make_cache(snapshot=snapshot) as cache:
        assert (await cache.stats()).indexed == 0
    assert (tmp_path / "cache.snapshot.unreadable").read_bytes() == b"not a snapshot"


async def test_vectors_of_another_model_are_refused(embedder: Embedder) -> None:
    ns = scope(embedder)
    async with make_cache() as cache:
        foreign = Embedding((await embedder.embed("hi")).vector, "other-model:1")
        with pytest.raises(ValueError, match="other-model:1"):
            await cache.semantic(ns, "hi", foreign)


# Slow: a CLI process that loads the embedder; the same lookups and guards run
# in-process in the tests above.
@pytest.mark.slow
def test_cache_eval_command(tmp_path: Path) -> None:
    pairs = tmp_path / "pairs.jsonl"
    rows = [
        {"a": "What is the capital of France?", "b": "Which city is France's capital?", "label": 1},
        {"a": "How do I enable 2FA?", "b": "How do I disable 2FA?", "label": 0},
        {"a": "What is 15% of 80?", "b": "What is 15% of 90?", "label": 0},
        {"a": "How do I bake bread?", "b": "What is the speed of light?", "label": 0},
    ]
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = satisfice("cache", "eval", "--pairs", str(pairs), "--threshold", "0.7", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    # Only the paraphrase may hit: the guards veto the two near misses.
    assert report["hit_rate"] == 0.25 and report["precision"] == 1.0
    assert report["false_hit_rate"] == 0.0
    assert report["best_hit_rate_at_99_precision"] == 0.25


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(
    template=st.sampled_from(
        [
            "What is {} plus 17?",
            "How many days are there in {} weeks?",
            "Convert {} km to miles.",
            "What was the population of Paris in {}?",
            "Is {} a prime number?",
        ]
    ),
    original=st.integers(min_value=0, max_value=10**6),
    changed=st.integers(min_value=0, max_value=10**6),
)
def test_a_changed_number_never_hits_the_original(
    embedder: Embedder, template: str, original: int, changed: int
) -> None:
    """Through the whole lookup, at any similarity: the guards decide, not the vectors."""
    hypothesis.assume(original != changed)
    cached, query = template.format(original), template.format(changed)
    vectors = embedder.encode([cached, query])

    async def check() -> Hit | Miss:
        # The default path, guards then verifier, with every neighbour a candidate.
        async with make_cache(verifier=VerifierSettings(similarity_floor=0.0)) as cache:
            ns = scope(embedder)
            vector = Embedding(vectors[0], embedder.fingerprint)
            entry = cache.entry(
                ns, cached, vector, response="x", model="small", tier="small", confidence=1.0
            )
            await cache.put([entry])

            async def known() -> Embedding:
                return Embedding(vectors[1], embedder.fingerprint)

            found = await cache.lookup(ns, query, known)
            return found

    found = asyncio.run(check())
    assert isinstance(found, Miss) and found.reason == "guard:numbers"


async def test_a_gpu_index_falls_back_to_the_cpu_without_one(
    embedder: Embedder, caplog: pytest.LogCaptureFixture
) -> None:
    """`index.device: gpu` on a machine (or FAISS build) without a GPU still caches."""
    ns = scope(embedder)
    with caplog.at_level("WARNING", logger="satisfice.index"):
        async with make_cache(index=IndexSettings(device="gpu")) as cache:
            await put(cache, embedder, ns, "What is the capital of France?")
            hit = await semantic(cache, embedder, ns, "Which city is the capital of France?")
            assert isinstance(hit, Hit)
    if not faiss_has_gpu():
        assert "FAISS sees no GPU: using the CPU" in caplog.text


def faiss_has_gpu() -> bool:
    import faiss

    return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0
