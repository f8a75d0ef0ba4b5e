"""Pool options for the planner: the operator's declared pools, and one per (traffic shape, GPU kind) they leave uncovered.

A pool the operator declared (``DeclaredPool``: the gateway config's pools) keeps its name and its
shapes, and starts from its declared engine configuration: ``choose_mix_config`` replaces it only
when another candidate is clearly faster for the pool's mix of shapes. A shape with load on a GPU kind
no declared pool serves it on gets a pool of its own, named ``<shape>@<gpu>``, with the configuration
``choose_config`` picks for the shape's current length profile and strictest tier. Capacity per
replica comes from the capacity model. The controller, and the simulator's static and oracle
policies, all plan through here, so every policy is judged by the same model.

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

from fleet.capacity import Capacity, CapacityModel, PerfCapacity, as_run, choose_config, choose_mix_config, mix_capacity, runnable_candidates
from fleet.compiled import CompiledConfig, ConfigSource, Envelope, config_changes, envelope_for, tier_name
from fleet.planner import PlanProblem, PoolOption, ShapeRate
from fleet.pool import PoolState
from fleet.telemetry import ShapeLoad, TrafficMix
from fleet.tiers import strictest, tier_weight
from kernels.catalog import get_gpu, get_model
from kernels.config import EngineConfig
from kernels.engine_servers import EngineServer
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


def pool_name(shape: str, gpu: str, model_prefix: str = "") -> str:
    """The name of a pool the controller makes: ``<shape>@<gpu>``; in a fleet of several models each
    model's controller prefixes its own (``<model>:``), so two models' pools never share a name and
    the actuator knows which model a new pool's replicas run (gateway.replicas)."""
    return f"{model_prefix}{shape}@{gpu}"


def config_json(config: EngineConfig) -> str:
    return json.dumps(config_changes(config), sort_keys=True)


@dataclass(frozen=True, slots=True)
class DeclaredPool:
    """A pool the operator declared (the gateway config's ``fleet.pools``), the controller's starting
    plan: its name, GPU kind, the shapes it serves and the engine configuration its replicas start
    with. ``config_json`` is that configuration exactly as its slots carry it, so a plan that keeps
    it restarts nothing."""

    name: str
    gpu: str
    shapes: tuple[str, ...]
    config: EngineConfig
    config_json: str
    engine: EngineServer | None = None  # how its engine runs a configuration (None: as sglang): its candidates are judged so


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
    declared: tuple[DeclaredPool, ...] = ()  # the operator's pools among ``pools``

    def configs_json(self) -> dict[str, str]:
        """Each pool's configuration as a slot carries it; a declared pool that keeps its declared
        configuration keeps the operator's spelling of it."""
        kept = {d.name: d.config_json for d in self.declared if d.config == dict(self.pool_to_config).get(d.name)}
        return {name: kept.get(name) or config_json(c) for name, c in self.pool_to_config}

    def envelope(self, pool: str) -> Envelope | None:
        return dict(self.pool_to_envelope).get(pool)

    def awaiting(self, pool: str) -> bool:
        return any(s.pool == pool for s in self.submitted)

    def pools_for(self, gpu: str, envelope: Envelope) -> list[str]:
        """The pools (planned or awaiting a compile) on ``gpu`` whose envelope is ``envelope``."""
        declared = {d.name: d.gpu for d in self.declared}
        return [name for name, found in self.pool_to_envelope
                if found == envelope and declared.get(name, name.rsplit("@", 1)[-1]) == gpu]


