"""The semantic cache on the real embedder: exact and semantic hits, guards, scopes."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from cache.entry import Namespace
from cache.memory_store import MemoryStore
from cache.semantic_cache import CacheSettings, Hit, Miss, SemanticCache
from router.embedder import Embedder, Embedding


def make_cache(embedder: Embedder, **settings: object) -> SemanticCache:
    config = CacheSettings(**settings)  # type: ignore[arg-type]
    return SemanticCache(config, MemoryStore(config.max_entries), dim=embedder.dim)


def scope(embedder: Embedder, tenant: str = "a") -> Namespace:
    return Namespace(tenant=tenant, model="small", embedding=embedder.fingerprint)


async def put(cache: SemanticCache, embedder: Embedder, ns: Namespace, prompt: str) -> None:
    embedding = await embedder.embed(prompt)
    cache.put(ns, prompt, embedding, response=f"answer to {prompt}", model="small",
              tier="small", confidence=0.9)  # fmt: skip


async def test_exact_then_semantic_then_guarded(embedder: Embedder) -> None:
    cache, ns = make_cache(embedder), scope(embedder)
    await put(cache, embedder, ns, "What is the capital of France?")
    exact = cache.exact(ns, "what is the capital of  France")
    assert exact is not None and exact.path == "exact"

    paraphrase = "Which city is the capital of France?"
    hit = cache.semantic(ns, paraphrase, await embedder.embed(paraphrase))
    assert isinstance(hit, Hit) and hit.entry.prompt == "What is the capital of France?"
    assert hit.similarity >= 0.92

    near_miss = "What is the capital of Germany?"
    miss = cache.semantic(ns, near_miss, await embedder.embed(near_miss))
    assert isinstance(miss, Miss) and miss.reason in ("guard:entities", "below_threshold")

    unrelated = "How do I bake sourdough bread?"
    far = cache.semantic(ns, unrelated, await embedder.embed(unrelated))
    assert isinstance(far, Miss) and far.reason == "below_threshold"


async def test_changed_number_is_vetoed_not_served(embedder: Embedder) -> None:
    cache, ns = make_cache(embedder, similarity_threshold=0.8), scope(embedder)
    await put(cache, embedder, ns, "What is 15% of 80?")
    query = "What is 15% of 90?"
    miss = cache.semantic(ns, query, await embedder.embed(query))
    assert isinstance(miss, Miss) and miss.reason == "guard:numbers"
    assert miss.best_similarity is not None and miss.best_similarity >= 0.8


async def test_namespaces_do_not_leak(embedder: Embedder) -> None:
    cache = make_cache(embedder)
    tenant_a, tenant_b = scope(embedder, "a"), scope(embedder, "b")
    prompt = "What is the capital of France?"
    await put(cache, embedder, tenant_a, prompt)
    assert cache.exact(tenant_b, prompt) is None
    assert cache.semantic(tenant_b, prompt, await embedder.embed(prompt)) == Miss("empty")
    assert cache.invalidate(tenant_a) == 1
    assert cache.exact(tenant_a, prompt) is None


async def test_write_confidence_ttl_and_eviction(embedder: Embedder) -> None:
    cache = make_cache(embedder, write_confidence=0.5, ttl_s=0.2, max_entries=2)
    ns = scope(embedder)
    low = await embedder.embed("Name a fruit.")
    assert cache.put(ns, "Name a fruit.", low, response="apple", model="small", tier="small",
                     confidence=0.4) is None  # fmt: skip
    assert cache.exact(ns, "Name a fruit.") is None
    for prompt in ("Name a colour.", "Name an animal.", "Name a planet."):
        await put(cache, embedder, ns, prompt)
    assert cache.exact(ns, "Name a colour.") is None  # the oldest was evicted
    colour = "Name a colour."
    assert isinstance(cache.semantic(ns, colour, await embedder.embed(colour)), Miss)
    assert cache.exact(ns, "Name a planet.") is not None
    await asyncio.sleep(0.25)
    assert cache.exact(ns, "Name a planet.") is None


async def test_vectors_of_another_model_are_refused(embedder: Embedder) -> None:
    cache, ns = make_cache(embedder), scope(embedder)
    foreign = Embedding((await embedder.embed("hi")).vector, "other-model:1")
    with pytest.raises(ValueError, match="other-model:1"):
        cache.semantic(ns, "hi", foreign)


def test_cache_eval_command(tmp_path: Path) -> None:
    pairs = tmp_path / "pairs.jsonl"
    rows = [
        {"a": "What is the capital of France?", "b": "Which city is France's capital?", "label": 1},
        {"a": "How do I enable 2FA?", "b": "How do I disable 2FA?", "label": 0},
        {"a": "What is 15% of 80?", "b": "What is 15% of 90?", "label": 0},
        {"a": "How do I bake bread?", "b": "What is the speed of light?", "label": 0},
    ]
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "cache", "eval", "--pairs", str(pairs),
         "--threshold", "0.7", "--json"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    # Only the paraphrase may hit: the guards veto the two near misses.
    assert report["hit_rate"] == 0.25 and report["precision"] == 1.0
    assert report["false_hit_rate"] == 0.0
    assert report["best_hit_rate_at_99_precision"] == 0.25
