"""The performance model's fitted constants (kernels/data/perf_params.yaml)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path

from kernels.yamlsrc import load_yaml

PARAMS_PATH = Path(str(resources.files("kernels").joinpath("data/perf_params.yaml")))


@dataclass(frozen=True, slots=True)
class PerfParams:
    """Achieved-efficiency factors and fixed latencies; each is one physical effect, fitted once for all GPUs."""

    compute_efficiency: Mapping[str, float]  # achieved / peak tensor FLOP/s, by executed precision
    bandwidth_efficiency: float  # achieved / peak HBM bandwidth when streaming weights and KV
    vendor_efficiency: Mapping[str, float]  # software maturity multiplier on both of the above
    interconnect_efficiency: float  # achieved / peak scale-up link bandwidth in all-reduce
    allreduce_latency_s: float  # fixed cost of one all-reduce (TP > 1)
    step_overhead_s: float  # scheduler, sampling, graph launch: once per iteration
    per_seq_overhead_s: float  # per running sequence per iteration (metadata, sampling)
    layer_floor_s: float  # minimum kernel time per layer even when bandwidth says less (CUDA graphs on)
    layer_launch_s: float  # per-layer launch cost without CUDA graphs (replaces layer_floor_s)
    moe_layer_floor_s: float  # extra per MoE layer: routing, permutation, grouped-GEMM launch
    draft_step_overhead_s: float  # fixed cost of one speculative draft step
    # Achieved / dense efficiency of routed-expert grouped GEMMs (few tokens per expert, many launches).
    moe_compute_efficiency: float = 1.0
    # Per request, outside the GPU: HTTP, tokenisation, scheduler hand-off and first-token streaming.
    request_overhead_s: float = 0.02
    fitted_on: str = ""

    def to_dict(self) -> dict[str, object]:
        return {f.name: (dict(v) if isinstance(v := getattr(self, f.name), Mapping) else v) for f in fields(self)}

    @classmethod
    def from_dict(cls, values: Mapping[str, object]) -> PerfParams:
        known = {f.name for f in fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"unknown perf parameter(s): {', '.join(sorted(unknown))}")
        return cls(**values)  # type: ignore[arg-type]


@functools.cache
def default_params() -> PerfParams:
    return PerfParams.from_dict(load_yaml(PARAMS_PATH).data)
