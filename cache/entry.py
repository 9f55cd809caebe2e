"""What the cache stores, and the keys it stores it under."""

from __future__ import annotations

import hashlib
import re
import time

import msgspec

_SPACE = re.compile(r"\s+")


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
    sampling: str = "greedy"

    @property
    def key(self) -> str:
        parts = (self.tenant, self.model, self.context, self.embedding, self.sampling)
        return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:32]


def normalise(prompt: str) -> str:
    """The form the exact path compares: case, spacing and end punctuation do not count."""
    return _SPACE.sub(" ", prompt).strip().rstrip("?!. ").lower()


def entry_id(namespace: Namespace, prompt: str) -> int:
    """A stable 63-bit id per (namespace, normalised prompt): the exact key, and the id
    of the prompt's vector in the namespace's index, so re-adding replaces."""
    digest = hashlib.sha256(f"{namespace.key}\x1f{normalise(prompt)}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


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

    def expired(self, now: float | None = None) -> bool:
        return self.expires_at is not None and (now or time.time()) >= self.expires_at
