"""`polymorph bench peers --parts routing --metric capacity`: each router's capacity at SLO on the routing fleet.

The routing part's fleet (2 H100 replicas with the short-chat engine, 2 H200 with the long-context
one, emulated at ``--speed``), workload (peers-routing.yaml) and routers (sglang-router round_robin
and cache_aware, Polymorph with shape routing off and on), as in loadtest/bench/peers_routing.py.
For each router: the highest multiplier of the workload's rate whose open-loop run keeps
``--slo-threshold`` overall and in every tier (loadtest/live_capacity.py's search, the same seed at
every point), then each tier's own reach read off the same curve. Each router gets a fresh fleet, so
no router inherits another's prefix caches, and within a router's search each point moves the
workload's hash ids by a salt of its own, as the goodput runs do. Rates are engine req/s.
"""

from __future__ import annotations

import argparse
import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from loadtest.bench.peers_report import MIN_GOODPUT_RATIO_VS_CACHE_AWARE
from loadtest.bench.peers_routing import (
    _DRAIN_TIMEOUT_S,
    MODEL,
    ROUTERS,
    SCENARIO_PATH,
    TIERS,
    _wait_for_idle,
    fleet_perf_models,
    kept_up,
    start_fleet,
    start_router,
    with_fresh_prefixes,
)
from loadtest.capacity import CapacityResult, CurvePoint, PartCapacity, part_capacity
from loadtest.demo_credentials import DEMO_API_KEY
from loadtest.procs import ProcessRegistry
from loadtest.record import RequestRecord
from loadtest.simulate import CapacitySettings, WorkloadSource
from loadtest.spec import Workload

# with_fresh_prefixes keeps salted hash ids under 2^53 for salts up to 15: one per point of a router's search
MAX_POINTS = 15
_RUN_DRAIN_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class RouterCapacity:
    router: str
    result: CapacityResult
    tier_to_capacity: dict[str, PartCapacity]
    behind_at: tuple[float, ...]  # multipliers whose run's load generator fell behind (those measured the CPU)
    wall_s: float


def run_routing_capacity(
    args: argparse.Namespace, run_dir: Path, router_python: Path | None, result: dict[str, object],
    say: Callable[[str], None],
) -> str:
    started_s = time.monotonic()
    routers = [name for name in ROUTERS if router_python is not None or not name.startswith("sglang")]
    settings = CapacitySettings(args.slo_threshold, args.resolution, args.max_points)
    source = routing_source(args)
    # the summary and the table ask for the same multipliers: each workload is built and counted once
    load_at = functools.cache(functools.partial(routing_compute_load, args, source.nominal_rate_rps))
    say(f"routing capacity: {', '.join(routers)}; workload {SCENARIO_PATH.name} x multiplier of "
        f"{source.nominal_rate_rps:g} req/s, {args.routing_duration:g} engine s per point at speed {args.speed:g}; "
        f"threshold {settings.threshold:g}, resolution {settings.resolution:g}, at most {settings.max_points} points per router; "
        f"at x1 its least work takes {load_at(1.0):.0%} of the GPUs' peak compute")
    figures: list[RouterCapacity] = []
    for name in routers:
        try:
            figures.append(_search_router(name, args, run_dir, router_python, source, settings, say))
        except RuntimeError as problem:
            say(f"bench peers: routing capacity of {name} failed: {problem}")
            result["routing_capacity"] = {"error": f"{name}: {problem}"}
            return ""
    wall_s = time.monotonic() - started_s
    result["routing_capacity"] = capacity_summary(figures, args, settings, wall_s, load_at)
    return format_capacity_table(figures, args, wall_s, load_at)


def routing_source(args: argparse.Namespace) -> WorkloadSource:
    """The routing workload at any multiplier of its engine-time rate, on the emulated fleet's wall clock."""
    from loadtest.scenario import build_workload, load_scenario
    from loadtest.transform import speed_up

    scenario = load_scenario(SCENARIO_PATH)
    nominal_rps = args.routing_rate or scenario.mean_rate_rps(args.routing_duration)

    def build(multiplier: float, seed: int) -> Workload:
        return speed_up(build_workload(scenario, args.routing_duration, nominal_rps * multiplier, seed), args.speed)

    return WorkloadSource(scenario.name, nominal_rps, args.seed, False, build)


