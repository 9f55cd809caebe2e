"""The semantic hits a replica served lately, so a report that one was wrong can name
it by the request id that got it."""

from __future__ import annotations

from collections import OrderedDict

# Semantic hits remembered per replica for feedback by request id: ~150 bytes each.
RECENT_HITS = 50_000


class RecentHits:
    """The last semantic hits this replica served: (tenant, request id) -> (entry id,
    score). Bounded: the oldest is forgotten first."""

    def __init__(self, capacity: int = RECENT_HITS) -> None:
        self.capacity = capacity
        self._hits: OrderedDict[tuple[str, str], tuple[int, float | None]] = OrderedDict()

    def add(self, tenant: str, request_id: str, entry: int, score: float | None) -> None:
        self._hits[(tenant, request_id)] = (entry, score)
        self._hits.move_to_end((tenant, request_id))
        while len(self._hits) > self.capacity:
            self._hits.popitem(last=False)

    def get(self, tenant: str, request_id: str) -> tuple[int, float | None] | None:
        return self._hits.get((tenant, request_id))
