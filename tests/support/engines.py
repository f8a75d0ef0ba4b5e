"""Real CPU engines for tests: llama.cpp's llama-server and vLLM's CPU build, serving the tiny Llama.

The session fixtures install what they return through ``fleet.engines.install`` (on a fresh machine the
first test that needs one builds or downloads it, printing progress past pytest's capture; afterwards
they return at once from the cache). The ``*_server`` context managers start an engine on a free loopback
port, wait for its ``/health`` and always stop it.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from fleet.engines import install

# tests.conftest imports this module for its fixtures, and procs imports tests.conftest: importing procs
# here at the top would make the import order matter, so the helpers below import it when called.
if TYPE_CHECKING:
    from tests.support.procs import Proc

__all__ = [
    "chat_both_ways",
    "ENGINE_FIXTURES",
    "engines_installed",
    "install_in_background",
    "installing",
    "llama_server",
    "llama_server_bin",
    "start_llama_server",
    "start_vllm",
    "tiny_gguf",
    "tiny_hf",
    "vllm_python",
    "vllm_server",
]

T = TypeVar("T")
LLAMA_START_TIMEOUT_S = 60.0
VLLM_START_TIMEOUT_S = 480.0  # about 40 s alone on two cores; 200 s seen beside other engines and a build
VLLM_ENV = {**install.QUIET_ENV, "VLLM_CPU_KVCACHE_SPACE": "1"}  # GiB of KV cache: the tiny model needs little


ENGINE_FIXTURES = frozenset({"llama_server_bin", "tiny_gguf", "tiny_hf", "vllm_python"})


def engines_installed() -> bool:
    return all(entry.installed for entry in install.cache_status())


def install_in_background() -> None:
    """Start installing the engines and the tiny model in processes of their own (idempotent, under the install
    locks the fixtures wait on), their lines in the cache's logs/background-install.log. On a fresh machine the
    tests that need no engine run meanwhile, instead of every worker waiting at its first engine test.

    vLLM's download runs beside llama.cpp's build (it is mostly network and disk), then the model (whose
    Hugging Face folder needs vLLM's venv). All of it at nice 19: the build takes both cores for 8-13
    minutes, and at equal priority it starved the timing-bound tests running beside it (a fresh run saw
    emulated replicas miss their start deadline and shedding exceed its latency bound). The shell is
    detached and waited for at once, so no Popen of a running child is left to be collected mid-test
    (pytest reported its ResourceWarning as the next test's setup error)."""
    log_path = install.cache_dir() / "logs" / "background-install.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cli = f"nice -n 19 {shlex.quote(sys.executable)} -m gateway.cli engines"
    script = f"({cli} install vllm & {cli} install llamacpp; wait; {cli} model --hf) >> {shlex.quote(str(log_path))} 2>&1 < /dev/null &"
    subprocess.run(["sh", "-c", script], check=True, start_new_session=True)
    print(f"\nreal engines: installing in the background (log: {log_path}); the tests that need them run last", file=sys.stderr, flush=True)


def installing(config: pytest.Config, step: Callable[[], T]) -> T:
    """Run an install step with its progress lines (stderr) shown even though pytest captures output."""
    capture = config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        return step()


@pytest.fixture(scope="session")
def llama_server_bin(pytestconfig: pytest.Config) -> Path:
    return installing(pytestconfig, install.llamacpp_server)


@pytest.fixture(scope="session")
def tiny_gguf(pytestconfig: pytest.Config) -> Path:
    return installing(pytestconfig, install.tiny_model_gguf)


@pytest.fixture(scope="session")
def vllm_python(pytestconfig: pytest.Config) -> Path:
    return installing(pytestconfig, install.vllm_python)


@pytest.fixture(scope="session")
def tiny_hf(pytestconfig: pytest.Config) -> Path:
    return installing(pytestconfig, install.tiny_model_hf)


def _log_file(engine: str, log_path: Path | None) -> Path:
    if log_path is not None:
        return log_path
    with tempfile.NamedTemporaryFile(prefix=f"polymorph-{engine}-", suffix=".log", delete=False) as handle:
        return Path(handle.name)


def start_llama_server(binary: Path, gguf: Path, port: int, *extra_args: str, log_path: Path | None = None) -> Proc:
    """llama-server on 127.0.0.1:``port`` serving ``gguf`` as ``tiny-llama``, healthy. One thread by
    default: two threads beside other work on a two-core machine collapse its speed; a later ``-t`` wins."""
    from tests.support.procs import start

    argv = ["-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--alias", install.TINY_MODEL, "-t", "1", *extra_args]
    return start(argv, port, _log_file("llama-server", log_path), "/health", command=[str(binary)], timeout_s=LLAMA_START_TIMEOUT_S)


def start_vllm(python: Path, hf_dir: Path, port: int, *extra_args: str, log_path: Path | None = None) -> Proc:
    """vLLM's OpenAI server on 127.0.0.1:``port`` serving ``hf_dir`` as ``tiny-llama``, healthy (about 40 s)."""
    from tests.support.procs import start

    argv = ["--model", str(hf_dir), "--served-model-name", install.TINY_MODEL, "--host", "127.0.0.1", "--port", str(port),
            "--enforce-eager", "--dtype", "bfloat16", "--max-model-len", "2048", *extra_args]
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server"]
    return start(argv, port, _log_file("vllm", log_path), "/health", command=command, timeout_s=VLLM_START_TIMEOUT_S, env=VLLM_ENV)


@contextmanager
def llama_server(binary: Path, gguf: Path, *extra_args: str, log_path: Path | None = None) -> Iterator[Proc]:
    from tests.conftest import free_port

    proc = start_llama_server(binary, gguf, free_port(), *extra_args, log_path=log_path)
    try:
        yield proc
    finally:
        proc.stop()


@contextmanager
def vllm_server(python: Path, hf_dir: Path, *extra_args: str, log_path: Path | None = None) -> Iterator[Proc]:
    from tests.conftest import free_port

    proc = start_vllm(python, hf_dir, free_port(), *extra_args, log_path=log_path)
    try:
        yield proc
    finally:
        proc.stop()


_MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Name three colours."}]


def chat_both_ways(url: str) -> None:
    """A plain and a streamed chat completion through the real OpenAI SDK: both produce tokens and usage."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        reply = client.chat.completions.create(model=install.TINY_MODEL, messages=_MESSAGES, max_tokens=8, temperature=0)
        assert reply.choices[0].message.content
        assert reply.usage is not None and reply.usage.prompt_tokens > 0 and reply.usage.completion_tokens > 0

        stream = client.chat.completions.create(model=install.TINY_MODEL, messages=_MESSAGES, max_tokens=8, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
        text = ""
        usage = None
        for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage is not None:
                usage = chunk.usage
        assert text
        assert usage is not None and usage.completion_tokens > 0 and usage.prompt_tokens == reply.usage.prompt_tokens
    finally:
        client.close()
