"""How much traffic of one shape a replica serves within its SLO, from the performance model.

``PerfCapacity.estimate(gpu, config, load, slo)`` runs ``kernels.predict.max_rate_under_slo`` on the
shape's length distribution: the cross product of its equal-mass prompt and output points
(fleet.lengths; the means when a load carries no points) as a Poisson load on the engine scheduler,
the same engine the simulator and emulator run, against the p99 TTFT and TPOT of the shape's
strictest tier. Sizing pools from mean lengths under-provisions heavy-tailed shapes (the long prompts
set the p99 TTFT); the points carry the tail. The share of prompt tokens engines served from their
prefix cache (``ShapeLoad.prefix_share``, measured from the responses' cached tokens) becomes a prefix
every simulated request shares: chat behind a 1,024-token system prompt (1,060-token prompts, 200
out) meets the interactive tier at 41 req/s on an H100 (near the search's ceiling, the engine's
saturated throughput, 43 req/s: kernels.predict.saturated_rate_rps), not the 17 req/s of 1,060 new
tokens each. Points are on a quarter-octave grid, so nearby windows
share a cache entry and a stationary mix costs nothing after its first plan. The cache can persist to
a JSON file (the bench keeps one between runs).

``choose_config`` is the one place that picks a pool's engine configuration for a shape: the
compiler's configuration for the shape's envelope when one is known (fleet.compiled), judged on this
capacity model beside a small fixed candidate set that stands in until the compile is done.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from fleet.lengths import snap_tokens
from fleet.telemetry import ShapeLoad
from kernels.catalog import get_gpu, get_model
from kernels.config import EngineConfig
from kernels.engine_servers import EngineServer
from kernels.perf import PerfModel
from kernels.predict import Workload, max_rate_under_slo, simulate
from kernels.tiers import TierSlo

# sglang's defaults, small chunks (short prompts, tight TPOT), large chunks (long prompts, fast TTFT)
CANDIDATE_CONFIGS: tuple[EngineConfig, ...] = (
    EngineConfig(),
    EngineConfig(chunked_prefill_size=2048),
    EngineConfig(chunked_prefill_size=8192),
)


# Bumped when an evaluation of the same key would answer differently: a persisted cache's older answers are
# not read (2: shared prefixes, and the rate search's bracket no longer starved by the chunk limit; 3: the
# search stops at the simulated saturated throughput, kernels.predict.saturated_rate_rps).
_KEY_VERSION = 3


@dataclass(frozen=True, slots=True)
class Capacity:
    rate_rps: float  # per replica, within the SLO
    concurrency: float  # requests in flight per replica at that rate (Little's law on the prediction)


class CapacityModel(Protocol):
    def estimate(self, gpu: str, config: EngineConfig, load: ShapeLoad, slo: TierSlo) -> Capacity: ...


def length_points(load: ShapeLoad) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The load's (prompt, output) points on the grid; its snapped means when it has none."""
    prompts = load.prompt_points or (snap_tokens(load.mean_prompt_tokens),)
    outputs = load.output_points or (snap_tokens(load.mean_output_tokens or 1),)
    return prompts, outputs


def shared_prefix_tokens(load: ShapeLoad, config: EngineConfig) -> int:
    """The prompt tokens every request of ``load`` shares, as ``config``'s engine caches them (on the
    grid, so nearby shares share a cache entry; 0 without prefix caching)."""
    if load.prefix_share <= 0 or not config.enable_prefix_caching:
        return 0
    return snap_tokens(load.prefix_share * load.mean_prompt_tokens)


