"""Routing quality side by side: the same heterogeneous emulated fleet and workload behind four routers.

Fleet: two H100 replicas compiled for short chat and two H200 replicas compiled for long context
(the engine settings of config.example.yaml's two pools), emulated at ``--speed`` times real time.
Routers: sglang-router ``round_robin`` and ``cache_aware`` (its defaults) over all four replicas;
Polymorph with pools that declare no shapes (the router then balances on load with prefix affinity
only); and Polymorph with the pools' shapes declared (classification picks the pool first). The
workload (loadtest/bench/data/peers-routing.yaml: interactive chat and code behind shared system
prompts, and long documents, with loadtest's fitted production lengths) is stretched by the speed,
and the tier objectives too, so goodput, TTFT and TPOT are judged per tier in the emulated GPUs' own
time; reported times are engine seconds. A speed below 1 emulates slower GPUs: the fleet is then busy
at a wall-clock request rate that two cores can send and proxy, so the figures measure routing, not
the proxies' CPU (each run reports whether the load generator kept up). Rounds alternate the
routers' order, and the fleet drains between runs. Replicas keep their prefix caches between runs,
so each run moves the workload's hash ids (and so its prompt text) by a salt of its own: every run
starts with its prefixes uncached, and requests that share a prefix within a run still share it
(replaying the same ids handed a later run the earlier runs' prefill: one router's attainment moved
0.63 -> 0.94 between rounds on that alone). Each run also reports where the requests went:
per replica, the requests finished and the prompt tokens prefilled beyond the prefix cache (the
replicas' own sglang counters), which is what tells one router's placement from another's.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import orjson

from loadtest.bench.measure import median_of, round_order
from loadtest.bench.peers_stack import sglang_router_argv
from loadtest.bench.stack import Target
from loadtest.demo_credentials import DEMO_API_KEY
from loadtest.procs import ProcessRegistry, free_port, wait_for_port

if TYPE_CHECKING:
    from kernels.perf import PerfModel
    from loadtest.spec import Workload

SCENARIO_PATH = Path(__file__).with_name("data") / "peers-routing.yaml"
MODEL = "llama-3.1-8b"
ROUTERS = ("sglang-rr", "sglang-cache-aware", "polymorph-no-shapes", "polymorph-shapes")
TIERS = ("interactive", "standard")  # the workload's tiers, reported one by one
# (pool, GPU, engine settings, shapes): config.example.yaml's two pools.
_POOLS = (
    ("chat-h100", "H100-SXM", {"tp": 1, "max_running_requests": 256, "chunked_prefill_size": 2048},
     ["short-chat", "batch"]),
    ("long-h200", "H200", {"tp": 1, "max_running_requests": 64, "chunked_prefill_size": 8192},
     ["long-context", "reasoning"]),
)
_REPLICAS_PER_POOL = 2
_STARTUP_TIMEOUT_S = 120.0
_DRAIN_TIMEOUT_S = 60.0
# The load generator kept up when it sent at its target rate and its scheduling error stayed small
# next to the tightest objective (loadtest's own 5 ms bound is for a quiet machine, not a busy 2-core one).
_MAX_RATE_SHORTFALL = 0.02
_MAX_LAG_SHARE_OF_TTFT = 0.05


@dataclass(frozen=True, slots=True)
class RoutingFigures:
    """One router's medians over rounds; times in engine seconds."""

    router: str
    goodput_rps: float
    slo_attainment: float
    ttft_p99_s: float | None
    ttft_p50_s: float | None
    num_requests: int
    num_errors: int
    tier_to_attainment: dict[str, float]  # share of the tier's requests that met its TTFT and TPOT objectives
    interactive_tpot_p99_s: float | None
    generator_kept_up: bool  # every run's load generator sent at its target rate (else the CPU, not routing, is measured)
    replica_split: tuple[ReplicaShare, ...] = ()  # medians over rounds, one per replica


@dataclass(frozen=True, slots=True)
class ReplicaShare:
    """What one replica served in a run: from its counters' change over the run."""

    replica: str
    num_requests: int
    uncached_prompt_tokens: int  # prefilled tokens the prefix cache did not cover: its prefill work


