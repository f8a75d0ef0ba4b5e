"""Which replica produced each Responses id this gateway process proxied, so a follow-up finds it.

An engine keeps a stored response in its own memory: a request naming ``previous_response_id`` can
only be answered by the replica that produced it. The map is bounded (least recently used first
out) and per process; an id it does not hold (another ``--workers`` process or gateway host proxied it,
or it fell out of the map) is looked up among the replicas (``gateway.response_lookup``) and then kept.
"""

from __future__ import annotations

from collections import OrderedDict

DEFAULT_MAX_IDS = 100_000


class ResponseIds:
    """Each id's replica, and the tenant whose request made it where this process proxied that request:
    another tenant naming it is answered as if it did not exist. An id found by asking the replicas
    (another process proxied it) has no known owner here; sglang's and vLLM's ids are random UUIDs."""

    __slots__ = ("_entries", "max_ids")

    def __init__(self, max_ids: int = DEFAULT_MAX_IDS) -> None:
        if max_ids < 1:
            raise ValueError(f"max_ids must be at least 1, got {max_ids}")
        self.max_ids = max_ids
        self._entries: OrderedDict[str, tuple[str, str | None]] = OrderedDict()

    def remember(self, response_id: str, replica: str, tenant: str | None) -> None:
        """``tenant``: the owner, or None when this process did not see the request that made it."""
        owner = tenant if response_id not in self._entries else self._entries[response_id][1]
        self._entries[response_id] = (replica, owner)  # a lookup by another tenant never takes ownership
        self._entries.move_to_end(response_id)
        if len(self._entries) > self.max_ids:
            self._entries.popitem(last=False)

    def replica_of(self, response_id: str) -> str | None:
        """The replica holding ``response_id``, or None when this process does not know it."""
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        self._entries.move_to_end(response_id)  # a conversation in use stays
        return entry[0]

    def owned_by_another(self, response_id: str, tenant: str) -> bool:
        """True when this process proxied the request that made ``response_id`` for a tenant other than ``tenant``."""
        entry = self._entries.get(response_id)
        return entry is not None and entry[1] is not None and entry[1] != tenant

    def __len__(self) -> int:
        return len(self._entries)
