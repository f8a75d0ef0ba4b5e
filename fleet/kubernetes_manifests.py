"""Kubernetes objects for a fleet's engine pools: one Deployment and one headless Service per pool.

Pure rendering: frozen dataclasses in, plain dicts (the objects' JSON form) out, no I/O; ``polymorph
deploy kubernetes`` (gateway/deploy_cli.py) writes them, and the Kubernetes actuator finds and scales
what they describe. The names, labels and annotations are the contract between the two:

- a pool's objects are named ``polymorph-engine-<slug>`` (``deployment_name``): the pool name lower-cased,
  every character outside ``[a-z0-9-]`` replaced by ``-``, and cut to fit 63 characters with a short
  hash of the exact name when it does not fit (or would end in ``-``, which no DNS label may);
- the Deployment, its selector and its pod template carry ``pool_labels``; the Deployment also carries
  ``polymorph.dev/pool-name`` (the exact name) and ``polymorph.dev/config-json`` (the pool's
  ``EngineConfig``, ``fleet.options.config_json`` form);
- the container ``engine`` serves HTTP on port 8000 (``http``) with ``/health`` for its probes; its
  command line is ``fleet.engines.launch.launch_argv`` (emulated pools: ``polymorph emulate``) plus
  ``--host 0.0.0.0 --port 8000``.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from fleet.actuators.local import emulated_replica_argv
from fleet.engines.launch import EngineLaunch, launch_argv, pool_env_defaults
from fleet.options import config_json
from kernels.catalog import get_gpu
from kernels.config import EngineConfig

ENGINE_PORT = 8000
NAME_PREFIX = "polymorph-engine-"
POOL_LABEL = "polymorph.dev/pool"
POOL_NAME_ANNOTATION = "polymorph.dev/pool-name"
CONFIG_JSON_ANNOTATION = "polymorph.dev/config-json"
_MAX_NAME = 63  # a Service name is a DNS-1035 label, and a label value has the same bound

# The images an engine kind runs unless ``fleet.kubernetes.images`` names another. Emulated pools run
# `polymorph emulate` from the gateway's own image (deploy/Dockerfile), so they need no GPU.
DEFAULT_IMAGES: Mapping[str, str] = {
    "emulated": "polymorph:0.1.0",
    "sglang": "lmsysorg/sglang:v0.5.3",
    "vllm": "vllm/vllm-openai:v0.11.0",
    "llamacpp": "ghcr.io/ggml-org/llama.cpp:server-cuda",
}
# GPU feature discovery's nvidia.com/gpu.product values (nvidia-smi's product name, spaces as '-') for
# the catalog's GPU kinds; a cluster whose nodes say otherwise names them in fleet.kubernetes.gpu_products
# (`kubectl get nodes -L nvidia.com/gpu.product` lists them).
DEFAULT_GPU_PRODUCTS: Mapping[str, str] = {
    "A100-80GB": "NVIDIA-A100-SXM4-80GB",
    "H100-SXM": "NVIDIA-H100-80GB-HBM3",
    "H800": "NVIDIA-H800",
    "H200": "NVIDIA-H200",
    "GH200": "NVIDIA-GH200-480GB",
    "B200": "NVIDIA-B200",
    "L40S": "NVIDIA-L40S",
}
_GPU_RESOURCE = {"nvidia": "nvidia.com/gpu", "amd": "amd.com/gpu"}  # the device plugins' resource names, by catalog vendor
# What runs when the pool's launch names no command: the interpreter (the module is added) or the
# binary inside the kind's image, never the engine this host installs for local replicas.
_IMAGE_COMMAND: Mapping[str, tuple[str, ...]] = {"vllm": ("python3",), "sglang": ("python3",), "llamacpp": ("/app/llama-server",)}
# The engines' usage reporting stays off in the pod as it does locally (fleet.engines.install.QUIET_ENV
# minus its hub lookups: a pod may well download its model).
_QUIET_ENV: Mapping[str, tuple[tuple[str, str], ...]] = {"vllm": (("VLLM_NO_USAGE_STATS", "1"), ("DO_NOT_TRACK", "1"))}
_ENGINE_EXIT_S = 30  # after the preStop sleep: SIGTERM, and this long for the engine to exit before SIGKILL
_STARTUP_BUDGET_S = 1800  # loading weights and capturing graphs takes minutes on large models (fleet.options.StartupCost)


@dataclass(frozen=True, slots=True)
class KubernetesSettings:
    """``fleet.kubernetes``: where and how the engine pools run on a cluster (gateway/kubernetes_config.py
    parses it; the manifests and the Kubernetes actuator both read it)."""

    namespace: str = "polymorph"
    kubeconfig: str | None = None  # None: the in-cluster service account; else a kubeconfig file's path
    gpu_label: str = "nvidia.com/gpu.product"  # the node label a pool's GPU kind selects on
    gpu_products: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_GPU_PRODUCTS))  # GPU kind -> label value
    images: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_IMAGES))  # engine kind -> image
    # the gateway's drain deadline plus a margin: a pod being deleted keeps serving this long (preStop)
    drain_grace_s: int = 330


@dataclass(frozen=True, slots=True)
class EnginePool:
    """One pool as the cluster runs it: its engine, where it runs and how many replicas."""

    name: str
    model: str
    gpu: str  # a catalog GPU kind, or "cpu"
    config: EngineConfig
    launch: EngineLaunch
    num_replicas: int
    emulator_speed: float = 1.0  # emulated pools only


def pool_slug(pool: str) -> str:
    """The pool's name as a DNS label and label value (see the module docstring)."""
    slug = re.sub(r"[^a-z0-9-]", "-", pool.lower())
    if len(NAME_PREFIX) + len(slug) <= _MAX_NAME and slug[-1] != "-":
        return slug
    digest = hashlib.sha256(pool.encode()).hexdigest()[:8]
    return f"{slug[: _MAX_NAME - len(NAME_PREFIX) - len(digest) - 1].rstrip('-')}-{digest}"


