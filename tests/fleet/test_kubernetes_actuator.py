"""The Kubernetes actuator moves a replica between two pools' Deployments, through the official client.

The API server is tests/support/kube_api.py (real HTTP, resourceVersions, 409s, watches with bookmarks
and 410 Gone, the scale subresource), whose kubelet runs each pod as a real emulated replica. The
edge is a minimal LiveFleet (as tests/fleet/test_ray_actuator.py's ``_Routes``): it routes real
``openai`` SDK requests from client threads to the routable pods, drains, and applies the real
``OperatorMoves``' commands (the Mover, with its decision records and rollback) through the actuator.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest

kubernetes = pytest.importorskip("kubernetes", reason="the kubernetes client is not installed: pip install -e '.[kubernetes]' (make test installs it)")

from fleet.actuators.kubernetes import KubernetesActuator, api_client  # noqa: E402
from fleet.commands import apply  # noqa: E402
from fleet.decisions import Decision, Move  # noqa: E402
from fleet.engines.launch import EngineLaunch  # noqa: E402
from fleet.kubernetes_manifests import EnginePool, KubernetesSettings, container_argv, engine_deployment, pool_slug  # noqa: E402
from fleet.operator import OperatorMoves  # noqa: E402
from fleet.options import config_json  # noqa: E402
from fleet.rollout import Mover, SlotState  # noqa: E402
from kernels.config import EngineConfig  # noqa: E402
from tests.support.kube_api import KubeApi  # noqa: E402

MODEL = "llama-3.1-8b"
GPU = "H100-SXM"
CHAT, LONG = "chat@H100-SXM", "long@H100-SXM"
CHAT_CONFIG = config_json(EngineConfig())
LONG_CONFIG = config_json(EngineConfig(chunked_prefill_size=8192))
SPEED = 20.0


def _pool(name: str, config_json: str, replicas: int = 1) -> EnginePool:
    return EnginePool(name, MODEL, GPU, EngineConfig.from_dict(orjson.loads(config_json)), EngineLaunch("emulated"), replicas, SPEED)


def _render(pool: str, gpu: str, config_json: str) -> dict[str, Any]:
    return engine_deployment(_pool(pool, config_json, 0), KubernetesSettings())


@dataclass
class _Edge:
    """Routes, in-flight counts and drains, as the gateway's LiveFleet; the process half is the actuator's."""

    actuator: KubernetesActuator
    routable: dict[str, str] = field(default_factory=dict)  # slot -> url
    in_flight: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    served: int = 0
    failures: list[str] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)

    def drain(self, slot: str, now: float) -> None:
        with self.lock:
            self.routable.pop(slot, None)

    def stop(self, slot: str, now: float) -> None:
        with self.lock:
            self.routable.pop(slot, None)
        self.actuator.stop(slot, now)

    def start(self, slot: str, pool: str, config_json: str, now: float) -> None:
        self.actuator.start(slot, pool, config_json, now)

    def activate(self, slot: str, now: float) -> None:
        url = self.actuator.url(slot)
        assert url is not None
        with self.lock:
            self.routable[slot] = url

    def snapshot(self) -> list[SlotState]:
        with self.lock:
            return [dataclasses.replace(s, num_in_flight=self.in_flight.get(s.slot, 0)) for s in self.actuator.slot_states()]

    def _pick(self, i: int) -> tuple[str, str] | None:
        with self.lock:  # picked and counted at once: a drain never misses a request
            if not self.routable:
                return None
            slot = sorted(self.routable)[i % len(self.routable)]
            self.in_flight[slot] = self.in_flight.get(slot, 0) + 1
            return slot, self.routable[slot]

    def load(self, stop: threading.Event, worker: int) -> None:
        import openai

        i = worker
        while not stop.is_set():
            picked = self._pick(i)
            i += 1
            if picked is None:
                time.sleep(0.05)
                continue
            slot, url = picked
            try:
                with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30) as client:
                    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=40,
                                                           extra_body={"ignore_eos": True})
                assert reply.usage is not None and reply.usage.completion_tokens == 40
                with self.lock:
                    self.served += 1
            except Exception as exc:  # noqa: BLE001 (every lost request is reported, not raised in a thread)
                with self.lock:
                    self.failures.append(f"{slot} {url}: {exc!r}")
            finally:
                with self.lock:
                    self.in_flight[slot] -= 1


@dataclass
class _Cluster:
    api: KubeApi
    actuator: KubernetesActuator
    edge: _Edge


def _until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout_s} s")
        time.sleep(0.1)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[_Cluster]:
    """Two pools (chat: 2 pods, long: 1) as engine Deployments; the actuator adopted their pods as slots c0, c1, l0."""
    api = KubeApi(tmp_path / "pods")
    api.start()
    actuator: KubernetesActuator | None = None
    try:
        for pool, replicas, config in ((CHAT, 2, CHAT_CONFIG), (LONG, 1, LONG_CONFIG)):
            api.add_deployment(engine_deployment(_pool(pool, config, replicas), KubernetesSettings()))
        _until(lambda: sum(1 for p in api.snapshot()[1] if p["status"]["conditions"][0]["status"] == "True") == 3, 60, "3 pods ready")
        actuator = KubernetesActuator(api_client(str(api.write_kubeconfig(tmp_path / "kubeconfig"))), api.namespace, _render, reconcile_s=0.5)
        for slot, pool, config in (("c0", CHAT, CHAT_CONFIG), ("c1", CHAT, CHAT_CONFIG), ("l0", LONG, LONG_CONFIG)):
            actuator.add_slot(slot, GPU, pool, config)
            actuator.start(slot, pool, config, 0.0)
        _until(lambda: all(actuator.is_healthy(s, 0.0) for s in ("c0", "c1", "l0")), 30, "the pods adopted")
        edge = _Edge(actuator)
        for slot in ("c0", "c1", "l0"):
            edge.activate(slot, 0.0)
        yield _Cluster(api, actuator, edge)
    finally:
        if actuator is not None:
            actuator.close()
        api.close()


def _move_under_load(c: _Cluster, start_timeout_s: float = 60.0, limit_s: float = 60.0, to_pool: str = LONG,
                     to_config: str = LONG_CONFIG) -> dict[str, Any]:
    """Move c1 from chat to ``to_pool`` (long) under load; returns what happened."""
    stop = threading.Event()
    clients = [threading.Thread(target=c.edge.load, args=(stop, i), daemon=True) for i in range(4)]
    for thread in clients:
        thread.start()
    _until(lambda: c.edge.served >= 4, 30, "requests served before the move")
    before_pods = {p["metadata"]["name"] for p in c.api.snapshot()[1]}
    drained_pod = c.actuator.pod_of("c1")
    operator = OperatorMoves(drain_timeout_s=60.0, start_timeout_s=start_timeout_s)
    now = time.monotonic()
    out = operator.request(now, c.edge.snapshot(), "c1", to_pool, to_config)
    apply(out.commands, c.edge, now)
    c.edge.decisions.extend(out.decisions)
    deadline = time.monotonic() + limit_s
    while operator.busy and time.monotonic() < deadline:
        time.sleep(0.1)
        now = time.monotonic()
        out = operator.tick(now, c.edge.snapshot())
        apply(out.commands, c.edge, now)
        c.edge.decisions.extend(out.decisions)
    _until(lambda: not c.api.down and c.actuator.converged(), 30, "the actuator converged")
    served_before_stop = c.edge.served
    _until(lambda: c.edge.served >= served_before_stop + 4, 30, "requests served after the move")
    stop.set()
    for thread in clients:
        thread.join(60)
    replicas, pods = c.api.snapshot()
    return {"busy": operator.busy, "before_pods": before_pods, "drained_pod": drained_pod, "replicas": replicas, "pods": pods,
            "kinds": [d.kind for d in c.edge.decisions], "decisions": [d.to_json() for d in c.edge.decisions]}


def _assert_whole(c: _Cluster, seen: dict[str, Any], c1_pool: str) -> None:
    """Never half-done: replica counts sum to the running slots, every pod is a slot's and runs its Deployment's config, 0 requests lost."""
    assert not seen["busy"], f"the move did not finish: {seen['decisions']}"
    assert c.edge.failures == []
    states = {s.slot: s for s in c.actuator.slot_states()}
    assert all(s.alive and s.healthy for s in states.values()), (states, seen["decisions"])
    assert states["c1"].pool == c1_pool
    counts = {CHAT: sum(1 for s in states.values() if s.pool == CHAT), LONG: sum(1 for s in states.values() if s.pool == LONG)}
    assert seen["replicas"] == {"polymorph-engine-chat-h100-sxm": counts[CHAT], "polymorph-engine-long-h100-sxm": counts[LONG]}
    live = [p for p in seen["pods"] if "deletionTimestamp" not in p["metadata"]]
    assert sorted(p["metadata"]["name"] for p in live) == sorted(c.actuator.pod_of(s) or "" for s in states)
    hashes = c.api.template_hashes()
    for slot, state in states.items():  # no pod runs a stale template
        pod = next(p for p in live if p["metadata"]["name"] == c.actuator.pod_of(slot))
        assert pod["metadata"]["labels"]["pod-template-hash"] == hashes[f"polymorph-engine-{pool_slug(state.pool)}"]
        assert pod["metadata"]["labels"]["polymorph.dev/pool"] == pool_slug(state.pool)
    assert c.actuator.stats().num_template_writes == 0


def test_a_move_under_load_scales_down_only_the_drained_pod_and_loses_no_request(cluster: _Cluster) -> None:
    seen = _move_under_load(cluster)
    _assert_whole(cluster, seen, LONG)
    assert seen["kinds"] == ["step", "verify"]
    assert cluster.api.scale_log == [("polymorph-engine-chat-h100-sxm", 2, 1), ("polymorph-engine-long-h100-sxm", 1, 2)]
    gone = seen["before_pods"] - {p["metadata"]["name"] for p in seen["pods"]}
    assert gone == {seen["drained_pod"]}  # exactly the drained pod left, no other
    assert cluster.edge.served > 8
    stats = cluster.actuator.stats()
    assert stats.num_conflicts == 0 and stats.num_scale_writes == 2 and stats.num_cost_writes == 1


def test_a_409_conflict_on_the_scale_call_is_read_again_and_the_move_completes(cluster: _Cluster) -> None:
    cluster.api.conflict_next_scale(times=3)
    seen = _move_under_load(cluster)
    _assert_whole(cluster, seen, LONG)
    assert seen["kinds"] == ["step", "verify"]
    assert cluster.actuator.stats().num_conflicts == 3
    assert cluster.api.scale_log == [("polymorph-engine-chat-h100-sxm", 2, 1), ("polymorph-engine-long-h100-sxm", 1, 2)]


def test_a_watch_dropped_with_410_gone_mid_move_is_listed_afresh_and_the_move_completes(cluster: _Cluster) -> None:
    # the watch ends as the new pod is asked for: it is created and becomes Ready while no watch runs
    cluster.api.on_scale = lambda deployment, before, after: cluster.api._compact() if after > before else None
    seen = _move_under_load(cluster)
    _assert_whole(cluster, seen, LONG)
    assert seen["kinds"] == ["step", "verify"]
    assert cluster.actuator.stats().num_relists >= 1


def test_a_30_s_api_outage_mid_move_rolls_the_move_back_whole(cluster: _Cluster) -> None:
    # The API server goes away right after the scale-down: the scale-up cannot go out for 30 s, past the move's start
    # deadline (29 s), so the move fails; its rollback (the same deadline) has the pool's count raised back once the
    # server answers, and is restored when the new pod is Ready.
    cluster.api.on_scale = lambda deployment, before, after: cluster.api.outage(30.0) if after < before and not cluster.api.refused else None
    seen = _move_under_load(cluster, start_timeout_s=29.0, limit_s=90.0)
    _assert_whole(cluster, seen, CHAT)
    rollbacks = [d["evidence"] for d in seen["decisions"] if d["kind"] == "rollback"]
    assert seen["kinds"] == ["step", "rollback", "rollback"] and rollbacks[-1]["outcome"] == "restored", seen["decisions"]
    assert cluster.api.refused > 0 and cluster.actuator.stats().num_transient_errors > 0
    # the long pool never ran a second pod; chat went down by one (the drained pod) and back up by one
    assert ("polymorph-engine-long-h100-sxm", 1, 2) not in cluster.api.scale_log
    assert cluster.api.scale_log == [("polymorph-engine-chat-h100-sxm", 2, 1), ("polymorph-engine-chat-h100-sxm", 1, 2)]


def test_a_configuration_change_rolls_the_pools_deployment_and_the_slot_takes_the_new_pod(cluster: _Cluster) -> None:
    """An in-place recompile of l0 (pool long, one pod): drained, then the Deployment's template is patched
    (container command and config annotation); the rolling update brings a pod of the new configuration,
    which becomes l0; the chat pool is untouched and no request is lost."""
    new_config = config_json(EngineConfig(chunked_prefill_size=4096))
    stop = threading.Event()
    clients = [threading.Thread(target=cluster.edge.load, args=(stop, i), daemon=True) for i in range(4)]
    for thread in clients:
        thread.start()
    _until(lambda: cluster.edge.served >= 4, 30, "requests served before the change")
    old_pod = cluster.actuator.pod_of("l0")
    now = time.monotonic()
    mover = Mover((Move("l0", LONG, LONG, new_config),), now, drain_timeout_s=60.0, start_timeout_s=60.0)
    deadline = now + 90.0
    while not mover.done and time.monotonic() < deadline:
        now = time.monotonic()
        apply(mover.advance(now, {s.slot: s for s in cluster.edge.snapshot()}), cluster.edge, now)
        time.sleep(0.1)
    _until(cluster.actuator.converged, 30, "the actuator converged")
    served = cluster.edge.served
    _until(lambda: cluster.edge.served >= served + 4, 30, "requests served after the change")
    stop.set()
    for thread in clients:
        thread.join(60)
    replicas, pods = cluster.api.snapshot()

    assert mover.done and not mover.failed and cluster.edge.failures == []
    state = cluster.actuator.slot_state("l0")
    assert state is not None and state.pool == LONG and state.config_json == new_config and state.healthy
    new_pod = cluster.actuator.pod_of("l0")
    assert new_pod != old_pod
    pod = next(p for p in pods if p["metadata"]["name"] == new_pod)
    assert pod["metadata"]["labels"]["pod-template-hash"] == cluster.api.template_hashes()["polymorph-engine-long-h100-sxm"]
    assert pod["spec"]["containers"][0]["command"] == container_argv(_pool(LONG, new_config))
    assert replicas == {"polymorph-engine-chat-h100-sxm": 2, "polymorph-engine-long-h100-sxm": 1}
    assert cluster.actuator.stats().num_template_writes == 1 and cluster.actuator.stats().num_scale_writes == 0


def test_a_move_into_a_pool_without_a_deployment_creates_it_and_loses_no_request(cluster: _Cluster) -> None:
    """The controller's own pool (``<shape>@<gpu>``) has no Deployment: the Start creates one as the manifests
    render it (0 replicas, then scaled to 1 like any pool), c1's pod leaves chat and c1 serves in the new pool."""
    short, short_config = "short-chat@H100-SXM", config_json(EngineConfig(chunked_prefill_size=2048))
    assert short not in cluster.actuator.pools
    seen = _move_under_load(cluster, to_pool=short, to_config=short_config)

    assert not seen["busy"] and seen["kinds"] == ["step", "verify"], seen["decisions"]
    assert cluster.edge.failures == [] and cluster.edge.served > 8
    created = cluster.api.call(lambda: dict(cluster.api.deployments["polymorph-engine-short-chat-h100-sxm"]))
    labels = {"app.kubernetes.io/name": "polymorph-engine", "app.kubernetes.io/part-of": "polymorph", "polymorph.dev/pool": "short-chat-h100-sxm"}
    assert created["metadata"]["labels"] == labels and created["spec"]["selector"]["matchLabels"] == labels
    assert created["spec"]["template"]["metadata"]["labels"] == labels
    assert created["metadata"]["annotations"] == {"polymorph.dev/pool-name": short, "polymorph.dev/config-json": short_config}
    assert created["spec"]["template"]["spec"]["containers"][0]["command"] == container_argv(_pool(short, short_config))
    assert seen["replicas"] == {"polymorph-engine-chat-h100-sxm": 1, "polymorph-engine-long-h100-sxm": 1, "polymorph-engine-short-chat-h100-sxm": 1}
    assert cluster.api.scale_log == [("polymorph-engine-chat-h100-sxm", 2, 1), ("polymorph-engine-short-chat-h100-sxm", 0, 1)]
    gone = seen["before_pods"] - {p["metadata"]["name"] for p in seen["pods"]}
    assert gone == {seen["drained_pod"]}  # exactly the drained pod left chat, no other
    state = cluster.actuator.slot_state("c1")
    assert state is not None and state.pool == short and state.config_json == short_config and state.healthy
    pod = next(p for p in seen["pods"] if p["metadata"]["name"] == cluster.actuator.pod_of("c1"))
    assert pod["metadata"]["labels"]["polymorph.dev/pool"] == "short-chat-h100-sxm" and "deletionTimestamp" not in pod["metadata"]
    assert cluster.actuator.argv("c1") == tuple(container_argv(_pool(short, short_config)))
    assert "c1" in cluster.edge.routable  # the Mover activated it: the requests after the move were served there too
    stats = cluster.actuator.stats()
    assert stats.num_deployment_creates == 1 and stats.num_template_writes == 0 and stats.num_scale_writes == 2


