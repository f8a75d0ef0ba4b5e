"""Set-up of `polymorph bench peers`: one cached virtual environment per peer, and a loopback-only network.

Each peer is installed at a pinned version into its own venv under ``<cache>/peers/<name>``, the cache
of ``fleet.engines.install`` (``~/.cache/polymorph`` unless ``$POLYMORPH_CACHE`` says otherwise), by its
``pip_venv`` (reused when its marker names the same requirement; two processes asking at once install it
once), never into the project's environment. The measurements then run inside a fresh network namespace
holding only loopback, so that no peer can reach out (LiteLLM's price list, sglang-router's tokenizer
look-up) whatever its settings say.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fleet.engines.install import InstallError, Progress, cache_dir, pip_venv, venv_ready

NETNS_ENV = "POLYMORPH_BENCH_IN_NETNS"


@dataclass(frozen=True, slots=True)
class PeerEnv:
    """A peer's venv: the pinned requirement and a module whose import proves the install works."""

    name: str
    requirement: str
    check_module: str
    note: str

    @property
    def folder(self) -> Path:
        return cache_dir() / "peers" / self.name

    @property
    def python(self) -> Path:
        return self.folder / "bin" / "python"


# Known-good pins (checked on PyPI when written). LiteLLM 1.107.x was a compromised release and
# 1.109+ needs a litellm-proxy-extras that PyPI does not serve; 1.106.12 installs and runs.
SGLANG_ROUTER = PeerEnv("sglang-router", "sglang-router==0.3.2", "sglang_router.launch_router", "Rust router, ~30 MB")
LITELLM = PeerEnv("litellm", "litellm[proxy]==1.106.12", "litellm.proxy.proxy_server", "LiteLLM proxy, ~400 MB")
SGLANG = PeerEnv("sglang", "sglang==0.5.23", "sglang.bench_serving", "sglang for bench_serving only, several GB")
PEER_ENVS = {env.name: env for env in (SGLANG_ROUTER, LITELLM, SGLANG)}


def env_ready(env: PeerEnv) -> bool:
    return venv_ready(env.folder, (env.requirement,))


def install_env(env: PeerEnv, progress: Progress | None = None) -> Path:
    """The venv's python, installed on first use; raises ``InstallError`` when pip or the import check fails."""
    return pip_venv(env.folder, (env.requirement,), env.check_module, progress)


def ensure_env(env: PeerEnv, install: bool, say: Callable[[str], None]) -> Path | None:
    """The venv's python, installing it first when allowed; None when it is absent or broken."""
    if not env_ready(env):
        if not install:
            say(f"set-up: {env.name} is not installed in {env.folder} (--no-install); skipping it")
            return None
        say(f"set-up: installing {env.requirement} into {env.folder} ({env.note}; once, then reused)")
        try:
            install_env(env, say)
        except InstallError as problem:
            say(f"set-up: {problem}")
            return None
    done = subprocess.run(
        [str(env.python), "-c", f"import {env.check_module}"], capture_output=True, text=True, check=False,
        timeout=300,
    )
    if done.returncode != 0:
        say(f"set-up: {env.name} is installed but `import {env.check_module}` fails: {done.stderr.strip()[-400:]}")
        return None
    return env.python


def in_loopback_netns() -> bool:
    return os.environ.get(NETNS_ENV) == "1"


def netns_argv(argv: list[str]) -> list[str] | None:
    """``argv`` wrapped to run in a new network namespace with only loopback up; None when impossible."""
    unshare, ip = shutil.which("unshare"), shutil.which("ip") or shutil.which("ip", path="/usr/sbin:/sbin")
    if unshare is None or ip is None or os.geteuid() != 0:
        return None
    probe = subprocess.run([unshare, "-n", ip, "link", "set", "lo", "up"], capture_output=True, check=False)
    if probe.returncode != 0:
        return None
    return [unshare, "-n", "sh", "-c", f'{ip} link set lo up && exec "$@"', "sh", *argv]
