"""Our semantic cache and GPTCache side by side on the same labelled prompt pairs.

Both are warmed with every pair's ``a`` and queried with every ``b``, with the same
MiniLM vectors (our bundled all-MiniLM-L6-v2, encoded once) and exact FAISS search.
A hit is correct only when it returns the prompt warmed from the pair's own ``a`` and
the pair is labelled a duplicate: the metric of `satisfice cache eval`.

    .venv/bin/python bench/cache_vs_gptcache.py --pairs bench/out/pairs_paws.jsonl \\
        --plot docs/img/cache_vs_gptcache_paws.png

- ours: `cache.pairs.sweep`, i.e. exactly what `satisfice cache eval` measures, with
  the similarity threshold alone (0.92, guards on: `verifier: null`), or with
  ``--verifier`` the default cache (guards, then the verifier at the operating point
  of ``--max-false-hit-rate``). Without the verifier the same lookup (exact match,
  then the nearest of ``candidates`` above the threshold that every guard accepts) is
  also replayed here, as a check; the report says how far it agrees with `sweep`.
- GPTCache 0.1.44 through its own adapter API (`cache.init`, `put`, `get` from
  `gptcache.adapter.api`): an embedding function that returns our vectors, its FAISS
  vector store (``IDMap,Flat``, L2), its `SearchDistanceEvaluation`, no eviction
  within the run. Its scalar store is an in-memory `CacheStorage` defined here: its
  SQL store would import SQLAlchemy, which is not installed, and GPTCache answers a
  missing package by running ``pip install``; that is refused here. The scalar
  store only maps ids to questions and answers, so it changes no lookup.

Both are swept over their thresholds from one pass: queried at threshold 0, each
returns its best candidate, and any threshold's outcome follows from that
candidate's score (checked against real `get` calls at two GPTCache thresholds).
GPTCache's threshold ``t`` serves a candidate whose score ``4 - L2²`` reaches ``4t``;
for unit vectors that is cosine ``>= 2t - 1``.

PAWS comes in families of sentences; most ``b`` are verbatim another pair's ``a``,
so both caches serve a prompt identical to the query, which the metric counts
wrong. The report therefore adds a "by meaning" view: a hit is right when the
served prompt is the query itself or linked to it by the duplicate labels of the
whole file (transitively), and wrong otherwise, unknown links included.

Prints one JSON object; ``--plot`` draws precision against hit rate for both.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import faiss
import gptcache.utils
import numpy as np
import numpy.typing as npt
from gptcache import Cache, Config
from gptcache.adapter.api import get, put
from gptcache.manager import VectorBase, get_data_manager
from gptcache.manager.scalar_data.base import CacheData, CacheStorage
from gptcache.processor.pre import get_prompt
from gptcache.similarity_evaluation.distance import SearchDistanceEvaluation
from verifier_data import families

from cache.entry import normalise
from cache.guards import veto
from cache.pairs import Pair, read_pairs, sweep
from cache.settings import CacheSettings
from cache.verifier import Verification
from router.embedder import Embedder, EmbedderSettings, Vectors

GPTCACHE_DEFAULT_THRESHOLD = 0.8  # gptcache.config.Config's own default
# Below this many hits a precision is too noisy to compare.
MIN_HITS = 20
Floats = npt.NDArray[np.float64]
Bools = npt.NDArray[np.bool_]


class MemoEmbedder(Embedder):
    """Our embedder with every prompt of the run encoded once, in batches: both
    caches and `sweep` get the very same vectors."""

    def __init__(self, settings: EmbedderSettings) -> None:
        super().__init__(settings)
        self.memo: dict[str, Vectors] = {}

    def prepare(self, texts: Sequence[str]) -> None:
        todo = [t for t in dict.fromkeys(texts) if t not in self.memo]
        if todo:
            self.memo.update(zip(todo, super().encode(todo), strict=True))

    def encode(self, texts: Sequence[str]) -> Vectors:
        self.prepare(texts)
        return np.stack([self.memo[t] for t in texts]).astype(np.float32)


class Outcome:
    """Per query: the score of what a cache would serve at threshold 0 (-inf: nothing)
    and which warmed prompt that is; any threshold's hits follow."""

    def __init__(self, score: Floats, served: list[str | None], pairs: list[Pair]) -> None:
        self.score = score
        self.served = served
        labelled = np.array([p.label == 1 for p in pairs])
        own = np.array(
            [
                s is not None and normalise(s) == normalise(p.a)
                for s, p in zip(served, pairs, strict=True)
            ]
        )
        self.correct: Bools = labelled & own
        self.near_miss: Bools = ~labelled
        self.by_meaning: Bools = np.zeros(len(pairs), dtype=bool)

    def at(self, threshold: float, *, meaning: bool = False) -> dict[str, float]:
        hits = self.score >= threshold
        right = hits & (self.by_meaning if meaning else self.correct)
        count, n_right = int(hits.sum()), int(right.sum())
        near = int(self.near_miss.sum())
        return {
            "threshold": round(threshold, 4),
            "hit_rate": count / len(hits),
            "precision": n_right / count if count else 1.0,
            "false_hit_rate": (count - n_right) / len(hits),
            # Near misses (pairs labelled different) that got a wrong hit.
            "near_miss_false_hit_rate": int((hits & ~right & self.near_miss).sum()) / near
            if near
            else 0.0,
        }

    def curve(self, meaning: bool = False) -> list[dict[str, float]]:
        """Every distinct operating point, from the most hits to the fewest."""
        scores = np.unique(self.score[np.isfinite(self.score)])
        return [self.at(float(s), meaning=meaning) for s in scores]