class PerfCapacity:
    """Capacity from kernels.predict, cached per (model, GPU, config, snapped lengths, SLO)."""

    def __init__(self, model: str, cache_path: Path | None = None, rel_tol: float = 0.05, num_requests: int = 400,
                 executor: Executor | None = None) -> None:
        self.model = model
        # a live controller evaluates in another process: seconds of perf-model work per new shape
        # would otherwise hold the GIL the gateway's event loop needs
        self.executor = executor
        self.cache_path = cache_path
        self.rel_tol = rel_tol
        self.num_requests = num_requests
        self._key_to_capacity: dict[str, Capacity] = {}
        self.num_evaluations = 0
        if cache_path is not None:
            self._key_to_capacity = _read_cache(cache_path)

    def _key(self, gpu: str, config: EngineConfig, prompts: tuple[int, ...], outputs: tuple[int, ...], slo: TierSlo, shared: int) -> str:
        return json.dumps([_KEY_VERSION, self.model, gpu, config.to_dict(), prompts, outputs, slo.ttft_p99_s, slo.tpot_p99_s, shared],
                          sort_keys=True)

    def estimate(self, gpu: str, config: EngineConfig, load: ShapeLoad, slo: TierSlo) -> Capacity:
        prompts, outputs = length_points(load)
        shared = shared_prefix_tokens(load, config)
        key = self._key(gpu, config, prompts, outputs, slo, shared)
        found = self._key_to_capacity.get(key)
        if found is None:
            found = self._key_to_capacity[key] = self._evaluate(gpu, config, prompts, outputs, slo, shared)
            self._save()
        return found

    def prefetch(self, queries: list[tuple[str, EngineConfig, ShapeLoad, TierSlo]]) -> None:
        """Evaluate the queries not cached yet side by side on the executor (a re-plan's candidates:
        one evaluation at a time would leave all but one of its workers idle). No-op without one."""
        if self.executor is None:
            return
        key_to_future = {}
        for gpu, config, load, slo in queries:
            prompts, outputs = length_points(load)
            shared = shared_prefix_tokens(load, config)
            key = self._key(gpu, config, prompts, outputs, slo, shared)
            if key not in self._key_to_capacity and key not in key_to_future:
                args = (self.model, gpu, config, prompts, outputs, slo, self.rel_tol, self.num_requests, shared)
                key_to_future[key] = self.executor.submit(evaluate_capacity, *args)
        for key, future in key_to_future.items():
            self._key_to_capacity[key] = future.result()
            self.num_evaluations += 1
        if key_to_future:
            self._save()

    def _evaluate(self, gpu: str, config: EngineConfig, prompts: tuple[int, ...], outputs: tuple[int, ...], slo: TierSlo,
                  shared: int) -> Capacity:
        self.num_evaluations += 1
        args = (self.model, gpu, config, prompts, outputs, slo, self.rel_tol, self.num_requests, shared)
        if self.executor is None:
            return evaluate_capacity(*args)
        return self.executor.submit(evaluate_capacity, *args).result()

    def _save(self) -> None:
        if self.cache_path is None:
            return
        self.cache_path.parent.mkdir(parents=True, exist_ok=True)
        data = {key: [c.rate_rps, c.concurrency] for key, c in sorted(self._key_to_capacity.items())}
        partial = self.cache_path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(data))
        os.replace(partial, self.cache_path)  # atomic: a concurrent reader never sees half a file


def _read_cache(path: Path) -> dict[str, Capacity]:
    """The cached capacities at ``path`` (none when it does not exist yet). A file that is not such a cache
    is set aside with a word and made anew: it holds only what the model can compute again, and before, one
    bad write failed every later adaptive run with a traceback. A path that is a folder is refused."""
    if path.is_dir():
        raise ValueError(f"capacity cache {path} is a directory; name a file")
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
        return {str(key): Capacity(float(rate), float(conc)) for key, (rate, conc) in data.items()}
    except (OSError, UnicodeDecodeError, ValueError, TypeError, AttributeError) as exc:
        print(f"polymorph: capacity cache {path} is not a capacity cache ({type(exc).__name__}: {exc}); it is made anew", file=sys.stderr)
        return {}


def evaluate_capacity(model: str, gpu: str, config: EngineConfig, prompts: tuple[int, ...], outputs: tuple[int, ...],
                      slo: TierSlo, rel_tol: float, num_requests: int, shared_prefix_tokens: int = 0) -> Capacity:
    """One replica's rate within ``slo`` on the (prompt, output) cross product, every prompt starting with
    the same ``shared_prefix_tokens`` (all but its last token of a shorter one) (module-level: picklable)."""
    perf = PerfModel(get_model(model), get_gpu(gpu), config)
    if not perf.fits or max(prompts) + max(outputs) > perf.kv_capacity_tokens:
        return Capacity(0.0, 0.0)
    workloads = [Workload(p, o, num_requests=num_requests, shared_prefix_tokens=min(shared_prefix_tokens, p - 1)) for p in prompts for o in outputs]
    rate = max_rate_under_slo(perf, workloads, ttft_p99_s=slo.ttft_p99_s, tpot_p99_s=slo.tpot_p99_s, rel_tol=rel_tol)
    if rate <= 0:
        return Capacity(0.0, 0.0)
    at = simulate(perf, [dataclasses.replace(w, rate=rate) for w in workloads], [1.0] * len(workloads))
    mean_osl = sum(outputs) / len(outputs)
    return Capacity(rate, rate * (at.ttft_mean_s + at.tpot_mean_s * mean_osl))


def config_candidates(compiled: EngineConfig | None = None, incumbent: EngineConfig | None = None) -> list[EngineConfig]:
    """What ``choose_config`` weighs, in its order of precedence."""
    candidates: list[EngineConfig] = []
    for config in (incumbent, compiled, *CANDIDATE_CONFIGS):
        if config is not None and config not in candidates:
            candidates.append(config)
    return candidates


def as_run(config: EngineConfig, engine: EngineServer | None) -> EngineConfig:
    """``config`` as the pool's engine runs it (kernels.engine_servers: llama-server's or vLLM's defaults
    where it leaves knobs unset), else (None) sglang's, which the capacity model follows. The prefetch
    and the choice ask the capacity model for the same configurations."""
    return config if engine is None else engine.runs(config)


