"""``polymorph bench adapt --metric capacity``: each policy's capacity at SLO on every workload, and GPUs saved.

For every scenario (and ``--trace``) and every policy: the highest load multiplier whose run keeps
the SLO threshold overall, per tier and per phase/window (loadtest/capacity.py, one simulated run per
point, the same seed at every point), then the smallest fleet (the same GPU kinds in their
proportions) with which the policy sustains the workload's nominal rate. The adaptive policy's
capacity is given over each other policy's; "GPUs saved" is the other policy's smallest fleet minus
adaptive's. One capacity model serves every run, as in the goodput bench; with ``--workers`` above 1 the
searches run in that many processes, each search with its own model over the shared on-disk cache (whose
answers do not depend on who computed them, so the figures are the same as in one process).
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from tqdm import tqdm

from fleet.capacity import CapacityModel
from kernels.traces import report_skipped_rows
from loadtest.capacity import CapacityResult, CurvePoint, smallest_passing
from loadtest.simulate import (
    CapacitySettings,
    WorkloadSource,
    budget_from_args,
    capacity_from_args,
    capacity_of,
    in_processes,
    judge,
    scale_fleet,
    scenario_source,
    sim_capacity_settings,
    trace_source,
)

FLEET_SEARCH_FACTOR = 2  # look for the smallest sustaining fleet up to this many times the given one


@dataclass(frozen=True, slots=True)
class PolicyCapacity:
    workload: str
    policy: str
    result: CapacityResult
    min_gpus: int | None  # smallest fleet sustaining the nominal rate; None: not found (or not searched)
    wall_s: float

    @property
    def num_dropped(self) -> int:
        return sum(point.attainment.num_dropped for point in self.result.curve)


def smallest_fleet(source: WorkloadSource, policy: str, budget: Mapping[str, int], capacity: CapacityModel, model: str,
                   settings: CapacitySettings, at_budget: CurvePoint | None) -> int | None:
    """Fewest GPUs (``budget``'s kinds in its proportions) whose run at the nominal rate passes; the
    capacity search's point at multiplier 1 already answers for ``budget`` itself."""
    total = sum(budget.values())
    known: dict[int, bool] = {} if at_budget is None else {total: at_budget.passed}

    def passes(num_gpus: int) -> bool:
        if num_gpus not in known:
            fleet = scale_fleet(budget, num_gpus)
            known[num_gpus] = judge(source, policy, fleet, capacity, model, settings)(1.0, source.seed).worst >= settings.threshold
        return known[num_gpus]

    if passes(total):
        return smallest_passing(passes, len(budget), total)
    return smallest_passing(passes, total + 1, FLEET_SEARCH_FACTOR * total)


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b > 0 else None


def _sources(args: argparse.Namespace, scenarios: tuple[str, ...], duration_s: float) -> list[WorkloadSource]:
    sources = [scenario_source(name, duration_s, args.rate, args.stretch, args.seed) for name in scenarios]
    return sources + [trace_source(path, args.format, args.speedup, None) for path in args.trace]


def _search(args: argparse.Namespace, source: WorkloadSource, policy: str, capacity: CapacityModel,
            on_point: Callable[[CurvePoint], None] = lambda point: None) -> PolicyCapacity:
    """One policy's capacity on one workload, then (unless ``--no-fleet-search``) its smallest fleet."""
    begun = time.perf_counter()
    settings, budget = sim_capacity_settings(args), budget_from_args(args)
    result = capacity_of(source, policy, budget, capacity, args.model, settings, on_point)
    at_one = next((p for p in result.curve if p.multiplier == 1.0), None)
    min_gpus = None if args.no_fleet_search else smallest_fleet(source, policy, budget, capacity, args.model, settings, at_one)
    return PolicyCapacity(source.name, policy, result, min_gpus, time.perf_counter() - begun)


def _search_in_worker(args: argparse.Namespace, scenarios: tuple[str, ...], duration_s: float, index: int,
                      policy: str, progress: queue.Queue[str]) -> tuple[PolicyCapacity, int]:
    """``_search`` in a worker process (a workload source holds a closure, so the worker builds its own):
    the row and its capacity model's evaluations; each point's verdict goes to ``progress``."""
    capacity = capacity_from_args(args)
    source = _sources(args, scenarios, duration_s)[index]
    label = f"{source.name} {policy}"
    return _search(args, source, policy, capacity, lambda point: progress.put(_verdict(label, point))), capacity.num_evaluations


def _verdict(label: str, point: CurvePoint) -> str:
    return f"{label} x{point.multiplier:.3g} {'pass' if point.passed else 'fail'}"


def _rows(args: argparse.Namespace, scenarios: tuple[str, ...], duration_s: float, sources: list[WorkloadSource],
          policies: tuple[str, ...], bar: tqdm) -> Iterator[tuple[PolicyCapacity, int]]:
    """Each (workload, policy) search with the evaluations it cost, in table order, each as soon as it is
    done; the progress bar names the last point judged."""
    jobs = [(index, source, policy) for index, source in enumerate(sources) for policy in policies]
    if args.workers <= 1:
        capacity = capacity_from_args(args)
        for _, source, policy in jobs:
            label = f"{source.name} {policy}"
            bar.set_postfix_str(label)
            before = capacity.num_evaluations
            row = _search(args, source, policy, capacity, lambda point, label=label: bar.set_postfix_str(_verdict(label, point)))
            yield row, capacity.num_evaluations - before
        return
    yield from in_processes(_search_in_worker, [(args, scenarios, duration_s, index, policy) for index, _, policy in jobs],
                            args.workers, bar.set_postfix_str)


def main_capacity(args: argparse.Namespace, scenarios: tuple[str, ...], policies: tuple[str, ...]) -> int:
    started = time.perf_counter()
    duration = 240.0 if args.quick else args.duration
    scenarios = scenarios[:2] if args.quick else scenarios
    try:
        settings = sim_capacity_settings(args)
        budget = budget_from_args(args)
        sources = _sources(args, scenarios, duration)
    except (ValueError, OSError) as exc:
        print(f"polymorph bench adapt: {exc}", file=sys.stderr)
        return 2
    for path, source in zip(args.trace, sources[len(scenarios):], strict=True):  # once: workers read the traces again
        report_skipped_rows(path, source.issues)
    out = sys.stderr if args.json else sys.stdout
    print(f"{'workload':<14} {'policy':<17} {'capacity x':>10} {'req/s':>8} {'points':>6} {'min GPUs':>8} {'dropped':>7} "
          f"{'wall s':>7}  note", file=out, flush=True)
    bar = tqdm(total=len(sources) * len(policies), unit="search", desc="capacity", file=sys.stderr,
               disable=args.no_progress, leave=False)
    rows: list[PolicyCapacity] = []
    num_evaluations = 0
    for row, evaluations in _rows(args, scenarios, duration, sources, policies, bar):
        rows.append(row)
        num_evaluations += evaluations
        bar.update(1)
        gpus = "-" if row.min_gpus is None else str(row.min_gpus)
        result = row.result
        bar.clear()
        print(f"{row.workload:<14} {row.policy:<17} {result.multiplier:10.3f} {result.rate_rps:8.2f} {len(result.curve):6d} "
              f"{gpus:>8} {row.num_dropped:7d} {row.wall_s:7.1f}  {result.note}", file=out, flush=True)
    bar.close()
    summary = _summary(args, budget, duration, settings, sources, rows)
    summary["wall_s"] = round(time.perf_counter() - started, 1)
    summary["capacity_evaluations"] = num_evaluations
    print(json.dumps(summary, sort_keys=True))
    return 0


def _summary(args: argparse.Namespace, budget: Mapping[str, int], duration_s: float, settings: CapacitySettings,
             sources: list[WorkloadSource], rows: list[PolicyCapacity]) -> dict[str, object]:
    summary: dict[str, object] = {
        "metric": "capacity", "fleet": dict(budget), "rate_rps": args.rate, "duration_s": duration_s, "stretch": args.stretch,
        "model": args.model, "slo_threshold": settings.threshold, "resolution": settings.resolution, "draws": settings.draws,
        "fleet_search": not args.no_fleet_search,
    }
    for source in sources:
        by_policy = {row.policy: row for row in rows if row.workload == source.name}
        entry: dict[str, object] = {
            "nominal_rate_rps": round(source.nominal_rate_rps, 3),
            "capacity_rps": {p: round(r.result.rate_rps, 3) for p, r in by_policy.items()},
            "capacity_multiplier": {p: round(r.result.multiplier, 4) for p, r in by_policy.items()},
            "notes": {p: r.result.note for p, r in by_policy.items() if r.result.note},
            "min_gpus": {p: r.min_gpus for p, r in by_policy.items()},
            "dropped": sum(r.num_dropped for r in by_policy.values()),
        }
        adaptive = by_policy.get("adaptive")
        if adaptive is not None:
            entry["adaptive_over"] = {p: _ratio(adaptive.result.rate_rps, r.result.rate_rps)
                                      for p, r in by_policy.items() if p != "adaptive"}
            if adaptive.min_gpus is not None:
                entry["gpus_saved_by_adaptive"] = {p: r.min_gpus - adaptive.min_gpus for p, r in by_policy.items()
                                                   if p != "adaptive" and r.min_gpus is not None}
        summary[source.name] = entry
    return summary
