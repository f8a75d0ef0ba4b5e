"""Capacity at SLO, live: loadtest/capacity.py's search, each point an open-loop run of the load tester.

``polymorph loadtest --capacity`` builds the workload from the same flags as a plain run and asks
``search_capacity`` (the simulator's search and gate: bracketing, geometric bisection, the minimum
over overall, tiers and scenario phases or 5-minute trace windows) for the highest rate multiplier
whose run keeps the threshold. One point is one open-loop ``runner.run`` against the target: a
scenario generated again at the multiplied rate over the same duration (its phases stay put), a
trace replayed that many times faster (the same requests, closer together), always with the same
seed. The search is bounded in wall time: a point starts only when its traffic plus the drain
timeout fit in what is left of ``--max-duration-s``, so the last point cannot overrun it by more
than its request bodies' preparation.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from kernels.tiers import TierSlo, slo_for
from loadtest.capacity import Attainment, CapacityResult, CurvePoint, attainment_of, phase_bounds_s, search_capacity, window_bounds_s
from loadtest.record import RequestRecord
from loadtest.runner import RunnerConfig, RunResult, TargetUnreachable, run
from loadtest.simulate import CapacitySettings, WorkloadSource, capacity_settings, trace_at_any_rate
from loadtest.slo import meets_slo
from loadtest.spec import Workload

EXIT_USAGE = 2
EXIT_UNREACHABLE = 3


def records_attainment(records: Sequence[RequestRecord], workload: Workload, is_trace: bool,
                       tier_to_slo: Mapping[str, TierSlo]) -> Attainment:
    """One live run judged like a simulated one: overall, per tier, per phase (scenario) or 5-minute
    window (trace), by each request's scheduled arrival. A request with no response at all (refused,
    timed out, cut off by the drain timeout) is counted as dropped."""
    arrivals = np.array([record.scheduled_at_s for record in records])
    met = np.array([meets_slo(record, slo_for(tier_to_slo, record.tier)) for record in records], dtype=bool)
    if is_trace:
        bounds, kind = window_bounds_s(workload.duration_s), "window"
    else:
        bounds, kind = phase_bounds_s(workload.duration_s, workload.drift_onsets_s), "phase"
    judged = attainment_of(arrivals, [record.tier for record in records], met, bounds, kind)
    return replace(judged, num_dropped=sum(record.status == 0 for record in records))


def search_live(
    source: WorkloadSource,
    run_point: Callable[[float, Workload], Sequence[RequestRecord]],
    tier_to_slo: Mapping[str, TierSlo],
    settings: CapacitySettings,
    max_duration_s: float,
    drain_timeout_s: float,
    clock: Callable[[], float],
    on_point: Callable[[CurvePoint], None] = lambda point: None,
) -> CapacityResult:
    """The capacity search with ``run_point`` (one open-loop run, its records) at every multiplier;
    a point starts only when its traffic and ``drain_timeout_s`` fit in what ``max_duration_s`` leaves."""
    started_s = clock()
    nominal = source.build(1.0, source.seed)

    def attainment_at(multiplier: float, seed: int) -> Attainment:
        workload = nominal if multiplier == 1.0 else source.build(multiplier, seed)
        return records_attainment(run_point(multiplier, workload), workload, source.is_trace, tier_to_slo)

    return search_capacity(
        attainment_at, source.nominal_rate_rps, source.seed, settings.threshold, settings.resolution,
        max_points=settings.max_points, on_point=on_point,
        can_run=lambda multiplier: clock() - started_s + point_bound_s(source, nominal, multiplier, drain_timeout_s) <= max_duration_s,
    )


def point_bound_s(source: WorkloadSource, nominal: Workload, multiplier: float, drain_timeout_s: float) -> float:
    """The longest one point can take: its traffic (a scenario keeps its duration at any rate, a trace
    is compressed by the multiplier), then the drain timeout."""
    return (nominal.duration_s / multiplier if source.is_trace else nominal.duration_s) + drain_timeout_s


def source_from_args(args: argparse.Namespace) -> WorkloadSource:
    """The load test's workload (every flag of a plain run) at any multiplier of its mean rate."""
    from loadtest.workload_args import build_workload_from_args

    base = build_workload_from_args(args)
    if args.trace:
        return trace_at_any_rate(base, base.name, args.seed or 0)
    from loadtest.scenario import load_scenario

    scenario = load_scenario(args.scenario)
    duration_s = args.duration if args.duration is not None else scenario.duration_s
    nominal_rps = args.rate if args.rate is not None else scenario.mean_rate_rps(duration_s + args.start)
    seed = args.seed if args.seed is not None else scenario.seed

    def build(multiplier: float, point_seed: int) -> Workload:
        rate = args.rate if multiplier == 1.0 else nominal_rps * multiplier
        return build_workload_from_args(argparse.Namespace(**{**vars(args), "rate": rate, "seed": point_seed}))

    return WorkloadSource(base.name, nominal_rps, seed, False, build)