def _meaning(pairs: list[Pair]) -> Callable[[str], str]:
    """Normalised prompts joined by duplicate labels, transitively, share a root."""
    find = families((normalise(p.a), normalise(p.b)) for p in pairs if p.label == 1)
    return lambda prompt: find(normalise(prompt))


def _set_meaning(outcome: Outcome, pairs: list[Pair], group: Callable[[str], str]) -> None:
    outcome.by_meaning = np.array(
        [
            s is not None and group(s) == group(p.b)
            for s, p in zip(outcome.served, pairs, strict=True)
        ]
    )


def ours(pairs: list[Pair], embedder: MemoEmbedder, settings: CacheSettings) -> dict[str, Any]:
    """`sweep` for the figures; without a verifier, a replay of the same lookup as a check."""
    started = time.perf_counter()
    official = sweep(pairs, settings, encode=embedder.encode, embedding_model=embedder.fingerprint)
    swept_s = time.perf_counter() - started
    # Exact repeats score above every operating point; nothing served, below every one.
    score = np.where(official.score < 0, -np.inf, np.minimum(official.score, 1.0 + 1e-9))
    result = Outcome(score, official.served, pairs)
    result.correct = official.correct
    report: dict[str, Any] = {"outcome": result, "seconds": round(swept_s, 1)}
    if settings.verifier is None:
        replay = _replay(pairs, embedder, settings)
        same = np.isclose(
            np.where(np.isfinite(score), score, -1),
            np.where(np.isfinite(replay.score), replay.score, -1),
            atol=2e-3,
        ) & (official.correct == replay.correct)
        report["replay_agreement"] = float(same.mean())
    return report


