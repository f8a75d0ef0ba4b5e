"""`polymorph bench peers --parts routing --metric capacity`: options, the workload at each multiplier,
per-tier capacity read off a curve, and the summary's ratios (no routers started)."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from loadtest.bench import cli
from loadtest.bench.peers_routing_capacity import (
    RouterCapacity,
    capacity_summary,
    format_capacity_table,
    routing_compute_load,
    routing_source,
)
from loadtest.capacity import Attainment, CapacityResult, Part, part_capacity, search_capacity
from loadtest.simulate import CapacitySettings

SETTINGS = CapacitySettings(0.9, 0.1, 5)


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="polymorph bench")
    cli.register_bench(parser.add_subparsers(dest="bench", required=True))
    return parser.parse_args(["peers", *argv])


def tiered_curve(interactive_capacity: float, standard_capacity: float) -> CapacityResult:
    """A search whose two tiers hold 0.95 up to their own capacity and 0.5 beyond it."""
    def attainment_at(multiplier: float, seed: int) -> Attainment:
        parts = tuple(Part("tier", tier, 0.95 if multiplier <= capacity else 0.5, 500, True)
                      for tier, capacity in (("interactive", interactive_capacity), ("standard", standard_capacity)))
        return Attainment(min(p.attainment for p in parts), 1000, parts)

    return search_capacity(attainment_at, 100.0, seed=7, resolution=0.1)


def test_capacity_options_parse_with_short_live_defaults() -> None:
    args = _args(["--parts", "routing", "--metric", "capacity"])
    assert args.metric == "capacity" and args.slo_threshold == 0.9
    assert args.resolution == 0.15 and args.max_points == 5
    assert _args([]).metric == "goodput"


def test_more_points_than_fresh_prefix_salts_are_refused() -> None:
    args = _args(["--parts", "routing", "--metric", "capacity", "--max-points", "16"])
    with pytest.raises(SystemExit, match="--max-points at most 15"):
        args.handler(args)


def test_each_tier_reaches_as_far_as_it_alone_holds_the_threshold() -> None:
    result = tiered_curve(interactive_capacity=3.0, standard_capacity=0.7)
    assert result.multiplier <= 0.7 <= result.multiplier * 1.1
    standard = part_capacity(result, "tier", "standard")
    assert standard.multiplier == result.multiplier and not standard.at_least and standard.attainment == 0.95
    interactive = part_capacity(result, "tier", "interactive")
    # the search never ran past 1.0 (it failed there), and interactive held at every point: a lower bound
    assert interactive.multiplier == max(p.multiplier for p in result.curve) == 1.0 and interactive.at_least
    assert part_capacity(result, "tier", "batch").at_least  # absent: it never failed


def test_a_tier_failing_at_the_lowest_point_has_capacity_zero() -> None:
    result = tiered_curve(interactive_capacity=0.001, standard_capacity=5.0)
    assert result.multiplier == 0.0
    interactive = part_capacity(result, "tier", "interactive")
    assert interactive.multiplier == 0.0 and not interactive.at_least and interactive.attainment is None


def _load_at(multiplier: float) -> float:
    """A fleet that computes twice the workload's least work at x1."""
    return multiplier / 2.0


def router(name: str, result: CapacityResult, behind_at: tuple[float, ...] = ()) -> RouterCapacity:
    return RouterCapacity(name, result, {tier: part_capacity(result, "tier", tier) for tier in ("interactive", "standard")},
                          behind_at, 60.0)


