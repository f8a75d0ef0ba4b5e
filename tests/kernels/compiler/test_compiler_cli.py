"""`polymorph compile`, `compile history`, the trace summary and the worker process, end to end."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

from kernels.compiler import Budget, CompileRequest, CompileWorker
from kernels.compiler.evaluators import ReplayEvaluator
from kernels.compiler.trace_shape import prefix_share, shape_from_trace

POLYMORPH = [sys.executable, "-m", "gateway.cli"]
METRIC_KEYS = {"goodput_rps", "throughput_tokens_s", "ttft_p99_s", "tpot_p99_s", "cost_per_mtok"}


def _polymorph(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*POLYMORPH, *args], capture_output=True, text=True, timeout=120, check=False)


def test_compile_json_contract_and_history(tmp_path: Path) -> None:
    store = tmp_path / "trials.sqlite3"
    done = _polymorph("compile", "--model", "llama-3.1-8b", "--gpu", "H100", "--shape", "reasoning", "--budget", "2",
                      "--store", str(store), "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert {"config", "sglang_args", "vllm_args", "predicted", "baseline", "trials", "warm_start", "store"} <= set(report)
    assert set(report["predicted"]) >= METRIC_KEYS and set(report["baseline"]) >= METRIC_KEYS
    assert report["trials"] == 2 and report["warm_start"] is False and report["store"] == str(store)
    assert report["sglang_args"][:2] == ["--model-path", "meta-llama/Llama-3.1-8B"] and report["vllm_args"][0] == "serve"
    assert report["predicted"]["goodput_rps"] >= report["baseline"]["goodput_rps"] > 0
    history = _polymorph("compile", "history", "--store", str(store), "--trials")
    assert history.returncode == 0, history.stderr
    assert "shape reasoning" in history.stdout and "winner:" in history.stdout and "engine-default" in history.stdout


def test_compile_reports_bad_input_plainly(tmp_path: Path) -> None:
    done = _polymorph("compile", "--model", "llama-3.1-8b", "--gpu", "H100", "--shape", "nope", "--no-store")
    assert done.returncode != 0 and "built-in shapes: short-chat, long-context, reasoning, batch" in done.stderr
    corrupt = tmp_path / "bad.sqlite3"
    corrupt.write_bytes(b"garbage" * 200)
    done = _polymorph("compile", "history", "--store", str(corrupt))
    assert done.returncode != 0 and "not a readable SQLite trial store" in done.stderr
    other = tmp_path / "other.sqlite3"  # someone else's SQLite file: read, never given the store's tables
    with sqlite3.connect(other) as db:
        db.execute("CREATE TABLE mine (a)")
    for argv in (("compile", "history", "--store", str(other)), ("kernels", "fit", "--store", str(other), "--dry-run")):
        done = _polymorph(*argv)
        assert done.returncode != 0 and "is not a Polymorph trial store" in done.stderr, done.stderr
    with sqlite3.connect(other) as db:
        assert [name for (name,) in db.execute("SELECT name FROM sqlite_master")] == ["mine"]
    done = _polymorph("compile", "history", "--store", str(other), "--model", "nope")  # was a traceback
    assert done.returncode != 0 and "unknown model 'nope'" in done.stderr and "Traceback" not in done.stderr
    (tmp_path / "a-file").write_text("")
    base = ("compile", "--model", "llama-3.1-8b", "--gpu", "H100", "--shape", "reasoning")
    for extra, says in ((("--budget", "0", "--no-store"), "argument --budget: must be an integer >= 1"),
                        (("--seconds", "-1", "--no-store"), "argument --seconds: must be > 0"),
                        (("--gpus", "0", "--no-store"), "argument --gpus: must be an integer >= 1"),
                        (("--budget", "2", "--store", str(tmp_path / "a-file" / "trials.sqlite3")), "cannot create the trial store's folder")):
        done = _polymorph(*base, *extra)  # each was a traceback
        assert done.returncode != 0 and says in done.stderr and "Traceback" not in done.stderr, done.stderr
    for extra in (("--engine", "llamacpp"), ("--model-path", "/models/m"), ("--devices", "0")):  # before, ignored without a word
        done = _polymorph(*base, "--budget", "2", "--no-store", *extra)
        assert done.returncode != 0 and f"only --evaluator probe reads {' '.join(extra) if extra[0] == '--engine' else extra[0]}" in done.stderr
    done = _polymorph("compile", "--evaluator", "probe", "--engine", "llamacpp", "--model", "llama-3.1-8b", "--shape", "short-chat",
                      "--budget", "0", "--no-store")  # was a ValueError from probe_compile, after the engine's set-up
    assert done.returncode == 2 and "argument --budget: must be an integer >= 1" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_trace_becomes_a_shape_and_a_replay(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    rows = [{"timestamp": i * 100, "input_length": 1024 + 512 * (i % 3), "output_length": 64 + i, "hash_ids": [1, 2, 10 + i]}
            for i in range(40)]
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\nnot json\n")
    shape, requests = shape_from_trace(trace, "mooncake", tier="standard")
    assert len(requests) == 40 and requests[-1].arrival_s == 3.9  # Mooncake timestamps are milliseconds
    assert shape.ttft_p99_s == 3.0 and shape.arrival_rate_rps == 40 / 3.9
    assert prefix_share(requests) == (2 * 39) / (3 * 40)
    from kernels.catalog import get_gpu, get_model
    from kernels.config import EngineConfig

    metrics = ReplayEvaluator(requests, speedups=(1, 4)).evaluate(get_model("llama-3.1-8b"), get_gpu("H100"), EngineConfig(), shape)
    assert metrics.goodput_rps == 4 * 40 / 3.9 and metrics.ttft_p99_s < shape.ttft_p99_s


def test_compile_runs_in_a_worker_process(tmp_path: Path) -> None:
    store = tmp_path / "w.sqlite3"
    with CompileWorker() as worker:
        future = worker.submit(CompileRequest("llama-3.1-8b", "H100", 1, "batch", budget=Budget(trials=2), store_path=str(store),
                                                   evaluator="analytic"))
        result = future.result(timeout=120)
    assert result is not None and result.trials == 2 and result.store_path == str(store)


def test_compile_reads_an_azure_2024_trace_with_utc_offsets(tmp_path: Path) -> None:
    """Azure's 2024 trace stamps carry a UTC offset: every row counts (the compiler once skipped them all)."""
    trace = tmp_path / "azure2024.csv"
    stamps = [f"2024-05-10 00:00:{i // 2:02d}.{(i % 2) * 5}00000+00:00" for i in range(40)]
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     + "".join(f"{stamp},{512 + 64 * (i % 5)},{32 + i}\n" for i, stamp in enumerate(stamps)))
    done = _polymorph("compile", "--model", "llama-3.1-8b", "--gpu", "H100", "--trace", str(trace), "--format", "azure",
                      "--budget", "2", "--no-store", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["trials"] == 2 and report["predicted"]["goodput_rps"] > 0
    shape, requests = shape_from_trace(trace, "azure")
    assert len(requests) == 40 and requests[-1].arrival_s == 19.5 and shape.arrival_rate_rps == 40 / 19.5
