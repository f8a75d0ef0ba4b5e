"""``polymorph simulate``: drive the fleet's virtual-time simulator with a loadtest scenario or trace.

The simulator (fleet/simulator) takes any request sequence; this driver builds one from loadtest's
scenarios and traces (the arrow points from loadtest to fleet), picks the fleet and prints the result.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import queue
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO, TypeVar

import numpy as np

from fleet.capacity import CapacityModel, PerfCapacity
from fleet.compile_sources import CompileSettings, VirtualTimeConfigSource
from fleet.decisions import DecisionLog
from fleet.simulator.run import simulate, simulate_outcomes
from kernels.catalog import get_gpu, get_model
from kernels.compiler import Budget, StoreError, TrialStore
from kernels.traces import RowIssue, report_skipped_rows
from loadtest.arrivals import check_arrivals
from loadtest.capacity import (
    DEFAULT_MAX_POINTS,
    DEFAULT_RESOLUTION,
    DEFAULT_THRESHOLD,
    Attainment,
    CapacityResult,
    CurvePoint,
    attainment_of,
    over_draws,
    phase_bounds_s,
    search_capacity,
    window_bounds_s,
)
from loadtest.spec import Workload

if TYPE_CHECKING:
    from loadtest.scenario import Scenario

DEFAULT_FLEET = "H100-SXM:8,H200:8"
# The longest run the simulator takes: its controller ticks every 5 fleet seconds, and every tick is an event
# queued at the start (518k here). Before, `--stretch 1e9` queued 3.6e11 of them and ended in a MemoryError.
MAX_SIMULATED_S = 30 * 86_400.0


def parse_fleet(text: str) -> dict[str, int]:
    """``H100:8,H200:8`` -> {"H100-SXM": 8, "H200": 8}: each kind by its catalog name, so that an alias and
    its name are one kind (before, ``H100:2,H100-SXM:3`` planned two kinds of the same GPU)."""
    budget: dict[str, int] = {}
    for part in text.split(","):
        gpu, _, count = part.strip().partition(":")
        if not gpu or not count.isdigit() or int(count) < 1:
            raise ValueError(f"--fleet wants GPU:COUNT pairs separated by commas, got {part!r}")
        name = get_gpu(gpu).name  # an unknown kind is refused here, with the known ones, not deep in a run
        budget[name] = budget.get(name, 0) + int(count)
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
    return budget if args.gpus is None else scale_fleet(budget, args.gpus)


def capacity_from_args(args: argparse.Namespace) -> PerfCapacity:
    """The capacity model of ``--model``, over ``--capacity-cache`` unless ``--no-cache``; ValueError for
    a model the catalog does not know (the model itself is read at the first evaluation)."""
    get_model(args.model)
    return PerfCapacity(args.model, None if args.no_cache else Path(args.capacity_cache))


_Result = TypeVar("_Result")
_PROGRESS_POLL_S = 0.5  # how long in_processes waits for a worker's progress before it looks at the job again


def in_processes(run: Callable[..., _Result], jobs: Sequence[tuple[Any, ...]], num_workers: int,
                 on_progress: Callable[[Any], None] | None = None) -> Iterator[_Result]:
    """``run(*job)`` for every job in ``num_workers`` processes, yielded in the jobs' order, each as soon as it
    and those before it are done. Spawned (a fork would copy the caller's threads: the progress bar's);
    an error or Ctrl-C kills the workers rather than waiting out their runs.

    With ``on_progress``, each run gets one more argument, a queue: what a worker puts there (anything
    picklable) reaches ``on_progress`` in this thread while it waits, so a long job shows its steps, not
    only its end."""
    from kernels.compiler.worker import terminate_process_pool

    pool = concurrent.futures.ProcessPoolExecutor(max_workers=num_workers, mp_context=multiprocessing.get_context("spawn"))
    manager = multiprocessing.get_context("spawn").Manager() if on_progress is not None else None
    progress = manager.Queue() if manager is not None else None

    def relay(wait_s: float) -> None:  # hand on what has arrived, waiting up to wait_s for the first
        assert progress is not None and on_progress is not None
        try:
            on_progress(progress.get(timeout=wait_s))
            while True:
                on_progress(progress.get_nowait())
        except queue.Empty:
            pass

    try:
        futures = [pool.submit(run, *job, *(() if progress is None else (progress,))) for job in jobs]
        for future in futures:
            while progress is not None and not future.done():
                relay(_PROGRESS_POLL_S)
            result = future.result()
            if progress is not None:
                relay(0.0)
            yield result
    except BaseException:
        terminate_process_pool(pool)
        raise
    finally:
        if manager is not None:
            manager.shutdown()
    pool.shutdown()


def stretched_workload(scenario: Scenario, duration_s: float | None, rate_rps: float | None, stretch: float, seed: int | None) -> Workload:
    """A scenario with its time axis stretched ``stretch`` times (phase onsets, periods and bursts move
    out with it) at ``rate_rps``; 1 is the scenario as it ships."""
    from loadtest.scenario import build_workload
    from loadtest.transform import speed_up

    duration = _stretched_duration_s(scenario, duration_s, stretch)
    rate = None if rate_rps is None else rate_rps * stretch
    workload = build_workload(scenario, duration_s=duration / stretch, rate_rps=rate, seed=seed)
    return workload if stretch == 1 else speed_up(workload, 1 / stretch)


def scenario_rate_rps(scenario: Scenario, duration_s: float | None, rate_rps: float | None, stretch: float) -> float:
    """The mean rate ``stretched_workload`` aims at (fleet req/s): ``rate_rps``, or the scenario's own
    rate spread over its stretched time axis."""
    duration = _stretched_duration_s(scenario, duration_s, stretch)
    if rate_rps is not None and not rate_rps > 0:
        raise ValueError(f"--rate must be > 0 req/s, got {rate_rps:g}")
    rate = rate_rps if rate_rps is not None else scenario.mean_rate_rps(duration / stretch) / stretch
    check_arrivals(rate, duration)  # a capacity search's first point, refused before the search rather than in it
    return rate


def _stretched_duration_s(loaded: Scenario, duration_s: float | None, stretch: float) -> float:
    """Fleet seconds of traffic: ``duration_s``, else the scenario's own stretched ``stretch`` times."""
    if not stretch > 0:
        raise ValueError(f"--stretch must be > 0, got {stretch:g}")
    if duration_s is not None and not duration_s > 0:
        raise ValueError(f"--duration must be > 0 s, got {duration_s:g}")
    return _simulable(loaded.duration_s * stretch if duration_s is None else duration_s)


