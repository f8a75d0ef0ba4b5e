"""The Kubernetes actuator: each replica slot is one pod of its pool's engine Deployment.

The manifests (``polymorph deploy kubernetes``) make one Deployment per pool, labelled and annotated
as the contract in the README's "Deploying on Kubernetes" says; this module finds them by label,
keeps a cache of their pods from a watch, and turns the controller's commands into changes of the
Deployments' replica counts:

- Drain is the gateway's (no API call).
- Stop of a slot dooms its pod: the pod gets ``controller.kubernetes.io/pod-deletion-cost: -1000`` and
  only then is its Deployment scaled down (through the ``scale`` subresource), so Kubernetes removes
  exactly the drained pod and never one still serving.
- Start in a pool raises that pool's wanted count by one; the next pod of the pool that no slot holds
  (the new one) becomes the slot, healthy once Ready. Start with a configuration other than the
  Deployment's patches its container command and ``polymorph.dev/config-json`` annotation (a rolling
  update), and the slot waits for a pod of the new configuration.
- Start in a pool that has no Deployment (one the controller made, ``<shape>@<gpu>``) creates it, rendered
  as the manifests render a pool (``RenderDeployment``) with ``spec.replicas: 0``, then scales it up as
  any other; a ``409 AlreadyExists`` means another writer created it first, and that one is used.

Commands only change what this actuator wants (each pool's replica count, which pods are doomed)
and return at once; one worker thread reconciles the API server toward it, another keeps the pod
cache. The reconciler writes absolute counts read-compare-write with the Scale's resourceVersion
as precondition: a 409 conflict is re-read and retried, and a retry after a lost answer is a no-op,
so an API server that is briefly unreachable is retried with back-off from the same wanted state and
nothing is half-applied (a scale-down never goes out before every doomed pod carries its cost). The
watch resumes from its last resourceVersion (bookmarks keep it fresh) and lists afresh on 410 Gone.
A move whose pod does not come within the Mover's start deadline fails, and its rollback is just
more wanted state (the old pool's count back up, or the doomed pod spared if it is still there).

The ``kubernetes`` client is an optional dependency (``pip install -e '.[kubernetes]'``); this module
is imported only when ``fleet.actuator: kubernetes``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import orjson
import urllib3
from kubernetes import client as k8s
from kubernetes import config as kube_config
from kubernetes.client.exceptions import ApiException
from kubernetes.watch import Watch

from fleet.kubernetes_manifests import CONFIG_JSON_ANNOTATION as CONFIG_ANNOTATION
from fleet.kubernetes_manifests import ENGINE_PORT as HTTP_PORT  # the container's port named "http" when its spec names none
from fleet.kubernetes_manifests import POOL_LABEL, POOL_NAME_ANNOTATION
from fleet.rollout import SlotState
from kernels.config import EngineConfig

ENGINE_SELECTOR = "app.kubernetes.io/name=polymorph-engine,app.kubernetes.io/part-of=polymorph"  # fleet.kubernetes_manifests.pool_labels
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
DRAINED_COST = "-1000"  # the lowest cost: the ReplicaSet removes this pod first on a scale-down
SERVING_COST = "0"
CONTAINER = "engine"
# Waiting reasons after which a container will not become ready by itself: the slot's start has failed.
_FATAL_WAITING = frozenset({"CrashLoopBackOff", "ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CreateContainerConfigError",
                            "CreateContainerError"})
_REQUEST_TIMEOUT_S = (3.0, 10.0)  # connect, read: a hung API server is an unreachable one
_WATCH_TIMEOUT_S = 30  # the server ends each watch this soon; it resumes from the last resourceVersion
_MAX_CONFLICT_RETRIES = 20
# Transient: the API server is unreachable, timed out or overloaded; the same wanted state is retried.
_TRANSIENT = (urllib3.exceptions.HTTPError, OSError)


def api_client(kubeconfig: str | None) -> k8s.ApiClient:
    """A client from a kubeconfig file, or the pod's service account when ``kubeconfig`` is None."""
    configuration = k8s.Configuration()
    configuration.retries = 0  # one try per call: the actuator's own back-off retries, from the state it wants
    if kubeconfig is not None:
        return kube_config.new_client_from_config(config_file=kubeconfig, client_configuration=configuration)  # type: ignore[no-untyped-call,no-any-return]
    kube_config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    return k8s.ApiClient(configuration)


