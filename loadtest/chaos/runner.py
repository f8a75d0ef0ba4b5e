"""`polymorph bench chaos`: every scenario in turn, each on the deployment it needs; a table, then one JSON line.

Scenarios are grouped by the deployment they run against (faults, overload, idle streams); a group's
deployment is started once and torn down before the next. Adding a scenario is one entry in a
group's table; scenarios that need parts not wired into the gateway yet are listed in PENDING.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from loadtest.chaos.broken_files import broken_decision_log, broken_trial_store
from loadtest.chaos.controller_faults import CONTROLLER_SCENARIOS
from loadtest.chaos.faults import (
    FAULT_SCENARIOS,
    LOAD_KEY,
    MODEL,
    FaultRunner,
    FaultSettings,
    fault_plan,
)
from loadtest.chaos.fleet_faults import FLEET_SCENARIOS, FleetFaultSettings
from loadtest.chaos.hostile import hostile_input, run_schemathesis
from loadtest.chaos.pressure import (
    OverloadSettings,
    idle_plan,
    idle_streams,
    overload,
    overload_plan,
    raise_fd_limit,
    tier_overload,
    tier_overload_plan,
)
from loadtest.chaos.report import (
    Check,
    ScenarioResult,
    json_summary,
    render_table,
    skipped,
)
from loadtest.chaos.stack import ChaosStack

HOSTILE_SCENARIOS = ("hostile-input", "schemathesis")
PRESSURE_SCENARIOS = ("overload-3x", "tier-overload-3x", "idle-streams")
FILE_SCENARIOS = ("broken-decision-log", "broken-trial-store")
ALL_SCENARIOS = (*FAULT_SCENARIOS, *HOSTILE_SCENARIOS, *FLEET_SCENARIOS, *CONTROLLER_SCENARIOS, *FILE_SCENARIOS, *PRESSURE_SCENARIOS)

# Need parts not wired into the gateway yet.
PENDING: tuple[str, ...] = ()


async def _fault_group(names: Sequence[str], args: argparse.Namespace, run_dir: Path) -> list[ScenarioResult]:
    results = []
    with ChaosStack(fault_plan(), run_dir / "faults") as stack:
        runner = FaultRunner(stack, FaultSettings(args.rate, args.duration, args.reload_rate))
        for name in ["baseline", *(n for n in names if n in FAULT_SCENARIOS and n != "baseline")]:
            results.append(await FAULT_SCENARIOS[name](runner))  # type: ignore[misc]
            _progress(results[-1])
        if "hostile-input" in names:
            results.append(await hostile_input(stack, LOAD_KEY, MODEL, args.hostile_requests, args.tricklers))
            _progress(results[-1])
        if "schemathesis" in names:
            code, output = await asyncio.to_thread(run_schemathesis, stack.url, LOAD_KEY, args.schemathesis_examples, 0, 600)
            if code is None:
                results.append(skipped("schemathesis", output))
            else:
                tail = output.strip().splitlines()[-1] if output.strip() else ""
                results.append(ScenarioResult("schemathesis", 0, 0, 0, 0, 0, 0.0, (Check("schemathesis passes", code == 0, tail),)))
            _progress(results[-1])
    return results


async def _fleet_group(names: Sequence[str], args: argparse.Namespace, run_dir: Path) -> list[ScenarioResult]:
    """Each fleet scenario on its own deployment with the controller on (a rollback leaves a back-off behind)."""
    results = []
    # two or three replicas, one of them out during a step: a moderate rate, the point is the controller
    settings = FleetFaultSettings(rate_rps=min(args.rate, 50.0))
    scenarios = {**FLEET_SCENARIOS, **CONTROLLER_SCENARIOS}
    for name in (n for n in scenarios if n in names):
        results.append(await scenarios[name](run_dir / name, settings))
        _progress(results[-1])
    if "broken-decision-log" in names:
        results.append(await broken_decision_log(run_dir / "broken-decision-log", settings))
        _progress(results[-1])
    if "broken-trial-store" in names:
        results.append(await broken_trial_store(run_dir / "broken-trial-store"))
        _progress(results[-1])
    return results


async def _pressure_group(names: Sequence[str], args: argparse.Namespace, run_dir: Path) -> list[ScenarioResult]:
    results = []
    if "overload-3x" in names:
        with ChaosStack(overload_plan(), run_dir / "overload") as stack:
            results.append(await overload(stack, OverloadSettings(overload_s=args.overload_s)))
            _progress(results[-1])
    if "tier-overload-3x" in names:
        with ChaosStack(tier_overload_plan(), run_dir / "tier-overload") as stack:
            results.append(await tier_overload(stack, OverloadSettings(overload_s=args.overload_s)))
            _progress(results[-1])
    if "idle-streams" in names:
        # The gateway holds two descriptors a stream (client and replica): the open-file limit caps the count.
        limit = raise_fd_limit(2 * args.idle_streams + 4096)
        num_streams = min(args.idle_streams, (limit - 512) // 2)
        if num_streams < 1:
            results.append(skipped("idle-streams", f"open-file limit {limit} is too low"))
        else:
            if num_streams < args.idle_streams:
                print(f"chaos: idle-streams: open-file limit {limit} allows {num_streams} streams, not {args.idle_streams}", file=sys.stderr)
            with ChaosStack(idle_plan(), run_dir / "idle") as stack:
                results.append(await idle_streams(stack, num_streams))
        _progress(results[-1])
    return results


def _progress(result: ScenarioResult) -> None:
    state = "skipped" if result.skipped else ("pass" if result.passed else "FAIL")
    print(f"chaos: {result.name}: {state}", file=sys.stderr, flush=True)


async def run_all(args: argparse.Namespace, run_dir: Path) -> list[ScenarioResult]:
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()] if args.scenarios else list(ALL_SCENARIOS)
    unknown = sorted(set(names) - set(ALL_SCENARIOS))
    if unknown:
        raise SystemExit(f"bench chaos: unknown scenarios {', '.join(unknown)}; known: {', '.join(ALL_SCENARIOS)}")
    results = []
    if any(n in FAULT_SCENARIOS or n in HOSTILE_SCENARIOS for n in names):
        results += await _fault_group(names, args, run_dir)
    results += await _fleet_group(names, args, run_dir)
    results += await _pressure_group(names, args, run_dir)
    return results


def main_bench(args: argparse.Namespace) -> int:
    run_dir = Path(tempfile.mkdtemp(prefix="polymorph-chaos-"))
    results = asyncio.run(run_all(args, run_dir))
    summary = json_summary(results, PENDING)
    if not args.json_only:
        print(render_table(results))
        print(f"pending (need parts not wired into the gateway yet): {len(PENDING)}")
        for line in PENDING:
            print(f"  - {line}")
        print(f"logs: {run_dir}")
    print(json.dumps(summary, separators=(",", ":")))
    return 0 if summary["passed"] else 1
