"""`polymorph bench compile`: compiled vs sglang-default goodput per cell, cold vs warm searches.

For each (model, GPU, shape) cell, side by side in one run:
1. cold: compile the shape from an empty store (the baseline is sglang's defaults on the same evaluator);
2. drift: scale the shape's prompt and output lengths by `--drift`, then compile the drifted shape
   (a) cold from an empty store: the from-scratch optimum and the trials it needed, and
   (b) warm from the store of step 1, and count the trials until it came within 2% of (a).
Cells run in worker processes (`--workers`); CPU seconds are each compile's own, its sglang parser
process included (when $POLYMORPH_SGLANG_PYTHON names one)."""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import resource
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kernels.catalog import get_gpu, get_model
from kernels.compiler.search import Budget, CompileResult, compile_config, score
from kernels.compiler.shape import NAMED_SHAPES, drifted
from kernels.compiler.space import default_space
from kernels.compiler.store import TrialStore

DEFAULT_MODELS = ("llama-3.1-8b:1", "llama-3.1-70b:4")
DEFAULT_SHAPES = ("short-chat", "long-context", "reasoning", "batch")
DEFAULT_BUDGET = 60
WITHIN = 0.02


@dataclass(frozen=True, slots=True)
class CellResult:
    model: str
    gpu: str
    num_gpus: int
    shape: str
    default_goodput_per_gpu: float
    compiled_goodput_per_gpu: float
    cold_trials: int
    cold_cpu_s: float
    changed: str  # knobs the winner changed from the default
    drift_cold_trials: int | None  # None: the drift comparison was not run
    warm_trials: int | None
    warm_trials_to_within_2pct: int | None  # None: not run, or never came within 2%

    @property
    def speedup(self) -> float:
        return self.compiled_goodput_per_gpu / self.default_goodput_per_gpu if self.default_goodput_per_gpu > 0 else float("inf")


def trials_to_within(result: CompileResult, target: float, objective: str) -> int | None:
    """Evaluations (in order, screens counted, reused entries free) until one scored within WITHIN of `target`."""
    count = 0
    for trial in result.history:
        if trial.screened:
            count += 1
        if trial.metrics is None or trial.reused:
            continue
        count += 1
        if score(trial.metrics, objective) >= target - WITHIN * abs(target):
            return count
    return None


