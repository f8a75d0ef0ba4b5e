import pytest

from kernels.catalog import get_gpu, get_model
from kernels.compiler import Budget, TrialStore, compile_config
from kernels.compiler.evaluators import AnalyticEvaluator
from kernels.compiler.gates import ParserGate, check_constraints, check_memory, sglang_model_path
from kernels.compiler.proposers import Proposal, ProposalBatch, SearchContext
from kernels.compiler.shape import get_shape
from kernels.config import EngineConfig

LLAMA_8B, LLAMA_70B, H100 = get_model("llama-3.1-8b"), get_model("llama-3.1-70b"), get_gpu("H100")


@pytest.mark.parametrize(("num_gpus", "config", "reason"), [
    (3, EngineConfig(tp=3), "does not divide the 32 attention heads"),
    (2, EngineConfig(tp=1), "must equal the replica's 2 GPUs"),
    (1, EngineConfig(max_running_requests=32), "cuda_graph_max_bs 256 exceeds max_running_requests 32"),
    (1, EngineConfig(schedule_policy="lpm", enable_prefix_caching=False), "needs the prefix (radix) cache"),
    (1, EngineConfig(speculative_algorithm="MTP"), "needs a checkpoint with MTP heads"),
])
def test_constraint_gate_rejects_with_a_reason(num_gpus: int, config: EngineConfig, reason: str) -> None:
    result = check_constraints(LLAMA_8B, H100, num_gpus, config)
    assert result.rejected and reason in result.reason


def test_constraint_gate_knows_fp8_needs_hopper() -> None:
    result = check_constraints(LLAMA_8B, get_gpu("A100"), 1, EngineConfig(kv_cache_dtype="fp8_e4m3"))
    assert result.rejected and "no fp8 tensor cores" in result.reason
    assert not check_constraints(LLAMA_8B, H100, 1, EngineConfig(max_running_requests=32, cuda_graph_max_bs=32)).rejected


def test_memory_gate_checks_weights_kv_and_activation_headroom() -> None:
    shape = get_shape("long-context")
    assert check_memory(LLAMA_8B, H100, EngineConfig(), shape).status == "passed"
    no_kv = check_memory(LLAMA_70B, H100, EngineConfig(tp=1), shape)
    assert no_kv.rejected and "KV pool holds 0 tokens" in no_kv.reason
    squeezed = check_memory(LLAMA_8B, H100, EngineConfig(mem_fraction_static=0.95, chunked_prefill_size=16384), shape)
    assert squeezed.rejected and "for activations and CUDA graphs" in squeezed.reason


def test_parser_gate_without_sglang_reports_skipped_never_passed() -> None:
    results = ParserGate(python=None).check_many([["--model-path", "m"]])
    assert [(r.status, r.reason) for r in results] == [("skipped", "skipped (no sglang environment)")]


def test_parser_gate_runs_the_parser_contract_in_a_subprocess_and_caches(standin_sglang: ParserGate) -> None:
    good = EngineConfig().to_sglang_args("meta-llama/Llama-3.1-8B")
    bad = EngineConfig(mem_fraction_static=0.95).to_sglang_args("meta-llama/Llama-3.1-8B")
    unknown = [*good, "--no-such-flag"]
    results = standin_sglang.check_many([good, bad, unknown])
    assert [r.status for r in results] == ["passed", "rejected", "rejected"]
    assert "above 0.92" in results[1].reason and "unrecognized arguments" in results[2].reason
    assert standin_sglang.check_many([bad, good])[0].rejected
    assert standin_sglang.num_subprocess_runs == 1


def test_parser_gate_asks_the_release_for_its_flags_once(standin_sglang: ParserGate) -> None:
    assert ParserGate(python=None).target() is None
    target = standin_sglang.target()
    assert target is not None and target.version is None  # the stand-in has no package metadata
    assert {"--model-path", "--cuda-graph-max-bs", "--disable-radix-cache"} <= target.option_strings  # type: ignore[operator]
    assert standin_sglang.target() is target and standin_sglang.num_subprocess_runs == 1
    # the stand-in knows the old spelling, so that is what a search renders for it
    args = EngineConfig(max_running_requests=128, cuda_graph_max_bs=128).to_sglang_args("m", target)
    assert "--cuda-graph-max-bs" in args and standin_sglang.check_many([args])[0].status == "passed"


