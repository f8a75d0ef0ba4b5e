"""The Ray actuator: each replica is a Ray actor holding its GPUs, so one controller drives a multi-node cluster.

A start reserves the configuration's GPUs (``tp x dp``) as a STRICT_PACK placement group of one
bundle, places a ``_ReplicaHost`` actor in it with ``num_gpus`` = all of them, and the actor runs the
replica server as its child process on its node's IP and a free port (the command comes from
``launch_for``: ``polymorph emulate`` for emulated replicas, a rendered ``sglang.launch_server`` for
real ones). One bundle, not one per GPU: a bundle is the most one actor can use, and sglang's server
is one process that must see all its GPUs; Ray sets the actor's ``CUDA_VISIBLE_DEVICES`` to them and
the child inherits it. The group makes the reservation atomic and lets a move start the new replica
before the old one has let go: Ray places the new group once the old one is removed.

Stopping is graceful: the actor terminates its child and waits for it (a real engine frees its GPU
memory only when its process exits), and only then are the actor killed and its group removed. Every
call returns at once; the waits run in worker threads. Routing stays with the edge that applies the
controller's commands (the gateway's ``LiveFleet``); this actuator is only their process half, like
its local twin (``fleet.actuators.local_slots.LocalSlots``), so the gateway drives either.

Ray is an optional dependency (``pip install -e '.[ray]'``); this module is imported only when a Ray
fleet is used. The caller connects to the cluster (``ray.init(...)``) before making the actuator.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from fleet.actuators.local import LaunchSpec, LocalActuator, answers_health, warm_up
from fleet.actuators.local_slots import LaunchFor
from fleet.rollout import SlotState
from kernels.config import EngineConfig


class _ReplicaHost:
    """A Ray actor that holds one replica's GPUs and runs its server as a child process."""

    def __init__(self, name: str, argv: tuple[str, ...], env: dict[str, str], log_dir: str) -> None:
        # Constructed on the actor's main thread, so the child's parent-death signal fires only when
        # the actor's process dies (ray.kill included): no replica outlives its reservation.
        self._local = LocalActuator(Path(log_dir), host=ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]  # untyped in Ray
        self._replica = self._local.start(LaunchSpec(name, argv, env))

    def url(self) -> str:
        return self._replica.url

    def gpu_ids(self) -> list[Any]:
        return list(ray.get_gpu_ids())

    def exit_code(self) -> int | None:
        """The replica process's exit code; None while it runs."""
        return self._replica.process.poll()

    def relaunch_if_port_lost(self) -> str | None:
        """The replica's new URL if its start lost its port to another process and it started again on
        another (``LocalActuator.relaunch_if_port_lost``); None otherwise."""
        again = self._local.relaunch_if_port_lost(self._replica)
        if again is None:
            return None
        self._replica = again
        return again.url

    def shutdown(self, grace_s: float) -> None:
        self._local.stop(self._replica, grace_s)


_RemoteHost = ray.remote(_ReplicaHost)


@dataclass(slots=True)
class _Replica:
    """One start of a slot: its reservation, its actor and, once it answered, its URL."""

    group: PlacementGroup
    actor: Any  # ray.actor.ActorHandle
    url_ref: Any  # ray.ObjectRef of the actor's URL
    warmup_model: str | None  # a real engine's first request compiles and allocates: one is sent before it is healthy
    url: str | None = None
    healthy: bool = False
    error: str | None = None  # why it will never be healthy (actor died, never placed)


@dataclass(slots=True)
class _Slot:
    name: str
    gpu: str
    pool: str
    config_json: str
    replica: _Replica | None = None


