"""``pip_venv``: a pinned tool's venv under the cache, installed once by two processes asking at once, redone when its pin changes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from fleet.engines import install
from tests.conftest import REPO

# Small, pure Python, on PyPI for years: the test installs it twice into a fresh cache.
TINY_PIN, OTHER_PIN = "six==1.17.0", "six==1.16.0"
_INSTALL = """
import sys
from pathlib import Path
from fleet.engines import install
folder = install.cache_dir() / "tools" / "six"
print(install.pip_venv(folder, [sys.argv[1]], "six"))
"""


def _installers(cache: Path, pin: str, num_procs: int) -> list[tuple[int, str, str]]:
    env = {**os.environ, "POLYMORPH_CACHE": str(cache)}
    procs = [subprocess.Popen([sys.executable, "-c", _INSTALL, pin], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(num_procs)]
    outputs = [proc.communicate(timeout=600) for proc in procs]
    return [(proc.returncode, out.strip(), err) for proc, (out, err) in zip(procs, outputs)]


def _six_version(python: Path) -> str:
    done = subprocess.run([str(python), "-c", "import six; print(six.__version__)"], capture_output=True, text=True, check=True, timeout=60)
    return done.stdout.strip()


def test_two_processes_install_once_then_the_cache_answers_and_a_new_pin_reinstalls(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    folder = cache / "tools" / "six"

    first = _installers(cache, TINY_PIN, 2)
    again = _installers(cache, TINY_PIN, 1)
    python = folder / "bin" / "python"
    installed_version = _six_version(python)
    repinned = _installers(cache, OTHER_PIN, 1)

    assert [code for code, _, _ in first] == [0, 0], first
    assert {out for _, out, _ in first} == {str(python)}
    assert len([err for _, _, err in first if "installing six==1.17.0 with pip: done" in err]) == 1, first  # the other waited
    assert again == [(0, str(python), "")]  # cached: no step ran, nothing printed
    assert installed_version == "1.17.0"
    assert not install.venv_ready(folder, [TINY_PIN])  # the new pin replaced the old venv in place
    assert repinned[0][0] == 0 and "installing six==1.16.0 with pip: done" in repinned[0][2], repinned
    assert install.venv_ready(folder, [OTHER_PIN]) and _six_version(python) == "1.16.0"