def pool_options(
    loads: tuple[ShapeLoad, ...],
    gpus: tuple[str, ...],
    capacity: CapacityModel,
    tiers: Mapping[str, TierSlo],
    configs: ConfigSource | None = None,
    now: float = 0.0,
    previous: Options | None = None,
    declared: tuple[DeclaredPool, ...] = (),
    model_prefix: str = "",
    running: Mapping[str, EngineConfig] | None = None,
    restart_margin: float = 0.02,
    made_engines: Mapping[str, EngineServer] | None = None,
) -> Options:
    """Pool options for ``loads``. With ``configs``, a pool keeps its envelope of ``previous`` while
    its traffic stays inside it (so a wobble neither recompiles nor changes the configuration).

    Each ``declared`` pool on a GPU kind of ``gpus`` is an option under its own name, serving those of
    its shapes that have load (none: it may still keep its replicas), with the configuration it runs
    as the incumbent (its replicas' in ``running``, else the previous plan's, else the declared one). A (shape, GPU kind) pair no declared
    pool covers gets a pool of its own, ``<shape>@<gpu>``. A pool of either kind with replicas in ``running``
    keeps the configuration they run unless a candidate is ``restart_margin`` faster
    (fleet.incumbents). ``made_engines``: how the engine a made pool runs on each GPU kind runs its
    configurations (gateway.replicas launches a made pool with a declared pool's engine; a GPU kind not
    in it: as sglang), judged so as a declared one is."""
    made_engines = made_engines or {}
    pools: list[PoolOption] = []
    chosen: list[tuple[str, EngineConfig]] = []
    concurrency: list[tuple[str, float]] = []
    envelopes: list[tuple[str, Envelope]] = []
    compiled_for: list[tuple[str, CompiledConfig]] = []
    submitted: list[Submitted] = []
    declared = tuple(d for d in declared if d.gpu in gpus)
    covered = {(shape, d.gpu) for d in declared for shape in d.shapes}
    ran = {} if previous is None else dict(previous.pool_to_config)
    # what a declared pool's replicas run is its incumbent: after an operator's canary adopted another
    # configuration, a plan that went back to the previous plan's (or the declared) one would undo it
    incumbents = {d.name: (running or {}).get(d.name) or ran.get(d.name, d.config) for d in declared}
    pool_to_loads = {d.name: [load for load in loads if load.name in d.shapes] for d in declared}
    if isinstance(capacity, PerfCapacity):  # the fixed candidates of every pool at once (most of a re-plan's work)
        capacity.prefetch([(gpu, as_run(config, made_engines.get(gpu)), load, strictest(load.tier_shares(), tiers))
                           for load in loads for gpu in gpus if (load.name, gpu) not in covered
                           for config in runnable_candidates([load], engine=made_engines.get(gpu))]
                          + [(d.gpu, as_run(config, d.engine), load, strictest(load.tier_shares(), tiers))
                             for d in declared if pool_to_loads[d.name]
                             for config in runnable_candidates(pool_to_loads[d.name], None, incumbents[d.name], d.engine)
                             for load in pool_to_loads[d.name]])

    def compiled_config(name: str, gpu: str, load: ShapeLoad, slo: TierSlo) -> CompiledConfig | None:
        """The compiler's configuration for the pool's envelope (submitting it when unknown)."""
        if configs is None:
            return None
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
        return compiled

    for pool in declared:
        mine = pool_to_loads[pool.name]
        slos = [strictest(load.tier_shares(), tiers) for load in mine]
        # the compiler tunes one shape's envelope: a pool that serves several gets the fixed candidates
        compiled = compiled_config(pool.name, pool.gpu, mine[0], slos[0]) if len(mine) == 1 else None
        total_rps = sum(load.rate_rps for load in mine)
        mix = [(load, slo, load.rate_rps / total_rps) for load, slo in zip(mine, slos, strict=True)]
        # its replicas would restart in place for a new configuration: the same margin as a pool the controller made
        margin = restart_margin if running is not None and pool.name in running else 0.02
        config, caps = (choose_mix_config(capacity, pool.gpu, mix, None if compiled is None else compiled.config,
                                          incumbents[pool.name], margin, pool.engine) if mine else (incumbents[pool.name], ()))
        served = [(load, cap) for load, cap in zip(mine, caps, strict=True) if cap.rate_rps > 0]
        served_rps = sum(load.rate_rps for load, _ in served)
        pools.append(PoolOption(pool.name, pool.gpu, config.num_gpus,
                                tuple(ShapeRate(load.name, cap.rate_rps, tier_weight(load.tier_shares(), tiers)) for load, cap in served)))
        chosen.append((pool.name, config))
        concurrency.append((pool.name, mix_capacity([(load.rate_rps / served_rps, cap) for load, cap in served]).concurrency))
        if compiled is not None and compiled.config == config:
            compiled_for.append((pool.name, compiled))
    for load in loads:
        slo = strictest(load.tier_shares(), tiers)
        weight = tier_weight(load.tier_shares(), tiers)
        for gpu in gpus:
            if (load.name, gpu) in covered:
                continue
            name = pool_name(load.name, gpu, model_prefix)
            compiled = compiled_config(name, gpu, load, slo)
            # with compiled configurations the running one is the incumbent: a restart needs a real gain
            incumbent = None if configs is None else ran.get(name)
            margin = 0.02
            if running is not None and name in running:  # its replicas would restart in place for a new one
                incumbent, margin = running[name], restart_margin
            config, cap = choose_config(capacity, gpu, load, slo, None if compiled is None else compiled.config, incumbent, margin,
                                        made_engines.get(gpu))
            if cap.rate_rps <= 0:
                continue
            pools.append(PoolOption.one(name, gpu, load.name, config.num_gpus, cap.rate_rps, weight))
            chosen.append((name, config))
            concurrency.append((name, cap.concurrency))
            if compiled is not None and compiled.config == config:
                compiled_for.append((name, compiled))
    # A pool made for a shape that has no load now keeps an option that serves nothing, as a declared pool does:
    # its replicas may stay until another pool gains by them, instead of moving at once for no predicted goodput
    # (the plan fills idle GPUs). Stretched drift-ramp: the start's reasoning replica, idle for the first minutes,
    # went to short-chat at 60 s and a long-context replica had to become reasoning at 370 s (fleet/README.md).
    offered = {name for name, _ in chosen}
    for name, config in sorted((running or {}).items()):
        gpu = name.rsplit("@", 1)[-1]
        if name not in offered and gpu in gpus and name.startswith(model_prefix):
            pools.append(PoolOption(name, gpu, config.num_gpus, ()))
            chosen.append((name, config))
            concurrency.append((name, 0.0))
    return Options(tuple(pools), tuple(chosen), tuple(concurrency), tuple(envelopes), tuple(compiled_for), tuple(submitted), declared)


