"""Fault injection for the emulated replica: what can go wrong, and which request it hits.

A ``FaultSpec`` is set from CLI flags at start-up and replaced live through
``POST /_emulator/faults`` (a JSON object of the fields to change; ``{"reset": true}`` clears all).
``FaultPlan`` decides per request, from a seeded generator and a request counter, so a test that
sends the same requests sees the same faults.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace

CRASH_MODES = ("cut", "exit")


@dataclass(frozen=True, slots=True)
class FaultSpec:
    """Faults to inject. Durations < 0 mean "forever"; None counts mean "never"."""

    fail_after_requests: int | None = None  # inference requests after the Nth are answered error_status
    error_rate: float = 0.0  # fraction of inference requests answered error_status
    error_status: int = 503
    slowdown: float = 1.0  # engine iterations take this many times longer
    hang_before_first_byte_s: float = 0.0  # wait this long before answering at all
    stall_after_tokens: int | None = None  # a stream pauses after this many tokens...
    stall_s: float = 0.0  # ...for this long
    crash_after_tokens: int | None = None  # a stream dies after this many tokens...
    crash_mode: str = "cut"  # ...by cutting its connection ("cut") or exiting the process ("exit")
    refuse_connections_s: float = 0.0  # close the listening socket for this long
    health_status: int = 200  # what GET /health answers
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("fail_after_requests", "stall_after_tokens", "crash_after_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"fault {name} must be a non-negative integer or null, got {value!r}")
        if not 0.0 <= self.error_rate <= 1.0:
            raise ValueError(f"fault error_rate must be in [0, 1], got {self.error_rate}")
        if not 100 <= self.health_status <= 599:
            raise ValueError(f"fault health_status must be an HTTP status, got {self.health_status}")
        if not 400 <= self.error_status <= 599:  # a 200 "error" would be counted a success with no body an engine sends
            raise ValueError(f"fault error_status must be an HTTP error status (400-599), got {self.error_status}")
        if (self.stall_after_tokens is None) != (self.stall_s == 0.0):  # half a stall does nothing: say so
            raise ValueError("fault stall_s and stall_after_tokens go together (a stall of stall_s seconds after "
                             f"stall_after_tokens tokens), got stall_s={self.stall_s} and stall_after_tokens={self.stall_after_tokens}")
        if not (self.slowdown > 0.0 and math.isfinite(self.slowdown)):
            raise ValueError(f"fault slowdown must be a positive number, got {self.slowdown}")
        if self.crash_mode not in CRASH_MODES:
            raise ValueError(f"fault crash_mode must be one of {CRASH_MODES}, got {self.crash_mode!r}")

    @classmethod
    def from_dict(cls, values: Mapping[str, object], base: FaultSpec | None = None) -> FaultSpec:
        """``base`` with the given fields replaced; ``{"reset": true}`` starts from no faults."""
        start = FaultSpec() if base is None or values.get("reset") else base
        known = {f.name: f.type for f in fields(cls)}
        changes: dict[str, object] = {}
        for key, value in values.items():
            if key == "reset":
                continue
            if key not in known:
                raise ValueError(f"unknown fault {key!r}; known: {', '.join(known)}")
            changes[key] = _coerce(key, str(known[key]), value)
        return replace(start, **changes)  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _coerce(key: str, type_text: str, value: object) -> object:
    if value is None:
        if "None" not in type_text:
            raise ValueError(f"fault {key} may not be null")
        return None
    if type_text.startswith("int"):
        if isinstance(value, bool) or not isinstance(value, int | float) or int(value) != value:
            raise ValueError(f"fault {key} must be an integer, got {value!r}")
        return int(value)
    if type_text == "float":
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"fault {key} must be a number, got {value!r}")
        return float(value)
    if not isinstance(value, str):
        raise ValueError(f"fault {key} must be a string, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class RequestFault:
    """What happens to one inference request (decided when it arrives)."""

    error_status: int | None
    hang_s: float
    stall_after_tokens: int | None
    stall_s: float
    crash_after_tokens: int | None
    crash_mode: str


class FaultPlan:
    """The live spec plus the counter and generator that pick the requests it hits."""

    __slots__ = ("spec", "num_requests", "_rng")

    def __init__(self, spec: FaultSpec) -> None:
        self.spec = spec
        self.num_requests = 0
        self._rng = random.Random(spec.seed)

    def replace_spec(self, spec: FaultSpec) -> None:
        """New faults; counting (for fail_after_requests) and the error draws restart."""
        self.spec = spec
        self.num_requests = 0
        self._rng = random.Random(spec.seed)

    def on_request(self) -> RequestFault:
        spec = self.spec
        self.num_requests += 1
        error_status: int | None = None
        if spec.fail_after_requests is not None and self.num_requests > spec.fail_after_requests or spec.error_rate > 0.0 and self._rng.random() < spec.error_rate:
            error_status = spec.error_status
        return RequestFault(
            error_status=error_status,
            hang_s=spec.hang_before_first_byte_s,
            stall_after_tokens=spec.stall_after_tokens,
            stall_s=spec.stall_s,
            crash_after_tokens=spec.crash_after_tokens,
            crash_mode=spec.crash_mode,
        )
