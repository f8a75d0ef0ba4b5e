"""A pool the controller makes runs the engine gateway.replicas launches it with (the first declared pool's on
its GPU kind): the controller judges its configurations as that engine runs them, the router counts the slots
it gives, and the gateway reads its /metrics and sends priorities as that engine's. A declared pool whose
configuration leaves its batch unset counts as saturated at what its engine runs on its device."""

from __future__ import annotations

from pathlib import Path

from gateway.config import load_config
from gateway.live_fleet import controller_settings, new_pool
from gateway.replicas import made_pool_engine, pool_engine
from gateway.runtime import build_runtime, max_running_per_replica
from kernels.catalog import get_gpu
from kernels.catalog.models import get_model
from kernels.config import EngineConfig
from kernels.engine_servers import LlamacppServer, VllmServer
from tests.gateway.test_lora import BASE, _config, _pool

REPO = Path(__file__).resolve().parents[2]


def test_a_pool_made_on_a_real_engine_fleet_is_judged_routed_and_read_as_its_engine(tmp_path: Path) -> None:
    config = load_config(REPO / "examples" / "cpu-llamacpp.yaml")
    assert controller_settings(config, "tiny-llama", {"cpu": 4}).made_engines == {"cpu": LlamacppServer(get_model("tiny-llama").max_context)}
    engine = made_pool_engine(config, "long-context@cpu", "cpu")
    # what the actuators launch and the external controller reads: a declared pool's own engine, a made pool's that one
    assert [getattr(pool_engine(config, name, gpu), "name", None) for name, gpu in (("long-cpu", "cpu"), ("long-context@cpu", "cpu"),
                                                                                     ("long-context@H100-SXM", "H100-SXM"))] == [
        "long-cpu", "chat-cpu", None]
    assert engine == pool_engine(config, "long-context@cpu", "cpu")
    # an engine configuration that leaves the slots unset: llama-server's 4, where the gateway's mark for sglang is 256
    pool = new_pool("long-context@cpu", "tiny-llama", "cpu", "{}", engine)
    assert (pool.max_running_per_replica, pool.engine_kind, pool.priority_scheduling) == (4, "llamacpp", False)
    assert new_pool("long-context@cpu", "tiny-llama", "cpu", '{"max_running_requests": 1}', engine).max_running_per_replica == 1
    # a declared pool is counted the same way (gateway.runtime); vLLM runs its sequences for the device
    assert [max_running_per_replica(EngineConfig(max_running_requests=value), kind, gpu) for value, kind, gpu in (
        (None, "llamacpp", "cpu"), (None, "vllm", "cpu"), (None, "vllm", "H100-SXM"), (None, "sglang", "H100-SXM"), (2, "llamacpp", "cpu"))] == [
        4, 128, 1024, 256, 2]

    vllm = load_config(REPO / "examples" / "cpu-vllm.yaml")
    assert controller_settings(vllm, "tiny-llama", {"cpu": 2}).made_engines == {"cpu": VllmServer(get_gpu("cpu"))}
    made = new_pool("long-context@cpu", "tiny-llama", "cpu", '{"schedule_policy": "priority"}', made_pool_engine(vllm, "long-context@cpu", "cpu"))
    assert (made.max_running_per_replica, made.engine_kind, made.priority_scheduling) == (128, "vllm", True)  # vLLM's CPU api_server runs 128 sequences

    emulated = load_config(_config(tmp_path, [_pool("plain")]))
    assert controller_settings(emulated, BASE, {"H100-SXM": 2}).made_engines == {}
    assert new_pool("long-context@H100-SXM", BASE, "H100-SXM", "{}", made_pool_engine(emulated, "long-context@H100-SXM", "H100-SXM")).engine_kind == "emulated"


def test_a_declared_pool_counts_as_saturated_at_what_its_engine_runs_on_its_device(tmp_path: Path) -> None:
    urls = {"urls": ["http://127.0.0.1:9"]}
    pools: list[dict[str, object]] = [{"name": "vllm-h100", "model": "tiny-llama", "gpu": "H100-SXM", "engine": {"kind": "vllm"}, "replicas": urls},
             {"name": "vllm-a100", "model": "tiny-llama", "gpu": "A100-80GB", "engine": {"kind": "vllm"}, "replicas": urls},
             {"name": "vllm-somewhere", "model": "tiny-llama", "engine": {"kind": "vllm"}, "replicas": urls},  # a device vLLM cannot read
             {"name": "vllm-cpu", "model": "tiny-llama", "gpu": "cpu", "engine": {"kind": "vllm", "tp": 2}, "replicas": urls},
             {"name": "llama", "model": "tiny-llama", "gpu": "cpu", "engine": {"kind": "llamacpp"}, "replicas": urls},
             {"name": "sglang", "model": "tiny-llama", "gpu": "H100-SXM", "engine": {"kind": "sglang"}, "replicas": urls},
             {"name": "capped", "model": "tiny-llama", "gpu": "H100-SXM", "engine": {"kind": "vllm", "max_running_requests": 8}, "replicas": urls}]
    runtime = build_runtime(load_config(_config(tmp_path, pools)), {}, None, 0.0)
    assert {pool.name: pool.max_running_per_replica for pool in runtime.pools} == {
        "vllm-h100": 1024, "vllm-a100": 256, "vllm-somewhere": 256, "vllm-cpu": 256, "llama": 4, "sglang": 256, "capped": 8}
