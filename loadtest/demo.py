"""`polymorph demo`: watch the control loop adapt a live deployment to a drift of the traffic mix.

Against a running gateway (`make run`, or one this command starts with ``--start``) it prints the
dashboard's address (``--open`` opens it), replays a drift scenario through the gateway with the load
test's runner while printing each decision the controller takes, then writes the load test's results
and plots and sums the decisions up.

Time. Emulated GPUs at speed X do X seconds of GPU work per wall second, and the controller's clock
(its warm-up, dwell and minimum time between plans) runs X times faster too. A scenario is written in
that fleet time, so the demo replays it X times faster (the same requests, X times the wall rate): the
fleet sees exactly the scenario. Latencies measured on the wall clock are X times shorter than the
emulated GPU's, so requests are held to the tier objectives divided by X.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import webbrowser
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from fleet.decisions import LoggedMove, read_decision
from fleet.evidence import DriftEvidence, PlanEvidence, RecompileEvidence, RollbackEvidence, StepEvidence, VerifyEvidence
from kernels.tiers import DEFAULT_TIERS, TierSlo
from loadtest import procs
from loadtest.demo_credentials import DEMO_ADMIN_TOKEN
from loadtest.spec import Workload

if TYPE_CHECKING:
    from loadtest.runner import RunnerConfig, RunResult

EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
DEMO_CONFIG = EXAMPLES / "demo.yaml"
DEMO_SCENARIO = EXAMPLES / "drift-demo.yaml"
_START_TIMEOUT_S = 180.0  # replicas start, the classifier loads
_WATCH_EVERY_S = 1.0


# -- pure parts -------------------------------------------------------------------------------


def fleet_workload(scenario: str, duration_s: float | None, rate_rps: float | None, seed: int | None) -> Workload:
    """The scenario in fleet time (what the simulator runs)."""
    from loadtest.scenario import build_workload, load_scenario

    return build_workload(load_scenario(scenario), duration_s, rate_rps, seed)


def demo_workload(scenario: str, speed: float, duration_s: float | None, rate_rps: float | None, seed: int | None) -> Workload:
    """The scenario in fleet time (``duration_s`` and ``rate_rps`` are fleet figures), replayed ``speed`` times faster."""
    from loadtest.transform import speed_up

    return speed_up(fleet_workload(scenario, duration_s, rate_rps, seed), speed)


def fleet_time_slos(tier_to_objectives: Mapping[str, Mapping[str, float]], speed: float) -> dict[str, TierSlo]:
    """The deployment's tier objectives (``/admin/state`` ``tiers``; the defaults without) on the wall
    clock of a fleet at ``speed``."""
    if not tier_to_objectives:
        return {tier: slo.sped_up(speed) for tier, slo in DEFAULT_TIERS.items()}
    return {
        tier: TierSlo(float(o["ttft_p99_s"]), float(o["tpot_p99_s"])).sped_up(speed)  # goodput reads only these two
        for tier, o in tier_to_objectives.items()
    }


def describe_decision(entry: Mapping[str, Any]) -> str:
    """One line a person can read; the dashboard and ``GET /admin/decisions`` hold the full evidence."""
    found = read_decision(entry)
    if found is None:  # not a decision this version reads: the gateway's own summary, else its kind
        return str(entry.get("summary") or entry.get("kind", "decision"))
    evidence = found.evidence
    if isinstance(evidence, DriftEvidence):
        shapes = evidence.mix_after.get("shapes") or {}
        total = sum(float(s.get("rate_rps", 0.0)) for s in shapes.values()) or 1.0
        mix = ", ".join(f"{name} {float(s.get('rate_rps', 0.0)) / total:.0%}" for name, s in sorted(shapes.items()))
        return f"drift detected ({evidence.reason}); mix now {mix or 'empty'}"
    if isinstance(evidence, PlanEvidence):
        changes = ", ".join(f"{pool} {old}->{new}" for pool, (old, new) in sorted((evidence.diff or {}).items())) or "no change"
        return (f"plan {evidence.outcome}: {changes}; predicted goodput "
                f"{_or_unknown(evidence.predicted_goodput_before_rps)} -> {_or_unknown(evidence.predicted_goodput_after_rps)} req/s")
    if isinstance(evidence, (StepEvidence, RecompileEvidence, RollbackEvidence)):
        moves = "; ".join(_move(m) for m in found.moves) or "-"
        extra = f" ({evidence.reason})" if isinstance(evidence, RollbackEvidence) else ""
        return f"{found.kind}: {moves}{extra}"
    if isinstance(evidence, VerifyEvidence):
        verdict = "kept" if evidence.ok else "worse than predicted"
        return (f"verify: observed goodput {_or_unknown(evidence.observed_goodput_rps)} vs predicted "
                f"{_or_unknown(evidence.predicted_goodput_rps)} req/s: {verdict}")
    return str(entry.get("summary") or found.kind)


def _or_unknown(value: float | None) -> str:
    return "?" if value is None else str(value)


def _move(move: LoggedMove) -> str:
    if move.from_pool != move.to_pool:
        return f"{move.slot} {move.from_pool} -> {move.to_pool}"
    return f"{move.slot} recompiled in {move.from_pool}"


def decisions_since(entries: Iterable[Mapping[str, Any]], started_at_unix_s: float) -> list[Mapping[str, Any]]:
    return [e for e in entries if isinstance(e.get("at_unix_s"), (int, float)) and e["at_unix_s"] >= started_at_unix_s]


def decision_summary(entries: list[Mapping[str, Any]], started_at_unix_s: float, speed: float) -> list[str]:
    """Counts by kind, then one line per decision at its time from the start (wall and fleet seconds)."""
    if not entries:
        return ["the controller took no decision during the demo (is fleet.controller enabled in the gateway's config?)"]
    counts = Counter(str(e.get("kind")) for e in entries)
    lines = [f"the controller took {len(entries)} decisions: " + ", ".join(f"{n} {kind}" for kind, n in counts.items())]
    for entry in entries:
        lines.append(f"  {_clock(float(entry['at_unix_s']) - started_at_unix_s, speed)}  {describe_decision(entry)}")
    return lines


def _clock(wall_s: float, speed: float) -> str:
    return f"+{wall_s:6.1f} s" if speed == 1 else f"+{wall_s:6.1f} s (fleet +{wall_s * speed:5.0f} s)"


# -- the deployment over HTTP --------------------------------------------------------------------


class AdminRefused(RuntimeError):
    """The admin API answered 401/403: a wrong admin token, or none configured."""


def get_json(url: str, token: str | None = None, timeout_s: float = 5.0) -> Any:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout_s) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as err:
        err.close()
        if err.code in (401, 403):
            raise AdminRefused(f"{url} answered {err.code}: pass the gateway's admin token with --admin-token") from None
        raise


def answers(base_url: str) -> bool:
    try:
        get_json(f"{base_url}/healthz", timeout_s=2.0)
        return True
    except (urllib.error.URLError, OSError, ValueError):
        return False


def fleet_speed(state: Mapping[str, Any]) -> float:
    """The emulated replicas' speed, from the first that answers ``/get_server_info``; 1 for real engines."""
    for pool in state.get("pools", []):
        for replica in pool.get("replicas", []):
            try:
                info = get_json(f"{replica['url']}/get_server_info", timeout_s=2.0)
            except (urllib.error.URLError, OSError, ValueError, KeyError):
                continue
            if isinstance(info, dict) and info.get("emulated") and float(info.get("speed", 0)) > 0:
                return float(info["speed"])
    return 1.0


