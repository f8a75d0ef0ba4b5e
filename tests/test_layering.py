"""Arrows point down: which of our packages may import which, and which modules may do no I/O.

Every import statement counts, at module level or inside a function or an ``if TYPE_CHECKING:``
block: a lazy import is still a dependency, only a later one.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("kernels", "classifiers", "fleet", "loadtest", "gateway")

# package -> our packages it must not import (gateway wires everything and may import any of them)
FORBIDDEN: dict[str, frozenset[str]] = {
    "kernels": frozenset({"classifiers", "fleet", "loadtest", "gateway"}),
    "classifiers": frozenset({"fleet", "loadtest", "gateway"}),
    "fleet": frozenset({"loadtest", "gateway"}),
    "loadtest": frozenset({"gateway"}),
}

# (importing module, imported module) pairs that cross an arrow on purpose, each with its reason. None today:
# the demo's credentials, which the load tools once read from gateway.config, live in loadtest.demo_credentials.
ALLOWED: dict[tuple[str, str], str] = {}

# Policy: modules that decide (routing, control, planning, telemetry, the engine and perf models).
# They take the time as an argument and do no I/O, so tests and the simulator drive them directly.
POLICY_MODULES = (
    "classifiers/output_predictor.py",
    "classifiers/request.py",
    "classifiers/shape.py",
    "fleet/canary.py",
    "fleet/canary_trial.py",
    "fleet/capacity.py",
    "fleet/commands.py",
    "fleet/controller.py",
    "fleet/controller_state.py",
    "fleet/decisions.py",
    "fleet/drift.py",
    "fleet/engines/metrics.py",
    "fleet/health.py",
    "fleet/lengths.py",
    "fleet/operator.py",
    "fleet/options.py",
    "fleet/planner.py",
    "fleet/pool.py",
    "fleet/queueing.py",
    "fleet/replica_outcomes.py",
    "fleet/rollout.py",
    "fleet/router.py",
    "fleet/telemetry.py",
    "fleet/telemetry_batch.py",
    "fleet/tiers.py",
    "kernels/compiler/shape.py",
    "kernels/compiler/space.py",
    "kernels/config.py",
    "kernels/engine.py",
    "kernels/engine_state.py",
    "kernels/kvcache.py",
    "kernels/perf.py",
    "kernels/predict.py",
    "kernels/tiers.py",
)
NO_IO_MODULES = frozenset({"asyncio", "aiohttp", "socket", "subprocess", "urllib", "requests", "threading", "time"})


def module_name(path: Path, root: Path = REPO) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, root: Path = REPO) -> Iterator[tuple[int, str, tuple[str, ...]]]:
    """(line, absolute module name, the names a ``from`` import takes) of every import in the file;
    relative imports resolved."""
    package = module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, ()
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            yield node.lineno, ".".join([*base, *([node.module] if node.module else [])]), tuple(alias.name for alias in node.names)


def package_violations(root: Path) -> list[str]:
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            importer = module_name(path, root)
            for line, imported, _ in imports(path, root):
                top = imported.split(".")[0]
                if top in FORBIDDEN.get(package, frozenset()) and (importer, imported) not in ALLOWED:
                    found.append(f"{path.relative_to(root)}:{line}: {package} must not import {top} (imports {imported})")
    return found


def io_violations(root: Path, modules: tuple[str, ...]) -> list[str]:
    found = []
    for relative in modules:
        path = root / relative
        for line, imported, _ in imports(path, root):
            if imported.split(".")[0] in NO_IO_MODULES:
                found.append(f"{relative}:{line}: policy module imports {imported} (policy takes the time as an argument and does no I/O)")
    return found


def module_loops(root: Path) -> list[list[str]]:
    """Our modules that import each other in a loop (each group of two or more, sorted; lazy and
    type-only imports count): Tarjan's strongly connected components over the import graph, where
    ``from a import b`` names module ``a.b`` when there is one."""
    paths = [path for package in PACKAGES for path in sorted((root / package).rglob("*.py"))]
    modules = {module_name(path, root) for path in paths}
    graph = {module_name(path, root): sorted({target for _, imported, names in imports(path, root)
                                               for target in (imported, *(f"{imported}.{name}" for name in names)) if target in modules})
             for path in paths}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    loops: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = stack[stack.index(module):]
            del stack[stack.index(module):]
            if len(group) > 1:
                loops.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(loops)


def test_no_modules_import_each_other() -> None:
    """Each module stands above what it imports: a type both sides need lives below them both
    (fleet.commands.TickOutput, gateway.outcome.Outcome), never in one that imports the other back."""
    assert module_loops(REPO) == []


def test_a_loop_of_imports_is_reported(tmp_path: Path) -> None:
    for package in PACKAGES:
        (tmp_path / package).mkdir()
    (tmp_path / "fleet" / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fleet import b\n")
    (tmp_path / "fleet" / "b.py").write_text("def f():\n    from fleet.c import g\n")
    (tmp_path / "fleet" / "c.py").write_text("from fleet.a import h\n")
    (tmp_path / "fleet" / "d.py").write_text("from fleet.a import h\n")
    assert module_loops(tmp_path) == [["fleet.a", "fleet.b", "fleet.c"]]


def test_packages_import_only_downwards() -> None:
    found = package_violations(REPO)
    assert not found, "imports against the arrows (kernels <- classifiers <- fleet <- loadtest <- gateway):\n" + "\n".join(found)


def test_allowed_exceptions_are_still_needed() -> None:
    """An exception whose import has gone is removed from ALLOWED, so it cannot cover a new one."""
    present = {(module_name(path), imported) for package in PACKAGES for path in (REPO / package).rglob("*.py") for _, imported, _ in imports(path)}
    assert [pair for pair in ALLOWED if pair not in present] == []


def test_policy_modules_do_no_io() -> None:
    missing = [relative for relative in POLICY_MODULES if not (REPO / relative).is_file()]
    assert missing == [], "a policy module moved: update POLICY_MODULES"
    found = io_violations(REPO, POLICY_MODULES)
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    ("relative", "source", "expected"),
    [
        ("kernels/x.py", "from fleet.pool import Pool\n", "kernels must not import fleet"),
        ("classifiers/x.py", "def f():\n    import gateway.config\n", "classifiers must not import gateway"),
        ("fleet/sub/x.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from loadtest import slo\n", "fleet must not import loadtest"),
    ],
)
def test_a_wrong_way_import_is_reported(tmp_path: Path, relative: str, source: str, expected: str) -> None:
    """The checks can fail: a module importing upwards (relative and lazy imports included) is named."""
    for package in PACKAGES:
        (tmp_path / package).mkdir()
    path = tmp_path / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    (found,) = package_violations(tmp_path)
    assert found.startswith(f"{relative}:") and expected in found


def test_a_policy_module_doing_io_is_reported(tmp_path: Path) -> None:
    (tmp_path / "fleet").mkdir()
    (tmp_path / "fleet" / "router.py").write_text("import asyncio\nfrom time import monotonic\n")
    found = io_violations(tmp_path, ("fleet/router.py",))
    assert [line.split(": ")[0] for line in found] == ["fleet/router.py:1", "fleet/router.py:2"]