def _replay(pairs: list[Pair], embedder: MemoEmbedder, settings: CacheSettings) -> Outcome:
    warm = list(dict.fromkeys(p.a for p in pairs))
    index = faiss.IndexFlatIP(embedder.dim)
    index.add(embedder.encode(warm))
    found, ids = index.search(embedder.encode([p.b for p in pairs]), settings.candidates)
    exact: dict[str, str] = {}
    for prompt in warm:
        exact.setdefault(normalise(prompt), prompt)
    score = np.full(len(pairs), -np.inf)
    served: list[str | None] = [None] * len(pairs)
    for i, pair in enumerate(pairs):
        if settings.exact and normalise(pair.b) in exact:
            score[i], served[i] = 1.0, exact[normalise(pair.b)]
            continue
        for similarity, id_ in zip(found[i], ids[i], strict=True):
            if id_ >= 0 and veto(warm[id_], pair.b, settings.guards) is None:
                score[i], served[i] = float(similarity), warm[id_]
                break
    return Outcome(score, served, pairs)


class MemoryStorage(CacheStorage):  # type: ignore[misc]  # GPTCache has no types
    """GPTCache's scalar store contract, in a dict."""

    def __init__(self) -> None:
        self.rows: dict[int, CacheData] = {}

    def create(self) -> None:
        pass

    def batch_insert(self, all_data: list[CacheData]) -> list[int]:
        ids = list(range(len(self.rows) + 1, len(self.rows) + 1 + len(all_data)))
        self.rows.update(zip(ids, all_data, strict=True))
        return ids

    def get_data_by_id(self, key: int) -> CacheData | None:
        return self.rows.get(int(key))

    def mark_deleted(self, keys: list[int]) -> None:
        for key in keys:
            self.rows.pop(int(key), None)

    def clear_deleted_data(self) -> None:
        pass

    def get_ids(self, deleted: bool = True) -> list[int]:
        return [] if deleted else list(self.rows)

    def count(self, state: int = 0, is_all: bool = False) -> int:
        return len(self.rows)

    def add_session(self, question_id: int, session_id: str, session_question: str) -> None:
        pass

    def list_sessions(self, session_id: str | None = None, key: int | None = None) -> list[Any]:
        return []

    def delete_session(self, keys: list[int]) -> None:
        pass

    def report_cache(self, *args: object) -> None:
        pass

    def close(self) -> None:
        pass


class Recording(SearchDistanceEvaluation):  # type: ignore[misc]  # GPTCache has no types
    """GPTCache's own score, remembered so one pass gives every threshold."""

    best = -np.inf

    def evaluation(self, src_dict: Any, cache_dict: Any, **kwargs: Any) -> float:
        score = float(super().evaluation(src_dict, cache_dict, **kwargs))
        self.best = max(self.best, score)
        return score


def _refuse_install(package: str, warn: bool = False) -> None:
    raise RuntimeError(f"GPTCache tried to pip install {package!r}; refused")


def gptcache_warmed(
    embedder: MemoEmbedder, warm: list[str], folder: str, threshold: float
) -> tuple[Any, Recording]:
    """A GPTCache at ``threshold`` holding every prompt of ``warm``, each answered by
    its index, and the evaluation that records its scores."""
    evaluation = Recording()
    cache = Cache()
    cache.init(
        pre_embedding_func=get_prompt,
        embedding_func=lambda text, **_: embedder.memo[text],
        data_manager=get_data_manager(
            cache_base=MemoryStorage(),
            vector_base=VectorBase(
                "faiss",
                dimension=embedder.dim,
                index_path=str(Path(folder) / f"faiss-{threshold}.index"),
            ),
            max_size=len(warm) + 1,
        ),
        similarity_evaluation=evaluation,
        config=Config(similarity_threshold=threshold, auto_flush=len(warm) + 1),
    )
    for n, prompt in enumerate(warm):
        put(prompt, str(n), cache_obj=cache)
    return cache, evaluation


