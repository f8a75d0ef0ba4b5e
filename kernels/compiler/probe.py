"""Screen with the model, confirm by measurement (the `probe` evaluator, llama.cpp).

`probe_compile` ranks llama.cpp's knobs (`--parallel`, `-c`, `-b`/`-ub`, `--cache-reuse` or
`--no-cache-prompt`: the `EngineConfig` fields `to_llamacpp_args` renders) with the performance model,
keeps the best `budget - 1` candidates that render distinct command lines, and hands them and
llama-server's defaults to a `Prober` (loadtest/probe.py starts a real llama-server). The chosen
configuration is the best *measured* one (goodput, then lower p99 TTFT); the default is always
measured, so the choice is never worse than it on the measurement. Every measured trial is stored
with the model's prediction beside the measurement and the fingerprint of what it ran on.

Warm start: a candidate already measured on the same engine and version, hardware and weights, for the
same shape and ladder size, is taken from the store instead of measured again (`reused`). A fitted
correction for the fingerprint (`polymorph kernels fit --store`, probe_fit.py) scales the predicted
goodput the result reports and starts the default's ladder near it; it does not change the ranking
(one factor for every candidate), and the store keeps the model's own prediction so a refit sees it.

vLLM (`engine="vllm"`): the same flow over the knobs `EngineConfig.vllm_flags` renders that matter on
its CPU build (`--max-num-seqs`, `--max-num-batched-tokens`, prefix caching), predicted as vLLM runs
them on the device when a flag is absent (kernels.engine_servers: on CPU, 128 sequences and 2048
batched tokens per worker).

sglang (`engine="sglang"`, on GPUs): the same flow over `--max-running-requests`,
`--chunked-prefill-size` and the radix cache, which the performance model predicts natively (it
models sglang's scheduler, auto-resolved knobs included). Where it runs is a `ProbeTarget`: the
engine's interpreter (sglang never enters Polymorph's environment), the weights and the GPUs.

kernels starts no process: the prober is injected (the `polymorph compile` wiring supplies it)."""

from __future__ import annotations

import itertools
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from kernels.catalog import GpuSpec, ModelSpec
from kernels.compiler.evaluators import Metrics, PerfModelEvaluator
from kernels.compiler.measurement import Measurement, ProbeCorrection, ProbeFingerprint, ProbeLadder
from kernels.compiler.shape import TrafficShape, shape_fingerprint
from kernels.compiler.store import ProbeTrialRecord, TrialStore, config_key
from kernels.config import EngineConfig
from kernels.engine_servers import engine_server

EVALUATOR = "probe"
_PARALLEL = (None, 1, 2, 8)
_CONTEXT_MULTIPLES = (None, 4)  # -c as a multiple of the model's context (None: the model's context)
_BATCH = (None, 256)  # -b/-ub (None: llama-server's 2048/512)
_PLACEHOLDER_MODEL = "MODEL"  # candidates are compared by their rendered flags, whatever the file
_DEFAULT_START_DIVISOR = 8
ENGINES = ("llamacpp", "vllm", "sglang")
CPU_ENGINES = ("llamacpp", "vllm")  # what this package's tests and the probe bench can run without a GPU
_VLLM_SEQS = (None, 1, 4, 16)
_VLLM_BATCHED_TOKENS = (None, 256)
_CORRECTED_START_DIVISOR = 2  # a corrected prediction is near the measurement: start one ladder step below it


_SGLANG_RUNNING = (None, 32, 128, 512)  # --max-running-requests (None: sglang sizes it from the KV pool)
_SGLANG_CHUNK = (None, 2048, 8192)  # --chunked-prefill-size (None: sglang's per-GPU default)


@dataclass(frozen=True, slots=True)
class ProbeTarget:
    """Where a probe runs its engine. ``command``: the interpreter (vllm, sglang) or binary (llamacpp);
    empty: the installed CPU engine, or $POLYMORPH_SGLANG_PYTHON for sglang. ``model_path``: the
    weights (None: the tiny model; sglang needs one). ``device_kind``: ``cpu`` or a GPU kind, whose
    ``device_ids`` the replica gets (``CUDA_VISIBLE_DEVICES``), as a pool's replica on those devices."""

    engine: str
    command: tuple[str, ...] = ()
    model_path: str | None = None
    device_kind: str = "cpu"
    device_ids: tuple[str, ...] = ()


class Prober(Protocol):
    """Starts a real replica with `config`, replays `shape` at the ladder's rates, stops it."""

    def fingerprint(self) -> ProbeFingerprint: ...

    def measure(self, config: EngineConfig, shape: TrafficShape, ladder: ProbeLadder) -> Measurement: ...


