"""The gateway's configuration: typed, validated, frozen.

Every user-facing mistake becomes a ``ConfigError`` naming the file, the line and the field. Objects
are never mutated after load; a reload builds a new ``GatewayConfig`` and swaps it in whole.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson

from classifiers.config import ClassifierConfigError, rules_from_mapping
from classifiers.shape import ShapeRules, default_shape_rules
from fleet.canary import CanarySettings
from fleet.drift import DriftSettings
from fleet.engines.launch import EngineLaunch
from fleet.engines.load import ENGINE_KINDS
from fleet.kubernetes_manifests import KubernetesSettings
from fleet.router import RouterSettings
from fleet.router_steps import STEPS
from kernels.argtypes import is_http_url
from kernels.tiers import DEFAULT_TIERS, TierSlo, read_tier_slo
from kernels.yamlsrc import FieldPath, FieldReader, YamlDoc, load_yaml
from loadtest.demo_credentials import DEMO_ADMIN_TOKEN, DEMO_API_KEY

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,62}$")
_POOL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:@-]{0,62}$")  # and the controller's own names, <shape>@<gpu>
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}$")  # as model ids are spelled (org/name allowed)


def sha256_hex(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


@dataclass(frozen=True, slots=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8080
    max_body_bytes: int = 4 * 1024 * 1024
    admin_token_sha256: str | None = None
    access_log: bool = True
    body_read_timeout_s: float = 30.0  # 408 for a body trickled slower than this (slowloris)


@dataclass(frozen=True, slots=True)
class UpstreamSettings:
    connect_timeout_s: float = 2.0
    first_byte_timeout_s: float = 120.0  # a stream's first chunk
    # A non-streamed answer arrives whole, so its first byte is its last: a long generation (a reasoning
    # model's 8,000 tokens at 30 ms) is not a hung replica. 600 s is the OpenAI SDK's own timeout.
    response_timeout_s: float = 600.0
    between_chunks_timeout_s: float = 60.0
    max_attempts: int = 3
    retry_budget_ratio: float = 0.2
    eject_after_failures: int = 3
    eject_cooldown_s: float = 5.0
    health_interval_s: float = 2.0
    # per pool: requests waiting for a replica's room when the pool is saturated (0: no queues)
    queue_max_len: int = 1024
    engine_metrics_interval_s: float = 1.0  # how often each replica engine's /metrics is read (gateway.engine_scrape)
    # how long a request may wait while every replica of its model restarts (gateway.restart_waits; 0: not at all)
    restart_hold_s: float = 30.0


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    key_sha256: frozenset[str]
    models: frozenset[str] | None  # None: every model the fleet serves
    tiers: tuple[str, ...]
    default_tier: str
    objectives: Mapping[str, TierSlo]
    requests_per_min: float
    tokens_per_min: float
    max_concurrency: int
    source: str = "<builtin>"
    budget_monthly_usd: float | None = None  # `budget: {monthly_usd}`: refused with 429 budget_exceeded once the month's spend reaches it
    adapters: frozenset[str] | None = None  # LoRA adapters it may name; None: every one (its base model must be allowed too)

    def may_use_model(self, model: str) -> bool:
        return self.models is None or model in self.models

    def may_use_adapter(self, adapter: str, base: str) -> bool:
        return (self.adapters is None or adapter in self.adapters) and self.may_use_model(base)


@dataclass(frozen=True, slots=True)
class ClassifierSettings:
    model: str = "builtin"
    tokenizer: str | None = None


@dataclass(frozen=True, slots=True)
class Alias:
    """``aliases: {public-name: served-model}``: clients name ``public``, the pools serve ``model``."""

    model: str
    listed: bool = True  # shown in /v1/models (a hidden alias still answers)


@dataclass(frozen=True, slots=True)
class PoolSpec:
    name: str
    model: str
    gpu: str | None
    shapes: tuple[str, ...]
    engine: Mapping[str, Any]  # the EngineConfig knobs (kernels.config); how to launch it is ``launch``
    urls: tuple[str, ...]
    num_launched: int  # replicas the actuator starts (emulated or real engine processes)
    min_replicas: int
    max_replicas: int
    # requests in flight per replica the gateway admits (more wait in the pool's queue); None: the
    # engine's max_running_requests marks saturation but the engine queues beyond it itself
    max_in_flight_per_replica: int | None = None
    launch: EngineLaunch = EngineLaunch("emulated")
    price_per_hour_usd: float | None = None  # one replica's price; None: its GPUs' catalog price (gateway.costs)
    # its ``urls`` are emulated replicas (`polymorph emulate`, engine ``kind: emulated`` said outright): they
    # run at ``fleet.emulator_speed`` like launched ones, so their latencies and capacity are in fleet time
    emulated_urls: bool = False

    @property
    def real(self) -> bool:
        """Its replicas are real engines (latencies in wall time), not emulated ones."""
        return (bool(self.urls) and not self.emulated_urls) or self.engine_kind != "emulated"

    @property
    def engine_kind(self) -> str:
        return self.launch.kind

    @property
    def config_json(self) -> str:
        """The pool's engine configuration as the controller and the actuators carry it (sorted JSON)."""
        return orjson.dumps(dict(self.engine), option=orjson.OPT_SORT_KEYS).decode()

    @property
    def adapter_names(self) -> frozenset[str]:
        return frozenset(name for name, _ in self.launch.adapters)


