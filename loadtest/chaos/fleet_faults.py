"""Fleet faults with the control loop on: a step whose replica never becomes healthy, and a pool lost.

The gateway runs its own emulated replicas and the fleet controller (``fleet.controller.enabled``),
at ``SPEED`` x real time so a re-plan happens within seconds. Faults are real process faults on the
replicas the gateway launches (found as its child processes): SIGSTOP on the first replica a step
starts (it never answers ``/health``: a start that hangs), SIGKILL on a whole pool's replicas (the
host is gone). Every request is judged by the chaos client; the decision log and ``/admin/state``
show what the controller did about it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleet.decisions import LoggedDecision, read_decisions
from fleet.evidence import CapacityEvidence, PlanEvidence, RollbackEvidence
from loadtest.chaos.load import OK, ChaosClient, Request, chat_request, open_loop, percentile
from loadtest.chaos.report import Check, ScenarioResult, summarize
from loadtest.chaos.stack import POLYMORPH, STARTUP_TIMEOUT_S, http_get, metric_sum
from loadtest.procs import ProcessRegistry, free_port, wait_http

MODEL, GPU = "llama-3.1-8b", "H100-SXM"
KEY, ADMIN = "sk-chaos-fleet", "chaos-fleet-admin"
SPEED = 20.0  # emulated GPUs and the controller's clock run 20x real time: a 30 s restart takes 1.5 s
DEADLINE_S = 20.0
FLEET_SHAPES = ("short-chat", "long-context", "reasoning", "batch")


@dataclass(frozen=True, slots=True)
class FleetFaultSettings:
    rate_rps: float = 25.0
    max_s: float = 40.0  # give up waiting for the controller after this long


def write_fleet_config(run_dir: Path, pools: tuple[tuple[str, int, tuple[str, ...]], ...], controller: dict[str, Any]) -> Path:
    """The tenant file and ``config.yaml`` (JSON is YAML) of a gateway over ``pools`` with ``controller`` settings."""
    (run_dir / "tenants").mkdir(parents=True, exist_ok=True)
    tenant = {"name": "fleet", "api_key_sha256": [hashlib.sha256(KEY.encode()).hexdigest()], "max_concurrency": 100000,
              "rate_limits": {"requests_per_min": 1e8, "tokens_per_min": 1e12}}
    (run_dir / "tenants" / "fleet.yaml").write_text(json.dumps(tenant))
    config = {
        "server": {"host": "127.0.0.1", "admin_token": ADMIN, "access_log": False},
        "upstream": {"connect_timeout_s": 0.5, "first_byte_timeout_s": 5.0, "response_timeout_s": 5.0, "eject_after_failures": 2,
                     "eject_cooldown_s": 1.0, "health_interval_s": 0.2},
        "tenants_dir": "tenants",
        "fleet": {
            "pools": [{"name": name, "model": MODEL, "gpu": GPU, "shapes": list(shapes), "replicas": {"emulated": n}}
                      for name, n, shapes in pools],
            "emulator_speed": SPEED,
            "controller": controller,
        },
    }
    path = run_dir / "config.yaml"
    path.write_text(json.dumps(config))
    return path


class ControllerStack:
    """One gateway with the controller on over ``pools`` ((name, emulated replicas, shapes))."""

    def __init__(self, pools: tuple[tuple[str, int, tuple[str, ...]], ...], run_dir: Path) -> None:
        self.pools = pools
        self.run_dir = run_dir
        self.registry = ProcessRegistry(run_dir)
        self.port = free_port()
        self.gateway_pid = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ControllerStack:
        path = write_fleet_config(self.run_dir, self.pools, {"enabled": True, "tick_s": 5.0, "decision_log": "decisions.jsonl"})
        gateway = self.registry.start("gateway", [*POLYMORPH, "serve", "--config", str(path), "--port", str(self.port)],
                                      env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.gateway_pid = gateway.pid
        try:
            wait_http(self.url + "/readyz", gateway, STARTUP_TIMEOUT_S)
        except Exception:
            self.registry.stop_all()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.registry.stop_all()

    def admin(self, path: str) -> dict[str, Any]:
        status, body = http_get(self.url + path, {"Authorization": f"Bearer {ADMIN}"})
        if status != 200:
            raise RuntimeError(f"{path} answered {status}: {body[:200]!r}")
        return json.loads(body)  # type: ignore[no-any-return]

    def decisions(self) -> list[LoggedDecision]:
        return read_decisions(self.admin("/admin/decisions?limit=10000")["decisions"])

    def pool_sizes(self) -> dict[str, int]:
        """Routable replicas per pool, from the gateway's own state."""
        return {p["name"]: len(p["replicas"]) for p in self.admin("/admin/state")["pools"] if p["replicas"]}

    def replica_pids(self) -> dict[int, int]:
        """The gateway's replica processes: pid -> the port it listens on."""
        return {pid: port for pid in _children(self.gateway_pid) if (port := _listen_port(pid)) is not None}

    def pids_of_pool(self, pool: str) -> list[int]:
        ports = {int(r["url"].rsplit(":", 1)[1]) for p in self.admin("/admin/state")["pools"] if p["name"] == pool for r in p["replicas"]}
        return [pid for pid, port in self.replica_pids().items() if port in ports]


