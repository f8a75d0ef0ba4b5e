"""`polymorph ... --help`: every option's default is shown once, and only when there is one to show."""

from __future__ import annotations

import importlib.metadata
import re

import pytest

from gateway.cli import _parsers, build_parser


def _helps() -> dict[str, str]:
    return {sub.prog: " ".join(sub.format_help().split()) for sub in _parsers(build_parser())}


def test_no_help_shows_a_missing_default_or_a_second_one() -> None:
    helps = _helps()
    assert len(helps) > 30  # every command and benchmark, not only the root
    for prog, text in helps.items():
        assert not re.search(r"\(default: (None|False|\[\])\)", text), prog
        assert not re.search(r"default[^()]*\) \(default: ", text), prog  # "(default: the scenario's) (default: 30.0)"


def test_a_default_the_help_does_not_state_is_shown() -> None:
    helps = _helps()
    assert "--rate RATE scale the scenario to this mean request rate (req/s) (default: 30.0)" in helps["polymorph bench adapt"]
    assert "--rate RATE scale the scenario to this mean request rate (req/s; default: the scenario's) --stretch" in helps["polymorph simulate"]
    assert "this many processes at once; the figures do not depend on it (default: 2)" in helps["polymorph bench adapt"]


def test_version_is_the_installed_packages(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        build_parser().parse_args(["--version"])
    assert stopped.value.code == 0 and capsys.readouterr().out.strip() == f"polymorph {importlib.metadata.version('polymorph')}"