def runnable_candidates(loads: Sequence[ShapeLoad], compiled: EngineConfig | None = None, incumbent: EngineConfig | None = None,
                        engine: EngineServer | None = None) -> list[EngineConfig]:
    """``config_candidates`` for a pool serving ``loads``, on its ``engine`` only those whose running
    requests can all hold the loads' longest requests (their top length points) at once (on llama-server
    the slots share one pool; sglang and vLLM queue instead); where none can, the one the engine sizes to
    hold them (``EngineServer.sized_for``), and where not even that exists, all of them."""
    candidates = config_candidates(compiled, incumbent)
    if engine is None:
        return candidates
    longest = max((max(load.prompt_points, default=round(load.mean_prompt_tokens))
                   + max(load.output_points, default=round(load.mean_output_tokens))) for load in loads)
    held = [config for config in candidates if engine.holds(config, longest)]
    sized = engine.sized_for(longest)
    return held or ([sized] if sized is not None else candidates)


def mix_capacity(parts: Sequence[tuple[float, Capacity]]) -> Capacity:
    """One replica time-sharing shapes, ``share`` of its requests each (shares sum to 1): a request of
    shape s takes 1 / rate_s of a replica-second, so it serves 1 / sum_s(share_s / rate_s) requests a
    second, and holds each shape's concurrency at capacity for the share of time that shape takes.
    A shape it cannot serve within its SLO (rate 0) makes the mix unservable (rate 0)."""
    parts = [(share, found) for share, found in parts if share > 0]
    if not parts or any(found.rate_rps <= 0 for _, found in parts):
        return Capacity(0.0, 0.0)
    rate = 1.0 / sum(share / found.rate_rps for share, found in parts)
    return Capacity(rate, sum(rate * share / found.rate_rps * found.concurrency for share, found in parts))


def choose_config(
    capacity: CapacityModel, gpu: str, load: ShapeLoad, slo: TierSlo, compiled: EngineConfig | None = None,
    incumbent: EngineConfig | None = None, incumbent_margin: float = 0.02, engine: EngineServer | None = None,
) -> tuple[EngineConfig, Capacity]:
    """The engine configuration that serves ``load`` fastest within ``slo`` on one ``gpu`` replica.

    Candidates in order: ``incumbent`` (what the pool runs now), ``compiled`` (kernels.compiler's
    result for the load's envelope), then sglang's defaults and two chunk sizes. A later candidate
    replaces an earlier one only when this model rates it > 2% faster: a restart is not spent on a
    tie, and a compile judged on a cruder evaluator (the simulator's analytic screen) cannot cost
    capacity. Without either, sglang's defaults win unless another config really helps. A candidate
    must beat the incumbent by ``incumbent_margin`` (at least 2%): what restarting its replicas costs
    (``math.inf``: the incumbent stays unless it cannot serve the load at all). ``engine``: how the
    pool's engine runs a configuration, where not as sglang does (``choose_mix_config``).
    """
    config, (found,) = choose_mix_config(capacity, gpu, ((load, slo, 1.0),), compiled, incumbent, incumbent_margin, engine)
    return config, found


def choose_mix_config(
    capacity: CapacityModel, gpu: str, mix: Sequence[tuple[ShapeLoad, TierSlo, float]], compiled: EngineConfig | None = None,
    incumbent: EngineConfig | None = None, incumbent_margin: float = 0.02, engine: EngineServer | None = None,
) -> tuple[EngineConfig, tuple[Capacity, ...]]:
    """``choose_config`` for a pool that serves several shapes, ``(load, its strictest tier's SLO, share
    of the pool's requests)`` each: candidates are judged by the mix's rate (``mix_capacity``), with the
    same order and 2% margin. Returns the configuration and each shape's capacity under it alone.
    ``engine``: how the pool's engine runs a configuration (kernels.engine_servers; None: as sglang). A
    candidate is judged as it runs it, and one whose slots cannot all hold the mix's longest requests at
    once is left out (``runnable_candidates``): llama-server would fail requests where the capacity
    model, like sglang, has them wait."""
    candidates = runnable_candidates([load for load, _, _ in mix], compiled, incumbent, engine)

    def judged(config: EngineConfig) -> tuple[tuple[Capacity, ...], float]:
        found = tuple(capacity.estimate(gpu, as_run(config, engine), load, slo) for load, slo, _ in mix)
        return found, mix_capacity([(share, f) for (_, _, share), f in zip(mix, found, strict=True)]).rate_rps

    best_config, (best, best_rate) = candidates[0], judged(candidates[0])
    for config in candidates[1:]:
        found, rate = judged(config)
        margin = max(0.02, incumbent_margin if best_config == incumbent else 0.0)
        if rate > 0 and (best_rate == 0 or rate > best_rate * (1 + margin)):  # margin may be inf: keep unless it serves nothing
            best_config, best, best_rate = config, found, rate
    return best_config, best