def test_summary_gives_shape_routing_over_each_router_and_per_tier() -> None:
    args = argparse.Namespace(routing_duration=8.0, speed=0.5, seed=7, slo_threshold=0.9)
    figures = [router("sglang-cache-aware", tiered_curve(3.0, 0.5)), router("polymorph-shapes", tiered_curve(3.0, 0.8)),
               router("sglang-rr", tiered_curve(0.4, 0.6))]
    summary: dict[str, Any] = capacity_summary(figures, args, SETTINGS, 900.0, _load_at)
    shapes, cache_aware = summary["routers"]["polymorph-shapes"], summary["routers"]["sglang-cache-aware"]
    ratio = summary["capacity_ratio_shapes_vs_cache_aware"]
    assert ratio == pytest.approx(shapes["capacity_multiplier"] / cache_aware["capacity_multiplier"], rel=1e-2)
    assert ratio > 1.3  # 0.8 / 0.5 within the resolution
    assert summary["targets"] == {"capacity_ge_1.3x_cache_aware": True}
    assert set(summary["capacity_ratio_shapes_vs"]) == {"sglang-cache-aware", "sglang-rr"}
    assert set(summary["tier_capacity_ratio_shapes_vs_cache_aware"]) == {"interactive", "standard"}
    assert shapes["by_tier"]["interactive"]["at_least"] and summary["wall_s"] == 900.0
    table = format_capacity_table(figures, args, 900.0, _load_at)
    assert "15.0 min" in table and ">=1.000" in table
    # the fleet computes x2 at most (_load_at): 1.3x cache_aware's x0.5 fits
    needed = summary["target_multiplier"]
    assert needed == pytest.approx(1.3 * cache_aware["capacity_multiplier"])
    assert summary["target_compute_load"] == pytest.approx(needed / 2, abs=1e-3) and summary["target_within_compute"]
    assert summary["compute_load_at_capacity"]["polymorph-shapes"] == pytest.approx(shapes["capacity_multiplier"] / 2, abs=1e-3)
    assert "no router can pass it" not in table


def test_a_target_past_the_fleets_compute_is_said_to_be_out_of_reach() -> None:
    args = argparse.Namespace(routing_duration=8.0, speed=0.5, seed=7, slo_threshold=0.9)
    figures = [router("sglang-cache-aware", tiered_curve(3.0, 1.8)), router("polymorph-shapes", tiered_curve(3.0, 1.9))]
    summary: dict[str, Any] = capacity_summary(figures, args, SETTINGS, 10.0, _load_at)
    assert summary["target_compute_load"] > 1.0 and summary["target_within_compute"] is False
    assert "no router can pass it" in format_capacity_table(figures, args, 10.0, _load_at)


def test_a_capacity_measured_behind_the_load_generator_is_not_judged() -> None:
    args = argparse.Namespace(routing_duration=8.0, speed=0.5, seed=7, slo_threshold=0.9)
    figures = [router("sglang-cache-aware", tiered_curve(3.0, 0.5)), router("polymorph-shapes", tiered_curve(3.0, 0.8), (1.0,))]
    summary: dict[str, Any] = capacity_summary(figures, args, SETTINGS, 10.0, _load_at)
    assert summary["capacity_ratio_shapes_vs_cache_aware"] is not None
    assert summary["targets"] == {"capacity_ge_1.3x_cache_aware": None}
    assert "fell behind at x1" in format_capacity_table(figures, args, 10.0, _load_at)


def test_the_routing_workload_scales_its_rate_and_runs_on_the_fleets_clock() -> None:
    args = argparse.Namespace(routing_rate=0.0, routing_duration=4.0, speed=0.5, seed=7)
    source = routing_source(args)
    assert source.nominal_rate_rps == pytest.approx(100.0, rel=0.01) and source.seed == 7
    base, doubled = source.build(1.0, 7), source.build(2.0, 7)
    assert base.duration_s == doubled.duration_s == pytest.approx(8.0)  # 4 engine seconds at half speed
    assert doubled.num_requests == pytest.approx(2 * base.num_requests, rel=0.25)
    assert source.build(2.0, 7) == doubled  # the same seed, the same requests



def test_the_fleets_compute_load_grows_with_the_multiplier() -> None:
    args = argparse.Namespace(routing_duration=8.0, seed=7)
    loads = [routing_compute_load(args, 100.0, multiplier) for multiplier in (0.5, 1.0, 2.0)]
    assert 0.0 < loads[0] < loads[1] < loads[2]
    assert loads[2] == pytest.approx(2 * loads[1], rel=0.25)  # arrivals scale; lengths do not