def test_parser_gate_reports_a_broken_interpreter_clearly(tmp_path) -> None:
    gate = ParserGate(python=str(tmp_path / "missing-python"))
    with pytest.raises(RuntimeError, match="cannot run"):
        gate.check_many([["--model-path", "m"]])


def test_one_parser_process_answers_every_batch_until_closed(standin_sglang: ParserGate) -> None:
    args = [EngineConfig(max_running_requests=m, cuda_graph_max_bs=32).to_sglang_args("m") for m in (64, 128, 256)]
    assert standin_sglang.target() is not None
    for one in args:  # one batch per search round, as a compile sends them
        assert standin_sglang.check_many([one])[0].status == "passed"
    process = standin_sglang._parser.process  # type: ignore[union-attr]
    assert standin_sglang.num_subprocess_runs == 1 and process.poll() is None
    standin_sglang.close()
    assert process.poll() is not None  # ended, not left behind
    assert standin_sglang.check_many([[*args[0], "--no-such-flag"]])[0].rejected  # a later check starts another
    assert standin_sglang.num_subprocess_runs == 2


def test_a_parser_process_that_dies_is_reported_with_its_exit_status(standin_sglang: ParserGate) -> None:
    standin_sglang.check_many([EngineConfig().to_sglang_args("m")])
    process = standin_sglang._parser.process  # type: ignore[union-attr]
    process.kill()
    process.wait()
    with pytest.raises(RuntimeError, match=r"\(exit -9\) did not answer"):
        standin_sglang.check_many([EngineConfig(tp=2).to_sglang_args("m")])
    assert standin_sglang.check_many([EngineConfig(tp=2).to_sglang_args("m")])[0].status == "passed"  # a fresh process
    assert standin_sglang.num_subprocess_runs == 2


class _Scripted:
    """A proposer returning fixed candidates once, then nothing."""

    name = "scripted"

    def __init__(self, candidates: list[object]) -> None:
        self.candidates = candidates

    def propose(self, context: SearchContext, num_candidates: int) -> ProposalBatch:
        out, self.candidates = self.candidates, []
        return ProposalBatch(tuple(Proposal(c) for c in out), self.name)


def test_rejections_are_stored_with_their_gate_and_reason(tmp_path, standin_sglang: ParserGate) -> None:
    candidates = [
        {"tp": 1, "max_running_requests": 32},  # constraints: graphs above the batch cap
        {"tp": 1, "mem_fraction_static": 0.93},  # sglang's parser (the stand-in) refuses it
        {"tp": 1, "max_running_requests": 100},  # outside the space
        {"tp": 1, "kv_cache_dtype": "fp8_e4m3"},  # fine
    ]
    with TrialStore(tmp_path / "t.sqlite3") as store:
        result = compile_config(LLAMA_8B, H100, 1, "short-chat", budget=Budget(trials=10), store=store,
                                proposer=_Scripted(candidates), evaluator=AnalyticEvaluator(), parser_gate=standin_sglang)
        trials = store.trials(LLAMA_8B.name, H100.name, 1)
    assert result is not None and result.num_rejected == 3
    by_config = {t.config: t for t in trials}
    assert by_config[EngineConfig(max_running_requests=32)].gates[0][:2] == ("constraints", "rejected")
    assert by_config[EngineConfig(mem_fraction_static=0.93)].gates[-1] == (
        "sglang-parser", "rejected", "sglang rejects the arguments: ValueError: mem_fraction_static above 0.92 (stand-in rule)")
    assert by_config[EngineConfig(max_running_requests=100)].gates[0][0] == "space"
    fine = by_config[EngineConfig(kv_cache_dtype="fp8_e4m3")]
    assert fine.status == "evaluated" and ("sglang-parser", "passed", "") in fine.gates
    assert sglang_model_path(LLAMA_8B) == "meta-llama/Llama-3.1-8B"
