"""Run one policy on one traffic in virtual time and summarise it (the drivers live in loadtest/)."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import numpy as np

from fleet.capacity import CapacityModel
from fleet.compile_sources import VirtualTimeConfigSource
from fleet.decisions import DecisionLog
from fleet.options import MoveCost
from fleet.simulator.policies import setup
from fleet.simulator.traffic import Traffic
from fleet.simulator.world import FleetSim, Outcomes, SimSettings, nan_percentile
from fleet.telemetry import Telemetry
from kernels.tiers import DEFAULT_TIERS

DEFAULT_MODEL = "llama-3.1-8b"


@dataclass(frozen=True, slots=True)
class SimResult:
    scenario: str
    policy: str
    num_gpus: int
    duration_s: float
    num_requests: int
    goodput_rps: float
    post_drift_goodput_rps: float  # after the workload's last drift onset (the whole run if none)
    slo_attainment: float
    throughput_tokens_s: float
    ttft_p99_s: float
    tpot_p99_s: float
    repartitions: int
    recompiles: int
    dropped_requests: int
    shed_requests: int  # refused with 429 before any token (not good, no GPU time): capacity was short
    unfinished_requests: int
    num_decisions: int
    num_events: int
    wall_s: float

    def to_json(self) -> dict[str, object]:
        return {k: (round(v, 4) if isinstance(v, float) and math.isfinite(v) else v) for k, v in asdict(self).items()}


def simulate(
    workload: Traffic,
    policy: str,
    budget: Mapping[str, int],
    capacity: CapacityModel,
    model: str = DEFAULT_MODEL,
    log: DecisionLog | None = None,
    move_cost: MoveCost | None = None,
    configs: VirtualTimeConfigSource | None = None,
) -> SimResult:
    return simulate_outcomes(workload, policy, budget, capacity, model, log, move_cost, configs)[0]


def simulate_outcomes(
    workload: Traffic,
    policy: str,
    budget: Mapping[str, int],
    capacity: CapacityModel,
    model: str = DEFAULT_MODEL,
    log: DecisionLog | None = None,
    move_cost: MoveCost | None = None,
    configs: VirtualTimeConfigSource | None = None,
) -> tuple[SimResult, Outcomes]:
    """``simulate`` plus the per-request outcomes (index-aligned with ``workload.specs``), for callers
    that judge attainment per tier or per window (loadtest/capacity.py)."""
    started = time.perf_counter()
    log = log if log is not None else DecisionLog()
    sim = FleetSim(SimSettings(model), workload, Telemetry())
    controller = setup(policy, sim, budget, capacity, dict(DEFAULT_TIERS), log, move_cost or MoveCost(), configs)
    sim.run(workload.duration_s)
    return _summarise(sim, policy, budget, log, controller, time.perf_counter() - started), sim.outcomes


def _summarise(sim: FleetSim, policy: str, budget: Mapping[str, int], log: DecisionLog, controller: object, wall_s: float) -> SimResult:
    workload, out = sim.workload, sim.outcomes
    arrivals = np.array([s.arrival_s for s in workload.specs])
    tokens = np.array([s.input_tokens + s.output_tokens for s in workload.specs])
    outputs = np.array([s.output_tokens for s in workload.specs])
    first = out.first_at
    ttft = first - arrivals + out.overhead_s
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(outputs > 1, (out.finished_at - first) / np.maximum(outputs - 1, 1), 0.0)
    done = np.isfinite(out.finished_at)
    duration = workload.duration_s
    onset = workload.drift_onsets_s[-1] if workload.drift_onsets_s else 0.0
    late = arrivals >= onset
    repartitions: int | None = getattr(controller, "num_repartitions", None)
    if repartitions is None:
        repartitions = getattr(getattr(sim, "oracle", None), "num_repartitions", 0)
    return SimResult(
        scenario=workload.name, policy=policy, num_gpus=sum(budget.values()), duration_s=duration,
        num_requests=len(workload.specs),
        goodput_rps=float(out.met_slo.sum()) / duration,
        post_drift_goodput_rps=float(out.met_slo[late].sum()) / max(duration - onset, 1e-9),
        slo_attainment=float(out.met_slo.mean()) if len(workload.specs) else 1.0,
        throughput_tokens_s=float(tokens[done].sum()) / duration,
        ttft_p99_s=nan_percentile(ttft[done], 99), tpot_p99_s=nan_percentile(tpot[done], 99),
        repartitions=int(repartitions), recompiles=int(getattr(controller, "num_recompiles", 0)),
        dropped_requests=out.num_dropped, shed_requests=out.num_shed,
        unfinished_requests=int(len(workload.specs) - done.sum() - out.num_dropped - out.num_shed),
        num_decisions=sum(log.kind_to_count.values()), num_events=sim.loop.num_events, wall_s=wall_s,
    )