def _simulable(duration_s: float) -> float:
    """``duration_s``, or ValueError past ``MAX_SIMULATED_S``."""
    if duration_s > MAX_SIMULATED_S:
        raise ValueError(f"the workload spans {duration_s:.4g} s of fleet time; a simulated run spans at most "
                         f"{MAX_SIMULATED_S:,.0f} s (30 days): shorten it (--duration, --stretch, --speedup)")
    return duration_s


def trace_workload(path: str, trace_format: str, speedup: float | None, rate_rps: float | None) -> Workload:
    """A trace, time-compressed ``speedup`` times or to a mean of ``rate_rps`` (loadtest.transform, as the
    load tester replays it): the same requests in the same order, inter-arrival gaps scaled, so its
    burstiness and mix are kept."""
    from loadtest.traces import read_trace
    from loadtest.transform import scale_to_rate, speed_up

    if speedup is not None and rate_rps is not None:
        raise ValueError("give a trace --speedup or --rate, not both")
    workload = read_trace(path, trace_format)
    if speedup is not None:
        workload = speed_up(workload, speedup)
    elif rate_rps is not None:
        workload = scale_to_rate(workload, rate_rps)
    _simulable(workload.duration_s)
    return workload


@dataclass(frozen=True, slots=True)
class WorkloadSource:
    """A scenario or trace at any load multiplier: ``build(multiplier, seed)``; 1 is ``nominal_rate_rps``.

    A scenario is generated again at the multiplied rate over the same duration (its phases stay put);
    a trace is time-compressed by the multiplier (the same requests, closer together)."""

    name: str
    nominal_rate_rps: float
    seed: int
    is_trace: bool
    build: Callable[[float, int], Workload]
    issues: tuple[RowIssue, ...] = ()  # a trace's skipped rows, for the command to report once

    def __post_init__(self) -> None:
        # A trace whose requests all arrive at one instant spans no time: no rate to multiply, and nothing
        # for the simulator to play (its plans are made on ticks over the time the workload spans).
        if not self.nominal_rate_rps > 0:
            raise ValueError(f"{self.name} has no rate to simulate or multiply: it is empty, or all its requests arrive at one instant")