@dataclass
class Deployment:
    """``polymorph serve`` started by the demo (``--start``)."""

    process: subprocess.Popen[bytes]
    log_path: Path

    def stop(self) -> None:
        procs.stop(self.process, grace_s=30.0)  # on SIGTERM serve stops its replicas on the way out


def start_deployment(config: Path, base_url: str, log_path: Path) -> Deployment:
    """``polymorph serve --config CONFIG`` on the URL's host and port; returns once ``/healthz`` answers."""
    where = urllib.parse.urlsplit(base_url)
    argv = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config),
            "--host", where.hostname or "127.0.0.1", "--port", str(where.port or 80)]
    try:
        process = procs.start_healthy(argv, f"{base_url}/healthz", log_path, _START_TIMEOUT_S)
    except RuntimeError as problem:
        raise RuntimeError(f"`polymorph serve --config {config}` did not come up at {base_url}: {problem}") from None
    return Deployment(process, log_path)


class DecisionWatcher:
    """Prints each new decision of the controller while the replay runs (a thread: the runner owns the event loop)."""

    def __init__(self, base_url: str, token: str, started_at_unix_s: float, speed: float, say: Callable[[str], None]) -> None:
        self.url = f"{base_url}/admin/decisions"
        self.token = token
        self.started_at_unix_s = started_at_unix_s
        self.speed = speed
        self.say = say
        self.seen = 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="polymorph-demo-decisions", daemon=True)

    def _watch(self) -> None:
        while not self.stopped.wait(_WATCH_EVERY_S):
            try:
                entries = decisions_since(get_json(self.url, self.token).get("decisions", []), self.started_at_unix_s)
            except (urllib.error.URLError, OSError, ValueError, AttributeError, AdminRefused):
                continue  # the gateway is busy or restarting: the next poll catches up
            for entry in entries[self.seen :]:  # the log only grows
                self.say(f"{_clock(float(entry['at_unix_s']) - self.started_at_unix_s, self.speed)}  {describe_decision(entry)}")
            self.seen = max(self.seen, len(entries))

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        self.thread.join(5)


# -- the command ------------------------------------------------------------------------------------


