"""Evaluators: score one engine configuration on one traffic shape.

All return `Metrics` for the whole replica (tp x dp GPUs). The performance model (`PerfModelEvaluator`)
is the default: it bisects, on a 2% grid of rates, the largest Poisson rate whose simulated p99 TTFT
and TPOT meet the shape's SLOs, and it can `screen` a candidate with one simulation (can it exceed a
given rate at all?) before the search pays for the bisection. `ReplayEvaluator` replays concrete
requests (a trace, prefix hash ids included) through the same engine on a virtual clock;
`ProbeEvaluator` hands the configuration to a caller-supplied probe that starts a real replica and
replays a short workload."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from kernels.catalog import GpuSpec, ModelSpec
from kernels.compiler.shape import TrafficShape
from kernels.config import EngineConfig
from kernels.engine import Engine
from kernels.engine_types import EngineRequest
from kernels.perf import IterationShape, PerfModel
from kernels.predict import RATE_BRACKET, Prediction, Workload, saturated_rate_rps, simulate

BOTTLENECKS = ("memory-bound", "compute-bound", "kv-capacity", "queueing")
_SIM_REQUESTS = 240  # simulated requests per bisection step: p99 over 240 is the 3rd-worst request
_KV_FULL = 0.85
_SLO_SLACK = 0.5  # both p99s under half their SLO at the best rate: capacity, not latency, caps it
_RATE_STEP = 1.02  # the rate grid (req/s per replica): goodput is the largest 1.02**k meeting both SLOs
_LADDERS_KEPT = 64  # configurations whose simulations an evaluator remembers


@dataclass(frozen=True, slots=True)
class Metrics:
    """What an evaluator measured for one configuration (whole replica unless `_per_gpu`)."""

    goodput_rps: float  # largest request rate meeting both p99 SLOs
    goodput_rps_per_gpu: float
    throughput_tokens_s: float  # prompt + output tokens/s at that rate
    ttft_p99_s: float
    tpot_p99_s: float
    cost_per_mtok: float  # USD per million (prompt + output) tokens at that rate; inf when goodput is 0
    kv_usage: float
    bottleneck: str  # one of BOTTLENECKS: what stops the rate from going higher

    def to_dict(self) -> dict[str, float | str]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, object]) -> Metrics:
        return cls(**{k: (v if k == "bottleneck" else float(v)) for k, v in values.items() if k in cls.__slots__})  # type: ignore[arg-type]


class Evaluator(Protocol):
    """Scores a configuration. `name` goes into the trial store: candidates are only compared with
    incumbents scored by the same evaluator."""

    name: str
    # Bumped when the same configuration on the same shape would score differently (a change of the
    # performance model, say): it is part of a trial's hardware fingerprint, so a store's older trials
    # seed a search but are evaluated again, and older artefacts are not found.
    version: int
    noise_margin: float  # relative gain below which a challenger does not replace the incumbent

    def evaluate(self, model: ModelSpec, gpu: GpuSpec, config: EngineConfig, shape: TrafficShape) -> Metrics: ...


@runtime_checkable
class Screening(Protocol):
    """An evaluator that can tell, for much less than an evaluation, that a configuration's goodput
    cannot exceed `goodput_rps` (whole replica): the first stage of a successive-halving search."""

    def screen(self, model: ModelSpec, gpu: GpuSpec, config: EngineConfig, shape: TrafficShape, goodput_rps: float) -> str | None:
        """Why the goodput cannot exceed `goodput_rps`, or None when it might (then evaluate it)."""
        ...


def shape_workloads(shape: TrafficShape, config: EngineConfig) -> tuple[list[Workload], list[float]]:
    """The shape as a weighted mix of fixed-length workloads (prompt x output quantile x domain).
    With prefix caching the shared part of a prompt is neither recomputed nor held twice, so the
    prompt is charged at its unshared length (EngineConfig.prefilled_share)."""
    keep = config.prefilled_share(shape.prefix_share)
    workloads: list[Workload] = []
    weights: list[float] = []
    domains = shape.domain_weights()
    for isl, osl, (domain, share) in itertools.product(shape.prompt_tokens, shape.output_tokens, domains.items()):
        workloads.append(Workload(max(1, round(isl * keep)), osl, domain=domain, num_requests=_SIM_REQUESTS))
        weights.append(share)
    return workloads, weights


class PerfModelEvaluator:
    """The default evaluator: the calibrated performance model driving the engine on a virtual clock.

    Goodput is the largest rate 1.02**k req/s (k an integer between 1e-3 and 1.2 times the offline
    throughput) at which a simulation of the shape meets both p99 SLOs, found by bisection on k. On a
    fixed grid the answer does not depend on which rates were simulated first, so a `screen` at the
    rate a candidate must beat (one simulation) and the bisection that follows for a contender share
    their simulations and agree: a screened-out candidate would have scored no higher."""

    name = "perf-model"
    version = 1
    noise_margin = 0.03  # the rate grid has 2% steps

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._ladders: dict[tuple[str, str, EngineConfig, TrafficShape], _RateLadder] = {}

    def evaluate(self, model: ModelSpec, gpu: GpuSpec, config: EngineConfig, shape: TrafficShape) -> Metrics:
        ladder = self._ladder(model, gpu, config, shape)
        step = ladder.best()
        if step is None:
            at_rate = simulate(ladder.perf, [_with_rate(w, 0.05) for w in ladder.workloads], ladder.weights, seed=self.seed)
            return metrics_from_prediction(ladder.perf, shape, 0.0, at_rate)
        return metrics_from_prediction(ladder.perf, shape, _RATE_STEP ** step, ladder.run(step))

    def screen(self, model: ModelSpec, gpu: GpuSpec, config: EngineConfig, shape: TrafficShape, goodput_rps: float) -> str | None:
        return self._ladder(model, gpu, config, shape).cannot_exceed(goodput_rps)

    def _ladder(self, model: ModelSpec, gpu: GpuSpec, config: EngineConfig, shape: TrafficShape) -> _RateLadder:
        key = (model.name, gpu.name, config, shape)
        if key not in self._ladders:
            if len(self._ladders) >= _LADDERS_KEPT:
                del self._ladders[next(iter(self._ladders))]
            self._ladders[key] = _RateLadder.for_config(model, gpu, config, shape, self.seed)
        return self._ladders[key]


@dataclass(slots=True)
class _RateLadder:
    """One configuration's simulations on the rate grid, each run at most once. `low` (a trickle) and
    `high` (the saturated throughput, as `kernels.predict.max_rate_under_slo` brackets it) bound the
    search: past the throughput a queue grows without end, which a finite simulation hides, so `high`
    is never run and counts as missing the SLOs."""

    perf: PerfModel
    workloads: list[Workload]
    weights: list[float]
    shape: TrafficShape
    seed: int
    low: int
    high: int
    runs: dict[int, Prediction] = field(default_factory=dict)

    @classmethod
    def for_config(cls, model: ModelSpec, gpu: GpuSpec, config: EngineConfig, shape: TrafficShape, seed: int) -> _RateLadder:
        perf = PerfModel(model, gpu, config)
        workloads, weights = shape_workloads(shape, perf.config)
        ceiling = saturated_rate_rps(perf, workloads, weights, seed)
        low = math.ceil(math.log(RATE_BRACKET[0] * ceiling, _RATE_STEP))
        high = max(low + 1, math.floor(math.log(RATE_BRACKET[1] * ceiling, _RATE_STEP)))
        return cls(perf, workloads, weights, shape, seed, low, high)

    def run(self, step: int) -> Prediction:
        if step not in self.runs:
            rate = _RATE_STEP ** step
            self.runs[step] = simulate(self.perf, [_with_rate(w, rate) for w in self.workloads], self.weights, seed=self.seed)
        return self.runs[step]

    def meets(self, step: int) -> bool:
        if step >= self.high:
            return False
        at = self.run(step)
        return at.ttft_p99_s <= self.shape.ttft_p99_s and at.tpot_p99_s <= self.shape.tpot_p99_s

    def best(self) -> int | None:
        """The largest step meeting both SLOs, None when even the trickle misses them: bisection
        between the largest step known to pass and the smallest known to miss above it."""
        passed = [s for s in self.runs if self.low <= s < self.high and self.meets(s)]
        if passed:
            good = max(passed)
        elif self.meets(self.low):
            good = self.low
        else:
            return None
        bad = min((s for s in self.runs if s > good and not self.meets(s)), default=self.high)
        while bad - good > 1:
            middle = (good + bad) // 2
            good, bad = (middle, bad) if self.meets(middle) else (good, middle)
        return good

    def cannot_exceed(self, goodput_rps: float) -> str | None:
        if goodput_rps <= 0:
            return None
        step = math.floor(math.log(goodput_rps, _RATE_STEP) + 1e-9) + 1  # the first grid rate above goodput_rps
        if step >= self.high:
            return (f"cannot exceed {goodput_rps:.3g} req/s: rates are searched up to {_RATE_STEP ** (self.high - 1):.3g} "
                    f"req/s, below its saturated throughput (a finite simulation past it hides the growing queue)")
        if step < self.low or self.meets(step):
            return None
        at = self.run(step)
        return (f"misses the p99 SLOs at {_RATE_STEP ** step:.3g} req/s (TTFT {at.ttft_p99_s:.3g} s, TPOT "
                f"{at.tpot_p99_s * 1e3:.3g} ms), the least rate that could win over {goodput_rps:.3g} req/s")


def _with_rate(w: Workload, rate: float) -> Workload:
    return Workload(w.isl, w.osl, rate=rate, domain=w.domain, num_requests=w.num_requests)


def metrics_from_prediction(perf: PerfModel, shape: TrafficShape, goodput_rps: float, at_rate: Prediction) -> Metrics:
    num_gpus = perf.config.num_gpus
    tokens_per_request = shape.mean_prompt_tokens + shape.mean_output_tokens
    tokens_s = goodput_rps * tokens_per_request
    dollars_per_s = perf.gpu.price_per_gpu_hour * num_gpus / 3600.0
    cost = dollars_per_s / tokens_s * 1e6 if tokens_s > 0 else math.inf
    return Metrics(
        goodput_rps=goodput_rps, goodput_rps_per_gpu=goodput_rps / num_gpus, throughput_tokens_s=tokens_s,
        ttft_p99_s=at_rate.ttft_p99_s, tpot_p99_s=at_rate.tpot_p99_s, cost_per_mtok=cost,
        kv_usage=at_rate.kv_usage, bottleneck=classify_bottleneck(perf, shape, at_rate),
    )


def classify_bottleneck(perf: PerfModel, shape: TrafficShape, at_rate: Prediction) -> str:
    """Why the rate cannot go higher. When neither p99 is near its SLO the rate is capped by the
    replica's capacity: KV when the pool, not max_running_requests, limits the batch. Otherwise TTFT
    binding means requests queue, and TPOT binding means the decode iteration at the observed batch
    is memory- or compute-bound."""
    ttft_ratio, tpot_ratio = at_rate.ttft_p99_s / shape.ttft_p99_s, at_rate.tpot_p99_s / shape.tpot_p99_s
    held = shape.mean_prompt_tokens + shape.mean_output_tokens / 2
    kv_batch = perf.kv_capacity_tokens / held
    if at_rate.kv_usage >= _KV_FULL or (max(ttft_ratio, tpot_ratio) < _SLO_SLACK and kv_batch < perf.config.max_running_requests):  # type: ignore[operator]
        return "kv-capacity"
    if ttft_ratio >= tpot_ratio:
        return "queueing"
    batch = max(1, round(at_rate.mean_batch))
    context = round(batch * held)
    it = perf.iteration_time(IterationShape(batch, context, 0, 0.0))
    return "compute-bound" if it.bound == "compute" else "memory-bound"


class AnalyticEvaluator:
    """Closed-form screening (milliseconds, no simulation): the largest steady decode batch whose
    iteration time per emitted token meets the TPOT SLO, on the shape's mean lengths, with the
    prefill that replaces finished requests mixed in; 0 when the longest prompt alone misses TTFT.
    Blind to queueing and tails, so it ranks configurations more than it predicts rates."""

    name = "analytic"
    version = 1
    noise_margin = 0.01

    def evaluate(self, model: ModelSpec, gpu: GpuSpec, config: EngineConfig, shape: TrafficShape) -> Metrics:
        perf = PerfModel(model, gpu, config)
        keep = perf.config.prefilled_share(shape.prefix_share)
        isl, osl = shape.mean_prompt_tokens * keep, shape.mean_output_tokens
        domain = max(shape.domain_weights().items(), key=lambda item: item[1])[0]
        held = isl + osl / 2
        cap = max(1, min(int(perf.config.max_running_requests), int(perf.kv_capacity_tokens // held)))  # type: ignore[arg-type]
        budget = min(perf.config.max_prefill_tokens, int(perf.config.chunked_prefill_size or perf.config.max_prefill_tokens))

        def tpot_s(batch: int) -> float:
            per_step = perf.spec_tokens_per_step(domain, batch)
            prefill = min(batch * isl * per_step / osl, budget)
            it = perf.iteration_time(IterationShape(batch, int(batch * held), int(prefill), prefill * isl / 2, 1))
            return it.total_s / per_step

        ttft = perf.prefill_time_s(max(1, round(max(shape.prompt_tokens) * keep))) + perf.request_overhead_s
        low, high = 0, cap
        while low < high:  # largest batch meeting the TPOT SLO (tpot grows with the batch)
            middle = (low + high + 1) // 2
            low, high = (middle, high) if tpot_s(middle) <= shape.tpot_p99_s else (low, middle - 1)
        batch = low if ttft <= shape.ttft_p99_s else 0
        tpot = tpot_s(max(1, batch))
        rate = perf.config.dp * batch / (osl * tpot)
        usage = min(1.0, batch * held / max(1, perf.kv_capacity_tokens))
        prediction = Prediction(ttft, ttft, ttft, tpot, tpot, tpot, 0.0, 0.0, 0.0, 0.0, rate, usage, float(batch), "analytic")
        return metrics_from_prediction(perf, shape, rate, prediction)


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    """One request of a replayed workload (from a trace): arrival and token counts."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    domain: str = "chat"
    prefix_hash_ids: tuple[int, ...] = ()


