"""`polymorph` subcommands owned by the loadtest package."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kernels.argtypes import count, count_or_zero, fraction, http_url, non_negative, port, positive, positives, seed
from loadtest.bench import cli as bench_cli
from loadtest.chaos import cli as chaos_cli
from loadtest.sim_cli import _add_capacity_args, register_bench_adapt, register_bench_agreement, register_simulate

_DESCRIPTION = """\
Replay production traffic (a trace) or a named scenario against any OpenAI-compatible endpoint
(Polymorph, sglang, vLLM, another gateway), open loop by default, and write results.json,
requests.jsonl and PNG plots to --out. Goodput counts requests that met their tier's TTFT and
TPOT objectives. Exit code 0 when the run completed (whatever the SLO attainment), 2 for bad
arguments or files, 3 when the target cannot be reached.

examples:
  polymorph loadtest --target http://127.0.0.1:8080 --api-key sk-polymorph-demo --scenario drift-step --out runs/a
  polymorph loadtest --target http://127.0.0.1:8080 --trace conv.csv --format azure --speedup 4 --duration 120 --out runs/b
  polymorph loadtest compare runs/a runs/b
  polymorph loadtest scenarios
"""


def _add_run_arguments(p: argparse.ArgumentParser) -> None:
    source = p.add_argument_group("workload (one of --scenario or --trace)")
    source.add_argument("--scenario", metavar="NAME|FILE", help="built-in scenario name or a scenario YAML file")
    source.add_argument("--trace", metavar="FILE", help="trace file to replay (FILE.gz is read compressed)")
    source.add_argument("--format", choices=("azure", "burstgpt", "mooncake", "native"), help="trace format")
    source.add_argument("--duration", type=positive, metavar="S", help="run length in seconds (default: the scenario's, or the whole trace)")
    source.add_argument("--start", type=non_negative, default=0.0, metavar="S", help="skip the first S seconds (after time scaling)")
    source.add_argument("--rate", type=positive, metavar="R", help="mean offered rate in requests/s (scenarios: scales every stream; traces: compresses time)")
    source.add_argument("--speedup", type=positive, metavar="X", help="trace time scaling: replay X times faster")
    source.add_argument("--seed", type=seed, help="seed for generation and assignment (default: the scenario's; 0 for traces)")
    source.add_argument("--tenants", metavar="A=F,B=F", help="assign tenants by fraction, e.g. acme=0.7,globex=0.3")
    source.add_argument("--tiers", metavar="T=F,...", help="assign tiers by fraction, e.g. interactive=0.6,batch=0.4")
    source.add_argument("--domains", metavar="D=F,...", help="assign domains by fraction (traces carry none; default chat)")
    source.add_argument("--assign", metavar="FILE", help="YAML list of rules, e.g. [{set: tier, to: batch, min_input_tokens: 4096}]")
    target = p.add_argument_group("target")
    target.add_argument("--target", type=http_url, metavar="URL", help="base URL of the endpoint, e.g. http://127.0.0.1:8080")
    target.add_argument("--api-key", metavar="K", help="API key sent as a Bearer token")
    target.add_argument("--tenant-keys", metavar="MAP|FILE", help="per-tenant keys: acme=sk-1,globex=sk-2 or a YAML file (default: --api-key)")
    target.add_argument("--model", help="model id (default: the first of GET /v1/models)")
    target.add_argument("--admin-token", help="admin token for GET /admin/decisions (fleet events on the plots)")
    target.add_argument("--no-stream", action="store_true", help="non-streaming requests (no TTFT/ITL; goodput uses end-to-end)")
    target.add_argument("--concurrency", type=count, metavar="N", help="closed loop with N concurrent requests instead of the schedule")
    target.add_argument("--timeout", type=positive, default=600.0, metavar="S", help="per-request timeout")
    target.add_argument("--drain-timeout", type=non_negative, default=120.0, metavar="S", help="wait after the last send before giving up on responses")
    slo = p.add_argument_group("objectives")
    slo.add_argument("--slo", metavar="FILE", help="YAML with tiers: {TIER: {ttft_p99_s, tpot_p99_s}} (a Polymorph config works)")
    slo.add_argument("--slo-ttft", action="append", metavar="TIER=S", help="override one tier's TTFT objective")
    slo.add_argument("--slo-tpot", action="append", metavar="TIER=S", help="override one tier's TPOT objective")
    out = p.add_argument_group("output")
    out.add_argument("--out", metavar="DIR", help="output folder (required)")
    out.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    out.add_argument("--no-progress", action="store_true", help="no live progress line")
    out.add_argument("--dry-run", action="store_true", help="write the workload to DIR/workload.jsonl (native format) and send nothing")
    capacity = p.add_argument_group("capacity at SLO (loadtest/live_capacity.py; also --slo-threshold, --resolution, --max-points)")
    capacity.add_argument("--capacity", action="store_true",
                          help="find the highest rate multiplier whose open-loop run keeps --slo-threshold (overall, per tier, per "
                          "scenario phase or 5-minute trace window): bracket and bisect, one run per point, the same seed every point; "
                          "prints the attainment curve (--out: capacity.json and each point's results)")
    capacity.add_argument("--max-duration-s", type=positive, default=900.0, metavar="S",
                          help="capacity: wall-time budget; a point starts only if its traffic and --drain-timeout fit in what is left")
    capacity.add_argument("--json", action="store_true", help="capacity: print one JSON object instead of the curve")


def register(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add this package's top-level subcommands."""
    p = commands.add_parser(
        "loadtest",
        help="replay traces or scenarios against an OpenAI-compatible endpoint; goodput, latency, plots",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_run_arguments(p)
    _add_capacity_args(p)
    p.set_defaults(handler=_run_loadtest)
    sub = p.add_subparsers(dest="loadtest_command", metavar="[compare|scenarios|fast-backend]")
    compare = sub.add_parser("compare", help="two runs side by side with ratios", description="Print a side-by-side table of two runs' results.json with B/A ratios, overall and per tier.")
    compare.add_argument("a", metavar="A/", help="first run's output folder")
    compare.add_argument("b", metavar="B/", help="second run's output folder")
    compare.set_defaults(handler=_run_compare)
    scenarios = sub.add_parser("scenarios", help="list the built-in scenarios", description="List the built-in scenarios with their descriptions.")
    scenarios.set_defaults(handler=_run_scenarios)
    backend = sub.add_parser(
        "fast-backend",
        help="a fast OpenAI stub server for measuring clients",
        description="Serve a minimal OpenAI-compatible stub that answers at once (or after fixed delays).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_fast_backend_arguments(backend)
    backend.set_defaults(handler=_run_fast_backend)
    register_simulate(commands)
    _register_demo(commands)


_DEMO_DESCRIPTION = """\
Watch Polymorph adapt. Against a running deployment this prints the dashboard's address (--open
opens it in a browser), replays a drift scenario through the gateway with the load tester, printing
each decision the controller takes (drift, plan, step, verify, rollback) as it happens, then writes
results.json, requests.jsonl and the plots (latency CDFs; goodput and p99 TTFT over time with the fleet
changes marked; the traffic mix) to --out and sums the decisions up.

Scenarios are in fleet time: emulated GPUs at speed X (the config's fleet.emulator_speed) run X times
faster than real time, and so does the controller's clock. The demo replays the scenario X times
faster (X times the request rate) and holds requests to the tier objectives divided by X. The default
scenario, examples/drift-demo.yaml, is 2000 s of fleet time: 200 s against examples/demo.yaml
(speed 10), 33 minutes against the plain `make run` (speed 1). The controller's re-plan is CPU work in
the gateway: on a small or busy machine (two cores) add --rate 1.5, or the drift's re-plan may land
after the replay has ended. Exit code 0 when the replay completed, 2 for bad arguments or a refused
admin token, 3 when no gateway answers.

examples:
  make run CONFIG=examples/demo.yaml      # in one terminal: the example fleet at 10x real time
  polymorph demo --open                   # in another
  polymorph demo --start                  # or let the demo start (and at the end stop) that deployment
  polymorph demo --scenario drift-ramp --rate 4 --out runs/ramp
"""


def _register_demo(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from loadtest.demo_credentials import DEMO_ADMIN_TOKEN, DEMO_API_KEY

    p = commands.add_parser(
        "demo",
        help="replay a drift through a running deployment and watch the controller adapt (dashboard, decisions, plots)",
        description=_DEMO_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--url", type=http_url, default="http://127.0.0.1:8080", help="the gateway's base URL (default: %(default)s)")
    p.add_argument("--admin-token", default=DEMO_ADMIN_TOKEN, help="the gateway's admin token (default: the demo's)")
    p.add_argument("--api-key", default=DEMO_API_KEY, help="the API key requests are sent with (default: the demo tenant's)")
    p.add_argument("--open", action="store_true", help="open the dashboard in a web browser")
    p.add_argument("--scenario", metavar="NAME|FILE",
                   help="scenario to replay: a built-in name (`polymorph loadtest scenarios`) or a file (default: examples/drift-demo.yaml)")
    p.add_argument("--speed", type=positive, metavar="X",
                   help="replay X times faster than the scenario (default: the emulated replicas' speed, read from them)")
    p.add_argument("--duration", type=positive, metavar="S", help="fleet seconds of the scenario to play (default: all of it)")
    p.add_argument("--rate", type=positive, metavar="R", help="mean request rate in fleet time (default: the scenario's)")
    p.add_argument("--seed", type=seed, help="workload seed (default: the scenario's)")
    p.add_argument("--out", metavar="DIR", help="output folder (default: runs/demo-<date>-<time>)")
    p.add_argument("--no-progress", action="store_true", help="no live progress line")
    start = p.add_argument_group("starting the deployment")
    start.add_argument("--start", action="store_true",
                       help="when nothing answers at --url, start `polymorph serve --config CONFIG` there, and stop it at the end")
    start.add_argument("--config", type=Path, default=None, metavar="FILE",
                       help="config for --start (default: examples/demo.yaml, 4 emulated GPUs at 10x real time)")
    start.add_argument("--keep-running", action="store_true",
                       help="with --start: keep the deployment and its dashboard up after the replay, until Ctrl-C")
    p.set_defaults(handler=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from loadtest.demo import DEMO_CONFIG, DEMO_SCENARIO, main_demo

    args.config = args.config or DEMO_CONFIG
    args.scenario = args.scenario or str(DEMO_SCENARIO)
    return main_demo(args)


def add_fast_backend_arguments(parser: argparse.ArgumentParser) -> None:
    """The fast stub backend's options (here, so that `polymorph --help` imports no server code)."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=port, default=8001, help="port to listen on")
    parser.add_argument("--model", default="fast-backend", help="model id it reports")
    parser.add_argument("--ttft-ms", type=non_negative, default=0.0, help="delay before the first token")
    parser.add_argument("--itl-ms", type=non_negative, default=0.0, help="delay between tokens")
    parser.add_argument("--routing-headers", action="store_true", help="send x-polymorph-* routing headers")
    parser.add_argument("--decisions", type=Path, default=None, help="JSONL file served at /admin/decisions")


def _run_loadtest(args: argparse.Namespace) -> int:
    if not args.out and not args.capacity:  # a dry run writes DIR/workload.jsonl
        print("error: --out DIR is required (see polymorph loadtest --help)", file=sys.stderr)
        return 2
    from loadtest.main import main_loadtest

    return main_loadtest(args)


def _run_compare(args: argparse.Namespace) -> int:
    from loadtest.compare import main_compare

    return main_compare(Path(args.a), Path(args.b))


def _run_scenarios(args: argparse.Namespace) -> int:
    from loadtest.scenario import builtin_names, load_scenario

    for name in builtin_names():
        scenario = load_scenario(name)
        print(f"{name} ({scenario.duration_s:.0f} s, ~{scenario.mean_rate_rps(scenario.duration_s):.1f} req/s)")
        print(f"    {scenario.description}\n")
    return 0


def _run_fast_backend(args: argparse.Namespace) -> int:
    from loadtest.fast_backend import serve

    return serve(args)


def register_bench(benches: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add this package's `polymorph bench` entries: the gateway's benchmarks and chaos suite first."""
    bench_cli.register_bench(benches)
    chaos_cli.register_bench(benches)
    p = benches.add_parser(
        "loadgen",
        help="load generator accuracy: achieved vs target rate and scheduling error, swept over rates",
        description=(
            "Start the fast stub backend in a subprocess, drive short non-streaming requests at a sweep of "
            "Poisson rates, and report achieved vs target rate and scheduling-error percentiles per trial. "
            "A trial passes when achieved is within 2% of target and the scheduling error p99 is <= 5 ms; the "
            "last JSON line names the highest passing rate."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--rates", type=positives, default="500,1000,1500,2000", help="comma-separated rates in requests/s")
    p.add_argument("--duration", type=positive, default=6.0, help="seconds per trial")
    p.add_argument("--trials", type=count, default=3, help="trials per rate (each with its own seed)")
    p.add_argument("--seed", type=seed, default=0, help="arrival seed")
    p.set_defaults(handler=_run_bench_loadgen)
    register_bench_adapt(benches)
    register_bench_agreement(benches)
    _register_bench_priority(benches)
    _register_bench_instructions(benches)


def _register_bench_instructions(benches: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = benches.add_parser(
        "instructions",
        help="the gateway's CPU instructions per request, counted by callgrind (optionally against another checkout)",
        description=(
            "Run a gateway under valgrind's callgrind in front of four stub backends in two pools, send a fixed request "
            "mix (shared-prefix chats, unique chats, long prompts, streams) one at a time, and report instructions per "
            "request: the median over rounds. With --baseline-tree, another checkout of this repository is measured in "
            "the same run (rounds alternate) and the JSON line gives current/baseline. Needs valgrind."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--requests", type=count, default=200, help="requests counted per round")
    p.add_argument("--rounds", type=count, default=3, help="rounds per tree (the figure is the median)")
    p.add_argument("--warmup", type=count_or_zero, default=40, help="requests sent before counting starts")
    p.add_argument("--baseline-tree", metavar="DIR", help="another checkout to compare with (e.g. `git worktree add DIR main`)")
    p.add_argument("--run-dir", help="keep the logs and callgrind dumps here (default: a temporary folder)")
    p.set_defaults(handler=_run_bench_instructions)


def _run_bench_instructions(args: argparse.Namespace) -> int:
    from loadtest.bench.instructions import main_bench

    return main_bench(args)


def _register_bench_priority(benches: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = benches.add_parser(
        "priority",
        help="interactive TTFT p99 under a batch flood into one real vLLM replica, with and without tier priorities",
        description=(
            "Start one vLLM replica of the tiny model (CPU build) with --scheduling-policy priority and a small batch, "
            "and a gateway in front of it whose tiers set each request's priority. Measure interactive TTFT alone, "
            "under a closed-loop batch flood with priorities, and under the same flood without them (a pool of the "
            "same replica that sends none). Prints a table, then one JSON line of ratios."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--interactive", type=count, default=12, help="interactive requests per phase")
    p.add_argument("--interactive-every", type=positive, default=0.6, metavar="S", help="seconds between interactive sends")
    p.add_argument("--interactive-max-tokens", type=count, default=8, help="output tokens of each interactive request")
    p.add_argument("--flood-concurrency", type=count, default=16, help="closed-loop batch clients during the flood phases")
    p.add_argument("--flood-max-tokens", type=count, default=32, help="output tokens of each batch request (ignore_eos)")
    p.add_argument("--flood-warmup", type=non_negative, default=3.0, metavar="S", help="flood time before the first interactive send")
    p.add_argument("--rounds", type=count, default=3, help="the phases run in this many rounds (each with a share of the interactive "
                   "requests), side by side, so the host's other load weighs on each phase alike")
    p.add_argument("--max-num-seqs", type=count, default=4, help="vLLM's batch size: the flood beyond it queues inside the engine")
    p.add_argument("--urgent-reserve", type=fraction, default=0.25, metavar="F",
                   help="router.urgent_reserve of the priority pool: the share of the engine's batch the gateway keeps from batch requests "
                        "(they wait in its queue), so an interactive request starts at the next step; 0: batch may fill it")
    p.add_argument("--urgent-window", type=positive, default=30.0, metavar="S",
                   help="router.urgent_window_s: the reserve is the share, or the interactive requests in flight at once within this "
                        "window plus one, when more (0: the share alone)")
    p.add_argument("--start-timeout", type=positive, default=300.0, metavar="S", help="how long vLLM may take to become healthy")
    p.add_argument("--vllm-python", help="python of a vLLM venv (default: fleet.engines.install.vllm_python(), installed on first use)")
    p.add_argument("--model-dir", help="Hugging Face model folder (default: fleet.engines.install.tiny_model_hf())")
    p.add_argument("--run-dir", help="keep the engine's and gateway's logs and config here (default: a temporary folder)")
    p.set_defaults(handler=_run_bench_priority)


def _run_bench_priority(args: argparse.Namespace) -> int:
    from loadtest.bench.priority import main_bench

    return main_bench(args)


def _run_bench_loadgen(args: argparse.Namespace) -> int:
    from loadtest.bench.loadgen import main_bench

    return main_bench(args)
