"""compile_config: search the engine configuration that maximises an objective for a traffic shape.

The loop: evaluate sglang's default (the baseline and first incumbent); evaluate seeds from the trial
store (the best configurations of the nearest stored shapes: a warm start); then ask the proposer
for batches of candidates until it has nothing new, or the trial or time budget runs out. Every
candidate is parsed, checked against the search space and passed through the gates before it is
evaluated; every outcome is stored. A candidate replaces the incumbent only when it beats it by more
than the evaluator's noise margin. With an evaluator that can screen (the performance model), a
candidate is first asked whether it can exceed the goodput it needs to change the round's outcome
(the incumbent's plus the margin, or the round's best so far; one simulation): only contenders are
evaluated in full (successive halving), so the search takes the same path for a fraction of the cost."""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from kernels.catalog import GpuSpec, ModelSpec, get_gpu, get_model
from kernels.compiler.evaluators import Evaluator, Metrics, PerfModelEvaluator, Screening
from kernels.compiler.gates import GateResult, ParserGate, check_constraints, check_memory, sglang_model_path
from kernels.compiler.proposers import AgentProposer, CoordinateProposer, Proposal, Proposer, SearchContext, TrialView
from kernels.compiler.shape import TrafficShape, get_shape, shape_distance, shape_fingerprint
from kernels.compiler.space import SearchSpace, config_from_dict, default_space, engine_default, in_space
from kernels.compiler.store import Fingerprints, TrialRecord, TrialStore, config_key, fingerprints_for
from kernels.config import EngineConfig, SglangTarget

OBJECTIVES = ("goodput", "cost")
_BATCH_SIZE = 4  # candidates per proposer round
_NUM_SEED_SHAPES = 2  # nearest stored shapes a warm start draws from
_SEEDS_PER_SHAPE = 2


@dataclass(frozen=True, slots=True)
class Budget:
    """When a search stops: `trials` evaluations (the baseline included; gate rejections are free) or
    `seconds`, whichever comes first. A cold search otherwise runs until the proposer has nothing new;
    a warm-started one also stops after `warm_patience_rounds` proposer rounds without a better candidate."""

    trials: int = 60
    seconds: float = 120.0
    warm_patience_rounds: int = 2

    def __post_init__(self) -> None:
        if self.trials < 1 or not self.seconds > 0 or self.warm_patience_rounds < 1:
            raise ValueError(f"budget needs trials >= 1, seconds > 0 and warm_patience_rounds >= 1; got {self}")


@dataclass(frozen=True, slots=True)
class Trial:
    """One candidate's outcome in this run."""

    config: EngineConfig
    metrics: Metrics | None  # None: rejected by a gate (see `gates`), unparseable, or screened out
    gates: tuple[GateResult, ...]
    proposer: str
    accepted: bool = False  # became the incumbent
    reused: bool = False  # metrics came from the store (same fingerprints), not a new evaluation
    note: str = ""
    screened: bool = False  # the evaluator's screen showed it cannot win (the "screen" entry of `gates` says why)


