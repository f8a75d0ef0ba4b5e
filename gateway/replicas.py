"""How the fleet's emulated replicas run (``fleet.actuator``): processes on this host, or Ray actors.

Either way the gateway gets a ``ReplicaControl``, the controller's ``Actuator`` over replica slots
that routes through the ``Routing`` bound to it (``LiveFleet``, once the gateway's pools exist):
``fleet.actuators.local_slots.LocalSlots`` or ``fleet.actuators.ray.RayActuator``. Ray is imported
only when chosen. With ``fleet.ray.address: null`` this process starts a local Ray cluster on loopback
with as many logical GPUs as the fleet's emulated replicas use (or ``fleet.ray.num_gpus``) and stops
it on close; otherwise it joins the cluster at that address.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Protocol

import orjson

from fleet.actuators.local import LocalActuator, emulated_replica_argv
from fleet.actuators.local_slots import LocalSlots, Routing
from fleet.rollout import SlotState
from gateway.config import GatewayConfig, RaySettings
from kernels.config import EngineConfig

RAY_MISSING = "fleet.actuator: ray needs the ray extra: pip install 'polymorph[ray]'"


class ReplicaControl(Protocol):
    """What ``LocalSlots`` and ``RayActuator`` share: the ``Actuator`` protocol and their slots' life."""

    routing: Routing | None

    def add_slot(self, slot: str, gpu: str, pool: str, config_json: str) -> None: ...
    def slot_states(self) -> list[SlotState]: ...
    def drain(self, slot: str, now: float) -> None: ...
    def num_in_flight(self, slot: str) -> int: ...
    def stop(self, slot: str, now: float) -> None: ...
    def start(self, slot: str, pool: str, config_json: str, now: float) -> None: ...
    def is_healthy(self, slot: str, now: float) -> bool: ...
    def activate(self, slot: str, now: float) -> None: ...
    def url(self, slot: str) -> str | None: ...
    def error(self, slot: str) -> str | None: ...
    def close(self) -> None: ...


def emulated_gpus(config: GatewayConfig) -> int:
    """The GPUs the config's emulated replicas use (the planner keeps each replica's GPU count)."""
    return sum(p.num_launched * EngineConfig.from_dict(dict(p.engine)).num_gpus for p in config.pools)


def connect_ray(settings: RaySettings, num_gpus: int) -> None:
    """``ray.init`` as ``fleet.ray`` says; a local cluster stays on loopback and reports no usage."""
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # read when ray is imported: nothing leaves this host
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # today's CUDA_VISIBLE_DEVICES rule, without Ray's FutureWarning
    try:
        import ray
    except ImportError:
        raise SystemExit(f"polymorph: {RAY_MISSING}") from None
    common = {"namespace": "polymorph", "log_to_driver": False, "configure_logging": False}
    if settings.address is not None:
        ray.init(address=settings.address, **common)
        return
    ray.init(
        num_gpus=settings.num_gpus or num_gpus,
        num_cpus=1,  # replica actors reserve no CPU (their engine's use is not Ray's to schedule)
        object_store_memory=100 * 1024 * 1024,  # replicas pass no objects through Ray
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        **common,
    )


def replica_control(config: GatewayConfig, command: tuple[str, ...], log_dir: Path) -> ReplicaControl:
    """The actuator ``fleet.actuator`` names, with no routing bound yet (Ray: connected first)."""
    model = next((p.model for p in config.pools if p.num_launched), "")

    def argv_for(gpu: str, config_json: str) -> tuple[str, ...]:
        return emulated_replica_argv(command, model, gpu, config_json, config.emulator_speed)

    if config.actuator == "local":
        return LocalSlots(LocalActuator(log_dir), argv_for)
    connect_ray(config.ray, emulated_gpus(config))
    from fleet.actuators.ray import RayActuator

    return RayActuator(None, argv_for, log_dir, start_timeout_s=120.0)


def close(control: ReplicaControl) -> None:
    """Stop every replica (blocks until they are gone); a Ray fleet also leaves its cluster (and stops
    the local one it started)."""
    control.close()
    if not isinstance(control, LocalSlots):
        import ray

        ray.shutdown()


def start_fleet(control: ReplicaControl, config: GatewayConfig, timeout_s: float = 120.0) -> dict[str, list[str]]:
    """Start the config's emulated replicas and wait until they answer; returns pool -> URLs.

    Each slot is named as the gateway names its replica (``<pool>-<i>``, after the pool's static URLs),
    so ``Routing`` calls find it. Raises SystemExit, with the replicas stopped, if any never answers."""
    slots: list[tuple[str, str]] = []  # (slot, pool)
    for pool in config.pools:
        for i in range(pool.num_launched):
            assert pool.gpu is not None
            slot = f"{pool.name}-{len(pool.urls) + i}"
            config_json = orjson.dumps(dict(pool.engine), option=orjson.OPT_SORT_KEYS).decode()
            control.add_slot(slot, pool.gpu, pool.name, config_json)
            control.start(slot, pool.name, config_json, 0.0)
            slots.append((slot, pool.name))
    if not slots:
        return {}
    print(f"polymorph: starting {len(slots)} emulated replicas ({config.actuator} actuator)", file=sys.stderr, flush=True)
    deadline = time.monotonic() + timeout_s
    pending = [s for s, _ in slots]
    while pending and time.monotonic() < deadline and not any(control.error(s) for s in pending):
        time.sleep(0.1)
        pending = [s for s in pending if not control.is_healthy(s, 0.0)]
    if pending:
        why = ", ".join(f"{s} ({control.error(s) or 'no answer'})" for s in pending)
        close(control)
        raise SystemExit(f"polymorph: emulated replicas did not become healthy: {why}")
    urls: dict[str, list[str]] = {}
    for slot, pool_name in slots:
        url = control.url(slot)
        assert url is not None
        urls.setdefault(pool_name, []).append(url)
    return urls
