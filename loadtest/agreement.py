"""``polymorph bench agreement``: one scenario with the adaptive policy in the simulator and live; do they agree?

Both sides get the same fleet (GPU kinds and counts), model, tiers and seeded requests, in fleet time:

* simulator: ``fleet.simulator.run.simulate(..., "adaptive", ...)`` on the scenario as written;
* live: a real ``polymorph serve`` on a temporary config (examples/demo.yaml's tiers, shapes and
  tenants) whose pools are the simulator's starting partition (adaptive starts with static-initial's
  plan, named ``<shape>@<gpu>`` as the controller names its pools, so the live controller sees the same
  fleet it would have planned), local emulated replicas at ``--speed`` X and the embedded controller
  on; the load test's runner replays the scenario X times faster (``polymorph demo``'s replay) and
  holds requests to the objectives divided by X.

Both sides admit by the same policy: the router given the tiers, and a bounded tier queue per pool
(``fleet.queueing.PoolQueue``; live, ``gateway.pool_wait``) in which a request waits for a replica's
room until half its tier's TTFT objective has passed, then is shed with 429.

Goodput is requests that met their tier's SLO per second of fleet time (the scenario's duration) on
both sides, so the two figures are the same unit. Moves and recompiles come from the simulator's
controller counters and from the live decision log (``plan`` decisions that moved replicas, the
replicas of ``recompile`` decisions), which the same controller code writes.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from fleet.decisions import read_decisions
from fleet.evidence import PlanEvidence, RecompileEvidence
from fleet.rollout import SlotState
from kernels.tiers import TierSlo, slo_for
from kernels.yamlsrc import load_yaml
from loadtest.record import RequestRecord
from loadtest.slo import meets_slo

TARGET_RATIO = 0.15  # the "within 15% on goodput"


@dataclass(frozen=True, slots=True)
class Side:
    """One side's figures, fleet time."""

    goodput_rps: float
    slo_attainment: float
    requests: int
    shed: int  # 429 before any token
    failed: int  # any other failure (dropped, error, unfinished)
    ttft_p99_s: float | None
    repartitions: int
    recompiles: int
    wall_s: float


def starting_pools(slots: Iterable[SlotState], model: str) -> list[dict[str, Any]]:
    """The config's ``fleet.pools`` for a partition: one pool per ``<shape>@<gpu>`` with its slots' count."""
    pool_to_slots: dict[str, list[SlotState]] = {}
    for slot in slots:
        pool_to_slots.setdefault(slot.pool, []).append(slot)
    return [
        {"name": name, "model": model, "gpu": found[0].gpu, "shapes": [name.split("@", 1)[0]],
         "engine": json.loads(found[0].config_json), "replicas": {"emulated": len(found)}}
        for name, found in sorted(pool_to_slots.items())
    ]


def live_config(base: Mapping[str, Any], pools: list[dict[str, Any]], speed: float, port: int, out_dir: Path,
                capacity_cache: str | None) -> dict[str, Any]:
    """``base`` (a gateway config) with these pools at ``speed``, the controller on, listening on ``port``."""
    from loadtest.demo import DEMO_CONFIG

    config = json.loads(json.dumps(base))  # a deep copy of plain YAML data
    config["server"] = {**config.get("server", {}), "host": "127.0.0.1", "port": port, "access_log": False}
    config["tenants_dir"] = str((DEMO_CONFIG.parent / config.get("tenants_dir", "../tenants")).resolve())
    controller = {"enabled": True, "tick_s": 5.0, "decision_log": str((out_dir / "live-decisions.jsonl").resolve())}
    if capacity_cache:
        controller["capacity_cache"] = capacity_cache  # the simulator's answers: the same predictions, and no waiting for them
    config["fleet"] = {"pools": pools, "emulator_speed": speed, "controller": controller}
    return config


