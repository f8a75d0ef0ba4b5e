"""The controller's ``Actuator`` over replica processes on this host, the local twin of the Ray actuator.

Both hold the controller's replica slots and their processes; neither routes. Routing stays with
whoever owns the router's pools (the gateway's ``LiveFleet``), which they tell through ``Routing``:
drain marks a replica unroutable, stop ends its process and removes it, start launches the slot's
new configuration on a free port and probes its ``/health`` from a thread of its own, activate makes
it routable in its (possibly new) pool. Every call returns at once, as the protocol asks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from fleet.actuators.local import LaunchSpec, LocalActuator, LocalReplica, answers_health
from fleet.rollout import SlotState

ArgvFor = Callable[[str, str], tuple[str, ...]]  # (gpu kind, engine config JSON) -> replica command line


class Routing(Protocol):
    """Whoever owns the router's pools; an actuator calls it from its caller's or worker threads."""

    def drain(self, slot: str) -> None: ...  # route nothing new to the slot
    def remove(self, slot: str) -> None: ...  # the slot's replica is going away
    def add(self, slot: str, url: str, pool: str, gpu: str, config_json: str) -> None: ...  # routable in ``pool``
    def num_in_flight(self, slot: str) -> int: ...


@dataclass(slots=True)
class _Slot:
    name: str
    gpu: str
    pool: str
    config_json: str
    process: LocalReplica | None = None
    healthy: bool = False


class RoutedActuator:
    """The half of the Actuator protocol that is the router's (drain, in-flight count): an actuator
    that owns only processes hands it to its bound ``Routing``."""

    routing: Routing | None

    def _routes(self) -> Routing:
        assert self.routing is not None, "no Routing bound to the actuator"
        return self.routing

    def drain(self, slot: str, now: float) -> None:
        self._routes().drain(slot)

    def num_in_flight(self, slot: str) -> int:
        return self._routes().num_in_flight(slot)


class LocalSlots(RoutedActuator):
    """Replica slots as child processes of the local actuator; ``add_slot`` + ``start`` place the initial fleet.

    ``routing`` may be bound after the initial fleet is up (the gateway's pools exist only then); it is
    needed from the first ``drain`` or ``activate`` on."""

    def __init__(self, local: LocalActuator, argv_for: ArgvFor, routing: Routing | None = None, start_timeout_s: float = 120.0) -> None:
        self.local = local
        self.argv_for = argv_for
        self.routing = routing
        self.start_timeout_s = start_timeout_s
        self.slots: dict[str, _Slot] = {}
        self.stopping: list[LocalReplica] = []

    def add_slot(self, slot: str, gpu: str, pool: str, config_json: str) -> None:
        self.slots[slot] = _Slot(slot, gpu, pool, config_json)

    def slot_states(self) -> list[SlotState]:
        """Called once a tick: also reaps the processes stopped since the last one."""
        for process in [p for p in self.stopping if p.process.poll() is not None]:
            self.stopping.remove(process)
            if process in self.local.replicas:
                self.local.replicas.remove(process)
        # a slot whose process has exited serves nothing: the controller takes its GPUs out of the budget
        return [SlotState(s.name, s.pool, s.gpu, s.config_json, alive=s.process is not None and s.process.process.poll() is None)
                for s in self.slots.values()]

    # -- the Actuator protocol (drain and num_in_flight: RoutedActuator) ----------------------

    def stop(self, slot: str, now: float) -> None:
        found = self.slots[slot]
        process, found.process, found.healthy = found.process, None, False
        if process is not None:
            process.process.terminate()  # reaped by a later tick; never waits here
            self.stopping.append(process)
        if self.routing is not None:
            self.routing.remove(slot)

    def start(self, slot: str, pool: str, config_json: str, now: float) -> None:
        found = self.slots[slot]
        found.process = self.local.start(LaunchSpec(f"{slot}-{time.time_ns()}", self.argv_for(found.gpu, config_json)))
        found.pool, found.config_json, found.healthy = pool, config_json, False
        # its own thread: a replica that hangs at start-up must not hold up the controller's ticks (and its start deadline)
        threading.Thread(target=self._wait_healthy, args=(found,), name=f"polymorph-start-{slot}", daemon=True).start()

    def is_healthy(self, slot: str, now: float) -> bool:
        return self.slots[slot].healthy

    def activate(self, slot: str, now: float) -> None:
        found = self.slots[slot]
        assert found.process is not None, f"{slot} activated before it was started"
        self._routes().add(slot, found.process.url, found.pool, found.gpu, found.config_json)

    # -- what callers may want to see ----------------------------------------------------------

    def url(self, slot: str) -> str | None:
        process = self.slots[slot].process
        return process.url if process is not None else None

    def error(self, slot: str) -> str | None:
        process = self.slots[slot].process
        if process is None or process.process.poll() is None:
            return None
        return f"exited with code {process.process.returncode} (see {process.log_path})"

    def close(self) -> None:
        """Stop every replica and wait for its process (for shutdown; blocks)."""
        self.local.stop_all()

    def _wait_healthy(self, found: _Slot) -> None:
        process = found.process
        deadline = time.monotonic() + self.start_timeout_s
        while process is not None and process is found.process and process.process.poll() is None and time.monotonic() < deadline:
            if answers_health(process.url):
                found.healthy = True
                return
            time.sleep(0.2)
