"""`polymorph bench peers`: set up the peers, then measure them side by side inside a loopback-only network.

The set-up (apt-get for wrk/nginx, one pip venv per peer) needs the package registries, so it runs
first, in the host's network. The measurements then run in a child process in a new network
namespace that holds only loopback (``unshare -n``), so nothing a peer does can leave the machine.
The child gets the parsed options as JSON: ``python -m loadtest.bench.peers --args-json '{...}'``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import orjson

from loadtest.bench import peers_report, peers_setup
from loadtest.bench.harness import _sigterm_interrupts
from loadtest.bench.measure import Settings
from loadtest.bench.peers_stack import RAW_PEERS
from loadtest.bench.processes import Pinning, default_pinning
from loadtest.bench.tools import SetupError, ensure_tools
from loadtest.procs import ProcessRegistry

PARTS = ("raw", "routing", "bench-serving")
_PART_TO_ENVS = {"raw": ("sglang-router", "litellm"), "routing": ("sglang-router",), "bench-serving": ("sglang",)}


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main_bench_peers(args: argparse.Namespace) -> int:
    """Set up in the host network, then measure in a loopback-only one (unless --no-netns)."""
    try:
        parts = parse_list(args.parts, PARTS, "--parts")
        parse_list(args.peers, RAW_PEERS, "--peers")
        ensure_tools(install=not args.no_install, say=_say)
    except (SetupError, ValueError) as problem:
        _say(f"bench peers: {problem}")
        return 2
    name_to_python = {}
    for name in sorted({env for part in parts for env in _PART_TO_ENVS[part]}):
        python = peers_setup.ensure_env(peers_setup.PEER_ENVS[name], not args.no_install, _say)
        if python is not None:
            name_to_python[name] = str(python)
    options = {key: value for key, value in vars(args).items() if key != "handler"}
    options["name_to_python"] = name_to_python
    child_argv = [sys.executable, "-m", "loadtest.bench.peers", "--args-json", orjson.dumps(options).decode()]
    wrapped = None if args.no_netns else peers_setup.netns_argv(child_argv)
    if wrapped is None and not args.no_netns:
        _say("bench peers: cannot make a loopback-only network namespace (needs root and unshare); "
             "running in the host network with every peer's own offline switches")
    env = {**os.environ, peers_setup.NETNS_ENV: "1" if wrapped else "0"}
    try:
        return subprocess.run(wrapped or child_argv, env=env, check=False).returncode
    except KeyboardInterrupt:
        return 130


def parse_list(text: str, known: Sequence[str], flag: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = sorted(set(names) - set(known))
    if unknown or not names:
        raise ValueError(f"{flag}: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(known)}")
    return tuple(name for name in known if name in names)


def measure_all(args: argparse.Namespace) -> int:
    """The child: run each part, print the tables, then the JSON line last."""
    parts = parse_list(args.parts, PARTS, "--parts")
    name_to_python = {name: Path(path) for name, path in args.name_to_python.items()}
    tool_to_path = ensure_tools(install=False, say=_say)
    pinning = default_pinning(pin=not args.no_pin)
    result: dict[str, object] = {"network": "loopback-only namespace" if peers_setup.in_loopback_netns() else "host"}
    tables: list[str] = []
    loadavg_at_start = os.getloadavg()[0]
    with _sigterm_interrupts(), tempfile.TemporaryDirectory(prefix="polymorph-peers-") as tmp:
        run_dir = Path(tmp)
        if "raw" in parts:
            tables.append(_raw_part(args, run_dir, tool_to_path, pinning, name_to_python, result))
        if "routing" in parts:
            tables.append(_routing_part(args, run_dir, name_to_python, result))
        if "bench-serving" in parts:
            tables.append(_bench_serving_part(args, run_dir, name_to_python, result))
    result["settings"] = {
        "quick": args.quick, "duration_s": args.duration, "rounds": args.rounds, "connections": list(args.connections),
        "pinning": pinning.describe(), "num_cpus": os.cpu_count(),
        "loadavg_1m_at_start": round(loadavg_at_start, 2), "loadavg_1m_at_end": round(os.getloadavg()[0], 2),
        "versions": {name: peers_setup.PEER_ENVS[name].requirement for name in name_to_python},
    }
    if not args.json_only:
        print("\n\n".join(table for table in tables if table))
    print(orjson.dumps(result).decode(), flush=True)
    return 0


def _raw_part(
    args: argparse.Namespace, run_dir: Path, tool_to_path: dict[str, str], pinning: Pinning,
    name_to_python: dict[str, Path], result: dict[str, object],
) -> str:
    from loadtest.bench.peers_raw import run_raw

    wanted = parse_list(args.peers, RAW_PEERS, "--peers")
    # A peer whose venv could not be set up is reported as skipped, not silently dropped.
    skipped = [name for name in wanted if name in peers_setup.PEER_ENVS and name not in name_to_python]
    names = [name for name in wanted if name not in skipped]
    settings = Settings(
        wrk=tool_to_path["wrk"], duration_s=args.duration, num_rounds=args.rounds, connections=tuple(args.connections),
        client_cpus=pinning.client_cpus, script_dir=run_dir, say=_say,
    )
    _say(f"raw proxy cost: {', '.join(names)}; {pinning.describe()}")
    with ProcessRegistry(run_dir) as registry:
        try:
            figures = run_raw(
                settings, names, registry, run_dir, tool_to_path["nginx"], pinning, name_to_python,
                args.rate or None, _say,
            )
        except RuntimeError as problem:
            _say(f"bench peers: raw part failed: {problem}")
            for name in names:
                if tail := registry.log_tail(name):
                    _say(f"--- {name} log (tail) ---\n{tail}")
            result["raw"] = {"error": str(problem)}
            return ""
    summary = peers_report.raw_summary(figures)
    summary["targets"] = peers_report.raw_targets(figures)
    summary["skipped"] = skipped
    result["raw"] = summary
    return peers_report.format_raw_table(figures)


def _routing_part(
    args: argparse.Namespace, run_dir: Path, name_to_python: dict[str, Path], result: dict[str, object]
) -> str:
    if args.metric == "capacity":
        from loadtest.bench.peers_routing_capacity import run_routing_capacity

        return run_routing_capacity(args, run_dir, name_to_python.get("sglang-router"), result, _say)
    from loadtest.bench.peers_routing import run_routing

    return run_routing(args, run_dir, name_to_python.get("sglang-router"), result, _say)


def _bench_serving_part(
    args: argparse.Namespace, run_dir: Path, name_to_python: dict[str, Path], result: dict[str, object]
) -> str:
    from loadtest.bench.peers_clients import run_bench_serving

    return run_bench_serving(args, run_dir, name_to_python.get("sglang"), result, _say)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The measuring half of `polymorph bench peers` (run by it).")
    parser.add_argument("--args-json", required=True, help="the parsed options of `polymorph bench peers`, as JSON")
    options = orjson.loads(parser.parse_args(argv).args_json)
    return measure_all(argparse.Namespace(**options))


if __name__ == "__main__":
    raise SystemExit(main())
