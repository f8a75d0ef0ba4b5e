"""Compiled configurations for the planner: envelopes, the config-source contract, decisions.

The configuration compiler (kernels.compiler) searches the engine configuration for one traffic
shape; the planner needs one per pool shape, and must not search while it plans. So the planner asks
a ``ConfigSource`` for the best *known* configuration of a shape's **envelope** on a GPU kind (a
lookup) and, when none is known yet, submits a compile and plans with the fixed candidates meanwhile
(``fleet.capacity.choose_config``); the controller adopts the result at the next plan it makes once
the source reports it ready.

An envelope is what a compile is valid for: the shape's equal-mass length points (fleet.lengths)
snapped to a half-octave grid, and the SLO it is held to. A pool keeps its envelope while every point
of its live traffic stays within half an octave of the envelope's point (hysteresis: a point can
wander a quarter octave past its grid cell before it leaves), so a wobble reuses the compiled result
and a real change asks for a new one, which the compiler warm-starts from the nearest stored shapes.
The offered rate is not part of an envelope: the compiler maximises goodput per GPU under the SLO,
which does not depend on the offered rate; the planner answers the rate with replica counts.

Everything here is deterministic and does no I/O; the sources that read the trial store and run
compiles live at the edge (``fleet.compile_sources``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from fleet.capacity import length_points
from fleet.decisions import Decision
from fleet.evidence import CompiledEvidence, CompileEvidence
from fleet.telemetry import ShapeLoad
from kernels.compiler.shape import TrafficShape
from kernels.config import EngineConfig
from kernels.tiers import TierSlo

STEPS_PER_OCTAVE = 2  # the envelope grid: a half-octave (x1.41) step
TOLERANCE_OCTAVES = 0.5  # a live point further than this from the envelope's point leaves it


def snap_half_octave(tokens: int) -> int:
    return max(1, round(2 ** (round(STEPS_PER_OCTAVE * math.log2(max(1, tokens))) / STEPS_PER_OCTAVE)))


@dataclass(frozen=True, slots=True)
class Envelope:
    """The traffic a compiled configuration is valid for (see the module docstring)."""

    prompt_points: tuple[int, ...]
    output_points: tuple[int, ...]
    ttft_p99_s: float
    tpot_p99_s: float
    tier: str

    def contains(self, load: ShapeLoad, slo: TierSlo) -> bool:
        prompts, outputs = length_points(load)
        if (slo.ttft_p99_s, slo.tpot_p99_s) != (self.ttft_p99_s, self.tpot_p99_s):
            return False
        if len(prompts) != len(self.prompt_points) or len(outputs) != len(self.output_points):
            return False
        pairs = [*zip(prompts, self.prompt_points), *zip(outputs, self.output_points)]
        return all(abs(math.log2(live / mine)) <= TOLERANCE_OCTAVES for live, mine in pairs)

    def traffic_shape(self, name: str) -> TrafficShape:
        """The shape the compiler optimises for. Built from the envelope alone, so every window in
        the envelope has the same shape fingerprint (and finds the same stored result)."""
        return TrafficShape(name, self.prompt_points, self.output_points, ttft_p99_s=self.ttft_p99_s,
                            tpot_p99_s=self.tpot_p99_s, tier=self.tier)

    def to_json(self) -> dict[str, object]:
        return {"prompt_points": list(self.prompt_points), "output_points": list(self.output_points),
                "ttft_p99_s": self.ttft_p99_s, "tpot_p99_s": self.tpot_p99_s, "tier": self.tier}


def tier_name(slo: TierSlo, tiers: Mapping[str, TierSlo]) -> str:
    """The name of the tier ``strictest`` took its priority from (a label for the compiled shape)."""
    return next((name for name, t in sorted(tiers.items()) if t.priority == slo.priority), "standard")


def envelope_for(load: ShapeLoad, slo: TierSlo, tier: str, previous: Envelope | None = None) -> Envelope:
    """``previous`` while the load stays inside it, else the load's own envelope."""
    if previous is not None and previous.contains(load, slo):
        return previous
    prompts, outputs = length_points(load)
    return Envelope(tuple(snap_half_octave(p) for p in prompts), tuple(snap_half_octave(o) for o in outputs),
                    slo.ttft_p99_s, slo.tpot_p99_s, tier)


@dataclass(frozen=True, slots=True)
class CompiledConfig:
    """A compiler result for (GPU kind, envelope), as the planner and the decision log need it."""

    gpu: str
    envelope: Envelope
    config: EngineConfig
    predicted_goodput_rps: float  # per replica, on the compiler's evaluator
    baseline_goodput_rps: float  # sglang's defaults on the same evaluator
    evaluator: str
    trials: int  # evaluations this compile ran (0: found in the trial store)
    warm_start: bool
    run_id: str
    trial_ids: tuple[int, ...]  # the run's rows in the trial store
    reason: str
    submitted_at: float
    ready_at: float

    @property
    def predicted_gain(self) -> float:
        return self.predicted_goodput_rps / self.baseline_goodput_rps if self.baseline_goodput_rps > 0 else math.inf


class ConfigSource(Protocol):
    """Compiled configurations per (GPU kind, envelope), for one model on one-GPU replicas.

    ``best`` answers from what the source already holds (no search); ``submit`` asks for a compile
    and returns at once (a repeated submit of the same envelope is ignored); ``ready`` hands over the
    compiles finished since its last call. ``now`` is the caller's clock (virtual in the simulator)."""

    def best(self, gpu: str, envelope: Envelope, now: float) -> CompiledConfig | None: ...

    def submit(self, gpu: str, envelope: Envelope, shape: str, now: float) -> None: ...

    def ready(self, now: float) -> list[CompiledConfig]: ...


def compile_submitted(now: float, pool: str, gpu: str, envelope: Envelope, previous: Envelope | None) -> Decision:
    if previous is None:
        why = "first plan for this pool"
    elif previous == envelope:
        why = "no compiled configuration for this envelope yet"
    else:
        why = "the shape's lengths or SLO left the envelope its configuration was compiled for"
    return Decision(now, CompileEvidence(pool=pool, gpu=gpu, envelope=envelope.to_json(),
                                         previous_envelope=None if previous is None else previous.to_json(), reason=why))


def compile_ready(now: float, pool: str, found: CompiledConfig, old_config: EngineConfig | None) -> Decision:
    return Decision(now, CompiledEvidence(
        pool=pool, gpu=found.gpu, envelope=found.envelope.to_json(),
        old_config=None if old_config is None else config_changes(old_config), new_config=config_changes(found.config),
        predicted_goodput_rps=round(found.predicted_goodput_rps, 3),
        baseline_goodput_rps=round(found.baseline_goodput_rps, 3), predicted_gain=round(found.predicted_gain, 3),
        evaluator=found.evaluator, trials=found.trials, warm_start=found.warm_start, run_id=found.run_id,
        trial_ids=found.trial_ids, submitted_at=found.submitted_at, reason=found.reason))


def config_changes(config: EngineConfig) -> dict[str, object]:
    """The knobs that differ from sglang's defaults (what a pool's config JSON and the log carry)."""
    default = EngineConfig().to_dict()
    return {k: v for k, v in config.to_dict().items() if v != default[k]}
