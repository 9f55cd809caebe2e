"""What SREs tune about checking the gateway's shortcuts (the config's ``shadow``), and
the shortcuts it checks (gateway.checks)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

# The shortcuts the gateway takes, each checked against the path it skipped:
# - semantic_hit, exact_hit: a cached answer, against the engine's answer now;
# - small_route: the small engine's answer, against the large path's (the loop when
#   it is on, else one pass of the large engine);
# - early_stop: the loop stopped confident, against the loop run on to its budget;
# - deadline_fallback: the loop's fallback at the deadline, against the loop without one;
# - large_route: not a shortcut but its mirror, the large path's answer against the
#   small engine's, so that a router refitted from the checks learns where the small
#   engine would have done too, not only where it would not.
Shortcut = Literal[
    "semantic_hit", "exact_hit", "small_route", "early_stop", "deadline_fallback", "large_route"
]
SHORTCUTS: tuple[Shortcut, ...] = (
    "semantic_hit",
    "exact_hit",
    "small_route",
    "early_stop",
    "deadline_fallback",
    "large_route",
)

Share = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
Seconds = Annotated[float, msgspec.Meta(gt=0)]


class ShadowSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Shadow checks: a random share of each shortcut answered again in the background
    by the path it skipped, on capacity live requests leave free."""

    # The share of every shortcut checked; `shadow: {share: 0.05}` turns checks on.
    share: Share = 0.0
    # Per shortcut, in place of `share`: semantic_hit, exact_hit, small_route,
    # early_stop, deadline_fallback.
    shares: dict[Shortcut, Share] = {}
    # Checks drawn but not yet started; one more is dropped (and counted).
    max_queue: Annotated[int, msgspec.Meta(ge=1)] = 32
    # Checks running at once.
    concurrency: Annotated[int, msgspec.Meta(ge=1)] = 1
    # Live requests generating at once above which checks wait, and a running check is
    # stopped and dropped: 0 on a host whose engines share its CPU (the embedded
    # default), so a check only ever runs while no live request generates.
    max_live: Annotated[int, msgspec.Meta(ge=0)] = 0
    # A check not started this long after its request settled is dropped: stale.
    max_wait_s: Seconds = 120.0
    # The reference path's deadline.
    timeout_s: Seconds = 300.0
    # The outcome store when the cache is not on Redis: one JSON record per line.
    outcomes_file: str = "~/.local/state/satisfice/outcomes.jsonl"
    # The file is rotated (to <file>.1) past this size.
    outcomes_max_bytes: Annotated[int, msgspec.Meta(ge=4096)] = 256 * 1024 * 1024
    # When the cache is on Redis: records kept in its stream (approximately).
    # (A record keeps at most 4,000 characters of each text: a few KB, ~1 KB typical.)
    stream_max_records: Annotated[int, msgspec.Meta(ge=100)] = 200_000

    def share_of(self, shortcut: Shortcut) -> float:
        return self.shares.get(shortcut, self.share)
