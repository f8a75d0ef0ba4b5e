"""The Ray actuator starts, moves and stops replicas on a local Ray cluster (8 logical GPUs), and starts
again on another port a replica whose port another process took before it listened.

Ray runs in a child process: its ``ray.init`` starts a cluster (GCS, raylet, workers) that must not
share pytest's process or warnings filter, and inside a network namespace holding only loopback when
this machine allows one (else Ray is told to stay on 127.0.0.1 and not to report usage). The child
(this module run as ``python -m``) applies the real ``Mover``'s commands through the actuator to real emulated
replicas and the real ``openai`` SDK, and prints what it saw as one JSON line; the test judges it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from loadtest.bench.peers_setup import netns_argv
from tests.conftest import REPO

pytestmark = pytest.mark.xdist_group("ray")  # one local Ray cluster at a time: the Ray tests keep to one xdist worker

MODEL = "llama-3.1-8b"
CHAT = '{"tp": 1}'
LONG_TP2 = '{"chunked_prefill_size": 8192, "tp": 2}'
DRAIN_TOKENS = 400  # ~3 s of decode on an emulated H100 at speed 1: the move must wait for it


def test_ray_actuator_starts_moves_and_stops_replicas_on_a_local_ray_cluster(tmp_path: Path) -> None:
    pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[ray]' (make test installs it)")
    argv = [sys.executable, "-m", "tests.fleet.test_ray_actuator", str(tmp_path)]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0", "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(netns_argv(argv) or argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=240, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and lines, f"scenario failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    seen = json.loads(lines[-1])

    # started: three replicas (one tp=2) hold 4 of the 8 GPUs and answer /health and a chat
    assert seen["gpus_free_after_start"] == 4
    assert seen["health"] == {"s0": 200, "s1": 200, "s2": 200}
    assert all(reply["tokens"] == 5 and reply["text"] for reply in seen["chat"].values())
    assert len(seen["gpu_ids"]["s2"]) == 2

    # moved: s1 waited for its request in flight, then restarted at tp=2 in another pool
    move = seen["move"]
    assert move["drain_request"] == {"finish_reason": "length", "tokens": DRAIN_TOKENS}
    assert move["routable_while_draining"] is False and move["kept_running_while_in_flight"] is True
    assert move["old_url_refused"] is True and move["new_url"] != move["old_url"]
    assert move["pool_after"] == "long@H100-SXM" and move["chat_after"]["tokens"] == 5
    assert len(move["gpu_ids_after"]) == 2 and move["gpus_free_after"] == 3

    # stopped: every GPU back, no group, no actor, no replica process left
    assert seen["gpus_free_after_stop"] == 8
    assert seen["groups_left"] == [] and seen["actors_left"] == []
    assert seen["replica_processes_left"] == []

    # a start whose port another process took before it listened came up on another port
    assert seen["port_lost"] == {"healthy": True, "error": None, "moved": True, "health": 200}, seen["port_lost"]


# --- the scenario, in the child process ----------------------------------------------------------


class _Routes:
    """A minimal edge, as the gateway's LiveFleet: owns which slot is routable where and its requests in
    flight, applies the Mover's commands (the process half through the Ray actuator), takes snapshots."""

    def __init__(self) -> None:
        self.routable: dict[str, tuple[str, str]] = {}  # slot -> (url, pool)
        self.in_flight: dict[str, int] = {}
        self.lock = threading.Lock()
        self.actuator: Any = None

    def drain(self, slot: str, now: float) -> None:
        self.routable.pop(slot, None)

    def stop(self, slot: str, now: float) -> None:
        self.actuator.stop(slot, now)
        self.routable.pop(slot, None)

    def start(self, slot: str, pool: str, config_json: str, now: float) -> None:
        self.actuator.start(slot, pool, config_json, now)

    def activate(self, slot: str, now: float) -> None:
        found = next(s for s in self.actuator.slot_states() if s.slot == slot)
        self.routable[slot] = (self.actuator.url(slot), found.pool)

    def snapshot(self) -> dict[str, Any]:
        import dataclasses

        return {s.slot: dataclasses.replace(s, num_in_flight=self.num_in_flight(s.slot)) for s in self.actuator.slot_states()}

    def num_in_flight(self, slot: str) -> int:
        with self.lock:
            return self.in_flight.get(slot, 0)

    def chat(self, slot: str, max_tokens: int) -> dict[str, Any]:
        import openai

        url = self.routable[slot][0]
        with self.lock:
            self.in_flight[slot] = self.in_flight.get(slot, 0) + 1
        try:
            with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
                reply = client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=max_tokens, extra_body={"ignore_eos": True},
                )
        finally:
            with self.lock:
                self.in_flight[slot] -= 1
        assert reply.usage is not None
        return {"text": reply.choices[0].message.content, "tokens": reply.usage.completion_tokens, "finish_reason": reply.choices[0].finish_reason}


def _status(url: str) -> int | str:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/health", timeout=2.0) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        exc.close()
        return exc.code
    except (urllib.error.URLError, OSError) as exc:
        return f"refused: {exc}"


def _until(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout_s} s")
        time.sleep(0.1)


def _replica_processes(ports: set[int]) -> list[str]:
    """Emulated replicas of this scenario (by port) still running on this host."""
    left = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        words = [w.decode(errors="replace") for w in argv]
        if "emulate" in words and "--port" in words and int(words[words.index("--port") + 1]) in ports:
            left.append(" ".join(words))
    return left


