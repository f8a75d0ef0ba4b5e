"""The `polymorph bench chaos` entry; loadtest/cli.py's ``register_bench`` calls ``register_bench`` here."""

from __future__ import annotations

import argparse

from kernels.argtypes import count, count_or_zero, positive

_DESCRIPTION = """\
Break a real deployment (emulated replicas and a gateway, all local processes) and count what
happens to every request: sent, succeeded, retried, failed with a clear error, and lost (no
answer, a truncated stream without an error event, or past the deadline: must be 0). Scenarios:
replica faults under load (refused connections, 5xx, hang before the first byte, stall and crash
mid-stream, crash-exit and SIGKILL with restart and readmission), a pool overflowing to a spare
pool, a model's only pool down (503 + Retry-After), invalid config and tenant files under load,
hostile input (malformed, oversized, nested, invalid UTF-8, header tricks, trickling bodies),
schemathesis against GET /openapi.json (installed on first use into the cache's schemathesis-venv),
with the fleet controller on: a step whose replica never becomes healthy (rolled back), a pool
lost (overflow, then a plan for the GPUs left), `polymorph controller` SIGKILLed mid-rollout (a
standby finishes it, a restart adopts the fleet) or SIGSTOPped (partitioned) beside 2 gateways; a
corrupted then unwritable decision log under load and corrupted, locked and full trial stores; 3x overload (shed fast, memory flat, recovery), 3x
overload of mixed tiers (batch shed, interactive keeps its latency) and thousands of idle streams.
Prints a table, then one JSON line last; exits 1 if any scenario fails.
"""


def register_bench(benches: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add `polymorph bench chaos`."""
    parser = benches.add_parser(
        "chaos",
        help="faults, overload and hostile input against a live gateway: nothing lost",
        description=_DESCRIPTION,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--scenarios", default="", help="comma-separated subset (default: all)")
    parser.add_argument("--rate", type=positive, default=100.0, help="requests per second during fault scenarios")
    parser.add_argument("--duration", type=positive, default=4.0, help="seconds of load per fault scenario")
    parser.add_argument("--reload-rate", type=positive, default=300.0, help="requests per second while config files are broken")
    parser.add_argument("--overload-s", type=positive, default=30.0, help="seconds of 3x overload")
    parser.add_argument("--idle-streams", type=count_or_zero, default=10000, help="idle streaming clients held open at once")
    parser.add_argument("--hostile-requests", type=count_or_zero, default=2000, help="hostile requests (fixed corpus, then mutations)")
    parser.add_argument("--tricklers", type=count_or_zero, default=50, help="slowloris clients trickling their bodies meanwhile")
    parser.add_argument("--schemathesis-examples", type=count, default=50, help="schemathesis examples per operation")
    parser.add_argument("--json-only", action="store_true", help="print only the JSON line on stdout")
    parser.set_defaults(handler=_run_bench_chaos)


def _run_bench_chaos(args: argparse.Namespace) -> int:
    from loadtest.chaos.runner import main_bench

    return main_bench(args)
