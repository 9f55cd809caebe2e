"""The front door of a chat request, one for both ways in: the express path (exact hits
at hand, before the web framework) and the framework's handler. Either opens the
request's ``Exchange`` and admits it here, by the same steps in the same order: the
request's headers, the body's checks and the settings resolved (``admit``), then the
key's rate limit (``charge``).

A request the express path admits but does not answer goes on to the handler with its
exchange and admission (``handed``): it is neither admitted nor charged twice.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

import msgspec

from gateway.api.headers import read_headers
from gateway.api.validate import chat_request
from gateway.api.wire import ChatCompletionRequest
from gateway.config import GatewayConfig
from gateway.ops import logs
from gateway.ops.keys import Caller
from gateway.pipeline.exchange import Exchange
from gateway.pipeline.request import ChatRequest
from gateway.pipeline.request_policy import Policy, resolve
from gateway.runtime import Runtime

# The request state's key for a request admitted by the express path, handed on.
HANDED: Final = "satisfice_handed"


class Admitted(msgspec.Struct, frozen=True):
    """A chat request let in: in the pipeline's terms, with its settings."""

    chat: ChatRequest
    policy: Policy
    trace: bool  # the decision trace in a plain answer's body
    reasoning: bool  # the loop's reasoning in a plain answer's message


def open_exchange(
    runtime: Runtime,
    *,
    tenant: str,
    model: str,
    key: str | None,
    started: float | None = None,
) -> Exchange:
    """A chat request's exchange: it settles into ``runtime``'s settlement."""
    return Exchange(
        runtime.settlement,
        tenant=tenant,
        model=model,
        key=key,
        request_id=logs.request_id.get(),
        started=started,
        policy=runtime.policy_version,
    )


def admit(
    runtime: Runtime,
    config: GatewayConfig,
    caller: Caller,
    data: ChatCompletionRequest,
    headers: Mapping[str, str],
    exchange: Exchange,
) -> Admitted:
    """The request checked, with its settings; raises the ``APIError`` that the client
    is answered with. Then, for a key with limits, ``charge``."""
    asked = read_headers(headers)
    chat = chat_request(data, runtime.engines, runtime.router is not None, config.server)
    policy = resolve(
        config,
        caller.tenant,
        arrived=exchange.started,
        asked_deadline_ms=asked.deadline_ms,
        control=asked.cache,
        conversation=asked.conversation or user_conversation(data, config),
        asked_first_answer=asked.first_answer,
    )
    exchange.admitted(chat, policy)
    return Admitted(chat, policy, asked.trace, asked.reasoning)


async def charge(
    runtime: Runtime, config: GatewayConfig, caller: Caller, chat: ChatRequest
) -> None:
    """The admitted request charged to its key's rate limit (a key with limits only:
    the check is a coroutine, which a key without them does not pay for); raises the
    rate limiter's refusal."""
    assert caller.limits is not None
    cost = chat.prompt_tokens + chat.params.max_tokens
    await runtime.limiter.admit(
        caller.key or "", caller.limits, cost, config.auth.rate_limit_outage
    )


def user_conversation(data: ChatCompletionRequest, config: GatewayConfig) -> str | None:
    """The OpenAI ``user`` field names a conversation only where the config says so: it
    is an end user's id, and one user may ask two questions at once."""
    return data.user if config.server.user_is_conversation else None