def decision_counts(entries: Iterable[Mapping[str, Any]]) -> tuple[int, int]:
    """(repartitions, recompiles): plans that changed pool sizes, replicas recompiled in place. (The controller's own
    ``num_repartitions`` also counts a plan that only recompiles; the live side has no such counter, so both
    sides are counted from their decision logs.)"""
    repartitions = recompiles = 0
    for found in read_decisions(entries):
        evidence = found.evidence
        if isinstance(evidence, PlanEvidence) and evidence.outcome == "apply" and any(
            old != new for old, new in (evidence.diff or {}).values()
        ):
            repartitions += 1
        if isinstance(evidence, RecompileEvidence):
            recompiles += len(found.moves)
    return repartitions, recompiles


def live_side(records: Sequence[RequestRecord], fleet_duration_s: float, speed: float, tier_to_slo: Mapping[str, TierSlo],
              decisions: Iterable[Mapping[str, Any]], wall_s: float) -> Side:
    """The live run's figures in fleet time (records are on the wall clock of a fleet ``speed`` times faster)."""
    met = sum(meets_slo(r, slo_for(tier_to_slo, r.tier)) for r in records)
    ttfts = [r.ttft_s * speed for r in records if r.ok and r.ttft_s is not None]
    shed = sum(r.status == 429 for r in records)
    repartitions, recompiles = decision_counts(decisions)
    return Side(goodput_rps=met / fleet_duration_s, slo_attainment=met / len(records) if records else 1.0, requests=len(records),
                shed=shed, failed=sum(not r.ok for r in records) - shed,
                ttft_p99_s=float(np.percentile(ttfts, 99)) if ttfts else None,
                repartitions=repartitions, recompiles=recompiles, wall_s=wall_s)


def summary(args: argparse.Namespace, budget: Mapping[str, int], duration_s: float, simulated: Side, live: Side) -> dict[str, Any]:
    ratio = live.goodput_rps / simulated.goodput_rps if simulated.goodput_rps > 0 else None
    return {
        "bench": "agreement", "scenario": args.scenario, "fleet": dict(budget), "model": args.model, "rate_rps": args.rate,
        "duration_s": duration_s, "seed": args.seed, "speed": args.speed,
        "simulator": _rounded(asdict(simulated)), "live": _rounded(asdict(live)),
        "goodput_ratio_live_over_sim": None if ratio is None else round(ratio, 3),
        "within_target": ratio is not None and abs(ratio - 1) <= TARGET_RATIO,
    }


def _rounded(values: Mapping[str, Any]) -> dict[str, Any]:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in values.items()}


def table(simulated: Side, live: Side) -> str:
    rows = [f"{'side':<10} {'goodput':>8} {'SLO%':>6} {'requests':>8} {'shed':>5} {'failed':>6} {'ttft p99':>9} {'moves':>5} {'recomp':>6} {'wall s':>7}"]
    for name, s in (("simulator", simulated), ("live", live)):
        ttft = f"{s.ttft_p99_s:9.2f}" if s.ttft_p99_s is not None else f"{'-':>9}"
        rows.append(f"{name:<10} {s.goodput_rps:8.3f} {100 * s.slo_attainment:6.1f} {s.requests:8d} {s.shed:5d} {s.failed:6d} {ttft} "
                    f"{s.repartitions:5d} {s.recompiles:6d} {s.wall_s:7.1f}")
    return "\n".join(rows)


# -- the two runs ---------------------------------------------------------------------------------