def _children(pid: int) -> list[int]:
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as text:
                found += [int(c) for c in text.read().split()]
    return found


def _listen_port(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as raw:
            argv = raw.read().split(b"\0")
    except OSError:
        return None
    if b"emulate" not in argv or b"--port" not in argv:
        return None
    return int(argv[argv.index(b"--port") + 1])


class HangNextReplica(threading.Thread):
    """SIGSTOPs the first replica process the gateway starts after ``known``: a start that never answers."""

    def __init__(self, stack: ControllerStack, known: set[int]) -> None:
        super().__init__(daemon=True)
        self.stack = stack
        self.known = known
        self.hung: int | None = None
        self.hung_at = 0.0
        self.finished = threading.Event()

    def run(self) -> None:
        while not self.finished.is_set() and self.hung is None:
            for pid in self.stack.replica_pids():
                if pid not in self.known:
                    os.kill(pid, signal.SIGSTOP)
                    self.hung, self.hung_at = pid, time.monotonic()
                    break
            time.sleep(0.01)

    def release(self) -> None:
        """SIGCONT: a terminate the gateway sent meanwhile takes effect, so nothing is left stopped."""
        self.finished.set()
        if self.hung is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.hung, signal.SIGCONT)


def fleet_request(i: int) -> Request:
    return chat_request(MODEL, KEY, max_tokens=24, stream=i % 2 == 0)


# ~5,600 prompt tokens: the long-context shape. The controller keeps a declared pool that fits its traffic,
# so the scenarios that need a move send long prompts into a fleet whose only pool is declared for short
# chats: the first plan makes a pool for them (DRIFT_POOL) and moves replicas there. Each prompt opens with
# its own number: a prompt the engines had cached would cost them little, and the capacity model knows it.
LONG_TEXT = "Summarise the minutes of the meeting below. " + "The team reviewed the quarter's roadmap. " * 700
DRIFT_POOL = f"long-context@{GPU}"


def long_request(i: int) -> Request:
    return chat_request(MODEL, KEY, max_tokens=24, stream=i % 2 == 0, text=f"[{i}] {LONG_TEXT}")


async def load_until(stack: ControllerStack, settings: FleetFaultSettings, done: Callable[[], bool],
                     request: Callable[[int], Request] = fleet_request) -> tuple[list, float, float]:
    """Open-loop load until ``done()`` (polled from a thread) or ``max_s``; returns (answers, seconds to done, retries)."""
    stop = asyncio.Event()
    started = time.monotonic()

    async def watch() -> float:
        while time.monotonic() - started < settings.max_s:
            if await asyncio.to_thread(done):
                await asyncio.sleep(1.0)  # a little traffic on the settled fleet too
                stop.set()
                return time.monotonic() - started
            await asyncio.sleep(0.25)
        stop.set()
        return -1.0

    retries_before = metric_sum(stack.url, "polymorph_upstream_retries_total")
    async with ChaosClient(stack.url, DEADLINE_S) as client:
        watcher = asyncio.create_task(watch())
        answers = await open_loop(client, request, settings.rate_rps, settings.max_s + 2.0, until=stop)
        settled_s = await watcher
    return answers, settled_s, metric_sum(stack.url, "polymorph_upstream_retries_total") - retries_before


def _kinds(decisions: list[LoggedDecision]) -> list[str]:
    return [d.kind for d in decisions]


