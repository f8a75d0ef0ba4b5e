"""The ServeGen drifting trace (loadtest/scripts/build_servegen_drift.py) built from ../shared on a small slice."""

from __future__ import annotations

from pathlib import Path

from loadtest.scripts.build_servegen_drift import build
from loadtest.traces import read_trace, write_native


def _reasoning_share(start_h: float, shared: Path) -> float:
    workload = build(shared, start_h, 0.5, 0.002, seed=7)
    return sum(spec.domain == "math" for spec in workload.specs) / workload.num_requests


def test_a_slice_builds_deterministically_round_trips_and_drifts(shared_dir: Path, tmp_path: Path) -> None:
    night = build(shared_dir, 2.0, 0.5, 0.002, seed=7)
    assert night.specs == build(shared_dir, 2.0, 0.5, 0.002, seed=7).specs
    assert night.duration_s == 1800 and 700 < night.num_requests < 1200  # ~(222 + 33) req/s x 0.002 x 1800 s = ~920
    assert {spec.tier for spec in night.specs} == {"interactive", "standard"}
    write_native(night, tmp_path / "trace.jsonl")
    again = read_trace(tmp_path / "trace.jsonl", "native")
    assert again.num_requests == night.num_requests and not again.issues
    assert [(s.input_tokens, s.output_tokens, s.domain) for s in again.specs] == [(s.input_tokens, s.output_tokens, s.domain) for s in night.specs]
    # the reasoning service's share of the requests: ~13% at 02:00, ~3-4% at 09:00
    assert _reasoning_share(2.0, shared_dir) > 2.5 * _reasoning_share(9.0, shared_dir)