def run_routing(
    args: argparse.Namespace, run_dir: Path, router_python: Path | None, result: dict[str, object],
    say: Callable[[str], None],
) -> str:
    routers = [name for name in ROUTERS if router_python is not None or not name.startswith("sglang")]
    with ProcessRegistry(run_dir) as registry:
        try:
            replica_urls = start_fleet(registry, args.speed)
            name_to_url = {
                name: start_router(name, registry, run_dir, replica_urls, router_python, args.speed) for name in routers
            }
            figures = _measure(args, name_to_url, replica_urls, say)
        except RuntimeError as problem:
            say(f"bench peers: routing part failed: {problem}")
            result["routing"] = {"error": str(problem)}
            return ""
    result["routing"] = routing_summary(figures, args)
    return format_routing_table(figures, args)


def start_fleet(registry: ProcessRegistry, speed: float) -> dict[str, list[str]]:
    """Start the emulated replicas; pool name -> their base URLs."""
    pool_to_urls: dict[str, list[str]] = {}
    pending = []
    for pool, gpu, engine, _shapes in _POOLS:
        for index in range(_REPLICAS_PER_POOL):
            port = free_port()
            argv = [
                sys.executable, "-m", "gateway.cli", "emulate", "--model", MODEL, "--gpu", gpu, "--port", str(port),
                "--config", orjson.dumps(engine).decode(), "--speed", str(speed), "--served-model-name", MODEL,
            ]
            pending.append((registry.start(f"{pool}-{index}", argv), port))
            pool_to_urls.setdefault(pool, []).append(f"http://127.0.0.1:{port}")
    for child, port in pending:
        wait_for_port(port, child, _STARTUP_TIMEOUT_S)
    return pool_to_urls


def fleet_perf_models() -> list[PerfModel]:
    """The performance model each replica of the fleet emulates (fleet/emulator runs it)."""
    from kernels.catalog import get_gpu, get_model
    from kernels.config import EngineConfig
    from kernels.perf import PerfModel

    model = get_model(MODEL)
    return [PerfModel(model, get_gpu(gpu), EngineConfig.from_dict(engine))
            for _pool, gpu, engine, _shapes in _POOLS for _ in range(_REPLICAS_PER_POOL)]


def start_router(
    name: str, registry: ProcessRegistry, run_dir: Path, pool_to_urls: dict[str, list[str]], router_python: Path | None, speed: float
) -> str:
    port = free_port()
    every_url = [url for urls in pool_to_urls.values() for url in urls]
    if name.startswith("sglang"):
        if router_python is None:
            raise RuntimeError("sglang-router is not installed")
        policy = "round_robin" if name == "sglang-rr" else "cache_aware"
        argv = sglang_router_argv(router_python, every_url, port, policy)
    else:
        config = write_polymorph_config(run_dir / name, pool_to_urls, shapes_on=name == "polymorph-shapes", speed=speed)
        argv = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config), "--port", str(port)]
    child = registry.start(name, argv)
    wait_for_port(port, child, _STARTUP_TIMEOUT_S)
    _wait_for_models(f"http://127.0.0.1:{port}", _STARTUP_TIMEOUT_S)
    return f"http://127.0.0.1:{port}"


def write_polymorph_config(directory: Path, pool_to_urls: dict[str, list[str]], shapes_on: bool, speed: float) -> Path:
    """A gateway config over the running replicas, emulated at ``speed``; with ``shapes_on`` False the pools
    declare no shapes. No fleet.controller: pricing these pools (gateway.pool_modeller) measured worse here
    (capacity 0.917x -> 0.545x of the workload's rate, fleet/README.md)."""
    tenants = directory / "tenants"
    tenants.mkdir(parents=True, exist_ok=True)
    tenant = {
        "name": "bench", "api_key_sha256": [hashlib.sha256(DEMO_API_KEY.encode()).hexdigest()],
        "rate_limits": {"requests_per_min": 10_000_000, "tokens_per_min": 10_000_000_000}, "max_concurrency": 100_000,
    }
    (tenants / "bench.yaml").write_bytes(orjson.dumps(tenant))
    pools = [
        {"name": pool, "model": MODEL, "gpu": gpu, "engine": {"kind": "emulated", **engine}, "shapes": shapes if shapes_on else [],
         "replicas": {"urls": pool_to_urls[pool]}}
        for pool, gpu, engine, shapes in _POOLS
    ]
    config = {"server": {"host": "127.0.0.1", "access_log": False}, "tenants_dir": "tenants", "fleet": {"pools": pools, "emulator_speed": speed}}
    path = directory / "config.yaml"
    path.write_bytes(orjson.dumps(config))  # JSON is YAML
    return path


