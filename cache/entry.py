"""What the cache stores, and the keys it stores it under."""

from __future__ import annotations

import functools
import hashlib
import time
from collections.abc import Sequence

import msgspec
import numpy as np

from router.embedder import Vectors


class Namespace(msgspec.Struct, frozen=True, kw_only=True):
    """The scope an answer is valid in: nothing crosses from one namespace to another.

    ``context`` fingerprints everything around the last user turn (system prompt,
    tools, earlier turns); semantic matching compares last user turns only, so two
    prompts match only where that context is identical.
    """

    tenant: str = "default"
    model: str
    context: str = ""
    embedding: str
    sampling: str = "greedy"  # see sampling_key

    @property
    def key(self) -> str:
        """``tenant:model:<hash of the rest>``: readable where an operator selects by
        it ("drop tenant acme's entries"), hashed where it only needs to differ."""
        return _namespace_key(self.tenant, self.model, self.context, self.embedding, self.sampling)


# A pure function of its arguments, remembered: every request of a namespace (a tenant's
# model, system prompt and sampling) needs its key, twice or more.
@functools.lru_cache(maxsize=4096)
def _namespace_key(tenant: str, model: str, context: str, embedding: str, sampling: str) -> str:
    digest = hashlib.sha256("\x1f".join((context, embedding, sampling)).encode()).hexdigest()
    return f"{tenant}:{model}:{digest[:16]}"


def normalise(prompt: str) -> str:
    """The form the exact path compares: the prompt as sent, but for whitespace around
    it and Windows line ends. Nothing inside is folded: case ("1 MB" is not "1 Mb"),
    punctuation ("What is 5!" is not "What is 5?") and spacing (Python's indentation)
    can each change the answer, and the exact path runs no guard. Prompts that differ
    only there may still meet on the semantic path, whose guards look at them."""
    return prompt.replace("\r\n", "\n").strip()


# Prompts up to this long have their ids remembered (4,096 of them: 8 M characters at most):
# normalising and hashing was 7% of an exact hit's cost, and hot prompts repeat.
_REMEMBERED_PROMPT_CHARS = 2048


def entry_id(namespace: Namespace, prompt: str) -> int:
    """A stable 63-bit id per (namespace, normalised prompt): the exact key, and the id
    of the prompt's vector in the namespace's index, so re-adding replaces."""
    if len(prompt) <= _REMEMBERED_PROMPT_CHARS:
        return _remembered_id(namespace.key, prompt)
    return _id(namespace.key, prompt)


def _id(namespace_key: str, prompt: str) -> int:
    digest = hashlib.sha256(f"{namespace_key}\x1f{normalise(prompt)}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


_remembered_id = functools.lru_cache(maxsize=4096)(_id)


class CacheEntry(msgspec.Struct, frozen=True, kw_only=True):
    id: int
    namespace: str  # Namespace.key
    prompt: str  # the last user turn, as first asked
    response: str
    model: str  # the engine that answered
    tier: str
    confidence: float
    created_at: float
    expires_at: float | None = None
    completion_tokens: int = 0
    # The prompt's embedding as little-endian float16: every replica rebuilds its
    # index from the store, so the store keeps the vector (half the bytes of float32,
    # cosine error about 1e-4).
    vector: bytes = b""
    # The least score (the verifier's P; the similarity without a verifier) a semantic
    # hit on this entry needs, over the operating point: raised each time a hit on it
    # is reported wrong (POST /v1/feedback). Exact repeats are served whatever it is.
    # None until then, and so left out of the store's hash: a replica of an earlier
    # version, which knows no such field, still reads the entry.
    hit_floor: float | None = None

    @property
    def floor(self) -> float:
        return self.hit_floor or 0.0

    def expired(self, now: float | None = None) -> bool:
        return self.expires_at is not None and (now or time.time()) >= self.expires_at


def pack_vector(vector: Vectors) -> bytes:
    return np.asarray(vector, dtype="<f2").tobytes()


def unpack_vector(packed: bytes) -> Vectors:
    return np.frombuffer(packed, dtype="<f2").astype(np.float32)


def context_fingerprint(turns: Sequence[tuple[str, ...]]) -> str:
    """Fingerprint of the (role, content) turns around the last user turn, and of
    whatever else (a message's name) the answer may depend on."""
    if not turns:
        return ""
    return hashlib.sha256(msgspec.msgpack.encode(list(turns))).hexdigest()[:32]


GREEDY = "greedy"


def sampling_key(
    temperature: float,
    *,
    top_p: float = 1.0,
    seed: int | None = None,
    stop: Sequence[str] = (),
    frequency_penalty: float = 0.0,
    presence_penalty: float = 0.0,
    response_format: str | None = None,
) -> str:
    """The sampling settings an answer depends on, as the engine samples it: at
    temperature 0 it is greedy, and top_p and the seed change nothing. A format the
    answer was constrained to (its JSON text) keys it whole: an answer made for one
    schema is no answer for another."""
    key = GREEDY if not temperature else f"t={temperature},p={top_p},seed={seed}"
    if stop or frequency_penalty or presence_penalty:
        key += f",stop={list(stop)},fp={frequency_penalty},pp={presence_penalty}"
    if response_format is not None:
        key += ",format=" + hashlib.sha256(response_format.encode()).hexdigest()[:32]
    return key
