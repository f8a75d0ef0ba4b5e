"""Deterministic gates every candidate passes before any evaluation, whoever proposed it.

1. `check_constraints`: sglang's structural rules (TP divides the attention heads and the replica's
   GPUs, the CUDA-graph batch fits under max running requests, ...).
2. `check_memory`: weights fit, the KV pool holds the shape's largest request twice over, and the
   HBM left outside `mem_fraction_static` covers activations and CUDA graphs.
3. `ParserGate`: the rendered arguments parse with sglang's own `ServerArgs.add_cli_args` +
   `from_cli_args`, run in a separate sglang interpreter (sglang is never installed beside
   Polymorph). With no interpreter configured it reports "skipped", never "passed"."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kernels.catalog import GpuSpec, ModelSpec
from kernels.compiler.shape import TrafficShape
from kernels.config import EngineConfig, SglangTarget
from kernels.perf import PerfModel

SGLANG_PYTHON_ENV = "POLYMORPH_SGLANG_PYTHON"
_GIB = 2**30
_BASE_RESERVE_BYTES = 1.5 * _GIB  # CUDA context, NCCL buffers, allocator slack
_GRAPH_BYTES_PER_SEQ_LAYER = 160 * 1024  # captured-graph activation buffers, per batch slot and layer
_PARSER_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class GateResult:
    gate: str  # "constraints", "memory" or "sglang-parser"
    status: str  # "passed", "rejected" or "skipped"
    reason: str = ""

    @property
    def rejected(self) -> bool:
        return self.status == "rejected"


def check_constraints(model: ModelSpec, gpu: GpuSpec, num_gpus: int, config: EngineConfig) -> GateResult:
    reason = _constraint_violation(model, gpu, num_gpus, config)
    return GateResult("constraints", "rejected" if reason else "passed", reason or "")


def _constraint_violation(model: ModelSpec, gpu: GpuSpec, num_gpus: int, config: EngineConfig) -> str | None:
    if config.tp * config.dp != num_gpus:
        return f"tp ({config.tp}) x dp ({config.dp}) must equal the replica's {num_gpus} GPUs"
    if model.num_heads % config.tp:
        return f"tp {config.tp} does not divide the {model.num_heads} attention heads"
    kv_heads = model.num_kv_heads
    if not model.is_mla and kv_heads % config.tp and config.tp % kv_heads:
        return f"tp {config.tp} and the {kv_heads} KV heads must divide one another"
    resolved = PerfModel(model, gpu, config).config
    if not config.disable_cuda_graph and resolved.cuda_graph_max_bs > resolved.max_running_requests:  # type: ignore[operator]
        return (f"cuda_graph_max_bs {resolved.cuda_graph_max_bs} exceeds max_running_requests "
                f"{resolved.max_running_requests} (graphs for batches that never run waste memory)")
    if config.schedule_policy == "lpm" and not config.enable_prefix_caching:
        return "schedule_policy lpm orders by cached prefix and needs the prefix (radix) cache"
    if gpu.fp8_tflops is None and ("fp8" in config.kv_cache_dtype or config.quantization is not None):
        return f"{gpu.name} has no fp8 tensor cores for fp8 weights or KV cache"
    if config.speculative_algorithm == "MTP" and not model.is_mla:
        return f"MTP speculative decoding needs a checkpoint with MTP heads; {model.name} has none"
    return None


def activation_reserve_bytes(model: ModelSpec, config: EngineConfig) -> float:
    """HBM a rank needs outside the static pool: a prefill chunk's activations (MLP intermediate
    and logits), captured CUDA graphs and fixed runtime buffers. A heuristic, deliberately generous."""
    chunk = config.chunked_prefill_size if (config.chunked_prefill_size or 0) > 0 else config.max_prefill_tokens
    per_token = (3 * model.intermediate_size + 4 * model.hidden_size) * 2 / config.tp
    graphs = 0 if config.disable_cuda_graph else (config.cuda_graph_max_bs or 0) * model.num_layers * _GRAPH_BYTES_PER_SEQ_LAYER
    return _BASE_RESERVE_BYTES + chunk * per_token + graphs


def check_memory(model: ModelSpec, gpu: GpuSpec, config: EngineConfig, shape: TrafficShape) -> GateResult:
    perf = PerfModel(model, gpu, config)
    resolved = perf.config
    needed = 2 * shape.max_request_tokens
    if perf.kv_capacity_tokens < needed:
        return GateResult("memory", "rejected", f"KV pool holds {perf.kv_capacity_tokens} tokens per replica; the shape's "
                          f"largest request needs {shape.max_request_tokens} and two must fit ({needed})")
    headroom = gpu.hbm_bytes * (1.0 - resolved.mem_fraction_static)  # type: ignore[operator]
    reserve = activation_reserve_bytes(model, resolved)
    if headroom < reserve:
        return GateResult("memory", "rejected", f"mem_fraction_static {resolved.mem_fraction_static} leaves "
                          f"{headroom / _GIB:.1f} GiB for activations and CUDA graphs; they need {reserve / _GIB:.1f} GiB")
    return GateResult("memory", "passed")


# Runs inside the sglang interpreter: one JSON list of argument lists on stdin, one JSON list of
# {"ok": bool, "error": str} on stdout. argparse errors raise instead of exiting.
PARSER_DRIVER = r"""
import argparse, json, sys
from sglang.srt.server_args import ServerArgs