def gptcache_run(
    pairs: list[Pair], embedder: MemoEmbedder, check_at: Sequence[float], check_limit: int
) -> dict[str, Any]:
    gptcache.utils.prompt_install = _refuse_install  # its import helpers call this by that name
    warm = list(dict.fromkeys(p.a for p in pairs))
    folder = tempfile.mkdtemp(prefix="gptcache-")
    # GPTCache writes its FAISS index at exit; registered first, this removal runs last.
    atexit.register(shutil.rmtree, folder, True)

    started = time.perf_counter()
    cache, evaluation = gptcache_warmed(embedder, warm, folder, 0.0)
    warmed_s = time.perf_counter() - started
    score = np.full(len(pairs), -np.inf)
    served: list[str | None] = [None] * len(pairs)
    for i, pair in enumerate(pairs):
        evaluation.best = -np.inf
        answer = get(pair.b, cache_obj=cache)
        if answer is not None:
            score[i], served[i] = evaluation.best / 4.0, warm[int(answer)]
    queried_s = time.perf_counter() - started - warmed_s
    # Real lookups at other thresholds must agree with the one-pass derivation.
    checks = []
    for threshold in check_at:
        other, _ = gptcache_warmed(embedder, warm, folder, threshold)
        sample = range(min(check_limit, len(pairs)))
        got = [get(pairs[i].b, cache_obj=other) for i in sample]
        derived = [score[i] >= threshold for i in sample]
        real = [g is not None for g in got]
        checks.append({"threshold": threshold, "queries": len(real),
                       "agree": float(np.mean(np.equal(real, derived)))})  # fmt: skip
    return {
        "outcome": Outcome(score, served, pairs),
        "threshold_checks": checks,
        "seconds": {"warm": round(warmed_s, 1), "query": round(queried_s, 1)},
    }


def _along(outcome: Outcome, meaning: bool) -> dict[str, Floats]:
    """An outcome's operating points by ascending hit rate, GPTCache's threshold
    given as the cosine it stands for."""
    curve = outcome.curve(meaning)[::-1]
    return {key: np.array([p[key] for p in curve]) for key in curve[0]}


def at_equal_hit_rate(
    mine: Outcome, theirs: Outcome, meaning: bool, points: int = 21
) -> list[dict[str, float]]:
    """Both systems at the same hit rates, evenly spread over the range both reach
    (with at least MIN_HITS hits), each interpolated along its own curve."""
    ours_at, gpt_at = _along(mine, meaning), _along(theirs, meaning)
    low = max(ours_at["hit_rate"][0], gpt_at["hit_rate"][0], MIN_HITS / len(mine.score))
    high = min(ours_at["hit_rate"][-1], gpt_at["hit_rate"][-1])
    rows = []
    for rate in np.linspace(low, high, points) if high > low else []:
        row = {"hit_rate": float(rate)}
        for name, at in (("our", ours_at), ("gptcache", gpt_at)):
            for key in ("threshold", "precision", "near_miss_false_hit_rate"):
                row[f"{name}_{key}"] = float(np.interp(rate, at["hit_rate"], at[key]))
        row["gptcache_cosine"] = 2 * row["gptcache_threshold"] - 1
        row["near_miss_ratio_ours_to_gptcache"] = (
            row["our_near_miss_false_hit_rate"] / row["gptcache_near_miss_false_hit_rate"]
            if row["gptcache_near_miss_false_hit_rate"]
            else float("nan")
        )
        rows.append(row)
    return rows


def summary(rows: list[dict[str, float]]) -> dict[str, float | int]:
    if not rows:
        return {"points": 0}
    gain = [r["our_precision"] - r["gptcache_precision"] for r in rows]
    ratios = [r["near_miss_ratio_ours_to_gptcache"] for r in rows]
    finite = [r for r in ratios if np.isfinite(r)]
    return {
        "points": len(rows),
        "ours_higher_at": sum(g > 0 for g in gain),
        "mean_precision_gain": float(np.mean(gain)),
        "min_precision_gain": float(np.min(gain)),
        "max_near_miss_ratio": float(np.max(finite)) if finite else float("nan"),
        "median_near_miss_ratio": float(np.median(finite)) if finite else float("nan"),
    }


