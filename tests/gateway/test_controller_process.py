"""`polymorph controller` beside two gateway processes: kill -9 it mid-rollout, a standby takes over
and finishes the rollout without repeating an applied move, a restarted controller adopts the fleet;
or stop it mid-rollout (the gateways cannot reach it) and let it go on. Traffic through both gateways
never fails while it happens (the `controller-*` scenarios of `polymorph bench chaos`)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import signal
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from fleet.controller_state import ControllerState, LoopState, MoveRecord, RolloutRecord, SlotRecord, resumed_phase
from fleet.decisions import Move
from fleet.multi import ModelTelemetry
from fleet.planner import Plan
from fleet.rebalance import Transfer
from fleet.restart_hold import Restart
from fleet.telemetry import PoolSlo, ShapeLoad, TrafficMix
from fleet.telemetry_batch import TelemetryBatch, parse, replay
from gateway.controller_service import _pid_alive
from gateway.plan_client import plan_restarts
from loadtest.chaos.controller_faults import CONTROLLER_SCENARIOS, ExternalControllerDeployment
from loadtest.chaos.fleet_faults import GPU, FleetFaultSettings
from loadtest.chaos.hostile import send_raw
from loadtest.chaos.stack import wait_until


@pytest.mark.parametrize("name", sorted(CONTROLLER_SCENARIOS))
def test_controller_killed_or_partitioned_mid_rollout_repeats_no_move_and_fails_no_request(tmp_path: Path, name: str) -> None:
    """controller-dies: kill -9 mid-rollout, a standby finishes it, a restarted controller serves the same plan;
    controller-partitioned: SIGSTOP mid-rollout, then SIGCONT; controller-moves-the-only-replica: the gateways
    hold the model's requests while its only replica restarts. The checks are the scenario's (loadtest/chaos)."""
    result = asyncio.run(CONTROLLER_SCENARIOS[name](tmp_path, FleetFaultSettings(rate_rps=20.0, max_s=90.0)))
    assert result.passed, result.failures()
    assert result.sent > 0 and result.succeeded == result.sent and result.figures["moves_repeated"] == 0


def test_a_replica_that_dies_under_the_controller_leaves_the_budget_it_plans(tmp_path: Path) -> None:
    """As in the gateway's own fleet: the slot's process is gone, so a ``capacity`` decision takes its GPU out."""
    with ExternalControllerDeployment(tmp_path / "run", num_replicas=2) as deployment:
        deployment.wait_leading(deployment.start_controller("controller"))

        def slots() -> list[dict[str, Any]]:
            return list(json.loads(deployment.state_file.read_text())["slots"]) if deployment.state_file.exists() else []

        def capacity() -> list[dict[str, Any]]:
            lines = deployment.decision_log.read_text().splitlines() if deployment.decision_log.exists() else []
            return [entry["evidence"] for entry in map(json.loads, lines) if entry["kind"] == "capacity"]

        wait_until("both replicas to serve", lambda: [s["phase"] for s in slots()] == ["active", "active"], 60)
        victim = slots()[0]
        os.kill(victim["pid"], signal.SIGKILL)
        wait_until("a capacity decision", lambda: bool(capacity()), 30)
        with urllib.request.urlopen(deployment.url + "/metrics", timeout=5) as resp:
            metrics = resp.read().decode()  # the controller's decisions as Prometheus counters, by kind
    assert capacity()[0]["lost"] == [victim["slot"]] and capacity()[0]["budget"] == {GPU: 1}
    assert 'polymorph_fleet_decisions_total{kind="capacity"} 1.0' in metrics, metrics


def test_a_report_body_its_content_encoding_does_not_decode_gets_a_400_and_one_log_line(tmp_path: Path) -> None:
    """Before: the 400, then aiohttp met the error again as it drained the body and logged three tracebacks; and a
    request aiohttp's parser refuses got its text/plain 400."""
    with ExternalControllerDeployment(tmp_path / "run", num_replicas=1) as deployment:
        controller = deployment.start_controller("controller")
        deployment.wait_leading(controller)
        request = urllib.request.Request(deployment.url + "/report", data=b"not compressed", method="POST",
                                         headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(request, timeout=5)
        body = json.loads(info.value.read())
        info.value.close()
        assert (info.value.code, body["error"]["code"]) == (400, "invalid_report")
        # a request the parser refuses gets the envelope too, not aiohttp's text/plain
        answer = asyncio.run(send_raw(int(deployment.url.rsplit(":", 1)[1]), b"POST /report HTTP/1.1\r\nHost: c\r\nContent-Length: -2\r\n\r\n"))
        assert answer is not None and (answer.status, json.loads(answer.body)["error"]["code"]) == (400, "malformed_http")
        wait_until("the drain's log line", lambda: "did not decode (answered 400)" in deployment.log("controller"), 5)
        assert "rejected malformed HTTP request: BadHttpMessage" in deployment.log("controller")
        assert "Traceback" not in deployment.log("controller") and controller.poll() is None
        with urllib.request.urlopen(urllib.request.Request(deployment.url + "/healthz", method="HEAD"), timeout=5) as head:
            assert (head.status, head.read()) == (200, b"")  # as GET, without the body (RFC 9110); it was 405


def test_a_batched_report_replays_into_each_models_window_as_direct_records() -> None:
    models = ("llama", "qwen")
    direct, replayed, batch = ModelTelemetry(models), ModelTelemetry(models), TelemetryBatch()
    for i in range(300):
        now = 1000.0 + i * 0.4
        prompt, output = 200 + (i * 37) % 900, 20 + (i * 13) % 300
        model = models[i % 7 == 0]  # qwen's traffic is a seventh of llama's, and differs
        for sink in (direct, batch):
            sink.record_arrival(now, "short-chat" if i % 3 else "long-context", "interactive" if i % 4 else "batch", prompt, model)
            sink.record_outcome(now, "short-chat", "mixed", i % 5 != 0, output, model, prompt // 2, prompt)
        batch.record_arrival(now, "short-chat", "batch", prompt, "a-model-no-controller-plans")  # dropped on replay
    replay(parse(json.loads(json.dumps(batch.take()))), replayed, 1200.0)
    windows = [(direct.of(m).window(1200.0), replayed.of(m).window(1200.0)) for m in models]
    for a, b in windows:
        assert a.to_json() == b.to_json() and a.goodput_rps() == b.goodput_rps()
    assert windows[0][1].to_json() != windows[1][1].to_json()  # each model's controller sees its own traffic
    assert 0.3 < replayed.of("llama").window(1200.0).shape("short-chat").prefix_share < 0.95  # type: ignore[union-attr]
    earlier = parse({"bucket_s": 5, "outcomes": [[1, "m", "s", "p", True, 2, 50]]})  # a gateway of an earlier version: none cached
    assert earlier.outcomes == ((1, "m", "s", "p", True, 2, 50, 0, 0),)
    for bad in ({"bucket_s": 0}, {"bucket_s": 5, "arrivals": [[1, "m", "s", "t", 0, 5]]}, {"bucket_s": 5, "outcomes": [[1, "m", "s", "p", 1, 1, 5]]},
                {"bucket_s": 5, "arrivals": [[1, "s", "t", 1, 5]]}, {"bucket_s": 5, "arrivals": [[1, 7, "s", "t", 1, 5]]}, []):
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
    loop = LoopState(mix, 5.0, -math.inf, 0, 1, 0, rollout, refine_at=125.0)
    state = ControllerState("e1", 4, tuple(dataclasses.replace(s, model="m") for s in slots), (("m", loop), ("q", dataclasses.replace(loop, rollout=None))),
                            rebalanced_at=90.0, lent=Transfer("H100-SXM/0", "H100-SXM", "q", "m", "q-chat"))
    assert ControllerState.from_json(json.loads(json.dumps(state.to_json()))) == state
    never = dataclasses.replace(state, rebalanced_at=-math.inf, lent=None)  # no transfer yet
    assert ControllerState.from_json(json.loads(json.dumps(never.to_json()))) == never
    # format 1, written when the controller planned one model (and before refines existed): its one loop, model ""
    doc = state.to_json()
    older = {**{k: v for k, v in doc["model_to_loop"]["m"].items() if k != "refine_at"}, "format": 1, "epoch": "e1", "plan_version": 4,
             "slots": [{k: v for k, v in s.items() if k != "model"} for s in doc["slots"]]}
    assert ControllerState.from_json(older) == ControllerState("e1", 4, slots, (("", dataclasses.replace(loop, refine_at=None)),))
    with pytest.raises(ValueError, match="format"):
        ControllerState.from_json({**doc, "format": 3})
    for not_an_object in ([], None):  # before: an AttributeError traceback from `polymorph controller`
        with pytest.raises(ValueError, match="a controller state is a JSON object"):
            ControllerState.from_json(not_an_object)  # type: ignore[arg-type]
    # the controller died after starting the new replica but before recording the move's phase
    assert resumed_phase(rollout.progress[0], slots[0]) == "starting"
    assert resumed_phase(rollout.progress[0], dataclasses.replace(slots[0], phase="active")) == "done"
    assert resumed_phase(rollout.progress[0], slots[1]) == "draining"


def test_the_plan_names_its_draining_and_starting_replicas_as_the_restarts_a_gateway_holds_for() -> None:
    """External mode: the controller's plan document lists the replicas out of service for a move that brings
    them back, so a gateway holds a model's requests while none of its replicas is routable (as embedded)."""
    doc = {"epoch": "e", "version": 7, "starting": [{"name": "H100-SXM/1", "pool": "long", "model": "m"}],
           "pools": [{"name": "chat", "model": "m", "gpu": "H100-SXM", "config_json": "{}",
                      "replicas": [{"name": "H100-SXM/0", "url": "http://127.0.0.1:1", "draining": True}]}]}
    assert plan_restarts(doc) == [Restart("H100-SXM/0", "chat", "m"), Restart("H100-SXM/1", "long", "m")]
    assert plan_restarts({**doc, "starting": [], "pools": [{**doc["pools"][0], "replicas": [{**doc["pools"][0]["replicas"][0], "draining": False}]}]}) == []  # type: ignore[index,dict-item]


def test_an_adopted_replica_that_is_a_zombie_is_not_alive() -> None:
    """An adopted replica is not the controller's child; under a subreaper it stays a zombie until that reaps
    it. Before, signal 0 found the zombie, and its GPU stayed in the budget."""
    process = subprocess.Popen(["true"])
    try:
        wait_until("the zombie", lambda: Path(f"/proc/{process.pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z", 5)
        assert not _pid_alive(process.pid)
    finally:
        process.wait()
    assert not _pid_alive(process.pid)
    assert _pid_alive(os.getpid())