def _scenario(log_dir: Path) -> dict[str, Any]:
    import ray
    from ray.util import placement_group_table

    from fleet.actuators.local import LaunchSpec, emulated_replica_argv
    from fleet.actuators.ray import RayActuator
    from fleet.commands import apply
    from fleet.decisions import Move
    from fleet.rollout import Mover

    ray.init(num_gpus=8, num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", object_store_memory=100 * 1024 * 1024,
             log_to_driver=False, configure_logging=False)
    command = (sys.executable, "-m", "gateway.cli", "emulate")
    routes = _Routes()
    actuator = RayActuator(lambda gpu, pool, config, devices: LaunchSpec("", emulated_replica_argv(command, MODEL, gpu, config, 1.0)), log_dir)
    routes.actuator = actuator
    seen: dict[str, Any] = {}
    try:
        for slot, gpu, pool, config in [("s0", "H100-SXM", "chat@H100-SXM", CHAT), ("s1", "H100-SXM", "chat@H100-SXM", CHAT),
                                        ("s2", "H200", "long@H200", LONG_TP2)]:
            actuator.add_slot(slot, gpu, pool, config)
            actuator.start(slot, pool, config, 0.0)
        _until(lambda: all(actuator.is_healthy(s, 0.0) for s in actuator.slots), 90, "replicas healthy")
        for slot in actuator.slots:
            routes.activate(slot, 0.0)
        seen["gpus_free_after_start"] = ray.available_resources().get("GPU", 0)
        seen["health"] = {slot: _status(url) for slot, (url, _) in routes.routable.items()}
        seen["chat"] = {slot: routes.chat(slot, 5) for slot in routes.routable}
        seen["gpu_ids"] = {slot: actuator.gpu_ids(slot) for slot in actuator.slots}
        ports = {int(url.rsplit(":", 1)[1]) for url, _ in routes.routable.values()}

        old_url = routes.routable["s1"][0]
        drain_result: dict[str, Any] = {}
        request = threading.Thread(target=lambda: drain_result.update(routes.chat("s1", DRAIN_TOKENS)))
        request.start()
        _until(lambda: routes.num_in_flight("s1") == 1, 10, "request in flight")
        mover = Mover((Move("s1", "chat@H100-SXM", "long@H100-SXM", LONG_TP2),), 0.0)
        apply(mover.advance(0.0, routes.snapshot()), routes, 0.0)  # the drain
        move: dict[str, Any] = {"routable_while_draining": "s1" in routes.routable, "kept_running_while_in_flight": True}
        while request.is_alive():
            now = time.monotonic()
            apply(mover.advance(now, routes.snapshot()), routes, now)
            if routes.num_in_flight("s1") and actuator.url("s1") != old_url:
                move["kept_running_while_in_flight"] = False
            time.sleep(0.05)
        request.join()
        move["drain_request"] = {k: drain_result.get(k) for k in ("finish_reason", "tokens")}
        deadline = time.monotonic() + 90
        while not mover.done and time.monotonic() < deadline:
            now = time.monotonic()
            apply(mover.advance(now, routes.snapshot()), routes, now)
            time.sleep(0.1)
        assert mover.done, f"move not done: {actuator.error('s1')}"
        move["old_url"], move["new_url"] = old_url, routes.routable["s1"][0]
        move["old_url_refused"] = str(_status(old_url)).startswith("refused")
        move["pool_after"] = routes.routable["s1"][1]
        move["chat_after"] = routes.chat("s1", 5)
        move["gpu_ids_after"] = actuator.gpu_ids("s1")
        move["gpus_free_after"] = ray.available_resources().get("GPU", 0)
        seen["move"] = move
        ports.add(int(move["new_url"].rsplit(":", 1)[1]))

        # another process takes a starting replica's port before it listens (the emulator spends a second
        # importing): it starts again on another port instead of failing
        actuator.add_slot("s3", "H100-SXM", "chat@H100-SXM", CHAT)
        actuator.start("s3", "chat@H100-SXM", CHAT, 0.0)
        replica = actuator.slots["s3"].replica
        taken = int(ray.get(replica.url_ref, timeout=60).rsplit(":", 1)[1])
        with socket.socket() as squatter:
            squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            squatter.bind(("127.0.0.1", taken))
            squatter.listen()
            _until(lambda: actuator.is_healthy("s3", 0.0) or actuator.error("s3") is not None, 90, "s3 healthy or failed")
            url = actuator.url("s3")
            seen["port_lost"] = {"healthy": actuator.is_healthy("s3", 0.0), "error": actuator.error("s3"),
                                 "moved": url is not None and int(url.rsplit(":", 1)[1]) != taken,
                                 "health": _status(url) if url is not None else None}
            if url is not None:
                ports.add(int(url.rsplit(":", 1)[1]))
    finally:
        actuator.close()
    _until(lambda: ray.available_resources().get("GPU", 0) == 8, 30, "GPUs released")
    seen["gpus_free_after_stop"] = ray.available_resources().get("GPU", 0)
    seen["groups_left"] = [g["name"] for g in placement_group_table().values() if g["state"] != "REMOVED"]
    seen["actors_left"] = [a["Name"] for a in ray._private.state.actors().values() if a["State"] != "DEAD"]
    seen["replica_processes_left"] = _replica_processes(ports)
    ray.shutdown()
    return seen


if __name__ == "__main__":
    print(json.dumps(_scenario(Path(sys.argv[1]))), flush=True)
