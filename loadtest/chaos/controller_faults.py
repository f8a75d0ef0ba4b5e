"""The controller out of process (``fleet.controller.mode: external``) fails beside two gateways under load.

``controller-moves-the-only-replica``: the fleet is one replica and the plan moves it: while it drains,
stops and starts no replica serves the model, and the gateways hold its requests for it (the plan lists
it draining, then starting) and route them once it is back. ``controller-dies``: the leader is
SIGKILLed right after the first step of a rollout; a standby (blocked on the lease) takes over and
finishes the rollout from the persisted state, then it is SIGKILLed too and a restarted controller
adopts the fleet with the same plan. ``controller-partitioned``: the leader is
SIGSTOPped right after the first step (its socket accepts, nothing answers: the gateways' plan polls
time out, as behind a partition), then SIGCONTed; it finishes the rollout. In both the gateways keep
routing on the last plan they applied, no request fails, and no applied move is made twice (a slot
named by two step decisions would be a repeated move).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

from fleet.controller_state import ControllerState
from fleet.decisions import LoggedDecision, read_log
from fleet.evidence import PlanEvidence
from loadtest.chaos.fleet_faults import DEADLINE_S, DRIFT_POOL, FleetFaultSettings, long_request, write_fleet_config
from loadtest.chaos.load import OK, Answer, ChaosClient, open_loop, percentile
from loadtest.chaos.report import Check, ScenarioResult, summarize
from loadtest.chaos.stack import POLYMORPH, STARTUP_TIMEOUT_S, http_get, metric_sum, wait_until
from loadtest.procs import ProcessRegistry, free_port, wait_http

NUM_GATEWAYS = 2
PARTITION_S = 3.0  # 60 fleet seconds at SPEED: many missed polls and reports


class ExternalControllerDeployment:
    """``polymorph controller`` processes (leader, standbys, restarts) and ``NUM_GATEWAYS`` gateways over one
    pool ``mixed`` of ``num_replicas`` emulated replicas, declared for short chats; the load is long prompts, so
    the first plan moves replicas to ``DRIFT_POOL``. Every process it started is ended on exit, replicas included."""

    def __init__(self, run_dir: Path, num_replicas: int = 2) -> None:
        self.run_dir = run_dir
        self.num_replicas = num_replicas
        self.registry = ProcessRegistry(run_dir)
        self.url = f"http://127.0.0.1:{free_port()}"
        self.gateway_urls: list[str] = []
        self.config = run_dir / "config.yaml"
        self.decision_log = run_dir / "decisions.jsonl"
        self.state_file = run_dir / "decisions.state.json"
        self.at_rollout_end: list[LoggedDecision] = []  # the decisions when ``rollout_done`` first said so

    def __enter__(self) -> Self:
        # verify_after_s: a step of a fleet meeting its demand is verified 6 wall seconds after its replica came
        # back (the default's 2.25 s made controller-partitioned's window, between the replica in the plan and its
        # verification, short enough for a poll on a loaded machine to miss)
        write_fleet_config(self.run_dir, (("mixed", self.num_replicas, ("short-chat",)),),
                           {"enabled": True, "mode": "external", "url": self.url, "tick_s": 5.0, "decision_log": self.decision_log.name,
                            "verify_after_s": 120.0})
        return self

    def __exit__(self, *exc: object) -> None:
        state = json.loads(self.state_file.read_text()) if self.state_file.exists() else {"slots": []}
        self.registry.stop_all()
        for slot in state["slots"]:  # replicas are detached from the controller: a SIGKILLed one leaves them behind
            if slot["pid"]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(slot["pid"], signal.SIGKILL)

    def start_controller(self, name: str) -> subprocess.Popen[bytes]:
        argv = [*POLYMORPH, "controller", "--config", str(self.config), "--replica-logs", str(self.run_dir / "replicas"),
                "--stop-replicas-on-exit"]
        return self.registry.start(name, argv, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def wait_leading(self, controller: subprocess.Popen[bytes]) -> None:
        wait_http(self.url + "/healthz", controller, STARTUP_TIMEOUT_S)

    def start_gateways(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        started = []
        for i in range(NUM_GATEWAYS):
            port = free_port()
            started.append((f"http://127.0.0.1:{port}", self.registry.start(
                f"gateway-{i}", [*POLYMORPH, "serve", "--config", str(self.config), "--port", str(port)], env=env)))
        for url, gateway in started:
            wait_http(url + "/readyz", gateway, STARTUP_TIMEOUT_S)
        self.gateway_urls = [url for url, _ in started]

    def log(self, name: str) -> str:
        path = self.run_dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def plan(self) -> dict[str, Any]:
        status, body = http_get(self.url + "/plan")
        if status != 200:
            raise RuntimeError(f"GET /plan answered {status}")
        return json.loads(body)  # type: ignore[no-any-return]

    def new_pool_urls(self) -> list[str]:
        """Routable (not draining) replicas of ``DRIFT_POOL`` in the controller's plan."""
        pools = {p["name"]: p for p in self.plan()["pools"]}
        return [r["url"] for r in pools.get(DRIFT_POOL, {"replicas": []})["replicas"] if not r["draining"]]

    def planned(self) -> int:
        """Replicas the first plan gives ``DRIFT_POOL`` (0 before it is made)."""
        plans = [d.evidence for d in self.decisions() if isinstance(d.evidence, PlanEvidence) and d.evidence.diff]
        return plans[0].diff.get(DRIFT_POOL, (0, 0))[1] if plans and plans[0].diff else 0

    def rollout_done(self) -> bool:
        """Every replica of the first plan moved and the last step verified. The decisions at that moment are
        kept: the scenario's checks are about that rollout, and a refine may rightly move more afterwards (all the
        load is long prompts; a loaded machine serves them slower and the refine gives the long pool a second replica)."""
        decisions = self.decisions()
        kinds = [d.kind for d in decisions]  # a refine may follow the last verification in the same tick
        done = 0 < kinds.count("step") <= kinds.count("verify") and 0 < self.planned() == len(self.new_pool_urls())
        if done and not self.at_rollout_end:
            self.at_rollout_end = decisions
        return done

    def rollout_saved(self) -> bool:
        """Does the state file, as a standby taking over now would read it, hold a rollout in progress?"""
        if not self.state_file.exists():
            return False
        return ControllerState.from_json(json.loads(self.state_file.read_bytes())).rollout_in_progress  # written whole (a rename)

    def decisions(self) -> list[LoggedDecision]:
        return read_log(self.decision_log) if self.decision_log.exists() else []

    def retries(self) -> float:
        return sum(metric_sum(url, "polymorph_upstream_retries_total") for url in self.gateway_urls)