class ReplayEvaluator:
    """Replays concrete requests, prefix hash ids included, through the engine on a virtual clock at
    increasing time compression; goodput is the fastest replay whose p99s meet the SLOs."""

    name = "replay"
    version = 1
    noise_margin = 0.05

    def __init__(self, requests: Sequence[ReplayRequest], speedups: Sequence[float] = (0.25, 0.5, 1, 2, 4, 8, 16)) -> None:
        if not requests:
            raise ValueError("a replay needs at least one request")
        self.requests = sorted(requests, key=lambda r: r.arrival_s)
        self.speedups = tuple(sorted(speedups))

    def evaluate(self, model: ModelSpec, gpu: GpuSpec, config: EngineConfig, shape: TrafficShape) -> Metrics:
        perf = PerfModel(model, gpu, config)
        span_s = max(self.requests[-1].arrival_s - self.requests[0].arrival_s, 1e-3)
        best_rate = 0.0
        best: tuple[float, float, float] | None = None  # p99 TTFT, p99 TPOT, KV usage at best_rate
        for speedup in self.speedups:
            observed = self._replay(perf, speedup)
            if observed[0] > shape.ttft_p99_s or observed[1] > shape.tpot_p99_s:
                best = best or observed
                break
            best_rate, best = len(self.requests) * speedup / span_s, observed
        assert best is not None  # the loop runs at least once
        ttft, tpot, kv = best
        prediction = Prediction(ttft, ttft, ttft, tpot, tpot, tpot, 0.0, 0.0, 0.0, 0.0, best_rate, kv, 1.0, "replay")
        return metrics_from_prediction(perf, shape, best_rate, prediction)

    def _replay(self, perf: PerfModel, speedup: float) -> tuple[float, float, float]:
        """p99 TTFT, p99 TPOT and mean KV usage of one data-parallel rank, which gets every dp-th request."""
        engine = Engine(perf, perf.config)
        requests = self.requests[:: perf.config.dp]
        start = requests[0].arrival_s
        arrivals = [(r.arrival_s - start) / speedup for r in requests]
        first: dict[str, float] = {}
        done: dict[str, float] = {}
        usage: list[float] = []
        now = 0.0
        for index, (req, at) in enumerate(zip(requests, arrivals)):
            now = self._advance(engine, now, at, first, done, usage)
            engine.add_request(EngineRequest(str(index), req.prompt_tokens, req.output_tokens, req.domain, req.prefix_hash_ids, at), at)
        self._advance(engine, now, math.inf, first, done, usage)
        ttft = [first[str(i)] - a + perf.request_overhead_s for i, a in enumerate(arrivals) if str(i) in first]
        tpot = [(done[str(i)] - first[str(i)]) / (r.output_tokens - 1) for i, r in enumerate(requests)
                if r.output_tokens > 1 and str(i) in done]
        return float(np.percentile(ttft, 99)), float(np.percentile(tpot or [0.0], 99)), float(np.mean(usage or [0.0]))

    @staticmethod
    def _advance(engine: Engine, now: float, until: float, first: dict[str, float], done: dict[str, float], usage: list[float]) -> float:
        """Run the engine until `until` (or idle), recording first-token and finish instants."""
        while now < until:
            plan = engine.schedule(now, horizon_s=min(until - now, 3600.0))
            if plan is None:
                break
            now = plan.ended_at
            outputs = engine.update(plan, now)
            for req_id in outputs.first_token_req_ids:
                first[req_id] = now
            for req_id in outputs.finished_req_ids:
                done[req_id] = now
            usage.append(engine.stats(now).token_usage)
        return max(now, until) if until != math.inf else now


ProbeFn = Callable[[ModelSpec, GpuSpec, EngineConfig, TrafficShape], Metrics]


class ProbeEvaluator:
    """A live probe for GPU machines: `probe` starts a replica with the candidate's sglang arguments,
    replays a short workload of the shape against it and returns the measured Metrics. Polymorph's
    fleet actuators and load-test runner implement it; kernels only defines the contract."""

    name = "live-probe"
    version = 1
    noise_margin = 0.08  # measured runs are noisy; demand a clear win

    def __init__(self, probe: ProbeFn) -> None:
        self.probe = probe

    def evaluate(self, model: ModelSpec, gpu: GpuSpec, config: EngineConfig, shape: TrafficShape) -> Metrics:
        return self.probe(model, gpu, config, shape)


def evaluator_by_name(name: str) -> Evaluator:
    """The evaluators that need no inputs beyond the shape: "perf-model" or "analytic"."""
    by_name: dict[str, Callable[[], Evaluator]] = {"perf-model": PerfModelEvaluator, "analytic": AnalyticEvaluator}
    if name not in by_name:
        raise ValueError(f"unknown evaluator {name!r}; choose one of {', '.join(by_name)}")
    return by_name[name]()