def main_demo(args: argparse.Namespace) -> int:
    base = args.url.rstrip("/")
    out_dir = Path(args.out) if args.out else Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")
    deployment = None
    if not answers(base):
        if not args.start:
            print(f"error: nothing answers at {base}. Start Polymorph first (`make run`, or `make run CONFIG=examples/demo.yaml` "
                  f"for a fleet 10x faster than real time), or pass --start to let the demo start it.", file=sys.stderr)
            return EXIT_UNREACHABLE
        print(f"starting `polymorph serve --config {args.config}` at {base} (log: {out_dir / 'gateway.log'}) ...", file=sys.stderr)
        try:
            deployment = start_deployment(args.config, base, out_dir / "gateway.log")
        except RuntimeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_UNREACHABLE
    try:
        return _demo(args, base, out_dir)
    except AdminRefused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (urllib.error.URLError, OSError, ValueError) as exc:  # the admin API failed or answered no JSON
        print(f"error: the gateway's admin API at {base} failed: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    finally:
        if deployment is not None:
            if args.keep_running:
                _serve_until_interrupted(base)
            deployment.stop()


def _demo(args: argparse.Namespace, base: str, out_dir: Path) -> int:
    from loadtest.runner import RunnerConfig, TargetUnreachable, run
    from loadtest.scenario import ScenarioError

    state = get_json(f"{base}/admin/state", args.admin_token)
    speed = args.speed or fleet_speed(state)
    try:
        workload = demo_workload(args.scenario, speed, args.duration, args.rate, args.seed)
    except ScenarioError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    pools = ", ".join(f"{p['name']} ({len(p['replicas'])} x {p.get('gpu') or '?'})" for p in state.get("pools", []))
    print(f"dashboard: {base}/dashboard (sign in with the admin token)")
    if args.open:
        # Signed in at once with the demo's public token (the page moves it into a cookie); a real token
        # stays off command lines and browser history: the page asks for it.
        signed_in = args.admin_token == DEMO_ADMIN_TOKEN
        webbrowser.open(f"{base}/dashboard" + (f"?token={urllib.parse.quote(args.admin_token)}" if signed_in else ""))
    onsets = ", ".join(f"{t:.0f} s" for t in workload.drift_onsets_s) or "none"
    print(f"fleet: {pools}; emulated GPUs at {speed:g}x real time")
    print(f"replaying {workload.name}: {workload.num_requests} requests over {workload.duration_s:.0f} s "
          f"({workload.duration_s * speed:.0f} s of fleet time, {workload.target_rate_rps:.1f} req/s); drift at {onsets}")
    if workload.duration_s * speed < 400:
        print("note: the controller needs ~90 s of fleet time to warm up and ~2 min between plans; a shorter run may show no repartition")
    tier_to_slo = fleet_time_slos(state.get("tiers") or {}, speed)
    config = RunnerConfig(target_url=base, api_key=args.api_key, admin_token=args.admin_token, progress=not args.no_progress,
                          drain_timeout_s=max(30.0, 600.0 / speed))
    started_at = time.time()
    say = _printer()
    try:
        with DecisionWatcher(base, args.admin_token, started_at, speed, say):
            result = run(workload, config, tier_to_slo)
    except TargetUnreachable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    decisions = decisions_since(get_json(f"{base}/admin/decisions?limit=10000", args.admin_token).get("decisions", []), started_at)
    _write_outputs(out_dir, workload, result, config, tier_to_slo)
    for line in decision_summary(decisions, started_at, speed):
        print(line)
    print(f"results and plots (times in wall seconds; x{speed:g} for fleet time): {out_dir.resolve()}/")
    print(f"dashboard: {base}/dashboard")
    return 0


def _write_outputs(out_dir: Path, workload: Workload, result: RunResult, config: RunnerConfig, tier_to_slo: Mapping[str, TierSlo]) -> None:
    from loadtest.metrics import RunFacts, summarize
    from loadtest.plots import write_plots
    from loadtest.report import text_summary, write_results

    during = tuple(event for event in result.gateway_events if event["at_s"] >= 0)  # the log may hold earlier runs'
    facts = RunFacts(workload.name, config.base_url, result.model, result.mode, config.stream,
                     result.duration_s, workload.drift_onsets_s, during)
    summary = summarize(result.records, facts, tier_to_slo)
    write_results(out_dir, summary, result.records)
    write_plots(out_dir, summary, result.records)
    print(text_summary(summary))


def _printer() -> Callable[[str], None]:
    """Lines that do not break the runner's progress bar."""
    from tqdm import tqdm

    return lambda line: tqdm.write(line, file=sys.stdout)


def _serve_until_interrupted(base: str) -> None:
    print(f"the deployment keeps serving {base}/dashboard; Ctrl-C stops it", file=sys.stderr, flush=True)

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)  # a service manager's stop ends the replicas too
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
