"""The `polymorph bench gateway`, `peers` and `dashboard` entries; loadtest/cli.py's ``register_bench`` calls ``register_bench`` here."""

from __future__ import annotations

import argparse

from kernels.argtypes import count, counts, non_negative, positive, seed
from loadtest.sim_cli import _add_capacity_args

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
    parser.add_argument("--duration", type=positive, default=10.0, help="seconds per measurement")
    parser.add_argument("--rounds", type=count, default=3, help="alternating rounds per phase (figures are medians)")
    parser.add_argument("--soak-s", type=non_negative, default=300.0, help="seconds of the memory soak (0 skips it)")
    parser.add_argument(
        "--connections", type=counts, default=(16, 64, 128),
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
    _register_peers(benches)
    _register_dashboard(benches)


def _register_dashboard(benches: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add `polymorph bench dashboard`."""
    parser = benches.add_parser(
        "dashboard",
        help="added request latency p50/p99 with and without a dashboard polling the admin API",
        description=(
            "Measure what an open dashboard costs the request path: the gateway in front of the fixed-cost nginx "
            "backend of `bench gateway`, wrk at a constant rate, rounds alternating direct / gateway / gateway while "
            "dashboard clients poll /admin/state, /admin/series and /admin/decisions at the page's rate. Added "
            "latency = gateway minus direct in the same round. Prints a table, then one JSON line with the "
            "with/without ratios."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--rate", type=positive, default=500.0, help="constant request rate in req/s")
    parser.add_argument("--duration", type=positive, default=10.0, help="seconds per run")
    parser.add_argument("--rounds", type=count, default=4, help="rounds, each measuring the three runs in alternating order")
    parser.add_argument("--clients", type=count, default=1, help="dashboard pages polling at once")
    parser.add_argument("--poll-s", type=positive, default=2.0, help="seconds between a page's polls (the page's POLL_MS)")
    parser.add_argument("--json-only", action="store_true", help="print only the JSON line on stdout")
    parser.add_argument("--no-pin", action="store_true", help="do not pin processes to CPUs with taskset")
    parser.add_argument("--no-install", action="store_true", help="never apt-get install missing wrk/nginx")
    parser.set_defaults(handler=_run_bench_dashboard)


def _run_bench_dashboard(args: argparse.Namespace) -> int:
    from loadtest.bench.dashboard_cost import main_bench_dashboard

    return main_bench_dashboard(args)


_PEERS_DESCRIPTION = """\
Polymorph side by side with the gateways people run today, in one run on this machine. Set-up
installs each peer at a pinned version into its own cached venv (~/.cache/polymorph/peers/<name>:
sglang-router, litellm[proxy], and sglang for its bench_serving), then every measurement runs in
a network namespace holding only loopback. Three parts:
raw: direct, nginx, sglang-router (cache_aware), LiteLLM proxy, Polymorph (1 process and
--workers 2) in front of one fixed-cost nginx backend; wrk measures peak req/s (alternating
rounds), CPU ms per request, resident memory, start-up time, and added latency p50/p99 at one
common rate every peer sustains.
routing: a heterogeneous emulated fleet (2 H100 replicas with a short-chat engine config, 2 H200
replicas with a long-context one) under a production-shaped workload (interactive chat and code
behind shared system prompts, long documents) at a rate that keeps it busy; goodput, SLO
attainment per tier (TTFT and TPOT objectives) and TTFT p99 for sglang-router round_robin and
cache_aware (its defaults), Polymorph with shape routing off (least load only) and on. The
emulated GPUs run at --speed 0.5, so the fleet is busy at a request rate two cores can proxy.
With --metric capacity, the routing part gives each router's capacity at SLO instead: the highest
multiplier of the workload's rate whose run keeps --slo-threshold overall and per tier (bracketing
and bisection to --resolution, at most --max-points runs per router, each router on a fresh fleet).
bench-serving: sglang's own `python -m sglang.bench_serving --backend sglang-oai` through
Polymorph, checking it completes every request it sent.
Prints the tables, then one JSON line last (ratios to Polymorph and the issue's targets).
"""


def _register_peers(benches: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add `polymorph bench peers`."""
    parser = benches.add_parser(
        "peers",
        help="Polymorph vs sglang-router, LiteLLM and nginx: proxy cost, routing quality, real clients",
        description=_PEERS_DESCRIPTION,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--parts", default="raw,routing,bench-serving",
        help="comma-separated subset of raw, routing, bench-serving",
    )
    parser.add_argument(
        "--peers", default="direct,nginx,sglang-router,litellm,polymorph,polymorph-w2",
        help="raw part: comma-separated subset of direct, nginx, sglang-router, litellm, polymorph, polymorph-w2",
    )
    parser.add_argument(
        "--quick", action="store_true",
        help="short runs (about 5 minutes in all): a smoke check, noisier figures",
    )
    parser.add_argument(
        "--duration", type=positive, default=None,
        help="raw part: seconds per wrk run (default 5; 2 with --quick)",
    )
    parser.add_argument(
        "--rounds", type=count, default=None,
        help="raw part: alternating rounds (default 3; 2 with --quick)",
    )
    parser.add_argument(
        "--connections", type=counts, default=(16, 64), help="raw part: connection counts swept for each peak",
    )
    parser.add_argument(
        "--rate", type=non_negative, default=0.0,
        help="raw part: the common rate in req/s (0: half the slowest peer's peak)",
    )
    parser.add_argument(
        "--routing-duration", type=positive, default=None,
        help="routing part: engine seconds of workload per run (default 15; 8 with --quick)",
    )
    parser.add_argument(
        "--routing-rounds", type=count, default=None,
        help="routing part: alternating rounds (default 2; 1 with --quick)",
    )
    parser.add_argument(
        "--routing-rate", type=non_negative, default=0.0,
        help="routing part: mean offered req/s in engine time (0: the scenario's own, 100 req/s)",
    )
    parser.add_argument(
        "--speed", type=positive, default=0.5,
        help="routing part: emulated GPUs run this many times real time (below 1: slower GPUs, fewer requests per wall second)",
    )
    parser.add_argument("--seed", type=seed, default=7, help="routing part: workload seed")
    parser.add_argument(
        "--metric", default="goodput", choices=("goodput", "capacity"),
        help="routing part: goodput at the offered rate, or each router's capacity at SLO (the highest multiplier of "
        "--routing-rate whose run keeps --slo-threshold overall and per tier; loadtest/bench/peers_routing_capacity.py)",
    )
    _add_capacity_args(parser)
    parser.set_defaults(resolution=0.15, max_points=5)  # a live point takes --routing-duration / --speed wall seconds
    parser.add_argument(
        "--num-prompts", type=count, default=None,
        help="bench-serving: requests sent (default 200; 60 with --quick)",
    )
    parser.add_argument("--json-only", action="store_true", help="print only the JSON line on stdout")
    parser.add_argument("--no-pin", action="store_true", help="do not pin processes to CPUs with taskset")
    parser.add_argument(
        "--no-install", action="store_true",
        help="never install anything; peers not yet installed are skipped",
    )
    parser.add_argument(
        "--no-netns", action="store_true",
        help="run in the host network instead of a loopback-only namespace",
    )
    parser.set_defaults(handler=_run_bench_peers)


def _run_bench_peers(args: argparse.Namespace) -> int:
    quick = args.quick
    for field, full, short in (("duration", 5.0, 2.0), ("rounds", 3, 2), ("routing_duration", 15.0, 8.0),
                               ("routing_rounds", 2, 1), ("num_prompts", 200, 60)):
        if getattr(args, field) is None:
            setattr(args, field, short if quick else full)
    from loadtest.bench.peers_routing_capacity import MAX_POINTS

    if not args.slo_threshold > 0 or args.max_points > MAX_POINTS:
        raise SystemExit(f"bench peers: --slo-threshold must be in (0, 1] and --max-points at most {MAX_POINTS}")
    from loadtest.bench.peers import main_bench_peers

    return main_bench_peers(args)


def _run_bench_gateway(args: argparse.Namespace) -> int:
    from loadtest.bench.harness import main_bench

    return main_bench(args)