@dataclass(frozen=True, slots=True)
class ControllerSettingsFile:
    """``fleet.controller``: the control loop that repartitions emulated replicas among pool shapes."""

    enabled: bool = False
    tick_s: float = 5.0
    decision_log: Path | None = None  # JSON lines, appended; the last ones are also at GET /admin/decisions
    capacity_cache: Path | None = None
    compile_store: Path | None = None  # trial store: pools run compiled configurations (kernels.compiler); None: fixed candidates
    # "embedded": the loop ticks in the gateway (--workers 1); "external": `polymorph controller` runs
    # it at ``url`` and every gateway process polls its plan there and reports its telemetry
    mode: str = "embedded"
    url: str | None = None
    state_file: Path | None = None  # the external controller's persisted state (default: beside the decision log)
    report_s: float = 5.0  # fleet seconds between a gateway's reports and plan polls (one telemetry bucket)
    # who of several `polymorph controller` processes leads: "file", an flock on <state file>.lease (one host,
    # or a volume that carries locks between nodes); "kubernetes", the Lease ``lease_name`` in fleet.kubernetes's
    # namespace (gateway.kube_lease), held ``lease_duration_s`` from each renewal, renewed every ``renew_every_s``
    leader_election: str = "file"
    lease_name: str = "polymorph-controller"
    lease_duration_s: int = 15
    renew_every_s: float = 5.0
    # with launched pools of several models: move one slot at a time to the model whose plan needs it (fleet.rebalance)
    rebalance: bool = True
    rebalance_cooldown_s: float = 300.0  # fleet seconds between two such moves
    rebalance_min_gain: float = 0.05  # the receiver's predicted goodput must rise by more than this share of its demand
    canary: CanarySettings = CanarySettings()  # trial a configuration on one replica of a pool first (fleet.canary)
    # how fast the loop reacts, in fleet seconds: the window it senses and plans from, the drift detector's
    # warm-up, dwell and least interval between plans, a step's verification delay and a failed plan's back-off
    window_s: float = 120.0
    drift: DriftSettings = DriftSettings()
    verify_after_s: float = 45.0
    backoff_s: float = 300.0


@dataclass(frozen=True, slots=True)
class RaySettings:
    """``fleet.ray``: where the Ray actuator's replicas run (``fleet.actuator: ray``)."""

    # None: start a local Ray cluster in the process that runs the replicas; "auto": join the cluster
    # this node belongs to; "ray://host:port" (Ray Client) or "host:port" (its GCS): join that one
    address: str | None = None
    num_gpus: int | None = None  # the local cluster's logical GPUs (default: the GPUs the fleet's emulated replicas use)


@dataclass(frozen=True, slots=True)
class LimitsSettings:
    """``limits:``: where tenants' rate, token and concurrency limits live when several gateways share them.

    ``store`` None: each gateway host keeps them itself (its ``--workers`` share one table in shared memory).
    """

    store: str | None = None  # redis://host:port/db (or rediss://, unix://): one budget per tenant across every gateway
    num_gateways: int = 1  # gateway hosts sharing the store: while it is unreachable each keeps 1/num_gateways of every limit
    key_prefix: str = "polymorph"
    call_timeout_s: float = 0.05  # a store call slower than this counts as the store being down (the request uses the fallback)
    lease_ttl_s: float = 10.0  # a gateway silent this long (dead) no longer holds its requests in flight


@dataclass(frozen=True, slots=True)
class TracingSettings:
    """``tracing:``: OpenTelemetry spans for each request, exported over OTLP/HTTP (gateway/tracing.py)."""

    enabled: bool = False
    otlp_endpoint: str = "http://127.0.0.1:4318/v1/traces"
    service_name: str = "polymorph"
    sample_ratio: float = 1.0  # of the traces that start here; a client's sampled flag decides for its own (parent-based)
    headers: Mapping[str, str] = field(default_factory=dict)  # sent with each export, e.g. a collector's auth


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    source: str
    server: ServerSettings
    upstream: UpstreamSettings
    tiers: Mapping[str, TierSlo]
    tenants: tuple[Tenant, ...]
    classifier: ClassifierSettings
    shapes: ShapeRules
    pools: tuple[PoolSpec, ...]
    emulator_speed: float = 1.0
    controller: ControllerSettingsFile = field(default_factory=ControllerSettingsFile)
    actuator: str = "local"  # how launched replicas run: "local" processes, "ray" actors (fleet.ray), or "kubernetes" Deployments
    ray: RaySettings = field(default_factory=RaySettings)
    kubernetes: KubernetesSettings = field(default_factory=KubernetesSettings)  # `fleet.kubernetes` (gateway.kubernetes_config)
    # ``fleet.devices``: what the actuator may hand out, device kind -> ids ("cpu" slots or a GPU kind's
    # CUDA device ids on this host); empty: launched replicas get logical ids (emulated GPUs need none)
    devices: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    router: RouterSettings = field(default_factory=RouterSettings)  # `router:`: how pools and replicas are chosen
    aliases: Mapping[str, Alias] = field(default_factory=dict)  # public model name -> the served one
    limits: LimitsSettings = field(default_factory=LimitsSettings)
    tracing: TracingSettings = field(default_factory=TracingSettings)
    tenants_dir: Path | None = None


# --- sections ------------------------------------------------------------------------------------


def _server(doc: YamlDoc) -> ServerSettings:
    r = FieldReader(doc, ("server",), doc.data.get("server"), {"host", "port", "max_body_bytes", "admin_token", "admin_token_sha256", "access_log", "body_read_timeout_s"})
    token, token_hash = r.text("admin_token", None), r.text("admin_token_sha256", None)
    if token is not None and token_hash is not None:
        raise r.error("admin_token", "give admin_token or admin_token_sha256, not both")
    if token_hash is not None and not _SHA256.match(token_hash):
        raise r.error("admin_token_sha256", "must be 64 lowercase hex digits (a SHA-256)")
    if token is not None and len(token) < 8:
        raise r.error("admin_token", "must be at least 8 characters")
    return ServerSettings(
        host=r.text("host", "127.0.0.1") or "127.0.0.1",
        port=r.number("port", 8080, lo=0, hi=65535, integer=True),
        max_body_bytes=r.number("max_body_bytes", 4 * 1024 * 1024, lo=1024, hi=1 << 30, integer=True),
        admin_token_sha256=token_hash or (sha256_hex(token) if token else None),
        access_log=r.flag("access_log", True),
        body_read_timeout_s=r.number("body_read_timeout_s", 30.0, lo=0.1, hi=3600),
    )


