"""`polymorph controller` launches real engines: each slot runs its pool's engine command line on its own share of
`fleet.devices`, keeps those devices in the state file, and a new leader relaunches a dead replica on them."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.conftest import free_port
from tests.gateway.test_compile_pool import SGLANG_STANDIN
from tests.support.procs import start, write_tenant


def _pool(name: str, weights: Path, launch: int, shapes: list[str]) -> dict[str, Any]:
    return {"name": name, "model": "tiny-llama", "gpu": "H100-SXM", "shapes": shapes, "replicas": {"launch": launch},
            "engine": {"kind": "sglang", "command": f"{sys.executable} {SGLANG_STANDIN}", "model_path": str(weights)}}


def _num_requests(url: str) -> float:
    """The requests the replica's engine finished (sglang's counter, which the stand-in's emulator exports)."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        lines = resp.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("sglang:num_requests_total"))


def _starts(record: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []


def test_the_external_controller_starts_each_engine_on_its_devices_and_relaunches_a_dead_one_there(tmp_path: Path) -> None:
    """sglang cannot run here: the pools' interpreter is the stand-in that serves the emulator and records the
    command line and CUDA_VISIBLE_DEVICES it was given (tests/support/sglang_standin.py)."""
    (tmp_path / "tenants").mkdir()
    write_tenant(tmp_path / "tenants", "ops", "sk-ops")
    weights = tmp_path / "weights"
    weights.mkdir()
    port = free_port()
    config = {"tenants_dir": "tenants", "fleet": {
        "devices": {"H100-SXM": {"ids": [4, 7, 2, 5]}},
        "pools": [_pool("chat-h100", weights, 2, ["short-chat"]), _pool("long-h100", weights, 1, ["long-context"])],
        "controller": {"enabled": True, "mode": "external", "url": f"http://127.0.0.1:{port}", "decision_log": "decisions.jsonl"}}}
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(config))
    record = tmp_path / "standin.jsonl"
    env = {"STANDIN_MODEL": "tiny-llama", "STANDIN_GPU": "H100-SXM", "STANDIN_RECORD": str(record)}
    argv = ["controller", "--config", str(path), "--replica-logs", str(tmp_path / "replicas"), "--stop-replicas-on-exit"]
    state_file = tmp_path / "decisions.state.json"
    controller = start(argv, port, tmp_path / "controller.log", "/healthz", timeout_s=120.0, env=env)
    try:
        first = {s["slot"]: s for s in json.loads(state_file.read_text())["slots"]}
        started = _starts(record)
        warmed = [_num_requests(s["url"]) for s in first.values()]  # before any gateway: the warm-up request
        long_slot = next(s for s in first.values() if s["pool"] == "long-h100")
        controller.kill()  # its replicas outlive it; then the long pool's replica dies too
        os.kill(long_slot["pid"], signal.SIGKILL)
        controller = start(argv, port, tmp_path / "controller-2.log", "/healthz", timeout_s=120.0, env=env)
        deadline = time.monotonic() + 60
        while len(_starts(record)) < 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        again = _starts(record)
        second = {s["slot"]: s for s in json.loads(state_file.read_text())["slots"]}
    finally:
        controller.stop()
        for slot in json.loads(state_file.read_text())["slots"] if state_file.exists() else ():
            if slot["pid"]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(slot["pid"], signal.SIGKILL)
    # fleet.devices in the config's order: the chat replicas hold 4 and 7, the long one 2; 5 stays free
    assert sorted((s["pool"], s["devices"]) for s in first.values()) == [
        ("chat-h100", ["4"]), ("chat-h100", ["7"]), ("long-h100", ["2"])], first
    assert sorted(s["cuda_visible_devices"] for s in started) == ["2", "4", "7"], started
    assert warmed == [1.0, 1.0, 1.0], warmed  # each real engine answered one request before it was routable
    assert all(s["argv"][s["argv"].index("--model-path") + 1] == str(weights) for s in started)  # sglang's own command line
    # the new leader relaunched the dead replica on its slot's device, and only that one
    assert len(again) == 4 and again[3]["cuda_visible_devices"] == "2", again
    assert second[long_slot["slot"]]["devices"] == ["2"] and second[long_slot["slot"]]["pid"] != long_slot["pid"]
    assert "is gone; starting it again" in (tmp_path / "controller-2.log").read_text()
