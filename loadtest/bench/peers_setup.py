"""Set-up of `polymorph bench peers`: one cached virtual environment per peer, and a loopback-only network.

Each peer is installed at a pinned version into its own venv under ``~/.cache/polymorph/peers/<name>``
(reused when its marker names the same requirement), never into the project's environment. The
measurements then run inside a fresh network namespace holding only loopback, so that no peer can
reach out (LiteLLM's price list, sglang-router's tokenizer look-up) whatever its settings say.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

CACHE_DIR = Path(os.environ.get("POLYMORPH_PEERS_CACHE", Path.home() / ".cache" / "polymorph" / "peers"))
NETNS_ENV = "POLYMORPH_BENCH_IN_NETNS"
_MARKER = ".polymorph-requirement"
_INSTALL_TIMEOUT_S = 1800.0


@dataclass(frozen=True, slots=True)
class PeerEnv:
    """A peer's venv: the pinned requirement and a module whose import proves the install works."""

    name: str
    requirement: str
    check_module: str
    note: str

    @property
    def python(self) -> Path:
        return CACHE_DIR / self.name / "bin" / "python"


# Known-good pins (checked on PyPI when written). LiteLLM 1.107.x was a compromised release and
# 1.109+ needs a litellm-proxy-extras that PyPI does not serve; 1.106.12 installs and runs.
SGLANG_ROUTER = PeerEnv("sglang-router", "sglang-router==0.3.2", "sglang_router.launch_router", "Rust router, ~30 MB")
LITELLM = PeerEnv("litellm", "litellm[proxy]==1.106.12", "litellm.proxy.proxy_server", "LiteLLM proxy, ~400 MB")
SGLANG = PeerEnv("sglang", "sglang==0.5.23", "sglang.bench_serving", "sglang for bench_serving only, several GB")
PEER_ENVS = {env.name: env for env in (SGLANG_ROUTER, LITELLM, SGLANG)}


def env_ready(env: PeerEnv) -> bool:
    marker = CACHE_DIR / env.name / _MARKER
    return env.python.exists() and marker.exists() and marker.read_text().strip() == env.requirement


def ensure_env(env: PeerEnv, install: bool, say: Callable[[str], None]) -> Path | None:
    """The venv's python, installing it first when allowed; None when it is absent or broken."""
    if not env_ready(env):
        if not install:
            say(f"set-up: {env.name} is not installed in {CACHE_DIR / env.name} (--no-install); skipping it")
            return None
        if not _install(env, say):
            return None
    done = subprocess.run(
        [str(env.python), "-c", f"import {env.check_module}"], capture_output=True, text=True, check=False,
        timeout=300,
    )
    if done.returncode != 0:
        say(f"set-up: {env.name} is installed but `import {env.check_module}` fails: {done.stderr.strip()[-400:]}")
        return None
    return env.python


def _install(env: PeerEnv, say: Callable[[str], None]) -> bool:
    venv_dir = CACHE_DIR / env.name
    say(f"set-up: installing {env.requirement} into {venv_dir} ({env.note}; once, then reused)")
    if venv_dir.exists() and not env.python.exists():
        shutil.rmtree(venv_dir)
    steps = [
        _venv_argv(venv_dir),
        [str(venv_dir / "bin" / "pip"), "install", "-q", env.requirement],
    ]
    for argv in steps:
        try:
            done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=_INSTALL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            say(f"set-up: `{' '.join(argv)}` took over {_INSTALL_TIMEOUT_S:.0f} s; giving up on {env.name}")
            return False
        if done.returncode != 0:
            problems = [line for line in done.stderr.splitlines() if not line.startswith("WARNING")]
            say(f"set-up: `{' '.join(argv)}` failed ({done.returncode}): {' '.join(problems)[-600:]}")
            return False
    (venv_dir / _MARKER).write_text(env.requirement + "\n")
    return True


def _venv_argv(venv_dir: Path) -> list[str]:
    # The base interpreter, not the project's venv: a peer must not see the project's packages.
    base = getattr(sys, "_base_executable", None) or sys.executable
    return [base, "-m", "venv", "--clear", str(venv_dir)]


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
