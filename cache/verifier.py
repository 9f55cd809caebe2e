"""P(same answer) for a cached prompt and a new one, from features of the pair.

The semantic path's nearest neighbours share a topic more often than an answer
("How do I learn Python?" and "How do I learn Java?" embed close by). The guards veto
the differences they know; the verifier scores what is left: gradient-boosted trees
over the pair's cosine and lexical features (overlap of words and word pairs, question
words, and how rare the words are that only one side has). It runs on numpy in a
fraction of a millisecond per lookup, so a semantic hit needs no model call beyond
the embedding it already has. (Trees over the two embeddings' difference and product
as well scored no better on the calibration pairs: bench/train_verifier.py.)

Its weights are trained from public paraphrase data by ``bench/train_verifier.py``
(``make verifier``) and shipped in ``cache/data/``; ``cache/data/README.md`` names the
data, its licence and the split.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from difflib import SequenceMatcher
from itertools import pairwise
from pathlib import Path

import msgspec
import numpy as np
import numpy.typing as npt

from cache.calibration import BUNDLED as BUNDLED_CALIBRATION
from cache.calibration import OperatingPoints, read_calibration
from cache.settings import VerifierSettings
from router.embedder import Vectors

Floats = npt.NDArray[np.float32]

BUNDLED = Path(__file__).parent / "data" / "default.verifier"

_WORD = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")
# Words that say what kind of answer is wanted: "how" and "why" share a topic, not an answer.
_ASKING = frozenset({
    "what", "how", "why", "which", "who", "whom", "whose", "when", "where", "is", "are",
    "can", "do", "does", "did", "should", "would", "will", "could", "was", "were", "has",
    "have", "may", "must", "shall",
})  # fmt: skip
_STOPWORDS = _ASKING | frozenset({
    "a", "an", "the", "i", "me", "my", "we", "our", "you", "your", "he", "she", "it",
    "its", "they", "them", "their", "this", "that", "these", "those", "to", "of", "in",
    "on", "at", "for", "from", "by", "with", "about", "as", "into", "and", "or", "but",
    "if", "so", "than", "then", "there", "be", "been", "being", "am", "not", "no", "any",
    "some", "get",
})  # fmt: skip

# The lexical features, in the order the model was trained on.
LEXICAL = (
    "cosine",
    "word_jaccard",
    "content_jaccard",
    "bigram_jaccard",
    "char_ratio",
    "length_ratio",
    "only_one_side",
    "same_first_word",
    "same_asking_words",
    "same_last_word",
    "content_missing_max",
    "shared_idf",
    "unshared_idf_max",
    "unshared_idf_min",
    "unshared_idf_share",
    "unshared_content_idf",
    "unshared_content_words",
)
# Character similarity looks at this much of each prompt (its cost grows with the square).
CHAR_SPAN = 400


class Trees(msgspec.Struct, frozen=True, kw_only=True):
    """Boosted regression trees, every tree's nodes in one table: a row goes left where
    its feature is at most the threshold; the raw score is ``baseline`` plus the value
    of the leaf it reaches in each tree, and P is its logistic."""

    baseline: float
    roots: list[int]  # each tree's first node
    feature: bytes  # int32 per node
    threshold: bytes  # float64 per node
    left: bytes  # int32 per node (the table's index)
    right: bytes  # int32 per node
    leaf: bytes  # uint8 per node
    value: bytes  # float64 per node
    depth: int  # the deepest leaf's depth


class VerifierWeights(msgspec.Struct, frozen=True, kw_only=True):
    """What ``bench/train_verifier.py`` writes."""

    embedding_model: str  # the embedder fingerprint whose cosines it was trained on
    lexical: tuple[str, ...]
    # Inverse document frequency of the words seen at least twice in the training
    # prompts; an unseen word counts as rare as one seen once.
    idf: dict[str, float]
    unseen_idf: float
    trees: Trees
    trained_on: str  # a line saying what data and split


class VerifierError(ValueError):
    """A weights file that cannot be used; the message names the file."""


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower().replace("\u2019", "'"))


def _jaccard(a: set[str] | set[tuple[str, str]], b: set[str] | set[tuple[str, str]]) -> float:
    union = len(a | b)
    return len(a & b) / union if union else 1.0


class Idf:
    def __init__(self, table: dict[str, float], unseen: float) -> None:
        self.table, self.unseen = table, unseen

    def __call__(self, word: str) -> float:
        return self.table.get(word, self.unseen)


def lexical_features(cached: str, query: str, cosine: float, idf: Idf) -> list[float]:
    """The pair's lexical features, in ``LEXICAL`` order."""
    cw, qw = words(cached), words(query)
    cs, qs = set(cw), set(qw)
    cc, qc = cs - _STOPWORDS, qs - _STOPWORDS
    cb, qb = set(pairwise(cw)), set(pairwise(qw))
    longest = max(len(cw), len(qw), 1)
    only_c, only_q = cs - qs, qs - cs
    total = sum(idf(w) for w in cs | qs) or 1.0
    rarest_c = max((idf(w) for w in only_c), default=0.0)
    rarest_q = max((idf(w) for w in only_q), default=0.0)
    unshared_content = (only_c | only_q) - _STOPWORDS
    chars = SequenceMatcher(
        None, " ".join(cw)[:CHAR_SPAN], " ".join(qw)[:CHAR_SPAN], autojunk=False
    )
    return [
        cosine,
        _jaccard(cs, qs),
        _jaccard(cc, qc),
        _jaccard(cb, qb),
        chars.ratio(),
        min(len(cw), len(qw)) / longest,
        len(cs ^ qs) / longest,
        float(bool(cw) and bool(qw) and cw[0] == qw[0]),
        float((cs & _ASKING) == (qs & _ASKING)),
        float(bool(cw) and bool(qw) and cw[-1] == qw[-1]),
        max(len(cc - qc), len(qc - cc)) / max(len(cc | qc), 1),
        sum(idf(w) for w in cs & qs) / total,
        max(rarest_c, rarest_q),
        min(rarest_c, rarest_q),
        sum(idf(w) for w in only_c | only_q) / total,
        sum(idf(w) for w in unshared_content),
        float(len(unshared_content)),
    ]


