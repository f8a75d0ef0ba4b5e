"""The sglang-parser gate against sglang itself (not the stand-in of conftest.py).

sglang lives in its own environment: `$POLYMORPH_SGLANG_PYTHON`, else the one `polymorph bench peers`
installs (~/.cache/polymorph/peers/sglang, sglang==0.5.23 with a CUDA build of torch, ~11 GB). Its
`sglang.srt.server_args` imports torch, which loads on a CPU-only machine. Without either environment
(CI) these tests skip. One parser process serves the whole module, because importing sglang takes
10-20 s: it reports the release's version and flags (so that candidates are rendered in the spelling
it parses), then answers every batch over stdin/stdout; the gate caches per argument list."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kernels.catalog import get_gpu, get_model
from kernels.compiler import Budget, TrialStore, compile_config
from kernels.compiler.evaluators import AnalyticEvaluator
from kernels.compiler.gates import SGLANG_PYTHON_ENV, GateResult, ParserGate, sglang_model_path
from kernels.compiler.search import render_sglang_args
from kernels.compiler.space import engine_default
from kernels.config import EngineConfig, SglangTarget
from loadtest.bench.peers_setup import SGLANG, env_ready
from tests.kernels.compiler.test_compiler_gates import _Scripted


def _sglang_python() -> str | None:
    return os.environ.get(SGLANG_PYTHON_ENV) or (str(SGLANG.python) if env_ready(SGLANG) else None)


pytestmark = pytest.mark.skipif(
    _sglang_python() is None,
    reason=f"no sglang environment: set ${SGLANG_PYTHON_ENV} or run `polymorph bench peers --peers sglang` once "
    "(installs sglang==0.5.23 into ~/.cache/polymorph/peers/sglang, ~11 GB)",
)

LLAMA_8B, H100 = get_model("llama-3.1-8b"), get_gpu("H100")
MODEL_PATH = sglang_model_path(LLAMA_8B)
# what the compiler's search space renders (one knob at a time off sglang's defaults)
RENDERED = {
    "default": engine_default(1, 1),
    "tp2": EngineConfig(tp=2),
    "max-running": EngineConfig(max_running_requests=512),
    "chunked": EngineConfig(chunked_prefill_size=2048, max_prefill_tokens=8192),
    "lpm": EngineConfig(schedule_policy="lpm"),
    "fp8-kv": EngineConfig(kv_cache_dtype="fp8_e4m3"),
    "mem-fraction": EngineConfig(mem_fraction_static=0.93),
    "no-radix": EngineConfig(enable_prefix_caching=False),
    "ngram": EngineConfig(speculative_algorithm="NGRAM", speculative_num_steps=3, speculative_num_draft_tokens=4),
    "cuda-graph": EngineConfig(max_running_requests=128, cuda_graph_max_bs=128),
    "eagle3": EngineConfig(speculative_algorithm="EAGLE3", speculative_num_steps=3, speculative_num_draft_tokens=4),
}
BROKEN = {
    "unknown-flag": [*RENDERED["default"].to_sglang_args(MODEL_PATH), "--no-such-flag"],
    "bad-choice": [*RENDERED["default"].to_sglang_args(MODEL_PATH), "--schedule-policy", "newest-first"],
}


@pytest.fixture(scope="module")
def checked() -> Iterator[tuple[ParserGate, dict[str, GateResult]]]:
    with ParserGate(python=_sglang_python()) as gate:
        target = gate.target()
        # and the widely deployed spelling, which a newer release may refuse
        names = [*RENDERED, *BROKEN, "cuda-graph-default-spelling"]
        args = [render_sglang_args(LLAMA_8B, c, target) for c in RENDERED.values()] + list(BROKEN.values())
        args.append(RENDERED["cuda-graph"].to_sglang_args(MODEL_PATH))
        yield gate, dict(zip(names, gate.check_many(args)))


def test_the_gate_reports_the_release_it_parses_with(checked: tuple[ParserGate, dict[str, GateResult]]) -> None:
    gate, _ = checked
    target = gate.target()
    assert isinstance(target, SglangTarget) and target.version
    assert {"--model-path", "--tp-size", "--max-running-requests", "--speculative-algorithm"} <= target.option_strings  # type: ignore[operator]


def test_sglang_parses_what_the_search_space_renders(checked: tuple[ParserGate, dict[str, GateResult]]) -> None:
    _, results = checked
    assert "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B" in render_sglang_args(LLAMA_8B, RENDERED["eagle3"], None)  # the catalog's draft
    assert {name: results[name].status for name in RENDERED} == dict.fromkeys(RENDERED, "passed")


def test_sglang_rejects_broken_arguments_with_its_own_message(checked: tuple[ParserGate, dict[str, GateResult]]) -> None:
    gate, results = checked
    assert results["unknown-flag"].rejected and "unrecognized arguments: --no-such-flag" in results["unknown-flag"].reason
    assert results["bad-choice"].rejected and "invalid choice: 'newest-first'" in results["bad-choice"].reason
    assert gate.num_subprocess_runs == 1  # the release's flags, then the batch, from one process


def test_cuda_graph_batch_renders_a_flag_this_release_knows(checked: tuple[ParserGate, dict[str, GateResult]]) -> None:
    # sglang 0.5.23 split --cuda-graph-max-bs into -decode and -prefill; argparse rejects the old
    # spelling as an ambiguous prefix, so the rendering must follow the release the gate reports
    gate, results = checked
    target = gate.target()
    rendered = render_sglang_args(LLAMA_8B, RENDERED["cuda-graph"], target)
    assert results["cuda-graph"].status == "passed", (rendered, results["cuda-graph"].reason)
    if "--cuda-graph-max-bs" not in target.option_strings:  # type: ignore[union-attr]
        assert "--cuda-graph-max-bs" not in rendered
        assert results["cuda-graph-default-spelling"].rejected and "ambiguous" in results["cuda-graph-default-spelling"].reason


def test_a_search_stores_sglang_verdicts_without_running_the_parser_again(
    tmp_path: Path, checked: tuple[ParserGate, dict[str, GateResult]],
) -> None:
    gate, results = checked
    candidates = [RENDERED[name].to_dict() for name in ("fp8-kv", "ngram", "cuda-graph")]
    candidates.append(EngineConfig(mem_fraction_static=0.85).to_dict())  # new: the same process answers it
    with TrialStore(tmp_path / "t.sqlite3") as store:
        compile_config(LLAMA_8B, H100, 1, "short-chat", budget=Budget(trials=10), store=store, proposer=_Scripted(candidates),
                       evaluator=AnalyticEvaluator(), parser_gate=gate)
        trials = store.trials(LLAMA_8B.name, H100.name, 1)
    by_config = {t.config: t for t in trials}
    for name in ("default", "fp8-kv", "ngram", "cuda-graph"):
        stored = [g for g in by_config[RENDERED[name]].gates if g[0] == "sglang-parser"]
        assert stored == [("sglang-parser", results[name].status, results[name].reason)], name
    assert [g for g in by_config[EngineConfig(mem_fraction_static=0.85)].gates if g[0] == "sglang-parser"] == [
        ("sglang-parser", "passed", "")]
    assert gate.num_subprocess_runs == 1  # known argument lists from the cache, the new one from the running parser