def plot(
    mine: Outcome,
    theirs: Outcome,
    title: str,
    path: str,
    meaning_too: bool,
    ours_at: float,
    ours_label: str,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.8))
    views = [False, True] if meaning_too else [False]
    for meaning in views:
        style = "--" if meaning else "-"
        suffix = " (by meaning)" if meaning else ""
        for name, outcome, colour in (("ours", mine, "C0"), ("GPTCache", theirs, "C1")):
            curve = [p for p in outcome.curve(meaning) if p["hit_rate"] * len(outcome.score)
                     >= MIN_HITS]  # fmt: skip
            axes.plot([p["hit_rate"] for p in curve], [p["precision"] for p in curve], style,
                      color=colour, label=name + suffix)  # fmt: skip
        for outcome, threshold, colour, label in (
            (mine, ours_at, "C0", ours_label),
            (theirs, GPTCACHE_DEFAULT_THRESHOLD, "C1", "GPTCache at its default 0.8"),
        ):
            point = outcome.at(threshold, meaning=meaning)
            axes.plot(point["hit_rate"], point["precision"], "o", color=colour,
                      label=None if meaning else label)  # fmt: skip
    axes.set_xlabel("hit rate")
    axes.set_ylabel("precision")
    axes.set_ylim(0, 1.02)
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def split(pairs: list[Pair], half: str, seed: int) -> list[Pair]:
    """A seeded half of the pairs: guards were developed on "dev", "held" is unseen."""
    if half == "all":
        return pairs
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    chosen = order[: len(order) // 2] if half == "dev" else order[len(order) // 2 :]
    return [pairs[i] for i in sorted(chosen)]


def _our_settings(args: argparse.Namespace) -> CacheSettings:
    """The cache measured; with the verifier, ``args.threshold`` becomes its operating point."""
    if not args.verifier:
        return CacheSettings(similarity_threshold=args.threshold, verifier=None)
    settings = CacheSettings(max_false_hit_rate=args.max_false_hit_rate)
    verification = Verification.configured(settings.verifier)
    assert verification is not None
    args.threshold = verification.threshold(args.max_false_hit_rate)
    return settings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", required=True, help='JSONL of {"a", "b", "label"} lines')
    parser.add_argument("--limit", type=int, default=8000,
                        help="a seeded sample of at most this many pairs (0: all)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--half", choices=["all", "dev", "held"], default="all")
    parser.add_argument("--threshold", type=float, default=0.92,
                        help="our similarity threshold, without --verifier")  # fmt: skip
    parser.add_argument("--verifier", action="store_true",
                        help="ours with the default verifier at --max-false-hit-rate")  # fmt: skip
    parser.add_argument("--max-false-hit-rate", type=float, default=0.01)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--plot", help="precision against hit rate for both, as PNG")
    args = parser.parse_args()

    pairs = everything = read_pairs(args.pairs)
    if args.limit and len(pairs) > args.limit:
        pairs = random.Random(args.seed).sample(pairs, args.limit)
    pairs = split(pairs, args.half, args.seed)
    started = time.perf_counter()
    embedder = MemoEmbedder(EmbedderSettings(threads=args.threads, max_batch=128))
    embedder.load()
    embedder.prepare([p.a for p in pairs] + [p.b for p in pairs])
    embedded_s = time.perf_counter() - started
    print(f"embedded {len(embedder.memo)} prompts in {embedded_s:.0f} s", file=sys.stderr)

    mine = ours(pairs, embedder, _our_settings(args))
    theirs = gptcache_run(pairs, embedder, check_at=[GPTCACHE_DEFAULT_THRESHOLD, 0.96],
                          check_limit=1000)  # fmt: skip
    # What the file's labels say about which prompts mean the same, all of them: a
    # half or a sample knows no less about meaning than the whole file.
    group = _meaning(everything)
    for outcome in (mine["outcome"], theirs["outcome"]):
        _set_meaning(outcome, pairs, group)
    ours_outcome: Outcome = mine["outcome"]
    gpt: Outcome = theirs["outcome"]

    # GPTCache thresholds from cosine 0.80 to 1.00 in steps of 0.005.
    grid = [round(0.9 + 0.0025 * k, 4) for k in range(41)]
    cosines = [round(0.8 + 0.005 * k, 4) for k in range(41)]
    grid_p = [round(0.025 * k, 4) for k in range(41)]
    report: dict[str, Any] = {
        "pairs": len(pairs),
        "file": Path(args.pairs).name,
        "half": args.half,
        "duplicates": sum(p.label for p in pairs),
        "near_misses": sum(1 - p.label for p in pairs),
        "embedding": embedder.fingerprint,
        "ours": {
            "decided_by": "verifier" if args.verifier else "similarity",
            "max_false_hit_rate": args.max_false_hit_rate if args.verifier else None,
            "threshold": args.threshold,
            "at_threshold": ours_outcome.at(args.threshold),
            "at_threshold_by_meaning": ours_outcome.at(args.threshold, meaning=True),
            "curve": [ours_outcome.at(c) for c in (grid_p if args.verifier else cosines)],
            "replay_agreement_with_sweep": mine.get("replay_agreement"),
        },
        "gptcache": {
            "version": gptcache.__version__,
            "api": "gptcache.adapter.api put/get, Cache.init(get_prompt, our vectors, "
            "faiss IDMap,Flat L2, SearchDistanceEvaluation(max_distance=4))",
            "default_threshold": GPTCACHE_DEFAULT_THRESHOLD,
            "at_default": gpt.at(GPTCACHE_DEFAULT_THRESHOLD),
            "at_default_by_meaning": gpt.at(GPTCACHE_DEFAULT_THRESHOLD, meaning=True),
            "at_cosine_of_our_threshold": gpt.at((args.threshold + 1) / 2),
            "curve": [gpt.at(t) for t in grid],
            "threshold_checks": theirs["threshold_checks"],
        },
        "equal_hit_rate": at_equal_hit_rate(ours_outcome, gpt, meaning=False),
        "equal_hit_rate_by_meaning": at_equal_hit_rate(ours_outcome, gpt, meaning=True),
    }
    for key in ("equal_hit_rate", "equal_hit_rate_by_meaning"):
        rows = report[key]
        report[f"{key}_summary"] = {
            "all": summary(rows),
            # Hit rates that both reach with a cosine threshold of at least 0.80: lower
            # thresholds serve prompts that merely share a topic.
            "cosine_0.80_up": summary(
                [
                    r
                    for r in rows
                    if r["gptcache_cosine"] >= 0.8 and (args.verifier or r["our_threshold"] >= 0.8)
                ]
            ),
        }
    # GPTCache at the hit rate our default threshold gives.
    ours_point = ours_outcome.at(args.threshold)
    gpt_curve = gpt.curve()[::-1]
    rates = np.array([p["hit_rate"] for p in gpt_curve])
    report["gptcache_at_our_hit_rate"] = {
        key: float(np.interp(ours_point["hit_rate"], rates, [p[key] for p in gpt_curve]))
        for key in ("precision", "near_miss_false_hit_rate")
    }
    report["seconds"] = {
        "embedding": round(embedded_s, 1),
        "ours_sweep": mine["seconds"],
        "gptcache": theirs["seconds"],
        "total": round(time.perf_counter() - started, 1),
    }
    if args.plot:
        paws = "paws" in Path(args.pairs).name
        title = f"{Path(args.pairs).name} ({len(pairs)} pairs{'' if args.half == 'all' else ', ' + args.half + ' half'})"  # noqa: E501
        label = (
            f"ours, verifier at max_false_hit_rate {args.max_false_hit_rate}"
            if args.verifier
            else f"ours at {args.threshold}"
        )
        plot(
            ours_outcome,
            gpt,
            title,
            args.plot,
            meaning_too=paws,
            ours_at=args.threshold,
            ours_label=label,
        )
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
