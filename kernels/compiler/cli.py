"""Handlers of `polymorph compile`, `polymorph compile history` and `polymorph bench compile`
(registered by kernels/cli.py; imported lazily so `polymorph --help` stays fast)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

import orjson

from kernels.compiler.evaluators import Evaluator, ReplayEvaluator, evaluator_by_name
from kernels.compiler.gates import SGLANG_PYTHON_ENV
from kernels.compiler.probe import ENGINES, Prober, ProbeTarget, probe_compile
from kernels.compiler.search import Budget, CompileResult, compile_config
from kernels.compiler.shape import TrafficShape, tier_shape
from kernels.compiler.space import default_space
from kernels.compiler.store import StoreError, TrialStore
from kernels.compiler.trace_shape import shape_from_trace
from kernels.config import EngineConfig

STORE_ENV = "POLYMORPH_COMPILER_STORE"


def default_store_path() -> Path:
    return Path(os.environ.get(STORE_ENV) or Path.home() / ".cache" / "polymorph" / "compiler.sqlite3")


def main_compile(args: argparse.Namespace, prober: Callable[[ProbeTarget], Prober] | None = None) -> int:
    """`prober` makes the real-engine prober of `--evaluator probe` (supplied by the `polymorph` command,
    which may import the load tester; kernels may not)."""
    from kernels.catalog import get_gpu, get_model

    if args.evaluator == "probe":
        return _main_probe(args, prober)
    # flags only a probe reads: given to another evaluator, they would be ignored without a word
    probe_only = [flag for flag, value in (("--engine-command", args.engine_command), ("--model-path", args.model_path),
                                           ("--devices", args.devices)) if value is not None]
    if args.engine != "sglang":
        probe_only.append(f"--engine {args.engine}")
    if probe_only:
        raise SystemExit(f"polymorph compile: only --evaluator probe reads {', '.join(probe_only)} (the {args.evaluator} evaluator "
                         "searches sglang's knobs on the performance model)")
    if not args.model or not args.gpu:
        raise SystemExit("polymorph compile: --model and --gpu are required")
    if bool(args.shape) == bool(args.trace):
        raise SystemExit("polymorph compile: give exactly one of --shape NAME or --trace FILE --format F")
    try:
        model, gpu = get_model(args.model), get_gpu(args.gpu)
        shape, evaluator = _shape_and_evaluator(args)
        space = default_space(model, gpu, args.gpus, allow_fp8_weights=args.allow_fp8_weights,
                              draft_models=tuple(args.draft or ()))
        budget = Budget(args.budget, args.seconds)
        store = None if args.no_store else TrialStore(args.store or default_store_path())
    except (ValueError, StoreError) as exc:
        raise SystemExit(f"polymorph compile: {exc}") from exc
    try:
        result = compile_config(model, gpu, args.gpus, shape, args.objective, budget,
                                store=store, evaluator=evaluator, space=space, engine_version=args.engine_version)
    except StoreError as exc:
        raise SystemExit(f"polymorph compile: {exc}") from exc
    finally:
        if store is not None:
            store.close()
    if result is None:
        raise SystemExit(f"polymorph compile: {model.name} does not fit on {args.gpus}x {gpu.name} in any configuration")
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        _print_result(result)
    return 0


def probe_target(engine: str, gpu: str, engine_command: str | None, model_path: str | None, devices: str | None) -> ProbeTarget:
    """Where `--evaluator probe` runs the engine; ValueError for what cannot run. sglang never enters
    Polymorph's environment: its interpreter is named, and it serves on GPUs only."""
    command = tuple(shlex.split(engine_command)) if engine_command else ()
    if engine == "sglang":
        command = command or tuple(shlex.split(os.environ.get(SGLANG_PYTHON_ENV, "")))
        if not command:
            raise ValueError(f"--engine sglang runs sglang's own interpreter: give it with --engine-command PYTHON or ${SGLANG_PYTHON_ENV}")
        if not model_path:
            raise ValueError("--engine sglang needs --model-path (the weights sglang loads)")
        if gpu == "cpu":
            raise ValueError("sglang serves on GPUs: give --gpu KIND (and --devices)")
    elif len(command) > 1:  # the CPU probes start the binary or interpreter itself, with their own arguments
        raise ValueError(f"--engine-command for {engine} is one path (llama-server, or vLLM's python), got {engine_command!r}")
    ids = tuple(d.strip() for d in (devices or ("0" if gpu != "cpu" else "")).split(",") if d.strip())
    if gpu == "cpu" and ids:
        raise ValueError("--devices names GPUs; a CPU probe runs its engine on one core")
    return ProbeTarget(engine, command, model_path, gpu, ids)