def pair_features(
    cached: str, cached_vector: Vectors, query: str, query_vector: Vectors, idf: Idf
) -> Floats:
    """One row of the model's input."""
    cosine = float(np.dot(cached_vector, query_vector))
    return np.asarray(lexical_features(cached, query, cosine, idf), dtype=np.float32)


class _Forest:
    """``Trees`` as arrays, evaluated for every row and tree at once, level by level."""

    def __init__(self, trees: Trees) -> None:
        self.baseline = trees.baseline
        self.roots = np.asarray(trees.roots, dtype=np.int32)
        self.feature = np.frombuffer(trees.feature, dtype="<i4").astype(np.intp)
        self.threshold = np.frombuffer(trees.threshold, dtype="<f8")
        self.left = np.frombuffer(trees.left, dtype="<i4").astype(np.intp)
        self.right = np.frombuffer(trees.right, dtype="<i4").astype(np.intp)
        self.leaf = np.frombuffer(trees.leaf, dtype=np.uint8).astype(bool)
        self.value = np.frombuffer(trees.value, dtype="<f8")
        self.depth = trees.depth
        sizes = {len(a) for a in (self.feature, self.threshold, self.left, self.right)}
        sizes |= {len(self.leaf), len(self.value)}
        nodes = len(self.value)
        if len(sizes) != 1 or not nodes or self.roots.max(initial=0) >= nodes:
            raise ValueError("the trees' node tables disagree in length")
        if max(self.left.max(), self.right.max()) >= nodes:
            raise ValueError("a tree's node points outside the table")

    def raw(self, x: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        rows = np.arange(len(x))[:, None]
        node = np.broadcast_to(self.roots, (len(x), len(self.roots))).copy()
        for _ in range(self.depth):
            at_leaf = self.leaf[node]
            if at_leaf.all():
                break
            left = x[rows, self.feature[node]] <= self.threshold[node]
            node = np.where(at_leaf, node, np.where(left, self.left[node], self.right[node]))
        raw: npt.NDArray[np.float64] = self.baseline + self.value[node].sum(axis=1)
        return raw


class Verifier:
    """Scores candidate pairs with the shipped (or a given) model."""

    def __init__(self, weights: VerifierWeights, fingerprint: str) -> None:
        self.weights = weights
        # Which weights decided: an operating point calibrated for other weights is void.
        self.fingerprint = fingerprint
        self.idf = Idf(weights.idf, weights.unseen_idf)
        self._forest = _Forest(weights.trees)
        if weights.lexical != LEXICAL:
            raise ValueError("the weights were trained on other lexical features")

    @classmethod
    def load(cls, path: str | Path = BUNDLED) -> Verifier:
        try:
            data = Path(path).read_bytes()
            return cls(msgspec.msgpack.decode(data, type=VerifierWeights), _digest(data))
        except (OSError, ValueError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise VerifierError(f"verifier weights {path}: {exc}") from exc

    @property
    def embedding_model(self) -> str:
        return self.weights.embedding_model

    def probabilities(self, features: Floats) -> Floats:
        """P(same answer) per row of ``features`` (rows from ``pair_features``)."""
        raw = self._forest.raw(np.atleast_2d(features).astype(np.float64))
        return (1.0 / (1.0 + np.exp(-np.clip(raw, -30.0, 30.0)))).astype(np.float32)

    def score(
        self, query: str, query_vector: Vectors, candidates: Sequence[tuple[str, Vectors]]
    ) -> list[float]:
        """P(same answer) of each (cached prompt, its vector) for the query."""
        if not candidates:
            return []
        rows = np.stack(
            [pair_features(c, vec, query, query_vector, self.idf) for c, vec in candidates]
        )
        return [float(p) for p in self.probabilities(rows)]


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def encode_weights(weights: VerifierWeights) -> bytes:
    return msgspec.msgpack.encode(weights)


class Verification:
    """The verifier and where its operating points come from."""

    def __init__(self, verifier: Verifier, points: OperatingPoints | None) -> None:
        """``points`` None: every P serves (operating point 0), for evaluation."""
        if points is not None and points.calibration.verifier != verifier.fingerprint:
            raise VerifierError(
                f"the calibration ({points.calibration.pairs}) scored verifier "
                f"{points.calibration.verifier}, not the one configured "
                f"({verifier.fingerprint}): run `satisfice cache calibrate` for it"
            )
        self.verifier = verifier
        self.points = points

    @classmethod
    def configured(cls, settings: VerifierSettings | None) -> Verification | None:
        if settings is None:
            return None
        verifier = Verifier.load(settings.weights or BUNDLED)
        calibration = read_calibration(settings.calibration or BUNDLED_CALIBRATION)
        return cls(verifier, OperatingPoints(calibration))

    def threshold(self, max_false_hit_rate: float) -> float:
        return 0.0 if self.points is None else self.points.threshold(max_false_hit_rate)

    def check(self, embedding_model: str) -> None:
        """The verifier learned the cosines of one embedder: refuse another's."""
        if embedding_model != self.verifier.embedding_model:
            raise VerifierError(
                f"the cache verifier was trained on the cosines of {self.verifier.embedding_model}"
                f", and this config embeds with {embedding_model}: retrain it for that model "
                "(make verifier), or set cache.verifier: null"
            )
