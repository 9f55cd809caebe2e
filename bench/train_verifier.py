"""Train the cache verifier (cache/verifier.py) on public paraphrase data, compare it
with the alternatives, and write the shipped weights (`make verifier`).

Examples are the labelled pairs of the `fit` splits (QQP and PAWS-Wiki; see
bench/verifier_data.py): the cached prompt `a`, the asked prompt `b`, the label.
Candidates that the semantic path meets besides a pair's own `a` are not used: those
files label only the pairs they list, and most near neighbours in QQP are duplicates
nobody labelled (trained as negatives, they taught a model that the cosine knows
better). The alternatives are measured on the `calibrate` splits' pairs above the
similarity floor (AUC, and precision of the top fifth and two fifths): the cosine
alone (today's threshold), logistic regression on the lexical features, boosted trees
on the lexical features (shipped: cache/verifier.py's features), and boosted trees on
the embeddings' difference and product as well.

    .venv/bin/python bench/train_verifier.py --out cache/data/default.verifier
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from convert_pairs import ROOT, PairLine
from sklearn.ensemble import HistGradientBoostingClassifier
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from verifier_data import DEFAULT_DATA, paws_splits, qqp_splits, write

from cache.entry import normalise
from cache.settings import VerifierSettings
from cache.verifier import (
    LEXICAL,
    Idf,
    Trees,
    Verifier,
    VerifierWeights,
    encode_weights,
    pair_features,
    words,
)
from router.embedder import Embedder, EmbedderSettings

Floats = npt.NDArray[np.float32]

# The alternatives are compared on pairs the semantic path would show the verifier.
FLOOR = VerifierSettings().similarity_floor


class Vectors:
    """Embeddings of every text asked for, kept on disk by text hash between runs."""

    def __init__(self, embedder: Embedder, path: Path) -> None:
        self.embedder, self.path = embedder, path
        self.known: dict[str, Floats] = {}
        if path.exists():
            saved = np.load(path)
            self.known = dict(zip(saved["keys"].tolist(), saved["vectors"], strict=True))

    @staticmethod
    def key(text: str) -> str:
        return hashlib.sha256(text.encode()).hexdigest()[:24]

    def embed(self, texts: Sequence[str]) -> Floats:
        missing = sorted({t for t in texts if self.key(t) not in self.known}, key=len)
        if missing:
            print(f"embedding {len(missing)} texts ...", file=sys.stderr, flush=True)
            for start in range(0, len(missing), 256):  # by length: batches pad less
                batch = missing[start : start + 256]
                for text, vector in zip(batch, self.embedder.encode(batch), strict=True):
                    self.known[self.key(text)] = vector
            keys = list(self.known)
            np.savez(self.path, keys=np.array(keys), vectors=np.stack(list(self.known.values())))
        return np.stack([self.known[self.key(t)] for t in texts]).astype(np.float32)


class Examples:
    """Labelled pairs as the verifier sees them: the cached prompt, the asked one, both
    vectors."""

    def __init__(self, pairs: list[PairLine], vectors: Vectors) -> None:
        kept = [p for p in pairs if normalise(p["a"]) != normalise(p["b"])]  # exact repeats
        self.cached = [p["a"] for p in kept]
        self.query = [p["b"] for p in kept]
        self.u = vectors.embed(self.cached)
        self.v = vectors.embed(self.query)
        self.label = np.array([p["label"] for p in kept])

    def features(self, idf: Idf) -> Floats:
        """The embeddings' difference and product, then the verifier's own features."""
        lexical = np.stack(
            [
                pair_features(c, u, q, v, idf)
                for c, u, q, v in zip(self.cached, self.u, self.query, self.v, strict=True)
            ]
        )
        return np.concatenate([np.abs(self.u - self.v), self.u * self.v, lexical], axis=1)


def idf_table(prompts: Sequence[str]) -> tuple[dict[str, float], float]:
    """Inverse document frequency of the words in at least two prompts; the value for
    any other word (as rare as a word seen once)."""
    seen = Counter(w for prompt in set(prompts) for w in set(words(prompt)))
    count = len(set(prompts))
    table = {w: round(math.log(count / n), 4) for w, n in seen.items() if n >= 2}
    return table, round(math.log(count), 4)


def precision_at(
    scores: Floats, labels: npt.NDArray[np.int64], shares: Sequence[float]
) -> list[float]:
    """Precision of the top ``share`` of candidates by score."""
    order = np.argsort(-scores)
    return [float(labels[order[: max(1, int(share * len(order)))]].mean()) for share in shares]


def export(
    model: HistGradientBoostingClassifier,
    embedder: Embedder,
    idf: Idf,
    trained_on: str,
) -> VerifierWeights:
    """The fitted trees as one node table (child indices made global)."""
    tables, roots, offset = [], [], 0
    for (predictor,) in model._predictors:  # one tree per iteration: a binary label
        nodes = predictor.nodes
        if nodes["missing_go_to_left"].any() and np.isnan(nodes["num_threshold"]).any():
            raise SystemExit("a tree splits on missing values, which the features never are")
        tables.append((nodes, offset))
        roots.append(offset)
        offset += len(nodes)
    nodes = np.concatenate([n for n, _ in tables])
    shift = np.concatenate([np.full(len(n), o) for n, o in tables])
    leaf = nodes["is_leaf"].astype(bool)
    left = np.where(leaf, 0, nodes["left"].astype(np.int64) + shift)
    right = np.where(leaf, 0, nodes["right"].astype(np.int64) + shift)
    trees = Trees(
        baseline=float(np.ravel(model._baseline_prediction)[0]),
        roots=roots,
        feature=nodes["feature_idx"].astype("<i4").tobytes(),
        threshold=nodes["num_threshold"].astype("<f8").tobytes(),
        left=left.astype("<i4").tobytes(),
        right=right.astype("<i4").tobytes(),
        leaf=leaf.astype(np.uint8).tobytes(),
        value=nodes["value"].astype("<f8").tobytes(),
        depth=int(nodes["depth"].max()) + 1,
    )
    return VerifierWeights(
        embedding_model=embedder.fingerprint,
        lexical=LEXICAL,
        idf=idf.table,
        unseen_idf=idf.unseen,
        trees=trees,
        trained_on=trained_on,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--out", type=Path, default=ROOT / "cache" / "data" / "default.verifier")
    parser.add_argument("--work", type=Path, default=ROOT / "bench" / "out")
    parser.add_argument("--iterations", type=int, default=300, help="boosting rounds")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()

    qqp, paws = qqp_splits(args.data), paws_splits(args.data)
    for source, parts in (("qqp", qqp), ("paws", paws)):
        for name, pairs in parts.items():
            write(pairs, args.work / f"verifier_{source}_{name}.jsonl")

    embedder = Embedder(EmbedderSettings(threads=2))
    embedder.load()
    vectors = Vectors(embedder, args.work / "verifier_vectors.npz")
    fit_pairs = qqp["fit"] + paws["fit"]
    idf = Idf(*idf_table([t for p in fit_pairs for t in (p["a"], p["b"])]))
    fit = Examples(fit_pairs, vectors)
    x, y = fit.features(idf), fit.label
    lexical = slice(x.shape[1] - len(LEXICAL), None)
    print(f"fit: {len(y)} pairs ({y.mean():.1%} positive)", file=sys.stderr)

    def trees(iterations: int) -> HistGradientBoostingClassifier:
        return HistGradientBoostingClassifier(max_iter=iterations, random_state=args.seed)

    alternatives: dict[str, tuple[Any, slice] | None] = {
        "cosine": None,
        "logistic_lexical": (
            make_pipeline(StandardScaler(), LogisticRegression(max_iter=3000)),
            lexical,
        ),
        "trees_lexical": (trees(args.iterations), lexical),
        "trees_embeddings_lexical": (trees(500), slice(None)),
    }
    report: dict[str, object] = {"fit_pairs": len(y), "fit_positive": round(float(y.mean()), 4)}
    for alternative in alternatives.values():
        if alternative is not None:
            alternative[0].fit(x[:, alternative[1]], y)
    for split, pairs in (
        ("qqp_calibrate", qqp["calibrate"]),
        ("paws_calibrate", paws["calibrate"]),
    ):
        check = Examples(pairs, vectors)
        cx, cy = check.features(idf), check.label
        near = cx[:, lexical][:, 0] >= FLOOR
        cx, cy = cx[near], cy[near]
        row: dict[str, object] = {
            "pairs_above_floor": len(cy),
            "positive": round(float(cy.mean()), 4),
        }
        for name, alternative in alternatives.items():
            if alternative is None:
                scores = cx[:, lexical][:, 0]
            else:
                scores = alternative[0].predict_proba(cx[:, alternative[1]])[:, 1]
            row[name] = {
                "auc": round(float(roc_auc_score(cy, scores)), 4),
                "precision_top_20_40": [round(p, 4) for p in precision_at(scores, cy, (0.2, 0.4))],
            }
        report[split] = row
    shipped = alternatives["trees_lexical"]
    assert shipped is not None
    trained_on = (
        f"QQP fit split ({len(qqp['fit'])} pairs) and PAWS-Wiki fit split "
        f"({len(paws['fit'])} pairs), bench/verifier_data.py; seed {args.seed}"
    )
    weights = export(shipped[0], embedder, idf, trained_on)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(encode_weights(weights))
    # The shipped file must score as the model it was exported from.
    check_rows = x[:200, lexical]
    exported = Verifier.load(args.out).probabilities(check_rows)
    fitted = shipped[0].predict_proba(check_rows)[:, 1]
    if not np.allclose(exported, fitted, atol=1e-5):
        raise SystemExit("the exported trees do not reproduce the fitted model")
    report["seconds"] = round(time.monotonic() - started, 1)
    report["out"] = str(args.out)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
