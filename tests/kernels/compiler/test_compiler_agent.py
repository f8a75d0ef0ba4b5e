"""The agent proposer against a real OpenAI-compatible HTTP server on loopback with scripted replies."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator

import pytest
from aiohttp import web

from kernels.catalog import get_gpu, get_model
from kernels.compiler import AgentProposer, compile_config
from kernels.compiler.evaluators import AnalyticEvaluator, Metrics
from kernels.compiler.gates import check_constraints, check_memory
from kernels.compiler.proposers import LLM_URL_ENV, parse_candidates
from kernels.compiler.shape import get_shape
from kernels.compiler.space import default_space, in_space
from kernels.config import EngineConfig
from tests.conftest import free_port

MODEL, GPU, SHAPE = get_model("llama-3.1-8b"), get_gpu("H100"), get_shape("reasoning")


VALID = {"kv_cache_dtype": "fp8_e4m3", "schedule_policy": "lpm", "max_prefill_tokens": 32768}


def _reply(content: str) -> web.Response:
    return web.json_response({"id": "x", "object": "chat.completion", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}]})


SCRIPT = [
    lambda: _reply("I think you should raise max_running_requests {"),  # malformed JSON
    lambda: web.Response(status=500, text="overloaded"),
    lambda: _reply(json.dumps({"candidates": [
        {"tp": 1, "dp": 2},  # two GPUs on a one-GPU replica
        {"max_running_requests": 32},  # CUDA graphs above the batch cap
        {"mem_fraction_static": 0.99},  # outside the space (and no headroom)
        {"max_running_requests": 100},  # outside the space
    ]})),
    lambda: _reply(json.dumps({"candidates": [
        {"bogus_key": 1},  # not an EngineConfig
        "raise the batch",  # not an object
        {"disable_cuda_graph": True},  # a knob the search does not turn
        VALID,
    ]})),
    lambda: _reply("```json\n" + json.dumps({"candidates": [VALID]}) + "\n```"),  # a repeat
]


@pytest.fixture
def llm_server() -> Iterator[tuple[str, list[dict[str, object]]]]:
    requests: list[dict[str, object]] = []

    async def completions(request: web.Request) -> web.Response:
        requests.append(await request.json())
        step = SCRIPT[min(len(requests), len(SCRIPT)) - 1]
        return step() if len(requests) <= len(SCRIPT) else _reply(json.dumps({"candidates": []}))

    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    runner = web.AppRunner(app)
    port = free_port()
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}/v1", requests
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


class _Recording(AnalyticEvaluator):
    def __init__(self) -> None:
        self.configs: list[EngineConfig] = []

    def evaluate(self, model, gpu, config, shape) -> Metrics:
        self.configs.append(config)
        return super().evaluate(model, gpu, config, shape)


def test_agent_proposals_cannot_bypass_a_gate(llm_server) -> None:
    url, requests = llm_server
    evaluator = _Recording()
    result = compile_config(MODEL, GPU, 1, SHAPE, proposer=AgentProposer(url, "scripted", api_key="k", timeout_s=10),
                            evaluator=evaluator)
    assert result is not None
    space = default_space(MODEL, GPU, 1)
    for config in evaluator.configs:  # everything evaluated passed every gate
        assert in_space(space, config) is None
        assert not check_constraints(MODEL, GPU, 1, config).rejected and not check_memory(MODEL, GPU, config, SHAPE).rejected
    agent_trials = [t for t in result.history if t.proposer == "agent"]
    rejected = [g.reason for t in agent_trials if t.metrics is None for g in t.gates if g.rejected]
    assert len(rejected) == 7
    assert any("must equal the replica's 1 GPUs" in r for r in rejected)
    assert any("cuda_graph_max_bs 256 exceeds max_running_requests 32" in r for r in rejected)
    assert any("outside the search space" in r for r in rejected)
    assert any("disable_cuda_graph is not searched" in r for r in rejected)
    assert sum(1 for r in rejected if r.startswith("not an EngineConfig")) == 2
    assert [t.config for t in agent_trials if t.metrics is not None] == [EngineConfig.from_dict(VALID)]
    # The malformed and failed rounds fell back to the deterministic proposer and said so.
    notes = [t.note for t in result.history if t.proposer == "coordinate"]
    assert any("agent reply is not JSON" in n for n in notes) and any("HTTP 500" in n for n in notes)
    assert [n.split(";")[0] for n in result.proposer_notes] == [
        "agent unavailable (agent reply is not JSON: Expecting value at 0)", f"agent unavailable (HTTP 500 from {url}/chat/completions)"]
    first = json.loads(requests[0]["messages"][1]["content"])
    assert first["bottleneck"] in ("memory-bound", "compute-bound", "kv-capacity", "queueing")
    assert first["shape"]["name"] == "reasoning" and first["trials"][0]["config"] == {"tp": 1}
    assert requests[0]["model"] == "scripted"


def test_no_endpoint_means_the_deterministic_proposer(monkeypatch) -> None:
    monkeypatch.delenv(LLM_URL_ENV, raising=False)
    assert AgentProposer.from_environment() is None
    monkeypatch.setenv(LLM_URL_ENV, "http://127.0.0.1:9/v1")
    assert AgentProposer.from_environment().url == "http://127.0.0.1:9/v1/chat/completions"


def test_compile_says_when_the_configured_agent_never_answered(monkeypatch, capsys) -> None:
    """Before, `polymorph compile` with $POLYMORPH_COMPILER_LLM_URL on a dead endpoint printed a result
    as if the agent had proposed; only the trial store's notes said otherwise."""
    from gateway.cli import build_parser

    monkeypatch.setenv(LLM_URL_ENV, f"http://127.0.0.1:{free_port()}/v1")
    args = build_parser().parse_args(["compile", "--model", "llama-3.1-8b", "--gpu", "H100", "--shape", "short-chat",
                                      "--budget", "3", "--no-store", "--evaluator", "analytic"])
    assert args.handler(args) == 0
    err = capsys.readouterr().err
    assert "warning: 1 proposer round(s) fell back" in err and "Connection refused" in err and "coordinate proposer used" in err


def test_parse_candidates_accepts_fenced_json_and_rejects_the_rest() -> None:
    assert parse_candidates('```json\n{"candidates": [{"tp": 1}]}\n```') == [{"tp": 1}]
    with pytest.raises(ValueError, match="no 'candidates' list"):
        parse_candidates('{"configs": []}')
