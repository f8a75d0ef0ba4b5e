"""A pool the controller makes on a llama.cpp fleet runs llama-server (gateway.replicas launches it with the
first declared pool's engine on its GPU kind), so the controller judges its configurations as llama-server
runs them and the router counts the slots llama-server gives it, not sglang's."""

from __future__ import annotations

from pathlib import Path

from gateway.config import load_config
from gateway.live_fleet import controller_settings, new_pool
from gateway.replicas import made_pool_llamacpp
from kernels.catalog.models import get_model
from kernels.config import LlamacppServer
from tests.gateway.test_lora import BASE, _config, _pool

REPO = Path(__file__).resolve().parents[2]


def test_a_pool_made_on_a_llamacpp_fleet_is_judged_and_routed_as_llama_server_runs_it(tmp_path: Path) -> None:
    config = load_config(REPO / "examples" / "cpu-llamacpp.yaml")
    server = LlamacppServer(get_model("tiny-llama").max_context)
    assert controller_settings(config, "tiny-llama", {"cpu": 4}).made_llamacpp == {"cpu": server}
    assert made_pool_llamacpp(config, "short-chat@cpu", "cpu") == server
    # an engine configuration that leaves the slots unset: llama-server's 4, where sglang's default is 256
    pool = new_pool("long-context@cpu", "tiny-llama", "cpu", "{}", (), made_pool_llamacpp(config, "long-context@cpu", "cpu"))
    assert pool.max_running_per_replica == 4
    assert new_pool("long-context@cpu", "tiny-llama", "cpu", '{"max_running_requests": 1}', (), server).max_running_per_replica == 1

    emulated = load_config(_config(tmp_path, [_pool("plain")]))
    assert controller_settings(emulated, BASE, {"H100-SXM": 2}).made_llamacpp == {}
    assert new_pool("long-context@H100-SXM", BASE, "H100-SXM", "{}").max_running_per_replica == 256
