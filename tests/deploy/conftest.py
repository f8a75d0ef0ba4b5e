"""The deployment tests' tools, installed on first use (tests/support/tools.py)."""

from __future__ import annotations

from tests.support.tools import kubectl, kubernetes_validate_bin  # noqa: F401
