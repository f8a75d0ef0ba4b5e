"""The workload value objects every producer emits and every consumer reads.

A workload is a deterministic, time-ordered sequence of ``RequestSpec``. Trace readers, the
parametric generators and scenarios produce it; the live runner replays it over HTTP and the
virtual-time simulator will consume the very same objects, so nothing here does network I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from kernels.traces import RowIssue

TIERS: tuple[str, ...] = ("interactive", "standard", "batch")
DEFAULT_TENANT = "default"
DEFAULT_TIER = "standard"
DEFAULT_DOMAIN = "chat"
HASH_BLOCK_TOKENS = 512  # Mooncake: one hash id per 512-token block of the prompt


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request to send: when (seconds from the workload start), how big, and who for."""

    arrival_s: float
    input_tokens: int
    output_tokens: int
    domain: str = DEFAULT_DOMAIN
    tenant: str = DEFAULT_TENANT
    tier: str = DEFAULT_TIER
    hash_ids: tuple[int, ...] = ()  # equal leading ids = a shared prompt prefix (512-token blocks)
    text: str | None = None  # the prompt itself; None = drawn from the shipped corpus at send time
    label: str = ""  # the workload class that made it (scenario stream/class, trace name): for mix plots


@dataclass(frozen=True, slots=True)
class Workload:
    """A named, time-ordered request sequence plus what the reports need to explain it."""

    name: str
    specs: tuple[RequestSpec, ...]
    duration_s: float
    drift_onsets_s: tuple[float, ...] = ()
    issues: tuple[RowIssue, ...] = ()

    @property
    def num_requests(self) -> int:
        return len(self.specs)

    @property
    def target_rate_rps(self) -> float:
        """Mean offered rate over the workload's duration (0 for an empty or instantaneous one)."""
        return len(self.specs) / self.duration_s if self.duration_s > 0 else 0.0


def make_workload(
    name: str,
    specs: list[RequestSpec] | tuple[RequestSpec, ...],
    duration_s: float | None = None,
    drift_onsets_s: tuple[float, ...] = (),
    issues: tuple[RowIssue, ...] = (),
) -> Workload:
    """Sort by arrival (stable, so equal times keep their order) and default the duration to the last arrival."""
    ordered = tuple(sorted(specs, key=lambda spec: spec.arrival_s))
    if duration_s is None:
        duration_s = ordered[-1].arrival_s if ordered else 0.0
    return Workload(name, ordered, float(duration_s), tuple(drift_onsets_s), tuple(issues))

