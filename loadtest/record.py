"""What the runner measured for one request (the unit of every report)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request's timing, sizes and outcome. Times are seconds; instants are from the run start."""

    index: int
    scheduled_at_s: float
    sent_at_s: float
    ttft_s: float | None  # None when not streamed or no token arrived
    itl_s: tuple[float, ...]  # gaps between successive streamed token chunks
    tpot_s: float | None  # (last token - first token) / (output tokens - 1)
    e2e_s: float | None  # None when no response completed
    input_tokens: int  # as the server's usage reported, else the target
    output_tokens: int
    target_input_tokens: int
    target_output_tokens: int
    status: int  # HTTP status; 0 when no response arrived
    error: str  # "" on success
    tenant: str
    tier: str
    domain: str
    label: str
    stream: bool
    pool: str = ""  # x-polymorph-pool
    replica: str = ""  # x-polymorph-replica
    shape: str = ""  # x-polymorph-shape

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error

    @property
    def lag_s(self) -> float:
        """Scheduling error: how late the request went out versus its schedule."""
        return self.sent_at_s - self.scheduled_at_s

    def to_json(self) -> dict[str, Any]:
        row = asdict(self)
        row["itl_s"] = [round(gap, 6) for gap in self.itl_s]
        return row


def record_from_json(row: dict[str, Any]) -> RequestRecord:
    return RequestRecord(**{**row, "itl_s": tuple(row.get("itl_s", ()))})
