"""`polymorph bench dashboard`: what an open dashboard costs the request path.

The gateway (`polymorph serve --upstream`, one pinned core) fronts the fixed-cost nginx backend of
`bench gateway`; wrk sends chat requests at a constant rate. Each round measures three runs in
alternating order: direct to the backend, the gateway alone (A), and the gateway while dashboard
clients poll what the page polls (``/admin/state``, ``/admin/series?window_s=3600``, ``/admin/decisions``
every 2 s, the page's POLL_MS). Added latency is the gateway's percentile minus the direct one of the
same round; the JSON line gives the medians and the B/A ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import orjson

from loadtest.bench import load, payloads
from loadtest.bench.load import WrkResult
from loadtest.bench.processes import default_pinning
from loadtest.bench.stack import Target, start_backend, start_target
from loadtest.bench.tools import SetupError, ensure_tools
from loadtest.demo_credentials import DEMO_ADMIN_TOKEN
from loadtest.procs import ProcessRegistry

POLL_PATHS = ("/admin/state", "/admin/series?window_s=3600", "/admin/decisions")
RUNS = ("direct", "gateway", "gateway+dashboard")


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class DashboardClients:
    """``num_clients`` pages' worth of polling, each every ``every_s``, from one thread; records each poll's time."""

    def __init__(self, base_url: str, num_clients: int, every_s: float) -> None:
        self.base_url = base_url
        self.num_clients = num_clients
        self.every_s = every_s
        self.poll_ms: list[float] = []
        self.num_failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dashboard-clients", daemon=True)

    def _poll(self) -> None:
        started = time.perf_counter()
        for path in POLL_PATHS:
            request = urllib.request.Request(self.base_url + path, headers={"Authorization": f"Bearer {DEMO_ADMIN_TOKEN}"})
            try:
                with urllib.request.urlopen(request, timeout=5) as response:
                    response.read()
            except (urllib.error.URLError, OSError):
                self.num_failures += 1
        self.poll_ms.append((time.perf_counter() - started) * 1000)

    def _run(self) -> None:
        # the clients' polls spread evenly over the period, as independent pages' timers would be
        gap_s = self.every_s / self.num_clients
        while not self._stop.wait(gap_s):
            self._poll()

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


@dataclass(frozen=True, slots=True)
class Round:
    direct: WrkResult
    gateway: WrkResult
    dashboard: WrkResult


def run_order(round_index: int) -> tuple[str, ...]:
    """A B C, then C B A: drift in the machine's load falls on every run alike."""
    return RUNS if round_index % 2 == 0 else tuple(reversed(RUNS))


def summarize(rounds: Sequence[Round], rate_rps: float, poll_ms: Sequence[float], settings: dict[str, object]) -> dict[str, Any]:
    def added(pick: str, run: str) -> float:
        values = [getattr(getattr(r, run), pick) - getattr(r.direct, pick) for r in rounds]
        return round(statistics.median(values), 3)

    off = {"p50": added("p50_ms", "gateway"), "p99": added("p99_ms", "gateway")}
    on = {"p50": added("p50_ms", "dashboard"), "p99": added("p99_ms", "dashboard")}
    return {
        "bench": "dashboard",
        "rate_rps": rate_rps,
        "added_latency_ms": {"without_dashboard": off, "with_dashboard": on},
        "ratio_p50": round(on["p50"] / off["p50"], 3) if off["p50"] > 0 else None,
        "ratio_p99": round(on["p99"] / off["p99"], 3) if off["p99"] > 0 else None,
        "direct_ms": {"p50": round(statistics.median(r.direct.p50_ms for r in rounds), 3),
                      "p99": round(statistics.median(r.direct.p99_ms for r in rounds), 3)},
        "dashboard_poll_ms": {"count": len(poll_ms), "p50": round(statistics.median(poll_ms), 2) if poll_ms else None,
                              "max": round(max(poll_ms), 2) if poll_ms else None},
        "errors": sum(getattr(r, run).num_errors for r in rounds for run in ("direct", "gateway", "dashboard")),
        "settings": settings,
    }


def main_bench_dashboard(args: argparse.Namespace) -> int:
    try:
        tool_to_path = ensure_tools(install=not args.no_install, say=_say)
    except SetupError as problem:
        _say(f"bench dashboard: {problem}")
        return 2
    pinning = default_pinning(pin=not args.no_pin)
    _say(f"bench dashboard: {args.rounds} rounds of {args.duration:.0f} s at {args.rate:.0f} req/s; "
         f"{args.clients} dashboard client(s) polling every {args.poll_s:g} s; {pinning.describe()}")
    with tempfile.TemporaryDirectory(prefix="polymorph-bench-dashboard-") as tmp, ProcessRegistry(Path(tmp)) as registry:
        run_dir = Path(tmp)
        backend = start_backend(registry, run_dir, tool_to_path["nginx"], pinning)
        direct = start_target("direct", registry, run_dir, backend, tool_to_path["nginx"], pinning, ())
        gateway = start_target("gateway", registry, run_dir, backend, tool_to_path["nginx"], pinning, ("--no-access-log",))
        script = load.write_script(run_dir / "rate.lua", payloads.chat_request_body(False), args.rate)
        connections = load.connections_for_rate(args.rate)

        def measure(target: Target) -> WrkResult:
            return load.run_wrk(tool_to_path["wrk"], target.json_url, script, connections, args.duration, pinning.client_cpus)

        measure(gateway)  # warm-up: first connections, imports, the series' first buckets
        gateway_base = gateway.json_url.split("/v1/", 1)[0]
        rounds: list[Round] = []
        poll_ms: list[float] = []
        for index in range(args.rounds):
            results: dict[str, WrkResult] = {}
            for run in run_order(index):
                if run == "gateway+dashboard":
                    with DashboardClients(gateway_base, args.clients, args.poll_s) as clients:
                        results[run] = measure(gateway)
                    poll_ms.extend(clients.poll_ms)
                    if clients.num_failures:
                        _say(f"  {clients.num_failures} dashboard polls failed")
                else:
                    results[run] = measure(direct if run == "direct" else gateway)
                result = results[run]
                _say(f"  round {index + 1} {run:18s} {result.rps:7.0f} req/s  p50 {result.p50_ms:.3f} ms  p99 {result.p99_ms:.3f} ms"
                     + (f"  {result.num_errors} errors" if result.num_errors else ""))
            rounds.append(Round(results["direct"], results["gateway"], results["gateway+dashboard"]))
    settings = {"duration_s": args.duration, "rounds": args.rounds, "clients": args.clients, "poll_s": args.poll_s,
                "pinning": pinning.describe()}
    summary = summarize(rounds, args.rate, poll_ms, settings)
    if not args.json_only:
        added = summary["added_latency_ms"]
        print(f"added latency over direct at {args.rate:.0f} req/s (median of {args.rounds} rounds)")
        print(f"  without dashboard  p50 {added['without_dashboard']['p50']:.3f} ms  p99 {added['without_dashboard']['p99']:.3f} ms")
        print(f"  with dashboard     p50 {added['with_dashboard']['p50']:.3f} ms  p99 {added['with_dashboard']['p99']:.3f} ms")
        print(f"  ratio with/without p50 {summary['ratio_p50']}  p99 {summary['ratio_p99']}")
    print(orjson.dumps(summary).decode(), flush=True)
    return 0