def _upstream(doc: YamlDoc) -> UpstreamSettings:
    known = set(UpstreamSettings.__dataclass_fields__)
    r = FieldReader(doc, ("upstream",), doc.data.get("upstream"), known)
    d = UpstreamSettings()
    return UpstreamSettings(
        connect_timeout_s=r.number("connect_timeout_s", d.connect_timeout_s, lo=0.01, hi=600),
        first_byte_timeout_s=r.number("first_byte_timeout_s", d.first_byte_timeout_s, lo=0.01, hi=86400),
        response_timeout_s=r.number("response_timeout_s", d.response_timeout_s, lo=0.01, hi=86400),
        between_chunks_timeout_s=r.number("between_chunks_timeout_s", d.between_chunks_timeout_s, lo=0.01, hi=86400),
        max_attempts=r.number("max_attempts", d.max_attempts, lo=1, hi=10, integer=True),
        retry_budget_ratio=r.number("retry_budget_ratio", d.retry_budget_ratio, lo=0, hi=10),
        eject_after_failures=r.number("eject_after_failures", d.eject_after_failures, lo=1, hi=1000, integer=True),
        eject_cooldown_s=r.number("eject_cooldown_s", d.eject_cooldown_s, lo=0.01, hi=3600),
        health_interval_s=r.number("health_interval_s", d.health_interval_s, lo=0.05, hi=3600),
        queue_max_len=r.number("queue_max_len", d.queue_max_len, lo=0, hi=1_000_000, integer=True),
        engine_metrics_interval_s=r.number("engine_metrics_interval_s", d.engine_metrics_interval_s, lo=0.05, hi=3600),
        restart_hold_s=r.number("restart_hold_s", d.restart_hold_s, lo=0, hi=3600),
    )


def _tiers(doc: YamlDoc) -> dict[str, TierSlo]:
    raw = doc.data.get("tiers")
    if raw is None:
        return dict(DEFAULT_TIERS)
    if not isinstance(raw, dict) or not raw:
        raise doc.error(("tiers",), "must be a non-empty mapping of tier name to objectives")
    tiers = {}
    for name, body in raw.items():
        if not isinstance(name, str) or not _NAME.match(name):
            raise doc.error(("tiers", str(name)), "tier names are letters, digits, '-', '_', '.' or ':'")
        tiers[name] = read_tier_slo(doc, ("tiers", name), body, DEFAULT_TIERS.get(name))
    return tiers


def _classifier(doc: YamlDoc, base: Path) -> ClassifierSettings:
    """Paths are relative to the config file, as `polymorph classify --config` reads them."""
    r = FieldReader(doc, ("classifier",), doc.data.get("classifier"), {"model", "tokenizer"})
    model = r.text("model", "builtin") or "builtin"
    tokenizer = r.text("tokenizer", None)
    return ClassifierSettings(
        model=model if model == "builtin" else str((base / model).resolve()),
        tokenizer=str((base / tokenizer).resolve()) if tokenizer is not None else None,
    )


def _shapes(doc: YamlDoc) -> ShapeRules:
    try:
        return rules_from_mapping(doc.data)
    except ClassifierConfigError as exc:
        raise doc.error(exc.path, exc.reason) from None


def _pool(doc: YamlDoc, i: int, body: object, shape_names: tuple[str, ...]) -> PoolSpec:
    path: FieldPath = ("fleet", "pools", i)
    r = FieldReader(doc, path, body, {"name", "model", "gpu", "shapes", "engine", "replicas", "min_replicas", "max_replicas", "max_in_flight_per_replica",
                                  "adapters", "price_per_hour_usd"})
    name = r.text("name", None)
    if not name or not _POOL_NAME.match(name):
        raise r.error("name", "every pool needs a name (letters, digits, '-', '_', '@')")
    model = r.text("model", None)
    if not model:
        raise r.error("model", "every pool needs the model id it serves")
    shapes = r.names("shapes", [], shape_names) or []
    engine = r.data.get("engine") or {}
    if not isinstance(engine, dict):
        raise r.error("engine", "must be a mapping of engine settings")
    launch = replace(_launch(doc, (*path, "engine"), engine, model), adapters=_pool_adapters(r, model))
    if launch.adapters and launch.kind == "llamacpp":
        raise r.error("adapters", "llama-server selects LoRA adapters by id in each request's `lora` field, not by model name: "
                                  "adapters are not supported on llamacpp pools (serve them from a vllm or sglang pool)")
    said_emulated = engine.get("kind") == "emulated"
    engine = {k: v for k, v in engine.items() if k not in _LAUNCH_KEYS}
    rr = FieldReader(doc, (*path, "replicas"), r.data.get("replicas"), {"urls", "emulated", "launch"})
    urls = rr.names("urls", []) or []
    for j, url in enumerate(urls):
        if not is_http_url(url):
            raise doc.error((*path, "replicas", "urls", j), f"{url!r} is not an http(s) URL")
    if "emulated" in rr.data and launch.kind != "emulated":
        raise rr.error("emulated", f"this pool's engine is {launch.kind!r}: give `launch: N` for replicas the actuator starts")
    num_launched = rr.number("launch" if "launch" in rr.data else "emulated", 0, lo=0, hi=1024, integer=True)
    if not urls and not num_launched and "launch" not in rr.data:  # `launch: 0`: a pool moves fill
        raise doc.error((*path, "replicas"), "give replica `urls: [...]`, or `launch: N` (`emulated: N`) replicas to start")
    gpu = r.text("gpu", None)
    if (num_launched or "launch" in rr.data) and not gpu:
        raise r.error("gpu", "launched replicas need their device kind (a GPU kind, or cpu)")
    emulated = num_launched > 0 and launch.kind == "emulated"
    # the catalog knows the devices (GPU kinds, and `cpu`) and the models the performance model times;
    # a real engine may serve a model it does not know (the controller then stays off, see serve_cli)
    _check_engine(doc, path, model if emulated else None, gpu, engine)
    gpu = _gpu_kind(gpu) if gpu is not None else None  # checked just above
    num_replicas = len(urls) + num_launched
    return PoolSpec(
        name=name,
        model=model,
        gpu=gpu,
        shapes=tuple(shapes),
        engine=dict(engine),
        urls=tuple(u.rstrip("/") for u in urls),
        num_launched=num_launched,
        min_replicas=r.number("min_replicas", 0, lo=0, hi=4096, integer=True),
        max_replicas=r.number("max_replicas", max(num_replicas, 1), lo=1, hi=4096, integer=True),
        launch=launch,
        max_in_flight_per_replica=(r.number("max_in_flight_per_replica", 1, lo=1, hi=1_000_000, integer=True)
                                   if "max_in_flight_per_replica" in r.data else None),
        price_per_hour_usd=r.number("price_per_hour_usd", 0.0, lo=0.0, hi=1e6) if "price_per_hour_usd" in r.data else None,
        emulated_urls=bool(urls) and said_emulated,
    )


