"""``polymorph simulate``: drive the fleet's virtual-time simulator with a loadtest scenario or trace.

The simulator (fleet/simulator) takes any request sequence; this driver builds one from loadtest's
scenarios and traces (the arrow points from loadtest to fleet), picks the fleet and prints the result.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path

from fleet.capacity import PerfCapacity
from fleet.compile_sources import CompileSettings, VirtualTimeConfigSource
from fleet.decisions import DecisionLog
from fleet.simulator.run import simulate
from kernels.compiler import Budget, StoreError, TrialStore
from loadtest.spec import Workload

DEFAULT_FLEET = "H100-SXM:8,H200:8"


def parse_fleet(text: str) -> dict[str, int]:
    """``H100-SXM:8,H200:8`` -> {"H100-SXM": 8, "H200": 8}."""
    budget: dict[str, int] = {}
    for part in text.split(","):
        gpu, _, count = part.strip().partition(":")
        if not gpu or not count.isdigit() or int(count) < 1:
            raise ValueError(f"--fleet wants GPU:COUNT pairs separated by commas, got {part!r}")
        budget[gpu] = budget.get(gpu, 0) + int(count)
    return budget


def scale_fleet(budget: Mapping[str, int], num_gpus: int) -> dict[str, int]:
    """Spread ``num_gpus`` over the fleet's GPU kinds in its proportions (each kind keeps at least one)."""
    total = sum(budget.values())
    scaled = {gpu: max(1, round(num_gpus * n / total)) for gpu, n in budget.items()}
    largest = max(scaled, key=lambda g: scaled[g])
    scaled[largest] += num_gpus - sum(scaled.values())
    if scaled[largest] < 1:
        raise ValueError(f"--gpus {num_gpus} is too few for {len(budget)} GPU kinds")
    return scaled


def budget_from_args(args: argparse.Namespace) -> dict[str, int]:
    budget = parse_fleet(args.fleet)
    return scale_fleet(budget, args.gpus) if args.gpus else budget


def stretched_workload(scenario: str, duration_s: float | None, rate_rps: float | None, stretch: float, seed: int | None) -> Workload:
    """A scenario with its time axis stretched ``stretch`` times (phase onsets, periods and bursts move
    out with it) at ``rate_rps``; 1 is the scenario as it ships."""
    from loadtest.scenario import build_workload, load_scenario
    from loadtest.transform import speed_up

    if not stretch > 0:
        raise ValueError(f"--stretch must be > 0, got {stretch}")
    loaded = load_scenario(scenario)
    duration = loaded.duration_s * stretch if duration_s is None else duration_s
    rate = None if rate_rps is None else rate_rps * stretch
    workload = build_workload(loaded, duration_s=duration / stretch, rate_rps=rate, seed=seed)
    return workload if stretch == 1 else speed_up(workload, 1 / stretch)


def load_workload(args: argparse.Namespace) -> Workload:
    from loadtest.traces import read_trace

    if args.trace:
        return read_trace(args.trace, args.format)
    return stretched_workload(args.scenario, args.duration, args.rate, args.stretch, args.seed)


def main_simulate(args: argparse.Namespace) -> int:
    try:
        budget = budget_from_args(args)
        workload = load_workload(args)
    except (ValueError, OSError) as exc:
        print(f"polymorph simulate: {exc}", file=sys.stderr)
        return 2
    capacity = PerfCapacity(args.model, None if args.no_cache else Path(args.capacity_cache))
    log = DecisionLog(Path(args.decisions) if args.decisions else None)
    if args.compile == "off":
        result = simulate(workload, args.policy, budget, capacity, args.model, log)
    else:
        if args.compile_trials < 1 or args.compile_s_per_trial < 0:
            print("polymorph simulate: --compile-trials must be >= 1 and --compile-s-per-trial >= 0", file=sys.stderr)
            return 2
        settings = CompileSettings(args.model, evaluator=args.compile, budget=Budget(trials=args.compile_trials))
        try:
            store = TrialStore(args.compile_store or ":memory:")
        except StoreError as exc:
            print(f"polymorph simulate: {exc}", file=sys.stderr)
            return 2
        with store:
            configs = VirtualTimeConfigSource(settings, store, args.compile_s_per_trial)
            result = simulate(workload, args.policy, budget, capacity, args.model, log, configs=configs)
    if args.json:
        print(json.dumps(result.to_json(), sort_keys=True))
    else:
        for key, value in result.to_json().items():
            print(f"{key:>24}  {value}")
    return 0
