"""`polymorph kernels fit --store FILE`: a goodput correction per fingerprint fitted to measured probe
trials (rows recorded from real llama-server runs, data/probe_trials_tiny_llama.json), its error on
held-back trials before and after, and the store's choice of which measured trials a compile may reuse."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from kernels.catalog import get_gpu, get_model
from kernels.compiler.evaluators import Metrics
from kernels.compiler.measurement import Measurement, ProbeFingerprint
from kernels.compiler.probe_fit import split
from kernels.compiler.shape import TrafficShape, get_shape
from kernels.compiler.store import ProbeTrialRecord, TrialStore
from kernels.config import EngineConfig

POLYMORPH = [sys.executable, "-m", "gateway.cli"]
RECORDED = Path(__file__).parent / "data" / "probe_trials_tiny_llama.json"


def _polymorph(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*POLYMORPH, *args], capture_output=True, text=True, timeout=60, check=False)


def _load_recorded(store: TrialStore) -> list[ProbeTrialRecord]:
    for row in json.loads(RECORDED.read_text()):
        store.record_probe_trial(
            row["run_id"], 0.0, get_model(row["model"]), get_gpu(row["gpu"]), get_shape(row["shape"]),
            TrafficShape.from_dict(row["measured_shape"]), EngineConfig.from_dict(row["config"]),
            Metrics.from_dict(row["predicted"]), Measurement.from_dict(row["measured"]),
            ProbeFingerprint(**{k: v for k, v in row["fingerprint"].items() if k != "digest"}), row["default"], row["chosen"])
    return store.probe_trials()


def test_the_fit_predicts_held_back_measured_trials_better_and_is_kept_for_the_fingerprint(tmp_path: Path) -> None:
    path = tmp_path / "trials.sqlite3"
    with TrialStore(path) as store:
        records = _load_recorded(store)
    done = _polymorph("kernels", "fit", "--store", str(path), "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["num_trials"] == len(records) and out["written"]
    (correction,) = out["corrections"]  # one engine version, CPU and weights in the recording
    usable = [r for r in records if r.measured.goodput_rps > 0]
    fit, held = split(usable)
    assert held and correction["num_held_back"] == len(held) and correction["num_fit"] == len(fit)
    assert correction["num_censored"] == len(records) - len(usable)
    # The factor is the geometric mean of measured / predicted over the fitted trials only.
    expected = math.exp(sum(math.log(r.measured.goodput_rps / r.predicted.goodput_rps) for r in fit) / len(fit))
    assert math.isclose(correction["goodput_factor"], expected, rel_tol=1e-9)
    assert correction["held_back_after_pct"] < correction["held_back_before_pct"]
    assert correction["fit_after_pct"] < correction["fit_before_pct"]
    with TrialStore(path) as store:
        kept = store.probe_correction(records[0].fingerprint.digest(), "tiny-llama")
        assert store.probe_correction("0" * 16, "tiny-llama") is None  # another engine, CPU or weights: no correction
    assert kept is not None and kept.goodput_factor == correction["goodput_factor"]
    assert kept.goodput_rps(records[0].predicted.goodput_rps) == records[0].predicted.goodput_rps * kept.goodput_factor

    table = _polymorph("kernels", "fit", "--store", str(path), "--dry-run")
    assert table.returncode == 0, table.stderr
    assert "held before" in table.stdout and "held after" in table.stdout and "not written" in table.stdout
    assert f"{correction['held_back_before_pct']:.1f}" in table.stdout and f"{correction['held_back_after_pct']:.1f}" in table.stdout


def test_fit_without_measured_trials_says_so(tmp_path: Path) -> None:
    empty = tmp_path / "empty.sqlite3"
    TrialStore(empty).close()
    done = _polymorph("kernels", "fit", "--store", str(empty), "--json")
    assert done.returncode != 0 and "no measured trial" in done.stderr and "Traceback" not in done.stderr
    done = _polymorph("kernels", "fit", "--store", str(tmp_path / "absent.sqlite3"))
    assert done.returncode != 0 and "no trial store" in done.stderr
    done = _polymorph("kernels", "fit", "--store", str(empty), "--data", str(empty))
    assert done.returncode != 0 and "not both" in done.stderr


def test_a_compile_may_reuse_only_trials_of_its_fingerprint_shape_and_ladder_size(tmp_path: Path) -> None:
    with TrialStore(tmp_path / "trials.sqlite3") as store:
        records = _load_recorded(store)
        first = records[0]
        model, gpu, shape = get_model(first.model), get_gpu(first.gpu), get_shape(first.shape_name)
        measured_shape = TrafficShape.from_dict(json.loads(RECORDED.read_text())[0]["measured_shape"])
        per_step = first.measured.steps[0].num_requests
        same = store.reusable_probe_trials(first.fingerprint, shape, measured_shape, per_step)
        assert [r.trial_id for r in same] == [r.trial_id for r in records if r.measured.steps[0].num_requests == per_step]
        newer = replace(first.fingerprint, engine_version="0.6.0")
        store.record_probe_trial("later", 1.0, model, gpu, shape, measured_shape, first.config, first.predicted, first.measured,
                                 newer, True, True)
        assert store.reusable_probe_trials(first.fingerprint, shape, measured_shape, per_step) == same
        assert [r.run_id for r in store.reusable_probe_trials(newer, shape, measured_shape, per_step)] == ["later"]
        assert store.reusable_probe_trials(first.fingerprint, get_shape("reasoning"), measured_shape, per_step) == []
        assert store.reusable_probe_trials(first.fingerprint, shape, measured_shape, per_step + 1) == []
