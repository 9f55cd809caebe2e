"""How a base model (no chat template) sees a conversation."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from engines.base import Message

# Short factual few-shot examples: enough for a base model to answer in one line
# and then start the next "Question:", which the stop sequence cuts off.
DEFAULT_PREAMBLE = (
    "Question: What is 7 plus 5?\nAnswer: 12\n\n"
    "Question: What is the capital of France?\nAnswer: Paris\n\n"
    "Question: Is the sun a star?\nAnswer: Yes\n\n"
)


class CompletionTemplate(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A few-shot completion prompt: ``preamble``, then each turn in its role's format.

    Each format takes ``{content}``. The prompt ends with ``generation_prefix`` and the
    model continues from there until a ``stop`` sequence.
    """

    # Text before the conversation: the few-shot examples.
    preamble: str = DEFAULT_PREAMBLE
    # Format of a system (or developer) turn.
    system: str = "{content}\n\n"
    # Format of a user (or tool) turn.
    user: str = "Question: {content}\n"
    # Format of an assistant turn; a conversation that ends in one continues it.
    assistant: str = "Answer: {content}\n\n"
    # The end of the prompt, which the model's answer continues.
    generation_prefix: str = "Answer:"
    # Sequences that end the answer (left out of it), besides the request's own.
    stop: tuple[str, ...] = ("\nQuestion:", "\n\n")

    def render(self, messages: Sequence[Message]) -> str:
        """The prompt text; a conversation that ends in an assistant turn continues
        that turn (a prefill), so the model picks up where its text leaves off."""
        parts = [self.preamble]
        continuing = continues(messages)
        for message in messages[:-1] if continuing else messages:
            fmt = {
                "system": self.system,
                "developer": self.system,
                "user": self.user,
                "tool": self.user,
                "assistant": self.assistant,
            }[message.role]
            parts.append(fmt.replace("{content}", message.content))
        if continuing:
            opening = self.assistant.split("{content}", 1)[0]
            parts.append(opening + messages[-1].content)
        else:
            parts.append(self.generation_prefix)
        return "".join(parts)


def continues(messages: Sequence[Message]) -> bool:
    """Whether a conversation asks to continue its last (assistant) turn."""
    return bool(messages) and messages[-1].role == "assistant"
