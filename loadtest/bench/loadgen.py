"""`polymorph bench loadgen`: how precisely the load generator keeps its schedule, rate by rate.

The fast stub backend runs in a subprocess (it measures the generator, not a server). For each
rate, seeded Poisson arrivals of short non-streaming requests (32 prompt tokens, 8 output tokens)
run for a fixed time; a rate passes when the achieved rate is within 2% of the target and the
scheduling error p99 is at most 5 ms. Each rate runs several trials, because on a shared machine
other processes preempting the generator show up as scheduling error; the table shows every trial
and the summary says how many passed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import numpy as np

from loadtest.arrivals import ArrivalProcess, arrival_times, check_arrivals
from loadtest.fast_backend import fast_backend_process
from loadtest.metrics import MAX_LAG_P99_MS, MAX_RATE_SHORTFALL, generator_health
from loadtest.runner import RunnerConfig, run
from loadtest.spec import RequestSpec, make_workload

_INPUT_TOKENS = 32
_OUTPUT_TOKENS = 8


def measure_rate(url: str, rate_rps: float, duration_s: float, seed: int) -> dict[str, Any]:
    times = arrival_times(ArrivalProcess("poisson", rate_rps), duration_s, np.random.default_rng(seed))
    specs = [RequestSpec(float(at_s), _INPUT_TOKENS, _OUTPUT_TOKENS, label="bench") for at_s in times]
    workload = make_workload(f"loadgen-{rate_rps:g}", specs, duration_s)
    config = RunnerConfig(target_url=url, stream=False, progress=False, request_timeout_s=30, drain_timeout_s=30)
    result = run(workload, config)
    health = generator_health(result.records, "open-loop")
    target, achieved = health["target_rate"], health["achieved_rate"]
    lag = health["scheduling_error_ms"]
    return {
        "rate_rps": rate_rps,
        "requests": len(result.records),
        "errors": sum(not record.ok for record in result.records),
        "target_rate": target,
        "achieved_rate": achieved,
        "rate_error": (achieved - target) / target if target and achieved else None,
        "lag_p50_ms": lag["p50"],
        "lag_p90_ms": lag["p90"],
        "lag_p99_ms": lag["p99"],
        "lag_max_ms": lag["max"],
        "passes": bool(health["generator_kept_up"]),
    }


def main_bench(args: argparse.Namespace) -> int:
    rates: tuple[float, ...] = args.rates
    try:  # before the backend starts: a rate no schedule can hold is the flag's fault
        for rate_rps in rates:
            check_arrivals(rate_rps, args.duration)
    except ValueError as exc:
        print(f"polymorph bench loadgen: --rates: {exc}", file=sys.stderr)
        return 2
    rows = []
    print(f"{'rate':>7} {'trial':>5} {'reqs':>6} {'achieved':>9} {'err%':>6} {'lag p50':>8} {'p90':>7} {'p99':>7} "
          f"{'max':>7} {'fails':>5}  pass")
    with fast_backend_process() as url:
        for rate_rps in rates:
            trials = []
            for trial in range(args.trials):
                point = measure_rate(url, rate_rps, args.duration, args.seed + trial)
                trials.append(point)
                print(
                    f"{rate_rps:7.0f} {trial + 1:5d} {point['requests']:6d} {point['achieved_rate']:9.1f} "
                    f"{point['rate_error'] * 100:6.2f} {point['lag_p50_ms']:8.2f} {point['lag_p90_ms']:7.2f} "
                    f"{point['lag_p99_ms']:7.2f} {point['lag_max_ms']:7.1f} {point['errors']:5d}  "
                    f"{'yes' if point['passes'] else 'no'}",
                    flush=True,
                )
            num_passing = sum(point["passes"] and point["errors"] == 0 for point in trials)
            rows.append({"rate_rps": rate_rps, "trials_passing": num_passing, "trials": trials})
    highest = max((row["rate_rps"] for row in rows if row["trials_passing"]), default=None)
    highest_all = max((row["rate_rps"] for row in rows if row["trials_passing"] == args.trials), default=None)
    print(f"criteria: achieved within {MAX_RATE_SHORTFALL:.0%} of target and scheduling error p99 <= "
          f"{MAX_LAG_P99_MS:.0f} ms; highest rate passing in at least one trial: {highest} req/s, "
          f"in every trial: {highest_all} req/s (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
    print(json.dumps({
        "bench": "loadgen",
        "highest_passing_rate_rps": highest,
        "highest_rate_passing_every_trial_rps": highest_all,
        "passes_at_1000_rps": any(row["rate_rps"] == 1000 and row["trials_passing"] for row in rows),
        "duration_s_per_trial": args.duration,
        "num_trials": args.trials,
        "load_average_1m": os.getloadavg()[0],
        "num_cpus": os.cpu_count(),
        "rates": rows,
    }))
    return 0
