"""The router's part of the config."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

BUNDLED_ROUTER = "bundled"


class RouterSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    # "bundled" (fitted for the bundled models) or a file from `satisfice router fit`.
    model_file: str = BUNDLED_ROUTER
    # Overrides the threshold stored in the model file (`satisfice router calibrate`
    # prints one for a target share of large-model traffic or a target quality).
    threshold: Annotated[float, msgspec.Meta(ge=0.0)] | None = None
    # Engines that serve each tier; both must be configured under `engines`.
    small_engine: str = "small"
    # The large tier's engine: hard questions, and the loop when there is one.
    large_engine: str = "large"
    # Labelled examples shown with a decision on /v1/route.
    explain_neighbours: Annotated[int, msgspec.Meta(ge=0, le=50)] = 5
    # Once a conversation's turn is answered by the large path (routed there, or
    # escalated from the small engine), its next sticky_turns turns stay there; 0: each
    # turn is routed on its own.
    sticky_turns: Annotated[int, msgspec.Meta(ge=0)] = 0
    # For at most this many seconds after the turn that escalated.
    sticky_s: Annotated[float, msgspec.Meta(gt=0.0)] = 900.0
    # What makes requests one conversation for that: "header" (the
    # x-satisfice-conversation header, or `user` with server.user_is_conversation), or
    # "first_turn": also the same system prompt and first user turn, which every later
    # turn of a chat sends again.
    sticky_by: Literal["header", "first_turn"] = "header"
