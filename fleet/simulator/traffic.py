"""What the simulator consumes: any time-ordered sequence of requests with lengths and a tier.

fleet does not import loadtest (the arrow points the other way): loadtest's ``Workload`` and
``RequestSpec`` satisfy these protocols as they are, and ``SimTraffic`` is a plain holder for
callers that build requests themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kernels.engine import DEFAULT_PREFIX_BLOCK_TOKENS


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


def reusable_prefix_tokens(specs: Sequence[SimRequest], block_tokens: int = DEFAULT_PREFIX_BLOCK_TOKENS) -> list[int]:
    """Per request, the prompt tokens an unbounded prefix cache would serve it: its leading blocks
    whose whole chain of ids an earlier request already sent (what the engines' block cache matches),
    at most all but its last token. What an oracle knows of a window's cache hits before they happen."""
    seen: set[int] = set()
    out = []
    for spec in specs:
        chain, num_reused, leading = 0, 0, True
        for hash_id in spec.hash_ids:
            chain = hash((chain, hash_id))
            if leading and chain in seen:
                num_reused += 1
            else:
                leading = False
                seen.add(chain)
        out.append(min(num_reused * block_tokens, max(0, spec.input_tokens - 1)))
    return out
