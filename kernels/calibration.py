"""Scores the performance model against measured datapoints (calibration.csv) and fits its parameters.

Each CSV row is one metric of one measurement. A row becomes a Scenario (model, GPU, EngineConfig,
Workload) or is skipped with a stated reason; every scored row yields (predicted, measured)."""

from __future__ import annotations

import csv
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kernels.catalog import get_gpu, get_model
from kernels.config import EngineConfig
from kernels.perf import PerfModel
from kernels.perf_params import PerfParams, default_params
from kernels.predict import Prediction, Workload, predict_offline, simulate

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "calibration" / "calibration.csv"

# metric -> (family, how to read a Prediction); units are checked separately in _unit_scale
_METRICS: dict[str, tuple[str, Callable[[Prediction], float]]] = {
    "output_throughput": ("throughput", lambda p: p.output_tok_s),
    "tokens_per_s": ("throughput", lambda p: p.output_tok_s),
    "output_throughput_per_gpu": ("throughput", lambda p: p.output_tok_s_per_gpu),
    "total_token_throughput": ("throughput", lambda p: p.total_tok_s),
    "total_token_throughput_per_gpu": ("throughput", lambda p: p.total_tok_s_per_gpu),
    "request_throughput": ("throughput", lambda p: p.request_rate),
    "samples_per_s": ("throughput", lambda p: p.request_rate),
    "tpot_mean": ("tpot", lambda p: p.tpot_mean_s * 1e3),
    "tpot_median": ("tpot", lambda p: p.tpot_p50_s * 1e3),
    "tpot_p50": ("tpot", lambda p: p.tpot_p50_s * 1e3),
    "tpot_p99": ("tpot", lambda p: p.tpot_p99_s * 1e3),
    "itl_mean": ("tpot", lambda p: p.tpot_mean_s * 1e3),
    "itl_median": ("tpot", lambda p: p.tpot_p50_s * 1e3),
    "ttft_mean": ("ttft", lambda p: p.ttft_mean_s * 1e3),
    "ttft_median": ("ttft", lambda p: p.ttft_p50_s * 1e3),
    "ttft_p50": ("ttft", lambda p: p.ttft_p50_s * 1e3),
    "ttft_p99": ("ttft", lambda p: p.ttft_p99_s * 1e3),
}
FAMILIES = ("throughput", "tpot", "ttft")

# Mean lengths of dataset-defined workloads (ISL, OSL) where the source states or implies them.
# MLPerf llama2-70b: OSL = tokens/s / samples/s of the v4.1 logs (274-293; v5.1 states 265);
# ISL 684 is the OpenOrca subset's mean prompt (MLCommons llama2-70b reference README).
# ShareGPT via sglang.bench_serving: OSL 194 = 4281.51 / 22.03 (SGLV060 offline rows); ISL ~226 is
# bench_serving's reported mean for its default ShareGPT sample (assumption, not in the CSV).
_DATASETS: tuple[tuple[str, int, int], ...] = (
    ("mlperf llama2-70b", 684, 282),
    ("sharegpt", 226, 194),
)


@dataclass(frozen=True, slots=True)
class Scenario:
    model: str
    gpu: str
    config: EngineConfig
    workload: Workload
    reserve_full_output: bool  # TensorRT-LLM's guaranteed-no-evict KV policy


@dataclass(frozen=True, slots=True)
class ScoredRow:
    row_id: str
    metric: str
    family: str
    measured: float
    predicted: float

    @property
    def ape_pct(self) -> float:
        return abs(self.predicted - self.measured) / abs(self.measured) * 100.0


@dataclass(frozen=True, slots=True)
class SkippedRow:
    row_id: str
    metric: str
    reason: str


# the columns the model reads (shared/calibration's layout): a file without them is not a calibration set
COLUMNS = ("id", "source", "engine", "model", "gpu", "n_gpus", "parallelism", "precision", "dataset", "isl", "osl",
           "concurrency", "request_rate", "metric", "value")


