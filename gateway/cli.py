"""The one `polymorph` command.

Each package owns its subcommands in its own ``cli.py``: ``register(subparsers)`` adds top-level
commands and ``register_bench(bench_subparsers)`` adds ``polymorph bench <name>`` entries. Handlers
import their heavy modules lazily so that ``polymorph --help`` stays instant.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from classifiers import cli as classifiers_cli
from fleet import cli as fleet_cli
from fleet.engines import cli as engines_cli
from gateway import compile_pool, deploy_cli, serve_cli
from kernels import cli as kernels_cli
from loadtest import cli as loadtest_cli

if TYPE_CHECKING:
    from kernels.compiler.probe import ProbeTarget
    from loadtest.probe import LlamacppProbe, SglangProbe, VllmProbe

_PACKAGES = (serve_cli, deploy_cli, classifiers_cli, kernels_cli, fleet_cli, engines_cli, loadtest_cli)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default unless its help already speaks of it ("default: the scenario's") or
    there is none to show (None, an off switch, an empty list): never "(default: None)"."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "default" in (action.help or "") or action.default is None or action.default is False or action.default == []:
            return action.help
        return super()._get_help_string(action)


def _parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """``parser`` and every subcommand's parser under it."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="polymorph",
        description=(
            "Polymorph: a workload-aware, OpenAI-compatible gateway that classifies requests, "
            "routes them to the pool compiled for their shape, and retunes the fleet as traffic drifts."
        ),
        epilog="Run `polymorph <command> --help` for each command's options.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {importlib.metadata.version('polymorph')}")
    commands = parser.add_subparsers(dest="command", metavar="<command>", required=True)
    bench = commands.add_parser(
        "bench",
        help="benchmarks that print one JSON line of side-by-side ratios",
        description="Benchmarks. Each prints a table and, last, one JSON line.",
    )
    benches = bench.add_subparsers(dest="bench", metavar="<benchmark>", required=True)
    for package in _PACKAGES:
        package.register(commands)
        package.register_bench(benches)
    # kernels may not import the load tester that measures `compile --evaluator probe`, nor read a gateway
    # config for `compile --fleet-config`; this is where they meet.
    compile_ = commands.choices["compile"]
    compile_pool.add_arguments(compile_)
    run_compile = compile_.get_default("handler")
    compile_.set_defaults(prober=_engine_prober, handler=lambda args: run_compile(compile_pool.resolve(args)))
    benches.choices["compile"].set_defaults(prober=_engine_prober)
    # Each package asks for its defaults shown; how they are shown is decided once, here.
    for sub in _parsers(parser):
        if sub.formatter_class is argparse.ArgumentDefaultsHelpFormatter:
            sub.formatter_class = _HelpFormatter
    return parser


def _engine_prober(target: ProbeTarget) -> LlamacppProbe | VllmProbe | SglangProbe:
    from loadtest.probe import prober_for

    return prober_for(target)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = args.handler(args)
    except KeyboardInterrupt:
        code = 130
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