@dataclass(frozen=True, slots=True)
class ProbeTrial:
    config: EngineConfig
    engine_args: tuple[str, ...]  # the engine's flags for `config`, without the model, host and port
    predicted: Metrics
    measured: Measurement
    default: bool
    chosen: bool = False
    trial_id: int | None = None  # row in the store's probe_trials (an earlier run's when reused)
    reused: bool = False  # taken from the store (warm start), not measured by this run

    def to_json(self, engine: str = "llamacpp") -> dict[str, object]:
        return {"trial_id": self.trial_id, "default": self.default, "chosen": self.chosen, "reused": self.reused,
                "config": self.config.to_dict(),
                f"{engine}_args": list(self.engine_args), "predicted": self.predicted.to_dict(),
                "measured": self.measured.to_dict()}


@dataclass(frozen=True, slots=True)
class ProbeResult:
    chosen: ProbeTrial
    baseline: ProbeTrial
    trials: tuple[ProbeTrial, ...]
    num_screened: int  # distinct command lines the performance model ranked
    shape: TrafficShape  # as measured (lengths fitted to the model's context)
    requested_shape: TrafficShape
    fingerprint: ProbeFingerprint
    ladder: ProbeLadder  # the default's; the others start at the default's measured goodput (their steps say so)
    run_id: str
    elapsed_s: float
    store_path: str | None
    correction: ProbeCorrection | None = None  # the fitted correction in force for the fingerprint, if any

    @property
    def num_reused(self) -> int:
        return sum(1 for t in self.trials if t.reused)

    def to_json(self) -> dict[str, object]:
        """The `polymorph compile --evaluator probe --json` document."""
        engine = self.fingerprint.engine
        trials = [t.to_json(engine) for t in self.trials]
        if self.correction is not None:
            for trial, as_json in zip(self.trials, trials):
                as_json["corrected_goodput_rps"] = self.correction.goodput_rps(trial.predicted.goodput_rps)
        return {
            "evaluator": EVALUATOR, "engine": engine, "config": self.chosen.config.to_dict(),
            f"{engine}_args": list(self.chosen.engine_args), "predicted": self.chosen.predicted.to_dict(),
            "measured": self.chosen.measured.to_dict(), "baseline": self.baseline.to_json(engine),
            "trials": trials, "screened": self.num_screened,
            "warm_start": {"reused": self.num_reused, "measured": len(self.trials) - self.num_reused},
            "correction": None if self.correction is None else self.correction.to_dict(),
            "shape": self.requested_shape.name, "shape_fingerprint": shape_fingerprint(self.requested_shape),
            "measured_shape": self.shape.to_dict(), "fingerprint": self.fingerprint.to_dict(),
            "ladder": {"start_rps": self.ladder.start_rps, "factor": self.ladder.factor, "max_steps": self.ladder.max_steps,
                       "requests_per_step": self.ladder.requests_per_step, "min_attainment": self.ladder.min_attainment},
            "run_id": self.run_id, "store": self.store_path, "elapsed_s": self.elapsed_s,
        }