def deployment_name(pool: str) -> str:
    """The pool's Deployment (and headless Service) name."""
    return NAME_PREFIX + pool_slug(pool)


def pool_labels(pool: str) -> dict[str, str]:
    """The labels of a pool's Deployment, its selector, its pods and its Service."""
    return {"app.kubernetes.io/name": "polymorph-engine", "app.kubernetes.io/part-of": "polymorph", POOL_LABEL: pool_slug(pool)}


def container_argv(pool: EnginePool) -> list[str]:
    """The engine container's command line. ValueError when a real engine's pool names no model_path:
    the local default (the tiny test model) exists only on the host that installed it."""
    if pool.launch.kind == "emulated":
        argv = emulated_replica_argv(("polymorph", "emulate"), pool.model, pool.gpu, config_json(pool.config), pool.emulator_speed, pool.launch.adapters)
    else:
        if pool.launch.model_path is None:
            raise ValueError(f"pool {pool.name!r} ({pool.launch.kind}): name the checkpoint its container loads in engine.model_path "
                             "(a Hugging Face repo id, or a path in the image or on a mounted volume)")
        launch = replace(pool.launch, command=pool.launch.command or _IMAGE_COMMAND[pool.launch.kind])
        argv = launch_argv(launch, pool.config, pool.gpu, probe=False)
    return [*argv, "--host", "0.0.0.0", "--port", str(ENGINE_PORT)]


