"""Replica slots as processes on this host, the local twin of the Ray actuator.

Both hold the controller's replica slots and their processes; neither routes. The edge that applies
the controller's commands (the gateway's ``LiveFleet``) keeps routing to itself and hands them the
process half: stop ends a slot's process, start launches the slot's new configuration on a free
port and probes its ``/health`` from a thread of its own; ``slot_states`` reports what came of it
(alive, healthy) for the next tick's snapshot, after starting again on another port a start whose port
another process took before it listened. Every call returns at once.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from fleet.actuators.local import LaunchSpec, LocalActuator, LocalReplica, answers_health, warm_up
from fleet.rollout import SlotState

# (device kind, pool, engine config JSON, the slot's device ids) -> what to start (its name is the caller's)
LaunchFor = Callable[[str, str, str, tuple[str, ...]], LaunchSpec]


@dataclass(slots=True)
class _Slot:
    name: str
    gpu: str
    pool: str
    config_json: str
    devices: tuple[str, ...] = ()  # the device ids it holds, whatever pool it serves
    process: LocalReplica | None = None
    healthy: bool = False


class LocalSlots:
    """Replica slots as child processes of the local actuator; ``add_slot`` + ``start`` place the initial fleet."""

    def __init__(self, local: LocalActuator, launch_for: LaunchFor, start_timeout_s: float = 120.0, stop_grace_s: float = 10.0) -> None:
        self.local = local
        self.launch_for = launch_for
        self.start_timeout_s = start_timeout_s
        self.stop_grace_s = stop_grace_s  # SIGTERM, then SIGKILL this long after
        self.slots: dict[str, _Slot] = {}
        self.stopping: list[tuple[LocalReplica, float]] = []  # (process, when it gets SIGKILL)

    def add_slot(self, slot: str, gpu: str, pool: str, config_json: str, devices: tuple[str, ...] = ()) -> None:
        self.slots[slot] = _Slot(slot, gpu, pool, config_json, devices)

    def devices(self, slot: str) -> tuple[str, ...]:
        return self.slots[slot].devices

    def argv(self, slot: str) -> tuple[str, ...] | None:
        """The command line the slot's process runs (None: none runs)."""
        process = self.slots[slot].process
        return (*process.spec.argv, "--host", self.local.host, "--port", process.url.rsplit(":", 1)[1]) if process is not None else None

    def slot_states(self) -> list[SlotState]:
        """Called once a tick: also reaps the processes stopped since the last one (and kills those past their grace)."""
        wall = time.monotonic()
        for item in list(self.stopping):
            process, kill_at = item
            if process.process.poll() is None:
                if wall >= kill_at:
                    process.process.kill()
                continue
            self.stopping.remove(item)
            if process in self.local.replicas:
                self.local.replicas.remove(process)
        for found in self.slots.values():
            self._relaunch_if_port_lost(found)
        return [self._state(s) for s in self.slots.values()]

    def slot_state(self, slot: str) -> SlotState | None:
        found = self.slots.get(slot)
        if found is None:
            return None
        self._relaunch_if_port_lost(found)
        return self._state(found)

    @staticmethod
    def _state(s: _Slot) -> SlotState:
        # a slot whose process has exited serves nothing: the controller takes its GPUs out of the budget
        return SlotState(s.name, s.pool, s.gpu, s.config_json, alive=s.process is not None and s.process.process.poll() is None,
                         healthy=s.healthy)

    # -- the process half of the commands ------------------------------------------------------

    def stop(self, slot: str, now: float) -> None:
        found = self.slots[slot]
        process, found.process, found.healthy = found.process, None, False
        if process is not None:
            process.process.terminate()  # reaped (or killed) by a later tick; never waits here
            self.stopping.append((process, time.monotonic() + self.stop_grace_s))

    def start(self, slot: str, pool: str, config_json: str, now: float) -> None:
        found = self.slots[slot]
        spec = self.launch_for(found.gpu, pool, config_json, found.devices)
        # the name is also the log file's: no '/' (controller slots are named like H100-SXM/0)
        found.process = self.local.start(dataclasses.replace(spec, name=f"{slot.replace('/', '-')}-{time.time_ns()}"))
        found.pool, found.config_json, found.healthy = pool, config_json, False
        self._watch(found)

    def _watch(self, found: _Slot) -> None:
        # its own thread: a replica that hangs at start-up must not hold up the controller's ticks (and its start deadline)
        threading.Thread(target=self._wait_healthy, args=(found,), name=f"polymorph-start-{found.name}", daemon=True).start()

    def _relaunch_if_port_lost(self, found: _Slot) -> None:
        """Before a slot is reported: a start that lost its port to another process starts again on another
        (``LocalActuator.relaunch_if_port_lost``). Called on the thread that starts and stops slots."""
        if found.process is not None and not found.healthy and (again := self.local.relaunch_if_port_lost(found.process)) is not None:
            found.process = again
            self._watch(found)

    def is_healthy(self, slot: str, now: float) -> bool:
        return self.slots[slot].healthy

    # -- what callers may want to see ----------------------------------------------------------

    def url(self, slot: str) -> str | None:
        process = self.slots[slot].process
        return process.url if process is not None else None

    def error(self, slot: str) -> str | None:
        self._relaunch_if_port_lost(self.slots[slot])
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
            if answers_health(process.url) and process.process.poll() is None:  # not another process on a port it lost
                model = process.spec.warmup_model
                found.healthy = model is None or warm_up(process.url, model, max(1.0, deadline - time.monotonic()))
                return
            time.sleep(0.2)
