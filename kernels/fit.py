"""Fit the performance model's few physical parameters to calibration.csv (`polymorph kernels fit`).

Least squares on log(predicted / measured) over every scored throughput and TPOT row (TTFT rows at
half weight: they carry queueing noise), with a soft-L1 loss so a handful of odd rows cannot drag the
fit. Parameters move in log space inside physical bounds (efficiencies in (0, 1])."""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import yaml
from scipy.optimize import least_squares

from kernels.calibration import evaluate, summarise
from kernels.perf_params import PARAMS_PATH, PerfParams

# (name, key inside a mapping parameter or None, lower bound, upper bound)
_FREE: tuple[tuple[str, str | None, float, float], ...] = (
    ("compute_efficiency", "bf16", 0.1, 1.0),
    ("compute_efficiency", "fp8", 0.1, 1.0),
    ("compute_efficiency", "fp4", 0.1, 1.0),
    ("bandwidth_efficiency", None, 0.3, 1.0),
    ("vendor_efficiency", "amd", 0.2, 1.0),
    ("step_overhead_s", None, 1e-5, 2e-2),
    ("layer_floor_s", None, 1e-7, 3e-4),
    ("moe_layer_floor_s", None, 1e-7, 5e-4),
    ("allreduce_latency_s", None, 1e-7, 2e-4),
    ("request_overhead_s", None, 1e-4, 0.2),
    ("moe_compute_efficiency", None, 0.02, 1.0),
)
_FAMILY_WEIGHT = {"throughput": 1.0, "tpot": 1.0, "ttft": 0.5}


def _vector(params: PerfParams) -> np.ndarray:
    values = []
    for name, key, _, _ in _FREE:
        value = getattr(params, name)
        values.append(value[key] if key else value)
    logs: np.ndarray = np.log(np.asarray(values, dtype=float))
    return logs


def _with_vector(params: PerfParams, vector: np.ndarray) -> PerfParams:
    changes: dict[str, object] = {}
    for (name, key, _, _), value in zip(_FREE, np.exp(vector), strict=True):
        if key:
            mapping = dict(changes.get(name, getattr(params, name)))  # type: ignore[call-overload]
            mapping[key] = float(value)
            changes[name] = mapping
        else:
            changes[name] = float(value)
    return dataclasses.replace(params, **changes)  # type: ignore[arg-type]


class NoScorableRows(ValueError):
    """Not one row could be scored: a fit would be to nothing, and its errors NaN."""


def fit_params(rows: Sequence[Mapping[str, str]], start: PerfParams, max_evals: int = 6) -> tuple[PerfParams, dict[str, float]]:
    """Fitted parameters and the resulting median APE per family. Raises NoScorableRows at the first
    evaluation when no row can be scored."""

    def residuals(vector: np.ndarray) -> np.ndarray:
        scored, _ = evaluate(rows, _with_vector(start, vector))
        if not scored:
            raise NoScorableRows("no row can be scored")
        return np.array([_FAMILY_WEIGHT[r.family] * np.log(max(r.predicted, 1e-12) / r.measured) for r in scored])

    lower = np.log([b[2] for b in _FREE])
    upper = np.log([b[3] for b in _FREE])
    x0 = np.clip(_vector(start), lower + 1e-9, upper - 1e-9)
    result = least_squares(residuals, x0, bounds=(lower, upper), loss="soft_l1", f_scale=0.2, diff_step=0.05, max_nfev=max_evals)
    fitted = _with_vector(start, result.x)
    scored, _ = evaluate(rows, fitted)
    return fitted, summarise(scored)


def write_params(params: PerfParams, errors: Mapping[str, float], source: str, path: Path = PARAMS_PATH) -> None:
    note = (f"least-squares fit (soft-L1 on log error) to {source} on {dt.date.today().isoformat()}; "
            f"median APE throughput {errors['throughput']:.1f}%, tpot {errors['tpot']:.1f}%, ttft {errors['ttft']:.1f}%")
    values = dataclasses.replace(params, fitted_on=note).to_dict()
    header = "# Fitted parameters of kernels.perf.PerfModel (equations in kernels/README.md).\n# Written by `polymorph kernels fit`; the fitted_on line says on what data and how well.\n"
    path.write_text(header + yaml.safe_dump(values, sort_keys=False))
