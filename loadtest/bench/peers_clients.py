"""sglang's own serving benchmark through Polymorph: a tool people already use must work unchanged.

``python -m sglang.bench_serving --backend sglang-oai`` runs from the cached sglang venv against a
Polymorph gateway in front of one emulated replica and must complete every request it sent. It
needs a tokenizer; the hub is out of reach here, so it gets a local one: the Hugging Face
``tokenizer.json`` that the litellm package ships (litellm/litellm_core_utils/tokenizers/), in a
directory beside a one-line ``tokenizer_config.json``. The ``random-ids`` dataset draws token ids
from that tokenizer, so no data set is downloaded either.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import orjson

from loadtest.bench.peers_setup import LITELLM
from loadtest.demo_credentials import DEMO_API_KEY
from loadtest.procs import ProcessRegistry, free_port, wait_for_port

_MODEL = "llama-3.1-8b"
_SHIPPED_TOKENIZER = "litellm/litellm_core_utils/tokenizers/anthropic_tokenizer.json"
_STARTUP_TIMEOUT_S = 60.0


def run_bench_serving(
    args: argparse.Namespace, run_dir: Path, sglang_python: Path | None, result: dict[str, object],
    say: Callable[[str], None],
) -> str:
    if sglang_python is None:
        result["bench_serving"] = {"error": "sglang is not installed (see the set-up lines above)"}
        return "bench_serving: skipped, sglang is not installed"
    tokenizer_dir = local_tokenizer_dir(run_dir)
    if tokenizer_dir is None:
        result["bench_serving"] = {"error": f"no local tokenizer: {_SHIPPED_TOKENIZER} not found in the litellm venv"}
        return "bench_serving: skipped, no local tokenizer"
    with ProcessRegistry(run_dir) as registry:
        gateway_url = _start_gateway(registry)
        say(f"bench_serving: {args.num_prompts} requests through Polymorph")
        summary = _run_tool(args, sglang_python, gateway_url, tokenizer_dir, run_dir, say)
    result["bench_serving"] = summary
    return (
        f"sglang.bench_serving through Polymorph: sent {summary.get('sent')}, completed {summary.get('completed')}, "
        f"TTFT p99 {summary.get('p99_ttft_ms')} ms, {summary.get('request_throughput')} req/s"
    )


def local_tokenizer_dir(run_dir: Path) -> Path | None:
    """A directory AutoTokenizer loads offline, built from the tokenizer.json litellm ships; None if absent."""
    candidates = sorted((LITELLM.python.parent.parent / "lib").glob(f"python*/site-packages/{_SHIPPED_TOKENIZER}"))
    if not candidates:
        return None
    directory = run_dir / "tokenizer"
    directory.mkdir(exist_ok=True)
    shutil.copyfile(candidates[0], directory / "tokenizer.json")
    (directory / "tokenizer_config.json").write_bytes(orjson.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return directory


def _start_gateway(registry: ProcessRegistry) -> str:
    emulator_port, gateway_port = free_port(), free_port()
    emulator = registry.start("bench-serving-emulator", [
        sys.executable, "-m", "gateway.cli", "emulate", "--model", _MODEL, "--gpu", "H100-SXM",
        "--port", str(emulator_port), "--speed", "20", "--served-model-name", _MODEL,
    ])
    wait_for_port(emulator_port, emulator, _STARTUP_TIMEOUT_S)
    gateway = registry.start("bench-serving-gateway", [
        sys.executable, "-m", "gateway.cli", "serve", "--upstream", f"http://127.0.0.1:{emulator_port}",
        "--port", str(gateway_port),
    ])
    wait_for_port(gateway_port, gateway, _STARTUP_TIMEOUT_S)
    return f"http://127.0.0.1:{gateway_port}"


def _run_tool(
    args: argparse.Namespace, sglang_python: Path, gateway_url: str, tokenizer_dir: Path, run_dir: Path,
    say: Callable[[str], None],
) -> dict[str, object]:
    output = run_dir / "bench_serving.jsonl"
    argv = [
        str(sglang_python), "-m", "sglang.bench_serving", "--backend", "sglang-oai", "--base-url", gateway_url,
        "--model", _MODEL, "--tokenizer", str(tokenizer_dir), "--dataset-name", "random-ids",
        "--num-prompts", str(args.num_prompts), "--random-input-len", "256", "--random-output-len", "32",
        "--request-rate", "20", "--seed", str(args.seed), "--output-file", str(output),
    ]
    env = {**os.environ, "OPENAI_API_KEY": DEMO_API_KEY, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600, check=False)
    if done.returncode != 0 or not output.exists():
        say(f"bench_serving failed ({done.returncode}): {(done.stdout + done.stderr)[-1500:]}")
        return {"sent": args.num_prompts, "completed": 0, "error": f"exit {done.returncode}"}
    last = orjson.loads(output.read_text().strip().splitlines()[-1])
    keep = ("completed", "duration", "request_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms")
    summary: dict[str, object] = {"sent": args.num_prompts}
    summary.update({key: round(last[key], 3) if isinstance(last.get(key), float) else last.get(key) for key in keep})
    summary["all_completed"] = last.get("completed") == args.num_prompts
    return summary
