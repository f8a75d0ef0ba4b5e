"""`polymorph` subcommands owned by the kernels package: `kernels predict`, `kernels fit`, `bench model`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

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
    predict.add_argument("--isl", type=int, required=True, help="prompt tokens per request")
    predict.add_argument("--osl", type=int, required=True, help="output tokens per request")
    load = predict.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, help="closed-loop clients")
    load.add_argument("--rate", type=float, help="Poisson arrival rate, requests/s")
    predict.add_argument("--domain", default="chat", help="request domain (speculative acceptance depends on it)")
    predict.add_argument("--num-requests", type=int, help="simulated requests (default: a few per client, 400 for --rate)")
    predict.add_argument("--seed", type=int, default=0, help="seed of the simulated arrivals")
    predict.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    predict.set_defaults(handler=_run_predict)

    fit = sub.add_parser(
        "fit", formatter_class=_FMT, help="refit the model's parameters to calibration data",
        description="Least-squares fit of the performance model's physical parameters (efficiencies, "
        "overheads, all-reduce latency) to a calibration CSV; writes kernels/data/perf_params.yaml.",
    )
    fit.add_argument("--data", type=Path, help="calibration CSV (default: ../shared/calibration/calibration.csv)")
    fit.add_argument("--max-evals", type=int, default=6,
                     help="optimiser steps (each costs ~10 scorings of the CSV, ~1 min on 2 cores)")
    fit.add_argument("--dry-run", action="store_true", help="print the fit without writing the parameter file")
    fit.set_defaults(handler=_run_fit)


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


def _data_path(path: Path | None) -> Path:
    from kernels.calibration import DEFAULT_DATA

    chosen = path or DEFAULT_DATA
    if not chosen.is_file():
        raise SystemExit(f"calibration data not found: {chosen} (pass --data FILE)")
    return chosen


def _run_predict(args: argparse.Namespace) -> int:
    import yaml

    from kernels.catalog import get_gpu, get_model
    from kernels.config import EngineConfig
    from kernels.perf import PerfModel
    from kernels.predict import Workload, predict

    values: dict[str, object] = {}
    if args.config:
        loaded = yaml.safe_load(args.config.read_text()) or {}
        if not isinstance(loaded, dict):
            raise SystemExit(f"{args.config}: expected a mapping of EngineConfig keys")
        values.update(loaded)
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set expects KEY=VALUE, got {item!r}")
        values[key] = value
    try:
        perf = PerfModel(get_model(args.model), get_gpu(args.gpu), EngineConfig.from_dict(values))
        result = predict(perf, Workload(args.isl, args.osl, args.concurrency, args.rate, args.domain, args.num_requests), seed=args.seed)
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc
    report = {"model": perf.model.name, "gpu": perf.gpu.name, "num_gpus": perf.config.num_gpus,
              "kv_capacity_tokens": perf.kv_capacity_tokens, **result.to_dict()}
    if args.json:
        print(json.dumps(report))
        return 0
    for key, value in report.items():
        shown = f"{value * 1e3:.2f} ms" if key.startswith(("ttft", "tpot")) else f"{value:.4g}" if isinstance(value, float) else value
        print(f"{key:>24}  {shown}")
    return 0


def _run_fit(args: argparse.Namespace) -> int:
    from kernels.calibration import load_rows
    from kernels.fit import fit_params, write_params
    from kernels.perf_params import default_params

    path = _data_path(args.data)
    params, errors = fit_params(load_rows(path), default_params(), max_evals=args.max_evals)
    print(json.dumps(params.to_dict(), indent=2))
    print(json.dumps({"median_ape_pct": errors}))
    if not args.dry_run:
        write_params(params, errors, source=path.name)
    return 0


def _run_bench_model(args: argparse.Namespace) -> int:
    import collections

    from kernels.calibration import FAMILIES, evaluate, load_rows, summarise

    scored, skipped = evaluate(load_rows(_data_path(args.data)))
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
               "median_ape_pct": {family: round(errors[family], 2) for family in FAMILIES}}
    print(json.dumps(summary))
    return 0