_LAUNCH_KEYS = frozenset({"kind", "command", "model_path", "served_model_name", "threads", "args", "env"})


def _launch(doc: YamlDoc, path: FieldPath, engine: dict[str, Any], model: str) -> EngineLaunch:
    """The launch keys of a pool's ``engine:`` mapping (the others are EngineConfig knobs); the engine
    serves the pool's ``model`` id unless ``served_model_name`` says otherwise."""
    r = FieldReader(doc, path, {k: v for k, v in engine.items() if k in _LAUNCH_KEYS}, set(_LAUNCH_KEYS))
    kind = r.text("kind", "emulated") or "emulated"
    if kind not in ENGINE_KINDS:
        raise r.error("kind", f"must be one of {', '.join(ENGINE_KINDS)}, not {kind!r}")
    command = r.data.get("command")
    if isinstance(command, str):
        command = shlex.split(command)
    if command is not None and (not isinstance(command, list) or not all(isinstance(c, str) for c in command) or not command):
        raise r.error("command", "must be the engine's interpreter or binary, a string or a list of strings")
    env = r.data.get("env") or {}
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, (str, int, float)) for k, v in env.items()):
        raise r.error("env", "must be a mapping of environment variable names to values")
    threads = r.data.get("threads")
    return EngineLaunch(
        kind=kind,
        command=tuple(command or ()),
        model_path=r.text("model_path", None),
        served_model_name=r.text("served_model_name", None) or model,
        threads=None if threads is None else r.number("threads", 1, lo=1, hi=1024, integer=True),
        extra_args=tuple(r.names("args", []) or []),
        env=tuple(sorted((k, str(v)) for k, v in env.items())),
    )


def _pool_adapters(r: FieldReader, model: str) -> tuple[tuple[str, str], ...]:
    """``adapters: {name: path}``: the LoRA adapters (PEFT folders) the pool's engine loads, named as requests name them."""
    raw = r.data.get("adapters") or {}
    if not isinstance(raw, dict):
        raise r.error("adapters", "must map adapter names to the path of each adapter the engine loads")
    if raw and model == "*":
        raise r.error("adapters", "a pool that discovers its models (model: '*') has no base model to hold adapters")
    out = []
    for name, path in raw.items():
        if not isinstance(name, str) or not _ADAPTER_NAME.match(name):
            raise r.doc.error((*r.path, "adapters", str(name)), "adapter names are spelled like model ids (letters, digits, '-', '_', '.', ':', '/')")
        if name == model:
            raise r.doc.error((*r.path, "adapters", name), f"{name!r} is the pool's own model; an adapter needs a name of its own")
        if not isinstance(path, str) or not path:
            raise r.doc.error((*r.path, "adapters", name), "must be the path of the adapter (a PEFT folder) the engine loads")
        out.append((name, path))
    return tuple(out)


def _check_adapter_names(doc: YamlDoc, pools: tuple[PoolSpec, ...]) -> None:
    """An adapter name selects one adapter of one base model fleet-wide: never a served model, never two adapters."""
    models = {p.model for p in pools}
    held: dict[str, tuple[str, str, str]] = {}  # adapter -> (base model, path, first pool)
    for i, pool in enumerate(pools):
        for name, path in pool.launch.adapters:
            where = ("fleet", "pools", i, "adapters", name)
            if name in models:
                raise doc.error(where, f"{name!r} is a model a pool serves; an adapter needs a name of its own")
            base, first_path, first = held.setdefault(name, (pool.model, path, pool.name))
            if (base, first_path) != (pool.model, path):
                raise doc.error(where, f"pool {first!r} holds adapter {name!r} of {base!r} at {first_path!r}; "
                                       "pools holding the same adapter name must serve the same base model and path")


def _check_engine(doc: YamlDoc, path: FieldPath, model: str | None, gpu: str | None, engine: dict[str, Any]) -> None:
    """Catalog names and engine settings are checked by the compiler's own types, with our line numbers."""
    from kernels.catalog import get_gpu, get_model
    from kernels.config import EngineConfig

    for key, value, lookup in (("gpu", gpu, get_gpu), ("model", model, get_model)):
        if value is None:
            continue
        try:
            lookup(value)
        except ValueError as exc:
            raise doc.error((*path, key), str(exc)) from None
    try:
        EngineConfig.from_dict(engine)
    except ValueError as exc:
        raise doc.error((*path, "engine"), str(exc)) from None


