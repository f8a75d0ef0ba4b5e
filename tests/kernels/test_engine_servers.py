"""How llama-server and vLLM run a configuration where it leaves knobs unset (kernels.engine_servers); that
vLLM's own code picks the same batch limits is checked in its interpreter (tests/engines/test_launch.py)."""

from __future__ import annotations

from kernels.catalog import get_gpu, get_model
from kernels.config import EngineConfig
from kernels.engine_servers import LlamacppServer, VllmServer, engine_server, running_by_default


def test_llama_server_runs_four_slots_in_the_models_context_where_a_configuration_leaves_them_unset() -> None:
    server = LlamacppServer(max_context=2048)
    assert server.runs(EngineConfig()) == EngineConfig(max_running_requests=4, max_total_tokens=2048)
    mine = EngineConfig(max_running_requests=1, chunked_prefill_size=512)
    assert server.runs(mine) == EngineConfig(max_running_requests=1, chunked_prefill_size=512, max_total_tokens=2048)
    # its slots share one pool: 4 of 2,048 tokens hold 512-token requests at once, not 513-token ones
    assert server.holds(EngineConfig(), 512) and not server.holds(EngineConfig(), 513)
    assert server.holds(mine, 2048) and server.holds(EngineConfig(max_total_tokens=8192), 1200)


def test_llama_server_sized_for_a_request_length_names_the_most_slots_the_models_context_holds_at_once() -> None:
    server = LlamacppServer(max_context=2048)
    for tokens, slots in ((1182, 1), (1024, 2), (682, 3), (300, 6)):
        sized = server.sized_for(tokens)
        assert sized == EngineConfig(max_running_requests=slots)
        assert server.holds(sized, tokens) and not server.holds(EngineConfig(max_running_requests=slots + 1), tokens)
    assert server.sized_for(2049) is None  # not even one slot holds it


def test_vllm_runs_its_batch_limits_for_the_device_where_a_configuration_leaves_them_unset() -> None:
    def run(gpu: str | None, tp: int = 1) -> tuple[int | None, int | None, float | None]:
        found = VllmServer(None if gpu is None else get_gpu(gpu)).runs(EngineConfig(tp=tp))
        return found.max_running_requests, found.chunked_prefill_size, found.mem_fraction_static

    # 80 GB and up (but not an A100) 1,024 sequences; 160 GB and up 16,384 tokens a step; where sglang
    # would size its batch from the KV pool (2,048-4,096) and chunk 8,192 tokens on an A100
    assert [run(gpu) for gpu in ("H100-SXM", "H200", "B200", "A100-80GB", "L40S", None)] == [
        (1024, 8192, 0.92), (1024, 8192, 0.92), (1024, 16384, 0.92), (256, 2048, 0.92), (256, 2048, 0.92), (256, 2048, None)]
    # on CPU both scale with the workers; its KV space is an environment setting, not a memory fraction
    assert run("cpu") == (128, 2048, None) and run("cpu", tp=2) == (256, 4096, None)
    mine = EngineConfig(max_running_requests=8, chunked_prefill_size=512, mem_fraction_static=0.8)
    assert VllmServer(get_gpu("A100-80GB")).runs(mine) == mine
    # vLLM queues or preempts what its KV cannot hold yet and chunks long prompts: every configuration holds
    assert VllmServer(get_gpu("cpu")).holds(EngineConfig(), 1e6) and VllmServer(None).sized_for(4096) is None


def test_each_engine_kind_runs_its_own_default_batch() -> None:
    h100, tiny = get_gpu("H100-SXM"), get_model("tiny-llama")
    assert [running_by_default(kind, h100) for kind in ("llamacpp", "vllm", "sglang", "emulated")] == [4, 1024, None, None]
    assert running_by_default("vllm", get_gpu("cpu"), 2) == 256
    assert engine_server("llamacpp", h100, tiny) == LlamacppServer(tiny.max_context)
    assert engine_server("vllm", h100, tiny) == VllmServer(h100) and engine_server("sglang", h100, tiny) is None