def cpu_seconds() -> float:
    """CPU time of this process and of its children that have ended (the sglang parser's process)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@dataclass(frozen=True, slots=True)
class BenchOptions:
    drift: float
    budget: Budget
    warm: bool = True  # also run the drift comparison (two more compiles a cell)
    allow_fp8_weights: bool = False
    draft_models: tuple[str, ...] = ()


def run_cell(model: str, num_gpus: int, gpu: str, shape_name: str, options: BenchOptions) -> CellResult | None:
    shape = NAMED_SHAPES[shape_name]
    moved = drifted(shape, options.drift, options.drift, name=f"{shape_name}-drifted")
    space = default_space(get_model(model), get_gpu(gpu), num_gpus, options.allow_fp8_weights, draft_models=options.draft_models)
    budget = options.budget
    with tempfile.TemporaryDirectory() as tmp:
        started = cpu_seconds()
        with TrialStore(Path(tmp) / "seeded.sqlite3") as store:
            cold = compile_config(model, gpu, num_gpus, shape, budget=budget, store=store, space=space)
            cold_cpu_s = cpu_seconds() - started
            if cold is None:
                return None
            warm = compile_config(model, gpu, num_gpus, moved, budget=budget, store=store, space=space) if options.warm else None
        with TrialStore(Path(tmp) / "scratch.sqlite3") as scratch:
            fresh = compile_config(model, gpu, num_gpus, moved, budget=budget, store=scratch, space=space) if options.warm else None
    return CellResult(
        model=cold.model, gpu=cold.gpu, num_gpus=num_gpus, shape=shape_name,
        default_goodput_per_gpu=cold.baseline.goodput_rps_per_gpu, compiled_goodput_per_gpu=cold.predicted.goodput_rps_per_gpu,
        cold_trials=cold.trials, cold_cpu_s=cold_cpu_s, changed=_changed(cold),
        drift_cold_trials=fresh.trials if fresh else None,
        warm_trials=warm.trials if warm else None,
        warm_trials_to_within_2pct=trials_to_within(warm, score(fresh.predicted, "goodput"), "goodput") if warm and fresh else None,
    )


def _changed(result: CompileResult) -> str:
    base = result.baseline_config.to_dict()
    short = {"max_running_requests": "mrr", "chunked_prefill_size": "chunk", "max_prefill_tokens": "maxpf",
             "kv_cache_dtype": "kv", "cuda_graph_max_bs": "graph", "mem_fraction_static": "mem",
             "enable_prefix_caching": "radix", "speculative_algorithm": "spec", "schedule_policy": "policy",
             "quantization": "quant"}
    return " ".join(f"{short.get(k, k)}={v}" for k, v in result.config.to_dict().items()
                    if v != base[k] and k not in ("speculative_num_steps", "speculative_num_draft_tokens", "dp")) or "-"


def main_bench(args: argparse.Namespace) -> int:
    shapes = args.shapes or list(DEFAULT_SHAPES)
    cells = [(m.split(":")[0], int(m.split(":")[1]) if ":" in m else 1, gpu, shape)
             for m in args.models for gpu in args.gpus for shape in shapes]
    unknown = [s for s in shapes if s not in NAMED_SHAPES]
    if unknown:
        raise SystemExit(f"unknown shapes {unknown}; built-in: {', '.join(NAMED_SHAPES)}")
    options = BenchOptions(args.drift, Budget(trials=DEFAULT_BUDGET if args.budget is None else args.budget, seconds=args.seconds), not args.no_warm,
                           args.allow_fp8_weights, tuple(args.draft or ()))
    print(f"{'model':<16}{'gpus':>5} {'gpu':<9}{'shape':<13}{'default':>9}{'compiled':>9}{'x':>6}"
          f"{'trials':>7}{'cpu s':>7}{'drift cold':>11}{'warm':>6}{'warm->2%':>9}  changed", flush=True)
    done: list[CellResult] = []
    with concurrent.futures.ProcessPoolExecutor(max_workers=args.workers) as pool:
        futures = [pool.submit(run_cell, m, n, g, s, options) for m, n, g, s in cells]
        for cell, future in zip(cells, futures):  # rows in a fixed order, each printed as soon as it is ready
            r = future.result()
            if r is None:
                print(f"{cell[0]:<16}{cell[1]:>5} {cell[2]:<9}{cell[3]:<13}  does not fit", flush=True)
                continue
            done.append(r)
            drift_cold, warm, reach = (("-" if v is None else str(v)) for v in (
                r.drift_cold_trials, r.warm_trials, r.warm_trials_to_within_2pct))
            print(f"{r.model:<16}{r.num_gpus:>5} {r.gpu:<9}{r.shape:<13}{r.default_goodput_per_gpu:>9.3g}"
                  f"{r.compiled_goodput_per_gpu:>9.3g}{r.speedup:>6.2f}{r.cold_trials:>7}{r.cold_cpu_s:>7.1f}"
                  f"{drift_cold:>11}{warm:>6}{reach:>9}  {r.changed}", flush=True)
    warm_ok = [r for r in done if r.warm_trials_to_within_2pct is not None and r.drift_cold_trials
               and r.warm_trials_to_within_2pct <= 0.2 * r.drift_cold_trials]
    summary = {
        "cells": len(cells), "fitted_cells": len(done),
        "cells_at_1_5x": sum(1 for r in done if r.speedup >= 1.5),
        "cells_worse_than_default": sum(1 for r in done if r.speedup < 1.0),
        "median_speedup": round(sorted(r.speedup for r in done)[len(done) // 2], 3) if done else None,
        "max_cold_cpu_s": round(max((r.cold_cpu_s for r in done), default=0.0), 1),
        "mean_cold_trials": round(sum(r.cold_trials for r in done) / max(1, len(done)), 1),
        "mean_warm_trials_to_within_2pct": round(sum(r.warm_trials_to_within_2pct or r.warm_trials or 0 for r in done)
                                                 / max(1, len(done)), 1) if options.warm else None,
        "warm_cells_within_2pct_in_20pct_trials": len(warm_ok) if options.warm else None,
        "space": {"allow_fp8_weights": options.allow_fp8_weights, "draft_models": list(options.draft_models)},
    }
    print(json.dumps(summary))
    return 0