def _measure(
    args: argparse.Namespace, name_to_url: dict[str, str], pool_to_urls: dict[str, list[str]], say: Callable[[str], None]
) -> list[RoutingFigures]:
    from kernels.tiers import DEFAULT_TIERS
    from loadtest.metrics import RunFacts, summarize
    from loadtest.runner import RunnerConfig, run
    from loadtest.scenario import build_workload, load_scenario
    from loadtest.transform import speed_up

    speed = args.speed
    scenario = load_scenario(SCENARIO_PATH)
    workload = speed_up(build_workload(scenario, args.routing_duration, args.routing_rate or None, args.seed), speed)
    tier_to_slo = {tier: slo.sped_up(speed) for tier, slo in DEFAULT_TIERS.items()}
    replica_urls = [url for urls in pool_to_urls.values() for url in urls]
    replica_names = [f"{pool}-{index}" for pool, urls in pool_to_urls.items() for index in range(len(urls))]
    targets = [Target(name, url, url, None) for name, url in name_to_url.items()]
    name_to_runs: dict[str, list[dict[str, object]]] = {name: [] for name in name_to_url}
    say(f"routing quality: {len(workload.specs)} requests over {workload.duration_s:.0f} s wall "
        f"({args.routing_duration:.0f} s of engine time at speed {speed:g}), {args.routing_rounds} round(s)")
    num_runs = 0
    for round_index in range(args.routing_rounds):
        for target in round_order(targets, round_index):
            _wait_for_idle(replica_urls, _DRAIN_TIMEOUT_S)
            config = RunnerConfig(
                target_url=target.json_url, model=MODEL, api_key=DEMO_API_KEY, progress=False,
                drain_timeout_s=60.0,
            )
            before = [_counters(url) for url in replica_urls]
            num_runs += 1
            outcome = run(with_fresh_prefixes(workload, num_runs), config, tier_to_slo)
            split = replica_split(replica_names, before, [_counters(url) for url in replica_urls])
            facts = RunFacts(workload.name, target.json_url, outcome.model, outcome.mode, True, outcome.duration_s)
            summary = summarize(outcome.records, facts, tier_to_slo)
            # Goodput over the offered span, not until the last straggler answers: a router that
            # leaves one long request queued must not look better for it.
            summary["goodput_rps"] = summary["slo_attainment"] * len(outcome.records) / workload.duration_s
            summary["generator_kept_up"] = kept_up(summary, speed)
            summary["replica_split"] = split
            name_to_runs[target.name].append(summary)
            tiers = ", ".join(f"{tier} {_tier_attainment(summary, tier):.3f}" for tier in TIERS)
            say(f"  {target.name:20s} round {round_index + 1}: goodput {summary['goodput_rps'] / speed:.2f} req/s, "
                f"attainment {summary['slo_attainment']:.3f} ({tiers}), TTFT p99 {_engine_s(summary['ttft_s'], 'p99', speed)} s, "
                f"{summary['errors']} errors{'' if summary['generator_kept_up'] else '; the load generator fell behind'}; "
                f"per replica {format_split(split)}")
    return [_figures(name, runs, speed) for name, runs in name_to_runs.items()]


def with_fresh_prefixes(workload: Workload, salt_index: int) -> Workload:
    """The same requests with every hash id moved by ``salt_index`` x 2^49 (above any scenario's id space,
    under 2^53 for a dozen runs): no prefix a replica cached in an earlier run matches."""
    salt = salt_index << 49
    specs = tuple(replace(spec, hash_ids=tuple(h + salt for h in spec.hash_ids)) if spec.hash_ids else spec
                  for spec in workload.specs)
    return replace(workload, specs=specs)


def kept_up(summary: dict[str, object], speed: float) -> bool:
    """Whether the run measured the routers rather than this machine: the generator sent at its target
    rate, and its p99 scheduling error (engine time) was under a small share of the tightest TTFT objective."""
    from kernels.tiers import DEFAULT_TIERS

    target, achieved = summary["target_rate"], summary["achieved_rate"]
    lag_p99_ms = summary["scheduling_error_ms"]["p99"]  # type: ignore[index]
    if target is None or achieved is None or lag_p99_ms is None:
        return True
    tightest_ttft_s = min(slo.ttft_p99_s for slo in DEFAULT_TIERS.values())
    return float(achieved) >= float(target) * (1 - _MAX_RATE_SHORTFALL) and \
        lag_p99_ms / 1000 * speed <= _MAX_LAG_SHARE_OF_TTFT * tightest_ttft_s  # type: ignore[operator]