def fit_to_context(shape: TrafficShape, max_context: int) -> TrafficShape:
    """The shape with every length scaled by one factor so that its largest request is at most half the
    model's context (two fit in llama-server's default pool); unchanged when it already is."""
    scale = min(1.0, (max_context // 2) / shape.max_request_tokens)
    if scale >= 1.0:
        return shape
    return replace(shape, prompt_tokens=tuple(max(1, int(t * scale)) for t in shape.prompt_tokens),
                   output_tokens=tuple(max(2, int(t * scale)) for t in shape.output_tokens))


def _distinct(configs: list[EngineConfig], flags_of: Callable[[EngineConfig], tuple[str, ...]]) -> list[EngineConfig]:
    """One configuration per distinct command line, in order (the engine sees nothing else)."""
    distinct: dict[tuple[str, ...], EngineConfig] = {}
    for config in configs:
        distinct.setdefault(flags_of(config), config)
    return list(distinct.values())


def _vllm_flags(config: EngineConfig) -> tuple[str, ...]:
    return tuple(config.vllm_flags())


def llamacpp_candidates(model: ModelSpec) -> list[EngineConfig]:
    """llama-server's defaults first, then the grid of its knobs, one per distinct command line."""
    configs = [EngineConfig()]
    for parallel, multiple, batch, reuse in itertools.product(_PARALLEL, _CONTEXT_MULTIPLES, _BATCH, (True, False)):
        context = None if multiple is None else model.max_context * multiple
        configs.append(EngineConfig(max_running_requests=parallel, max_total_tokens=context, chunked_prefill_size=batch,
                                    enable_prefix_caching=reuse))
    return _distinct(configs, llamacpp_flags)


def llamacpp_flags(config: EngineConfig) -> tuple[str, ...]:
    """llama-server's flags for `config`, without `-m MODEL` (the prober adds the model, threads, host and port)."""
    args = config.to_llamacpp_args(_PLACEHOLDER_MODEL)
    return tuple(args[2:])


def vllm_candidates() -> list[EngineConfig]:
    """vLLM's defaults first, then its sequence and batched-token limits with prefix caching on and off."""
    configs = [EngineConfig()]
    for seqs, batched, caching in itertools.product(_VLLM_SEQS, _VLLM_BATCHED_TOKENS, (True, False)):
        configs.append(EngineConfig(max_running_requests=seqs, chunked_prefill_size=batched, enable_prefix_caching=caching))
    return _distinct(configs, _vllm_flags)


def sglang_candidates() -> list[EngineConfig]:
    """sglang's defaults first, then its batch and prefill-chunk limits with the radix cache on and off."""
    configs = [EngineConfig()]
    for running, chunk, caching in itertools.product(_SGLANG_RUNNING, _SGLANG_CHUNK, (True, False)):
        configs.append(EngineConfig(max_running_requests=running, chunked_prefill_size=chunk, enable_prefix_caching=caching))
    return _distinct(configs, sglang_flags)


def sglang_flags(config: EngineConfig) -> tuple[str, ...]:
    """sglang's flags for `config`, without `--model-path MODEL` (the prober adds the model, host and port)."""
    return tuple(config.to_sglang_args(_PLACEHOLDER_MODEL)[2:])


def engine_knobs(engine: str, model: ModelSpec, gpu: GpuSpec) -> tuple[list[EngineConfig], Callable[[EngineConfig], tuple[str, ...]],
                                                                         Callable[[EngineConfig], EngineConfig]]:
    """(candidates, their flags, what the engine runs for each) of `engine` on `gpu`: its own choices
    where a flag is absent (kernels.engine_servers; sglang's the model resolves itself)."""
    flags: Callable[[EngineConfig], tuple[str, ...]]
    if engine == "llamacpp":
        candidates, flags = llamacpp_candidates(model), llamacpp_flags
    elif engine == "vllm":
        candidates, flags = vllm_candidates(), _vllm_flags
    elif engine == "sglang":
        candidates, flags = sglang_candidates(), sglang_flags
    else:
        raise ValueError(f"a probe measures on {' or '.join(ENGINES)}, not {engine!r}")
    server = engine_server(engine, gpu, model)
    return candidates, flags, (lambda config: config) if server is None else server.runs


def probe_compile(
    model: ModelSpec, gpu: GpuSpec, shape: TrafficShape, budget: int, prober: Prober,
    requests_per_step: int = 12, store: TrialStore | None = None,
    progress: Callable[[str], None] = lambda line: None, clock: Callable[[], float] = time.monotonic,
    wall_clock: Callable[[], float] = time.time, engine: str = "llamacpp",
) -> ProbeResult:
    """Rank the engine's configurations by predicted goodput, measure the default and the best
    `budget - 1` others, choose the best measured. `budget` counts candidates (>= 1); those measured
    before on the same fingerprint are taken from the store."""
    if budget < 1:
        raise ValueError(f"a probe compile needs a budget of at least 1 measurement, got {budget}")
    candidates, flags_of, as_runs = engine_knobs(engine, model, gpu)
    started_s = clock()
    run_id = uuid.uuid4().hex[:12]
    fitted = fit_to_context(shape, model.max_context)
    model_eval = PerfModelEvaluator()
    fingerprint = prober.fingerprint()
    stored = _reusable(store, fingerprint, shape, fitted, requests_per_step)
    correction = None if store is None else store.probe_correction(fingerprint.digest(), model.name)
    progress(f"screening {len(candidates)} {engine} configurations with the performance model")
    default, default_prediction = candidates[0], model_eval.evaluate(model, gpu, as_runs(candidates[0]), fitted)
    ranked: list[tuple[EngineConfig, Metrics]] = []
    for config in candidates[1:]:
        runs = as_runs(config)
        # Successive halving: once `budget - 1` are ranked, one simulation tells whether a candidate can
        # beat the last of them; only those that can are bisected in full.
        if len(ranked) >= budget - 1 and (budget == 1 or model_eval.screen(model, gpu, runs, fitted, ranked[-1][1].goodput_rps)):
            continue
        ranked.append((config, model_eval.evaluate(model, gpu, runs, fitted)))
        ranked = sorted(ranked, key=lambda pair: -pair[1].goodput_rps)[: budget - 1]
    to_measure = [(default, default_prediction), *ranked]
    num_reused = sum(1 for config, _ in to_measure if config_key(config) in stored)
    progress(f"warm start: {num_reused} of {len(to_measure)} candidates were measured before on this engine, hardware and "
             f"weights ({fingerprint.digest()}); measuring {len(to_measure) - num_reused}" if num_reused
             else f"cold start: no stored measurement of these candidates on {fingerprint.digest()}")
    if correction is not None:
        progress(f"correction in force: predicted goodput x {correction.goodput_factor:.3g} (fitted on {correction.num_fit} trials)")
    # The model predicts batched decode on one CPU core several times too fast, so on a CPU the default's
    # ladder starts well below its figure; on a GPU (the model's calibration) or with a fitted correction,
    # one step below it. The others start at the default's measured goodput (the rate that matters: can
    # they beat it?) and only climb. A rate seeds its requests, so equal rates replay equal requests.
    if correction is not None:
        start_rps = correction.goodput_rps(default_prediction.goodput_rps) / _CORRECTED_START_DIVISOR
    else:
        start_rps = max(default_prediction.goodput_rps, 0.1) / (_DEFAULT_START_DIVISOR if gpu.name == "cpu" else _CORRECTED_START_DIVISOR)
    ladder = ProbeLadder(start_rps=_round_rate(start_rps), requests_per_step=requests_per_step)
    default_ladder = ladder
    trials: list[ProbeTrial] = []
    for index, (config, prediction) in enumerate(to_measure):
        flags = flags_of(config)
        earlier = stored.get(config_key(config))
        measured = earlier.measured if earlier is not None else prober.measure(config, fitted, ladder)
        if index == 0:
            # A candidate that misses where the default passes cannot be chosen: no need to look below.
            ladder = replace(ladder, start_rps=measured.goodput_rps or min(s.rate_rps for s in measured.steps), max_steps_down=0)
        trials.append(ProbeTrial(config, flags, prediction, measured, default=index == 0, reused=earlier is not None,
                                 trial_id=None if earlier is None else earlier.trial_id))
        predicted = f"predicted {prediction.goodput_rps:.3g}" + (
            "" if correction is None else f", corrected {correction.goodput_rps(prediction.goodput_rps):.3g}")
        source = "measured goodput" if earlier is None else f"stored goodput (trial {earlier.trial_id}, run {earlier.run_id})"
        progress(f"[{index + 1}/{len(to_measure)}] {' '.join(flags)}: {source} "
                 f"{measured.goodput_rps:.3g} req/s ({predicted}), ttft p99 {measured.ttft_p99_s:.3g} s, "
                 f"tpot p99 {measured.tpot_p99_s * 1e3:.3g} ms, {measured.wall_s:.0f} s")
    best = max(range(len(trials)), key=lambda i: (trials[i].measured.goodput_rps, -trials[i].measured.ttft_p99_s, -i))
    trials[best] = replace(trials[best], chosen=True)
    if store is not None:
        now = wall_clock()
        # A reused trial keeps its row: the store holds each measurement once, so a fit does not count it twice.
        trials = [t if t.reused else replace(t, trial_id=store.record_probe_trial(
                      run_id, now, model, gpu, shape, fitted, t.config, t.predicted, t.measured, fingerprint, t.default, t.chosen))
                  for t in trials]
    return ProbeResult(
        chosen=trials[best], baseline=trials[0], trials=tuple(trials), num_screened=len(candidates), shape=fitted,
        requested_shape=shape, fingerprint=fingerprint, ladder=default_ladder, run_id=run_id, elapsed_s=clock() - started_s,
        store_path=None if store is None else str(store.path), correction=correction,
    )


def _reusable(store: TrialStore | None, fingerprint: ProbeFingerprint, shape: TrafficShape, fitted: TrafficShape,
              requests_per_step: int) -> dict[str, ProbeTrialRecord]:
    """Stored measurements by configuration key; the newest of a configuration wins."""
    if store is None:
        return {}
    return {config_key(t.config): t for t in store.reusable_probe_trials(fingerprint, shape, fitted, requests_per_step)}


def _round_rate(rate_rps: float) -> float:
    """Two significant figures, so the ladder's rates (and the requests' seeds) read plainly."""
    return float(f"{rate_rps:.2g}") if rate_rps > 0 and math.isfinite(rate_rps) else 0.1
