"""Successive halving: the performance model screens a candidate with one simulation (can it exceed
the goodput it needs to matter?) and only contenders are bisected in full. The grid makes the two
stages agree, so the search takes the same path as with full evaluations only."""

import math

from kernels.catalog import get_gpu, get_model
from kernels.compiler import Budget, compile_config
from kernels.compiler.evaluators import Metrics, PerfModelEvaluator, Screening
from kernels.compiler.shape import get_shape
from kernels.config import EngineConfig

MODEL, GPU, SHAPE = get_model("llama-3.1-8b"), get_gpu("H100"), get_shape("short-chat")


class _FullOnly:
    """The performance model without its screen: every candidate is bisected in full."""

    name = "perf-model"
    version = PerfModelEvaluator.version
    noise_margin = PerfModelEvaluator.noise_margin

    def __init__(self) -> None:
        self.inner = PerfModelEvaluator()

    def evaluate(self, model, gpu, config, shape) -> Metrics:
        return self.inner.evaluate(model, gpu, config, shape)


def test_the_screen_agrees_with_the_full_evaluation() -> None:
    config = EngineConfig(kv_cache_dtype="fp8_e4m3")
    goodput = PerfModelEvaluator().evaluate(MODEL, GPU, config, SHAPE).goodput_rps
    assert goodput > 0 and math.isclose(math.log(goodput, 1.02), round(math.log(goodput, 1.02)), abs_tol=1e-6)  # on the grid
    refused = PerfModelEvaluator().screen(MODEL, GPU, config, SHAPE, goodput)
    # the next step up fails (or is past the saturated throughput, never searched): it cannot exceed itself
    assert refused is not None and ("misses the p99 SLOs at" in refused or "rates are searched up to" in refused)
    contender = PerfModelEvaluator()
    assert contender.screen(MODEL, GPU, config, SHAPE, goodput * 0.97) is None
    assert contender.evaluate(MODEL, GPU, config, SHAPE).goodput_rps == goodput  # the bisection after a screen agrees


def test_screening_keeps_the_search_path_and_stores_why_a_candidate_was_cut() -> None:
    budget = Budget(trials=6, seconds=1e9)
    assert isinstance(PerfModelEvaluator(), Screening) and not isinstance(_FullOnly(), Screening)
    screened = compile_config(MODEL, GPU, 1, SHAPE, budget=budget, evaluator=PerfModelEvaluator())
    full = compile_config(MODEL, GPU, 1, SHAPE, budget=budget, evaluator=_FullOnly())
    assert screened is not None and full is not None
    assert [t.config for t in screened.history] == [t.config for t in full.history]
    assert screened.config == full.config and screened.predicted == full.predicted and screened.trials == full.trials
    assert screened.num_screened > 0 and full.num_screened == 0 and screened.num_rejected == full.num_rejected
    for cut, scored in zip(screened.history, full.history):
        if cut.screened:
            reason = next(g.reason for g in cut.gates if g.gate == "screen" and g.rejected)
            assert cut.metrics is None and ("the least rate that could win over" in reason or "cannot exceed" in reason)
            assert scored.metrics is not None and not scored.accepted  # it would not have won