def routing_compute_load(args: argparse.Namespace, nominal_rps: float, multiplier: float) -> float:
    """The share of the fleet's peak compute that the search's workload at ``multiplier`` (engine time, the
    search's seed) needs at the least (loadtest/compute_bound.py): above 1, no router passes that point."""
    from loadtest.compute_bound import compute_load, least_work
    from loadtest.scenario import build_workload, load_scenario

    workload = build_workload(load_scenario(SCENARIO_PATH), args.routing_duration, nominal_rps * multiplier, args.seed)
    return compute_load(least_work(workload), fleet_perf_models())


def _search_router(
    name: str, args: argparse.Namespace, run_dir: Path, router_python: Path | None, source: WorkloadSource,
    settings: CapacitySettings, say: Callable[[str], None],
) -> RouterCapacity:
    from kernels.tiers import DEFAULT_TIERS
    from loadtest.live_capacity import search_live
    from loadtest.metrics import RunFacts, summarize
    from loadtest.runner import RunnerConfig, run

    begun_s = time.monotonic()
    tier_to_slo = {tier: slo.sped_up(args.speed) for tier, slo in DEFAULT_TIERS.items()}
    behind_at: list[float] = []
    with ProcessRegistry(run_dir / name) as registry:
        pool_to_urls = start_fleet(registry, args.speed)
        replica_urls = [url for urls in pool_to_urls.values() for url in urls]
        url = start_router(name, registry, run_dir, pool_to_urls, router_python, args.speed)
        config = RunnerConfig(target_url=url, model=MODEL, api_key=DEMO_API_KEY, progress=False,
                              drain_timeout_s=_RUN_DRAIN_TIMEOUT_S)
        salts = iter(range(1, MAX_POINTS + 1))

        def run_point(multiplier: float, workload: Workload) -> Sequence[RequestRecord]:
            _wait_for_idle(replica_urls, _DRAIN_TIMEOUT_S)
            outcome = run(with_fresh_prefixes(workload, next(salts)), config, tier_to_slo)
            facts = RunFacts(workload.name, url, outcome.model, outcome.mode, True, outcome.duration_s)
            if not kept_up(summarize(outcome.records, facts, tier_to_slo), args.speed):
                behind_at.append(multiplier)
            return outcome.records

        def on_point(point: CurvePoint) -> None:
            tiers = ", ".join(f"{p.name} {p.attainment:.3f}" for p in point.attainment.parts if p.kind == "tier")
            say(f"  {name:20s} x{point.multiplier:.4g} ({point.rate_rps:.1f} req/s): attainment "
                f"{point.attainment.overall:.3f} ({tiers}) {'pass' if point.passed else 'fail'}"
                f"{'; the load generator fell behind' if point.multiplier in behind_at else ''}")

        result = search_live(source, run_point, tier_to_slo, settings, math.inf, _RUN_DRAIN_TIMEOUT_S, time.monotonic, on_point)
    tier_to_capacity = {tier: part_capacity(result, "tier", tier) for tier in TIERS}
    return RouterCapacity(name, result, tier_to_capacity, tuple(behind_at), time.monotonic() - begun_s)


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b > 0 else None


