"""The vLLM-parser gate against vLLM itself: the CPU build `fleet.engines.install` caches (installed on
first use, about 5 minutes and 3.4 GB once). Its parser is the OpenAI server's (`make_arg_parser` on
`FlexibleArgumentParser`, `validate_parsed_serve_args`, `AsyncEngineArgs.from_cli_args`): argument
parsing does not depend on the device, so the CPU build checks what a GPU replica would be started with.
One parser process serves the module (importing vLLM takes 20-30 s)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fleet.engines import install
from kernels.catalog import get_gpu, get_model
from kernels.compiler.gates import GateResult, ParserGate, sglang_model_path
from kernels.compiler.space import KNOBS, default_space, engine_default, with_knob
from kernels.config import EngineConfig

pytestmark = pytest.mark.xdist_group("vllm")  # one vLLM (3 GB, two cores' worth) at a time: the vLLM tests keep to one xdist worker

LLAMA_8B, H100 = get_model("llama-3.1-8b"), get_gpu("H100")
MODEL_PATH = sglang_model_path(LLAMA_8B)  # a hub id: the gate checks arguments, not where the model is
NUM_GPUS = 2
SPACE = default_space(LLAMA_8B, H100, NUM_GPUS, allow_fp8_weights=True)
# every move the compiler's search makes from sglang's defaults: each knob to each of its choices
RENDERED = {f"{knob}={value}": with_knob(engine_default(NUM_GPUS, 1), knob, value, NUM_GPUS)
            for knob in KNOBS for value in SPACE.choices(knob)}
BROKEN = {
    "unknown-flag": ["--model", MODEL_PATH, *EngineConfig().vllm_flags(), "--no-such-flag"],
    "bad-choice": ["--model", MODEL_PATH, *EngineConfig().vllm_flags(), "--scheduling-policy", "newest-first"],
    "bad-json": ["--model", MODEL_PATH, "--speculative-config", "{not json"],
}


@pytest.fixture(scope="module")
def checked(vllm_python: Path) -> Iterator[tuple[ParserGate, dict[str, GateResult]]]:
    with ParserGate(python=str(vllm_python), env=install.QUIET_ENV, engine="vllm") as gate:
        names = [*RENDERED, *BROKEN]
        args = [["--model", MODEL_PATH, *config.vllm_flags()] for config in RENDERED.values()] + list(BROKEN.values())
        yield gate, dict(zip(names, gate.check_many(args)))


def test_the_search_space_covers_every_knob() -> None:
    assert len(RENDERED) > 40
    assert {"speculative=('EAGLE3', 1, 2)", "quantization=fp8", "kv_cache_dtype=fp8_e4m3", "tp=2", "schedule_policy=lpm"} <= set(RENDERED)


def test_vllm_parses_every_config_the_search_space_renders(checked: tuple[ParserGate, dict[str, GateResult]]) -> None:
    _, results = checked
    rejected = {name: results[name].reason for name in RENDERED if results[name].status != "passed"}
    assert rejected == {}


def test_vllm_rejects_broken_arguments_with_its_own_message(checked: tuple[ParserGate, dict[str, GateResult]]) -> None:
    gate, results = checked
    assert all(results[name].gate == "vllm-parser" for name in BROKEN)
    assert results["unknown-flag"].rejected and "unrecognized arguments: --no-such-flag" in results["unknown-flag"].reason
    assert results["bad-choice"].rejected and "invalid choice: 'newest-first'" in results["bad-choice"].reason
    assert results["bad-json"].rejected and "--speculative-config" in results["bad-json"].reason
    assert gate.num_subprocess_runs == 1  # one process answered the whole batch


def test_the_gate_caches_verdicts_and_reports_no_sglang_target(checked: tuple[ParserGate, dict[str, GateResult]]) -> None:
    gate, results = checked
    again = gate.check_many([["--model", MODEL_PATH, *RENDERED["tp=2"].vllm_flags()]])
    assert again == [results["tp=2"]] and gate.num_subprocess_runs == 1
    assert gate.target() is None  # spellings per release are an sglang matter
