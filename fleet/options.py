"""Pool options for the planner: one per (traffic shape, GPU kind), configured and sized by the model.

A pool is named ``<shape>@<gpu>``. Its engine configuration is the one ``choose_config`` picks for the
shape's current length profile and strictest tier; its capacity per replica comes from the capacity
model. The controller, and the simulator's static and oracle policies, all plan through here, so every
policy is judged by the same model.

With a ``ConfigSource`` (fleet.compiled), each pool also gets an envelope, and the compiler's best known
configuration for it joins the candidates (first, so it wins ties); an envelope the source does not
know yet is submitted for compiling and listed in ``Options.submitted`` (the caller logs it), and the
configuration compiled for the envelope the pool left stands in until the compile is done.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass

from fleet.capacity import CapacityModel, PerfCapacity, choose_config, config_candidates
from fleet.compiled import CompiledConfig, ConfigSource, Envelope, config_changes, envelope_for, tier_name
from fleet.planner import PlanProblem, PoolOption
from fleet.pool import PoolState
from fleet.telemetry import ShapeLoad, TrafficMix
from fleet.tiers import strictest, tier_weight
from kernels.catalog import get_gpu, get_model
from kernels.config import EngineConfig
from kernels.perf import PerfModel
from kernels.tiers import TierSlo


@dataclass(frozen=True, slots=True)
class MoveCost:
    """What moving a replica costs: drain, then an engine restart. The one place these assumptions live.

    Defaults, for Llama-3.1-8B-class models on H100/H200 (all configurable):

    * weights read at 2 GB/s per GPU: 16 GB of bf16 weights in ~8 s. Published start-up logs bracket
      it: ~2 s for the four safetensors shards of Llama-3.1-8B from a page-cached local snapshot
      (sgl-project/sglang#15426) and 53 s from a slow shared disk (pytorch/serve#3315, 13.4 s/shard);
      2 GB/s is a local NVMe read. A cold image or weight download is not charged.
    * CUDA-graph capture 15 s: vLLM captures 67 graphs by default, "more than 10s" depending on model
      and GPU (vllm-project/vllm#20098), and up to a minute before its warm-up fix (vllm#29275);
      sglang captures one graph per batch size up to cuda_graph_max_bs in the same way.
    * warm-up 5 s (first requests, JIT kernels, health check): an assumption, not measured.

    Large models are far slower: sglang reports 3-6+ minutes for e.g. Qwen3-235B FP8 on 4 GPUs
    (sgl-project/sglang#27139), which is why the planner charges the restart against its gain.
    """

    load_gb_per_s: float = 2.0
    cuda_graph_capture_s: float = 15.0
    warmup_s: float = 5.0
    drain_s: float = 20.0  # expected wait for in-flight requests (the simulator measures the real one)

    def restart_s(self, model: str, gpu: str, config: EngineConfig) -> float:
        """Engine start-up: each GPU reads its weight shard in parallel, then graphs and warm-up."""
        weight_bytes = PerfModel(get_model(model), get_gpu(gpu), config).weight_bytes_per_gpu
        return weight_bytes / (self.load_gb_per_s * 1e9) + self.cuda_graph_capture_s + self.warmup_s


def pool_name(shape: str, gpu: str) -> str:
    return f"{shape}@{gpu}"


def config_json(config: EngineConfig) -> str:
    return json.dumps(config_changes(config), sort_keys=True)


@dataclass(frozen=True, slots=True)
class Submitted:
    """A compile ``pool_options`` waits for: the pool's envelope and the one it left (None: first plan).
    ``new`` is False when the previous options already waited for it (nothing new to log)."""

    pool: str
    gpu: str
    envelope: Envelope
    previous: Envelope | None
    new: bool = True


@dataclass(frozen=True, slots=True)
class Options:
    pools: tuple[PoolOption, ...]
    pool_to_config: tuple[tuple[str, EngineConfig], ...]
    pool_to_concurrency: tuple[tuple[str, float], ...]  # in flight per replica at capacity (router saturation)
    # with a ConfigSource: each pool's envelope, the compiled result it runs, the compiles still awaited
    pool_to_envelope: tuple[tuple[str, Envelope], ...] = ()
    pool_to_compiled: tuple[tuple[str, CompiledConfig], ...] = ()
    submitted: tuple[Submitted, ...] = ()

    def configs_json(self) -> dict[str, str]:
        return {name: config_json(c) for name, c in self.pool_to_config}

    def envelope(self, pool: str) -> Envelope | None:
        return dict(self.pool_to_envelope).get(pool)

    def awaiting(self, pool: str) -> bool:
        return any(s.pool == pool for s in self.submitted)

    def pools_for(self, gpu: str, envelope: Envelope) -> list[str]:
        """The pools (planned or awaiting a compile) on ``gpu`` whose envelope is ``envelope``."""
        return [name for name, found in self.pool_to_envelope if found == envelope and name.endswith("@" + gpu)]


def pool_options(
    loads: tuple[ShapeLoad, ...],
    gpus: tuple[str, ...],
    capacity: CapacityModel,
    tiers: Mapping[str, TierSlo],
    configs: ConfigSource | None = None,
    now: float = 0.0,
    previous: Options | None = None,
) -> Options:
    """Pool options for ``loads``. With ``configs``, a pool keeps its envelope of ``previous`` while
    its traffic stays inside it (so a wobble neither recompiles nor changes the configuration)."""
    pools: list[PoolOption] = []
    chosen: list[tuple[str, EngineConfig]] = []
    concurrency: list[tuple[str, float]] = []
    envelopes: list[tuple[str, Envelope]] = []
    compiled_for: list[tuple[str, CompiledConfig]] = []
    submitted: list[Submitted] = []
    if isinstance(capacity, PerfCapacity):  # the fixed candidates of every pool at once (most of a re-plan's work)
        capacity.prefetch([(gpu, config, load, strictest(load.tier_shares(), tiers))
                           for load in loads for gpu in gpus for config in config_candidates()])
    for load in loads:
        slo = strictest(load.tier_shares(), tiers)
        weight = tier_weight(load.tier_shares(), tiers)
        for gpu in gpus:
            name = pool_name(load.name, gpu)
            compiled = None
            if configs is not None:
                before = None if previous is None else previous.envelope(name)
                envelope = envelope_for(load, slo, tier_name(slo, tiers), before)
                envelopes.append((name, envelope))
                compiled = configs.best(gpu, envelope, now)
                if compiled is None:
                    configs.submit(gpu, envelope, load.name, now)
                    compiled = configs.best(gpu, envelope, now)  # found in the trial store: no search
                if compiled is None:
                    awaited = previous is not None and previous.awaiting(name) and before == envelope
                    submitted.append(Submitted(name, gpu, envelope, before, new=not awaited))
                    # until it is done, the configuration compiled for the envelope the pool left stands in
                    compiled = None if previous is None else dict(previous.pool_to_compiled).get(name)
            # with compiled configurations the running one is the incumbent: a restart needs a real gain
            incumbent = None if configs is None or previous is None else dict(previous.pool_to_config).get(name)
            config, cap = choose_config(capacity, gpu, load, slo, None if compiled is None else compiled.config, incumbent)
            if cap.rate_rps <= 0:
                continue
            pools.append(PoolOption(name, gpu, load.name, config.num_gpus, cap.rate_rps, weight))
            chosen.append((name, config))
            concurrency.append((name, cap.concurrency))
            if compiled is not None and compiled.config == config:
                compiled_for.append((name, compiled))
    return Options(tuple(pools), tuple(chosen), tuple(concurrency), tuple(envelopes), tuple(compiled_for), tuple(submitted))


def problem_for(
    options: Options,
    mixes: tuple[TrafficMix, ...],
    gpu_to_budget: Mapping[str, int],
    current: Mapping[str, int] | None = None,
    move_cost_s: float = 0.0,
    horizon_s: float = 600.0,
) -> PlanProblem:
    """A planning problem over ``mixes`` (equally weighted); a replica change costs its pool's
    weighted capacity for ``move_cost_s`` out of ``horizon_s`` (halved: each move changes two pools)."""
    demands = tuple(tuple((s.name, s.rate_rps) for s in mix.shapes) for mix in mixes)
    costs = tuple(
        (p.name, p.weight * p.rate_per_replica_rps * move_cost_s / horizon_s / 2) for p in options.pools
    ) if move_cost_s > 0 else ()
    return PlanProblem(
        options.pools, tuple(sorted(gpu_to_budget.items())), demands, tuple(1.0 for _ in mixes),
        tuple(sorted((current or {}).items())), costs,
    )


@dataclass(frozen=True, slots=True)
class PoolModel:
    """What the router knows of one pool from the capacity model (fleet.pool.PoolState's model fields)."""

    max_running_per_replica: int  # in flight per replica at capacity: the router's saturation point
    rate_per_replica_rps: float
    cost_per_hour: float  # one replica's GPUs
    mean_prompt_tokens: float  # of the shape it was planned for (weighs other shapes' requests)
    mean_output_tokens: float

    def apply(self, pool: PoolState) -> None:
        pool.max_running_per_replica = self.max_running_per_replica
        pool.rate_per_replica_rps, pool.cost_per_hour = self.rate_per_replica_rps, self.cost_per_hour
        pool.mean_prompt_tokens, pool.mean_output_tokens = self.mean_prompt_tokens, self.mean_output_tokens


def pool_models(options: Options, mix: TrafficMix) -> dict[str, PoolModel]:
    """Each planned pool's router model, from ``options`` planned for ``mix``; the simulator and the
    live gateway both hand these to their pools after a plan."""
    out = {}
    for option, (name, concurrency) in zip(options.pools, options.pool_to_concurrency, strict=True):
        load = mix.shape(option.shape)
        out[name] = PoolModel(max(1, math.ceil(concurrency)), option.rate_per_replica_rps,
                              get_gpu(option.gpu).price_per_gpu_hour * option.gpus_per_replica,
                              load.mean_prompt_tokens if load else 0.0, load.mean_output_tokens if load else 0.0)
    return out
