"""The semantic hits a replica served lately, so a report that one was wrong can name
it by the request id that got it."""

from __future__ import annotations

from collections import OrderedDict

# Semantic hits remembered per tenant and replica for feedback by request id: ~150 bytes
# each. Per tenant, so that one tenant's traffic never pushes out another's hits.
RECENT_HITS_PER_TENANT = 20_000


class RecentHits:
    """Each tenant's last semantic hits on this replica: request id -> (entry id, score).
    Bounded per tenant: its oldest is forgotten first. Tenants are the config's (or
    "default"), so their number is bounded too."""

    def __init__(self, capacity: int = RECENT_HITS_PER_TENANT) -> None:
        self.capacity = capacity
        self._hits: dict[str, OrderedDict[str, tuple[int, float | None]]] = {}

    def add(self, tenant: str, request_id: str, entry: int, score: float | None) -> None:
        hits = self._hits.setdefault(tenant, OrderedDict())
        hits[request_id] = (entry, score)
        hits.move_to_end(request_id)
        while len(hits) > self.capacity:
            hits.popitem(last=False)

    def get(self, tenant: str, request_id: str) -> tuple[int, float | None] | None:
        hits = self._hits.get(tenant)
        return None if hits is None else hits.get(request_id)
