"""`polymorph controller`: the control loop in its own process, beside any number of gateway processes.

The policy objects are the embedded loop's (fleet.controller's ``Controller``, its ``Mover`` and
``Telemetry``); this module is their I/O edge when they run out of the gateway:

- Leadership: an exclusive ``flock`` on ``<state file>.lease``. A second controller blocks on it as a
  standby and becomes the leader the moment the leader's process ends (the kernel drops the lock of a
  killed process), then resumes from the state file. Only the leader listens, so the gateways always
  talk to the one controller that acts.
- Actuator: replica processes on this host (``LocalActuator``, detached so they outlive a controller
  crash), each slot on its share of ``fleet.devices`` and launched as its pool's engine says
  (``gateway.replicas.launcher``: emulated, llama.cpp, vLLM, sglang), recorded with their URL, PID and
  devices in the state file and adopted again by the next leader.
  With ``fleet.actuator: ray`` they are Ray actors (``fleet.actuators.ray``, started, stopped and
  probed through it; the plan stays this service's). A Ray actor lives only as long as the driver that
  made it, so a new leader starts every replica the state file lists again, and a leader that exits
  stops its replicas gracefully itself.
- Plan: ``GET /plan`` is every pool's replica URLs and drain flags with a version (and an ETag); a
  drain is published at once, and a drained replica is stopped only when every live gateway routes
  on that version or a newer one and none of them has a request in flight on it.
- Models: one ``Controller`` per model over the slots that model's pools hold (``fleet.multi``, as the
  embedded loop does), with the arbiter moving a slot between models when ``rebalance`` is on; each slot
  record names its model, so a new leader splits the slots as the old one left them.
- Telemetry: ``POST /report`` from each gateway (``fleet.telemetry_batch``, per model), replayed into
  each model's ``Telemetry`` by the tick thread (the one thread that touches the policy objects).
- Engine figures: every tick interval the event loop reads each routable replica's own ``/metrics``
  (``gateway.engine_scrape.read_engine_load``), and each tick hands the latest to the controller with its
  snapshot, as the embedded loop's gateway does: a step whose moved engines queue what the plan said
  they run fails verification, and the plan counts what other clients hold on the replicas (foreign
  load). A replica unread for three ticks has no figures (goodput alone judges it).
- Persistence: after every tick (and right after a replica process is started) the state
  (``fleet.controller_state``) is written to a temporary file and renamed over the old one, so a crash
  leaves the previous state or the new one, never half of one; decisions are appended to the log first.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import math
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

import aiohttp
import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from prometheus_client import CollectorRegistry, generate_latest

from fleet.actuators.local import LocalActuator, LocalReplica, answers_health, warm_up
from fleet.capacity import PerfCapacity
from fleet.commands import apply
from fleet.controller import Controller
from fleet.controller_state import ControllerState, SlotRecord, capture, capture_arbiter, restore, restore_arbiter
from fleet.decisions import DecisionLog
from fleet.engines.load import EngineLoad
from fleet.multi import ModelTelemetry, MultiController
from fleet.rebalance import RebalanceSettings
from fleet.rollout import SlotState
from fleet.telemetry_batch import Report, parse, replay
from gateway.config import GatewayConfig
from gateway.dashboard import is_admin_request
from gateway.decision_metrics import DecisionMetrics
from gateway.engine_scrape import EngineUnreadable, read_engine_load
from gateway.errors import ApiError, error_response
from gateway.live_fleet import controller_settings
from gateway.malformed_http import EnvelopeAppRunner
from gateway.metrics import CONTENT_TYPE
from gateway.replicas import ReplicaControl, assign_devices, close, launcher, pool_engine, replica_control, start_timeout_s

_JSON = "application/json"
_WARMUP_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class _GatewayReport:
    at: float  # wall time it arrived
    epoch: str | None
    version: int
    in_flight: dict[str, int]  # replica URL -> requests


def state_path(config: GatewayConfig) -> Path | None:
    """The persisted state: ``fleet.controller.state_file``, else beside the decision log."""
    settings = config.controller
    if settings.state_file is not None:
        return settings.state_file
    if settings.decision_log is not None:
        return settings.decision_log.with_name(settings.decision_log.stem + ".state.json")
    return None


def hold_lease(path: Path, on_wait: str) -> IO[str]:
    """Block until this process holds the exclusive lease on ``path``; the open file is the lease."""
    lease = open(path, "a+")  # noqa: SIM115 (held for the life of the process)
    try:
        fcntl.flock(lease, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(on_wait, file=sys.stderr, flush=True)
        fcntl.flock(lease, fcntl.LOCK_EX)
    lease.truncate(0)
    lease.write(f"{os.getpid()}\n")
    lease.flush()
    return lease


def save_state(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as out:
        out.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)


def _pid_alive(pid: int | None) -> bool:
    """Whether an adopted replica's process still runs. A zombie does not: a replica adopted from an earlier
    controller is not our child, and under a subreaper (tini, systemd) it stays a zombie until that reaps it,
    while signal 0 still finds it."""
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # it ended since the signal, or there is no procfs (macOS), where signal 0's answer stands
        return not Path("/proc/self").exists()
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")  # the state follows the name, which may hold ')'


class ControllerService:
    """The leader's loop, actuator and HTTP API. ``Actuator`` methods run on the tick thread only."""

    def __init__(self, config: GatewayConfig, state_file: Path, command: tuple[str, ...], log_dir: Path) -> None:
        settings = config.controller
        assert settings.url is not None
        launched = [p for p in config.pools if p.num_launched]
        if not launched:
            raise ValueError("the config launches no replicas (fleet.pools[].replicas.emulated or launch) for the controller to run")
        self.config = config
        self.settings = settings
        self.state_file = state_file
        self.models = tuple(sorted({p.model for p in launched}))
        self.launch_for = launcher(config, command)
        self.speed = config.emulator_speed
        self.local = LocalActuator(log_dir, detach=True)
        # fleet.actuator: ray: Ray actors instead of self.local's processes (no routing bound: the plan routes)
        self.ray: ReplicaControl | None = replica_control(config, command, log_dir) if config.actuator == "ray" else None
        self.slots: dict[str, SlotRecord] = {}
        self.processes: dict[str, LocalReplica] = {}  # slot -> the child this process started
        self.stopping: list[subprocess.Popen[bytes]] = []  # terminated children not yet reaped
        self.healthy: set[str] = set()
        self.recovering: set[str] = set()  # relaunched outside a move (their process was gone): routable once healthy
        self.warmup_model: dict[str, str | None] = {}  # slot -> the model its engine's warm-up request names, until it answered
        self.telemetry = ModelTelemetry(self.models, settings.window_s)
        self.decisions = DecisionLog(settings.decision_log)
        self.metrics = CollectorRegistry(auto_describe=True)
        self.metrics.register(DecisionMetrics(self.decisions))
        self.controller: MultiController | None = None
        self.epoch = uuid.uuid4().hex[:12]
        self.version = 0
        self._plan_key: bytes = b""
        self.plan_body: bytes = b""
        self.etag = ""
        self._saved = b""
        self._lock = threading.Lock()  # guards what the event loop hands the tick thread
        self._inbox: list[Report] = []
        self._routable: tuple[tuple[str, str, str], ...] = ()  # (slot, URL, engine kind) whose /metrics read_engines reads
        self._engines: dict[tuple[str, str], EngineLoad] = {}  # (slot, URL) -> that engine's latest figures (read_engines)
        self._engine_stale_s = 3 * settings.tick_s  # fleet seconds: figures older than three ticks are dropped
        self._gateways: dict[str, _GatewayReport] = {}
        self.stale_s = max(2.0, 4 * settings.report_s / self.speed)  # a gateway silent this long no longer holds drains
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="polymorph-controller")

    def now(self) -> float:
        """Fleet time: Unix time x the emulator speed, the same clock in every process and across restarts."""
        return time.time() * self.speed

    # -- slots ---------------------------------------------------------------------------------

    def _set(self, record: SlotRecord) -> None:
        self.slots[record.slot] = record
        self._publish()

    def _launch(self, record: SlotRecord, pool: str, config_json: str) -> SlotRecord:
        self.healthy.discard(record.slot)
        if self.ray is not None:
            self.ray.add_slot(record.slot, record.gpu, pool, config_json, record.devices)
            self.ray.start(record.slot, pool, config_json, self.now())
            return dataclasses.replace(record, pool=pool, config_json=config_json, phase="starting", url=None, pid=None)  # URL once healthy
        spec = self.launch_for(record.gpu, pool, config_json, record.devices)  # the pool's model, engine and LoRA adapters
        self.warmup_model[record.slot] = spec.warmup_model
        replica = self.local.start(dataclasses.replace(spec, name=f"{record.slot.replace('/', '-')}-{time.time_ns()}"))
        self.local.replicas.remove(replica)  # this service tracks its processes by slot
        self.processes[record.slot] = replica
        return dataclasses.replace(record, pool=pool, config_json=config_json, phase="starting", url=replica.url, pid=replica.process.pid)

    def _terminate(self, slot: str, pid: int | None) -> None:
        if self.ray is not None:
            self.ray.stop(slot, self.now())
            return
        replica = self.processes.pop(slot, None)
        if replica is not None:
            replica.process.terminate()
            self.stopping.append(replica.process)  # reaped by a later tick; never waits here
        elif _pid_alive(pid):
            assert pid is not None
            os.kill(pid, signal.SIGTERM)  # adopted from an earlier leader: not our child, init reaps it

    def fresh_fleet(self) -> None:
        """The config's launched replicas, each on its share of ``fleet.devices`` (its slot's for good: a move
        restarts it there), started and waited for: the first leader of a fleet."""
        gpu_to_next: dict[str, int] = {}
        held, _ = assign_devices(self.config)
        for _, pool, devices in held:
            assert pool.gpu is not None
            k = gpu_to_next.get(pool.gpu, 0)
            gpu_to_next[pool.gpu] = k + 1
            record = SlotRecord(f"{pool.gpu}/{k}", pool.name, pool.gpu, pool.config_json, "starting", model=pool.model, devices=devices)
            self.slots[record.slot] = self._launch(record, pool.name, pool.config_json)
        deadline = time.monotonic() + start_timeout_s(self.config)
        while time.monotonic() < deadline and len(self.healthy) < len(self.slots):
            self._probe_starting()
            time.sleep(0.1)
        missing = sorted(set(self.slots) - self.healthy)
        if missing:
            self.stop_replicas()
            raise SystemExit(f"polymorph: replicas {', '.join(missing)} did not become healthy (logs in {self.local.log_dir})")
        for record in self.slots.values():
            self.slots[record.slot] = dataclasses.replace(record, phase="active")

    def adopt(self, state: ControllerState) -> None:
        """Take over the slots of ``state``: live processes as they are, dead ones relaunched."""
        self.epoch, self.version = state.epoch, state.plan_version
        self._plan_key = self._plan_routes(state.slots)  # the plan the gateways route on: same version while unchanged
        for record in state.slots:  # checked before anything is launched
            if not record.model and len(self.models) > 1:
                raise SystemExit(f"polymorph: {self.state_file} was written by a controller of one model, and the config launches "
                                 f"replicas of {', '.join(self.models)}: move it aside to start the fleet afresh")
            if record.model and record.model not in self.models:
                raise SystemExit(f"polymorph: {self.state_file} has replica {record.slot} serving {record.model!r}, which the config "
                                 f"no longer launches (it launches {', '.join(self.models)}): move the file aside to start afresh")
        for record in state.slots:
            record = dataclasses.replace(record, model=record.model or self.models[0])  # format 1: the one model's
            if self.ray is not None:  # known to the actuator, to be started or stopped later
                self.ray.add_slot(record.slot, record.gpu, record.pool, record.config_json, record.devices)
            alive = record.url is not None and _pid_alive(record.pid) and (record.phase == "starting" or answers_health(record.url, 2.0))
            if record.phase == "stopped" or alive:
                self.slots[record.slot] = record
                if alive and record.phase != "starting":
                    self.healthy.add(record.slot)
                continue
            print(f"polymorph: replica {record.slot} ({record.url}, pid {record.pid}) is gone; starting it again", file=sys.stderr, flush=True)
            relaunched = self._launch(record, record.pool, record.config_json)
            if record.phase in ("active", "draining"):
                self.recovering.add(record.slot)
            self.slots[record.slot] = relaunched

    def build_controller(self, state: ControllerState | None) -> None:
        """One controller per model over the slots that model holds; each resumes its part of ``state``."""
        model_to_budget: dict[str, dict[str, int]] = {}
        for record in self.slots.values():
            budget = model_to_budget.setdefault(record.model, {})
            budget[record.gpu] = budget.get(record.gpu, 0) + 1
        now = self.now()
        loops = dict(state.model_to_loop) if state is not None else {}
        controllers = {}
        for model, budget in sorted(model_to_budget.items()):
            settings = controller_settings(self.config, model, budget, f"{model}:" if len(model_to_budget) > 1 else "")
            telemetry = self.telemetry.of(model)
            controllers[model] = Controller(settings, telemetry, PerfCapacity(model, self.settings.capacity_cache), telemetry.window(now))
            loop = loops.get(model, loops.get("") if len(model_to_budget) == 1 else None)  # "": a format-1 state's one model
            if loop is not None and state is not None:
                restore(controllers[model], loop, state.slots, now)
        rebalance = RebalanceSettings(self.settings.rebalance_cooldown_s, self.settings.rebalance_min_gain) if self.settings.rebalance else None
        self.controller = MultiController(controllers, {r.slot: r.model for r in self.slots.values()}, rebalance)
        if state is not None and self.controller.arbiter is not None:
            restore_arbiter(self.controller.arbiter, state)
        self._publish()
        self._persist()

    # -- the Actuator protocol (fleet.commands; applied on the tick thread) ----------------------

    def drain(self, slot: str, now: float) -> None:
        record = self.slots[slot]
        if record.phase == "active":
            self._set(dataclasses.replace(record, phase="draining"))  # publishes the plan version that drains it
            self.slots[slot] = dataclasses.replace(self.slots[slot], drained_at_version=self.version)

    def num_in_flight(self, slot: str) -> int:
        record = self.slots[slot]
        wall = time.time()
        with self._lock:
            live = [g for g in self._gateways.values() if wall - g.at <= self.stale_s]
        behind = sum(1 for g in live if g.epoch != self.epoch or g.version < record.drained_at_version)
        return behind + sum(g.in_flight.get(record.url or "", 0) for g in live)

    def stop(self, slot: str, now: float) -> None:
        record = self.slots[slot]
        self._terminate(slot, record.pid)
        self.healthy.discard(slot)
        # not published: a stop is always followed by its start (fleet.rollout), and a plan without the
        # slot in between would tell the gateways that nothing comes back, ending their restart holds
        self.slots[slot] = dataclasses.replace(record, phase="stopped", url=None, pid=None, drained_at_version=0)

    def start(self, slot: str, pool: str, config_json: str, now: float) -> None:
        self._set(self._launch(self.slots[slot], pool, config_json))  # published: the gateways hold for a starting slot
        self._persist()  # the new process must be known even if this controller dies before the tick ends

    def activate(self, slot: str, now: float) -> None:
        self._set(dataclasses.replace(self.slots[slot], phase="active"))

    # -- plan and persistence --------------------------------------------------------------------

    def _plan_routes(self, slots: Iterable[SlotRecord]) -> bytes:
        """What the gateways route on: each pool's routable replicas, with their drain flags, and the slots
        starting in a pool (while no replica serves the model, a gateway holds its requests for them)."""
        pools: dict[str, dict[str, Any]] = {}
        starting = []
        for record in sorted(slots, key=lambda r: r.slot):
            if record.phase == "starting":
                starting.append({"name": record.slot, "pool": record.pool, "model": record.model})
            if record.phase not in ("active", "draining"):
                continue
            pool = pools.setdefault(record.pool, {"name": record.pool, "model": record.model, "gpu": record.gpu,
                                                  "config_json": record.config_json, "replicas": []})
            pool["replicas"].append({"name": record.slot, "url": record.url, "draining": record.phase == "draining"})
        return orjson.dumps({"pools": sorted(pools.values(), key=lambda p: p["name"]), "starting": starting})

    def _publish(self) -> None:
        """A new plan version when what the gateways route on changed (the HTTP side reads the bytes)."""
        key = self._plan_routes(self.slots.values())
        if key == self._plan_key and self.plan_body:
            return
        if key != self._plan_key:
            self.version += 1
        self._plan_key = key
        self.plan_body = orjson.dumps({"epoch": self.epoch, "version": self.version, **orjson.loads(key)})
        self.etag = f'"{self.epoch}-{self.version}"'

    def _persist(self) -> None:
        assert self.controller is not None
        slots = tuple(sorted(self.slots.values(), key=lambda r: r.slot))
        rebalanced_at, lent = capture_arbiter(self.controller.arbiter) if self.controller.arbiter is not None else (-math.inf, None)
        state = ControllerState(self.epoch, self.version, slots, tuple((m, capture(c)) for m, c in self.controller.model_to_controller.items()),
                                rebalanced_at, lent)
        doc = state.to_json()
        body = orjson.dumps(doc)
        if body != self._saved:
            save_state(self.state_file, doc)
            self._saved = body

    # -- the loop (tick thread) ------------------------------------------------------------------

    def _alive(self, record: SlotRecord) -> bool:
        """Its replica's process runs (this process's child, an earlier leader's by its pid, or a Ray actor): a
        dead one's GPUs leave the budget the controller plans (a ``capacity`` decision), as in the gateway's fleet."""
        if self.ray is not None:
            found = self.ray.slot_state(record.slot)
            return found is not None and found.alive
        child = self.processes.get(record.slot)
        return child.process.poll() is None if child is not None else _pid_alive(record.pid)

    def _probe_starting(self) -> None:
        for record in list(self.slots.values()):
            if record.phase != "starting" or record.slot in self.healthy:
                continue
            child = self.processes.get(record.slot)  # None: Ray's, or adopted from an earlier leader
            if child is not None and (again := self.local.relaunch_if_port_lost(child)) is not None:  # another process took its port
                self.local.replicas.remove(again)
                self.processes[record.slot] = again
                self.slots[record.slot] = dataclasses.replace(record, url=again.url, pid=again.process.pid)
                continue
            if self.ray is not None and self.ray.is_healthy(record.slot, self.now()):
                self.slots[record.slot] = dataclasses.replace(record, url=self.ray.url(record.slot))  # known once its actor answered
            elif self.ray is not None or not (record.url and answers_health(record.url, 0.5)) or (child is not None and child.process.poll() is not None):
                continue  # not answering yet, or another process answers on the port its exited child was given
            # a real engine's first request compiles and allocates: one warm-up before it is routable (it holds
            # this tick, as the start it follows holds the rollout; a failed one is tried again next tick)
            model = self.warmup_model.get(record.slot)
            if model is not None and record.url and not warm_up(record.url, model, _WARMUP_TIMEOUT_S):
                continue
            self.warmup_model.pop(record.slot, None)
            self.healthy.add(record.slot)
            if record.slot in self.recovering:
                self.recovering.discard(record.slot)
                self.activate(record.slot, self.now())

    async def read_engines(self) -> None:
        """Every routable replica's engine figures, read concurrently each tick interval on the event loop
        (as the gateway's scraper does, gateway.engine_scrape): the tick takes the latest of each that is
        no older than ``_engine_stale_s``. A busy engine answers /metrics slowly; reading between ticks
        instead would leave its figures out of exactly the ticks it is loaded in."""
        loop = asyncio.get_running_loop()
        interval_s = self.settings.tick_s / self.speed
        timeout = aiohttp.ClientTimeout(total=min(1.0, max(interval_s, 0.25)))
        async with aiohttp.ClientSession() as session:

            async def one(slot: str, url: str, kind: str) -> tuple[tuple[str, str], EngineLoad | None]:
                try:
                    return (slot, url), await read_engine_load(session, url, kind, timeout, self.now())
                except EngineUnreadable:
                    return (slot, url), None

            while True:
                started = loop.time()
                with self._lock:
                    routable = self._routable
                read = await asyncio.gather(*(one(*r) for r in routable))
                with self._lock:
                    self._engines.update((key, load) for key, load in read if load is not None)
                await asyncio.sleep(max(0.0, interval_s - (loop.time() - started)))

    def _fresh_engines(self, now: float) -> dict[str, EngineLoad]:
        """Per slot, the figures read from the process it runs now (by URL: a restarted slot's old figures
        are not its new engine's), if fresh."""
        with self._lock:
            self._engines = {key: load for key, load in self._engines.items() if now - load.scraped_at <= self._engine_stale_s}
            return {slot: load for (slot, url), load in self._engines.items() if (r := self.slots.get(slot)) is not None and r.url == url}

    def _publish_routable(self) -> None:
        """The replicas read_engines reads next: this tick's routable slots (the tick thread owns ``slots``)."""
        # how each replica's /metrics reads: its pool's engine, as gateway.replicas launched it
        routable = tuple((r.slot, r.url, spec.engine_kind if (spec := pool_engine(self.config, r.pool, r.gpu)) is not None else "emulated")
                         for r in self.slots.values() if r.phase in ("active", "draining") and r.url)
        with self._lock:
            self._routable = routable

    def tick(self) -> None:
        assert self.controller is not None
        now = self.now()
        engines = self._fresh_engines(now)
        self._publish_routable()
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for report in inbox:
            replay(report, self.telemetry, now)
        for process in [p for p in self.stopping if p.poll() is not None]:
            self.stopping.remove(process)
        self._probe_starting()
        slots = [SlotState(r.slot, r.pool, r.gpu, r.config_json, alive=self._alive(r), num_in_flight=self.num_in_flight(r.slot),
                           healthy=r.slot in self.healthy, engine=engines.get(r.slot)) for r in self.slots.values()]
        out = self.controller.tick(now, slots)
        for slot, model in self.controller.slot_to_model.items():  # a slot the arbiter gave another model starts as that model's
            if self.slots[slot].model != model:
                self.slots[slot] = dataclasses.replace(self.slots[slot], model=model)
        apply(out.commands, self, now)
        self.decisions.extend([dataclasses.replace(d, at=d.at / self.speed) for d in out.decisions])
        self._persist()

    async def run_ticks(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.settings.tick_s / self.speed)
            try:
                await loop.run_in_executor(self.executor, self.tick)
            except Exception as exc:  # noqa: BLE001 (the gateways keep routing on the last plan)
                print(f"polymorph: controller tick failed, keeping the current plan: {exc!r}", file=sys.stderr, flush=True)

    def stop_replicas(self) -> None:
        if self.ray is not None:
            close(self.ray)
            return
        for record in self.slots.values():
            self._terminate(record.slot, record.pid)
        for process in self.stopping:
            try:
                process.wait(5.0)
            except subprocess.TimeoutExpired:
                process.kill()

    # -- HTTP (event loop) -----------------------------------------------------------------------

    async def get_plan(self, request: web.Request) -> web.Response:
        etag = self.etag
        if request.headers.get("If-None-Match") == etag:
            return web.Response(status=304, headers={"ETag": etag})
        return web.Response(body=self.plan_body, content_type=_JSON, headers={"ETag": etag})

    async def post_report(self, request: web.Request) -> web.Response:
        try:
            doc = orjson.loads(await request.read())
            if not isinstance(doc, dict) or not isinstance(doc.get("gateway"), str):
                raise TypeError("a report is a JSON object with a 'gateway' id")
            in_flight = doc.get("in_flight", {})
            if not isinstance(in_flight, dict) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in in_flight.values()):
                raise ValueError("in_flight must map replica URLs to counts")
            version, epoch = doc.get("version", 0), doc.get("epoch")
            if isinstance(version, bool) or not isinstance(version, int) or not (epoch is None or isinstance(epoch, str)):
                raise ValueError("version must be an integer and epoch a string or null")
            report = parse(doc.get("telemetry", {"bucket_s": 5.0}))
        except (ValueError, TypeError, RequestPayloadError) as exc:  # orjson.JSONDecodeError is a ValueError
            return error_response(ApiError(400, f"Invalid report: {exc}", "invalid_report"))
        with self._lock:
            self._gateways[doc["gateway"]] = _GatewayReport(time.time(), epoch, version, in_flight)
            self._inbox.append(report)
        return web.Response(status=204)

    async def healthz(self, request: web.Request) -> web.Response:
        return web.Response(body=orjson.dumps({"status": "ok", "role": "leader", "epoch": self.epoch, "plan_version": self.version}), content_type=_JSON)

    async def get_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics), headers={"Content-Type": CONTENT_TYPE})

    async def admin_decisions(self, request: web.Request) -> web.Response:
        if not is_admin_request(request, self.config.server.admin_token_sha256):
            return error_response(ApiError(401, "The admin API needs 'Authorization: Bearer <admin token>'.", "invalid_admin_token"))
        return web.Response(body=orjson.dumps({"decisions": self.decisions.tail()}), content_type=_JSON)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=8 * 1024 * 1024)
        app.router.add_get("/plan", self.get_plan)
        app.router.add_post("/report", self.post_report)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/admin/decisions", self.admin_decisions)
        app.router.add_get("/metrics", self.get_metrics)
        return app


async def serve(service: ControllerService) -> None:
    """Listen where ``fleet.controller.url`` says, tick until SIGTERM or SIGINT."""
    assert service.settings.url is not None
    where = urlsplit(service.settings.url)
    runner = EnvelopeAppRunner(service.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, where.hostname or "127.0.0.1", where.port or 80)
    await site.start()
    print(f"polymorph: controller leading at {service.settings.url} (plan version {service.version}, "
          f"{len(service.slots)} replica slots)", file=sys.stderr, flush=True)
    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(service.run_ticks()), loop.create_task(service.read_engines())]
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await runner.cleanup()
    service.executor.shutdown(wait=True)
    if service.ray is not None:  # its actors would die with this process anyway: let their replicas exit cleanly
        service.stop_replicas()