class _Fail(Exception):
    pass

def _error(message):
    raise _Fail(message)

results = []
for argv in json.load(sys.stdin):
    parser = argparse.ArgumentParser()
    parser.error = _error
    ServerArgs.add_cli_args(parser)
    try:
        ServerArgs.from_cli_args(parser.parse_args(argv))
        results.append({"ok": True, "error": ""})
    except BaseException as exc:
        results.append({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
sys.stdout.write(json.dumps(results))
"""


# Runs inside the sglang interpreter: its version (None for a package without metadata) and every
# option string its parser registers, as one JSON object on stdout.
TARGET_DRIVER = r"""
import argparse, importlib.metadata, json, sys
from sglang.srt.server_args import ServerArgs

parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
try:
    version = importlib.metadata.version("sglang")
except importlib.metadata.PackageNotFoundError:
    version = None
sys.stdout.write(json.dumps({"version": version, "option_strings": sorted(
    s for action in parser._actions for s in action.option_strings)}))
"""
# (interpreter, extra environment) -> what it reported: importing sglang takes 10-20 s; once a process is enough
_TARGETS: dict[tuple[str, str], SglangTarget] = {}


@dataclass(slots=True)
class ParserGate:
    """sglang's argument parser in its own interpreter, one subprocess per batch of candidates,
    results cached per argument list. `python` None (and no $POLYMORPH_SGLANG_PYTHON) skips the gate."""

    python: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    cache: dict[str, GateResult] = field(default_factory=dict)
    num_subprocess_runs: int = 0

    @classmethod
    def from_environment(cls) -> ParserGate:
        return cls(python=os.environ.get(SGLANG_PYTHON_ENV) or None)

    @property
    def configured(self) -> bool:
        return bool(self.python)

    def target(self) -> SglangTarget | None:
        """The sglang release behind this gate (version and its parser's flags), asked once per
        interpreter and process, so that candidates are rendered in the spelling it parses; None
        when no sglang environment is configured (then the widely deployed spelling applies)."""
        if not self.python:
            return None
        key = (self.python, json.dumps(sorted(self.env.items())))
        if key not in _TARGETS:
            answer = self._driver(TARGET_DRIVER, "")
            if not isinstance(answer, dict) or not isinstance(answer.get("option_strings"), list):
                raise RuntimeError(f"sglang parser gate: {self.python} did not report its parser's flags: {str(answer)[:200]}")
            _TARGETS[key] = SglangTarget(answer.get("version"), frozenset(answer["option_strings"]))
        return _TARGETS[key]

    def check_many(self, arg_lists: Sequence[Sequence[str]]) -> list[GateResult]:
        if not self.python:
            return [GateResult("sglang-parser", "skipped", "skipped (no sglang environment)") for _ in arg_lists]
        keys = [_args_key(args) for args in arg_lists]
        missing = {key: list(args) for key, args in zip(keys, arg_lists) if key not in self.cache}
        if missing:
            for key, result in zip(missing, self._run(list(missing.values()))):
                self.cache[key] = result
        return [self.cache[key] for key in keys]

    def _run(self, arg_lists: list[list[str]]) -> list[GateResult]:
        answers = self._driver(PARSER_DRIVER, json.dumps(arg_lists))
        if not isinstance(answers, list) or len(answers) != len(arg_lists):
            raise RuntimeError(f"sglang parser gate: {self.python} answered {len(answers) if isinstance(answers, list) else 'no list'} "
                               f"for {len(arg_lists)} argument lists")
        return [GateResult("sglang-parser", "passed") if answer.get("ok") else
                GateResult("sglang-parser", "rejected", f"sglang rejects the arguments: {answer.get('error', '')}")
                for answer in answers]

    def _driver(self, driver: str, stdin: str) -> object:
        """Run `driver` in the sglang interpreter and decode the JSON it prints."""
        self.num_subprocess_runs += 1
        env = {**os.environ, **self.env}
        try:
            # `python -c` puts its working directory first on sys.path: run in an empty one, so that
            # Polymorph's `kernels` package (when started from a checkout) cannot shadow the top-level
            # `kernels` module one of sglang's dependencies installs
            with tempfile.TemporaryDirectory(prefix="polymorph-sglang-parser-") as cwd:
                done = subprocess.run([self.python, "-c", driver], input=stdin, capture_output=True,  # type: ignore[list-item]
                                      text=True, timeout=_PARSER_TIMEOUT_S, env=env, check=False, cwd=cwd)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RuntimeError(f"sglang parser gate: cannot run {self.python}: {exc}") from exc
        try:
            return json.loads(done.stdout)
        except ValueError as exc:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise RuntimeError(f"sglang parser gate: {self.python} (exit {done.returncode}) did not answer: "
                               f"{' | '.join(tail) or exc}") from exc


def _args_key(args: Sequence[str]) -> str:
    return hashlib.sha256(json.dumps(list(args)).encode()).hexdigest()


def sglang_model_path(model: ModelSpec) -> str:
    """The Hugging Face repo id sglang would load (the first alias with an owner), else the name."""
    return next((alias for alias in model.aliases if "/" in alias), model.name)