# (pool, GPU kind, engine config JSON) -> the pool's engine Deployment with spec.replicas 0, as the manifests
# render it (fleet.kubernetes_manifests.engine_deployment): what a Start into a pool without one creates, and
# whose container command a configuration change patches in. ValueError: the settings cannot place that pool.
RenderDeployment = Callable[[str, str, str], dict[str, Any]]


@dataclass(frozen=True, slots=True)
class PodFact:
    """One engine pod as the watch last saw it."""

    name: str
    pool_label: str
    created_at: datetime | None
    url: str | None  # None until it has an IP
    ready: bool
    terminating: bool  # deletionTimestamp set: it is going away
    deletion_cost: str | None
    config_json: str | None  # its template's config-json annotation (None: the Deployment's, from before any patch)
    argv: tuple[str, ...]
    failure: str | None  # why it will never become ready


@dataclass(frozen=True, slots=True)
class KubeStats:
    """What the actuator met on the way (evidence for the decision log and tests)."""

    num_conflicts: int  # 409s on a write, each re-read and retried
    num_relists: int  # fresh lists after the first (410 Gone)
    num_transient_errors: int  # calls that failed because the API server was unreachable or overloaded
    num_scale_writes: int
    num_cost_writes: int
    num_template_writes: int
    num_deployment_creates: int  # Deployments this actuator created (pools that had none)


@dataclass(slots=True)
class _Pool:
    """One engine Deployment and what this actuator wants of it."""

    name: str
    deployment: str
    pool_label: str
    desired: int  # spec.replicas to reach
    config_json: str  # the configuration its pod template should run
    initial_config_json: str  # what pods without the annotation run (the Deployment's when found)
    manifest: dict[str, Any] | None = None  # to create: the API server had no Deployment for the pool when last looked


@dataclass(slots=True)
class _Slot:
    name: str
    gpu: str
    pool: str
    config_json: str
    running: bool = False  # started and not stopped since
    pod: str | None = None  # the pod it holds (None: waiting for one)
    error: str | None = None


@dataclass(slots=True)
class _Counters:
    conflicts: int = 0
    relists: int = -1  # the first list is not a relist
    transient: int = 0
    scale_writes: int = 0
    cost_writes: int = 0
    template_writes: int = 0
    deployment_creates: int = 0
    errors: list[str] = field(default_factory=list)  # the last few transient errors, for diagnostics


def _same_config(a: str, b: str) -> bool:
    """The same engine configuration, however written (the manifests write only the fields that differ from the defaults)."""
    return EngineConfig.from_dict(orjson.loads(a)) == EngineConfig.from_dict(orjson.loads(b))


def pod_fact(pod: k8s.V1Pod) -> PodFact | None:
    """The facts the actuator reads from a pod (None: not an engine pod of a pool)."""
    meta, spec, status = pod.metadata, pod.spec, pod.status
    if meta is None or meta.name is None or POOL_LABEL not in (meta.labels or {}):
        return None
    annotations = meta.annotations or {}
    container = next((c for c in (spec.containers if spec is not None else []) if c.name == CONTAINER), None)
    port = next((p.container_port for p in (container.ports or []) if p.name == "http"), HTTP_PORT) if container is not None else HTTP_PORT
    ip = status.pod_ip if status is not None else None
    ready = status is not None and any(c.type == "Ready" and c.status == "True" for c in status.conditions or [])
    failure = None
    if status is not None:
        if status.phase == "Failed":
            failure = f"pod {meta.name} failed: {status.reason or status.message or 'no reason given'}"
        for cs in status.container_statuses or []:
            waiting = cs.state.waiting if cs.state is not None else None
            if waiting is not None and waiting.reason in _FATAL_WAITING:
                failure = f"pod {meta.name}: container {cs.name} {waiting.reason}: {waiting.message or ''}".rstrip(": ")
    argv = tuple((container.command or []) + (container.args or [])) if container is not None else ()
    return PodFact(meta.name, (meta.labels or {})[POOL_LABEL], meta.creation_timestamp, f"http://{ip}:{port}" if ip else None, ready,
                   meta.deletion_timestamp is not None, annotations.get(DELETION_COST), annotations.get(CONFIG_ANNOTATION), argv, failure)


