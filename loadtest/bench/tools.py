"""Set-up: find system tools (wrk and nginx for the benchmarks), installing them from Debian's packages when they are missing."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Mapping

from fleet.engines.install import locked

# wrk drives the load (its LuaJIT paces the constant-rate runs); nginx is both the fixed-cost
# backend and the compiled-proxy reference.
_TOOL_TO_PACKAGE = {"wrk": "wrk", "nginx": "nginx"}


class SetupError(RuntimeError):
    """A tool the benchmark needs is missing and could not be installed."""


def find_tool(name: str) -> str | None:
    # nginx lives in /usr/sbin, which a non-root PATH often lacks.
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


def ensure_tools(install: bool, say: Callable[[str], None], tool_to_package: Mapping[str, str] = _TOOL_TO_PACKAGE) -> dict[str, str]:
    """Map each needed tool to its path, installing the missing ones with apt-get when allowed."""
    missing = [tool for tool in tool_to_package if find_tool(tool) is None]
    if missing and install:
        # One apt-get at a time (dpkg's lock would fail a second one): test workers may ask at once.
        with locked("apt-get", say):
            if still_to_install := [tool_to_package[tool] for tool in missing if find_tool(tool) is None]:
                _apt_install(still_to_install, say)
    tool_to_path = {tool: find_tool(tool) for tool in tool_to_package}
    still_missing = sorted(tool for tool, path in tool_to_path.items() if path is None)
    if still_missing:
        packages = " ".join(tool_to_package[tool] for tool in still_missing)
        raise SetupError(f"{', '.join(still_missing)} not found; install them and rerun: `sudo apt-get install -y {packages}` "
                         "on Debian/Ubuntu (or your system's packages for them)")
    return {tool: path for tool, path in tool_to_path.items() if path is not None}


def _apt_install(packages: list[str], say: Callable[[str], None]) -> None:
    if shutil.which("apt-get") is None:
        say(f"set-up: {', '.join(packages)} missing and apt-get is not available")
        return
    if os.geteuid() != 0:
        say(f"set-up: {', '.join(packages)} missing and installing needs root; skipping installation")
        return
    say(f"set-up: installing {' '.join(packages)} from Debian's packages (apt-get update; apt-get install -y)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for argv in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", *packages]):
        done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            say(f"set-up: `{' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip()[-500:]}")
            return