def _main_probe(args: argparse.Namespace, prober: Callable[[ProbeTarget], Prober] | None) -> int:
    from kernels.catalog import get_gpu, get_model

    if args.engine not in ENGINES:
        raise SystemExit(f"polymorph compile: --evaluator probe measures on {', '.join(ENGINES)}, not {args.engine!r}")
    if prober is None:
        raise SystemExit("polymorph compile: --evaluator probe needs the load tester's prober (run it as `polymorph compile`)")
    if not args.model or not args.shape:
        raise SystemExit("polymorph compile: --evaluator probe needs --model and --shape")
    try:
        model, gpu, shape = get_model(args.model), get_gpu(args.gpu or "cpu"), tier_shape(args.shape, args.tier)
        target = probe_target(args.engine, gpu.name, args.engine_command, args.model_path, args.devices)
        store = None if args.no_store else TrialStore(args.store or default_store_path())
    except (ValueError, StoreError) as exc:
        raise SystemExit(f"polymorph compile: {exc}") from exc
    try:
        result = probe_compile(model, gpu, shape, args.budget, prober(target), args.probe_requests, store,
                               progress=lambda line: print(line, file=sys.stderr, flush=True), engine=args.engine)
    except (StoreError, RuntimeError) as exc:
        raise SystemExit(f"polymorph compile: {exc}") from exc
    finally:
        if store is not None:
            store.close()
    if args.json:
        # orjson: a latency no request measured (inf) is null, not the non-standard Infinity json.dumps writes
        print(orjson.dumps(result.to_json()).decode())
        return 0
    chosen, base = result.chosen.measured, result.baseline.measured
    print(f"{model.name} on {gpu.name} via {args.engine} ({result.fingerprint.engine_version}), shape {shape.name}: "
          f"{len(result.trials)} measured of {result.num_screened} screened, {result.elapsed_s:.0f} s")
    print(f"{'measured':<22}{'chosen':>12}{'default':>12}")
    for key in ("goodput_rps", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "throughput_tokens_s"):
        print(f"{key:<22}{getattr(chosen, key):>12.4g}{getattr(base, key):>12.4g}")
    launcher = {"llamacpp": "llama-server -m MODEL ", "vllm": "vllm serve MODEL ", "sglang": "python -m sglang.launch_server --model-path MODEL "}
    print(launcher[args.engine] + " ".join(result.chosen.engine_args))
    print(f"warm start: {result.num_reused} of {len(result.trials)} candidates taken from the store")
    return 0


def main_fit_store(args: argparse.Namespace) -> int:
    """`polymorph kernels fit --store FILE`: a goodput correction per fingerprint and model from measured trials."""
    import time

    from kernels.compiler.probe_fit import fit_corrections

    path = Path(args.store)
    if not path.is_file():
        raise SystemExit(f"polymorph kernels fit: no trial store at {path}")
    try:
        with TrialStore(path, create=False) as store:
            records = store.probe_trials()
            corrections = fit_corrections(records, time.time())
            if not args.dry_run:
                for correction in corrections:
                    store.record_probe_correction(correction)
    except StoreError as exc:
        raise SystemExit(f"polymorph kernels fit: {exc}") from exc
    if not corrections:
        raise SystemExit(f"polymorph kernels fit: {path} holds no measured trial with a goodput above 0 "
                         f"({len(records)} probe trials); run `polymorph compile --evaluator probe` first")
    if args.json:
        print(json.dumps({"store": str(path), "num_trials": len(records), "written": not args.dry_run,
                          "corrections": [c.to_dict() for c in corrections]}))
        return 0
    print(f"{len(records)} measured trials in {path}; median |predicted - measured| / measured of goodput, %")
    print(f"{'model':<16}{'fingerprint':<18}{'factor':>8}{'fit':>5}{'held':>6}{'before':>10}{'after':>10}"
          f"{'held before':>13}{'held after':>12}")
    for c in corrections:
        held = ("-", "-") if c.held_back_before_pct is None or c.held_back_after_pct is None else (
            f"{c.held_back_before_pct:.1f}", f"{c.held_back_after_pct:.1f}")
        print(f"{c.model:<16}{c.fingerprint:<18}{c.goodput_factor:>8.3g}{c.num_fit:>5}{c.num_held_back:>6}"
              f"{c.fit_before_pct:>10.1f}{c.fit_after_pct:>10.1f}{held[0]:>13}{held[1]:>12}")
    print("not written (--dry-run)" if args.dry_run else f"written to {path}: later probe compiles on these fingerprints use them")
    return 0


