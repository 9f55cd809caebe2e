"""The one config tree SREs edit: each package's settings, composed and validated.

A config is decoded from YAML straight into typed ``msgspec.Struct``s. Anything
wrong is refused with the key path, the value found there and what was expected,
so a bad file never half-applies.
"""

from __future__ import annotations

import re
import typing
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import yaml

from cache.settings import CacheSettings
from engines.settings import EngineSettings
from evaluator.loop import FallbackSettings
from evaluator.policy import LoopSettings
from gateway.config.shadow import ShadowSettings, Share, Shortcut
from router.embedder import EmbedderSettings
from router.settings import RouterSettings

# Clients send this name to let the router pick the engine (once the router exists).
AUTO_MODEL = "auto"

# What per-key rate limits do while their Redis is unavailable (AuthSettings).
Outage = Literal["open", "local", "closed"]

Positive = Annotated[int, msgspec.Meta(ge=1)]


class ServerSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    # Address the HTTP API listens on; `satisfice serve --host` overrides it.
    host: str = "127.0.0.1"
    # Port the HTTP API listens on; `satisfice serve --port` overrides it.
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 8000
    # Request limits: anything larger is refused with a 4xx before any work is done.
    max_body_bytes: Positive = 1_048_576
    # Most messages in one request's conversation.
    max_messages: Positive = 256
    # Most samples (`n`) one request may ask for.
    max_n: Positive = 8
    # max_tokens a client may ask for, and what it gets when it asks for nothing.
    max_tokens_cap: Positive = 1024
    # The max_tokens of a request that sets neither max_tokens nor max_completion_tokens.
    default_max_tokens: Positive = 256
    # The temperature of a request that sets none, which the engine samples at and the
    # cache keys on: 0 (greedy) lets such requests share cached answers; 1.0 is OpenAI's
    # own default, and then such requests are sampled and bypass the cache (unless
    # cache.cache_sampled).
    default_temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] = 0.0
    # Also take the OpenAI `user` field as the conversation a request continues (a new
    # request of the same user then stops that user's reasoning loop in flight). Off:
    # only the x-satisfice-conversation header names a conversation, as one end user
    # may well ask two questions at once.
    user_is_conversation: bool = False
    # The key that opens /admin/*; when unset, the environment's SATISFICE_ADMIN_KEY,
    # and with neither the admin endpoints stay closed.
    admin_key: str | None = None
    # Most prompt tokens one request may send, estimated as UTF-8 bytes / 4 over all
    # messages (the engine still refuses a prompt longer than its context, counted
    # exactly); null: no limit but the engine's.
    max_prompt_tokens: Positive | None = 16_384
    # How often the config file is checked for changes, which are then reloaded as on
    # SIGHUP; null: only SIGHUP reloads it.
    watch_interval_s: Annotated[float, msgspec.Meta(gt=0)] | None = 2.0
    # Log lines on stderr: `text` for people, `json` (one object per line, with the
    # request id and an access line per chat completion) for log collectors.
    log_format: Literal["text", "json"] = "text"
    # One access line per request (a chat completion's says what answered it). At
    # thousands of cache hits a second, writing them is a tenth of the gateway's CPU:
    # false leaves them out; metrics and traces still count every request.
    access_log: bool = True
    # Seconds from a connection's opening (or a request's first byte on a kept-alive
    # connection) until its request line and headers are whole; a client still sending
    # them then gets 408 and the connection is closed, one that sent nothing is closed.
    header_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0
    # Seconds a request body may take to arrive after its headers, plus one more for
    # every `body_min_rate` bytes received, so an upload at a fair speed is never cut;
    # a body that trickles in slower gets 408 and the connection is closed.
    body_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    # Bytes per second a long body must keep up, on average, beyond `body_timeout_s`.
    body_min_rate: Positive = 65_536
    # Seconds an idle kept-alive connection stays open between requests.
    keep_alive_timeout_s: Positive = 5
    # Most bytes of a request line and headers; more get 431 and the connection closed.
    max_header_bytes: Positive = 65_536
    # Answer an exact hit this process holds (memory store, or the Redis store's near
    # cache) before the web framework sees the request, by the same checks and with
    # the same response: about three times the exact hits per second. false: every
    # request takes the framework's path.
    express_hits: bool = True


# Where an OpenTelemetry Collector listens for OTLP/HTTP traces by default.
DEFAULT_ENDPOINT = "http://localhost:4318/v1/traces"


class TelemetrySettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """OpenTelemetry traces: one span per HTTP request, exported over OTLP/HTTP
    (protobuf) in batches from a background thread. A collector that is slow or down
    never fails or slows a request; its spans are dropped."""

    # The collector's OTLP/HTTP traces URL, path included.
    endpoint: Annotated[str, msgspec.Meta(pattern=r"^https?://")] = DEFAULT_ENDPOINT
    # service.name of every span, the name trace backends list the gateway under.
    service_name: Annotated[str, msgspec.Meta(min_length=1)] = "satisfice"
    # Fraction of requests traced, among those that arrive without a `traceparent`;
    # a client's `traceparent` decides for its own requests (its sampled flag).
    sample_ratio: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 1.0
    # HTTP headers sent with every export: an API key, say.
    headers: dict[str, str] = {}
    # Seconds one export may take, retries included, before its spans are dropped; also
    # the longest a stopping gateway waits for its last spans to go out.
    export_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0
    # Longest a finished span waits before it is exported with the others of its batch.
    batch_delay_ms: Annotated[int, msgspec.Meta(ge=1)] = 5000


Milliseconds = Annotated[int, msgspec.Meta(ge=1)]


Unit = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
# The tenant of every request when no API keys are configured.
DEFAULT_TENANT = "default"


class SLASettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """How long a request may take, by the tier that answers it, and what answers when
    the reasoning loop runs out of time. A request's own ``x-satisfice-deadline-ms``
    header may shorten its deadline, never lengthen it."""

    # Per tier (engine name), milliseconds from the request's arrival; a tier not
    # listed has no deadline beyond its engine's timeout_s.
    deadline_ms: dict[str, Milliseconds] = {}
    # What answers at the deadline, for every tenant without a fallback of its own.
    fallback: FallbackSettings = FallbackSettings()


class TenantSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One tenant's own thresholds, deadlines and fallback; each one left out (null)
    is the config's own."""

    # Difficulty at or above which the router sends this tenant's requests to the
    # large engine; null: router.threshold.
    router_threshold: float | None = None
    # Calibrated P(correct) that ends the loop for this tenant; null: loop.threshold.
    loop_threshold: Unit | None = None
    # The share of this tenant's semantic hits allowed to be wrong; null:
    # cache.max_false_hit_rate.
    max_false_hit_rate: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    # Cosine similarity this tenant's cached prompts need to be served without a
    # verifier; null: cache.similarity_threshold.
    similarity_threshold: Unit | None = None
    # Per tier (engine name), this tenant's deadline; a tier not listed keeps
    # sla.deadline_ms.
    deadline_ms: dict[str, Milliseconds] = {}
    # This tenant's fallback at the deadline; null: sla.fallback.
    fallback: FallbackSettings | None = None
    # Whether this tenant's streamed hard questions show a provisional first answer
    # from the small engine; null: loop.first_answer.
    first_answer: bool | None = None
    # The share of this tenant's shortcuts checked in the background, for every
    # shortcut; null: shadow.share (needs the shadow section).
    shadow_share: Share | None = None
    # Per shortcut, this tenant's share in place of shadow_share and the shadow
    # section's shares.
    shadow_shares: dict[Shortcut, Share] = {}
    # How many turns after one answered by the large path this tenant's conversations
    # stay there (0: none); null: router.sticky_turns.
    sticky_turns: Annotated[int, msgspec.Meta(ge=0)] | None = None
    # For at most how many seconds after that turn; null: router.sticky_s.
    sticky_s: Annotated[float, msgspec.Meta(gt=0.0)] | None = None


_NO_OVERRIDES = TenantSettings()
_TENANT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def valid_tenant(name: str) -> bool:
    """Whether ``name`` may name a tenant: letters, digits, '_', '-' or '.', 1 to 64 of
    them. A tenant begins each cache namespace key (tenant:model:...), so a colon or a
    wildcard in one could make another tenant's selector match it."""
    return _TENANT_NAME.fullmatch(name) is not None


Sha256 = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]


class KeySettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One API key: who it speaks for, what it may do and how fast."""

    # Hex SHA-256 of the key (`satisfice keys hash` prints it): the key itself need
    # not be in the file. Exactly one of sha256 and env.
    sha256: Sha256 | None = None
    # Or the name of an environment variable holding the key, read and hashed when
    # the config is loaded.
    env: str | None = None
    # The tenant this key's requests belong to: its cache namespace and overrides.
    tenant: str = DEFAULT_TENANT
    # May call /admin/* (a key without it gets 403 there).
    admin: bool = False
    # Requests per minute; one more gets 429 with Retry-After. null: no limit.
    requests_per_minute: Positive | None = None
    # Tokens per minute, charged when a request is admitted: its prompt's estimate
    # plus its max_tokens, so a refusal comes before any work. null: no limit.
    tokens_per_minute: Positive | None = None

    def __post_init__(self) -> None:
        if (self.sha256 is None) == (self.env is None):
            raise ValueError("set exactly one of sha256 and env")


class AuthSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """API keys. With none configured the API is open and every request is tenant
    "default"; with any, /v1/* needs one (401 without)."""

    # API keys by name; the name, never the key, is what logs and metrics show.
    keys: dict[str, KeySettings] = {}
    # Redis URL where per-key rate limits are counted, shared by every replica; null:
    # the cache's Redis when cache.store.kind is redis, else this process alone.
    rate_limit_url: str | None = None
    # While the rate limits' Redis is unavailable (down, or slower than 0.25 s): `open`
    # admits every request unlimited, `local` counts each key's limits in this process
    # alone (each replica allows the whole limit), `closed` refuses limited keys' requests
    # with 503 and Retry-After. Keys without limits are never refused.
    rate_limit_outage: Outage = "open"


class GatewayConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    # Where the HTTP API listens, and the limits on each request.
    server: ServerSettings = ServerSettings()
    # Where weights assembled from packages are kept between starts (~ is expanded).
    models_dir: str = "~/.cache/satisfice/models"
    # Model names clients may ask for, each served by one engine.
    engines: dict[str, EngineSettings]
    # Embeds each prompt once, for the cache and the router.
    embedder: EmbedderSettings = EmbedderSettings()
    # Routes the model name "auto" to a tier by difficulty; without it, no "auto".
    router: RouterSettings | None = None
    # Exact and semantic answers from earlier requests; without it, no cache.
    cache: CacheSettings | None = None
    # Hard questions routed to the large engine think in rounds until confident
    # (needs the router); without it, they get one pass like any other.
    loop: LoopSettings | None = None
    # OpenTelemetry traces over OTLP/HTTP. Null: none, unless the standard
    # OTEL_EXPORTER_OTLP_ENDPOINT (or ..._TRACES_ENDPOINT) is set; this section wins over it.
    telemetry: TelemetrySettings | None = None
    # Deadlines by tier, and what answers when one runs out.
    sla: SLASettings = SLASettings()
    # Per tenant name: thresholds, deadlines and fallback that replace the ones above.
    tenants: dict[str, TenantSettings] = {}
    # API keys, the tenant each speaks for, and their rate limits.
    auth: AuthSettings = AuthSettings()
    # Shadow checks of the gateway's shortcuts, and the outcome store they are kept
    # in; without it, no checks (a tenant's shadow_share needs it).
    shadow: ShadowSettings | None = None

    def __post_init__(self) -> None:
        if not self.engines:
            raise ValueError("at least one engine is required")
        if AUTO_MODEL in self.engines:
            raise ValueError(f"engines.{AUTO_MODEL}: the name is reserved for routed requests")
        self._check_engine_references()
        if self.loop is not None and self.router is None:
            raise ValueError("loop: needs a router, which decides what is hard")
        self._check_tenant_names()
        self._check_deadline_tiers()
        if self.shadow is None:
            for name, own in self.tenants.items():
                if own.shadow_share is not None or own.shadow_shares:
                    raise ValueError(f"tenants.{name}: a shadow share needs the shadow section")
        if self.server.default_max_tokens > self.server.max_tokens_cap:
            raise ValueError("server.default_max_tokens must not exceed server.max_tokens_cap")

    def _check_engine_references(self) -> None:
        """The router's tiers and each engine's fallback name engines that exist."""
        if self.router is not None:
            for tier in (self.router.small_engine, self.router.large_engine):
                if tier not in self.engines:
                    raise ValueError(f"router: engine {tier!r} is not configured under engines")
        for name, engine in self.engines.items():
            if engine.fallback is not None and engine.fallback not in self.engines:
                raise ValueError(f"engines.{name}.fallback: {engine.fallback!r} is not an engine")
            if engine.fallback == name:
                raise ValueError(f"engines.{name}.fallback: an engine cannot be its own fallback")

    def _check_tenant_names(self) -> None:
        # A tenant begins each cache namespace key (tenant:model:...): a colon in its
        # name could make two tenants' keys meet.
        tenant_names = [(f"tenants.{name}", name) for name in self.tenants] + [
            (f"auth.keys.{name}.tenant", key.tenant) for name, key in self.auth.keys.items()
        ]
        for where, name in tenant_names:
            if not _TENANT_NAME.fullmatch(name):
                raise ValueError(
                    f"{where}: tenant {name!r} must be letters, digits, '_', '-' or '.'"
                )

    def _check_deadline_tiers(self) -> None:
        """Every deadline, the SLA's and each tenant's, is for an engine that exists."""
        tiers = [("sla.deadline_ms", t) for t in self.sla.deadline_ms] + [
            (f"tenants.{name}.deadline_ms", t)
            for name, tenant in self.tenants.items()
            for t in tenant.deadline_ms
        ]
        for where, tier in tiers:
            if tier not in self.engines:
                raise ValueError(f"{where}: {tier!r} is not an engine under engines")

    def tenant(self, name: str) -> TenantSettings:
        """The overrides of tenant ``name``; none for a tenant the config does not list."""
        return self.tenants.get(name, _NO_OVERRIDES)

    def deadline_ms(self, tenant: str, tier: str) -> int | None:
        own = self.tenant(tenant).deadline_ms
        return own[tier] if tier in own else self.sla.deadline_ms.get(tier)

    def fallback(self, tenant: str) -> FallbackSettings:
        return self.tenant(tenant).fallback or self.sla.fallback

    def shadow_share(self, tenant: str, shortcut: Shortcut) -> float:
        """The share of ``tenant``'s ``shortcut`` answers checked in the background: the
        most specific setting wins (tenant per shortcut, tenant, shadow per shortcut,
        shadow)."""
        shadow = self.shadow
        if shadow is None:
            return 0.0
        own = self.tenant(tenant)
        if shortcut in own.shadow_shares:
            return own.shadow_shares[shortcut]
        if own.shadow_share is not None:
            return own.shadow_share
        return shadow.share_of(shortcut)


class ConfigError(ValueError):
    """A config that cannot be used; the message says where and why."""


_PATH = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_STEP = re.compile(r"\.([^.\[]+)|\[(\d+|\.\.\.)\]")


def parse_config(text: str | bytes, source: str = "<config>") -> GatewayConfig:
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level, got {raw!r}")
    try:
        return msgspec.convert(raw, GatewayConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {_explain(str(exc), raw, GatewayConfig)}") from exc


def _explain(message: str, raw: Any, kind: Any, prefix: str = "") -> str:
    """Turn msgspec's "Expected X - at `$.a.b`" into "a.b = <value>: Expected X".

    msgspec writes a mapping's key as ``[...]``; to name it, each entry of that
    mapping is validated on its own until the failing one is found.
    """
    match = _PATH.search(message)
    if match is None:
        return f"{prefix.rstrip('.')}: {message}" if prefix else message
    what = message[: match.start()]
    value = raw
    key = prefix
    for step in _STEP.finditer(match.group("path")):
        name, index = step.group(1), step.group(2)
        if index == "...":
            entry_kind = typing.get_args(kind)[1]
            for entry, entry_value in value.items():
                try:
                    msgspec.convert(entry_value, entry_kind)
                except msgspec.ValidationError as inner:
                    return _explain(str(inner), entry_value, entry_kind, f"{key}{entry}.")
            break
        if name is not None:
            kind = _field_type(kind, name)
            key += f"{name}."
        else:
            kind = typing.get_args(kind)[0] if typing.get_args(kind) else Any
            key = f"{key.rstrip('.')}[{index}]."
        try:
            value = value[name if name is not None else int(index)]
        except (KeyError, IndexError, TypeError):
            return f"{key.rstrip('.') or '<top level>'}: {what}"
    return f"{key.rstrip('.') or '<top level>'} = {value!r}: {what}"


def _field_type(kind: Any, name: str) -> Any:
    """The declared type of field ``name`` of a Struct type, unwrapping Optional."""
    for candidate in typing.get_args(kind) or (kind,):
        if isinstance(candidate, type) and issubclass(candidate, msgspec.Struct):
            hints = typing.get_type_hints(candidate, include_extras=True)
            if name in hints:
                hint = hints[name]
                return typing.get_args(hint)[0] if typing.get_origin(hint) is Annotated else hint
    return Any


def load_config(path: str | Path | None = None) -> GatewayConfig:
    """The config at ``path``, or the embedded default when ``path`` is None."""
    if path is None:
        text = resources.files("gateway.config").joinpath("default.yaml").read_text("utf-8")
        return parse_config(text, "embedded default config")
    try:
        text = Path(path).read_text("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from exc
    return parse_config(text, str(path))
