"""How the fleet's replicas run (``fleet.actuator``): processes on this host, Ray actors, or pods of Kubernetes Deployments.

Either way the gateway gets a ``ReplicaControl``, the process half of the controller's commands over
replica slots (the edge that applies them, ``LiveFleet``, keeps routing to itself):
``fleet.actuators.local_slots.LocalSlots``, ``fleet.actuators.ray.RayActuator`` or
``fleet.actuators.kubernetes.KubernetesActuator`` (the pools' Deployments, ``fleet.kubernetes``). Each slot runs the
engine its pool declares (``launcher``), on the device ids it holds from ``fleet.devices``. Ray is imported
only when chosen. With ``fleet.ray.address: null`` this process starts a local Ray cluster on loopback
with as many logical GPUs as the fleet's emulated replicas use (or ``fleet.ray.num_gpus``) and stops
it on close; otherwise it joins the cluster at that address.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import orjson

from fleet.actuators.local import LaunchSpec, LocalActuator, emulated_replica_argv
from fleet.actuators.local_slots import LaunchFor, LocalSlots
from fleet.engines.launch import EngineLaunch, launch_argv, launch_env
from fleet.rollout import SlotState
from gateway.adapters import model_adapters
from gateway.config import GatewayConfig, PoolSpec, RaySettings, replica_devices
from kernels.catalog import get_gpu, get_model
from kernels.config import EngineConfig
from kernels.engine_servers import EngineServer, engine_server

# A real engine loads its weights, and vLLM compiles, before /health answers: ~40 s for vLLM's CPU
# build here, minutes for a large model on GPUs.
REAL_START_TIMEOUT_S = 900.0
RAY_MISSING = "fleet.actuator: ray needs the ray extra: pip install 'polymorph[ray]'"
KUBERNETES_MISSING = "fleet.actuator: kubernetes needs the kubernetes extra: pip install 'polymorph[kubernetes]'"
EMULATE_COMMAND = (sys.executable, "-m", "gateway.cli", "emulate")  # what an emulated replica runs: `polymorph emulate`


class ReplicaControl(Protocol):
    """What ``LocalSlots`` and ``RayActuator`` share: their slots' processes and what came of them."""

    def add_slot(self, slot: str, gpu: str, pool: str, config_json: str, devices: tuple[str, ...] = ()) -> None: ...
    def slot_states(self) -> list[SlotState]: ...  # once a tick; alive and healthy filled in; in-flight counts are the router's
    def slot_state(self, slot: str) -> SlotState | None: ...  # one slot's, without the tick's reaping
    def stop(self, slot: str, now: float) -> None: ...
    def start(self, slot: str, pool: str, config_json: str, now: float) -> None: ...
    def is_healthy(self, slot: str, now: float) -> bool: ...
    def devices(self, slot: str) -> tuple[str, ...]: ...
    def argv(self, slot: str) -> tuple[str, ...] | None: ...
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


def launcher(config: GatewayConfig, command: tuple[str, ...]) -> LaunchFor:
    """What a slot starts for a pool: its declared engine rendered with the configuration it moves
    with, on the slot's devices. The controller plans with the declared pools under their own names;
    a pool it made for a shape no declared pool serves on that device kind (``<shape>@<gpu>``, or
    ``<model>:<shape>@<gpu>`` beside other models) runs the engine of the first declared pool of its model on
    the same device kind; emulated replicas run ``command`` (``polymorph emulate``)."""
    def launch_for(gpu: str, pool: str, config_json: str, devices: tuple[str, ...]) -> LaunchSpec:
        spec = pool_engine(config, pool, gpu)
        model = spec.model if spec is not None else ""
        launch = spec.launch if spec is not None else EngineLaunch("emulated")
        if launch.kind == "emulated":
            return LaunchSpec("", emulated_replica_argv(command, model, gpu, config_json, config.emulator_speed, launch.adapters))
        engine = EngineConfig.from_dict(orjson.loads(config_json))
        env = launch_env(launch, gpu, devices)
        changed = {k: v for k, v in env.items() if os.environ.get(k) != v}  # the process inherits the rest
        return LaunchSpec("", launch_argv(launch, engine, gpu), changed, warmup_model=launch.served_model_name)

    return launch_for


def pool_engine(config: GatewayConfig, pool: str, gpu: str) -> PoolSpec | None:
    """The pool whose engine ``pool``'s replicas on ``gpu`` run: ``pool`` itself where declared, else
    ``made_pool_engine`` (None: no declared pool runs on ``gpu``)."""
    return next((spec for spec in config.pools if spec.name == pool), None) or made_pool_engine(config, pool, gpu)


def made_pool_engine(config: GatewayConfig, pool: str, gpu: str) -> PoolSpec | None:
    """The declared pool whose engine a pool the controller made runs: the first launched one on ``gpu``
    of the model its name carries (``<model>:<shape>@<gpu>``), or of any model (``<shape>@<gpu>``),
    loading every LoRA adapter of that model's declared pools (llama.cpp pools load none)."""
    on_gpu = [spec for spec in config.pools if spec.num_launched and spec.gpu == gpu]
    head = pool.split("@", 1)[0]
    spec = next((spec for spec in on_gpu if head.startswith(f"{spec.model}:")), on_gpu[0] if on_gpu else None)
    if spec is None or spec.launch.kind == "llamacpp":
        return spec
    return dataclasses.replace(spec, launch=dataclasses.replace(spec.launch, adapters=model_adapters(config.pools, spec.model)))