def replica_split(names: Sequence[str], before: Sequence[dict[str, float]], after: Sequence[dict[str, float]]) -> tuple[ReplicaShare, ...]:
    """Each replica's share of a run from its counters before and after it."""
    def change(key: str, start: dict[str, float], end: dict[str, float]) -> float:
        return end.get(key, 0.0) - start.get(key, 0.0)

    return tuple(
        ReplicaShare(name, round(change("num_requests_total", start, end)),
                     round(change("prompt_tokens_total", start, end) - change("cached_tokens_total", start, end)))
        for name, start, end in zip(names, before, after, strict=True)
    )


def format_split(split: Sequence[ReplicaShare]) -> str:
    """``name requests/uncached prompt ktok`` per replica."""
    return ", ".join(f"{share.replica} {share.num_requests}/{share.uncached_prompt_tokens / 1000:.0f}k" for share in split)


_COUNTERS = ("num_requests_total", "prompt_tokens_total", "cached_tokens_total")


def parse_counters(text: str) -> dict[str, float]:
    """The sglang counters a replica's Prometheus text carries (``sglang:<name>{labels} value``)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("sglang:"):
            name = line[len("sglang:"):].split("{", 1)[0].split(" ", 1)[0]
            if name in _COUNTERS:
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _counters(base_url: str) -> dict[str, float]:
    with urllib.request.urlopen(base_url + "/metrics", timeout=5) as response:
        return parse_counters(response.read().decode())


def _engine_s(percentiles: object, key: str, speed: float) -> float | None:
    value = percentiles.get(key)  # type: ignore[attr-defined]
    return None if value is None else round(value * speed, 3)


def _tier_attainment(summary: dict[str, object], tier: str) -> float:
    group = summary["by_tier"].get(tier)  # type: ignore[attr-defined]
    return float(group["slo_attainment"]) if group else 0.0


def _median_or_none(values: Sequence[float | None]) -> float | None:
    known = [value for value in values if value is not None]
    return round(median_of(known), 3) if known else None


def _figures(name: str, runs: Sequence[dict[str, object]], speed: float) -> RoutingFigures:
    """Medians over rounds; goodput in engine time: requests meeting objectives per emulated second."""
    interactive_tpot = [
        _engine_s(run["by_tier"]["interactive"]["tpot_s"], "p99", speed) if "interactive" in run["by_tier"] else None  # type: ignore[index,operator]
        for run in runs
    ]
    return RoutingFigures(
        router=name,
        goodput_rps=median_of([float(run["goodput_rps"]) / speed for run in runs]),  # type: ignore[arg-type]
        slo_attainment=median_of([float(run["slo_attainment"]) for run in runs]),  # type: ignore[arg-type]
        ttft_p99_s=_median_or_none([_engine_s(run["ttft_s"], "p99", speed) for run in runs]),
        ttft_p50_s=_median_or_none([_engine_s(run["ttft_s"], "p50", speed) for run in runs]),
        num_requests=sum(int(run["requests"]) for run in runs),  # type: ignore[call-overload]
        num_errors=sum(int(run["errors"]) for run in runs),  # type: ignore[call-overload]
        tier_to_attainment={tier: median_of([_tier_attainment(run, tier) for run in runs]) for tier in TIERS},
        interactive_tpot_p99_s=_median_or_none(interactive_tpot),
        generator_kept_up=all(bool(run["generator_kept_up"]) for run in runs),
        replica_split=_median_split([run["replica_split"] for run in runs]),  # type: ignore[misc]
    )


def _median_split(splits: Sequence[Sequence[ReplicaShare]]) -> tuple[ReplicaShare, ...]:
    by_replica = zip(*splits, strict=True)
    return tuple(
        ReplicaShare(shares[0].replica, round(median_of([s.num_requests for s in shares])),
                     round(median_of([s.uncached_prompt_tokens for s in shares])))
        for shares in by_replica
    )


def routing_summary(figures: Sequence[RoutingFigures], args: argparse.Namespace) -> dict[str, object]:
    from loadtest.bench.peers_report import MIN_GOODPUT_RATIO_VS_CACHE_AWARE

    name_to_item = {item.router: item for item in figures}
    routers = {
        item.router: {
            "goodput_rps": round(item.goodput_rps, 3), "slo_attainment": round(item.slo_attainment, 4),
            "ttft_p99_s": item.ttft_p99_s, "ttft_p50_s": item.ttft_p50_s, "requests": item.num_requests,
            "errors": item.num_errors,
            "slo_attainment_by_tier": {tier: round(value, 4) for tier, value in item.tier_to_attainment.items()},
            "interactive_tpot_p99_s": item.interactive_tpot_p99_s, "generator_kept_up": item.generator_kept_up,
            "replicas": {share.replica: {"requests": share.num_requests, "uncached_prompt_tokens": share.uncached_prompt_tokens}
                         for share in item.replica_split},
        }
        for item in figures
    }
    shapes, cache_aware = name_to_item.get("polymorph-shapes"), name_to_item.get("sglang-cache-aware")
    ratio = None
    if shapes is not None and cache_aware is not None and cache_aware.goodput_rps > 0:
        ratio = round(shapes.goodput_rps / cache_aware.goodput_rps, 3)
    # A run whose load generator fell behind measured this machine's CPU, not routing: not judged.
    judged = ratio is not None and shapes is not None and cache_aware is not None and shapes.generator_kept_up \
        and cache_aware.generator_kept_up
    return {
        "routers": routers,
        "goodput_ratio_shapes_vs_cache_aware": ratio,
        "targets": {
            f"goodput_ge_{MIN_GOODPUT_RATIO_VS_CACHE_AWARE}x_cache_aware": ratio >= MIN_GOODPUT_RATIO_VS_CACHE_AWARE
            if judged and ratio is not None else None,
        },
        "workload": {"scenario": SCENARIO_PATH.name, "engine_duration_s": args.routing_duration, "speed": args.speed,
                     "rate_rps": args.routing_rate or "scenario", "seed": args.seed, "rounds": args.routing_rounds},
    }


def format_routing_table(figures: Sequence[RoutingFigures], args: argparse.Namespace) -> str:
    header = (
        f"{'router':20s} {'goodput req/s':>13s} {'attainment':>10s} {'interactive':>11s} {'standard':>8s} "
        f"{'TTFT p50 s':>10s} {'TTFT p99 s':>10s} {'int. TPOT p99 s':>15s} {'requests':>8s} {'errors':>6s}"
    )
    lines = [header, "-" * len(header)]
    for item in figures:
        lines.append(
            f"{item.router:20s} {item.goodput_rps:13.2f} {item.slo_attainment:10.3f} "
            f"{item.tier_to_attainment['interactive']:11.3f} {item.tier_to_attainment['standard']:8.3f} "
            f"{_cell(item.ttft_p50_s, 10)} {_cell(item.ttft_p99_s, 10)} {_cell(item.interactive_tpot_p99_s, 15)} "
            f"{item.num_requests:8d} {item.num_errors:6d}{'' if item.generator_kept_up else '  (load generator fell behind)'}"
        )
    splits = [f"{item.router} {format_split(item.replica_split)}" for item in figures if item.replica_split]
    if splits:
        lines.append("requests/uncached prompt tokens per replica (medians): " + "; ".join(splits))
    rate = f"{args.routing_rate:g} req/s" if args.routing_rate else "the scenario's rate"
    lines.append(f"fleet: 2x H100 (short-chat engine) + 2x H200 (long-context engine), speed {args.speed:g}; "
                 f"workload {SCENARIO_PATH.name} at {rate}, seed {args.seed}; times and goodput in engine seconds; "
                 f"attainment per tier against its TTFT and TPOT p99 objectives")
    return "\n".join(lines)


def _cell(value: float | None, width: int) -> str:
    return f"{value:{width}.3f}" if value is not None else f"{'-':>{width}s}"


def _wait_for_models(base_url: str, timeout_s: float) -> None:
    """Until the router lists the model: its workers are registered and healthy."""
    deadline_at = time.monotonic() + timeout_s
    headers = {"Authorization": f"Bearer {DEMO_API_KEY}"}
    request = urllib.request.Request(base_url + "/v1/models", headers=headers)
    while time.monotonic() < deadline_at:
        try:
            with urllib.request.urlopen(request, timeout=2) as response:
                if MODEL.encode() in response.read():
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{base_url} never listed model {MODEL}")


def _wait_for_idle(replica_urls: Sequence[str], timeout_s: float) -> None:
    """Until no replica has running or queued requests (a run's leftovers must not load the next)."""
    deadline_at = time.monotonic() + timeout_s
    while time.monotonic() < deadline_at:
        busy = 0
        for url in replica_urls:
            with urllib.request.urlopen(url + "/server_info", timeout=5) as response:
                state = orjson.loads(response.read())["internal_states"][0]
            busy += int(state["num_running_reqs"]) + int(state["num_queue_reqs"])
        if busy == 0:
            return
        time.sleep(0.5)
