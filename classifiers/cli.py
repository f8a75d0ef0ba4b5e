"""`polymorph` subcommands owned by the classifiers package."""

from __future__ import annotations

import argparse


def register(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add this package's top-level subcommands."""


def register_bench(benches: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add this package's `polymorph bench` entries."""