def _shape_and_evaluator(args: argparse.Namespace) -> tuple[TrafficShape, Evaluator]:
    if args.shape:
        if args.evaluator == "replay":
            raise ValueError("--evaluator replay needs --trace (it replays the trace's requests)")
        return tier_shape(args.shape, args.tier), evaluator_by_name(args.evaluator)
    if not args.format:
        raise ValueError("--trace needs --format (azure, burstgpt, mooncake or native)")
    shape, requests = shape_from_trace(args.trace, args.format, args.tier)
    return shape, (ReplayEvaluator(requests) if args.evaluator == "replay" else evaluator_by_name(args.evaluator))


def _print_result(result: CompileResult) -> None:
    default = result.baseline_config.to_dict()
    changed = {k: v for k, v in result.config.to_dict().items() if v != default[k]}
    print(f"{result.model} on {result.num_gpus}x {result.gpu}, shape {result.shape.name}, objective {result.objective} "
          f"({result.evaluator}): {result.trials} trials ({result.num_screened} screened out), {result.num_rejected} rejected by gates, "
          f"{'warm' if result.warm_start else 'cold'} start, {result.elapsed_s:.1f} s")
    print(f"{'':<22}{'compiled':>12}{'default':>12}")
    for key in ("goodput_rps", "goodput_rps_per_gpu", "throughput_tokens_s", "ttft_p99_s", "tpot_p99_s", "cost_per_mtok"):
        print(f"{key:<22}{getattr(result.predicted, key):>12.4g}{getattr(result.baseline, key):>12.4g}")
    print(f"changed from sglang's defaults: {json.dumps(changed) if changed else 'nothing'}")
    print("sglang: python -m sglang.launch_server " + " ".join(result.sglang_args()))
    print(f"why: {result.reason}")
    if result.proposer_notes:
        first = result.proposer_notes[0]
        print(f"warning: {len(result.proposer_notes)} proposer round(s) fell back; the first: {first}", file=sys.stderr)


def main_history(args: argparse.Namespace) -> int:
    path = Path(args.store or default_store_path())
    if not path.is_file():
        raise SystemExit(f"polymorph compile history: no trial store at {path}")
    try:
        model, gpu = args.model and _model_name(args.model), args.gpu and _gpu_name(args.gpu)
    except ValueError as exc:  # an unknown name (was a traceback)
        raise SystemExit(f"polymorph compile history: {exc}") from exc
    try:
        with TrialStore(path, create=False) as store:
            artefacts = store.artefacts(model, gpu, args.limit)
            for artefact in artefacts:
                print(f"#{artefact.artefact_id} run {artefact.run_id} {artefact.model} {artefact.num_gpus}x {artefact.gpu} "
                      f"shape {artefact.shape_name} [{artefact.shape_fp}] {artefact.objective} via {artefact.evaluator}: "
                      f"{artefact.num_trials} trials, {'warm' if artefact.warm_start else 'cold'}, "
                      f"engine {artefact.engine_version}"
                      f"{', pools ' + ','.join(artefact.pools) if artefact.pools else ''}")
                print(f"   winner: {artefact.reason}")
                if args.trials:
                    _print_trials(store, artefact.model, artefact.gpu, artefact.num_gpus, artefact.run_id)
    except StoreError as exc:
        raise SystemExit(f"polymorph compile history: {exc}") from exc
    if not artefacts:
        print(f"no compiled artefacts in {path}")
    return 0


def _print_trials(store: TrialStore, model: str, gpu: str, num_gpus: int, run_id: str) -> None:
    default = EngineConfig().to_dict()
    for trial in store.trials(model, gpu, num_gpus, run_id=run_id):
        changed = {k: v for k, v in trial.config.to_dict().items() if v != default[k] and k not in ("tp", "dp")}
        head = f"tp{trial.config.tp} {json.dumps(changed) if changed else 'defaults'}"
        if trial.metrics is None:
            why = "; ".join(reason for _, status, reason in trial.gates if status == "rejected") or trial.note
            print(f"     {trial.trial_id:>5} {trial.proposer:<14} {head}  REJECTED: {why}")
        else:
            m = trial.metrics
            print(f"     {trial.trial_id:>5} {trial.proposer:<14} {head}  goodput/GPU {m.goodput_rps_per_gpu:.3g} "
                  f"ttft99 {m.ttft_p99_s:.3g}s tpot99 {m.tpot_p99_s * 1e3:.3g}ms {m.bottleneck}")


def _model_name(name: str) -> str:
    from kernels.catalog import get_model

    return get_model(name).name


def _gpu_name(name: str) -> str:
    from kernels.catalog import get_gpu

    return get_gpu(name).name