def main_capacity(args: argparse.Namespace, tier_to_slo: Mapping[str, TierSlo], tenant_to_key: dict[str, str]) -> int:
    """`polymorph loadtest --capacity`: the search against --target, the curve (or one JSON object)."""
    if args.concurrency or args.dry_run:
        print("error: --capacity runs open loop and sends traffic: drop --concurrency and --dry-run", file=sys.stderr)
        return EXIT_USAGE
    if not args.target:
        print("error: --capacity needs --target URL", file=sys.stderr)
        return EXIT_USAGE
    try:
        settings = capacity_settings(args)
        source = source_from_args(args)
        first_s = point_bound_s(source, source.build(1.0, source.seed), 1.0, args.drain_timeout)
        if first_s > args.max_duration_s:
            raise ValueError(f"--max-duration-s {args.max_duration_s:g} leaves no time for one point: its traffic and "
                             f"--drain-timeout take up to {first_s:g} s")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    config = RunnerConfig(
        target_url=args.target, model=args.model, api_key=args.api_key, tenant_to_api_key=tenant_to_key,
        stream=not args.no_stream, request_timeout_s=args.timeout, drain_timeout_s=args.drain_timeout,
        admin_token=args.admin_token, progress=not args.no_progress,
    )
    out_dir = Path(args.out) if args.out else None
    models: list[str] = []

    def run_point(multiplier: float, workload: Workload) -> tuple[RequestRecord, ...]:
        print(f"{workload.name}: {workload.num_requests} requests over {workload.duration_s:.1f} s "
              f"({workload.target_rate_rps:.2f} req/s offered) -> {config.base_url}", file=sys.stderr, flush=True)
        result = run(workload, config, tier_to_slo)
        models.append(result.model)
        if out_dir is not None:
            _write_point(out_dir / f"x{multiplier:.4g}", workload, config, result, tier_to_slo)
        return result.records

    def progress(point: CurvePoint) -> None:
        print(f"capacity: x{point.multiplier:.4g} ({point.rate_rps:.2f} req/s): worst attainment "
              f"{100 * point.attainment.worst:.1f}% ({point.attainment.binding}) {'pass' if point.passed else 'fail'}",
              file=sys.stderr, flush=True)

    started_s = time.monotonic()
    try:
        result = search_live(source, run_point, tier_to_slo, settings, args.max_duration_s, args.drain_timeout,
                             time.monotonic, progress)
    except TargetUnreachable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    report = {"workload": source.name, "target": config.base_url, "model": models[0] if models else args.model,
              "max_duration_s": args.max_duration_s, "wall_s": round(time.monotonic() - started_s, 1), **result.to_json()}
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "capacity.json").write_text(json.dumps(report, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    if args.json:
        print(json.dumps(report, sort_keys=True))
    else:
        from loadtest.simulate import print_curve

        print_curve(result)
        print(f"{len(result.curve)} points in {report['wall_s']} s against {config.base_url}")
    return 0


def _write_point(point_dir: Path, workload: Workload, config: RunnerConfig, result: RunResult,
                 tier_to_slo: Mapping[str, TierSlo]) -> None:
    """One point's results.json and requests.jsonl, as a plain run writes them."""
    from loadtest.metrics import RunFacts, summarize
    from loadtest.report import write_results

    facts = RunFacts(workload.name, config.base_url, result.model, result.mode, config.stream, result.duration_s,
                     workload.drift_onsets_s, result.gateway_events)
    write_results(point_dir, summarize(result.records, facts, tier_to_slo), result.records)