def main_agreement(args: argparse.Namespace) -> int:
    from fleet.capacity import PerfCapacity
    from loadtest.demo import fleet_workload
    from loadtest.scenario import ScenarioError
    from loadtest.simulate import budget_from_args

    try:
        budget = budget_from_args(args)
        workload = fleet_workload(args.scenario, args.duration, args.rate, args.seed)
    except (ValueError, OSError, ScenarioError) as exc:
        print(f"polymorph bench agreement: {exc}")
        return 2
    out_dir = Path(args.out) if args.out else Path("runs") / time.strftime("agreement-%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    cache = None if args.no_cache else args.capacity_cache
    capacity = PerfCapacity(args.model, Path(cache) if cache else None)
    print(f"{workload.name}: {workload.num_requests} requests over {workload.duration_s:.0f} fleet s on {dict(budget)}; "
          f"live at {args.speed:g}x ({workload.duration_s / args.speed:.0f} wall s); outputs in {out_dir}", flush=True)
    simulated, slots = _simulate(workload, budget, capacity, args.model, out_dir)
    live = _live(args, workload, slots, out_dir, cache)
    print(table(simulated, live))
    print(json.dumps(summary(args, budget, workload.duration_s, simulated, live), sort_keys=True))
    return 0


def _simulate(workload: Any, budget: Mapping[str, int], capacity: Any, model: str, out_dir: Path) -> tuple[Side, list[SlotState]]:
    """The adaptive run, and its starting partition (static-initial's plan, deterministic) for the live fleet."""
    from fleet.decisions import DecisionLog
    from fleet.options import MoveCost
    from fleet.simulator.policies import setup
    from fleet.simulator.run import simulate
    from fleet.simulator.world import FleetSim, SimSettings
    from fleet.telemetry import Telemetry
    from kernels.tiers import DEFAULT_TIERS

    start = FleetSim(SimSettings(model), workload, Telemetry())
    setup("static-initial", start, budget, capacity, dict(DEFAULT_TIERS), DecisionLog(), MoveCost())
    path = out_dir / "sim-decisions.jsonl"
    path.unlink(missing_ok=True)  # a log reopened would bring an earlier run's decisions into the tail
    log = DecisionLog(path, max_tail=1_000_000)
    r = simulate(workload, "adaptive", budget, capacity, model, log)
    repartitions, recompiles = decision_counts(log.tail())  # counted as the live side's are
    side = Side(goodput_rps=r.goodput_rps, slo_attainment=r.slo_attainment, requests=r.num_requests, shed=r.shed_requests,
                failed=r.dropped_requests + r.unfinished_requests, ttft_p99_s=r.ttft_p99_s, repartitions=repartitions,
                recompiles=recompiles, wall_s=r.wall_s)
    return side, start.slot_states(0.0)


def _live(args: argparse.Namespace, workload: Any, slots: list[SlotState], out_dir: Path, cache: str | None) -> Side:
    from fleet.actuators.local import free_port
    from loadtest.demo import DEMO_CONFIG, decisions_since, fleet_time_slos, get_json, start_deployment
    from loadtest.demo_credentials import DEMO_ADMIN_TOKEN, DEMO_API_KEY
    from loadtest.runner import RunnerConfig, run
    from loadtest.transform import speed_up

    port = free_port()
    config = live_config(load_yaml(DEMO_CONFIG).data, starting_pools(slots, args.model), args.speed, port, out_dir, cache)
    config_path = out_dir / "live-config.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    base = f"http://127.0.0.1:{port}"
    deployment = start_deployment(config_path, base, out_dir / "gateway.log")
    try:
        state = get_json(f"{base}/admin/state", DEMO_ADMIN_TOKEN)
        tier_to_slo = fleet_time_slos(state.get("tiers") or {}, args.speed)
        runner = RunnerConfig(target_url=base, api_key=DEMO_API_KEY, admin_token=DEMO_ADMIN_TOKEN, progress=not args.no_progress,
                              drain_timeout_s=max(30.0, 600.0 / args.speed))
        started_at = time.time()
        result = run(speed_up(workload, args.speed), runner, tier_to_slo)
        wall_s = time.time() - started_at
        entries = get_json(f"{base}/admin/decisions?limit=10000", DEMO_ADMIN_TOKEN).get("decisions", [])
    finally:
        deployment.stop()
    return live_side(result.records, workload.duration_s, args.speed, tier_to_slo, decisions_since(entries, started_at), wall_s)
