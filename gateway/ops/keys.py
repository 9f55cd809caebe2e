"""Who is calling: an API key, kept only as its SHA-256, names a key and its tenant.

API keys are random tokens, not passwords: one SHA-256 of a key is as hard to
reverse as the key is to guess, so a slow password hash would only slow requests.
A key refused raises ``KeyRefused``, which the HTTP layer answers with 401 or 403.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping
from typing import Literal

import msgspec

from gateway.config import DEFAULT_TENANT, AuthSettings, ConfigError, KeySettings

ADMIN_KEY_ENV = "SATISFICE_ADMIN_KEY"

# Why a key is refused: no known API key, no known admin key (both unauthenticated);
# admin endpoints that nothing could open, an API key without the admin right (both
# forbidden).
KeyRefusal = Literal["invalid_api_key", "invalid_admin_key", "admin_closed", "not_admin"]


class KeyRefused(Exception):
    """The request's key may not do what it asks; ``message`` is safe to show it."""

    def __init__(self, kind: KeyRefusal, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


class Caller(msgspec.Struct, frozen=True, kw_only=True):
    """The key a request came with (None when the API is open) and what it may do."""

    key: str | None
    tenant: str
    admin: bool = False
    limits: KeySettings | None = None


OPEN = Caller(key=None, tenant=DEFAULT_TENANT)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class KeyTable:
    """The configured keys by hash, and the admin key, as one config defines them."""

    def __init__(
        self, auth: AuthSettings, admin_key: str | None, environ: Mapping[str, str] = os.environ
    ) -> None:
        self._callers: dict[str, Caller] = {}
        for name, settings in auth.keys.items():
            digest = settings.sha256
            if settings.env is not None:
                key = environ.get(settings.env, "")
                if not key:
                    raise ConfigError(
                        f"auth.keys.{name}.env: the environment variable {settings.env} "
                        "is not set or empty"
                    )
                digest = hash_key(key)
            assert digest is not None  # KeySettings insists on sha256 or env
            if digest in self._callers:
                raise ConfigError(
                    f"auth.keys.{name}: the same key as auth.keys.{self._callers[digest].key}"
                )
            self._callers[digest] = Caller(
                key=name, tenant=settings.tenant, admin=settings.admin, limits=settings
            )
        admin = admin_key or environ.get(ADMIN_KEY_ENV) or None
        self._admin_digest = None if admin is None else hash_key(admin)

    @property
    def open(self) -> bool:
        """No keys configured: anyone may call the API, as tenant "default"."""
        return not self._callers

    def caller(self, headers: Mapping[str, str]) -> Caller:
        """The caller of an API request; refused without a known key (when keys exist)."""
        if self.open:
            return OPEN
        caller = self._known(headers)
        if caller is None:
            raise KeyRefused(
                "invalid_api_key",
                "an API key is required: send one as 'Authorization: Bearer <key>' or "
                "'x-api-key: <key>'"
                if _token(headers) is None
                else "the API key is not valid",
            )
        return caller

    def admin(self, headers: Mapping[str, str]) -> None:
        """Let an admin through: the admin key, or an API key with ``admin: true``.
        Refused without a known key, when nothing could open the admin endpoints, or
        when the key lacks the right."""
        if self._admin_digest is None and not any(c.admin for c in self._callers.values()):
            raise KeyRefused(
                "admin_closed",
                f"admin endpoints are closed: set server.admin_key or {ADMIN_KEY_ENV}, or "
                "give an API key admin: true",
            )
        token = _token(headers)
        digest = None if token is None else hash_key(token)
        admin = self._admin_digest
        if digest is not None and admin is not None and hmac.compare_digest(digest, admin):
            return
        caller = self._known(headers)
        if caller is None:
            raise KeyRefused(
                "invalid_admin_key",
                "an admin key is required: send it as 'Authorization: Bearer <key>'",
            )
        if not caller.admin:
            raise KeyRefused("not_admin", f"the API key {caller.key!r} may not use admin endpoints")

    def _known(self, headers: Mapping[str, str]) -> Caller | None:
        token = _token(headers)
        # A dict lookup by digest: comparing digests leaks nothing about the key.
        return None if token is None else self._callers.get(hash_key(token))


def _token(headers: Mapping[str, str]) -> str | None:
    """The key a request carries: as OpenAI's clients send it (a bearer token), else as
    Anthropic's do (x-api-key)."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    token = token.strip()
    if scheme.lower() == "bearer" and token:
        return token
    return headers.get("x-api-key", "").strip() or None