def moves_repeated(decisions: list[LoggedDecision]) -> int:
    """Slots named by more than one step: a move applied again."""
    slots = [m.slot for d in decisions if d.kind == "step" for m in d.moves]
    return len(slots) - len(set(slots))


async def _under_load(deployment: ExternalControllerDeployment, settings: FleetFaultSettings,
                      faults: Callable[[], dict[str, Any]]) -> tuple[list[Answer], float, dict[str, Any], str | None]:
    """Requests alternating between the gateways while ``faults()`` runs (in a thread); it returns what it saw."""
    stop = asyncio.Event()
    retries_before = deployment.retries()
    rate = settings.rate_rps / NUM_GATEWAYS

    async def one_gateway(url: str) -> list[Answer]:
        async with ChaosClient(url, DEADLINE_S) as client:
            return await open_loop(client, long_request, rate, 600.0, until=stop)

    loads = [asyncio.create_task(one_gateway(url)) for url in deployment.gateway_urls]
    seen: dict[str, Any] = {}
    error: str | None = None
    try:
        seen = await asyncio.to_thread(faults)
        await asyncio.sleep(1.0)  # traffic on through the settled fleet too
    except (TimeoutError, RuntimeError) as exc:
        error = str(exc)
    finally:
        stop.set()
        answers = [a for batch in await asyncio.gather(*loads) for a in batch]
    return answers, deployment.retries() - retries_before, seen, error


def _common_checks(deployment: ExternalControllerDeployment, answers: list[Answer], error: str | None,
                   moved: list[str]) -> list[Check]:
    decisions = deployment.decisions()
    rollout = deployment.at_rollout_end or decisions
    kinds = [d.kind for d in rollout]
    plans = [d.evidence for d in rollout if isinstance(d.evidence, PlanEvidence)]
    # up to the rollout's end: the drift plan, then plans that keep it (its refine; the mix does not move again)
    one_plan = bool(plans) and plans[0].outcome == "apply" and all(p.outcome == "keep" for p in plans[1:])
    steps = [d for d in rollout if d.kind == "step"]
    all_kinds = [d.kind for d in decisions]
    failed = [a for a in answers if a.verdict != OK]
    final = set(deployment.new_pool_urls()) if error is None else set()
    return [
        Check("the scenario ran to the end", error is None, str(error)),
        Check("one plan, each step verified, no rollback", one_plan and bool(steps) and kinds.count("verify") == len(steps)
              and "rollback" not in all_kinds, f"decisions {all_kinds} (the rollout's {len(rollout)})"),
        Check("no applied move was repeated", moves_repeated(decisions) == 0, f"steps {[d.moves for d in steps]}"),
        Check("the replica moved first stayed moved", bool(moved) and set(moved) <= final, f"{moved} then {sorted(final)}"),
        Check("the gateways noticed the controller was gone",
              any("unreachable" in deployment.log(f"gateway-{i}") for i in range(NUM_GATEWAYS)), "no gateway logged it"),
        Check("every request succeeded", not failed, f"{len(failed)} failed: {sorted({a.detail for a in failed})[:3]}"),
    ]


def _result(name: str, deployment: ExternalControllerDeployment, answers: list[Answer], retried: float, checks: list[Check],
            figures: dict[str, float]) -> ScenarioResult:
    ok = [a.latency_s for a in answers if a.verdict == OK]
    return summarize(name, answers, retried, percentile(ok, 0.5), checks,
                     {"moves_repeated": float(moves_repeated(deployment.decisions())), **figures, "p99_ms": percentile(ok, 0.99) * 1000})