@dataclass(frozen=True, slots=True)
class CompileResult:
    config: EngineConfig
    predicted: Metrics
    baseline_config: EngineConfig
    baseline: Metrics
    trials: int  # evaluations run in this compile, screens included (reused store entries not counted)
    num_rejected: int  # by a gate, before any evaluation
    warm_start: bool  # seeded from stored trials of other (or stale) shapes
    trials_to_best: int  # evaluations until the winner was first evaluated
    objective: str
    evaluator: str
    shape: TrafficShape
    model: str
    gpu: str
    num_gpus: int
    run_id: str
    reason: str  # why the winner won
    elapsed_s: float
    store_path: str | None = None
    history: tuple[Trial, ...] = field(default=(), repr=False)
    sglang_target: SglangTarget | None = field(default=None, repr=False)  # the release the parser gate ran, if any
    num_screened: int = 0  # evaluations stopped after the screen: they could not have won
    # one per proposer round that fell back (an agent that did not answer): a configured agent that never
    # answered is said, not hidden in the trials
    proposer_notes: tuple[str, ...] = ()

    @property
    def speedup(self) -> float:
        """Compiled over default on the objective's headline figure (goodput per GPU)."""
        base = self.baseline.goodput_rps_per_gpu
        return self.predicted.goodput_rps_per_gpu / base if base > 0 else math.inf

    def sglang_args(self) -> list[str]:
        return render_sglang_args(get_model(self.model), self.config, self.sglang_target)

    def vllm_args(self) -> list[str]:
        return self.config.to_vllm_args(sglang_model_path(get_model(self.model)))

    def to_json(self) -> dict[str, object]:
        """The `polymorph compile --json` contract."""
        return {
            "config": self.config.to_dict(), "sglang_args": self.sglang_args(), "vllm_args": self.vllm_args(),
            "predicted": self.predicted.to_dict(), "baseline": self.baseline.to_dict(), "trials": self.trials,
            "warm_start": self.warm_start, "store": self.store_path,
            "shape": self.shape.name, "shape_fingerprint": shape_fingerprint(self.shape), "objective": self.objective,
            "evaluator": self.evaluator, "rejected": self.num_rejected, "screened": self.num_screened, "reason": self.reason,
            "proposer_notes": list(self.proposer_notes),
        }


def render_sglang_args(model: ModelSpec, config: EngineConfig, target: SglangTarget | None) -> list[str]:
    """`config` as sglang arguments for `target`, with the catalog's draft checkpoint when it speculates with one."""
    draft = model.draft_model(config.speculative_algorithm) if config.speculative_algorithm else None
    return config.to_sglang_args(sglang_model_path(model), target, draft)


def score(metrics: Metrics, objective: str) -> float:
    """Higher is better: goodput per GPU, or minus the cost per million tokens."""
    if objective == "goodput":
        return metrics.goodput_rps_per_gpu
    return -metrics.cost_per_mtok


def beats(challenger: Metrics, incumbent: Metrics, objective: str, margin: float) -> bool:
    """True when `challenger` is better than `incumbent` by more than the relative `margin`."""
    new, old = score(challenger, objective), score(incumbent, objective)
    if not math.isfinite(new):
        return False
    if not math.isfinite(old) or old == 0:
        return new > old
    return new > old + margin * abs(old)


