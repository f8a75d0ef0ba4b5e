"""What the simulator consumes: any time-ordered sequence of requests with lengths and a tier.

fleet does not import loadtest (the arrow points the other way): loadtest's ``Workload`` and
``RequestSpec`` satisfy these protocols as they are, and ``SimTraffic`` is a plain holder for
callers that build requests themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class SimRequest(Protocol):
    @property
    def arrival_s(self) -> float: ...
    @property
    def input_tokens(self) -> int: ...
    @property
    def output_tokens(self) -> int: ...
    @property
    def domain(self) -> str: ...
    @property
    def tenant(self) -> str: ...
    @property
    def tier(self) -> str: ...
    @property
    def hash_ids(self) -> tuple[int, ...]: ...  # leading ids shared = a shared prompt prefix


class Traffic(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def specs(self) -> Sequence[SimRequest]: ...  # sorted by arrival_s
    @property
    def duration_s(self) -> float: ...
    @property
    def drift_onsets_s(self) -> tuple[float, ...]: ...


@dataclass(frozen=True, slots=True)
class SimTraffic:
    name: str
    specs: Sequence[SimRequest]
    duration_s: float
    drift_onsets_s: tuple[float, ...] = ()