def _shares(option: PoolOption, shape_to_rps: Mapping[str, float]) -> list[tuple[float, ShapeRate]]:
    """The option's shapes with their shares of its requests under ``shape_to_rps`` (equal when none has load)."""
    total = sum(shape_to_rps.get(s.shape, 0.0) for s in option.serves)
    return [(shape_to_rps.get(s.shape, 0.0) / total if total > 0 else 1.0 / len(option.serves), s) for s in option.serves]


def problem_for(
    options: Options,
    mixes: tuple[TrafficMix, ...],
    gpu_to_budget: Mapping[str, int],
    current: Mapping[str, int] | None = None,
    move_cost_s: float = 0.0,
    horizon_s: float = 600.0,
) -> PlanProblem:
    """A planning problem over ``mixes`` (their mean goodput); a replica change costs its pool's
    weighted capacity (for a pool of several shapes: under their mix) for ``move_cost_s`` out of
    ``horizon_s`` (halved: each move changes two pools). Capping that at the demand of the pool's
    shapes (a replica restarting while less than its capacity arrives loses only that) was tried:
    `polymorph bench adapt --scenarios drift-step --policies adaptive` fell from 28.21 to 27.68 req/s
    (one recompile fewer, 3,730 shed instead of 2,840), so a move still costs the capacity, and a
    light shape that no declared pool serves rides on overflow instead of getting a pool."""
    demands = tuple(tuple((s.name, s.rate_rps) for s in mix.shapes) for mix in mixes)
    shape_to_rps: dict[str, float] = {}
    for mix in mixes:
        for load in mix.shapes:
            shape_to_rps[load.name] = shape_to_rps.get(load.name, 0.0) + load.rate_rps
    costs = []
    for option in options.pools if move_cost_s > 0 else ():
        shares = _shares(option, shape_to_rps)
        rate = mix_capacity([(share, Capacity(s.rate_per_replica_rps, 0.0)) for share, s in shares]).rate_rps
        costs.append((option.name, sum(share * s.weight for share, s in shares) * rate * move_cost_s / horizon_s / 2))
    return PlanProblem(
        options.pools, tuple(sorted(gpu_to_budget.items())), demands, tuple(1.0 / len(mixes) for _ in mixes),
        tuple(sorted((current or {}).items())), tuple(costs),
    )


@dataclass(frozen=True, slots=True)
class PoolModel:
    """What the router knows of one pool from the capacity model (fleet.pool.PoolState's model fields)."""

    max_running_per_replica: int  # in flight per replica at capacity: the router's saturation point
    rate_per_replica_rps: float
    cost_per_hour: float  # one replica's GPUs
    mean_prompt_tokens: float  # of the shape it was planned for (weighs other shapes' requests)
    mean_output_tokens: float
    tpot_objective_s: float  # the TPOT objective its concurrency was sized to meet (its shapes' strictest)

    def apply(self, pool: PoolState) -> None:
        pool.max_running_per_replica = self.max_running_per_replica
        pool.rate_per_replica_rps, pool.cost_per_hour = self.rate_per_replica_rps, self.cost_per_hour
        pool.mean_prompt_tokens, pool.mean_output_tokens = self.mean_prompt_tokens, self.mean_output_tokens
        pool.tpot_objective_s = self.tpot_objective_s


def pool_models(options: Options, mix: TrafficMix, tiers: Mapping[str, TierSlo]) -> dict[str, PoolModel]:
    """Each planned pool's router model, from ``options`` planned for ``mix`` (a pool of several shapes:
    its rate under their mix, their mean lengths weighted by their shares); the simulator and the live
    gateway both hand these to their pools after a plan. A declared pool that serves no shape with
    load has none (the router keeps what it knew)."""
    out = {}
    for option, (name, concurrency) in zip(options.pools, options.pool_to_concurrency, strict=True):
        if not option.serves:
            continue
        shares = _shares(option, {load.name: load.rate_rps for load in mix.shapes})
        rate = mix_capacity([(share, Capacity(s.rate_per_replica_rps, 0.0)) for share, s in shares]).rate_rps
        prompt = output = 0.0
        tpot_s = math.inf
        for share, served in shares:
            load = mix.shape(served.shape)
            if load is not None:
                prompt, output = prompt + share * load.mean_prompt_tokens, output + share * load.mean_output_tokens
                tpot_s = min(tpot_s, strictest(load.tier_shares(), tiers).tpot_p99_s)
        out[name] = PoolModel(max(1, math.ceil(concurrency)), rate, get_gpu(option.gpu).price_per_gpu_hour * option.gpus_per_replica,
                              prompt, output, tpot_s if math.isfinite(tpot_s) else 0.0)
    return out