def engine_deployment(pool: EnginePool, settings: KubernetesSettings) -> dict[str, Any]:
    """The pool's Deployment. GPU pools request their engine's GPUs (tp x dp) on nodes of their GPU
    kind; emulated and CPU pools run anywhere. ValueError for what the settings cannot place."""
    labels = pool_labels(pool.name)
    image = settings.images.get(pool.launch.kind)
    if image is None:
        raise ValueError(f"pool {pool.name!r}: fleet.kubernetes.images names no image for {pool.launch.kind!r} engines")
    on_gpu = pool.launch.kind != "emulated" and pool.gpu != "cpu"
    grace_s = settings.drain_grace_s + _ENGINE_EXIT_S
    probe = {"httpGet": {"path": "/health", "port": "http"}, "timeoutSeconds": 5}
    container: dict[str, Any] = {
        "name": "engine",
        "image": image,
        "command": container_argv(pool),
        "ports": [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}],
        "startupProbe": {**probe, "periodSeconds": 10, "failureThreshold": _STARTUP_BUDGET_S // 10},
        "readinessProbe": {**probe, "periodSeconds": 5, "failureThreshold": 3},
        # a busy engine may answer /health late: only a minute of silence restarts it
        "livenessProbe": {**probe, "periodSeconds": 10, "failureThreshold": 6},
        # a pod being deleted (scale-down, node drain, rollout) keeps serving while the gateway drains it
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(settings.drain_grace_s)]}}},
    }
    own = dict(pool.launch.env)
    defaults = [(k, v) for k, v in pool_env_defaults(pool.launch.kind).items() if k not in own]
    env = [*defaults, *pool.launch.env, *_QUIET_ENV.get(pool.launch.kind, ())]
    if env:
        container["env"] = [{"name": k, "value": v} for k, v in env]
    pod: dict[str, Any] = {"terminationGracePeriodSeconds": grace_s, "containers": [container]}
    if on_gpu:
        vendor = get_gpu(pool.gpu).vendor
        product = settings.gpu_products.get(pool.gpu)
        if product is None:
            raise ValueError(f"pool {pool.name!r}: fleet.kubernetes.gpu_products names no {settings.gpu_label} value for GPU kind {pool.gpu!r}")
        resource = _GPU_RESOURCE[vendor]
        container["resources"] = {"limits": {resource: pool.config.num_gpus}}
        pod["nodeSelector"] = {settings.gpu_label: product}
        pod["tolerations"] = [{"key": resource, "operator": "Exists", "effect": "NoSchedule"}]  # GPU node pools are often tainted
    if pool.launch.kind in ("vllm", "sglang"):
        # their tensor-parallel workers exchange tensors through shared memory; a container's default /dev/shm is 64 MiB
        container["volumeMounts"] = [{"name": "shm", "mountPath": "/dev/shm"}]
        pod["volumes"] = [{"name": "shm", "emptyDir": {"medium": "Memory"}}]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": deployment_name(pool.name),
            "namespace": settings.namespace,
            "labels": labels,
            "annotations": {POOL_NAME_ANNOTATION: pool.name, CONFIG_JSON_ANNOTATION: config_json(pool.config)},
        },
        "spec": {
            "replicas": pool.num_replicas,
            "selector": {"matchLabels": dict(labels)},
            # no spare GPUs assumed: a rollout replaces a GPU pod rather than adding one first
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}} if on_gpu else {"type": "RollingUpdate"},
            "progressDeadlineSeconds": _STARTUP_BUDGET_S,
            "template": {"metadata": {"labels": dict(labels)}, "spec": pod},
        },
    }


def engine_service(pool: EnginePool, settings: KubernetesSettings) -> dict[str, Any]:
    """The pool's headless Service: its EndpointSlices list the pool's ready pods for discovery."""
    labels = pool_labels(pool.name)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": deployment_name(pool.name), "namespace": settings.namespace, "labels": labels,
                     "annotations": {POOL_NAME_ANNOTATION: pool.name}},
        "spec": {
            "clusterIP": "None",
            "selector": dict(labels),
            "ports": [{"name": "http", "port": ENGINE_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def render_engines(pools: Sequence[EnginePool], settings: KubernetesSettings) -> dict[str, list[dict[str, Any]]]:
    """File name -> the objects it holds: one file per pool (its Deployment and Service) and a
    ``kustomization.yaml`` listing them, so ``kubectl apply -k DIR`` applies the lot. ValueError
    when two pools' names sanitise to one object name."""
    files: dict[str, list[dict[str, Any]]] = {}
    owner: dict[str, str] = {}
    for pool in pools:
        name = deployment_name(pool.name)
        if name in owner:
            raise ValueError(f"pools {owner[name]!r} and {pool.name!r} both become the Kubernetes name {name!r}; rename one")
        owner[name] = pool.name
        files[f"{name}.yaml"] = [engine_deployment(pool, settings), engine_service(pool, settings)]
    kustomization = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": list(files)}
    return {**files, "kustomization.yaml": [kustomization]}