class RayActuator:
    """Replica slots as Ray actors (the process half of the controller's commands, as ``LocalSlots``);
    ``add_slot`` + ``start`` place the initial fleet."""

    def __init__(self, launch_for: LaunchFor, log_dir: Path, start_timeout_s: float = 600.0, stop_grace_s: float = 30.0) -> None:
        self.launch_for = launch_for
        self.log_dir = log_dir
        self.start_timeout_s = start_timeout_s
        self.stop_grace_s = stop_grace_s
        self.slots: dict[str, _Slot] = {}
        self._workers = ThreadPoolExecutor(max_workers=64, thread_name_prefix="polymorph-ray")

    def add_slot(self, slot: str, gpu: str, pool: str, config_json: str, devices: tuple[str, ...] = ()) -> None:
        """A slot on GPUs of kind ``gpu``, not started yet (``start`` it, then ``activate`` once healthy)."""
        self.slots[slot] = _Slot(slot, gpu, pool, config_json)

    def slot_states(self) -> list[SlotState]:
        return [self._state(s) for s in self.slots.values()]

    def slot_state(self, slot: str) -> SlotState | None:
        found = self.slots.get(slot)
        return self._state(found) if found is not None else None

    @staticmethod
    def _state(s: _Slot) -> SlotState:
        return SlotState(s.name, s.pool, s.gpu, s.config_json, alive=s.replica is not None and s.replica.error is None,
                         healthy=s.replica is not None and s.replica.healthy)

    # -- the process half of the commands ------------------------------------------------------

    def stop(self, slot: str, now: float) -> None:
        found = self.slots[slot]
        replica, found.replica = found.replica, None
        if replica is not None:
            self._workers.submit(self._retire, replica)

    def start(self, slot: str, pool: str, config_json: str, now: float) -> None:
        found = self.slots[slot]
        num_gpus = EngineConfig.from_dict(orjson.loads(config_json)).num_gpus
        name = f"polymorph-{slot.replace('/', '-')}-{time.time_ns()}"  # also its log file's name: no '/' (slots like H100-SXM/0)
        spec = self._spec(found, pool, config_json)
        group = placement_group([{"GPU": num_gpus}], strategy="STRICT_PACK", name=name)
        actor = _RemoteHost.options(
            name=name,
            num_cpus=0,  # a replica's CPU use is its engine's, not a Ray task's
            num_gpus=num_gpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0),
            max_restarts=0,
        ).remote(name, spec.argv, dict(spec.env), str(self.log_dir))
        # Ray's stubs type an actor's method as the plain function; the handle's method has .remote
        replica = _Replica(group, actor, actor.url.remote(), spec.warmup_model)  # type: ignore[union-attr]
        found.replica, found.pool, found.config_json = replica, pool, config_json
        self._workers.submit(self._wait_healthy, found, replica)

    def _spec(self, found: _Slot, pool: str, config_json: str) -> LaunchSpec:
        # Ray sets the actor's CUDA_VISIBLE_DEVICES to its GPUs: the slot holds no device ids of its own
        return self.launch_for(found.gpu, pool, config_json, ())

    def is_healthy(self, slot: str, now: float) -> bool:
        replica = self.slots[slot].replica
        return replica is not None and replica.healthy

    # -- what callers may want to see ----------------------------------------------------------

    def devices(self, slot: str) -> tuple[str, ...]:
        return ()  # Ray picks the GPUs (``gpu_ids``)

    def argv(self, slot: str) -> tuple[str, ...] | None:
        found = self.slots[slot]
        return self._spec(found, found.pool, found.config_json).argv if found.replica is not None else None

    def url(self, slot: str) -> str | None:
        replica = self.slots[slot].replica
        return replica.url if replica is not None else None

    def error(self, slot: str) -> str | None:
        replica = self.slots[slot].replica
        return replica.error if replica is not None else None

    def gpu_ids(self, slot: str) -> list[Any]:
        """The GPU ids Ray gave the slot's actor (blocks: for diagnostics and tests)."""
        replica = self.slots[slot].replica
        assert replica is not None and replica.url is not None, f"{slot} is not running"
        return list(ray.get(replica.actor.gpu_ids.remote(), timeout=30))

    def close(self) -> None:
        """Stop every replica and wait until their GPUs are released (for shutdown; blocks)."""
        for slot in list(self.slots):
            self.stop(slot, 0.0)
        self._workers.shutdown(wait=True)

    # -- worker threads ------------------------------------------------------------------------

    def _wait_healthy(self, found: _Slot, replica: _Replica) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while found.replica is replica and time.monotonic() < deadline:
            if replica.url is None:
                ready, _ = ray.wait([replica.url_ref], timeout=1.0)
                if not ready:
                    continue  # its group waits for GPUs, or its actor is starting
                try:
                    replica.url = ray.get(replica.url_ref)
                except ray.exceptions.RayError as exc:
                    replica.error = f"replica actor failed: {exc}"
                    return
            code = ray.get(replica.actor.exit_code.remote(), timeout=30)
            if code is None and answers_health(replica.url):  # its own process answers, not another on a port it lost
                model = replica.warmup_model
                replica.healthy = model is None or warm_up(replica.url, model, max(1.0, deadline - time.monotonic()))
                if not replica.healthy:
                    replica.error = f"the warm-up request to {replica.url} failed"
                return
            if code is not None:
                moved = ray.get(replica.actor.relaunch_if_port_lost.remote(), timeout=30)
                if moved is not None:  # another process took its port before it listened: it started again on another
                    replica.url = moved
                    continue
                # an engine that refused its arguments exits at once: say so now, not at the start timeout
                replica.error = f"the replica process exited with code {code} (see its log under {self.log_dir})"
                return
            time.sleep(0.2)
        if found.replica is replica:
            replica.error = f"not healthy within {self.start_timeout_s:g} s"

    def _retire(self, replica: _Replica) -> None:
        # Graceful only if the actor is up: a replica still waiting for its group has no child yet.
        started, _ = ray.wait([replica.url_ref], timeout=0)
        if started:
            try:
                ray.get(replica.actor.shutdown.remote(self.stop_grace_s), timeout=self.stop_grace_s + 10.0)
            except ray.exceptions.RayError:
                pass  # the actor is already dead (its child got the parent-death signal) or hung: killed below
        ray.kill(replica.actor, no_restart=True)
        remove_placement_group(replica.group)
