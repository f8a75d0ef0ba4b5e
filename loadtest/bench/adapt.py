"""``polymorph bench adapt``: every named scenario x every fleet policy in virtual time, one table, one JSON line.

Every run plans with the same capacity model, so every policy is planned with the same predictions (with
``--workers`` above 1 each run has its own, over the shared on-disk cache: the same answers). The
defaults (see fleet/README.md for why) size the fleet so that drift-step's
post-drift mix needs most of it at its SLO: 4 H100 + 4 H200 for llama-3.1-8b, the scenarios' time
stretched 2x (drift-step's change lands at 600 s, the end of static-initial's planning window) and
run for 1800 s. ``--quick`` runs two scenarios for 240 s on a small fleet (for tests).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator

from fleet.simulator.policies import POLICIES
from fleet.simulator.run import SimResult, simulate
from kernels.catalog import get_model
from loadtest.scenario import builtin_names, load_scenario
from loadtest.simulate import budget_from_args, capacity_from_args, in_processes, scenario_rate_rps, stretched_workload

NAMED = ("stationary", "drift-step", "drift-ramp", "diurnal", "flash-crowd", "tenant-mix")


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b > 0 else None


def main_bench(args: argparse.Namespace) -> int:
    scenarios = NAMED if args.scenarios is None else tuple(s for s in args.scenarios.split(",") if s)
    unknown = [s for s in scenarios if s not in builtin_names()]
    if unknown:
        print(f"polymorph bench adapt: unknown scenarios {unknown}", file=sys.stderr)
        return 2
    if not scenarios and not (args.metric == "capacity" and args.trace):
        print("polymorph bench adapt: --scenarios '' leaves nothing to run (with --metric capacity, give --trace)", file=sys.stderr)
        return 2
    if args.draws != 1 and args.metric != "capacity":
        print("polymorph bench adapt: --draws judges the points of --metric capacity; a goodput run is one draw", file=sys.stderr)
        return 2
    policies = tuple(args.policies.split(",")) if args.policies else POLICIES
    problem = _argument_problem(args, scenarios, policies)
    if problem:
        print(f"polymorph bench adapt: {problem}", file=sys.stderr)
        return 2
    if args.metric == "capacity":
        from loadtest.bench.adapt_capacity import main_capacity

        return main_capacity(args, scenarios, policies)
    budget = budget_from_args(args)
    duration = 240.0 if args.quick else args.duration
    scenarios = scenarios[:2] if args.quick else scenarios
    results: dict[str, dict[str, SimResult]] = {}
    print(f"{'scenario':<12} {'policy':<17} {'goodput':>8} {'post-drift':>10} {'SLO%':>6} {'ttft p99':>9} {'tpot p99':>9} "
          f"{'moves':>5} {'recomp':>6} {'shed':>6} {'drop':>5} {'wall s':>7}")
    num_evaluations = 0
    for name, policy, r, evaluations in _runs(args, scenarios, policies, duration):
        results.setdefault(name, {})[policy] = r
        num_evaluations += evaluations
        print(f"{name:<12} {policy:<17} {r.goodput_rps:8.2f} {r.post_drift_goodput_rps:10.2f} {100 * r.slo_attainment:6.1f} "
              f"{r.ttft_p99_s:9.2f} {r.tpot_p99_s:9.3f} {r.repartitions:5d} {r.recompiles:6d} {r.shed_requests:6d} {r.dropped_requests:5d} "
              f"{r.wall_s:7.1f}", flush=True)
    summary: dict[str, object] = {"fleet": budget, "rate_rps": args.rate, "duration_s": duration, "stretch": args.stretch, "model": args.model}
    for name, by_policy in results.items():
        entry: dict[str, object] = {"goodput_rps": {p: round(r.goodput_rps, 3) for p, r in by_policy.items()},
                                    "shed": {p: r.shed_requests for p, r in by_policy.items()},
                                    "dropped": sum(r.dropped_requests for r in by_policy.values())}
        adaptive = by_policy.get("adaptive")
        if adaptive is not None:
            entry["adaptive_over"] = {p: _ratio(adaptive.goodput_rps, r.goodput_rps) for p, r in by_policy.items() if p != "adaptive"}
            entry["post_drift_adaptive_over"] = {p: _ratio(adaptive.post_drift_goodput_rps, r.post_drift_goodput_rps)
                                                 for p, r in by_policy.items() if p != "adaptive"}
        summary[name] = entry
    summary["capacity_evaluations"] = num_evaluations
    print(json.dumps(summary, sort_keys=True))
    return 0


def _argument_problem(args: argparse.Namespace, scenarios: tuple[str, ...], policies: tuple[str, ...]) -> str | None:
    """What is wrong with the flags every run reads, found before the first run rather than inside one
    (a worker's error would end the bench in a traceback), by the checks the runs themselves make."""
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        return f"unknown policies {unknown} (choose from {', '.join(POLICIES)})"
    try:
        get_model(args.model)
        budget_from_args(args)
        for name in scenarios:
            scenario_rate_rps(load_scenario(name), 240.0 if args.quick else args.duration, args.rate, args.stretch)
    except ValueError as exc:
        return str(exc)
    return None


def _run_in_worker(args: argparse.Namespace, scenario: str, policy: str, duration_s: float) -> tuple[SimResult, int]:
    """One run in a worker process: its result and its capacity model's evaluations."""
    capacity = capacity_from_args(args)
    workload = stretched_workload(load_scenario(scenario), duration_s, args.rate, args.stretch, args.seed)
    return simulate(workload, policy, budget_from_args(args), capacity, args.model), capacity.num_evaluations


def _runs(args: argparse.Namespace, scenarios: tuple[str, ...], policies: tuple[str, ...],
          duration_s: float) -> Iterator[tuple[str, str, SimResult, int]]:
    """Each (scenario, policy) run with the evaluations it cost, in table order, each as soon as it is done."""
    if args.workers <= 1:
        capacity, budget = capacity_from_args(args), budget_from_args(args)
        for name in scenarios:
            workload = stretched_workload(load_scenario(name), duration_s, args.rate, args.stretch, args.seed)
            for policy in policies:
                before = capacity.num_evaluations
                result = simulate(workload, policy, budget, capacity, args.model)
                yield name, policy, result, capacity.num_evaluations - before
        return
    jobs = [(args, name, policy, duration_s) for name in scenarios for policy in policies]
    for (_, name, policy, _), (result, evaluations) in zip(jobs, in_processes(_run_in_worker, jobs, args.workers), strict=True):
        yield name, policy, result, evaluations