class KubernetesActuator:
    """Replica slots as pods of the pools' engine Deployments (the process half of the controller's
    commands, as ``LocalSlots``); ``add_slot`` + ``start`` adopt the pods the Deployments already run."""

    def __init__(self, api: k8s.ApiClient, namespace: str, render: RenderDeployment, reconcile_s: float = 1.0) -> None:
        self.namespace = namespace
        self.render = render
        self.reconcile_s = reconcile_s
        self._apps = k8s.AppsV1Api(api)
        self._core = k8s.CoreV1Api(api)
        self._lock = threading.Lock()  # guards everything below; held for no API call
        self.slots: dict[str, _Slot] = {}
        self.pools: dict[str, _Pool] = {}
        self._pods: dict[str, PodFact] = {}
        self._doomed: set[str] = set()  # pods a Stop left behind, to go on the next scale-down
        # doomed pods a scale write may already have removed (its answer can be lost): never taken back,
        # even when the cache, cut off from the API server, still shows them serving
        self._sentenced: set[str] = set()
        self._counters = _Counters()
        self._synced = threading.Event()  # the pod cache holds a full list
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._discover()
        self._threads = [threading.Thread(target=self._watch_pods, name="polymorph-kube-watch", daemon=True),
                         threading.Thread(target=self._reconcile, name="polymorph-kube-reconcile", daemon=True)]
        for thread in self._threads:
            thread.start()
        if not self._synced.wait(30.0):
            raise RuntimeError(f"could not list the engine pods in namespace {namespace!r}: {self._counters.errors[-1:]}")

    def _discover(self) -> None:
        """The engine Deployments (blocks: at start-up, when the API server must answer)."""
        found = self._apps.list_namespaced_deployment(self.namespace, label_selector=ENGINE_SELECTOR, _request_timeout=_REQUEST_TIMEOUT_S)
        for deployment in found.items:
            meta, spec = deployment.metadata, deployment.spec
            if meta is None or meta.name is None or spec is None:
                continue
            annotations, labels = meta.annotations or {}, meta.labels or {}
            name = annotations.get(POOL_NAME_ANNOTATION, labels.get(POOL_LABEL, meta.name))
            config_json = annotations.get(CONFIG_ANNOTATION, "{}")
            self.pools[name] = _Pool(name, meta.name, labels.get(POOL_LABEL, name), spec.replicas or 0, config_json, config_json)

    # -- ReplicaControl ------------------------------------------------------------------------

    def add_slot(self, slot: str, gpu: str, pool: str, config_json: str, devices: tuple[str, ...] = ()) -> None:
        """A slot on GPUs of kind ``gpu`` (the Deployment's node selector places it), not started yet."""
        with self._lock:
            self.slots[slot] = _Slot(slot, gpu, pool, config_json)

    def slot_states(self) -> list[SlotState]:
        with self._lock:
            return [self._state(s) for s in self.slots.values()]

    def slot_state(self, slot: str) -> SlotState | None:
        with self._lock:
            found = self.slots.get(slot)
            return self._state(found) if found is not None else None

    def _state(self, s: _Slot) -> SlotState:
        pod = self._pods.get(s.pod) if s.pod is not None else None
        # a slot waiting for its pod is alive: the Deployment will make one (the Mover's deadline bounds the wait)
        return SlotState(s.name, s.pool, s.gpu, s.config_json, alive=s.running and self._error(s) is None,
                         healthy=pod is not None and pod.ready and not pod.terminating and pod.url is not None)

    def stop(self, slot: str, now: float) -> None:
        with self._lock:
            found = self.slots[slot]
            if not found.running:
                return
            pool = self.pools.get(found.pool)
            if found.pod is not None:
                self._doomed.add(found.pod)
            if pool is not None:
                pool.desired = max(0, pool.desired - 1)
            found.running, found.pod, found.error = False, None, None
        self._wake.set()

    def start(self, slot: str, pool: str, config_json: str, now: float) -> None:
        with self._lock:
            found = self.slots[slot]
            found.pool, found.config_json, found.pod, found.error = pool, config_json, None, None
            target = self.pools.get(pool) or self._new_pool(found, pool, config_json)
            if target is None:
                return
            found.running = True
            if not _same_config(target.config_json, config_json):
                target.config_json = config_json  # a rolling update; the slot waits for a pod of the new configuration
            running = sum(1 for s in self.slots.values() if s.running and s.pool == pool and s is not found)
            if running >= target.desired:  # no pod the Deployment runs (or will run) is free for it: one more
                target.desired += 1
            self._bind()
        self._wake.set()

    def _new_pool(self, slot: _Slot, pool: str, config_json: str) -> _Pool | None:
        """A pool with no Deployment yet (under the lock): the reconciler creates the one rendered here.
        None, with the slot's error set, when the settings cannot place it."""
        try:
            manifest = self.render(pool, slot.gpu, config_json)
        except ValueError as exc:
            slot.error = f"cannot render an engine Deployment for pool {pool!r}: {exc}"
            return None
        meta = manifest["metadata"]
        self.pools[pool] = _Pool(pool, meta["name"], meta["labels"][POOL_LABEL], 0, config_json, config_json, manifest)
        return self.pools[pool]

    def is_healthy(self, slot: str, now: float) -> bool:
        state = self.slot_state(slot)
        return state is not None and state.healthy

    def devices(self, slot: str) -> tuple[str, ...]:
        return ()  # the device plugin hands the pod its GPUs

    def argv(self, slot: str) -> tuple[str, ...] | None:
        with self._lock:
            pod = self._pod_of(self.slots[slot])
            return pod.argv if pod is not None else None

    def url(self, slot: str) -> str | None:
        with self._lock:
            pod = self._pod_of(self.slots[slot])
            return pod.url if pod is not None else None

    def error(self, slot: str) -> str | None:
        with self._lock:
            return self._error(self.slots[slot])

    def stats(self) -> KubeStats:
        with self._lock:
            c = self._counters
            return KubeStats(c.conflicts, max(0, c.relists), c.transient, c.scale_writes, c.cost_writes, c.template_writes, c.deployment_creates)

    def pod_of(self, slot: str) -> str | None:
        """The name of the pod ``slot`` holds (None: none yet)."""
        with self._lock:
            return self.slots[slot].pod

    def converged(self) -> bool:
        """Has the API server been told everything this actuator wants (no doomed pod left, no slot waiting)?"""
        with self._lock:
            return not self._doomed and not self._sentenced and not self._wake.is_set() and all(s.pod is not None for s in self.slots.values() if s.running)

    def close(self) -> None:
        """Stop reconciling (the pods stay: they are the Deployments', and a restarted gateway adopts them)."""
        self._closed.set()
        self._wake.set()
        for thread in self._threads:
            thread.join(timeout=_REQUEST_TIMEOUT_S[0] + _REQUEST_TIMEOUT_S[1])

    def _pod_of(self, s: _Slot) -> PodFact | None:
        return self._pods.get(s.pod) if s.pod is not None else None

    def _error(self, s: _Slot) -> str | None:
        pod = self._pod_of(s)
        return s.error or (pod.failure if pod is not None else None)

    # -- which pod is whose (under the lock) -----------------------------------------------------

    def _pod_config(self, pod: PodFact, pool: _Pool) -> str:
        return pod.config_json if pod.config_json is not None else pool.initial_config_json

    def _bind(self) -> None:
        """Slots waiting for a pod take one: a live pod of their pool and configuration that no slot
        holds. A doomed pod is taken back only while the Deployment wants every pod it has (a rollback
        before the scale-down went out)."""
        for s in self.slots.values():
            if s.pod is not None and (s.pod not in self._pods or self._pods[s.pod].terminating):
                s.pod = None  # gone outside a Stop (evicted, replaced): the Deployment makes another
        held = {s.pod for s in self.slots.values() if s.pod is not None}
        for s in self.slots.values():
            pool = self.pools.get(s.pool)
            if not s.running or s.pod is not None or pool is None:
                continue
            live = [p for p in self._pods.values() if p.pool_label == pool.pool_label and not p.terminating]
            fits = [p for p in live if p.name not in held and p.name not in self._sentenced and _same_config(self._pod_config(p, pool), s.config_json)]
            free = [p for p in fits if p.name not in self._doomed]
            if not free and pool.desired >= len(live):
                free = fits
            if free:
                pick = min(free, key=lambda p: (not p.ready, p.created_at or datetime.max, p.name))
                s.pod = pick.name
                self._doomed.discard(pick.name)
                held.add(pick.name)

    # -- the pod cache (its own thread) ----------------------------------------------------------

    def _watch_pods(self) -> None:
        resource_version: str | None = None
        backoff = _Backoff()
        while not self._closed.is_set():
            try:
                if resource_version is None:
                    listed = self._core.list_namespaced_pod(self.namespace, label_selector=ENGINE_SELECTOR, _request_timeout=_REQUEST_TIMEOUT_S)
                    facts = [f for f in map(pod_fact, listed.items) if f is not None]
                    with self._lock:
                        self._pods = {f.name: f for f in facts}
                        self._doomed &= set(self._pods)
                        self._sentenced &= set(self._pods)
                        self._counters.relists += 1
                        self._bind()
                    resource_version = listed.metadata.resource_version if listed.metadata is not None else None
                    self._synced.set()
                    self._wake.set()
                watch = Watch()  # type: ignore[no-untyped-call]
                for event in watch.stream(self._core.list_namespaced_pod, self.namespace, label_selector=ENGINE_SELECTOR,  # type: ignore[no-untyped-call]
                                          resource_version=resource_version, allow_watch_bookmarks=True, timeout_seconds=_WATCH_TIMEOUT_S,
                                          _request_timeout=(_REQUEST_TIMEOUT_S[0], _WATCH_TIMEOUT_S * 2)):
                    if self._closed.is_set():
                        watch.stop()  # type: ignore[no-untyped-call]
                        break
                    self._on_event(event)
                    resource_version = watch.resource_version or resource_version
                    backoff.reset()
            except ApiException as exc:
                if exc.status == 410:  # our resourceVersion is older than the server keeps: list afresh
                    resource_version = None
                    continue
                self._transient(exc)
                backoff.sleep(self._closed)
            except _TRANSIENT as exc:
                self._transient(exc)
                backoff.sleep(self._closed)

    def _on_event(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        if kind not in ("ADDED", "MODIFIED", "DELETED"):
            return  # BOOKMARK: only its resourceVersion (the Watch keeps it)
        fact = pod_fact(event["object"])
        if fact is None:
            return
        with self._lock:
            if kind == "DELETED":
                self._pods.pop(fact.name, None)
                self._doomed.discard(fact.name)
                self._sentenced.discard(fact.name)
            else:
                self._pods[fact.name] = fact
            self._bind()
        self._wake.set()

    # -- the reconciler (its own thread) ---------------------------------------------------------

    def _reconcile(self) -> None:
        backoff = _Backoff()
        while not self._closed.is_set():
            self._wake.wait(self.reconcile_s)
            if self._closed.is_set():
                return
            self._wake.clear()
            try:
                self._reconcile_once()
                backoff.reset()
            except ApiException as exc:
                self._transient(exc)
                self._wake.set()  # not there yet: again after the back-off
                backoff.sleep(self._closed)
            except _TRANSIENT as exc:
                self._transient(exc)
                self._wake.set()
                backoff.sleep(self._closed)

    def _reconcile_once(self) -> None:
        listed = self._apps.list_namespaced_deployment(self.namespace, label_selector=ENGINE_SELECTOR, _request_timeout=_REQUEST_TIMEOUT_S)
        by_name = {d.metadata.name: d for d in listed.items if d.metadata is not None}
        for name in list(self.pools):
            with self._lock:
                self._bind()
                pool = self.pools[name]
                desired, config_json, label = pool.desired, pool.config_json, pool.pool_label
                live = [p for p in self._pods.values() if p.pool_label == label and not p.terminating]
                held = {s.pod for s in self.slots.values() if s.pod is not None}
                doomed = [p.name for p in live if p.name in self._doomed]
                doom = [name for name in doomed if self._pods[name].deletion_cost != DRAINED_COST]
                spare = [p.name for p in live if p.name in held and p.deletion_cost == DRAINED_COST]
                gpu = next((s.gpu for s in self.slots.values() if s.pool == name), "")
                manifest = pool.manifest
            deployment = by_name.get(pool.deployment)
            if deployment is None and manifest is not None and desired > 0:  # a start rolled back before it went out needs none
                deployment = self._create(manifest)
            if deployment is None or deployment.metadata is None or deployment.spec is None:
                continue
            annotations = deployment.metadata.annotations or {}
            if manifest is not None:
                with self._lock:  # it exists now: its pods without the annotation run the config it was made with
                    pool.manifest, pool.initial_config_json = None, annotations.get(CONFIG_ANNOTATION, "{}")
            if not _same_config(annotations.get(CONFIG_ANNOTATION, "{}"), config_json):
                self._patch_template(pool.deployment, name, gpu, config_json)
            for pod in spare:
                self._patch_cost(pod, SERVING_COST)
            for pod in doom:  # every doomed pod carries its cost before any scale-down goes out
                self._patch_cost(pod, DRAINED_COST)
            if deployment.spec.replicas != desired:
                with self._lock:
                    self._sentenced.update(doomed)
                self._scale(pool.deployment, desired)

    def _create(self, manifest: dict[str, Any]) -> k8s.V1Deployment:
        """Create a pool's Deployment; one another writer created first (409 AlreadyExists) is read and used."""
        try:
            # the client sends a dict body as the JSON it is (the stubs name only the model class)
            created: k8s.V1Deployment = self._apps.create_namespaced_deployment(self.namespace, manifest,  # type: ignore[arg-type]
                                                                                _request_timeout=_REQUEST_TIMEOUT_S)
        except ApiException as exc:
            if exc.status != 409:
                raise
            return self._apps.read_namespaced_deployment(manifest["metadata"]["name"], self.namespace, _request_timeout=_REQUEST_TIMEOUT_S)
        with self._lock:
            self._counters.deployment_creates += 1
        return created

    def _patch_cost(self, pod: str, cost: str) -> None:
        self._core.patch_namespaced_pod(pod, self.namespace, {"metadata": {"annotations": {DELETION_COST: cost}}},
                                        _content_type="application/strategic-merge-patch+json", _request_timeout=_REQUEST_TIMEOUT_S)
        with self._lock:
            self._counters.cost_writes += 1

    def _patch_template(self, deployment: str, pool: str, gpu: str, config_json: str) -> None:
        containers = self.render(pool, gpu, config_json)["spec"]["template"]["spec"]["containers"]
        command = next(c["command"] for c in containers if c["name"] == CONTAINER)
        body = {"metadata": {"annotations": {CONFIG_ANNOTATION: config_json}},
                "spec": {"template": {"metadata": {"annotations": {CONFIG_ANNOTATION: config_json}},
                                      "spec": {"containers": [{"name": CONTAINER, "command": command, "args": []}]}}}}
        self._apps.patch_namespaced_deployment(deployment, self.namespace, body, _content_type="application/strategic-merge-patch+json",
                                               _request_timeout=_REQUEST_TIMEOUT_S)
        with self._lock:
            self._counters.template_writes += 1

    def _scale(self, deployment: str, replicas: int) -> None:
        """Set ``spec.replicas`` through the scale subresource, with the read resourceVersion as precondition."""
        for _ in range(_MAX_CONFLICT_RETRIES):
            scale = self._apps.read_namespaced_deployment_scale(deployment, self.namespace, _request_timeout=_REQUEST_TIMEOUT_S)
            if scale.spec is not None and scale.spec.replicas == replicas:
                return  # already so (an earlier write whose answer was lost)
            version = scale.metadata.resource_version if scale.metadata is not None else None
            try:
                self._apps.patch_namespaced_deployment_scale(
                    deployment, self.namespace, {"metadata": {"resourceVersion": version}, "spec": {"replicas": replicas}},
                    _content_type="application/merge-patch+json", _request_timeout=_REQUEST_TIMEOUT_S)
            except ApiException as exc:
                if exc.status != 409:
                    raise
                with self._lock:
                    self._counters.conflicts += 1
                continue  # someone wrote the Deployment since we read it: read again
            with self._lock:
                self._counters.scale_writes += 1
            return
        raise ApiException(status=409, reason=f"scale of {deployment} conflicted {_MAX_CONFLICT_RETRIES} times in a row")

    def _transient(self, exc: BaseException) -> None:
        with self._lock:
            self._counters.transient += 1
            self._counters.errors = [*self._counters.errors[-4:], repr(exc)[:300]]


class _Backoff:
    """0.2 s, doubling to 2 s, between tries against an API server that does not answer (short: a move waits on it)."""

    def __init__(self) -> None:
        self.delay_s = 0.2

    def reset(self) -> None:
        self.delay_s = 0.2

    def sleep(self, closed: threading.Event) -> None:
        closed.wait(self.delay_s)
        self.delay_s = min(2.0, self.delay_s * 2)