def test_a_deployment_another_writer_created_first_409_already_exists_is_used(cluster: _Cluster) -> None:
    """The create meets 409 AlreadyExists (another controller made the pool's Deployment between our list and our
    create): the actuator reads that one, scales it up, and the move completes."""
    short, short_config = "short-chat@H100-SXM", config_json(EngineConfig(chunked_prefill_size=2048))
    cluster.api.create_before_next_create(_render(short, GPU, short_config))
    seen = _move_under_load(cluster, to_pool=short, to_config=short_config)

    assert not seen["busy"] and seen["kinds"] == ["step", "verify"], seen["decisions"]
    assert cluster.edge.failures == []
    assert seen["replicas"] == {"polymorph-engine-chat-h100-sxm": 1, "polymorph-engine-long-h100-sxm": 1, "polymorph-engine-short-chat-h100-sxm": 1}
    assert cluster.api.scale_log == [("polymorph-engine-chat-h100-sxm", 2, 1), ("polymorph-engine-short-chat-h100-sxm", 0, 1)]
    state = cluster.actuator.slot_state("c1")
    assert state is not None and state.pool == short and state.healthy
    assert cluster.actuator.stats().num_deployment_creates == 0  # its create was refused: it used the other writer's


@pytest.mark.skipif(not (os.environ.get("KUBECONFIG") and os.environ.get("POLYMORPH_KUBE_E2E") == "1"),
                    reason="against a real cluster only: set KUBECONFIG and POLYMORPH_KUBE_E2E=1 (engine Deployments from polymorph deploy kubernetes)")