def scenario_source(scenario: str, duration_s: float | None, rate_rps: float | None, stretch: float, seed: int | None) -> WorkloadSource:
    from loadtest.scenario import load_scenario

    loaded = load_scenario(scenario)  # read once: every point of a search plays the same scenario
    nominal = scenario_rate_rps(loaded, duration_s, rate_rps, stretch)
    seed = loaded.seed if seed is None else seed
    return WorkloadSource(Path(scenario).stem, nominal, seed, False,
                          # at 1 the rate as given (None: the scenario's own), so plain runs repeat earlier figures
                          lambda multiplier, s: stretched_workload(loaded, duration_s, rate_rps if multiplier == 1 else nominal * multiplier, stretch, s))


def trace_source(path: str, trace_format: str, speedup: float | None, rate_rps: float | None) -> WorkloadSource:
    return trace_at_any_rate(trace_workload(path, trace_format, speedup, rate_rps), Path(path).name, 0)


def trace_at_any_rate(base: Workload, name: str, seed: int) -> WorkloadSource:
    """``base`` (a trace, as read and compressed) time-compressed by each multiplier, the load tester's
    and the simulator's alike."""
    from loadtest.transform import speed_up

    return WorkloadSource(name, base.target_rate_rps, seed, True, lambda multiplier, _: base if multiplier == 1 else speed_up(base, multiplier),
                          base.issues)


def source_from_args(args: argparse.Namespace) -> WorkloadSource:
    if args.trace:
        return trace_source(args.trace, args.format, args.speedup, args.rate)
    if args.speedup is not None:
        raise ValueError("--speedup applies to traces; scale a scenario with --rate or --stretch")
    return scenario_source(args.scenario, args.duration, args.rate, args.stretch, args.seed)


def load_workload(args: argparse.Namespace) -> Workload:
    source = source_from_args(args)
    return source.build(1.0, source.seed)


def run_attainment(workload: Workload, is_trace: bool, policy: str, budget: Mapping[str, int],
                   capacity: CapacityModel, model: str) -> Attainment:
    """One simulated run judged overall, per tier, and per scenario phase or per 5-minute trace window."""
    _, outcomes = simulate_outcomes(workload, policy, budget, capacity, model)
    arrivals = np.array([spec.arrival_s for spec in workload.specs])
    if is_trace:
        bounds, kind = window_bounds_s(workload.duration_s), "window"
    else:
        bounds, kind = phase_bounds_s(workload.duration_s, workload.drift_onsets_s), "phase"
    judged = attainment_of(arrivals, [spec.tier for spec in workload.specs], outcomes.met_slo, bounds, kind)
    return replace(judged, num_dropped=outcomes.num_dropped)


@dataclass(frozen=True, slots=True)
class CapacitySettings:
    threshold: float = DEFAULT_THRESHOLD
    resolution: float = DEFAULT_RESOLUTION
    max_points: int = DEFAULT_MAX_POINTS
    draws: int = 1  # the simulator's: seeds each point pools (a trace replays the same requests: one)


def capacity_settings(args: argparse.Namespace) -> CapacitySettings:
    if not args.slo_threshold > 0:  # 0 would pass every point (argparse keeps it within 0 to 1)
        raise ValueError("--slo-threshold must be in (0, 1]")
    return CapacitySettings(args.slo_threshold, args.resolution, args.max_points)


def sim_capacity_settings(args: argparse.Namespace) -> CapacitySettings:
    """``capacity_settings`` and the simulator's ``--draws`` (a scenario's seeds per point)."""
    return replace(capacity_settings(args), draws=args.draws)


