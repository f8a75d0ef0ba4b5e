"""Every YAML file Polymorph reads refuses a key given twice, naming the file and both lines.

PyYAML keeps the last of two equal keys without a word, so a scenario with a second ``phases:`` or an
SLO file with a second ``standard:`` would run something other than what its author wrote. The gateway
config has refused this since ``kernels.yamlsrc`` was written; these are the other files.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from classifiers.config import load_classifier_config
from fleet.emulator.server import load_engine_config
from gateway.cli import main as polymorph
from kernels.catalog import get_model
from loadtest.main import _tenant_keys
from loadtest.scenario import load_scenario
from loadtest.slo import load_slos
from loadtest.workload_args import _rules
from tests.conftest import REPO

# (reader, file text with the key given twice on lines 3 and 4 or 1 and 2, the key's line, its first line)
SLO = "tiers:\n  standard:\n    ttft_p99_s: 1\n    ttft_p99_s: 2\n"
SCENARIO = "name: s\nduration_s: 60\nseed: 1\nseed: 2\n"
RULES = "- set: tier\n  to: batch\n  to: interactive\n"
TENANT_KEYS = "acme: sk-1\nacme: sk-2\n"
CLASSIFIER = "classifier:\n  model: builtin\n  model: other\n"
ENGINE = "max_running_requests: 8\nmax_running_requests: 16\n"
CATALOG = "my-model:\n  num_layers: 2\n  num_layers: 4\n"


def _predict(path: Path) -> None:
    polymorph(["kernels", "predict", "--model", "llama-3.1-8b", "--gpu", "h100", "--isl", "8", "--osl", "8", "--config", str(path)])


def _catalog(path: Path) -> None:
    os.environ["POLYMORPH_MODEL_CATALOG"] = str(path)
    try:
        get_model("a-model-only-the-user-catalog-could-name")
    finally:
        del os.environ["POLYMORPH_MODEL_CATALOG"]


READERS: dict[str, tuple[Callable[[Path], object], str, int, int]] = {
    "scenario": (load_scenario, SCENARIO, 4, 3),
    "slo": (load_slos, SLO, 4, 3),
    "assign rules": (_rules, RULES, 3, 2),
    "tenant keys": (lambda path: _tenant_keys(str(path)), TENANT_KEYS, 2, 1),
    "classifier config": (load_classifier_config, CLASSIFIER, 3, 2),
    "emulator engine config": (lambda path: load_engine_config(str(path)), ENGINE, 2, 1),
    "user model catalog": (_catalog, CATALOG, 3, 2),
    "kernels predict --config": (_predict, ENGINE, 2, 1),
}


@pytest.mark.parametrize("name", list(READERS))
def test_a_key_given_twice_is_refused_with_the_file_and_both_lines(name: str, tmp_path: Path) -> None:
    reader, text, line, first = READERS[name]
    path = tmp_path / "file.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises((ValueError, SystemExit)) as caught:
        reader(path)
    message = str(caught.value)
    assert f"{path}:{line}" in message, message
    assert f"duplicate key (first given on line {first})" in message, message


def test_a_tenant_key_that_is_not_a_string_is_refused_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text("acme: sk-1\nglobex: [sk-2]\n")  # was used as the key '['sk-2']'
    with pytest.raises(ValueError, match=f"{path}:2: globex: an API key must be a non-empty string"):
        _tenant_keys(str(path))


YAML_READS = frozenset({"safe_load", "load", "full_load", "unsafe_load", "safe_load_all", "load_all", "compose", "compose_all"})


def yaml_reads_outside_the_loader(root: Path) -> list[str]:
    """Calls of PyYAML's readers anywhere in the product but ``kernels/yamlsrc.py``."""
    found = []
    for package in ("kernels", "classifiers", "fleet", "loadtest", "gateway"):
        for path in sorted((root / package).rglob("*.py")):
            if path.relative_to(root) == Path("kernels/yamlsrc.py"):
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if (isinstance(node, ast.Attribute) and node.attr in YAML_READS
                        and isinstance(node.value, ast.Name) and node.value.id == "yaml"):
                    found.append(f"{path.relative_to(root)}:{node.lineno}: yaml.{node.attr}")
    return found


def test_only_the_strict_loader_reads_yaml() -> None:
    assert yaml_reads_outside_the_loader(REPO) == []


def test_a_yaml_read_outside_the_loader_is_reported(tmp_path: Path) -> None:
    (tmp_path / "loadtest").mkdir()
    (tmp_path / "loadtest" / "reader.py").write_text("import yaml\n\ndata = yaml.safe_load('a: 1')\n")
    assert yaml_reads_outside_the_loader(tmp_path) == ["loadtest/reader.py:3: yaml.safe_load"]
