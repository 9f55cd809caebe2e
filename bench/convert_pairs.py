"""Public duplicate-detection data as cache evaluation pairs: JSONL lines
``{"a": str, "b": str, "label": 0|1}`` for `satisfice cache eval`.

Sources (in ../shared/data): `qqp` (GPTCache's Quora Question Pairs, duplicates and
not), `paws` (PAWS-Wiki, near-miss word swaps, hard negatives), `mock` (GPTCache's
paraphrase positives), `stsb` (STS-B's test split, similarity graded 0-5 by people: a
pair is a duplicate at 4 or more, "mostly equivalent", and not one below 3; the 3-4
band is left out as neither), `probes` (bench/data/polarity_probes_heldout.jsonl, the
yes/no polarity probes). `--limit N` keeps a reproducible random sample.

    .venv/bin/python bench/convert_pairs.py qqp --out bench/out/pairs_qqp.jsonl --limit 5000
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import subprocess
from pathlib import Path
from typing import TypedDict

ROOT = Path(__file__).resolve().parent.parent


class PairLine(TypedDict):
    a: str
    b: str
    label: int  # 1: the two ask the same


def _qqp(data: Path) -> list[PairLine]:
    raw = subprocess.run(
        ["tar", "xzOf", str(data / "gptcache_qqp" / "similiar_qqp_full.json.gz")],
        capture_output=True,
        check=True,
    ).stdout
    return [{"a": p["text_a"], "b": p["text_b"], "label": int(p["label"])} for p in json.loads(raw)]


def _paws(data: Path) -> list[PairLine]:
    with (data / "paws_wiki" / "test.tsv").open(newline="") as file:
        rows = csv.reader(file, delimiter="\t", quoting=csv.QUOTE_NONE)
        return [{"a": r[1], "b": r[2], "label": int(r[3])} for r in rows if len(r) == 4]


def _mock(data: Path) -> list[PairLine]:
    pairs = json.loads((data / "gptcache_mock" / "mock_data.json").read_text())
    return [{"a": p["origin"], "b": p["similar"], "label": 1} for p in pairs]


def _stsb(data: Path) -> list[PairLine]:
    with (data / "stsb" / "sts-test.csv").open(newline="") as file:
        rows = csv.reader(file, delimiter="\t", quoting=csv.QUOTE_NONE)
        graded = [(float(r[4]), r[5], r[6]) for r in rows if len(r) >= 7]
    return [{"a": a, "b": b, "label": int(g >= 4.0)} for g, a, b in graded if not 3.0 <= g < 4.0]


def _probes(data: Path) -> list[PairLine]:
    lines = (ROOT / "bench" / "data" / "polarity_probes_heldout.jsonl").read_text().splitlines()
    probes = [json.loads(line) for line in lines if line.strip()]
    return [{"a": p["cached"], "b": p["query"], "label": int(p["same"])} for p in probes]


SOURCES = {"qqp": _qqp, "paws": _paws, "mock": _mock, "stsb": _stsb, "probes": _probes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", choices=sorted(SOURCES))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--limit", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    pairs = SOURCES[args.source](args.data)
    if args.limit and args.limit < len(pairs):
        pairs = random.Random(args.seed).sample(pairs, args.limit)
    args.out.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    positives = sum(p["label"] for p in pairs)
    print(f"{args.source}: {len(pairs)} pairs ({positives} duplicates) -> {args.out}")


if __name__ == "__main__":
    main()