async def step_never_healthy(run_dir: Path, settings: FleetFaultSettings) -> ScenarioResult:
    """The controller's first step starts a replica that hangs: the step is rolled back, the fleet returns
    to the previous plan (both replicas in pool ``mixed``), and no request is lost. ``mixed`` is declared
    for short chats and the load is long prompts, so the first plan moves a replica to ``DRIFT_POOL``."""
    with ControllerStack((("mixed", 2, ("short-chat",)),), run_dir) as stack:
        before = stack.pool_sizes()
        hang = HangNextReplica(stack, set(stack.replica_pids()))
        hang.start()

        def rolled_back_and_settled() -> bool:
            decisions = stack.decisions()
            rollback = [d for d in decisions if d.kind == "rollback"]
            if not rollback:
                return False
            hang.release()
            return stack.pool_sizes() == before

        try:
            answers, settled_s, retried = await load_until(stack, settings, rolled_back_and_settled, long_request)
        finally:
            hang.release()
        decisions, after = stack.decisions(), stack.pool_sizes()
    rollbacks = [d.evidence for d in decisions if isinstance(d.evidence, RollbackEvidence)]
    reason = rollbacks[0].reason if rollbacks else None
    failed = [a for a in answers if a.verdict != OK]
    ok = [a.latency_s for a in answers if a.verdict == OK]
    checks = [
        Check("a replica was hung", hang.hung is not None, "the controller never started a replica"),
        Check("the step was rolled back", reason == "replica never became healthy", f"decisions {_kinds(decisions)}; reason {reason!r}"),
        Check("fleet back to the previous plan", after == before, f"{before} -> {after}"),
        Check("every request succeeded", not failed, f"{len(failed)} failed: {sorted({a.detail for a in failed})[:3]}"),
    ]
    return summarize("step-never-healthy", answers, retried, percentile(ok, 0.5), checks,
                     {"settled_after_s": settled_s, "p50_ms": percentile(ok, 0.5) * 1000, "p99_ms": percentile(ok, 0.99) * 1000})


async def pool_lost_replan(run_dir: Path, settings: FleetFaultSettings) -> ScenarioResult:
    """Pool ``chat`` (the only pool compiled for short-chat) loses its host: short-chat overflows to pool
    ``rest``, a ``capacity`` decision takes its GPU out of the budget and the next plan is for the 2 left."""
    with ControllerStack((("chat", 1, ("short-chat",)), ("rest", 2, FLEET_SHAPES[1:])), run_dir) as stack:
        for pid in stack.pids_of_pool("chat"):
            os.kill(pid, signal.SIGKILL)

        def replanned() -> bool:
            kinds = _kinds(stack.decisions())
            return "capacity" in kinds and "plan" in kinds[kinds.index("capacity"):]

        answers, settled_s, retried = await load_until(stack, settings, replanned)
        decisions = stack.decisions()
    capacity = next((d.evidence for d in decisions if isinstance(d.evidence, CapacityEvidence)), None)
    after = decisions[_kinds(decisions).index("capacity"):] if capacity else []
    plan = next((d.evidence for d in after if isinstance(d.evidence, PlanEvidence)), None)
    moved = {m.slot for d in after if d.kind == "step" for m in d.moves}
    by_rest = sum(a.verdict == OK and a.detail == "rest" for a in answers)
    failed = [a for a in answers if a.verdict != OK]
    ok = [a.latency_s for a in answers if a.verdict == OK]
    checks = [
        Check("capacity decision names the lost slot", capacity is not None and capacity.lost == ("chat-0",) and capacity.budget == {GPU: 2},
              f"capacity evidence {capacity}"),
        Check("the next plan is for the GPUs left", plan is not None and plan.budget == {GPU: 2},
              f"decisions {_kinds(decisions)}; plan {plan and plan.budget}"),
        Check("the lost slot is never moved", "chat-0" not in moved, f"moved {sorted(moved)}"),
        Check("short-chat overflowed to pool rest", by_rest > 0, "no request was served by pool rest"),
        Check("every request succeeded", not failed, f"{len(failed)} failed: {sorted({a.detail for a in failed})[:3]}"),
    ]
    return summarize("pool-lost-replan", answers, retried, percentile(ok, 0.5), checks,
                     {"replanned_after_s": settled_s, "served_by_rest": float(by_rest), "p99_ms": percentile(ok, 0.99) * 1000})


FLEET_SCENARIOS: dict[str, Callable[[Path, FleetFaultSettings], Any]] = {
    "step-never-healthy": step_never_healthy,
    "pool-lost-replan": pool_lost_replan,
}
