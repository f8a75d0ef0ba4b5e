"""`polymorph bench priority` end to end with tiny settings: a real vLLM replica, a real gateway, three phases."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.cli import build_parser
from loadtest.bench.priority import PHASES, main_bench

pytestmark = pytest.mark.xdist_group("vllm")  # one vLLM (3 GB, two cores' worth) at a time: the vLLM tests keep to one xdist worker


def test_bench_priority_runs_its_three_phases_and_prints_ratios_last(
    vllm_python: Path, tiny_hf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = build_parser().parse_args([
        "bench", "priority", "--interactive", "3", "--interactive-every", "0.3", "--flood-concurrency", "4",
        "--flood-max-tokens", "12", "--flood-warmup", "1", "--max-num-seqs", "2",
        "--vllm-python", str(vllm_python), "--model-dir", str(tiny_hf), "--run-dir", str(tmp_path),
    ])
    code = main_bench(args)
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert code == 0 and summary["failed"] == 0, (lines, (tmp_path / "gateway.log").read_text()[-2000:])
    assert set(summary["ttft_p99_s"]) == set(PHASES) and all(v > 0 for v in summary["ttft_p99_s"].values())
    assert summary["no_priority_over_priority"] is not None
    assert [line.split()[0] for line in lines[1:4]] == ["alone", "flood+priority", "flood,"]
