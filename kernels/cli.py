"""`polymorph` subcommands owned by the kernels package: `kernels predict`, `kernels fit`, `compile`,
`compile history`, `bench model` and `bench compile`."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping
from pathlib import Path

from kernels.argtypes import count, positive, seed
from kernels.domains import DOMAINS

_FMT = argparse.ArgumentDefaultsHelpFormatter


def register(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add this package's top-level subcommands."""
    kernels = commands.add_parser(
        "kernels",
        help="performance model: predict latency/throughput, fit its parameters",
        description="The compiler's performance model: a calibrated roofline of each engine iteration "
        "driving the sglang-like scheduler on a virtual clock.",
    )
    sub = kernels.add_subparsers(dest="kernels_command", metavar="<subcommand>", required=True)
    predict = sub.add_parser(
        "predict", formatter_class=_FMT, help="predict TTFT/TPOT/throughput/KV usage for one load",
        description="Predict TTFT and TPOT (mean, p50, p99), throughput (tokens/s, total and per GPU) and KV "
        "usage of MODEL on GPU under an engine config and a fixed ISL/OSL load. Give --concurrency for a "
        "closed loop, --rate for Poisson arrivals, or neither for an offline (all queued) run.",
    )
    predict.add_argument("--model", required=True, help="catalog name, alias, HF repo id or path to a config.json")
    predict.add_argument("--gpu", required=True, help="GPU name or alias, e.g. H100, H200-SXM-141GB, B200")
    predict.add_argument("--config", type=Path, help="YAML/JSON file with EngineConfig keys (tp, kv_cache_dtype, ...)")
    predict.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override one EngineConfig key (repeatable)")
    predict.add_argument("--isl", type=count, required=True, help="prompt tokens per request")
    predict.add_argument("--osl", type=count, required=True, help="output tokens per request")
    load = predict.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=count, help="closed-loop clients")
    load.add_argument("--rate", type=positive, help="Poisson arrival rate, requests/s")
    predict.add_argument("--domain", default="chat", choices=DOMAINS, help="request domain (speculative acceptance depends on it)")
    predict.add_argument("--num-requests", type=count, help="simulated requests (default: a few per client, 400 for --rate)")
    predict.add_argument("--seed", type=seed, default=0, help="seed of the simulated arrivals")
    predict.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    predict.set_defaults(handler=_run_predict)

    fit = sub.add_parser(
        "fit", formatter_class=_FMT, help="refit the model's parameters to calibration data, or to measured trials",
        description="Least-squares fit of the performance model's physical parameters (efficiencies, "
        "overheads, all-reduce latency) to a calibration CSV; writes kernels/data/perf_params.yaml. With --store: "
        "fit one goodput correction per (engine and version, hardware, weights; model) to the probe's measured "
        "trials in that trial store (every third trial held back) and keep it there for later probe compiles.",
    )
    fit.add_argument("--data", type=Path, help="calibration CSV (default: ../shared/calibration/calibration.csv)")
    fit.add_argument("--max-evals", type=count, default=6,
                     help="optimiser steps (each costs ~10 scorings of the CSV, ~1 min on 2 cores)")
    fit.add_argument("--dry-run", action="store_true", help="print the fit without writing the parameter file (or the store)")
    fit.add_argument("--store", type=Path, help="fit corrections to this trial store's measured probe trials instead")
    fit.add_argument("--json", action="store_true", help="with --store: print one JSON object instead of a table")
    fit.set_defaults(handler=_run_fit)

    add_model = sub.add_parser(
        "add-model", formatter_class=_FMT, help="add a model to your catalog from its Hugging Face config.json",
        description="Parse a Hugging Face config.json (layers, hidden size, heads, KV heads, vocabulary, MoE experts, "
        "MLA, sliding windows) as --model PATH does, and keep it in your model catalog under NAME, so that "
        "`--model NAME` works in every command.",
    )
    add_model.add_argument("--hf-config", type=Path, required=True, help="a config.json, or the folder holding one")
    add_model.add_argument("--name", help="catalog name (default: the config's folder name)")
    add_model.add_argument("--catalog", type=Path, help="user catalog file (default: $POLYMORPH_MODEL_CATALOG, else "
                           "$XDG_CONFIG_HOME/polymorph/models.yaml, ~/.config when unset)")
    add_model.add_argument("--json", action="store_true", help="print the added model's fields as one JSON object")
    add_model.set_defaults(handler=_run_add_model)
    _register_compile(commands)