def _aliases(doc: YamlDoc, pools: tuple[PoolSpec, ...]) -> dict[str, Alias]:
    """``aliases:``: ``public: served`` or ``public: {model: served, listed: false}``; a served model must
    be one a pool declares (or any, when a pool discovers its models: ``model: "*"``)."""
    r = FieldReader(doc, ("aliases",), doc.data.get("aliases"), set((doc.data.get("aliases") or {}) if isinstance(doc.data.get("aliases"), dict) else ()))
    declared = {p.model for p in pools}
    out: dict[str, Alias] = {}
    for public, body in r.data.items():
        if not isinstance(public, str) or not public:
            raise r.error(str(public), "an alias must be a non-empty model name")
        if isinstance(body, str):
            alias = Alias(body)
        else:
            a = FieldReader(doc, ("aliases", public), body, {"model", "listed"})
            alias = Alias(a.text("model", "") or "", a.flag("listed", True))
        if not alias.model:
            raise r.error(public, "names the served model it stands for: `public: served` or `{model: served, listed: false}`")
        if alias.model == public or alias.model in r.data:
            raise r.error(public, f"must name a served model, not itself or another alias ({alias.model!r})")
        if public in declared:
            raise r.error(public, f"{public!r} is a model a pool serves; an alias cannot hide it")
        if any(public in p.adapter_names for p in pools):
            raise r.error(public, f"{public!r} is a LoRA adapter a pool holds; an alias cannot hide it")
        if "*" not in declared and alias.model not in declared:
            raise r.error(public, f"no pool serves {alias.model!r} (pools serve: {', '.join(sorted(declared))})")
        out[public] = alias
    return out


_STORE_SCHEMES = ("redis://", "rediss://", "unix://")


