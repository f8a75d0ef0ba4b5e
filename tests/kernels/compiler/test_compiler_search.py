from dataclasses import replace
from pathlib import Path

from kernels.catalog import get_gpu, get_model
from kernels.compiler import Budget, TrialStore, compile_config
from kernels.compiler.bench import trials_to_within
from kernels.compiler.evaluators import AnalyticEvaluator, Metrics
from kernels.compiler.search import beats, score
from kernels.compiler.shape import drifted, get_shape
from kernels.config import EngineConfig

MODEL, GPU = get_model("llama-3.1-8b"), get_gpu("H100")


def test_compiled_config_beats_the_default_and_never_loses() -> None:
    for shape in ("short-chat", "long-context", "reasoning", "batch"):
        result = compile_config(MODEL, GPU, 1, shape, evaluator=AnalyticEvaluator())
        assert result is not None and result.baseline_config == EngineConfig()
        assert result.predicted.goodput_rps_per_gpu >= result.baseline.goodput_rps_per_gpu
    assert result.speedup > 1.5 and "the default's goodput per GPU" in result.reason


def test_warm_start_after_drift_needs_far_fewer_trials(tmp_path: Path) -> None:
    evaluator = AnalyticEvaluator()
    shape = get_shape("reasoning")
    moved = drifted(shape, 1.3, 1.3)
    with TrialStore(tmp_path / "seeded.sqlite3") as store:
        assert compile_config(MODEL, GPU, 1, shape, store=store, evaluator=evaluator) is not None
        warm = compile_config(MODEL, GPU, 1, moved, store=store, evaluator=evaluator)
    cold = compile_config(MODEL, GPU, 1, moved, evaluator=evaluator)
    assert warm is not None and cold is not None and warm.warm_start and not cold.warm_start
    reached = trials_to_within(warm, score(cold.predicted, "goodput"), "goodput")
    assert reached is not None and reached <= 0.2 * cold.trials
    assert warm.trials < cold.trials


def test_a_challenger_must_clear_the_noise_margin() -> None:
    incumbent = Metrics(10.0, 10.0, 1.0, 0.1, 0.01, 1.0, 0.5, "queueing")
    assert not beats(replace(incumbent, goodput_rps_per_gpu=10.2), incumbent, "goodput", 0.03)
    assert beats(replace(incumbent, goodput_rps_per_gpu=10.4), incumbent, "goodput", 0.03)
    assert beats(replace(incumbent, cost_per_mtok=0.9), incumbent, "cost", 0.03)
    assert beats(replace(incumbent, goodput_rps_per_gpu=0.1), replace(incumbent, goodput_rps_per_gpu=0.0), "goodput", 0.03)


class _Noisy:
    """Scores every non-default configuration 2% above the default: inside a 3% noise margin."""

    name = "noisy"
    version = 1
    noise_margin = 0.03

    def evaluate(self, model, gpu, config, shape) -> Metrics:
        goodput = 10.0 if config == EngineConfig() else 10.2
        return Metrics(goodput, goodput, 1.0, 0.1, 0.01, 1.0, 0.5, "queueing")


def test_gains_within_the_noise_margin_keep_the_incumbent() -> None:
    result = compile_config(MODEL, GPU, 1, "short-chat", evaluator=_Noisy(), budget=Budget(trials=12))
    assert result is not None and result.config == EngineConfig() and result.trials == 12
    assert "sglang's defaults kept" in result.reason


def test_nothing_fits_is_none() -> None:
    assert compile_config("llama-3.1-70b", "H100", 1, "short-chat", evaluator=AnalyticEvaluator()) is None


def test_larger_replicas_search_tensor_parallelism() -> None:
    result = compile_config("llama-3.1-70b", "H100", 4, "short-chat", evaluator=AnalyticEvaluator())
    assert result is not None and result.baseline_config == EngineConfig(tp=4)  # the whole replica as one TP group
    assert result.config.tp * result.config.dp == 4