def pool_server(spec: PoolSpec) -> EngineServer | None:
    """How the controller judges the configurations of a pool that ``spec``'s engine runs: as llama-server
    or vLLM runs them on its GPU kind (kernels.engine_servers), else as sglang (None)."""
    return engine_server(spec.engine_kind, get_gpu(spec.gpu) if spec.gpu else None, get_model(spec.model))


def replica_control(config: GatewayConfig, command: tuple[str, ...], log_dir: Path) -> ReplicaControl:
    """The actuator ``fleet.actuator`` names (Ray: connected first)."""
    launch_for = launcher(config, command)
    timeout_s = start_timeout_s(config)
    if config.actuator == "local":
        return LocalSlots(LocalActuator(log_dir), launch_for, timeout_s)
    if config.actuator == "kubernetes":
        return kubernetes_control(config)
    connect_ray(config.ray, emulated_gpus(config))
    from fleet.actuators.ray import RayActuator

    return RayActuator(launch_for, log_dir, start_timeout_s=timeout_s)


def kubernetes_control(config: GatewayConfig) -> ReplicaControl:
    """The pools' engine Deployments in ``fleet.kubernetes.namespace`` (their pods become the slots that
    ``start_fleet`` names); a pool without one, and a configuration change, are rendered as the manifests render them."""
    try:
        from fleet.actuators.kubernetes import KubernetesActuator, api_client
    except ImportError:
        raise SystemExit(f"polymorph: {KUBERNETES_MISSING}") from None
    from fleet.kubernetes_manifests import EnginePool, engine_deployment

    settings = config.kubernetes

    def render(pool: str, gpu: str, config_json: str) -> dict[str, Any]:
        spec = pool_engine(config, pool, gpu)
        if spec is None:
            raise ValueError(f"no declared pool runs on {gpu}: no engine to run")
        engine = EngineConfig.from_dict(orjson.loads(config_json))
        return engine_deployment(EnginePool(pool, spec.model, gpu, engine, spec.launch, 0, config.emulator_speed), settings)

    return KubernetesActuator(api_client(settings.kubeconfig), settings.namespace, render)


def start_timeout_s(config: GatewayConfig) -> float:
    """How long a fleet's replicas may take to answer at start (a real engine loads weights, vLLM compiles)."""
    real = any(p.num_launched and p.engine_kind != "emulated" for p in config.pools)
    return REAL_START_TIMEOUT_S if real else 120.0


def close(control: ReplicaControl) -> None:
    """Stop every replica (blocks until they are gone); a Ray fleet also leaves its cluster (and stops
    the local one it started)."""
    control.close()
    if type(control).__module__ == "fleet.actuators.ray":  # by name: the other actuators never import ray
        import ray

        ray.shutdown()


def assign_devices(config: GatewayConfig) -> tuple[list[tuple[str, PoolSpec, tuple[str, ...]]], dict[str, tuple[str, ...]]]:
    """Each launched replica's slot (``<pool>-<i>``, after the pool's static URLs), its pool and the ids of
    ``fleet.devices`` it holds, in the config's order (none declared: emulated, or every device visible);
    and the ids per kind that no replica holds (what a probe may use beside the fleet)."""
    free = {kind: list(ids) for kind, ids in config.devices.items()}
    held: list[tuple[str, PoolSpec, tuple[str, ...]]] = []
    for pool in config.pools:
        for i in range(pool.num_launched):
            assert pool.gpu is not None
            ids = free.get(pool.gpu, [])[:replica_devices(pool)]
            del free.get(pool.gpu, [])[:len(ids)]
            held.append((f"{pool.name}-{len(pool.urls) + i}", pool, tuple(ids)))
    return held, {kind: tuple(ids) for kind, ids in free.items()}


def start_fleet(control: ReplicaControl, config: GatewayConfig, pool_to_config_json: Mapping[str, str] | None = None) -> dict[str, list[str]]:
    """Start the config's launched replicas, each on its share of ``fleet.devices`` and with its pool's
    configuration (``pool_to_config_json``'s where it names the pool: an adopted one, fleet.adoptions; else the
    declared one), and wait until they answer; returns pool -> URLs.

    Each slot is named as the gateway names its replica (``<pool>-<i>``, after the pool's static URLs),
    so the commands find it. Raises SystemExit, with the replicas stopped, if any never answers."""
    slots: list[tuple[str, str]] = []  # (slot, pool)
    held, _ = assign_devices(config)
    for slot, pool, devices in held:
        assert pool.gpu is not None
        config_json = (pool_to_config_json or {}).get(pool.name, pool.config_json)
        control.add_slot(slot, pool.gpu, pool.name, config_json, devices)
        control.start(slot, pool.name, config_json, 0.0)
        slots.append((slot, pool.name))
    if not slots:
        return {}
    timeout_s = start_timeout_s(config)
    kinds = ", ".join(sorted({p.engine_kind for p in config.pools if p.num_launched}))
    print(f"polymorph: starting {len(slots)} replicas ({kinds}; {config.actuator} actuator)", file=sys.stderr, flush=True)
    deadline = time.monotonic() + timeout_s
    pending = [s for s, _ in slots]
    while pending and time.monotonic() < deadline and not any(control.error(s) for s in pending):
        time.sleep(0.1)
        pending = [s for s in pending if not control.is_healthy(s, 0.0)]
    if pending:
        why = ", ".join(f"{s} ({control.error(s) or 'no answer'})" for s in pending)
        close(control)
        raise SystemExit(f"polymorph: replicas did not become healthy within {timeout_s:g} s: {why}")
    urls: dict[str, list[str]] = {}
    for slot, pool_name in slots:
        url = control.url(slot)
        assert url is not None
        urls.setdefault(pool_name, []).append(url)
    return urls
