"""`polymorph controller` beside two gateway processes: kill -9 it mid-rollout, a standby takes over
and finishes the rollout without repeating an applied move, a restarted controller adopts the fleet,
and traffic through both gateways never fails while it happens."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Self

import aiohttp
import pytest

from fleet.controller_state import ControllerState, MoveRecord, RolloutRecord, SlotRecord, resumed_phase
from fleet.decisions import Move
from fleet.planner import Plan
from fleet.telemetry import PoolSlo, ShapeLoad, Telemetry, TrafficMix
from fleet.telemetry_batch import TelemetryBatch, parse, replay
from tests.conftest import REPO, free_port
from tests.support.procs import POLYMORPH, Proc, start_gateway, wait_http, write_tenant

KEY = "sk-test-controller"
SPEED = 20.0
NEW_POOL = "short-chat@H100-SXM"


def _get(url: str) -> dict[str, object]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())  # type: ignore[no-any-return]


def _wait(what: str, check: Callable[[], bool], timeout_s: float = 40.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise TimeoutError(f"timed out waiting for {what}")


def _controller(tmp: Path, config: Path, name: str, url: str) -> Proc:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    argv = [*POLYMORPH, "controller", "--config", str(config), "--replica-logs", str(tmp / "replicas"), "--stop-replicas-on-exit"]
    with open(tmp / f"{name}.log", "wb") as log:
        process = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    return Proc(process, url, tmp / f"{name}.log")


class Traffic:
    """Requests alternating between the gateways until stopped; every status is kept."""

    def __init__(self, urls: list[str], rate_rps: float) -> None:
        self.urls, self.rate_rps = urls, rate_rps
        self.statuses: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()))

    async def _run(self) -> None:
        body = {"model": "llama-3.1-8b", "messages": [{"role": "user", "content": "Say hello to the team, briefly."}], "max_tokens": 32, "ignore_eos": True}

        async def one(session: aiohttp.ClientSession, url: str) -> None:
            try:
                async with session.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}) as resp:
                    await resp.read()
                    self.statuses.append(resp.status)
            except aiohttp.ClientError:
                self.statuses.append(-1)

        async with aiohttp.ClientSession() as session:
            tasks, i = [], 0
            while not self._stop.is_set():
                tasks.append(asyncio.create_task(one(session, self.urls[i % len(self.urls)])))
                i += 1
                await asyncio.sleep(1 / self.rate_rps)
            await asyncio.gather(*tasks)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)


def _decisions(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _new_pool_urls(plan: dict[str, object]) -> list[str]:
    pools = {p["name"]: p for p in plan["pools"]}  # type: ignore[index, union-attr]
    return [r["url"] for r in pools.get(NEW_POOL, {"replicas": []})["replicas"] if not r["draining"]]  # type: ignore[index]


def test_controller_crash_standby_takeover_and_restart(tmp_path: Path) -> None:
    (tmp_path / "tenants").mkdir()
    write_tenant(tmp_path / "tenants", "ctl", KEY, max_concurrency=1000, rate_limits={"requests_per_min": 1_000_000})
    url = f"http://127.0.0.1:{free_port()}"
    config = {
        "server": {"admin_token": "admin-token-ctl", "access_log": False},
        "tenants_dir": "tenants",
        "fleet": {
            "pools": [{"name": "mixed", "model": "llama-3.1-8b", "gpu": "H100-SXM", "shapes": ["short-chat"], "replicas": {"emulated": 2}}],
            "emulator_speed": SPEED,
            "controller": {"enabled": True, "mode": "external", "url": url, "tick_s": 5.0, "decision_log": "decisions.jsonl"},
        },
    }
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(config))
    log, state_file = tmp_path / "decisions.jsonl", tmp_path / "decisions.state.json"
    leader = _controller(tmp_path, path, "controller-a", url)
    procs = [leader]
    try:
        wait_http(url + "/healthz", 60, leader.process)
        standby = _controller(tmp_path, path, "controller-b", url)
        procs.append(standby)
        _wait("the standby to wait for the lease", lambda: "standby" in standby.log())
        gateways = [start_gateway(tmp_path, ["--config", str(path)], name=f"gateway-{i}") for i in range(2)]
        procs += gateways
        for gateway in gateways:
            wait_http(gateway.url + "/readyz")
        with Traffic([g.url for g in gateways], rate_rps=20.0) as traffic:
            # the first step of the rollout is applied: one replica routable in the new pool
            _wait("the first step", lambda: len(_new_pool_urls(_get(url + "/plan"))) == 1, timeout_s=60)
            moved = _new_pool_urls(_get(url + "/plan"))
            leader.kill()
            wait_http(url + "/healthz", 60, standby.process)
            assert "rollout in progress" in standby.log()
            _wait("the rollout to finish", lambda: len(_new_pool_urls(_get(url + "/plan"))) == 2, timeout_s=60)
            plan = _get(url + "/plan")
            assert set(moved) <= set(_new_pool_urls(plan)), "the replica moved before the crash was moved again"
            _wait("the last verification", lambda: _decisions(log)[-1]["kind"] == "verify")
            standby.kill()
            restarted = _controller(tmp_path, path, "controller-c", url)
            procs.append(restarted)
            wait_http(url + "/healthz", 60, restarted.process)
            again = _get(url + "/plan")
            time.sleep(1.0)  # traffic on through the gateways, routed by the restarted controller
        assert (again["epoch"], again["version"], again["pools"]) == (plan["epoch"], plan["version"], plan["pools"])
        assert traffic.statuses and set(traffic.statuses) == {200}, f"{len(traffic.statuses)} requests: {sorted(set(traffic.statuses))}"
        decisions = _decisions(log)
        kinds = [d["kind"] for d in decisions]
        assert kinds.count("plan") == 1 and "rollback" not in kinds, kinds
        steps = [tuple(m[0] for m in d["evidence"]["moves"]) for d in decisions if d["kind"] == "step"]  # type: ignore[index]
        slots = [slot for step in steps for slot in step]
        assert len(steps) == 2 and len(slots) == len(set(slots)) == 2, steps
        assert any("unreachable" in g.log() for g in gateways)
    finally:
        state = json.loads(state_file.read_text()) if state_file.exists() else {"slots": []}
        for proc in reversed(procs):
            proc.stop()
        for slot in state["slots"]:
            if slot["pid"]:
                try:
                    os.kill(slot["pid"], signal.SIGKILL)
                except ProcessLookupError:
                    pass


def test_a_batched_report_replays_into_the_same_window_as_direct_records() -> None:
    direct, replayed, batch = Telemetry(), Telemetry(), TelemetryBatch()
    for i in range(300):
        now = 1000.0 + i * 0.4
        prompt, output = 200 + (i * 37) % 900, 20 + (i * 13) % 300
        for sink in (direct, batch):
            sink.record_arrival(now, "short-chat" if i % 3 else "long-context", "interactive" if i % 4 else "batch", prompt)
            sink.record_outcome(now, "short-chat", "mixed", i % 5 != 0, output)
    replay(parse(json.loads(json.dumps(batch.take()))), replayed, 1200.0)
    a, b = direct.window(1200.0), replayed.window(1200.0)
    assert a.to_json() == b.to_json() and a.goodput_rps() == b.goodput_rps()
    for bad in ({"bucket_s": 0}, {"bucket_s": 5, "arrivals": [[1, "s", "t", 0, 5]]}, {"bucket_s": 5, "outcomes": [[1, "s", "p", 1, 1, 5]]}, []):
        with pytest.raises((ValueError, TypeError)):
            parse(bad)


def test_controller_state_round_trips_and_resumes_a_started_move_without_restarting_it() -> None:
    move = Move("H100-SXM/0", "mixed", "short-chat@H100-SXM", '{"chunked_prefill_size":2048}')
    slots = (SlotRecord("H100-SXM/0", move.to_pool, "H100-SXM", move.config_json, "starting", "http://127.0.0.1:1", 42, 3),
             SlotRecord("H100-SXM/1", "mixed", "H100-SXM", "{}", "active", "http://127.0.0.1:2", 43))
    mix = TrafficMix(10.0, 120.0, (ShapeLoad("short-chat", 1.5, 300.0, 80.0, (("interactive", 1.0),), (100, 200), (50, 90)),),
                     (PoolSlo("mixed", 10, 9),))
    rollout = RolloutRecord(Plan((("short-chat@H100-SXM", 2),), 1.4, -3.0), ((Move("H100-SXM/1", "mixed", move.to_pool, "{}"),),),
                            (move,), (MoveRecord(move, "draining", 5.0),), None, 1.2, True, (("H100-SXM/0", "{}"),), False)
    state = ControllerState("e1", 4, slots, mix, 5.0, -math.inf, 0, 1, 0, rollout)
    assert ControllerState.from_json(json.loads(json.dumps(state.to_json()))) == state
    # the controller died after starting the new replica but before recording the move's phase
    assert resumed_phase(rollout.progress[0], slots[0]) == "starting"
    assert resumed_phase(rollout.progress[0], dataclasses.replace(slots[0], phase="active")) == "done"
    assert resumed_phase(rollout.progress[0], slots[1]) == "draining"
