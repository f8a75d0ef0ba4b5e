"""`polymorph bench peers`: option parsing, generated peer configs, common rate and targets (no peers started)."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import orjson
import pytest

from gateway.config import load_config
from loadtest.bench import cli, peers_report
from loadtest.bench.load import WrkResult
from loadtest.bench.peers import parse_list
from loadtest.bench.peers_raw import PeerFigures, common_rate
from loadtest.bench.peers_routing import (
    ReplicaShare,
    RoutingFigures,
    format_routing_table,
    kept_up,
    parse_counters,
    replica_split,
    routing_summary,
    with_fresh_prefixes,
    write_polymorph_config,
)
from loadtest.bench.peers_stack import RAW_PEERS, write_litellm_config


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="polymorph bench")
    cli.register_bench(parser.add_subparsers(dest="bench", required=True))
    return parser.parse_args(["peers", *argv])


def test_peer_list_keeps_canonical_order_and_names_unknown_peers() -> None:
    assert parse_list("polymorph,nginx", RAW_PEERS, "--peers") == ("nginx", "polymorph")
    with pytest.raises(ValueError, match="unknown envoy"):
        parse_list("nginx,envoy", RAW_PEERS, "--peers")


def test_cli_registers_peers_with_quick_and_parts() -> None:
    args = _args(["--quick", "--parts", "raw"])
    assert args.quick and args.parts == "raw" and args.duration is None


def test_common_rate_is_half_the_slowest_peer_ignoring_direct() -> None:
    def runs(rps: float) -> list[WrkResult]:
        return [WrkResult(int(rps * 2), 2.0, 0, 0, 1.0, 2.0)]

    assert common_rate({"direct": runs(40000), "polymorph": runs(3000), "litellm": runs(31)}) == 16


def _figures(name: str, peak_rps: float, added_p50_ms: float) -> PeerFigures:
    return PeerFigures(name, 64, peak_rps, 0.3, 90.0, 1.0, 15.0, 1.0, 5.0, added_p50_ms, 1.0, 0)


def test_targets_compare_polymorph_with_router_and_litellm_of_the_same_run() -> None:
    figures = [_figures("sglang-router", 3000, 1.0), _figures("litellm", 30, 40.0), _figures("polymorph", 1600, 1.4)]

    targets = peers_report.raw_targets(figures)
    summary = peers_report.raw_summary(figures)

    assert targets == {
        "peak_ge_0.5x_sglang_router": True, "peak_ge_30x_litellm": True,
        "added_p50_within_0.5ms_of_sglang_router": True,
    }
    assert summary["polymorph_vs"]["litellm"]["peak_rps"] == pytest.approx(53.333)  # type: ignore[index]
    assert peers_report.format_raw_table(figures).splitlines()[0].startswith("peer")


def test_routing_configs_load_and_differ_only_in_declared_shapes(tmp_path: Path) -> None:
    pool_to_urls = {"chat-h100": ["http://127.0.0.1:1", "http://127.0.0.1:2"], "long-h200": ["http://127.0.0.1:3"]}

    with_shapes = load_config(write_polymorph_config(tmp_path / "on", pool_to_urls, shapes_on=True, speed=0.5))
    without = load_config(write_polymorph_config(tmp_path / "off", pool_to_urls, shapes_on=False, speed=0.5))

    assert [pool.shapes for pool in with_shapes.pools] == [("short-chat", "batch"), ("long-context", "reasoning")]
    assert [pool.shapes for pool in without.pools] == [(), ()]
    assert [pool.urls for pool in without.pools] == [pool.urls for pool in with_shapes.pools]
    # emulated replicas at half speed: the gateway's own latencies (and queue deadlines) in engine time
    assert all(pool.emulated_urls and not pool.real for pool in [*with_shapes.pools, *without.pools])
    assert with_shapes.emulator_speed == without.emulator_speed == 0.5


def test_litellm_config_points_at_the_backend_with_a_master_key(tmp_path: Path) -> None:
    config = orjson.loads(write_litellm_config(tmp_path / "litellm.yaml", "http://127.0.0.1:9/v1").read_bytes())

    deployment = config["model_list"][0]
    assert deployment["litellm_params"] == {
        "model": "openai/bench-model", "api_base": "http://127.0.0.1:9/v1", "api_key": "dummy",
    }
    assert config["general_settings"]["master_key"].startswith("sk-")


def _routing(router: str, goodput_rps: float, interactive: float) -> RoutingFigures:
    return RoutingFigures(router, goodput_rps, 0.9, 0.8, 0.1, 100, 0, {"interactive": interactive, "standard": 0.95}, 0.03, True)


def test_routing_summary_judges_shape_routing_against_cache_aware_only_when_the_generator_kept_up() -> None:
    args = _args(["--parts", "routing", "--routing-rate", "100"])
    args.routing_duration, args.routing_rounds = 30.0, 2
    figures = [_routing("sglang-cache-aware", 70.0, 0.8), _routing("polymorph-shapes", 91.0, 0.99)]

    summary = routing_summary(figures, args)
    table = format_routing_table(figures, args)

    assert summary["goodput_ratio_shapes_vs_cache_aware"] == pytest.approx(1.3)
    assert summary["targets"] == {f"goodput_ge_{peers_report.MIN_GOODPUT_RATIO_VS_CACHE_AWARE}x_cache_aware": True}
    assert summary["routers"]["polymorph-shapes"]["slo_attainment_by_tier"] == {"interactive": 0.99, "standard": 0.95}  # type: ignore[index]
    assert "interactive" in table.splitlines()[0] and "at 100 req/s" in table
    behind = [_routing("sglang-cache-aware", 70.0, 0.8), replace(_routing("polymorph-shapes", 91.0, 0.99), generator_kept_up=False)]
    assert routing_summary(behind, args)["targets"] == {f"goodput_ge_{peers_report.MIN_GOODPUT_RATIO_VS_CACHE_AWARE}x_cache_aware": None}
    assert "load generator fell behind" in format_routing_table(behind, args)


def test_the_generator_kept_up_when_its_rate_held_and_its_lag_is_small_next_to_the_tightest_ttft() -> None:
    def run(achieved: float, lag_p99_ms: float) -> dict[str, object]:
        return {"target_rate": 50.0, "achieved_rate": achieved, "scheduling_error_ms": {"p99": lag_p99_ms}}

    assert kept_up(run(50.0, 80.0), speed=0.5)  # 40 ms of engine time: 4% of interactive's 1 s TTFT
    assert not kept_up(run(50.0, 80.0), speed=1.0)
    assert not kept_up(run(45.0, 1.0), speed=0.5)  # sent 10% short of the offered rate


def test_replica_split_is_each_replicas_requests_and_uncached_prefill_over_the_run() -> None:
    metrics = (
        "# TYPE sglang:num_requests_total counter\n"
        'sglang:num_requests_total{model_name="m"} 30.0\n'
        'sglang:prompt_tokens_total{model_name="m"} 9000.0\n'
        'sglang:cached_tokens_total{model_name="m"} 6000.0\n'
        'sglang:num_running_reqs{model_name="m"} 4.0\n'
    )
    after = parse_counters(metrics)
    assert after == {"num_requests_total": 30.0, "prompt_tokens_total": 9000.0, "cached_tokens_total": 6000.0}
    before = {"num_requests_total": 10.0, "prompt_tokens_total": 1000.0, "cached_tokens_total": 500.0}
    split = replica_split(["chat-0", "long-0"], [before, {}], [after, after])
    assert split == (ReplicaShare("chat-0", 20, 2500), ReplicaShare("long-0", 30, 3000))
    args = _args(["--parts", "routing"])
    figures = [replace(_routing("polymorph-shapes", 91.0, 0.99), replica_split=split)]
    assert routing_summary(figures, args)["routers"]["polymorph-shapes"]["replicas"]["long-0"] == {  # type: ignore[index]
        "requests": 30, "uncached_prompt_tokens": 3000}
    assert "chat-0 20/2k" in format_routing_table(figures, args)


def test_each_run_gets_fresh_prefixes_that_its_requests_still_share() -> None:
    from loadtest.spec import RequestSpec, Workload

    shared, own = (7, 8), (100, 101)
    specs = (RequestSpec(0.0, 1500, 8, hash_ids=shared + own), RequestSpec(0.1, 1500, 8, hash_ids=shared + (102,)), RequestSpec(0.2, 50, 8))
    workload = Workload("w", specs, 1.0)
    first, second = with_fresh_prefixes(workload, 1), with_fresh_prefixes(workload, 2)
    assert first.specs[0].hash_ids[:2] == first.specs[1].hash_ids[:2]  # the shared prefix stays shared within a run
    assert not set(first.specs[0].hash_ids) & (set(second.specs[0].hash_ids) | set(specs[0].hash_ids))  # nothing cached earlier matches
    assert first.specs[2] == specs[2] and [s.input_tokens for s in first.specs] == [s.input_tokens for s in specs]