def load_rows(path: Path) -> list[dict[str, str]]:
    """The rows of a calibration CSV. Raises ValueError naming the file for one that is not UTF-8 text
    or lacks a column (before, a KeyError or UnicodeDecodeError traceback)."""
    try:
        with path.open(newline="", encoding="utf-8") as handle:
            reader = csv.DictReader(handle)
            missing = [column for column in COLUMNS if column not in (reader.fieldnames or ())]
            if missing:
                raise ValueError(f"{path} is not a calibration CSV: it lacks the columns {', '.join(missing)}")
            return list(reader)
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not UTF-8 text (byte {exc.start})") from None


def scenario_for(row: Mapping[str, str]) -> Scenario | str:
    """The scenario a row measured, or the reason it cannot be modelled."""
    engine = row["engine"]
    if engine.startswith("(simulator)"):
        return "simulator error figure, not a measurement"
    try:
        model = get_model(row["model"])
        gpu = get_gpu(row["gpu"])
    except ValueError as exc:
        return f"not in catalog: {str(exc).split(';')[0]}"
    parallel = _parallelism(row, model.total_params, gpu.hbm_gb)
    if isinstance(parallel, str):
        return parallel
    tp, dp, ep, dp_attention = parallel
    lengths = _lengths(row)
    if isinstance(lengths, str):
        return lengths
    isl, osl = lengths
    is_trt = engine.startswith("TensorRT")
    precision = row["precision"].lower()
    quant = _quantization(precision, gpu.vendor, model.weight_dtype)
    if isinstance(quant, str) and quant.startswith("?"):
        return quant[1:]
    kv_dtype = "fp8_e4m3" if is_trt and ("fp8" in precision or "fp4" in precision or "not stated" in precision) else "auto"
    config = EngineConfig(tp=tp, dp=dp, ep=ep, enable_dp_attention=dp_attention, quantization=quant, kv_cache_dtype=kv_dtype,
                          chunked_prefill_size=8192 if is_trt else None, max_running_requests=2048 if is_trt else None)
    load = _load(row, isl, osl)
    if isinstance(load, str):
        return load
    return Scenario(model.name, gpu.name, config, load, reserve_full_output=is_trt)


