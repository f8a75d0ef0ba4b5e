"""The `polymorph bench gateway` entry; the gateway's CLI registration calls ``register_bench``."""

from __future__ import annotations

import argparse

_DESCRIPTION = """\
Measure the gateway's request rate and added latency side by side with a direct connection, a
minimal aiohttp pass-through proxy (the ceiling for a Python proxy) and, when nginx is installed,
nginx as a reverse proxy, all in front of the same fixed-cost nginx backend. wrk drives the load:
a short connection sweep, the peak rate over alternating rounds (non-streaming and streaming),
latency at a constant rate of half the gateway's peak (added latency = variant minus direct, in the
same round), then a memory soak of the gateway under load. Missing wrk/nginx are installed with
apt-get when run as root. Processes are pinned with taskset: load generator and backend on CPU 0,
the proxy under test on CPU 1. Prints a table, then one JSON line last.
"""


def register_bench(benches: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add `polymorph bench gateway`."""
    parser = benches.add_parser(
        "gateway",
        help="gateway req/s and added latency vs direct, aiohttp pass-through and nginx",
        description=_DESCRIPTION,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per phase (figures are medians)")
    parser.add_argument("--soak-s", type=float, default=300.0, help="seconds of the memory soak (0 skips it)")
    parser.add_argument(
        "--connections", type=_positive_ints, default=(16, 64, 128),
        help="comma-separated connection counts swept to find each variant's peak",
    )
    parser.add_argument(
        "--variants", default="direct,passthrough,nginx,gateway",
        help="comma-separated subset of direct, passthrough, nginx, gateway",
    )
    parser.add_argument(
        "--gateway-arg", action="append", default=[], metavar="ARG",
        help="extra argument for `polymorph serve` (repeat it; e.g. --gateway-arg=--workers --gateway-arg=2)",
    )
    parser.add_argument("--json-only", action="store_true", help="print only the JSON line on stdout")
    parser.add_argument("--no-pin", action="store_true", help="do not pin processes to CPUs with taskset")
    parser.add_argument("--no-install", action="store_true", help="never apt-get install missing wrk/nginx")
    parser.set_defaults(handler=_run_bench_gateway)


def _positive_ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _run_bench_gateway(args: argparse.Namespace) -> int:
    if args.duration <= 0 or args.rounds < 1 or args.soak_s < 0:
        raise SystemExit("bench gateway: --duration must be > 0, --rounds >= 1 and --soak-s >= 0")
    from gateway.bench.harness import main_bench

    return main_bench(args)
