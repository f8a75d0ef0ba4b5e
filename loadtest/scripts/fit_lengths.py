"""Fit the built-in length distributions and arrival shapes to the public traces (offline; run once).

    .venv/bin/python loadtest/scripts/fit_lengths.py [--shared ../shared] [--out loadtest/data/fitted.json]

Token lengths: a Gaussian mixture on log(tokens) (1-3 components, chosen by BIC), i.e. a mixture of
lognormals, clipped to the observed range. Azure 2023 rows are used as they are; ServeGen publishes
length PMFs, so 50,000 tokens are drawn from each PMF with a fixed seed and fitted the same way.
Arrivals: the Azure traces' mean rate and inter-arrival coefficient of variation (CV), which the
Gamma arrival process takes as its parameters. Deterministic: the same inputs give the same file.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
from datetime import datetime
from pathlib import Path

import numpy as np
from sklearn.mixture import GaussianMixture

from loadtest.lengths import LengthDist, LogComponent

_REPO = Path(__file__).resolve().parents[2]
_SEED = 20231116
_NUM_PMF_DRAWS = 50_000
_QUANTILES = (0.5, 0.9, 0.99)


def _fit_log_mixture(tokens: np.ndarray) -> dict[str, object]:
    log_tokens = np.log(np.maximum(tokens, 1)).reshape(-1, 1)
    best: GaussianMixture | None = None
    for num_components in (1, 2, 3):
        model = GaussianMixture(num_components, random_state=_SEED, n_init=2).fit(log_tokens)
        if best is None or model.bic(log_tokens) < best.bic(log_tokens):
            best = model
    assert best is not None
    order = np.argsort(best.means_.ravel())
    components: list[dict[str, float]] = [
        {
            "weight": round(float(best.weights_[i]), 4),
            "mu": round(float(best.means_.ravel()[i]), 4),
            "sigma": round(float(np.sqrt(best.covariances_.ravel()[i])), 4),
        }
        for i in order
    ]
    fit = LengthDist(
        tuple(LogComponent(c["weight"], c["mu"], c["sigma"]) for c in components), int(tokens.min()), int(tokens.max())
    )
    draws = fit.sample(np.random.default_rng(_SEED), 100_000)
    return {
        "components": components,
        "min": fit.min_tokens,
        "max": fit.max_tokens,
        "empirical": _quantiles(tokens),
        "fitted": _quantiles(draws),
    }


def _quantiles(values: np.ndarray) -> dict[str, float]:
    return {f"p{round(q * 100)}": round(float(np.quantile(values, q)), 1) for q in _QUANTILES}


def _read_azure(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    times: list[float] = []
    inputs: list[int] = []
    outputs: list[int] = []
    with path.open(newline="") as handle:
        for row in csv.DictReader(handle):
            stamp = row["TIMESTAMP"][:26]  # datetime takes at most 6 fractional digits
            times.append(datetime.fromisoformat(stamp).timestamp())
            inputs.append(int(row["ContextTokens"]))
            outputs.append(int(row["GeneratedTokens"]))
    return np.array(times), np.array(inputs), np.array(outputs)


def _arrival_shape(times: np.ndarray) -> dict[str, float]:
    gaps = np.diff(np.sort(times))
    return {
        "rate_rps": round(float(len(times) / (times.max() - times.min())), 4),
        "iat_cv": round(float(gaps.std() / gaps.mean()), 4),
    }


def _read_servegen_pmfs(path: Path) -> dict[tuple[str, str], tuple[np.ndarray, np.ndarray]]:
    rows: dict[tuple[str, str], list[tuple[int, float]]] = {}
    with gzip.open(path, "rt", newline="") as handle:
        for row in csv.DictReader(handle):
            rows.setdefault((row["model"], row["kind"]), []).append((int(row["tokens"]), float(row["prob"])))
    pmfs = {}
    for key, pairs in rows.items():
        tokens = np.array([t for t, _ in pairs])
        probs = np.array([p for _, p in pairs])
        pmfs[key] = (tokens, probs / probs.sum())
    return pmfs


def fit(shared: Path) -> dict[str, object]:
    traces = shared / "data" / "traces"
    profiles: dict[str, object] = {}
    arrivals: dict[str, object] = {}
    for name in ("code", "conv"):
        times, inputs, outputs = _read_azure(traces / "azure2023" / f"AzureLLMInferenceTrace_{name}.csv")
        profiles[f"azure-{name}"] = {
            "source": f"Azure LLM inference trace 2023, {name} (AzureLLMInferenceTrace_{name}.csv, CC-BY 4.0)",
            "num_requests": int(len(inputs)),
            "input": _fit_log_mixture(inputs),
            "output": _fit_log_mixture(np.maximum(outputs, 1)),
        }
        arrivals[f"azure-{name}"] = {"source": profiles[f"azure-{name}"]["source"], **_arrival_shape(times)}
    rng = np.random.default_rng(_SEED)
    pmfs = _read_servegen_pmfs(traces / "servegen" / "length_pmf.csv.gz")
    for model in ("m-large", "m-mid", "m-small", "deepseek-r1"):
        fitted = {}
        for kind in ("input", "output"):
            tokens, probs = pmfs[(model, kind)]
            draws = rng.choice(tokens, size=_NUM_PMF_DRAWS, p=probs)
            fitted[kind] = _fit_log_mixture(np.maximum(draws, 1))
        profiles[f"servegen-{model}"] = {
            "source": f"Alibaba ServeGen length_pmf.csv.gz, model {model} ({_NUM_PMF_DRAWS} seeded draws, Apache-2.0)",
            **fitted,
        }
    return {
        "about": "Fitted by loadtest/scripts/fit_lengths.py; lengths are mixtures of lognormals in tokens.",
        "seed": _SEED,
        "lengths": profiles,
        "arrivals": arrivals,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shared", type=Path, default=_REPO.parent / "shared")
    parser.add_argument("--out", type=Path, default=_REPO / "loadtest" / "data" / "fitted.json")
    args = parser.parse_args()
    args.out.write_text(json.dumps(fit(args.shared), indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