def compile_config(
    model: ModelSpec | str,
    gpu: GpuSpec | str,
    num_gpus: int,
    shape: TrafficShape | str,
    objective: str = "goodput",
    budget: Budget = Budget(),
    store: TrialStore | None = None,
    proposer: Proposer | None = None,
    evaluator: Evaluator | None = None,
    space: SearchSpace | None = None,
    parser_gate: ParserGate | None = None,
    engine_version: str = "unknown",
    clock: Callable[[], float] = time.monotonic,
    wall_clock: Callable[[], float] = time.time,
) -> CompileResult | None:
    """Search the best EngineConfig for `shape` on a replica of `num_gpus` x `gpu`.

    proposer: default the agent configured by $POLYMORPH_COMPILER_LLM_URL, else the deterministic
    coordinate proposer. evaluator: default the performance model. parser_gate: default sglang's
    parser in $POLYMORPH_SGLANG_PYTHON (skipped when unset). Returns None when no configuration of
    the space fits (e.g. the weights exceed the replica's memory at every TP)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}; got {objective!r}")
    if num_gpus < 1:
        raise ValueError(f"num_gpus must be >= 1, got {num_gpus}")
    model_spec = get_model(model) if isinstance(model, str) else model
    gpu_spec = get_gpu(gpu) if isinstance(gpu, str) else gpu
    gate = parser_gate or ParserGate.from_environment()
    scorer = evaluator or PerfModelEvaluator()
    run = _Run(
        model=model_spec, gpu=gpu_spec, num_gpus=num_gpus, shape=get_shape(shape), objective=objective, budget=budget,
        store=store, proposer=proposer or AgentProposer.from_environment() or CoordinateProposer(),
        evaluator=scorer, space=space or default_space(model_spec, gpu_spec, num_gpus),
        parser_gate=gate, fingerprints=fingerprints_for(model_spec, gpu_spec, num_gpus, engine_version, scorer.version),
        clock=clock, wall_clock=wall_clock,
    )
    try:
        return run.execute()
    finally:
        if parser_gate is None:
            gate.close()  # the parser process lives for one compile unless the caller shares a gate


@dataclass(slots=True)
class _Run:
    model: ModelSpec
    gpu: GpuSpec
    num_gpus: int
    shape: TrafficShape
    objective: str
    budget: Budget
    store: TrialStore | None
    proposer: Proposer
    evaluator: Evaluator
    space: SearchSpace
    parser_gate: ParserGate
    fingerprints: Fingerprints
    clock: Callable[[], float]
    wall_clock: Callable[[], float]
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    history: list[Trial] = field(default_factory=list)
    tried: set[str] = field(default_factory=set)
    num_evaluations: int = 0
    started_at: float = 0.0
    incumbent: Trial | None = None
    incumbent_at: int = 0
    fresh: dict[str, Metrics] = field(default_factory=dict)  # config key -> stored metrics still valid
    proposer_notes: list[str] = field(default_factory=list)

    def execute(self) -> CompileResult | None:
        self.started_at = self.clock()
        stored = self._stored_trials()
        seeds = self._seeds(stored)
        baseline = self._baseline()
        if baseline is None:
            return None
        if seeds:
            self._round([Proposal(c, "seed from the trial store") for c in seeds], "store-seed")
        idle_rounds = 0
        while not self._out_of_budget() and not (seeds and idle_rounds >= self.budget.warm_patience_rounds):
            batch = self.proposer.propose(self._context(), _BATCH_SIZE)
            if batch.note:
                self.proposer_notes.append(batch.note)
            if not batch.proposals:
                break
            before, incumbent = len(self.tried), self.incumbent
            self._round(list(batch.proposals), batch.source, batch.note)
            if len(self.tried) == before:
                break  # the proposer only repeats itself
            idle_rounds = 0 if self.incumbent is not incumbent else idle_rounds + 1
        return self._result(baseline, warm_start=bool(seeds))

    # ----- store --------------------------------------------------------------------------------
    def _stored_trials(self) -> list[TrialRecord]:
        if self.store is None:
            return []
        records = self.store.trials(self.model.name, self.gpu.name, self.num_gpus, evaluator=self.evaluator.name)
        fp = shape_fingerprint(self.shape)
        for record in records:
            if record.metrics is not None and record.shape_fp == fp and record.is_fresh(self.fingerprints):
                self.fresh[config_key(record.config)] = record.metrics
        return records

    def _seeds(self, records: list[TrialRecord]) -> list[EngineConfig]:
        """Best configurations of the nearest other (or stale) shapes, re-evaluated on this one."""
        fp = shape_fingerprint(self.shape)
        by_shape: dict[str, list[TrialRecord]] = {}
        for record in records:
            if record.metrics is None or (record.shape_fp == fp and record.is_fresh(self.fingerprints)):
                continue
            by_shape.setdefault(record.shape_fp, []).append(record)
        nearest = sorted(by_shape.values(), key=lambda rs: (shape_distance(self.shape, rs[0].shape), rs[0].shape_fp))
        seeds: list[EngineConfig] = []
        for group in nearest[:_NUM_SEED_SHAPES]:
            ranked = sorted(group, key=lambda r: -score(r.metrics, self.objective))  # type: ignore[arg-type]
            for record in ranked[:_SEEDS_PER_SHAPE]:
                if record.config not in seeds:
                    seeds.append(record.config)
        return seeds

    # ----- trials -------------------------------------------------------------------------------
    def _baseline(self) -> Trial | None:
        """sglang's defaults with the whole replica as one TP group (`--tp-size N`, how a multi-GPU
        sglang server is launched), else the next smaller TP that passes the gates."""
        for tp in sorted(self.space.tp, reverse=True):
            trials = self._round([Proposal(engine_default(self.num_gpus, tp), "engine default")], "engine-default")
            if trials and trials[0].metrics is not None:
                return trials[0]
        return None

    def _round(self, proposals: list[Proposal], source: str, note: str = "") -> list[Trial]:
        """Gate, evaluate and record a batch; the best passing candidate may replace the incumbent."""
        checked: list[tuple[EngineConfig | None, tuple[GateResult, ...], str]] = []
        for proposal in proposals:
            config, gates, why = self._static_gates(proposal)
            if config is not None:
                key = config_key(config)
                if key in self.tried:
                    continue
                self.tried.add(key)
            checked.append((config, gates, why or proposal.rationale))
        parsed = [(c, g, w) for c, g, w in checked if c is not None and not any(x.rejected for x in g)]
        target = self.parser_gate.target()
        parser = self.parser_gate.check_many([render_sglang_args(self.model, c, target) for c, _, _ in parsed])
        parser_by_key = {config_key(c): r for (c, _, _), r in zip(parsed, parser)}
        outcomes: list[Trial] = []
        for config, gates, why in checked:
            if config is not None and config_key(config) in parser_by_key:
                gates = (*gates, parser_by_key[config_key(config)])
            passed = config is not None and not any(g.rejected for g in gates)
            if passed and self._out_of_budget():
                self.tried.discard(config_key(config))  # type: ignore[arg-type]
                continue
            outcomes.append(self._evaluate(config, gates, source, "; ".join(x for x in (note, why) if x), self._to_matter(outcomes)))
        self._accept(outcomes)
        return outcomes

    def _to_matter(self, outcomes: list[Trial]) -> float:
        """The goodput (req/s per replica) a candidate must exceed to change this round's outcome: the
        incumbent's past the noise margin (for cost too: at a fixed GPU count cost falls as goodput
        rises) and the best of the round so far (a tie keeps the earlier one). 0: anything may matter."""
        if self.incumbent is None or self.incumbent.metrics is None:
            return 0.0  # the baseline is evaluated in full
        margin, incumbent = self.evaluator.noise_margin, self.incumbent.metrics.goodput_rps
        need = incumbent * (1 + margin) if self.objective == "goodput" else incumbent / (1 - margin)
        return max([need, *(t.metrics.goodput_rps for t in outcomes if t.metrics is not None)])

    def _static_gates(self, proposal: Proposal) -> tuple[EngineConfig | None, tuple[GateResult, ...], str]:
        values = proposal.values
        try:
            config = values if isinstance(values, EngineConfig) else config_from_dict(values)  # type: ignore[arg-type]
        except (ValueError, TypeError) as exc:
            return None, (GateResult("parse", "rejected", f"not an EngineConfig: {exc}"),), f"raw: {str(values)[:200]}"
        outside = in_space(self.space, config)
        if outside:
            return config, (GateResult("space", "rejected", outside),), ""
        constraints = check_constraints(self.model, self.gpu, self.num_gpus, config)
        if constraints.rejected:
            return config, (constraints,), ""
        return config, (constraints, check_memory(self.model, self.gpu, config, self.shape)), ""

    def _evaluate(self, config: EngineConfig | None, gates: tuple[GateResult, ...], source: str, note: str,
                  to_matter: float) -> Trial:
        if config is None or any(g.rejected for g in gates):
            trial = Trial(config or EngineConfig(), None, gates, source, note=note)
            self._record(trial)
            self.history.append(trial)
            return trial
        stored = self.fresh.get(config_key(config))
        if stored is not None:
            trial = Trial(config, stored, gates, source, reused=True, note=note)
        else:
            self.num_evaluations += 1
            why_not = self._screen(config, to_matter)
            if why_not:
                trial = Trial(config, None, (*gates, GateResult("screen", "rejected", why_not)), source, note=note, screened=True)
            else:
                trial = Trial(config, self.evaluator.evaluate(self.model, self.gpu, config, self.shape), gates, source, note=note)
            self._record(trial)
        self.history.append(trial)
        return trial

    def _screen(self, config: EngineConfig, to_matter: float) -> str | None:
        if to_matter <= 0 or not isinstance(self.evaluator, Screening):
            return None
        return self.evaluator.screen(self.model, self.gpu, config, self.shape, to_matter)

    def _record(self, trial: Trial) -> None:
        if self.store is None:
            return
        self.store.record_trial(self.run_id, self.wall_clock(), self.model, self.gpu, self.num_gpus, self.fingerprints,
                                self.shape, self.evaluator.name, trial.proposer, trial.config,
                                [(g.gate, g.status, g.reason) for g in trial.gates], trial.metrics, trial.note)

    def _accept(self, outcomes: list[Trial]) -> None:
        for trial in sorted((t for t in outcomes if t.metrics is not None), key=lambda t: -score(t.metrics, self.objective)):  # type: ignore[arg-type]
            if self.incumbent is None or beats(trial.metrics, self.incumbent.metrics, self.objective, self.evaluator.noise_margin):  # type: ignore[arg-type]
                index = self.history.index(trial)
                self.history[index] = accepted = _accepted(trial)
                self.incumbent, self.incumbent_at = accepted, self.num_evaluations
            break

    def _out_of_budget(self) -> bool:
        return self.num_evaluations >= self.budget.trials or self.clock() - self.started_at >= self.budget.seconds

    def _context(self) -> SearchContext:
        incumbent = self.incumbent
        assert incumbent is not None and incumbent.metrics is not None  # set by _baseline before any proposal
        views = tuple(TrialView(t.config, t.metrics, "; ".join(g.reason for g in t.gates if g.rejected)) for t in self.history)
        return SearchContext(self.model, self.gpu, self.num_gpus, self.shape, self.objective, self.space,
                             incumbent.config, incumbent.metrics, views)

    def _result(self, baseline: Trial, warm_start: bool) -> CompileResult:
        winner = self.incumbent
        assert winner is not None and winner.metrics is not None and baseline.metrics is not None
        reason = _why(winner, baseline, self.objective, self.evaluator.noise_margin, len(self.history))
        result = CompileResult(
            config=winner.config, predicted=winner.metrics, baseline_config=baseline.config, baseline=baseline.metrics,
            trials=self.num_evaluations, num_rejected=sum(1 for t in self.history if t.metrics is None and not t.screened),
            warm_start=warm_start, trials_to_best=self.incumbent_at, objective=self.objective,
            evaluator=self.evaluator.name, shape=self.shape, model=self.model.name, gpu=self.gpu.name,
            num_gpus=self.num_gpus, run_id=self.run_id, reason=reason, elapsed_s=self.clock() - self.started_at,
            store_path=None if self.store is None else str(self.store.path), history=tuple(self.history),
            sglang_target=self.parser_gate.target(), num_screened=sum(1 for t in self.history if t.screened),
            proposer_notes=tuple(self.proposer_notes),
        )
        if self.store is not None:
            self.store.record_artefact(self.run_id, self.wall_clock(), self.model, self.gpu, self.num_gpus, self.fingerprints,
                                       self.shape, self.evaluator.name, self.objective, winner.config, winner.metrics,
                                       baseline.metrics, self.num_evaluations, warm_start, reason)
        return result


def _accepted(trial: Trial) -> Trial:
    return replace(trial, accepted=True)


def _why(winner: Trial, baseline: Trial, objective: str, margin: float, num_candidates: int) -> str:
    w, b = winner.metrics, baseline.metrics
    assert w is not None and b is not None
    if winner.config == baseline.config:
        return (f"sglang's defaults kept: none of {num_candidates - 1} other candidates beat them by more than "
                f"the {margin:.0%} noise margin on {objective}")
    gain = w.goodput_rps_per_gpu / b.goodput_rps_per_gpu if b.goodput_rps_per_gpu > 0 else math.inf
    changed = {k: v for k, v in winner.config.to_dict().items() if v != baseline.config.to_dict()[k]}
    return (f"{gain:.2f}x the default's goodput per GPU ({w.goodput_rps_per_gpu:.3g} vs {b.goodput_rps_per_gpu:.3g} req/s), "
            f"cost {w.cost_per_mtok:.3g} vs {b.cost_per_mtok:.3g} USD/Mtok; default was {b.bottleneck}; "
            f"changed {changed}; best of {num_candidates} candidates, each kept only past a {margin:.0%} margin")
