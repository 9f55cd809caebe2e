"""A chat request as the pipeline takes it: checked against the config's limits by the
HTTP layer, in the engines' terms, with nothing of HTTP left in it."""

from __future__ import annotations

import msgspec

from engines.base import Message, SamplingParams, last_user_turn


class ChatRequest(msgspec.Struct, frozen=True, kw_only=True):
    model: str  # an engine's name, or "auto" for the router to choose
    messages: tuple[Message, ...]
    # Each message's `name` (a participant's), in order: the engines are not told them,
    # but no cached answer crosses from one name to another.
    names: tuple[str | None, ...] = ()
    # What the engine samples with, defaults filled in: the cache keys answers on
    # exactly these, so no answer is served to a request that samples otherwise.
    params: SamplingParams
    include_usage: bool  # a stream ends with a usage chunk
    # The answer as it comes (a stream), or whole: a plain answer is asked of the
    # engine whole, and crosses the gateway in one step rather than one per token.
    stream: bool = False
    # The prompt's size by the gateway's estimate (UTF-8 bytes / 4): what rate limits
    # charge before the engine has counted.
    prompt_tokens: int

    @property
    def last_user_turn(self) -> str:
        """What the cache and the router compare: the last user turn (else the last turn)."""
        return last_user_turn(self.messages) or self.messages[-1].content
