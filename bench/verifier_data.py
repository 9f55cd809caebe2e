"""The pair data the cache verifier is trained, calibrated and reported on, split so
that no question is on two sides.

- QQP (GPTCache's Quora Question Pairs): the report set is the seeded sample the cache
  figures in docs/benchmarks.md have always used (`convert_pairs.py qqp --limit 4000`,
  seed 0). Every other pair that shares no question with it is the pool; the pool's
  families (questions joined by any pair) go to `fit` or `calibrate` by a hash.
- PAWS-Wiki (its labelled test split, the only one here): families of sentences (joined
  by any pair) go by a hash to `fit`, `calibrate` or `held` (the report set).

    .venv/bin/python bench/verifier_data.py --out bench/out
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from collections.abc import Callable, Iterable
from pathlib import Path

from convert_pairs import ROOT, PairLine, _paws, _qqp

DEFAULT_DATA = ROOT.parent / "shared" / "data"
# The QQP report sample: the figures in docs/benchmarks.md have always used it.
QQP_REPORT_SIZE, QQP_REPORT_SEED = 4000, 0


def families(links: Iterable[tuple[str, str]]) -> Callable[[str], str]:
    """Union-find: the root of each text's family, two texts in a link being one family."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in links:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[ra] = rb
    return find


def _bucket(text: str, salt: str) -> float:
    """A stable number in [0, 1) per text: splits do not depend on file order."""
    digest = hashlib.sha256(f"{salt}\x1f{text}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_by_family(
    pairs: list[PairLine], shares: dict[str, float], salt: str
) -> dict[str, list[PairLine]]:
    """Pairs to named parts by their family's hash; ``shares`` sum to 1."""
    family = families((p["a"], p["b"]) for p in pairs)
    out: dict[str, list[PairLine]] = {name: [] for name in shares}
    for p in pairs:
        x, edge = _bucket(family(p["a"]), salt), 0.0
        for name, share in shares.items():
            edge += share
            if x < edge:
                out[name].append(p)
                break
        else:
            out[list(shares)[-1]].append(p)
    return out


def qqp_splits(data: Path) -> dict[str, list[PairLine]]:
    pairs = _qqp(data)
    report = random.Random(QQP_REPORT_SEED).sample(pairs, QQP_REPORT_SIZE)
    seen = {p["a"] for p in report} | {p["b"] for p in report}
    pool = [p for p in pairs if p["a"] not in seen and p["b"] not in seen]
    parts = split_by_family(pool, {"fit": 0.85, "calibrate": 0.15}, salt="qqp")
    return {"report": report, **parts}


def paws_splits(data: Path) -> dict[str, list[PairLine]]:
    return split_by_family(_paws(data), {"fit": 0.4, "calibrate": 0.2, "held": 0.4}, salt="paws")


def write(pairs: list[PairLine], path: Path) -> None:
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for source, parts in (("qqp", qqp_splits(args.data)), ("paws", paws_splits(args.data))):
        for name, pairs in parts.items():
            path = args.out / f"verifier_{source}_{name}.jsonl"
            write(pairs, path)
            positives = sum(p["label"] for p in pairs)
            print(f"{path}: {len(pairs)} pairs ({positives} positive)")


if __name__ == "__main__":
    main()