def test_against_a_real_cluster_moves_one_replica_and_back() -> None:
    """Opt-in: the pools' engine Deployments already run (``polymorph deploy kubernetes`` applied) in
    ``POLYMORPH_KUBE_NAMESPACE`` (default polymorph) with at least one Ready pod in the first pool (by name) and
    room for one more pod of the second; moves one pod there and back, each drain-first."""
    namespace = os.environ.get("POLYMORPH_KUBE_NAMESPACE", "polymorph")
    actuator = KubernetesActuator(api_client(os.environ["KUBECONFIG"]), namespace, _render)
    try:
        pools = sorted(actuator.pools.values(), key=lambda p: p.name)
        assert len(pools) >= 2, f"two engine Deployments wanted in {namespace}, found {[p.name for p in pools]}"
        first, second = pools[0], pools[1]
        actuator.add_slot("e2e", GPU, first.name, first.config_json)
        actuator.start("e2e", first.name, first.config_json, 0.0)
        _until(lambda: actuator.is_healthy("e2e", 0.0), 600, f"a pod of {first.name} adopted")
        for to_pool, back in ((second, first), (first, second)):
            actuator.stop("e2e", 0.0)
            actuator.start("e2e", to_pool.name, to_pool.config_json, 0.0)
            _until(lambda: actuator.is_healthy("e2e", 0.0), 900, f"a pod of {to_pool.name} ready")
            assert back.name != to_pool.name
        _until(actuator.converged, 300, "the Deployments scaled")
    finally:
        actuator.close()
