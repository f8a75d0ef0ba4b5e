"""Type checks and lint, run by `make test`: the settings live in pyproject.toml ([tool.mypy], [tool.ruff])."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *argv], cwd=REPO, capture_output=True, text=True, timeout=600)


def test_mypy_strict() -> None:
    """kernels, classifiers and fleet type-check under --strict (the files listed in [tool.mypy])."""
    result = _run("mypy")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_check() -> None:
    result = _run("ruff", "check", "--no-fix", "--output-format", "concise", ".")
    assert result.returncode == 0, result.stdout + result.stderr
