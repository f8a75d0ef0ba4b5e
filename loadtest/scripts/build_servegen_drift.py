"""Build a drifting trace from Alibaba ServeGen's published rates and lengths (offline; needs ../shared).

    .venv/bin/python loadtest/scripts/build_servegen_drift.py [--shared ../shared] [--out servegen-drift.jsonl]
        [--start-h 1] [--hours 8] [--scale 0.002] [--seed 20250609]

Two Bailian services over the same hours of the same day: ``m-large`` (a general language model:
chat, tier interactive) and ``deepseek-r1`` (a reasoning model: domain math, long outputs, tier
standard). Each 600 s window of ``aggregate_rate.csv`` gives each service's request rate, both
multiplied by one ``--scale`` so their ratio stays the data's; arrivals are Poisson within a window at
that rate; prompt and output lengths are drawn independently from the service's ``length_pmf.csv.gz``
(ServeGen publishes marginal distributions, not per-request pairs). Why it drifts: the reasoning
service peaks at night (14.7% of m-large's requests at 02:00) and falls to ~3.5% by 09:00 while
m-large rises by half; over the default hours 01:00-09:00 the requests the router classifies as
``reasoning`` (math, >= 384 output tokens) fall from 10% to 3% of the requests and from 18% to 4% of
the tokens (prompt + output). Deterministic: the same inputs and seed give the same file.
The output is the native JSONL trace (``polymorph simulate --trace F --format native --speedup X``).
"""

from __future__ import annotations

import argparse
import csv
import gzip
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loadtest.spec import RequestSpec, Workload, make_workload
from loadtest.traces import write_native

_REPO = Path(__file__).resolve().parents[2]
WINDOW_S = 600.0  # ServeGen's rate windows


@dataclass(frozen=True, slots=True)
class Service:
    model: str  # ServeGen's model name
    domain: str
    tier: str


SERVICES = (Service("m-large", "chat", "interactive"), Service("deepseek-r1", "math", "standard"))


def read_rates(path: Path, models: set[str]) -> dict[str, dict[float, float]]:
    """model -> window start (s) -> total request rate (req/s) of every client."""
    out: dict[str, dict[float, float]] = {model: {} for model in models}
    with path.open(newline="") as handle:
        for row in csv.DictReader(handle):
            if row["model"] in models:
                out[row["model"]][float(row["window_start_s"])] = float(row["total_rate_rps"])
    return out


def read_pmfs(path: Path, models: set[str]) -> dict[tuple[str, str], tuple[np.ndarray, np.ndarray]]:
    """(model, "input" | "output") -> (tokens, probabilities summing to 1)."""
    rows: dict[tuple[str, str], list[tuple[int, float]]] = {}
    with gzip.open(path, "rt", newline="") as handle:
        for row in csv.DictReader(handle):
            if row["model"] in models:
                rows.setdefault((row["model"], row["kind"]), []).append((int(row["tokens"]), float(row["prob"])))
    out = {}
    for key, pairs in rows.items():
        tokens = np.array([t for t, _ in pairs], dtype=np.int64)
        probs = np.array([p for _, p in pairs], dtype=np.float64)
        out[key] = (tokens, probs / probs.sum())
    return out


def build(shared: Path, start_h: float, hours: float, scale: float, seed: int) -> Workload:
    folder = shared / "data" / "traces" / "servegen"
    models = {s.model for s in SERVICES}
    rates = read_rates(folder / "aggregate_rate.csv", models)
    pmfs = read_pmfs(folder / "length_pmf.csv.gz", models)
    rng = np.random.default_rng(seed)
    begin_s, end_s = start_h * 3600.0, (start_h + hours) * 3600.0
    specs: list[RequestSpec] = []
    for window_s in np.arange(begin_s, end_s, WINDOW_S):
        for service in SERVICES:
            rate = rates[service.model].get(float(window_s), 0.0) * scale
            count = int(rng.poisson(rate * WINDOW_S))
            if count == 0:
                continue
            arrivals = np.sort(rng.uniform(0.0, WINDOW_S, count)) + window_s - begin_s
            (prompt_tokens, prompt_probs), (output_tokens, output_probs) = pmfs[(service.model, "input")], pmfs[(service.model, "output")]
            prompts = rng.choice(prompt_tokens, size=count, p=prompt_probs)
            outputs = rng.choice(output_tokens, size=count, p=output_probs)
            specs += [RequestSpec(float(at), max(1, int(p)), max(1, int(o)), service.domain, tier=service.tier,
                                  label=f"servegen-{service.model}")
                      for at, p, o in zip(arrivals, prompts, outputs, strict=True)]
    return make_workload("servegen-drift", specs, end_s - begin_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shared", type=Path, default=_REPO.parent / "shared")
    parser.add_argument("--out", type=Path, default=Path("servegen-drift.jsonl"))
    parser.add_argument("--start-h", type=float, default=1.0, help="first hour of day 1 (default: 01:00)")
    parser.add_argument("--hours", type=float, default=8.0)
    parser.add_argument("--scale", type=float, default=0.002, help="both services' rates times this (default: ~0.5 req/s)")
    parser.add_argument("--seed", type=int, default=20250609)
    args = parser.parse_args()
    workload = build(args.shared, args.start_h, args.hours, args.scale, args.seed)
    write_native(workload, args.out)
    print(f"{args.out}: {workload.num_requests} requests over {workload.duration_s:.0f} s")


if __name__ == "__main__":
    main()
