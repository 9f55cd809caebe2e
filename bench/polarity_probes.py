"""Whether the semantic cache serves a yes/no question the answer to its opposite.

Each probe is a cached question and a new one that either flips its polarity (an
antonym, a comparative, a negating prefix, a quantifier, a preposition, a negation:
serving the cached answer is wrong) or says the same in other words (serving it is
right). Each pair goes through the cache's own lookup on its own (the cached question
alone in a namespace, the new one asked: embedding, guards, verifier at the
configured operating point), once with every configured guard and once with the
polarity guard off, so the two columns differ by that guard alone.

    .venv/bin/python bench/polarity_probes.py bench/data/polarity_probes_heldout.jsonl

bench/data/polarity_probes_dev.jsonl holds the probes the guard's word lists were
written against; bench/data/polarity_probes_heldout.jsonl was written apart from the
code and read once the lists were fixed (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import msgspec

from cache.pairs import Pair, sweep
from cache.settings import CacheSettings
from cache.verifier import Verification
from engines.jsonl import read_jsonl
from evaluator.replay_report import wilson
from gateway.config import load_config
from router.embedder import Embedder


class Probe(msgspec.Struct, frozen=True):
    cached: str
    query: str
    same: bool  # serving the cached answer is right
    flip: str  # how the query flips it, or "paraphrase"


def served(probes: list[Probe], settings: CacheSettings, embedder: Embedder) -> list[bool]:
    """Per probe, whether the cache would serve the cached question's answer."""
    pairs = [Pair(p.cached, p.query, int(p.same)) for p in probes]
    result = sweep(
        pairs,
        settings,
        encode=embedder.encode,
        embedding_model=embedder.fingerprint,
        pairwise=True,
    )
    if result.by == "similarity":
        threshold = settings.similarity_threshold
    else:
        verification = Verification.configured(settings.verifier)
        assert verification is not None
        threshold = verification.threshold(settings.max_false_hit_rate)
    return [bool(s >= threshold) for s in result.score]


def _rate(hits: int, n: int) -> dict[str, object]:
    low, high = wilson(hits, n)
    return {"served": hits, "of": n, "rate": round(hits / n, 4) if n else None,
            "ci95": [round(low, 4), round(high, 4)]}  # fmt: skip


def report(probes: list[Probe], columns: dict[str, list[bool]]) -> dict[str, object]:
    """Per column: flips served (wrong answers) by kind and in all, paraphrases served."""
    out: dict[str, object] = {"probes": len(probes)}
    for name, hits in columns.items():
        by_kind: dict[str, list[bool]] = defaultdict(list)
        for probe, hit in zip(probes, hits, strict=True):
            by_kind[probe.flip].append(hit)
        flips = [h for p, h in zip(probes, hits, strict=True) if not p.same]
        same = [h for p, h in zip(probes, hits, strict=True) if p.same]
        out[name] = {
            "flips_served": _rate(sum(flips), len(flips)),
            "paraphrases_served": _rate(sum(same), len(same)),
            "by_kind": {k: _rate(sum(v), len(v)) for k, v in sorted(by_kind.items())},
        }
    return out


def _table(figures: dict[str, object], columns: list[str]) -> str:
    """One row per flip kind, then the totals: served/of (rate, 95% interval)."""

    def cell(rate: dict[str, object]) -> str:
        low, high = rate["ci95"]  # type: ignore[misc]
        return f"{rate['served']}/{rate['of']} ({low:.2f}-{high:.2f})"

    per_column = [figures[c] for c in columns]
    kinds = list(per_column[0]["by_kind"])  # type: ignore[index]
    lines = ["| probes | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for kind in kinds:
        row = [cell(c["by_kind"][kind]) for c in per_column]  # type: ignore[index]
        lines.append(f"| {kind} | " + " | ".join(row) + " |")
    for total in ("flips_served", "paraphrases_served"):
        row = [cell(c[total]) for c in per_column]  # type: ignore[index]
        lines.append(f"| **{total.replace('_', ' ')}** | " + " | ".join(row) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("probes", help="JSON Lines of {cached, query, same, flip}")
    parser.add_argument("--config", help="the gateway config (default: the embedded one)")
    parser.add_argument("--json", help="write the figures here as JSON too")
    parser.add_argument("--list", action="store_true", help="print each probe served wrongly")
    args = parser.parse_args()
    probes = read_jsonl(args.probes, Probe).records
    config = load_config(args.config)
    settings = config.cache or CacheSettings()
    embedder = Embedder(config.embedder, Path(config.models_dir))
    embedder.load()
    guards_off = msgspec.structs.replace(settings.guards, polarity=False)
    columns = {
        "guards": served(probes, settings, embedder),
        "polarity_off": served(
            probes, msgspec.structs.replace(settings, guards=guards_off), embedder
        ),
    }
    figures = report(probes, columns)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")
    print(_table(figures, list(columns)))
    if args.list:
        for probe, hit in zip(probes, columns["guards"], strict=True):
            if hit != probe.same:
                wrong = "served" if hit else "not served"
                print(f"{wrong}: {probe.flip}: {probe.cached!r} -> {probe.query!r}")


if __name__ == "__main__":
    main()