def _limits(doc: YamlDoc) -> LimitsSettings:
    r = FieldReader(doc, ("limits",), doc.data.get("limits"), set(LimitsSettings.__dataclass_fields__))
    d = LimitsSettings()
    store = r.text("store", None)
    if store is not None and not store.startswith(_STORE_SCHEMES):
        raise r.error("store", f"must be a Redis URL ({', '.join(s + '...' for s in _STORE_SCHEMES)}), not {store!r}")
    prefix = r.text("key_prefix", d.key_prefix) or ""
    if not _NAME.match(prefix):
        raise r.error("key_prefix", f"must be 1-63 letters, digits or _.:- (starting with a letter or digit), not {prefix!r}")
    settings = LimitsSettings(
        store=store,
        num_gateways=r.number("num_gateways", d.num_gateways, lo=1, hi=10_000, integer=True),
        key_prefix=prefix,
        call_timeout_s=r.number("call_timeout_s", d.call_timeout_s, lo=0.001, hi=10),
        lease_ttl_s=r.number("lease_ttl_s", d.lease_ttl_s, lo=1, hi=3600),
    )
    if store is None and r.data:
        raise doc.error(("limits",), "its fields configure the shared store: name it (store: redis://host:port/db) or drop the section")
    return settings


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def _tracing(doc: YamlDoc) -> TracingSettings:
    r = FieldReader(doc, ("tracing",), doc.data.get("tracing"), set(TracingSettings.__dataclass_fields__))
    d = TracingSettings()
    endpoint = r.text("otlp_endpoint", d.otlp_endpoint) or ""
    if not endpoint.startswith(("http://", "https://")):
        raise r.error("otlp_endpoint", f"must be an http:// or https:// URL (OTLP over HTTP), not {endpoint!r}")
    headers = r.data.get("headers", {})
    if not isinstance(headers, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items()):
        raise r.error("headers", "must be a mapping of header names to string values")
    settings = TracingSettings(
        enabled=r.flag("enabled", d.enabled),
        otlp_endpoint=endpoint,
        service_name=r.text("service_name", d.service_name) or d.service_name,
        sample_ratio=r.number("sample_ratio", d.sample_ratio, lo=0.0, hi=1.0),
        headers=headers,
    )
    # found, not imported: a config that leaves tracing off must not load OpenTelemetry
    if settings.enabled and not all(_installed(m) for m in ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http")):
        raise r.error("enabled", "needs the OpenTelemetry packages: pip install 'polymorph[tracing]'")
    return settings


def _router(doc: YamlDoc) -> RouterSettings:
    """``router:``: the router's knobs and named steps (fleet.router.RouterSettings, fleet.router_steps.STEPS;
    the defaults are today's behaviour). Building the settings composes the steps: once per load."""
    d = RouterSettings()
    r = FieldReader(doc, ("router",), doc.data.get("router"), {"affinity_slack", "shed_priority", "shed_load_fraction",
                                                            "shed_retry_after_s", "good_chance", "shed_chance", "wait_share", "urgent_reserve",
                                                            "urgent_window_s", "overflow_share", *STEPS})

    def step(stage: str, default: str) -> str:
        name = r.text(stage, default)
        if name is None or name not in STEPS[stage]:
            raise r.error(stage, f"unknown step {name!r} (known: {', '.join(STEPS[stage])})")
        return name

    return RouterSettings(
        affinity_slack=r.number("affinity_slack", d.affinity_slack, lo=1.0, hi=100.0),
        shed_priority=r.number("shed_priority", d.shed_priority, lo=0, hi=100, integer=True),
        shed_load_fraction=r.number("shed_load_fraction", d.shed_load_fraction, lo=0.01, hi=100.0),
        shed_retry_after_s=r.number("shed_retry_after_s", d.shed_retry_after_s, lo=0.0, hi=3600.0),
        good_chance=r.number("good_chance", d.good_chance, lo=0.0, hi=1.0),
        shed_chance=r.number("shed_chance", d.shed_chance, lo=0.0, hi=1.0),
        wait_share=r.number("wait_share", d.wait_share, lo=0.01, hi=1.0),
        urgent_reserve=r.number("urgent_reserve", d.urgent_reserve, lo=0.0, hi=0.9),
        urgent_window_s=r.number("urgent_window_s", d.urgent_window_s, lo=0.0, hi=86400.0),
        overflow_share=r.number("overflow_share", d.overflow_share, lo=0.05, hi=1.0),
        pool_filter=step("pool_filter", d.pool_filter),
        pool_scorer=step("pool_scorer", d.pool_scorer),
        admission=step("admission", d.admission),
        replica_filter=step("replica_filter", d.replica_filter),
        replica_picker=step("replica_picker", d.replica_picker),
    )


_LEASE_NAME = re.compile(r"^(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")  # a DNS-1123 subdomain


def _controller(doc: YamlDoc, base: Path, raw: object) -> ControllerSettingsFile:
    r = FieldReader(doc, ("fleet", "controller"), raw,
                {"enabled", "tick_s", "decision_log", "capacity_cache", "mode", "url", "state_file", "report_s", "compile_store",
                 "leader_election", "lease_name", "lease_duration_s", "renew_every_s", "rebalance", "rebalance_cooldown_s",
                 "rebalance_min_gain", "canary", "window_s", "drift", "verify_after_s", "backoff_s"})
    log, cache, state = r.text("decision_log", None), r.text("capacity_cache", None), r.text("state_file", None)
    mode = r.text("mode", "embedded")
    if mode not in ("embedded", "external"):
        raise r.error("mode", f"must be 'embedded' or 'external', not {mode!r}")
    url = r.text("url", None)
    if url is not None and not is_http_url(url):
        raise r.error("url", f"must be an http:// or https:// URL, not {url!r}")
    if mode == "external" and url is None:
        raise r.error("url", "is required with mode: external (where `polymorph controller` listens)")
    election = r.text("leader_election", "file")
    if election not in ("file", "kubernetes"):
        raise r.error("leader_election", f"must be 'file' (a lock beside the state file) or 'kubernetes' (a Lease), not {election!r}")
    if election == "kubernetes" and mode != "external":
        raise r.error("leader_election", "elects among `polymorph controller` processes: it needs mode: external")
    lease_name = r.text("lease_name", "polymorph-controller") or ""
    if not _LEASE_NAME.match(lease_name):
        raise r.error("lease_name", f"must be a DNS subdomain (lowercase letters, digits, '-', '.'; at most 253), not {lease_name!r}")
    lease_duration_s = r.number("lease_duration_s", 15, lo=1, hi=3600, integer=True)  # the Lease's field is whole seconds
    renew_every_s = r.number("renew_every_s", 5.0, lo=0.1, hi=1800)
    if renew_every_s * 2 > lease_duration_s:  # the leader must get a second try at renewing before its lease can lapse
        raise r.error("renew_every_s", f"must be at most half of lease_duration_s ({lease_duration_s}), not {renew_every_s!r}")
    window_s = r.number("window_s", 120.0, lo=5.0, hi=86400)  # at least one telemetry bucket (5 s)
    return ControllerSettingsFile(
        enabled=r.flag("enabled", False),
        tick_s=r.number("tick_s", 5.0, lo=0.1, hi=3600),
        decision_log=(base / log).resolve() if log else None,
        capacity_cache=Path(cache).expanduser() if cache else None,
        mode=mode,
        url=url.rstrip("/") if url else None,
        state_file=(base / state).resolve() if state else None,
        report_s=r.number("report_s", 5.0, lo=0.1, hi=3600),
        compile_store=Path(compile_store).expanduser() if (compile_store := r.text("compile_store", None)) else None,
        leader_election=election,
        lease_name=lease_name,
        lease_duration_s=lease_duration_s,
        renew_every_s=renew_every_s,
        rebalance=r.flag("rebalance", True),
        rebalance_cooldown_s=r.number("rebalance_cooldown_s", 300.0, hi=86400),
        rebalance_min_gain=r.number("rebalance_min_gain", 0.05, hi=0.99),
        canary=_canary(doc, r.data.get("canary")),
        window_s=window_s,
        drift=_drift(doc, r.data.get("drift"), window_s),
        verify_after_s=r.number("verify_after_s", 45.0, lo=0.0, hi=86400),
        backoff_s=r.number("backoff_s", 300.0, lo=0.0, hi=86400),
    )


def _drift(doc: YamlDoc, raw: object, window_s: float) -> DriftSettings:
    r = FieldReader(doc, ("fleet", "controller", "drift"), raw, {"warmup_s", "dwell_s", "strong_dwell_s", "min_interval_s"})
    d = DriftSettings()
    # the warm-up ends when the telemetry window holds that much traffic, and a window holds at most window_s:
    # a longer warm-up never ends, and the controller would never plan nor the urls pools get a model
    warmup_s = r.number("warmup_s", min(d.warmup_s, window_s), hi=86400)
    if warmup_s > window_s:
        raise r.error("warmup_s", f"must be at most fleet.controller.window_s ({window_s!r}): a longer warm-up never ends")
    dwell_s = r.number("dwell_s", d.dwell_s, hi=86400)
    strong_dwell_s = r.number("strong_dwell_s", min(d.strong_dwell_s, dwell_s), hi=86400)
    if strong_dwell_s > dwell_s:
        raise r.error("strong_dwell_s", f"must be at most dwell_s ({dwell_s!r}): a strong score fires sooner, not later")
    return replace(d, warmup_s=warmup_s, dwell_s=dwell_s, strong_dwell_s=strong_dwell_s,
                   min_interval_s=r.number("min_interval_s", d.min_interval_s, hi=86400))


def _canary(doc: YamlDoc, raw: object) -> CanarySettings:
    r = FieldReader(doc, ("fleet", "controller", "canary"), raw, {"enabled", "window_s", "min_requests", "min_margin", "max_windows"})
    return CanarySettings(
        enabled=r.flag("enabled", False),
        window_s=r.number("window_s", 120.0, lo=1.0, hi=86400),
        min_requests=r.number("min_requests", 20, lo=1, hi=1_000_000, integer=True),
        min_margin=r.number("min_margin", 0.05, hi=0.99),
        max_windows=r.number("max_windows", 3.0, lo=1.0, hi=100),
    )


_RAY_ADDRESS = re.compile(r"^(auto|ray://\S+|[^\s/:]+:\d+)$")


def _ray(doc: YamlDoc, raw: object) -> RaySettings:
    r = FieldReader(doc, ("fleet", "ray"), raw, {"address", "num_gpus"})
    address = r.text("address", None)
    if address is not None and not _RAY_ADDRESS.match(address):
        raise r.error("address", f"must be null (a local cluster), 'auto', 'ray://host:port' or 'host:port', not {address!r}")
    num_gpus = r.data.get("num_gpus")
    if num_gpus is not None:
        if address is not None:
            raise r.error("num_gpus", "sizes the local cluster only (address: null); a cluster you join has its own GPUs")
        num_gpus = r.number("num_gpus", 0, lo=1, hi=100000, integer=True)
    return RaySettings(address=address, num_gpus=num_gpus)


def _devices(doc: YamlDoc, raw: object, pools: tuple[PoolSpec, ...]) -> dict[str, tuple[str, ...]]:
    """``fleet.devices``: ``{kind: {ids: [...]}}`` or ``{kind: {count: N}}`` (ids 0..N-1); each launched
    replica takes its engine's GPU count of ids of its pool's device kind (a CPU engine: one slot)."""
    r = FieldReader(doc, ("fleet", "devices"), raw, set((raw or {}) if isinstance(raw, dict) else ()))
    out: dict[str, tuple[str, ...]] = {}
    for kind in r.data:
        d = FieldReader(doc, ("fleet", "devices", kind), r.data[kind], {"ids", "count"})
        if ("ids" in d.data) == ("count" in d.data):
            raise r.error(kind, "give the device ids (`ids: [0, 1]`) or their number (`count: N`)")
        try:
            name = _gpu_kind(str(kind))
        except ValueError as exc:
            raise r.error(kind, str(exc)) from None
        if name in out:
            raise r.error(kind, f"{kind!r} is {name}, whose devices are already declared")
        if "ids" in d.data:
            ids = d.data["ids"]
            if not isinstance(ids, list) or not ids or not all(isinstance(i, (int, str)) and not isinstance(i, bool) for i in ids):
                raise d.error("ids", "must be a non-empty list of device ids")
            out[name] = tuple(str(i) for i in ids)
        else:
            out[name] = tuple(str(i) for i in range(d.number("count", 1, lo=1, hi=100000, integer=True)))
    if out:
        need: dict[str, int] = {}
        for pool in pools:
            if pool.num_launched and pool.gpu is not None:
                need[pool.gpu] = need.get(pool.gpu, 0) + pool.num_launched * replica_devices(pool)
        for kind, n in need.items():
            if n > len(out.get(kind, ())):
                raise doc.error(("fleet", "devices"), f"the pools launch replicas on {n} {kind} devices; {len(out.get(kind, ()))} declared")
    return out


def _gpu_kind(name: str) -> str:
    """A device kind by its catalog name, so that ``H100`` and ``H100-SXM`` are one kind to the planner,
    the devices and the manifests (before, two pools so named were planned as two kinds)."""
    from kernels.catalog import get_gpu

    return get_gpu(name).name


def replica_devices(pool: PoolSpec) -> int:
    """Devices one replica of ``pool`` holds: its engine's GPUs, or one CPU slot."""
    from kernels.config import EngineConfig

    return 1 if pool.gpu == "cpu" else EngineConfig.from_dict(pool.engine).num_gpus


def replica_price_per_hour_usd(pool: PoolSpec) -> float:
    """What one replica of ``pool`` costs an hour (gateway.costs): its ``price_per_hour_usd``, else its
    devices at the catalog's price of its ``gpu`` (0 for a pool of URLs with neither)."""
    from kernels.catalog import get_gpu

    if pool.price_per_hour_usd is not None:
        return pool.price_per_hour_usd
    if pool.gpu is None:
        return 0.0
    return get_gpu(pool.gpu).price_per_gpu_hour * replica_devices(pool)


def _fleet(doc: YamlDoc, shapes: ShapeRules, base: Path) -> tuple[tuple[PoolSpec, ...], float, ControllerSettingsFile, str, RaySettings,
                                                                  dict[str, tuple[str, ...]], KubernetesSettings]:
    from gateway.kubernetes_config import parse_kubernetes  # here: it reads with this module's FieldReader

    r = FieldReader(doc, ("fleet",), doc.data.get("fleet"), {"pools", "emulator_speed", "controller", "actuator", "ray", "devices", "kubernetes"})
    raw = r.data.get("pools")
    if not isinstance(raw, list) or not raw:
        raise doc.error(("fleet", "pools"), "must be a non-empty list of pools")
    pools = tuple(_pool(doc, i, body, shapes.names) for i, body in enumerate(raw))
    _check_adapter_names(doc, pools)
    seen: set[str] = set()
    for i, pool in enumerate(pools):
        if pool.name in seen:
            raise doc.error(("fleet", "pools", i, "name"), f"pool name {pool.name!r} is used twice")
        seen.add(pool.name)
    speed = r.number("emulator_speed", 1.0, lo=0.01, hi=10000)
    actuator = r.text("actuator", "local")
    if actuator not in ("local", "ray", "kubernetes"):
        raise r.error("actuator", f"must be 'local' (replica processes on this host), 'ray' (Ray actors) or 'kubernetes' "
                                  f"(the pools' Deployments, fleet.kubernetes), not {actuator!r}")
    devices = _devices(doc, r.data.get("devices"), pools)
    kubernetes = parse_kubernetes(doc, r.data.get("kubernetes"), base)
    return pools, speed, _controller(doc, base, r.data.get("controller")), actuator, _ray(doc, r.data.get("ray")), devices, kubernetes


# --- tenants -------------------------------------------------------------------------------------


def parse_tenant(doc: YamlDoc, tiers: Mapping[str, TierSlo]) -> Tenant:
    known = {"name", "api_key_sha256", "models", "tiers", "default_tier", "objectives", "rate_limits", "max_concurrency", "adapters", "budget"}
    r = FieldReader(doc, (), doc.data, known)
    name = r.text("name", None)
    if not name or not _NAME.match(name):
        raise r.error("name", "every tenant needs a name (letters, digits, '-', '_')")
    hashes = r.names("api_key_sha256", None)
    if not hashes:
        raise r.error("api_key_sha256", "list the SHA-256 (hex) of each API key; keys themselves are never stored")
    for i, h in enumerate(hashes):
        if not _SHA256.match(h):
            raise doc.error(("api_key_sha256", i), "must be 64 lowercase hex digits (a SHA-256 of the key)")
    models = r.names("models", ["*"]) or ["*"]
    adapters = r.names("adapters", ["*"]) or []  # `adapters: []`: none
    allowed = r.names("tiers", list(tiers), tuple(tiers)) or []
    if not allowed:
        raise r.error("tiers", "a tenant needs at least one tier")
    default_tier = r.text("default_tier", allowed[0]) or allowed[0]
    if default_tier not in allowed:
        raise r.error("default_tier", f"{default_tier!r} is not one of the tenant's tiers {allowed}")
    overrides = r.data.get("objectives") or {}
    if not isinstance(overrides, dict):
        raise r.error("objectives", "must map tier names to objectives")
    objectives = dict(tiers)
    for tier, body in overrides.items():
        if tier not in tiers:
            raise doc.error(("objectives", tier), f"unknown tier (configured tiers: {', '.join(tiers)})")
        objectives[tier] = read_tier_slo(doc, ("objectives", tier), body, tiers[tier])
    limits = FieldReader(doc, ("rate_limits",), r.data.get("rate_limits"), {"requests_per_min", "tokens_per_min"})
    budget = FieldReader(doc, ("budget",), r.data.get("budget"), {"monthly_usd"})
    return Tenant(
        name=name,
        key_sha256=frozenset(hashes),
        models=None if "*" in models else frozenset(models),
        tiers=tuple(allowed),
        default_tier=default_tier,
        objectives=objectives,
        requests_per_min=limits.number("requests_per_min", 6000, lo=1, hi=1e12),
        tokens_per_min=limits.number("tokens_per_min", 1e9, lo=1, hi=1e15),
        max_concurrency=r.number("max_concurrency", 256, lo=1, hi=10**7, integer=True),
        source=doc.file,
        budget_monthly_usd=budget.number("monthly_usd", 0.0, lo=0.0, hi=1e12) if "monthly_usd" in budget.data else None,
        adapters=None if "*" in adapters else frozenset(adapters),
    )


def demo_tenant(tiers: Mapping[str, TierSlo]) -> Tenant:
    """The tenant `polymorph serve --upstream` serves: demo-only key, generous limits."""
    return Tenant(
        name="demo",
        key_sha256=frozenset({sha256_hex(DEMO_API_KEY)}),
        models=None,
        tiers=tuple(tiers),
        default_tier="standard" if "standard" in tiers else next(iter(tiers)),
        objectives=dict(tiers),
        requests_per_min=1e9,
        tokens_per_min=1e15,
        max_concurrency=1_000_000,
    )


def _tenants(doc: YamlDoc, base: Path, tiers: Mapping[str, TierSlo]) -> tuple[tuple[Tenant, ...], Path]:
    raw = doc.data.get("tenants_dir")
    if not isinstance(raw, str) or not raw:
        raise doc.error(("tenants_dir",), "name the directory of per-tenant YAML files")
    directory = (base / raw).resolve()
    if not directory.is_dir():
        raise doc.error(("tenants_dir",), f"{directory} is not a directory")
    files = sorted([*directory.glob("*.yaml"), *directory.glob("*.yml")])
    if not files:
        raise doc.error(("tenants_dir",), f"{directory} holds no *.yaml tenant files")
    tenants: list[Tenant] = []
    key_owner: dict[str, str] = {}
    for file in files:
        tdoc = load_yaml(file)
        tenant = parse_tenant(tdoc, tiers)
        if any(t.name == tenant.name for t in tenants):
            raise tdoc.error(("name",), f"tenant {tenant.name!r} is defined twice")
        for h in tenant.key_sha256:
            if h in key_owner:
                raise tdoc.error(("api_key_sha256",), f"a key hash is also listed by tenant {key_owner[h]!r}")
            key_owner[h] = tenant.name
        tenants.append(tenant)
    return tuple(tenants), directory


def load_config(path: Path) -> GatewayConfig:
    """Load and validate a gateway config file and its tenant files. Raises ConfigError."""
    # absolute, not resolved: a Kubernetes ConfigMap's file is a symlink into a folder the kubelet replaces on every
    # update, so the path to watch and to resolve relative paths from is the one given, not that folder's
    path = Path(os.path.abspath(path))
    doc = load_yaml(path)
    if not isinstance(doc.data, dict):
        raise doc.error((), "the config must be a YAML mapping")
    known = {"server", "upstream", "tenants_dir", "tiers", "classifier", "shapes", "default_shape", "fleet", "router", "aliases", "limits", "tracing"}
    FieldReader(doc, (), doc.data, known)
    tiers = _tiers(doc)
    shapes = _shapes(doc)
    tenants, tenants_dir = _tenants(doc, path.parent, tiers)
    pools, speed, controller, actuator, ray, devices, kubernetes = _fleet(doc, shapes, path.parent)
    return GatewayConfig(
        source=str(path),
        server=_server(doc),
        upstream=_upstream(doc),
        tiers=tiers,
        tenants=tenants,
        classifier=_classifier(doc, path.parent),
        shapes=shapes,
        pools=pools,
        emulator_speed=speed,
        controller=controller,
        actuator=actuator,
        ray=ray,
        kubernetes=kubernetes,
        devices=devices,
        router=_router(doc),
        aliases=_aliases(doc, pools),
        limits=_limits(doc),
        tracing=_tracing(doc),
        tenants_dir=tenants_dir,
    )


def upstream_only_config(urls: list[str], host: str, port: int) -> GatewayConfig:
    """`polymorph serve --upstream URL...`: one pool of those replicas, the demo tenant, default shapes."""
    tiers = dict(DEFAULT_TIERS)
    pool = PoolSpec("default", "*", None, (), {}, tuple(u.rstrip("/") for u in urls), 0, 0, len(urls))
    return GatewayConfig(
        source="<command line>",
        server=ServerSettings(host=host, port=port, admin_token_sha256=sha256_hex(DEMO_ADMIN_TOKEN), access_log=False),
        upstream=UpstreamSettings(),
        tiers=tiers,
        tenants=(demo_tenant(tiers),),
        classifier=ClassifierSettings(),
        shapes=default_shape_rules(),
        pools=(pool,),
    )
