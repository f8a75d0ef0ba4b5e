"""A small Kubernetes API server for the Kubernetes actuator's tests, with a "kubelet" that runs real replicas.

aiohttp on 127.0.0.1, in a thread of its own, speaking the real API's JSON for what
fleet.actuators.kubernetes uses, so the official ``kubernetes`` client talks to it over real HTTP
through a kubeconfig (``write_kubeconfig``):

- apps/v1 Deployments: list (``labelSelector``), get, create (POST; ``409 AlreadyExists`` when the name is
  taken, ``400`` when the body's namespace is not the URL's; its pods run like any other's), patch (strategic-merge-patch: maps merge,
  ``containers`` merge by ``name``, other lists replace, null deletes; merge-patch+json likewise but
  lists replace), and the ``scale`` subresource: get and patch, answering an autoscaling/v1 Scale whose
  resourceVersion is the Deployment's.
- v1 Pods: list, get, patch (as above), and watch (``watch=true``): JSON lines of ADDED/MODIFIED/DELETED
  from the given resourceVersion, BOOKMARKs every ``bookmark_s`` when ``allowWatchBookmarks``, the
  stream ends after ``timeoutSeconds``, and an ERROR event with ``410 Gone`` for a resourceVersion
  older than the history kept (``compact`` forgets it and ends every watch).
- coordination.k8s.io/v1 Leases: get (``404 NotFound`` when absent), create (POST; ``409 AlreadyExists``
  when the name is taken) and replace (PUT; ``422 Invalid`` without ``metadata.resourceVersion``,
  ``409 Conflict`` with a stale one, ``404`` when absent, ``400`` when the body's name or namespace is not
  the URL's); ``renewTime`` and ``acquireTime`` must be MicroTimes (six fraction digits, ``400``
  otherwise) and are stored as the API server writes them (UTC, ``Z``).
- One resourceVersion counter for every write; a write whose body carries ``metadata.resourceVersion``
  other than the object's gets ``409 Conflict``. Errors are Status objects.
- The kubelet and the ReplicaSet controller in one loop (every 0.1 s): a Deployment with fewer live
  pods than ``spec.replicas`` gets a new pod whose container command (its trailing ``--host/--port``
  replaced) runs as a REAL process on a free loopback port (the pod's IP is 127.0.0.1, and its
  ``http`` containerPort is that port, since all pods share one address); the pod is Ready once
  ``/health`` answers 200. With more, the pod with the lowest ``pod-deletion-cost`` goes (then pods of
  an old template, not-ready ones, the newest), as the ReplicaSet controller ranks them: it is marked
  terminating, its process gets SIGTERM (SIGKILL after 10 s), and it is deleted when the process has
  exited. A changed pod template rolls one pod at a time (one extra pod, old ones go once it is Ready).
  A process that exits by itself leaves its pod in CrashLoopBackOff. No image is pulled: the
  container's command runs on this host (``polymorph`` being this checkout's CLI).
- Fault injection for the tests: ``conflict_next_scale`` (another writer bumps the Deployment just
  before the next scale patches), ``create_before_next_create`` (another writer creates a Deployment just
  before the next create), ``conflict_next_lease_write`` (likewise a Lease before the next
  replaces), ``write_lease`` (a write by another client), ``on_scale`` (a hook after each scale patch), ``compact`` (410 Gone
  for every resourceVersion so far, and dropped watches), ``outage`` (for N seconds the port refuses
  connections and open connections are cut; the port stays this server's, so nothing else answers on it).

What it does NOT do (everything else): authentication and RBAC (any token passes), admission,
validation against the schemas, field selectors, set-based label selectors (only ``k=v,k2=v2``),
server-side apply, JSON patch, create but a Lease's and a Deployment's, update (PUT) but a Lease's, delete, list and watch of
Leases, other resources and API groups (no Services, EndpointSlices, ReplicaSets, Nodes, Events), discovery (``/api``, ``/apis``),
namespaces as objects, Deployment strategies (maxSurge/maxUnavailable), owner references and garbage collection, probes other than one readiness GET of
``/health``, liveness restarts, scheduling, resources and node selectors, preStop hooks, Deployment
status beyond replica counts, protobuf/CBOR/YAML, chunked lists (``limit``/``continue``), and
``resourceVersionMatch``.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import signal
import socket
import subprocess
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from tests.conftest import free_port
from tests.support.procs import POLYMORPH

Obj = dict[str, Any]
_KUBELET_TICK_S = 0.1
_KILL_AFTER_S = 10.0
_MICRO_TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}(Z|[+-]\d\d:\d\d)$")  # Go's RFC3339Micro parses these


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _selects(selector: str | None, labels: dict[str, str]) -> bool:
    if not selector:
        return True
    return all(labels.get(k) == v for k, v in (term.split("=", 1) for term in selector.split(",")))


def _merge(target: Any, patch: Any, strategic: bool) -> Any:
    """A merge patch of ``patch`` onto ``target``; strategic: ``containers`` lists merge by name."""
    if not isinstance(patch, dict) or not isinstance(target, dict):
        return copy.deepcopy(patch)
    out = dict(target)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif strategic and key == "containers" and isinstance(value, list):
            merged = {c["name"]: c for c in out.get(key, [])}
            for item in value:
                merged[item["name"]] = _merge(merged.get(item["name"], {}), item, strategic)
            out[key] = list(merged.values())
        else:
            out[key] = _merge(out.get(key), value, strategic)
    return out


def _template_hash(deployment: Obj) -> str:
    return f"{zlib.crc32(json.dumps(deployment['spec']['template'], sort_keys=True).encode()):08x}"


def _host_port_stripped(argv: Sequence[str]) -> list[str]:
    out = list(argv)
    for flag in ("--host", "--port"):
        while flag in out:
            i = out.index(flag)
            del out[i:i + 2]
    return out


class _Failure(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


class KubeApi:
    """The server; ``start`` it, ``add_deployment`` the pools, point the client at ``write_kubeconfig``."""

    def __init__(self, log_dir: Path, namespace: str = "polymorph", bookmark_s: float = 0.5) -> None:
        self.log_dir = log_dir
        self.namespace = namespace
        self.bookmark_s = bookmark_s
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.rv = 0
        self.oldest_rv = 0  # watches from before this get 410 Gone
        self.deployments: dict[str, Obj] = {}
        self.leases: dict[str, Obj] = {}
        self.lease_conflicts = 0  # 409 Conflicts answered to lease replaces
        self.pods: dict[str, Obj] = {}
        self.history: list[tuple[int, str, Obj]] = []  # (resourceVersion, event type, pod)
        self.watchers: set[asyncio.Queue[tuple[str, Obj] | None]] = set()
        self.processes: dict[str, subprocess.Popen[bytes]] = {}  # pod -> its container's process
        self.kill_at: dict[str, float] = {}
        self.scale_log: list[tuple[str, int, int]] = []  # (deployment, from, to) per applied scale patch
        self.refused = 0  # requests cut during outages
        self.on_scale: Callable[[str, int, int], None] | None = None
        self._conflicts_left = 0
        self._lease_conflicts_left = 0
        self._created_first: Obj | None = None
        self._down = False
        self._refusing = False  # in an outage, once the port no longer listens
        self._pod_serial = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kube-api", daemon=True)
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._kubelet: asyncio.Task[None] | None = None
        self._http: aiohttp.ClientSession | None = None

    # -- life ------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()
        self.call(self._start)

    async def _start(self) -> None:
        app = web.Application(middlewares=[self._outage_cut])
        ns = "/namespaces/{ns}"
        app.router.add_get(f"/apis/apps/v1{ns}/deployments", self._list_deployments)
        app.router.add_post(f"/apis/apps/v1{ns}/deployments", self._create_deployment)
        app.router.add_get(f"/apis/apps/v1{ns}/deployments/{{name}}", self._get_deployment)
        app.router.add_patch(f"/apis/apps/v1{ns}/deployments/{{name}}", self._patch_deployment)
        app.router.add_get(f"/apis/apps/v1{ns}/deployments/{{name}}/scale", self._get_scale)
        app.router.add_patch(f"/apis/apps/v1{ns}/deployments/{{name}}/scale", self._patch_scale)
        app.router.add_get(f"/api/v1{ns}/pods", self._list_pods)
        app.router.add_get(f"/api/v1{ns}/pods/{{name}}", self._get_pod)
        app.router.add_patch(f"/api/v1{ns}/pods/{{name}}", self._patch_pod)
        app.router.add_get(f"/apis/coordination.k8s.io/v1{ns}/leases/{{name}}", self._get_lease)
        app.router.add_post(f"/apis/coordination.k8s.io/v1{ns}/leases", self._create_lease)
        app.router.add_put(f"/apis/coordination.k8s.io/v1{ns}/leases/{{name}}", self._replace_lease)
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.5)
        await self._runner.setup()
        await self._listen()
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.5))
        self._kubelet = asyncio.create_task(self._kubelet_loop())

    async def _listen(self) -> None:
        assert self._runner is not None
        self._site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True)
        await self._site.start()

    def close(self) -> None:
        """Stop the server and every pod's process."""
        self.call(self._close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()

    async def _close(self) -> None:
        if self._kubelet is not None:
            self._kubelet.cancel()
        self._end_watches()
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        for process in self.processes.values():
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
        if self._http is not None:
            await self._http.close()
        if self._runner is not None:
            await self._runner.cleanup()

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` (a coroutine function or a plain one) on the server's loop and return its result."""
        async def run() -> Any:
            result = fn()
            return await result if asyncio.iscoroutine(result) else result
        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(30)

    def write_kubeconfig(self, path: Path) -> Path:
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "test", "cluster": {"server": self.url}}],
            "users": [{"name": "test", "user": {"token": "test"}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test", "namespace": self.namespace}}],
        }))
        return path

    # -- what tests set up and read (any thread) ---------------------------------------------------

    def add_deployment(self, deployment: Obj) -> str:
        """Create a Deployment as rendered (fleet.kubernetes_manifests.engine_deployment); returns its name."""
        return str(self.call(lambda: self._store_deployment(deployment))["metadata"]["name"])

    def snapshot(self) -> tuple[dict[str, int], list[Obj]]:
        """(Deployment -> spec.replicas, a copy of every pod)."""
        return self.call(lambda: ({n: d["spec"]["replicas"] for n, d in self.deployments.items()}, copy.deepcopy(list(self.pods.values()))))

    def template_hashes(self) -> dict[str, str]:
        """Deployment -> its pod template's hash (a pod's ``pod-template-hash`` label says which template it runs)."""
        return self.call(lambda: {n: _template_hash(d) for n, d in self.deployments.items()})

    def conflict_next_scale(self, times: int = 1) -> None:
        """Before each of the next ``times`` scale patches another writer changes the Deployment (its resourceVersion moves on)."""
        def arm() -> None:
            self._conflicts_left += times
        self.call(arm)

    def lease(self, name: str) -> Obj | None:
        """A copy of the Lease ``name`` (None when there is none)."""
        found: Obj | None = self.call(lambda: copy.deepcopy(self.leases.get(name)))
        return found

    def create_before_next_create(self, deployment: Obj) -> None:
        """Another writer creates ``deployment`` just before the next Deployment create (which then meets it)."""
        def arm() -> None:
            self._created_first = copy.deepcopy(deployment)
        self.call(arm)

    def write_lease(self, name: str, spec: Obj) -> None:
        """Another client writes these fields into the Lease ``name``'s spec (its resourceVersion moves on)."""
        def write() -> None:
            lease = self.leases[name]
            lease["spec"].update(spec)
            self._bump(lease)
        self.call(write)

    def conflict_next_lease_write(self, times: int = 1) -> None:
        """Before each of the next ``times`` Lease replaces another writer changes that Lease (an annotation),
        so the replace's resourceVersion is stale."""
        def arm() -> None:
            self._lease_conflicts_left += times
        self.call(arm)

    def compact(self) -> None:
        """Forget the event history (a resourceVersion from before now gets 410 Gone) and end every watch."""
        self.call(self._compact)

    def _compact(self) -> None:
        self.oldest_rv = self.rv
        self.history.clear()
        self._end_watches()

    def outage(self, seconds: float) -> None:
        """From now for ``seconds``: new connections are refused and requests on open ones are cut."""
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._outage(seconds)))

    async def _outage(self, seconds: float) -> None:
        self._down = True
        self._end_watches()
        assert self._site is not None
        await self._site.stop()
        # held (bound, not listening: connections are refused) until it listens again, so that free_port's
        # probe, in another test worker say, does not hand the port to another server meanwhile: its 404s for
        # our paths once read as "the Lease was deleted by someone else"
        with socket.socket() as hold:
            hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # beside this server's connections still closing
            hold.bind(("127.0.0.1", self.port))
            self._refusing = True
            await asyncio.sleep(seconds)
        self._refusing = False
        await self._listen()
        self._down = False

    @property
    def down(self) -> bool:
        return self._down

    @property
    def refusing(self) -> bool:
        """In an outage and no longer listening: connections are refused."""
        return self._refusing

    # -- HTTP --------------------------------------------------------------------------------------

    @web.middleware
    async def _outage_cut(self, request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
        if self._down:
            self.refused += 1
            if request.transport is not None:
                request.transport.abort()
            raise web.HTTPServiceUnavailable()
        try:
            return await handler(request)  # type: ignore[no-any-return]
        except _Failure as failure:
            return web.json_response({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                                      "message": failure.message, "reason": failure.reason, "code": failure.code}, status=failure.code)

    def _ns(self, request: web.Request) -> None:
        if request.match_info["ns"] != self.namespace:
            raise _Failure(404, "NotFound", f"namespace {request.match_info['ns']} has nothing")

    def _deployment(self, request: web.Request) -> Obj:
        self._ns(request)
        found = self.deployments.get(request.match_info["name"])
        if found is None:
            raise _Failure(404, "NotFound", f'deployments.apps "{request.match_info["name"]}" not found')
        return found

    async def _list_deployments(self, request: web.Request) -> web.Response:
        self._ns(request)
        items = [d for d in self.deployments.values() if _selects(request.query.get("labelSelector"), d["metadata"]["labels"])]
        return web.json_response({"apiVersion": "apps/v1", "kind": "DeploymentList", "metadata": {"resourceVersion": str(self.rv)}, "items": items})

    async def _create_deployment(self, request: web.Request) -> web.Response:
        self._ns(request)
        body = await request.json()
        if not isinstance(body, dict) or not isinstance(body.get("metadata"), dict) or not isinstance(body.get("spec"), dict):
            raise _Failure(400, "BadRequest", "the body is not a Deployment")
        name = str(body["metadata"].get("name") or "")
        if not name:
            raise _Failure(422, "Invalid", "Deployment.apps is invalid: metadata.name: Required value: name or generateName is required")
        if body["metadata"].get("namespace", self.namespace) != self.namespace:
            raise _Failure(400, "BadRequest", "the namespace of the provided object does not match the namespace sent on the request")
        if self._created_first is not None:
            self._store_deployment(self._created_first)
            self._created_first = None
        if name in self.deployments:
            raise _Failure(409, "AlreadyExists", f'deployments.apps "{name}" already exists')
        return web.json_response(self._store_deployment(body), status=201)

    def _store_deployment(self, deployment: Obj) -> Obj:
        """A new Deployment as the API server stores one (on the loop): the kubelet loop runs its pods from now on."""
        deployment = copy.deepcopy(deployment)
        deployment["metadata"].update({"namespace": self.namespace, "uid": str(uuid.uuid4()), "generation": 1, "creationTimestamp": _now()})
        deployment["metadata"].pop("resourceVersion", None)
        deployment["status"] = {"replicas": 0, "readyReplicas": 0}
        self.deployments[deployment["metadata"]["name"]] = deployment
        self._bump(deployment)
        return deployment

    async def _get_deployment(self, request: web.Request) -> web.Response:
        return web.json_response(self._deployment(request))

    async def _patch_deployment(self, request: web.Request) -> web.Response:
        deployment = self._deployment(request)
        patched = await self._patched(request, deployment)
        if patched["spec"]["template"] != deployment["spec"]["template"]:
            patched["metadata"]["generation"] += 1
        deployment.clear()
        deployment.update(patched)
        self._bump(deployment)
        return web.json_response(deployment)

    def _scale(self, deployment: Obj) -> Obj:
        meta = deployment["metadata"]
        selector = ",".join(f"{k}={v}" for k, v in deployment["spec"]["selector"]["matchLabels"].items())
        return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {"name": meta["name"], "namespace": meta["namespace"], "uid": meta["uid"], "resourceVersion": meta["resourceVersion"],
                             "creationTimestamp": meta["creationTimestamp"]},
                "spec": {"replicas": deployment["spec"]["replicas"]},
                "status": {"replicas": deployment["status"]["replicas"], "selector": selector}}

    async def _get_scale(self, request: web.Request) -> web.Response:
        return web.json_response(self._scale(self._deployment(request)))

    async def _patch_scale(self, request: web.Request) -> web.Response:
        deployment = self._deployment(request)
        if self._conflicts_left:
            self._conflicts_left -= 1
            deployment["metadata"].setdefault("annotations", {})["polymorph.test/other-writer"] = str(self.rv)
            self._bump(deployment)
        patched = await self._patched(request, self._scale(deployment))
        before, after = deployment["spec"]["replicas"], int(patched["spec"]["replicas"])
        deployment["spec"]["replicas"] = after
        self._bump(deployment)
        self.scale_log.append((deployment["metadata"]["name"], before, after))
        if self.on_scale is not None:
            self.on_scale(deployment["metadata"]["name"], before, after)
        return web.json_response(self._scale(deployment))

    async def _patched(self, request: web.Request, current: Obj) -> Obj:
        kind = request.content_type
        if kind not in ("application/strategic-merge-patch+json", "application/merge-patch+json"):
            raise _Failure(415, "UnsupportedMediaType", f"the test API server does not take {kind} patches")
        body = await request.json()
        wanted = (body.get("metadata") or {}).get("resourceVersion")
        if wanted is not None and wanted != current["metadata"]["resourceVersion"]:
            raise _Failure(409, "Conflict", f'Operation cannot be fulfilled on {current["metadata"]["name"]}: the object has been modified; '
                                            "please apply your changes to the latest version and try again")
        body.get("metadata", {}).pop("resourceVersion", None)
        return _merge(current, body, kind == "application/strategic-merge-patch+json")  # type: ignore[no-any-return]

    def _pod(self, request: web.Request) -> Obj:
        self._ns(request)
        found = self.pods.get(request.match_info["name"])
        if found is None:
            raise _Failure(404, "NotFound", f'pods "{request.match_info["name"]}" not found')
        return found

    async def _get_pod(self, request: web.Request) -> web.Response:
        return web.json_response(self._pod(request))

    async def _patch_pod(self, request: web.Request) -> web.Response:
        pod = self._pod(request)
        patched = await self._patched(request, pod)
        pod.clear()
        pod.update(patched)
        self._pod_event("MODIFIED", pod)
        return web.json_response(pod)

    def _lease_body(self, request: web.Request, body: Any, name: str) -> Obj:
        """The Lease a create or replace sends, checked as the API server decodes one."""
        if not isinstance(body, dict) or not isinstance(body.get("metadata"), dict):
            raise _Failure(400, "BadRequest", "the body is not a Lease")
        meta = body["metadata"]
        if meta.get("name") != name:
            raise _Failure(400, "BadRequest", f"the name of the object ({meta.get('name')}) does not match the name on the URL ({name})")
        if meta.get("namespace", self.namespace) != self.namespace:
            raise _Failure(400, "BadRequest", "the namespace of the provided object does not match the namespace sent on the request")
        spec = dict(body.get("spec") or {})
        for key in ("acquireTime", "renewTime"):
            value = spec.get(key)
            if value is None:
                continue
            if not isinstance(value, str) or not _MICRO_TIME.match(value):
                raise _Failure(400, "BadRequest", f'parsing time "{value}" as "2006-01-02T15:04:05.000000Z07:00": cannot parse')
            spec[key] = datetime.fromisoformat(value).astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": dict(meta, namespace=self.namespace), "spec": spec}

    async def _get_lease(self, request: web.Request) -> web.Response:
        self._ns(request)
        found = self.leases.get(request.match_info["name"])
        if found is None:
            raise _Failure(404, "NotFound", f'leases.coordination.k8s.io "{request.match_info["name"]}" not found')
        return web.json_response(found)

    async def _create_lease(self, request: web.Request) -> web.Response:
        self._ns(request)
        body = await request.json()
        name = str(((body or {}).get("metadata") or {}).get("name") or "")
        lease = self._lease_body(request, body, name)
        if not name:
            raise _Failure(422, "Invalid", "Lease.coordination.k8s.io is invalid: metadata.name: Required value: name or generateName is required")
        if name in self.leases:
            raise _Failure(409, "AlreadyExists", f'leases.coordination.k8s.io "{name}" already exists')
        lease["metadata"].update({"uid": str(uuid.uuid4()), "creationTimestamp": _now()})
        self.leases[name] = lease
        self._bump(lease)
        return web.json_response(lease, status=201)

    async def _replace_lease(self, request: web.Request) -> web.Response:
        self._ns(request)
        name = request.match_info["name"]
        lease = self._lease_body(request, await request.json(), name)
        current = self.leases.get(name)
        if current is None:
            raise _Failure(404, "NotFound", f'leases.coordination.k8s.io "{name}" not found')
        if self._lease_conflicts_left:
            self._lease_conflicts_left -= 1
            current["metadata"].setdefault("annotations", {})["polymorph.test/other-writer"] = str(self.rv)
            self._bump(current)
        wanted = lease["metadata"].get("resourceVersion")
        if not wanted:
            raise _Failure(422, "Invalid", f'Lease.coordination.k8s.io "{name}" is invalid: metadata.resourceVersion: Invalid value: 0x0: '
                                           "must be specified for an update")
        if wanted != current["metadata"]["resourceVersion"]:
            self.lease_conflicts += 1
            raise _Failure(409, "Conflict", f'Operation cannot be fulfilled on leases.coordination.k8s.io "{name}": the object has been modified; '
                                            "please apply your changes to the latest version and try again")
        lease["metadata"].update({"uid": current["metadata"]["uid"], "creationTimestamp": current["metadata"]["creationTimestamp"]})
        self.leases[name] = lease
        self._bump(lease)
        return web.json_response(lease)

    async def _list_pods(self, request: web.Request) -> web.StreamResponse:
        self._ns(request)
        selector = request.query.get("labelSelector")
        if request.query.get("watch") in ("true", "1"):
            return await self._watch(request, selector)
        items = [p for p in self.pods.values() if _selects(selector, p["metadata"]["labels"])]
        return web.json_response({"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": str(self.rv)}, "items": items})

    async def _watch(self, request: web.Request, selector: str | None) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        since = request.query.get("resourceVersion")
        bookmarks = request.query.get("allowWatchBookmarks") == "true"
        ends_at = time.monotonic() + float(request.query.get("timeoutSeconds", "1800"))

        async def send(kind: str, obj: Obj) -> None:
            await response.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")

        if since not in (None, "", "0") and int(since) < self.oldest_rv:
            await send("ERROR", {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "code": 410, "reason": "Expired",
                                 "message": f"too old resource version: {since} ({self.oldest_rv})"})
            return response
        queue: asyncio.Queue[tuple[str, Obj] | None] = asyncio.Queue()
        if since in (None, "", "0"):
            for pod in self.pods.values():
                queue.put_nowait(("ADDED", copy.deepcopy(pod)))
        else:
            for rv, kind, pod in self.history:
                if rv > int(since):
                    queue.put_nowait((kind, pod))
        self.watchers.add(queue)
        try:
            while True:
                left = ends_at - time.monotonic()
                if left <= 0:
                    break
                try:
                    item = await asyncio.wait_for(queue.get(), min(left, self.bookmark_s))
                except TimeoutError:
                    if bookmarks:
                        await send("BOOKMARK", {"kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": str(self.rv)}})
                    continue
                if item is None:  # compacted, or an outage: the stream ends
                    if request.transport is not None:
                        request.transport.abort()
                    break
                kind, pod = item
                if _selects(selector, pod["metadata"]["labels"]):
                    await send(kind, pod)
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            pass
        finally:
            self.watchers.discard(queue)
        return response

    def _end_watches(self) -> None:
        for queue in self.watchers:
            queue.put_nowait(None)

    # -- writes ------------------------------------------------------------------------------------

    def _bump(self, obj: Obj) -> None:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)

    def _pod_event(self, kind: str, pod: Obj) -> None:
        self._bump(pod)
        snapshot = copy.deepcopy(pod)
        self.history.append((self.rv, kind, snapshot))
        for queue in self.watchers:
            queue.put_nowait((kind, snapshot))

    # -- the kubelet and the ReplicaSet controller -------------------------------------------------

    async def _kubelet_loop(self) -> None:
        while True:
            await asyncio.sleep(_KUBELET_TICK_S)
            for deployment in list(self.deployments.values()):
                await self._sync(deployment)
            self._reap()

    def _owned(self, deployment: Obj) -> list[Obj]:
        return [p for p in self.pods.values() if p["metadata"]["labels"].get("polymorph.test/deployment") == deployment["metadata"]["name"]]

    async def _sync(self, deployment: Obj) -> None:
        current = _template_hash(deployment)
        pods = self._owned(deployment)
        for pod in pods:
            await self._probe(pod)
        live = [p for p in pods if "deletionTimestamp" not in p["metadata"]]
        new = [p for p in live if p["metadata"]["labels"]["pod-template-hash"] == current]
        old = [p for p in live if p not in new]
        want = deployment["spec"]["replicas"]
        ready = [p for p in live if self._ready(p)]
        rolled = all(self._ready(p) for p in new)  # a rolling update waits for its new pod before the next step
        if len(live) < want or (old and len(live) == want and rolled):
            self._create_pod(deployment, current)
        elif len(live) > want and (not old or rolled):
            self._delete_pod(min(live, key=lambda p: (
                int(p["metadata"].get("annotations", {}).get("controller.kubernetes.io/pod-deletion-cost", "0")),
                p["metadata"]["labels"]["pod-template-hash"] == current, self._ready(p), [-ord(c) for c in p["metadata"]["creationTimestamp"]])))
        status = {"replicas": len(live), "readyReplicas": len(ready), "observedGeneration": deployment["metadata"]["generation"]}
        if deployment["status"] != status:
            deployment["status"] = status
            self._bump(deployment)

    @staticmethod
    def _ready(pod: Obj) -> bool:
        return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))

    def _create_pod(self, deployment: Obj, template_hash: str) -> None:
        self._pod_serial += 1
        template = copy.deepcopy(deployment["spec"]["template"])
        name = f"{deployment['metadata']['name']}-{template_hash[:6]}-{self._pod_serial:04d}"
        port = free_port()
        container = template["spec"]["containers"][0]
        container["ports"] = [{"name": "http", "containerPort": port}]
        argv = [*_host_port_stripped([*container.get("command", []), *container.get("args", [])]), "--host", "127.0.0.1", "--port", str(port)]
        if argv[0] == "polymorph":  # the gateway image's CLI: this checkout's
            argv[:1] = POLYMORPH
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / f"{name}.log", "ab") as log:
            self.processes[name] = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        labels = {**template["metadata"]["labels"], "pod-template-hash": template_hash, "polymorph.test/deployment": deployment["metadata"]["name"]}
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": name, "namespace": self.namespace, "uid": str(uuid.uuid4()), "creationTimestamp": _now(), "labels": labels,
                            "annotations": dict(template["metadata"].get("annotations", {}))},
               "spec": template["spec"],
               "status": {"phase": "Running", "podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "False"}]}}
        self.pods[name] = pod
        self._pod_event("ADDED", pod)

    async def _probe(self, pod: Obj) -> None:
        name = pod["metadata"]["name"]
        process = self.processes.get(name)
        if self._ready(pod) or "deletionTimestamp" in pod["metadata"] or process is None:
            return
        if process.poll() is not None:
            if pod["status"]["phase"] != "Failed" and not pod["status"].get("containerStatuses"):
                pod["status"]["containerStatuses"] = [{"name": "engine", "image": "polymorph/emulated:test", "imageID": "", "ready": False,
                                                       "restartCount": 1, "state": {"waiting": {"reason": "CrashLoopBackOff",
                                                                                                "message": f"exited with {process.returncode}"}}}]
                self._pod_event("MODIFIED", pod)
            return
        port = pod["spec"]["containers"][0]["ports"][0]["containerPort"]
        assert self._http is not None
        try:
            async with self._http.get(f"http://127.0.0.1:{port}/health") as resp:
                ok = resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            ok = False
        if ok:
            pod["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
            self._pod_event("MODIFIED", pod)

    def _delete_pod(self, pod: Obj) -> None:
        name = pod["metadata"]["name"]
        pod["metadata"]["deletionTimestamp"] = _now()
        pod["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
        self._pod_event("MODIFIED", pod)
        process = self.processes.get(name)
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
        self.kill_at[name] = time.monotonic() + _KILL_AFTER_S

    def _reap(self) -> None:
        for name, kill_at in list(self.kill_at.items()):
            process = self.processes.get(name)
            if process is not None and process.poll() is None:
                if time.monotonic() >= kill_at:
                    process.kill()
                continue
            del self.kill_at[name]
            self.processes.pop(name, None)
            pod = self.pods.pop(name)
            self._pod_event("DELETED", pod)