def _parallelism(row: Mapping[str, str], total_params: int, hbm_gb: float) -> tuple[int, int, int, bool] | str:
    text = row["parallelism"]
    n_gpus = int(row["n_gpus"]) if row["n_gpus"].strip().isdigit() else 0
    if re.search(r"PD|disagg|nodes|EP\d\d|Infini", text):
        return "multi-node / disaggregated deployment (not modelled)"
    if match := re.search(r"DEP(\d+)", text):
        size = int(match.group(1))
        return size, 1, size, True
    if match := re.search(r"TP(\d+)", text):
        tp = int(match.group(1))
        ep_match = re.search(r"EP(\d+)", text)
        return tp, max(1, n_gpus // tp) if n_gpus else 1, int(ep_match.group(1)) if ep_match else 1, False
    if "per-submitter" in text and n_gpus:
        # Submitters pick the smallest TP that leaves room for KV: weights under ~60% of HBM.
        weight_gb = total_params / 1e9  # ~1 byte/param at the FP8/FP4 precisions these runs use
        tp = next((t for t in (1, 2, 4, 8) if weight_gb / t < 0.6 * hbm_gb and n_gpus % t == 0), 8)
        return tp, max(1, n_gpus // tp), 1, False
    return "parallelism not stated"


def _lengths(row: Mapping[str, str]) -> tuple[int, int] | str:
    dataset = row["dataset"].lower()
    isl = int(row["isl"]) if row["isl"].strip().isdigit() else None
    osl = int(row["osl"]) if row["osl"].strip().isdigit() else None
    if isl is None or osl is None:
        for key, d_isl, d_osl in _DATASETS:
            if key in dataset:
                return isl or d_isl, osl or d_osl
        return "input/output lengths unknown for this dataset"
    if "random-range-ratio 0.8" in dataset:
        # lengths drawn uniformly from [0.8, 1.0] x nominal
        return round(isl * 0.9), round(osl * 0.9)
    return isl, osl


def _quantization(precision: str, vendor: str, native: str) -> str | None:
    if "fp4" in precision:
        return None if native == "mxfp4_experts" else "fp4"
    if "fp8" in precision:
        return None if native == "fp8" else "fp8"
    if "not stated" in precision:
        return "fp4" if vendor == "nvidia" else "fp8"
    if precision in ("bf16", "fp16", "bf16/fp16", ""):
        return None
    return f"?precision {precision!r} not modelled"


def _load(row: Mapping[str, str], isl: int, osl: int) -> Workload | str:
    concurrency = row["concurrency"].strip().lower()
    rate = row["request_rate"].strip().lower()
    if concurrency.startswith("offline") or (concurrency in ("", "inf") and rate == "inf"):
        return Workload(isl, osl)
    if match := re.match(r"^(\d+)$", concurrency):
        return Workload(isl, osl, concurrency=int(match.group(1)), domain="chat")
    if "server" in concurrency and (match := re.match(r"^([\d.]+)", rate)):
        return Workload(isl, osl, rate=float(match.group(1)))
    if concurrency == "" and (match := re.match(r"^([\d.]+)$", rate)):
        return Workload(isl, osl, rate=float(match.group(1)), num_requests=500)
    return f"load {concurrency or '-'} / rate {rate or '-'} not modelled (no target rate or concurrency)"


def _metric_skip_reason(row: Mapping[str, str]) -> str | None:
    metric = row["metric"]
    if metric not in _METRICS:
        return f"metric {metric} not modelled"
    if metric.startswith("itl") and ("num-scheduler-steps" in row["engine"] or "issue" in row["source"].lower()):
        return "ITL is a streaming artifact for this source (README caveat 5)"
    return None


def evaluate(rows: Iterable[Mapping[str, str]], params: PerfParams | None = None) -> tuple[list[ScoredRow], list[SkippedRow]]:
    """Predict every modellable row; scenarios shared by several metric rows are predicted once."""
    params = params or default_params()
    scored: list[ScoredRow] = []
    skipped: list[SkippedRow] = []
    cache: dict[Scenario, Prediction | str] = {}
    for row in rows:
        reason = _metric_skip_reason(row)
        scenario = scenario_for(row) if reason is None else reason
        if isinstance(scenario, str):
            skipped.append(SkippedRow(row["id"], row["metric"], scenario))
            continue
        if scenario not in cache:
            cache[scenario] = _predict(scenario, params)
        prediction = cache[scenario]
        if isinstance(prediction, str):
            skipped.append(SkippedRow(row["id"], row["metric"], prediction))
            continue
        measured = _measured(row["value"])
        if measured is None:  # before, a ValueError (text) or a ZeroDivisionError (0) ended the whole run
            skipped.append(SkippedRow(row["id"], row["metric"], f"value {row['value']!r} is not a positive finite measurement"))
            continue
        family, read = _METRICS[row["metric"]]
        scored.append(ScoredRow(row["id"], row["metric"], family, measured, read(prediction)))
    return scored, skipped


def _measured(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) and value > 0 else None


def _predict(scenario: Scenario, params: PerfParams) -> Prediction | str:
    model, gpu = get_model(scenario.model), get_gpu(scenario.gpu)
    perf = PerfModel(model, gpu, scenario.config, params)
    if scenario.reserve_full_output:
        # TensorRT-LLM gives the KV cache 95% of the memory left after weights and ~3 GB of activations.
        free = 0.95 * (gpu.hbm_bytes - perf.weight_bytes_per_gpu - 3 * 2**30)
        fraction = (free + perf.weight_bytes_per_gpu) / gpu.hbm_bytes
        if 0.0 < fraction < 1.0:
            perf = PerfModel(model, gpu, EngineConfig.from_dict({**scenario.config.to_dict(), "mem_fraction_static": fraction}), params)
    if not perf.fits:
        return "model does not fit in this configuration's memory"
    load = scenario.workload
    if perf.kv_capacity_tokens < load.isl + load.osl:
        return "one request does not fit in KV memory"
    if load.concurrency is None and load.rate is None:
        return predict_offline(perf, load.isl, load.osl, reserve_full_output=scenario.reserve_full_output)
    return simulate(perf, [load], [1.0], seed=0)


def summarise(scored: Sequence[ScoredRow]) -> dict[str, float]:
    """Median absolute percentage error per metric family (NaN where a family has no rows)."""
    return {
        family: float(np.median([r.ape_pct for r in scored if r.family == family])) if any(r.family == family for r in scored) else math.nan
        for family in FAMILIES
    }
