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
    __slots__ = ("_replicas", "max_ids")

    def __init__(self, max_ids: int = DEFAULT_MAX_IDS) -> None:
        if max_ids < 1:
            raise ValueError(f"max_ids must be at least 1, got {max_ids}")
        self.max_ids = max_ids
        self._replicas: OrderedDict[str, str] = OrderedDict()

    def remember(self, response_id: str, replica: str) -> None:
        self._replicas[response_id] = replica
        self._replicas.move_to_end(response_id)
        if len(self._replicas) > self.max_ids:
            self._replicas.popitem(last=False)

    def replica_of(self, response_id: str) -> str | None:
        """The replica holding ``response_id``, or None when this process does not know it."""
        replica = self._replicas.get(response_id)
        if replica is not None:
            self._replicas.move_to_end(response_id)  # a conversation in use stays
        return replica

    def __len__(self) -> int:
        return len(self._replicas)
