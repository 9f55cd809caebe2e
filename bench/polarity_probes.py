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
from collections import defaultdict
from pathlib import Path

import msgspec

from cache.pairs import Pair, sweep
from cache.settings import CacheSettings
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
    threshold = result.configured(settings)
    return [bool(s >= threshold) for s in result.score]


class Rate(msgspec.Struct, frozen=True):
    served: int
    of: int
    low: float  # the 95% Wilson interval of served/of
    high: float

    @classmethod
    def of_hits(cls, hits: list[bool]) -> Rate:
        low, high = wilson(sum(hits), len(hits))
        return cls(sum(hits), len(hits), max(0.0, low), high)  # low is -1e-17 for none

    def __str__(self) -> str:
        return f"{self.served}/{self.of} ({self.low:.2f}-{self.high:.2f})"


class Column(msgspec.Struct, frozen=True):
    """One guard setting's probes served: flips (wrong answers), paraphrases, by kind."""

    flips_served: Rate
    paraphrases_served: Rate
    by_kind: dict[str, Rate]


def column(probes: list[Probe], hits: list[bool]) -> Column:
    by_kind: dict[str, list[bool]] = defaultdict(list)
    for probe, hit in zip(probes, hits, strict=True):
        by_kind[probe.flip].append(hit)
    return Column(
        flips_served=Rate.of_hits([h for p, h in zip(probes, hits, strict=True) if not p.same]),
        paraphrases_served=Rate.of_hits([h for p, h in zip(probes, hits, strict=True) if p.same]),
        by_kind={kind: Rate.of_hits(h) for kind, h in sorted(by_kind.items())},
    )


def table(columns: dict[str, Column]) -> str:
    """One row per kind of probe, then the totals: served/of (95% interval)."""
    kinds = list(next(iter(columns.values())).by_kind)
    lines = ["| probes | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for kind in kinds:
        cells = [str(c.by_kind[kind]) for c in columns.values()]
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    for name in ("flips_served", "paraphrases_served"):
        cells = [str(getattr(c, name)) for c in columns.values()]
        lines.append(f"| **{name.replace('_', ' ')}** | " + " | ".join(cells) + " |")
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
    hits = {
        "guards": served(probes, settings, embedder),
        "polarity_off": served(
            probes, msgspec.structs.replace(settings, guards=guards_off), embedder
        ),
    }
    columns = {name: column(probes, h) for name, h in hits.items()}
    if args.json:
        Path(args.json).write_bytes(msgspec.json.encode(columns) + b"\n")
    print(table(columns))
    if args.list:
        for probe, hit in zip(probes, hits["guards"], strict=True):
            if hit != probe.same:
                wrong = "served" if hit else "not served"
                print(f"{wrong}: {probe.flip}: {probe.cached!r} -> {probe.query!r}")


if __name__ == "__main__":
    main()