def capacity_summary(figures: Sequence[RouterCapacity], args: argparse.Namespace, settings: CapacitySettings,
                     wall_s: float, load_at: Callable[[float], float]) -> dict[str, object]:
    """Per router: capacity (overall gate and per tier) and its curve; Polymorph with shapes over each other
    router; and whether the target's multiplier is within what the fleet could compute at all
    (``load_at``: a multiplier's least work over the fleet's peak compute)."""
    routers = {
        item.router: {
            "capacity_multiplier": round(item.result.multiplier, 4), "capacity_rps": round(item.result.rate_rps, 2),
            "by_tier": {tier: {"capacity_multiplier": round(part.multiplier, 4), "at_least": part.at_least,
                               "capacity_rps": round(part.multiplier * item.result.nominal_rate_rps, 2),
                               "attainment_at_capacity": None if part.attainment is None else round(part.attainment, 4)}
                        for tier, part in item.tier_to_capacity.items()},
            "points": len(item.result.curve), "note": item.result.note, "wall_s": round(item.wall_s, 1),
            "generator_kept_up": not item.behind_at, "generator_behind_at": [round(m, 4) for m in item.behind_at],
            "curve": item.result.to_json()["curve"],
        }
        for item in figures
    }
    name_to_item = {item.router: item for item in figures}
    shapes, cache_aware = name_to_item.get("polymorph-shapes"), name_to_item.get("sglang-cache-aware")
    over: dict[str, float | None] = {}
    over_by_tier: dict[str, float | None] = {}
    if shapes is not None:
        over = {item.router: _ratio(shapes.result.multiplier, item.result.multiplier) for item in figures if item is not shapes}
        if cache_aware is not None:
            over_by_tier = {tier: _ratio(shapes.tier_to_capacity[tier].multiplier, cache_aware.tier_to_capacity[tier].multiplier)
                            for tier in TIERS}
    ratio = over.get("sglang-cache-aware")
    # a capacity measured where the load generator fell behind is the CPU's, not the router's: not judged
    judged = ratio is not None and shapes is not None and cache_aware is not None and not shapes.behind_at and not cache_aware.behind_at
    # the target asks Polymorph for this multiplier: past the fleet's peak compute, no router could pass it
    needed = MIN_GOODPUT_RATIO_VS_CACHE_AWARE * cache_aware.result.multiplier if cache_aware is not None else None
    needed_load = None if needed is None else load_at(needed)
    return {
        "routers": routers,
        "capacity_ratio_shapes_vs_cache_aware": ratio,
        "capacity_ratio_shapes_vs": over,
        "tier_capacity_ratio_shapes_vs_cache_aware": over_by_tier,
        "targets": {f"capacity_ge_{MIN_GOODPUT_RATIO_VS_CACHE_AWARE}x_cache_aware":
                    ratio >= MIN_GOODPUT_RATIO_VS_CACHE_AWARE if judged and ratio is not None else None},
        "compute_load_at_capacity": {item.router: round(load_at(item.result.multiplier), 3) for item in figures},
        "target_multiplier": None if needed is None else round(needed, 4),
        "target_compute_load": None if needed_load is None else round(needed_load, 3),
        "target_within_compute": None if needed_load is None else needed_load <= 1.0,
        "search": {"slo_threshold": settings.threshold, "resolution": settings.resolution, "max_points": settings.max_points},
        "workload": {"scenario": SCENARIO_PATH.name, "engine_duration_s": args.routing_duration, "speed": args.speed,
                     "nominal_rate_rps": round(figures[0].result.nominal_rate_rps, 2) if figures else None, "seed": args.seed},
        "wall_s": round(wall_s, 1),
    }


def format_capacity_table(
    figures: Sequence[RouterCapacity], args: argparse.Namespace, wall_s: float, load_at: Callable[[float], float]
) -> str:
    header = f"{'router':20s} {'capacity x':>10s} {'req/s':>7s} " + " ".join(f"{tier + ' x':>13s}" for tier in TIERS) + \
        f" {'points':>6s} {'wall s':>6s}  note"
    lines = [header, "-" * len(header)]
    for item in figures:
        tiers = " ".join(f"{('>=' if part.at_least else '') + f'{part.multiplier:.3f}':>13s}" for part in item.tier_to_capacity.values())
        behind = f"load generator fell behind at x{', x'.join(f'{m:.3g}' for m in item.behind_at)}" if item.behind_at else ""
        note = "; ".join(text for text in (item.result.note, behind) if text)
        lines.append(f"{item.router:20s} {item.result.multiplier:10.3f} {item.result.rate_rps:7.1f} {tiers} "
                     f"{len(item.result.curve):6d} {item.wall_s:6.0f}  {note}")
    nominal = figures[0].result.nominal_rate_rps if figures else 0.0
    lines.append(f"capacity at SLO: the highest multiplier of {nominal:g} req/s (engine time) keeping attainment >= "
                 f"{args.slo_threshold:g} overall and per tier; a tier's column: the highest point of the same curve up to "
                 f"which that tier alone held it (>=: it held at every point run); {args.routing_duration:g} engine s per "
                 f"point at speed {args.speed:g}, seed {args.seed}; the whole part took {wall_s / 60:.1f} min")
    loads = ", ".join(f"{item.router} {load_at(item.result.multiplier):.0%}" for item in figures)
    lines.append(f"least work at each capacity, as a share of the four GPUs' peak compute (prompts less every prefix seen "
                 f"before, plus outputs, at the compute roofline; loadtest/compute_bound.py): {loads}")
    cache_aware = next((item for item in figures if item.router == "sglang-cache-aware"), None)
    if cache_aware is not None:
        needed = MIN_GOODPUT_RATIO_VS_CACHE_AWARE * cache_aware.result.multiplier
        load = load_at(needed)
        lines.append(f"{MIN_GOODPUT_RATIO_VS_CACHE_AWARE:g}x cache_aware's capacity is x{needed:.3f}, whose least work takes "
                     f"{load:.0%} of it{'' if load <= 1.0 else ': no router can pass it'}")
    return "\n".join(lines)
