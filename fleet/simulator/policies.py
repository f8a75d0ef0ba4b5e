"""The five fleet policies the simulator compares, built on the same planner and capacity model.

* ``round-robin``: one pool of every GPU with sglang's default configuration, least-load routing
  straight into the engines (no tier queues or shedding: what most deployments run today).
* ``static-initial``: the best partition and configurations for every minute of the first 10 minutes
  (the first half of runs shorter than 20 minutes), then frozen. Planned for each minute's demand, not
  the 10 minutes' mean, as every plan is: on tenant-mix the mean calls for a reasoning replica, the
  minutes for two more batch replicas, which is static-hindsight's partition.
* ``static-hindsight``: the best single partition for every minute of the run at once (it knows the
  future; the planner maximises the goodput summed over all windows).
* ``adaptive``: starts like static-initial, then Polymorph's controller (drift, plan, rollout, verify).
* ``oracle``: at every window start, re-plans for that window's true mix and swaps replicas at once
  (no drain, no restart; the old engines finish their in-flight requests off the books).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fleet.capacity import CapacityModel
from fleet.commands import apply
from fleet.compile_sources import VirtualTimeConfigSource
from fleet.compiled import ConfigSource
from fleet.controller import Controller, ControllerSettings, initial_slots
from fleet.decisions import Decision, DecisionLog
from fleet.evidence import PlanEvidence
from fleet.lengths import length_bin
from fleet.options import MoveCost, Options, pool_options, problem_for
from fleet.planner import fill_budget, plan
from fleet.rollout import SlotState, diff_moves
from fleet.simulator.world import FleetSim
from fleet.telemetry import TrafficMix, mix_from_counts
from kernels.tiers import TierSlo

POLICIES = ("round-robin", "static-initial", "static-hindsight", "adaptive", "oracle")
INITIAL_WINDOW_S = 600.0
WINDOW_S = 60.0


def true_mix(sim: FleetSim, start_s: float, end_s: float) -> TrafficMix:
    """The mix the workload really sends in ``[start_s, end_s)`` (what an oracle knows), with the
    same length histograms telemetry keeps and the prefix share an unbounded cache would reach."""
    counts: dict[str, list[Any]] = {}
    bins: dict[str, tuple[dict[int, int], dict[int, int]]] = {}
    specs, shapes, reusable = sim.specs, sim.shapes, sim.reusable_tokens
    for index in range(bisect_left(sim.arrivals_s, start_s), bisect_left(sim.arrivals_s, end_s)):
        spec, shape = specs[index], shapes[index]
        entry = counts.setdefault(shape, [0, 0.0, 0.0, 0, {}, 0.0, 0.0])
        entry[0] += 1
        entry[1] += spec.input_tokens
        entry[2] += spec.output_tokens
        entry[3] += 1
        entry[4][spec.tier] = entry[4].get(spec.tier, 0) + 1
        entry[5] += reusable[index]
        entry[6] += spec.input_tokens
        prompt_bins, output_bins = bins.setdefault(shape, ({}, {}))
        for hist, tokens in ((prompt_bins, spec.input_tokens), (output_bins, spec.output_tokens)):
            k = length_bin(tokens)
            hist[k] = hist.get(k, 0) + 1
    return mix_from_counts(end_s, end_s - start_s, {k: tuple(v) for k, v in counts.items()}, bins)


def minutes(sim: FleetSim, start_s: float, end_s: float) -> tuple[TrafficMix, ...]:
    """The true mix of every ``WINDOW_S`` of ``[start_s, end_s)``: the demand a plan made for that span serves."""
    return tuple(true_mix(sim, t, min(end_s, t + WINDOW_S)) for t in np.arange(start_s, end_s, WINDOW_S))


def initial_window_s(duration_s: float) -> float:
    return min(INITIAL_WINDOW_S, duration_s / 2)


def _deploy(sim: FleetSim, options: Options, mix: TrafficMix, counts: Mapping[str, int]) -> list[SlotState]:
    sim.set_pool_model(options, mix)
    slots = initial_slots(counts, options)
    sim.deploy(slots)
    return slots


def _plan_for(mixes: tuple[TrafficMix, ...], profile: TrafficMix, budget: Mapping[str, int],
              capacity: CapacityModel, tiers: Mapping[str, TierSlo],
              configs: ConfigSource | None = None) -> tuple[Options, dict[str, int]]:
    options = pool_options(profile.shapes, tuple(sorted(budget)), capacity, tiers, configs)
    problem = problem_for(options, mixes, budget)
    found = plan(problem)
    if found is None:
        raise ValueError(f"no allocation of {dict(budget)} fits the pool options")
    return options, fill_budget(problem, found).replicas()


def setup(
    policy: str, sim: FleetSim, budget: Mapping[str, int], capacity: CapacityModel,
    tiers: Mapping[str, TierSlo], log: DecisionLog, move_cost: MoveCost,
    configs: VirtualTimeConfigSource | None = None,
) -> Controller | None:
    """Deploy the policy's starting fleet on ``sim`` and hook its control loop to the ticks. With
    ``configs`` every policy but round-robin runs compiled configurations: plans made before the run
    (and the oracle's) get them at once, the adaptive controller when its compiles are done."""
    duration = sim.workload.duration_s
    offline = None if configs is None else configs.at_once()
    if policy == "round-robin":
        sim.settings.admission = False
        slots = [SlotState(f"{gpu}/{k}", "all", gpu, "{}") for gpu, n in sorted(budget.items()) for k in range(n)]
        sim.deploy(slots)
        return None
    first = true_mix(sim, 0.0, initial_window_s(duration))
    if policy == "static-hindsight":
        whole = true_mix(sim, 0.0, duration)
        options, counts = _plan_for(minutes(sim, 0.0, duration), whole, budget, capacity, tiers, offline)
        _deploy(sim, options, whole, counts)
        return None
    options, counts = _plan_for(minutes(sim, 0.0, initial_window_s(duration)), first, budget, capacity, tiers, offline)
    _deploy(sim, options, first, counts)
    if policy == "static-initial":
        return None
    if policy == "oracle":
        _hook_oracle(sim, budget, capacity, tiers, log, offline)
        return None
    if policy != "adaptive":
        raise ValueError(f"unknown policy {policy!r} (choose from {', '.join(POLICIES)})")
    model = sim.settings.model
    settings = ControllerSettings(model, dict(budget), dict(tiers), move_cost=move_cost)
    controller = Controller(settings, sim.telemetry, capacity, first, configs)
    if configs is not None:
        controller.options = options  # the start's envelopes: a wobble around them does not recompile
    sim.settings.restart_s = lambda gpu, config: move_cost.restart_s(model, gpu, config)

    def tick(now: float) -> None:
        out = controller.tick(now, sim.slot_states(now))
        log.extend(out.decisions)
        apply(out.commands, sim, now)
        if controller.options is not None:
            sim.set_pool_model(controller.options, controller.reference_mix)

    sim.on_tick = tick
    return controller


def profile_span_s(now: float, onsets_s: Sequence[float]) -> tuple[float, float]:
    """The span whose lengths and tiers size the oracle's pools for the window starting at ``now``: 5
    minutes around it (one minute's sample is too noisy to size a pool by, and would miss the capacity
    cache on every window), cut at the workload's drift onsets on either side (the oracle knows them).
    A span across an onset averages two mixes: on flash-crowd at x3.36 the span at 240 s held the
    burst's first 20 s, short-chat prompts read 836 tokens instead of 1,136, and the oracle gave
    short-chat three H200s where it needed four (minutes 240-360 read 86% and 81%)."""
    start, end = max(0.0, now - 2 * WINDOW_S), now + 3 * WINDOW_S
    for onset in onsets_s:
        if start < onset <= now:
            start = onset
        elif now < onset < end:
            end = onset
    return start, end


class OracleState:
    def __init__(self) -> None:
        self.num_repartitions = 0
        self.next_plan_at = WINDOW_S


def _hook_oracle(sim: FleetSim, budget: Mapping[str, int], capacity: CapacityModel,
                 tiers: Mapping[str, TierSlo], log: DecisionLog, configs: ConfigSource | None = None) -> None:
    """Every window, the best plan for the next window's true mix, swapped in at once (no drain, no
    restart: the limit any real controller can approach)."""
    state = OracleState()
    sim.oracle = state  # type: ignore[attr-defined]

    def tick(now: float) -> None:
        if now < state.next_plan_at or now >= sim.workload.duration_s:
            return
        state.next_plan_at = now + WINDOW_S
        window = true_mix(sim, now, now + WINDOW_S)
        if not window.shapes:
            return
        profile = true_mix(sim, *profile_span_s(now, sim.workload.drift_onsets_s))
        options, counts = _plan_for((window,), profile, budget, capacity, tiers, configs)
        sim.set_pool_model(options, profile)
        pool_to_gpu = {p.name: p.gpu for p in options.pools}
        slots = sim.slot_states(now)
        moves = diff_moves(slots, counts, pool_to_gpu, options.configs_json())
        if moves:
            state.num_repartitions += 1
            before = {pool: sum(s.pool == pool for s in slots) for pool in {s.pool for s in slots} | set(counts)}
            diff = {pool: (n, counts.get(pool, 0)) for pool, n in sorted(before.items()) if n != counts.get(pool, 0)}
            log.append(Decision(now, PlanEvidence(outcome="oracle", diff=diff), tuple(moves)))
            for move in moves:
                sim.swap(move.slot, move.to_pool, move.config_json, now)

    sim.on_tick = tick