def _register_compile(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    compile_ = commands.add_parser(
        "compile", formatter_class=_FMT, help="search the engine configuration that best serves a traffic shape",
        description="Search sglang engine configurations (TP, max running requests, chunked prefill, KV dtype, "
        "CUDA-graph batch, schedule policy, speculative decoding, ...) for MODEL on GPUS x GPU under a traffic "
        "shape, maximising goodput per GPU (requests/s meeting the shape's p99 TTFT/TPOT SLOs) or minimising cost. "
        "Every candidate passes deterministic gates (constraints, memory, sglang's own argument parser when "
        "$POLYMORPH_SGLANG_PYTHON names an sglang interpreter) before the performance model scores it. Every trial "
        "goes to the trial store; a later compile of a nearby shape starts warm from it. Proposals come from "
        "$POLYMORPH_COMPILER_LLM_URL (an OpenAI-compatible endpoint) when set, else a deterministic coordinate search.",
    )
    compile_.add_argument("--model", help="catalog name, alias, HF repo id or path to a config.json (required)")
    compile_.add_argument("--gpu", help="GPU name or alias, e.g. H100, H200 (required)")
    compile_.add_argument("--gpus", type=count, default=1, help="GPUs per replica (TP x DP)")
    compile_.add_argument("--shape", help="built-in traffic shape: short-chat, long-context, reasoning, batch")
    compile_.add_argument("--trace", type=Path, help="summarise this request trace as the shape instead")
    compile_.add_argument("--format", choices=("azure", "burstgpt", "mooncake", "native"), help="format of --trace")
    compile_.add_argument("--tier", default="interactive", choices=("interactive", "standard", "batch"),
                          help="the SLO tier whose objectives the shape is compiled for (a --trace shape's, or a built-in's)")
    compile_.add_argument("--evaluator", "--evaluate", default="perf-model", choices=("perf-model", "analytic", "replay", "probe"),
                          help="perf-model: bisect the SLO-meeting rate on the performance model (simulated); "
                          "analytic: closed-form screening, milliseconds a trial; replay: replay the --trace "
                          "requests (prefix ids included) through the engine at increasing speed; probe: the model "
                          "screens, the default and the best --budget - 1 are measured on a real engine (--engine)")
    compile_.add_argument("--engine", default="sglang", choices=("sglang", "llamacpp", "vllm"),
                          help="the engine whose knobs are searched; llamacpp or vllm (with --evaluator probe) measure on the "
                          "installed llama-server or vLLM CPU build and the tiny model, on --gpu cpu unless given; sglang "
                          "(with --evaluator probe) on the GPUs --devices of kind --gpu, with --model-path and the interpreter "
                          "--engine-command or $POLYMORPH_SGLANG_PYTHON")
    compile_.add_argument("--engine-command", help="--evaluator probe: the engine's interpreter (vllm, sglang) or binary (llamacpp) "
                          "instead of the installed one; one path for vllm and llamacpp, a command line for sglang")
    compile_.add_argument("--model-path", help="--evaluator probe: the weights the engine loads (default: the tiny model; "
                          "sglang needs one)")
    compile_.add_argument("--devices", help="--evaluator probe on a GPU: the device ids the engine gets (CUDA_VISIBLE_DEVICES), "
                          "e.g. 0 or 2,3 (default 0)")
    compile_.add_argument("--probe-requests", type=count, default=12,
                          help="requests per rate of a probe's ladder (fewer: a quicker, noisier measurement)")
    compile_.add_argument("--objective", default="goodput", choices=("goodput", "cost"),
                          help="maximise goodput per GPU, or minimise USD per million tokens at the SLOs")
    compile_.add_argument("--budget", type=count, default=60, help="most evaluations (gate rejections are free)")
    compile_.add_argument("--seconds", type=positive, default=120.0, help="most wall seconds of search")
    compile_.add_argument("--store", type=Path, help="trial store (SQLite); default $POLYMORPH_COMPILER_STORE or "
                          "~/.cache/polymorph/compiler.sqlite3")
    compile_.add_argument("--no-store", action="store_true", help="remember nothing (no warm start)")
    compile_.add_argument("--allow-fp8-weights", action="store_true",
                          help="let the search quantize bf16 weights to fp8 (trades model quality for speed)")
    compile_.add_argument("--draft", action="append", choices=("EAGLE", "EAGLE3", "MTP"),
                          help="a speculative algorithm whose draft weights you provide (repeatable)")
    compile_.add_argument("--engine-version", default="unknown",
                          help="sglang version the replicas run (trials from another version are re-evaluated)")
    compile_.add_argument("--json", action="store_true", help="print one JSON object (config, sglang_args, vllm_args, "
                          "predicted, baseline, trials, warm_start, store)")
    compile_.set_defaults(handler=_run_compile)
    sub = compile_.add_subparsers(dest="compile_command", metavar="<subcommand>", required=False)
    history = sub.add_parser(
        "history", formatter_class=_FMT, help="list compiled artefacts, their trials and why each winner won",
        description="List what the trial store holds: each compile (newest first) with the reason its winner won, "
        "and with --trials every candidate tried, its metrics or the gate that rejected it.",
    )
    history.add_argument("--store", type=Path, help="trial store (default as for `polymorph compile`)")
    history.add_argument("--model", help="only this model")
    history.add_argument("--gpu", help="only this GPU kind")
    history.add_argument("--limit", type=count, default=20, help="most compiles to list")
    history.add_argument("--trials", action="store_true", help="also list every trial of each compile")
    history.set_defaults(handler=_run_compile_history)


def register_bench(benches: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add this package's `polymorph bench` entries."""
    bench = benches.add_parser(
        "model", formatter_class=_FMT, help="score the performance model against measured datapoints",
        description="Predict every modellable datapoint of a calibration CSV and report the median absolute "
        "percentage error per metric family (throughput, TPOT, TTFT). Rows that cannot be modelled are "
        "counted and listed with the reason. The last line is one JSON object.",
    )
    bench.add_argument("--data", type=Path, help="calibration CSV (default: ../shared/calibration/calibration.csv)")
    bench.add_argument("--json", action="store_true", help="print per-row results as JSON lines before the summary")
    bench.set_defaults(handler=_run_bench_model)
    compile_bench = benches.add_parser(
        "compile", formatter_class=_FMT, help="compiled vs sglang-default goodput per (model, GPU, shape); cold vs warm",
        description="For every (model, GPU, shape) cell: compile cold and compare the predicted goodput per GPU with "
        "sglang's default configuration on the same evaluator; then drift the shape (lengths x --drift) and compare "
        "a from-scratch compile with one warm-started from the first compile's trials (trials until within 2% of "
        "the from-scratch optimum). With --evaluate probe, on real CPU engines instead: for every (engine, shape) "
        "cell a probe compile of --model (the default and the best --budget - 1 candidates measured), then the "
        "default and the chosen configuration measured once more side by side; the speed-up is that pair's, "
        "with the chosen one's prediction error (about 10-25 minutes a llama.cpp cell with the defaults, more "
        "on vLLM). The last line is one JSON object.",
    )
    compile_bench.add_argument("--evaluate", choices=("model", "probe"), default="model",
                               help="model: predicted by the performance model; probe: measured on the CPU engines")
    compile_bench.add_argument("--models", nargs="+", default=["llama-3.1-8b:1", "llama-3.1-70b:4"],
                               help="MODEL[:GPUS_PER_REPLICA] entries (--evaluate model)")
    compile_bench.add_argument("--gpus", nargs="+", default=["H100", "H200"], help="GPU kinds (--evaluate model)")
    compile_bench.add_argument("--shapes", nargs="+",
                               help="built-in traffic shapes (default: short-chat long-context reasoning batch; "
                               "with --evaluate probe: short-chat long-context)")
    compile_bench.add_argument("--drift", type=positive, default=1.3, help="length scale of the drifted shape")
    compile_bench.add_argument("--budget", type=count,
                               help="most evaluations per compile (default 60; with --evaluate probe: measured candidates, default 4)")
    compile_bench.add_argument("--engines", nargs="+", help="--evaluate probe: llamacpp and/or vllm (default: both)")
    compile_bench.add_argument("--model", default="tiny-llama", help="--evaluate probe: the model the engines serve")
    compile_bench.add_argument("--probe-requests", type=count, default=12, help="--evaluate probe: requests a ladder step")
    compile_bench.add_argument("--tier", choices=("interactive", "standard", "batch"), default="interactive",
                               help="--evaluate probe: whose objectives goodput is measured against (the tiers' GPU figures: "
                               "vLLM's CPU build on one core meets no interactive one; standard allows 3 s TTFT, 100 ms TPOT)")
    compile_bench.add_argument("--no-confirm", action="store_true",
                               help="--evaluate probe: take the compile's own pair instead of measuring both again side by side")
    compile_bench.add_argument("--store", type=Path,
                               help="--evaluate probe: trial store to keep (and warm-start from); default a temporary one")
    compile_bench.add_argument("--seconds", type=positive, default=300.0, help="most wall seconds per compile")
    compile_bench.add_argument("--workers", type=count, default=2, help="cells compiled in parallel processes")
    compile_bench.add_argument("--no-warm", action="store_true", help="skip the drift comparison (cold compiles only)")
    compile_bench.add_argument("--allow-fp8-weights", action="store_true", help="widen the space with fp8 weights (lossy)")
    compile_bench.add_argument("--draft", action="append", choices=("EAGLE", "EAGLE3", "MTP"),
                               help="widen the space with this speculative algorithm (its draft weights assumed present)")
    compile_bench.set_defaults(handler=_run_bench_compile)


def _data_path(path: Path | None) -> Path:
    from kernels.calibration import DEFAULT_DATA

    chosen = path or DEFAULT_DATA
    if not chosen.is_file():
        raise SystemExit(f"calibration data not found: {chosen} (pass --data FILE)")
    return chosen


def _run_predict(args: argparse.Namespace) -> int:
    from kernels.catalog import get_gpu, get_model
    from kernels.compiler.gates import check_constraints
    from kernels.config import EngineConfig, canonical_key
    from kernels.perf import PerfModel
    from kernels.predict import Workload, predict
    from kernels.yamlsrc import ConfigError, load_yaml

    values: dict[str, object] = {}
    if args.config:
        try:
            loaded = load_yaml(args.config).data or {}
        except ConfigError as exc:
            raise SystemExit(f"polymorph kernels predict: {exc}") from None
        if not isinstance(loaded, dict):
            raise SystemExit(f"polymorph kernels predict: {args.config}: expected a mapping of EngineConfig keys")
        values.update(loaded)
    overridden: set[str] = set()
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"polymorph kernels predict: --set expects KEY=VALUE, got {item!r}")
        name = canonical_key(key)
        if name in overridden:  # `--set tp=2 --set tp=4`: before, the last silently won
            raise SystemExit(f"polymorph kernels predict: --set {key} is {name}, set already")
        overridden.add(name)
        values = {k: v for k, v in values.items() if canonical_key(str(k)) != name}  # --set overrides --config's spelling too
        values[name] = value
    try:
        perf = PerfModel(get_model(args.model), get_gpu(args.gpu), EngineConfig.from_dict(values))
        result = predict(perf, Workload(args.isl, args.osl, args.concurrency, args.rate, args.domain, args.num_requests), seed=args.seed)
    except ValueError as exc:
        raise SystemExit(f"polymorph kernels predict: {exc}") from exc
    # predicted all the same (the model can price what an engine would refuse), but said: a figure for a
    # configuration sglang will not launch, or for requests longer than the model's context, misleads
    problems = []
    gate = check_constraints(perf.model, perf.gpu, perf.config.tp * perf.config.dp, perf.config)
    if gate.rejected:
        problems.append(gate.reason)
    if args.isl + args.osl > perf.model.max_context:
        problems.append(f"--isl + --osl ({args.isl + args.osl}) exceed {perf.model.name}'s context of {perf.model.max_context} tokens")
    for problem in problems:
        print(f"polymorph kernels predict: warning: {problem}; predicted anyway", file=sys.stderr)
    report = {"model": perf.model.name, "gpu": perf.gpu.name, "num_gpus": perf.config.num_gpus,
              "kv_capacity_tokens": perf.kv_capacity_tokens, **result.to_dict()}
    if args.json:
        print(json.dumps(report))
        return 0
    for key, value in report.items():
        shown = value if not isinstance(value, float) else f"{value * 1e3:.2f} ms" if key.startswith(("ttft", "tpot")) else f"{value:.4g}"
        print(f"{key:>24}  {shown}")
    return 0


def _run_fit(args: argparse.Namespace) -> int:
    if args.store is not None:
        from kernels.compiler.cli import main_fit_store

        if args.data is not None:
            raise SystemExit("polymorph kernels fit: give --data (calibration CSV) or --store (measured trials), not both")

        return main_fit_store(args)
    from kernels.calibration import load_rows
    from kernels.fit import NoScorableRows, fit_params, write_params
    from kernels.perf_params import default_params

    path = _data_path(args.data)
    try:
        rows = load_rows(path)
    except ValueError as exc:
        raise SystemExit(f"polymorph kernels fit: {exc}") from None
    try:
        params, errors = fit_params(rows, default_params(), max_evals=args.max_evals)
    except NoScorableRows:  # a fit to nothing would write NaN errors over the shipped parameters
        raise SystemExit(f"polymorph kernels fit: no row of {path} can be scored (`polymorph bench model --data {path}` says why)") from None
    print(json.dumps(params.to_dict(), indent=2))
    print(json.dumps({"median_ape_pct": _json_errors(errors)}))
    if not args.dry_run:
        write_params(params, errors, source=path.name)
    return 0


def _run_add_model(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from kernels.catalog.models import add_model

    try:
        spec, path = add_model(args.hf_config, args.name, args.catalog)
    except ValueError as exc:
        raise SystemExit(f"polymorph kernels add-model: {exc}") from exc
    if args.json:
        print(json.dumps({"catalog": str(path), **asdict(spec)}))
        return 0
    moe = f", {spec.num_experts} experts ({spec.num_experts_per_tok} a token)" if spec.is_moe else ""
    print(f"added {spec.name} to {path}: {spec.num_layers} layers, hidden {spec.hidden_size}, {spec.num_heads} heads "
          f"({spec.num_kv_heads} KV), vocabulary {spec.vocab_size}{moe}, {spec.total_params / 1e9:.3g}B parameters")
    return 0


def _json_errors(errors: Mapping[str, float]) -> dict[str, float | None]:
    """Median errors per family for a JSON line: a family without rows (NaN) is null, as JSON has no NaN."""
    return {family: None if math.isnan(error) else error for family, error in errors.items()}


def _run_bench_model(args: argparse.Namespace) -> int:
    import collections

    from kernels.calibration import FAMILIES, evaluate, load_rows, summarise

    try:
        rows = load_rows(_data_path(args.data))
    except ValueError as exc:
        raise SystemExit(f"polymorph bench model: {exc}") from None
    scored, skipped = evaluate(rows)
    errors = summarise(scored)
    if args.json:
        for row in scored:
            print(json.dumps({"id": row.row_id, "metric": row.metric, "measured": row.measured,
                              "predicted": round(row.predicted, 4), "ape_pct": round(row.ape_pct, 2)}))
    print(f"{'family':<12}{'rows':>6}{'median APE %':>14}")
    for family in FAMILIES:
        count = sum(1 for r in scored if r.family == family)
        print(f"{family:<12}{count:>6}{errors[family]:>14.1f}")
    print(f"skipped {len(skipped)} rows:")
    for reason, count in collections.Counter(s.reason for s in skipped).most_common():
        ids = sorted({s.row_id for s in skipped if s.reason == reason})
        print(f"  {count:>3}  {reason}: {', '.join(ids[:6])}{' ...' if len(ids) > 6 else ''}")
    summary = {"rows_scored": len(scored), "rows_skipped": len(skipped),
               "median_ape_pct": _json_errors({family: round(errors[family], 2) for family in FAMILIES})}
    print(json.dumps(summary))
    return 0


def _run_compile(args: argparse.Namespace) -> int:
    from kernels.compiler.cli import main_compile

    return main_compile(args, getattr(args, "prober", None))


def _run_compile_history(args: argparse.Namespace) -> int:
    from kernels.compiler.cli import main_history

    return main_history(args)


def _run_bench_compile(args: argparse.Namespace) -> int:
    if args.evaluate == "probe":
        from kernels.compiler.probe_bench import main_probe_bench

        return main_probe_bench(args, getattr(args, "prober", None))
    from kernels.compiler.bench import main_bench

    return main_bench(args)