def judge(source: WorkloadSource, policy: str, budget: Mapping[str, int], capacity: CapacityModel, model: str,
          settings: CapacitySettings) -> Callable[[float, int], Attainment]:
    """One point's attainment: the simulated run at ``multiplier`` from ``seed``, pooled over the
    settings' draws for a scenario (a trace replays the same requests, so it is one draw)."""
    def one(multiplier: float, seed: int) -> Attainment:
        return run_attainment(source.build(multiplier, seed), source.is_trace, policy, budget, capacity, model)

    return over_draws(one, 1 if source.is_trace else settings.draws)


def capacity_of(source: WorkloadSource, policy: str, budget: Mapping[str, int], capacity: CapacityModel, model: str,
                settings: CapacitySettings, on_point: Callable[[CurvePoint], None] = lambda point: None) -> CapacityResult:
    """The policy's capacity at SLO on ``budget``: every point the same seeds, only the load differs."""
    return search_capacity(
        judge(source, policy, budget, capacity, model, settings),
        source.nominal_rate_rps, source.seed, settings.threshold, settings.resolution, max_points=settings.max_points,
        on_point=on_point,
    )


def print_curve(result: CapacityResult, out: TextIO = sys.stdout) -> None:
    print(f"{'multiplier':>10} {'req/s':>8} {'overall %':>9} {'worst %':>8}  {'pass':<4}  binding", file=out)
    for point in result.curve:
        a = point.attainment
        print(f"{point.multiplier:10.4g} {point.rate_rps:8.2f} {100 * a.overall:9.1f} {100 * a.worst:8.1f}  "
              f"{'yes' if point.passed else 'no':<4}  {a.binding}", file=out)
    print(f"capacity at SLO >= {result.threshold:g}: {result.multiplier:.4g}x = {result.rate_rps:.2f} req/s "
          f"(nominal {result.nominal_rate_rps:.2f} req/s, resolution {result.resolution:g})"
          + (f"; {result.note}" if result.note else ""), file=out)


def _main_capacity(args: argparse.Namespace, budget: Mapping[str, int], capacity: CapacityModel) -> int:
    try:
        settings = sim_capacity_settings(args)
        source = source_from_args(args)
        if source.is_trace and settings.draws > 1:
            raise ValueError("a trace replays the same requests, so it has one draw: --draws applies to scenarios")
    except (ValueError, OSError) as exc:
        print(f"polymorph simulate: {exc}", file=sys.stderr)
        return 2
    report_skipped_rows(args.trace, source.issues)

    def progress(point: CurvePoint) -> None:
        print(f"polymorph simulate: x{point.multiplier:.4g} ({point.rate_rps:.2f} req/s): worst attainment "
              f"{100 * point.attainment.worst:.1f}% ({point.attainment.binding}) {'pass' if point.passed else 'fail'}",
              file=sys.stderr, flush=True)

    result = capacity_of(source, args.policy, budget, capacity, args.model, settings, progress)
    if args.json:
        print(json.dumps({"workload": source.name, "policy": args.policy, "fleet": dict(budget), "draws": settings.draws,
                          **result.to_json()}, sort_keys=True))
    else:
        print_curve(result)
    return 0


def main_simulate(args: argparse.Namespace) -> int:
    if args.capacity and (args.compile != "off" or args.decisions):
        print("polymorph simulate: --capacity runs without --compile and --decisions", file=sys.stderr)
        return 2
    if args.draws != 1 and not args.capacity:
        print("polymorph simulate: --draws judges the points of a --capacity search; one run is one draw (give --seed)", file=sys.stderr)
        return 2
    try:
        budget = budget_from_args(args)
        workload = None if args.capacity else load_workload(args)
        capacity = capacity_from_args(args)
        if args.decisions:  # opened now, so a path it cannot write ends the command before the run, not after
            Path(args.decisions).open("a", encoding="utf-8").close()
    except (ValueError, OSError) as exc:
        print(f"polymorph simulate: {exc}", file=sys.stderr)
        return 2
    if workload is None:
        return _main_capacity(args, budget, capacity)
    report_skipped_rows(args.trace, workload.issues)
    log = DecisionLog(Path(args.decisions) if args.decisions else None)
    if args.compile == "off":
        result = simulate(workload, args.policy, budget, capacity, args.model, log)
    else:
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
