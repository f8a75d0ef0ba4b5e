"""`polymorph bench compile --evaluate probe`: the compiled configuration against the engine's defaults,
confirmed side by side, with the chosen one's prediction error; once end to end on a real llama-server."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from gateway.cli import build_parser
from kernels.catalog import get_gpu, get_model
from kernels.compiler.measurement import Measurement, ProbeFingerprint, ProbeLadder, ProbeStep
from kernels.compiler.probe import ProbeResult, probe_compile
from kernels.compiler.probe_bench import confirmed, summarize
from kernels.compiler.shape import TrafficShape, get_shape, shape_fingerprint, tier_shape
from kernels.compiler.store import TrialStore
from kernels.config import EngineConfig


class TableProber:
    """A STAND-IN engine for the bench's arithmetic: goodput by `--parallel` from a table. The real
    probers (loadtest/probe.py) are measured on llama-server and vLLM in test_compile_probe.py and below."""

    def __init__(self, goodput_rps: dict[int | None, float]) -> None:
        self.goodput_rps = goodput_rps
        self.calls: list[tuple[int | None, float]] = []  # (--parallel, the ladder's first rate) of each measurement

    def fingerprint(self) -> ProbeFingerprint:
        return ProbeFingerprint("llamacpp", "table", "cpu: test x 1 thread(s)", "0" * 64)

    def measure(self, config: EngineConfig, shape: TrafficShape, ladder: ProbeLadder) -> Measurement:
        self.calls.append((config.max_running_requests, ladder.start_rps))
        return _measured(self.goodput_rps.get(config.max_running_requests, 0.0), ladder.start_rps)


def _measured(goodput_rps: float, rate_rps: float = 0.2) -> Measurement:
    step = ProbeStep(rate_rps, 3, 3, 1.0 if goodput_rps else 0.0, 0.1, 0.2, 0.01, 0.02, 100.0, 1.0)
    return Measurement(goodput_rps, 0.1, 0.2, 0.01, 0.02, 100.0, step.attainment, (step,), wall_s=2.0)


def _compiled(prober: TableProber) -> ProbeResult:
    """A probe compile of the default only (budget 1: no screening), then, as if the compile had
    measured `--parallel 8` at 0.4 req/s and chosen it, that challenger beside the default."""
    result = probe_compile(get_model("tiny-llama"), get_gpu("cpu"), get_shape("short-chat"), 1, prober, 3)
    challenger = replace(result.baseline, config=EngineConfig(max_running_requests=8), engine_args=("--parallel", "8"),
                         measured=_measured(0.4), default=False, chosen=True)
    return replace(result, chosen=challenger, baseline=replace(result.baseline, chosen=False),
                   trials=(replace(result.baseline, chosen=False), challenger))


def test_the_speedup_is_the_side_by_side_confirmation_not_the_compiles_lucky_pair() -> None:
    # The compile measured the challenger at 2x the default (0.4 vs 0.2); measured again beside it, 1.5x.
    prober = TableProber({None: 0.2, 8: 0.3})
    compiled = _compiled(prober)
    cell = confirmed("llamacpp", "short-chat", compiled, prober, lambda line: None)
    out = cell.to_json()
    assert not out["chose_default"] and out["confirmed"] and out["chosen_args"] == ["--parallel", "8"]
    assert out["compile_speedup"] == pytest.approx(2.0) and out["speedup"] == pytest.approx(1.5)
    assert out["default_goodput_rps"] == pytest.approx(0.2) and out["chosen_goodput_rps"] == pytest.approx(0.3)
    # The compile measured the default once; the confirmation the default, then the chosen, from the lower goodput.
    assert prober.calls[1:] == [(None, 0.2), (8, 0.2)]
    assert out["chosen_prediction_error"] == pytest.approx(out["chosen_predicted_goodput_rps"] / 0.3 - 1.0)
    assert out["elapsed_s"] == pytest.approx(compiled.elapsed_s + 4.0)
    summary = summarize([cell])
    assert summary["cells_at_target"] == 1 and summary["best_speedup"] == pytest.approx(1.5) and summary["min_speedup"] == pytest.approx(1.5)
    assert summary["cells_rejected_on_confirmation"] == 0 and out["confirm_speedup"] == pytest.approx(1.5)

    # Measured again the other way round, the choice loses its confirmation: the default is kept (1.0x),
    # with the pair's own ratio beside it, and its prediction error is the default's.
    worse = confirmed("llamacpp", "short-chat", compiled, TableProber({None: 0.3, 8: 0.2}), lambda line: None)
    summary = summarize([cell, worse])
    assert summary["cells_rejected_on_confirmation"] == 1 and summary["cells_at_target"] == 1 and summary["min_speedup"] == 1.0
    assert summary["worst_confirm_speedup"] == pytest.approx(2 / 3)
    rejected = summary["per_cell"][1]  # type: ignore[index]
    assert rejected["rejected_on_confirmation"] and rejected["speedup"] == 1.0 and rejected["confirm_speedup"] == pytest.approx(2 / 3)
    assert rejected["chosen_args"] == list(compiled.baseline.engine_args) and rejected["compile_chosen_args"] == ["--parallel", "8"]
    assert rejected["chosen_goodput_rps"] == pytest.approx(0.3) == rejected["default_goodput_rps"]
    assert rejected["chosen_prediction_error"] == pytest.approx(compiled.baseline.predicted.goodput_rps / 0.3 - 1.0)
    assert worse.adopted is compiled.baseline
    # A tie keeps the default too: a restart for no measured gain
    tie = confirmed("llamacpp", "short-chat", compiled, TableProber({None: 0.3, 8: 0.3}), lambda line: None)
    assert tie.rejected and tie.speedup == 1.0
    # A default that met no rate gives the chosen one's ratio to the lowest rate tried, as a lower bound.
    unbounded = replace(cell, confirm_default=_measured(0.0, rate_rps=0.1), confirm_chosen=_measured(0.4))
    assert unbounded.speedup is None and unbounded.default_below_rps == 0.1
    assert summarize([unbounded])["best_speedup"] == pytest.approx(4.0)


def test_a_chosen_default_is_not_measured_again_and_is_1x() -> None:
    prober = TableProber({None: 0.4})
    result = probe_compile(get_model("tiny-llama"), get_gpu("cpu"), get_shape("short-chat"), 1, prober, 3)
    out = confirmed("llamacpp", "short-chat", result, prober, lambda line: None).to_json()
    assert out["chose_default"] and not out["confirmed"] and out["speedup"] == 1.0 and len(prober.calls) == 1


def test_bench_compile_probe_rejects_what_it_cannot_measure() -> None:
    for args, message in ((["--engines", "sglang"], "not ['sglang']"), (["--shapes", "nope"], "unknown traffic shape"),
                          (["--model", "nope"], "nope")):
        parsed = build_parser().parse_args(["bench", "compile", "--evaluate", "probe", *args])
        with pytest.raises(SystemExit, match=re.escape(message)):
            parsed.handler(parsed)
    with pytest.raises(SystemExit):  # argparse: argument --budget: must be an integer >= 1
        build_parser().parse_args(["bench", "compile", "--evaluate", "probe", "--budget", "0"])


@pytest.mark.slow
def test_bench_compile_probe_measures_a_cell_on_a_real_llama_server(tmp_path: Path, llama_server_bin: Path, tiny_gguf: Path) -> None:
    # Budget 1: the default only (the comparison itself is the table tests' above; this is the wiring).
    done = subprocess.run([sys.executable, "-m", "gateway.cli", "bench", "compile", "--evaluate", "probe", "--engines", "llamacpp",
                           "--shapes", "short-chat", "--budget", "1", "--probe-requests", "2", "--store", str(tmp_path / "s.sqlite3")],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[0].split()[:4] == ["engine", "shape", "default", "chosen"] and lines[1].startswith("llamacpp  short-chat")
    summary = json.loads(lines[-1])
    assert summary["evaluator"] == "probe" and summary["cells"] == 1
    (cell,) = summary["per_cell"]
    assert cell["engine"] == "llamacpp" and cell["chose_default"] and cell["speedup"] == 1.0 and cell["measured"] == 1
    assert cell["fingerprint"]["engine"] == "llamacpp" and "measured goodput" in done.stderr
    with TrialStore(tmp_path / "s.sqlite3") as store:
        assert len(store.probe_trials(cell["run_id"])) == 1


def test_a_tier_judges_the_shape_by_its_objectives_and_keeps_its_trials_apart() -> None:
    standard = tier_shape("short-chat", "standard")
    assert (standard.ttft_p99_s, standard.tpot_p99_s, standard.tier) == (3.0, 0.1, "standard")
    assert standard.prompt_tokens == get_shape("short-chat").prompt_tokens
    # a warm start never reuses a trial judged against other objectives
    assert shape_fingerprint(standard) != shape_fingerprint(tier_shape("short-chat", "interactive")) == shape_fingerprint(get_shape("short-chat"))
