"""Arguments of `polymorph simulate` and `polymorph bench adapt` (registered by loadtest/cli.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kernels.argtypes import count, fraction, positive, seed

POLICY_NAMES = ("round-robin", "static-initial", "static-hindsight", "adaptive", "oracle")
DEFAULT_COMPILE_TRIALS = 40


def _add_sim_args(p: argparse.ArgumentParser, fleet: str, rate: float | None, stretch: float) -> None:
    p.add_argument("--model", default="llama-3.1-8b", help="catalogue model every pool serves")
    p.add_argument("--fleet", default=fleet, help="GPU budget per kind, GPU:COUNT pairs")
    p.add_argument("--gpus", type=count, default=None, help="total GPUs, spread over --fleet's kinds in its proportions")
    p.add_argument("--rate", type=positive, default=rate,
                   help="scale the scenario to this mean request rate (req/s" + ("; default: the scenario's)" if rate is None else ")"))
    p.add_argument("--stretch", type=positive, default=stretch,
                   help="stretch the scenario's time axis this many times (phase onsets, periods, bursts), keeping --rate")
    p.add_argument("--seed", type=seed, default=None, help="workload seed (default: the scenario's)")
    p.add_argument("--capacity-cache", default=str(Path.home() / ".cache" / "polymorph" / "capacity.json"),
                   help="JSON file caching capacity-model answers between runs")
    p.add_argument("--no-cache", action="store_true", help="do not read or write --capacity-cache")


def _add_capacity_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--slo-threshold", type=fraction, default=0.90,
                   help="capacity: the SLO attainment (overall, every tier, every scenario phase or 5-minute trace window) a rate must keep")
    p.add_argument("--resolution", type=positive, default=0.02,
                   help="capacity: stop bisecting when the failing multiplier is within this fraction of the passing one")
    p.add_argument("--max-points", type=count, default=16, help="capacity: at most this many runs per search")


def _add_draws_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draws", type=count, default=1,
                   help="capacity: judge each point on this many seeds' runs pooled (--seed, --seed+1, ...; the same at "
                   "every point); one draw decides a point within its own noise (scenarios; a trace is one draw)")


def register_simulate(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = commands.add_parser(
        "simulate",
        help="run a fleet policy on a scenario or trace in virtual time",
        description=(
            "Replay a loadtest scenario or trace against a simulated fleet: the real router, drift detector, "
            "planner, rollout and controller, and one kernels.engine.Engine per replica, on a virtual clock. "
            "Policies: round-robin (one pool, default engine config), static-initial (best plan for the first "
            "10 minutes, frozen), static-hindsight (best fixed plan for the whole run), adaptive (Polymorph's "
            "controller; moves cost drain + restart), oracle (re-plans each minute, swaps for free). Prints goodput, "
            "SLO attainment, p99 TTFT/TPOT, repartitions, recompiles, shed (429 before any token) and dropped requests."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--scenario", help="a built-in scenario name (e.g. drift-step) or a scenario YAML path")
    source.add_argument("--trace", help="a trace file (see --format)")
    p.add_argument("--format", default="native", help="trace format: azure, burstgpt, mooncake, native")
    p.add_argument("--speedup", type=positive, default=None,
                   help="replay the trace this many times faster (inter-arrival gaps divided: bursts and mix kept); "
                   "or give a trace --rate")
    p.add_argument("--policy", default="adaptive", choices=POLICY_NAMES, help="fleet policy")
    p.add_argument("--duration", type=positive, default=None, help="seconds of traffic (default: the scenario's, times --stretch)")
    p.add_argument("--decisions", default=None, help="append the decision log (JSON lines) to this file")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--capacity", action="store_true",
                   help="find the capacity at SLO instead: the highest load multiplier whose run keeps --slo-threshold "
                   "(bracket by doubling and halving, then bisect to --resolution; the same seed at every point); prints "
                   "the attainment curve")
    _add_capacity_args(p)
    _add_draws_arg(p)
    p.add_argument("--compile", default="off", choices=("off", "analytic", "perf-model"),
                   help="run compiled engine configurations (kernels.compiler) searched with this evaluator; a compile "
                   "is computed at once but released to the adaptive controller --compile-s-per-trial virtual seconds "
                   "per trial later (plans made before the run, and the oracle's, get it at once)")
    p.add_argument("--compile-store", default=None,
                   help="trial store (SQLite) for --compile; default a fresh in-memory store, so runs repeat exactly")
    p.add_argument("--compile-trials", type=count, default=DEFAULT_COMPILE_TRIALS, help="trial budget of one compile")
    p.add_argument("--compile-s-per-trial", type=positive, default=1.7,
                   help="virtual seconds a compile trial takes (a perf-model trial costs the live worker ~1.7 CPU s)")
    _add_sim_args(p, "H100-SXM:8,H200:8", None, 1.0)
    p.set_defaults(handler=_run_simulate)


def register_bench_adapt(benches: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = benches.add_parser(
        "adapt",
        help="every named scenario x every fleet policy in the virtual-time simulator",
        description=(
            "Run `polymorph simulate` for each named scenario (stationary, drift-step, drift-ramp, diurnal, "
            "flash-crowd, tenant-mix) with each policy (round-robin, static-initial, static-hindsight, adaptive, "
            "oracle) on one fleet, print a table and, last, one JSON line with goodput per policy and the "
            "adaptive policy's ratios to the others (whole run and after the last drift onset). The default "
            "fleet, rate, stretch and duration are explained in fleet/README.md."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--scenarios", default=None, help="comma-separated subset of the named scenarios (default: all); '' for "
                   "none (with --metric capacity and --trace: the traces alone)")
    p.add_argument("--policies", default=None, help=f"comma-separated subset of {', '.join(POLICY_NAMES)} (default: all)")
    p.add_argument("--duration", type=positive, default=1800.0, help="seconds of traffic per scenario")
    p.add_argument("--quick", action="store_true", help="two scenarios, 240 s each (for tests)")
    p.add_argument("--metric", default="goodput", choices=("goodput", "capacity"),
                   help="goodput: at the offered --rate; capacity: each policy's capacity at SLO (see `polymorph simulate "
                   "--capacity`) and the smallest fleet that sustains the nominal rate")
    p.add_argument("--trace", action="append", default=[], help="capacity: also this trace file (repeatable; --format, --speedup)")
    p.add_argument("--format", default="native", help="trace format of --trace")
    p.add_argument("--speedup", type=positive, default=None, help="replay --trace this many times faster (default: as recorded)")
    p.add_argument("--no-fleet-search", action="store_true", help="capacity: skip the smallest-fleet search (GPUs saved)")
    p.add_argument("--json", action="store_true", help="capacity: print only the JSON object")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    p.add_argument("--workers", type=count, default=2,
                   help="runs (goodput) or searches (capacity) in this many processes at once; the figures do not depend on it")
    _add_capacity_args(p)
    _add_draws_arg(p)
    _add_sim_args(p, "H100-SXM:4,H200:4", 30.0, 2.0)
    p.set_defaults(handler=_run_bench_adapt)


def register_bench_agreement(benches: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = benches.add_parser(
        "agreement",
        help="one scenario with the adaptive policy in the simulator and live (emulated replicas); compare goodput",
        description=(
            "Run one scenario with the adaptive policy twice on the same fleet, model, tiers and seeded requests: "
            "in the virtual-time simulator, then live (a `polymorph serve` on a temporary config whose pools are the "
            "simulator's starting partition, emulated replicas at --speed, the embedded controller on; the load "
            "tester replays the scenario --speed times faster). Prints goodput (fleet-time req/s meeting their SLO), "
            "SLO attainment, moves and recompiles of both, a table and, last, one JSON line with the live/simulator "
            "goodput ratio. The live side takes --duration / --speed wall seconds plus start-up; keep the rate low "
            "on a small machine (the gateway, the load tester and every replica share its cores)."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--scenario", default=str(Path(__file__).resolve().parent.parent / "examples" / "drift-demo.yaml"),
                   help="a built-in scenario name or a scenario YAML path")
    p.add_argument("--duration", type=positive, default=None, help="fleet seconds of traffic (default: the scenario's)")
    p.add_argument("--speed", type=positive, default=10.0, help="emulated GPUs (and the controller's clock) this many times real time")
    p.add_argument("--out", default=None, help="folder for the live config, logs and decision logs (default: runs/agreement-<time>)")
    p.add_argument("--no-progress", action="store_true", help="no live progress line")
    _add_sim_args(p, "H100-SXM:2,H200:2", 1.5, 1.0)
    p.set_defaults(handler=_run_bench_agreement)


def _run_bench_agreement(args: argparse.Namespace) -> int:
    from loadtest.agreement import main_agreement

    return main_agreement(args)


def _run_simulate(args: argparse.Namespace) -> int:
    from loadtest.simulate import main_simulate

    # flags that would otherwise be read by nothing (before, each was ignored without a word)
    if args.trace and args.stretch != 1.0:
        print("polymorph simulate: --stretch stretches a scenario's phases; a trace keeps its own time axis (give --speedup or --rate)",
              file=sys.stderr)
        return 2
    if args.compile == "off" and (args.compile_store is not None or args.compile_trials != DEFAULT_COMPILE_TRIALS):
        print("polymorph simulate: --compile-store and --compile-trials need --compile analytic or perf-model", file=sys.stderr)
        return 2
    return main_simulate(args)


def _run_bench_adapt(args: argparse.Namespace) -> int:
    from loadtest.bench.adapt import main_bench

    return main_bench(args)
