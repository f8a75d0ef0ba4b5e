"""No blackout while a model's only replica restarts: its requests wait for it (gateway.restart_waits).

A move of the only replica serving a model (``POST /admin/move`` into another pool of the model) leaves
no routable replica while it drains, stops and starts. Continuous requests through the openai SDK
meanwhile all succeed: they are held and routed to the replica once it is back. With a hold shorter
than the restart they get a clean 503 ``replica_restarting`` with ``Retry-After`` instead.
"""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.gateway.test_admin_move import KEY, _config, _move_and_watch
from tests.gateway.test_config import _error_for
from tests.support.procs import start_gateway

MODEL = "llama-3.1-8b"


def _pools(engine: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One replica serving the model, and an empty pool of the same model it moves into (another configuration)."""
    return [
        {"name": "chat", "model": MODEL, "gpu": "H100-SXM", "shapes": ["short-chat"],
         "engine": {"max_running_requests": 64, **(engine or {})}, "replicas": {"emulated": 1}},
        {"name": "chat-next", "model": MODEL, "gpu": "H100-SXM", "shapes": ["short-chat"],
         "engine": {"max_running_requests": 32, **(engine or {})}, "replicas": {"launch": 0}},
    ]


def _holds(url: str) -> dict[str, float]:
    """``polymorph_restart_holds_total`` by outcome, from the gateway's /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for match in re.finditer(r'^polymorph_restart_holds_total\{[^}]*outcome="(\w+)"[^}]*\} (\S+)$', text, re.M):
        out[match[1]] = out.get(match[1], 0.0) + float(match[2])
    return out


def test_requests_wait_for_the_only_replica_of_their_model_while_it_restarts(tmp_path: Path) -> None:
    gateway = start_gateway(tmp_path, ["--config", str(_config(tmp_path, _pools(), emulator_speed=20.0))])
    try:
        load, decisions = _move_and_watch(gateway, "chat-0", "chat-next", MODEL, 16, 60)
        holds = _holds(gateway.url)
    finally:
        gateway.stop()
    assert [d["kind"] for d in decisions] == ["step", "verify"]
    assert load.failed == [] and load.ok > 8
    assert load.replicas == {"chat-0"}
    # the requests that came while no replica served the model were held, then served: none timed out
    assert holds.get("released", 0) > 0 and holds.get("deadline", 0) == 0, holds


@pytest.mark.slow
def test_requests_wait_for_the_only_real_llamacpp_replica_of_their_model_while_it_restarts(
        tmp_path: Path, llama_server_bin: Path, tiny_gguf: Path) -> None:
    """The same with a real llama-server: it stops, starts with ``--parallel 2`` on its CPU slot, warms up, and serves again."""
    llama = {"kind": "llamacpp", "threads": 1}
    pools = [
        {"name": "chat-cpu", "model": "tiny-llama", "gpu": "cpu", "shapes": ["short-chat"],
         "engine": {**llama, "max_running_requests": 4}, "replicas": {"launch": 1}},
        {"name": "chat-cpu-next", "model": "tiny-llama", "gpu": "cpu", "shapes": ["short-chat"],
         "engine": {**llama, "max_running_requests": 2}, "replicas": {"launch": 0}},
    ]
    config = _config(tmp_path, pools, devices={"cpu": {"count": 1}})
    gateway = start_gateway(tmp_path, ["--config", str(config), "--replica-logs", str(tmp_path / "replicas")], timeout_s=180)
    try:
        load, decisions = _move_and_watch(gateway, "chat-cpu-0", "chat-cpu-next", "tiny-llama", 8, 120)
        holds = _holds(gateway.url)
    finally:
        gateway.stop()
    assert [d["kind"] for d in decisions] == ["step", "verify"]
    assert load.failed == [] and load.ok > 8
    assert holds.get("released", 0) > 0 and holds.get("deadline", 0) == 0, holds


def test_a_hold_shorter_than_the_restart_ends_in_a_clean_503_with_retry_after(tmp_path: Path) -> None:
    config = _config(tmp_path, _pools())
    config.write_text(config.read_text().replace('"server":', '"upstream": {"restart_hold_s": 0.05}, "server":', 1))
    gateway = start_gateway(tmp_path, ["--config", str(config)])
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=KEY, max_retries=0, timeout=30)
    try:
        load, _ = _move_and_watch(gateway, "chat-0", "chat-next", MODEL, 16, 60)
        holds = _holds(gateway.url)
        after = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    finally:
        client.close()
        gateway.stop()
    assert load.errors, "no request came while the replica restarted"
    assert holds.get("deadline", 0) == len(load.errors), holds  # each failure is a hold that ran out
    for error in load.errors:
        assert isinstance(error, openai.APIStatusError) and error.status_code == 503, load.failed
        assert float(error.response.headers["retry-after"]) > 0
        body = error.response.json()["error"]
        assert body["code"] == "replica_restarting" and body["type"] == "service_unavailable" and "restarting" in body["message"]
    assert after.choices[0].message.content  # and once it is back, it serves


@pytest.mark.parametrize(("old", "new", "field"), [
    ("restart_hold_s: 30.0", "restart_hold_s: -1", "upstream.restart_hold_s"),
    ("urgent_window_s: 30.0", "urgent_window_s: soon", "router.urgent_window_s"),
])
def test_a_bad_hold_or_urgent_window_names_its_field_and_line(tmp_path: Path, old: str, new: str, field: str) -> None:
    err = _error_for(tmp_path, old, new)
    assert err.field == field and err.line is not None and err.file.endswith("config.yaml")