async def controller_dies(run_dir: Path, settings: FleetFaultSettings) -> ScenarioResult:
    with ExternalControllerDeployment(run_dir) as deployment:
        leader = deployment.start_controller("controller-a")
        deployment.wait_leading(leader)
        standby = deployment.start_controller("controller-b")
        wait_until("the standby to wait for the lease", lambda: "standby" in deployment.log("controller-b"))
        deployment.start_gateways()

        def faults() -> dict[str, Any]:
            # killed once its state holds the rollout: its replica draining, restarting or serving unverified. Not
            # on seeing the moved replica in the plan: a fleet failing its demand verifies a step one tick after
            # its replica is back, and a poll of a controller busy planning missed that window (two suite runs)
            wait_until("the first step", deployment.rollout_saved)
            leader.send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            deployment.wait_leading(standby)
            takeover_s = time.monotonic() - killed_at
            wait_until("the moved replica to serve", lambda: len(deployment.new_pool_urls()) >= 1)
            moved = deployment.new_pool_urls()
            wait_until("the rollout to finish", deployment.rollout_done)
            plan = deployment.plan()
            standby.send_signal(signal.SIGKILL)
            restarted = deployment.start_controller("controller-c")
            deployment.wait_leading(restarted)
            return {"moved": moved, "takeover_s": takeover_s, "plan": plan, "again": deployment.plan()}

        answers, retried, seen, error = await _under_load(deployment, settings, faults)
        checks = _common_checks(deployment, answers, error, seen.get("moved", []))
        plan, again = seen.get("plan", {}), seen.get("again", {})
        checks += [
            Check("the standby resumed the rollout in progress", "rollout in progress" in deployment.log("controller-b"),
                  "controller-b did not say it resumed a rollout"),
            Check("a restarted controller serves the same plan", bool(plan) and [again.get(k) for k in ("epoch", "version", "pools")]
                  == [plan.get(k) for k in ("epoch", "version", "pools")], f"{plan.get('version')} -> {again.get('version')}"),
        ]
        return _result("controller-dies", deployment, answers, retried, checks, {"takeover_s": seen.get("takeover_s", -1.0)})


async def controller_partitioned(run_dir: Path, settings: FleetFaultSettings) -> ScenarioResult:
    with ExternalControllerDeployment(run_dir) as deployment:
        leader = deployment.start_controller("controller-a")
        deployment.wait_leading(leader)
        deployment.start_gateways()

        def faults() -> dict[str, Any]:
            wait_until("the first step", lambda: len(deployment.new_pool_urls()) == 1)
            moved = deployment.new_pool_urls()
            leader.send_signal(signal.SIGSTOP)
            try:
                wait_until("the gateways to lose the controller",
                           lambda: all("unreachable" in deployment.log(f"gateway-{i}") for i in range(NUM_GATEWAYS)))
                time.sleep(PARTITION_S)
            finally:
                leader.send_signal(signal.SIGCONT)
            wait_until("the gateways to reach it again",
                       lambda: all("answers again" in deployment.log(f"gateway-{i}") for i in range(NUM_GATEWAYS)))
            wait_until("the rollout to finish", deployment.rollout_done)
            return {"moved": moved}

        answers, retried, seen, error = await _under_load(deployment, settings, faults)
        checks = _common_checks(deployment, answers, error, seen.get("moved", []))
        return _result("controller-partitioned", deployment, answers, retried, checks, {"partition_s": PARTITION_S})


async def controller_moves_the_only_replica(run_dir: Path, settings: FleetFaultSettings) -> ScenarioResult:
    with ExternalControllerDeployment(run_dir, num_replicas=1) as deployment:
        leader = deployment.start_controller("controller-a")
        deployment.wait_leading(leader)
        deployment.start_gateways()

        def faults() -> dict[str, Any]:
            wait_until("the rollout to finish", deployment.rollout_done, timeout_s=settings.max_s)
            return {}

        answers, retried, _, error = await _under_load(deployment, settings, faults)
        kinds = [d.kind for d in deployment.decisions()]
        failed = [a for a in answers if a.verdict != OK]
        released = sum(metric_sum(url, "polymorph_restart_holds_total", 'outcome="released"') for url in deployment.gateway_urls)
        checks = [
            Check("the scenario ran to the end", error is None, str(error)),
            Check("the only replica moved and was verified, no rollback", "step" in kinds and "verify" in kinds and "rollback" not in kinds,
                  f"decisions {kinds}"),
            Check("requests were held while it restarted, then served", released > 0, f"{released:g} released from a hold"),
            Check("every request succeeded", not failed, f"{len(failed)} failed: {sorted({a.detail for a in failed})[:3]}"),
        ]
        return _result("controller-moves-the-only-replica", deployment, answers, retried, checks, {"held_then_served": released})


CONTROLLER_SCENARIOS: dict[str, Callable[[Path, FleetFaultSettings], Any]] = {
    "controller-moves-the-only-replica": controller_moves_the_only_replica,
    "controller-dies": controller_dies,
    "controller-partitioned": controller_partitioned,
}
