"""Continuous compilation: search the engine configuration that best serves a traffic shape.

Stable API (the fleet controller calls these)::

    result = compile_config("llama-3.1-8b", "H100", 1, "short-chat", budget=Budget(trials=40), store=TrialStore(path))
    result.config, result.predicted, result.baseline, result.trials, result.warm_start

    with CompileWorker() as worker:                      # off the request path
        future = worker.submit(CompileRequest("llama-3.1-8b", "H100", 1, shape, store_path=str(path)))
"""

from kernels.compiler.evaluators import Evaluator, Metrics, PerfModelEvaluator, ProbeEvaluator, ReplayEvaluator, ReplayRequest, Screening
from kernels.compiler.gates import GateResult, ParserGate
from kernels.compiler.proposers import AgentProposer, CoordinateProposer, Proposer
from kernels.compiler.search import OBJECTIVES, Budget, CompileResult, Trial, compile_config
from kernels.compiler.shape import NAMED_SHAPES, TrafficShape, get_shape, shape_distance, shape_fingerprint, shape_from_samples
from kernels.compiler.space import SearchSpace, default_space, engine_default
from kernels.compiler.store import StoreError, TrialStore
from kernels.compiler.worker import CompileRequest, CompileWorker, run_compile

__all__ = [
    "NAMED_SHAPES", "OBJECTIVES", "AgentProposer", "Budget", "CompileRequest", "CompileResult", "CompileWorker",
    "CoordinateProposer", "Evaluator", "GateResult", "Metrics", "ParserGate", "PerfModelEvaluator", "ProbeEvaluator",
    "Proposer", "ReplayEvaluator", "ReplayRequest", "Screening", "SearchSpace", "StoreError", "TrafficShape", "Trial", "TrialStore",
    "compile_config", "default_space", "engine_default", "get_shape", "run_compile", "shape_distance",
    "shape_fingerprint", "shape_from_samples",
]
