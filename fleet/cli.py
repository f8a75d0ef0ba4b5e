"""`polymorph` subcommands owned by the fleet package."""

from __future__ import annotations

import argparse

from kernels.argtypes import count, count_or_zero, fraction, port, positive, seed


def register(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add this package's top-level subcommands."""
    p = commands.add_parser(
        "emulate",
        help="run an emulated sglang replica (no GPU needed)",
        description=(
            "Serve an HTTP endpoint that behaves like an sglang server running MODEL on GPU with the "
            "given engine configuration: OpenAI routes (/v1/chat/completions, /v1/completions, /v1/models), "
            "sglang's native routes (/generate, /health, /server_info, /model_info, /metrics), with token "
            "timing from Polymorph's engine scheduler and performance model. Faults can be injected with the "
            "flags below or live with POST /_emulator/faults (JSON of the same names, e.g. "
            '{"error_rate": 0.1}; {"reset": true} clears them).'
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", required=True, help="catalogue model name or alias (e.g. llama-3.1-8b), or a config.json path")
    p.add_argument("--gpu", required=True, help="catalogue GPU name or alias (e.g. H100-SXM)")
    p.add_argument("--config", default=None,
                   help='engine config: a YAML/JSON file of EngineConfig fields, or inline JSON starting with "{"')
    p.add_argument("--port", type=port, required=True, help="TCP port to listen on")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--speed", type=positive, default=1.0, help="engine seconds per wall second (2 runs twice as fast)")
    p.add_argument("--served-model-name", default=None, help="model id reported to clients (default: the catalogue name)")
    p.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH",
                   help="a LoRA adapter requests may name (repeatable); a replica with adapters answers 404 for other models, as vLLM does")
    faults = p.add_argument_group("fault injection")
    faults.add_argument("--fail-after-requests", type=count_or_zero, default=None, metavar="N",
                        help="answer every inference request after the Nth with --error-status")
    faults.add_argument("--error-rate", type=fraction, default=0.0, help="fraction of inference requests answered with --error-status")
    faults.add_argument("--error-status", type=int, default=503, help="HTTP status of injected errors")
    faults.add_argument("--slowdown", type=positive, default=1.0, help="engine iterations take this many times longer")
    faults.add_argument("--hang-before-first-byte-s", type=float, default=0.0,
                        help="wait this long before answering (negative: until the client leaves)")
    faults.add_argument("--stall-after-tokens", type=count_or_zero, default=None, metavar="K", help="pause each response after K tokens...")
    faults.add_argument("--stall-s", type=float, default=0.0, help="...for this many seconds (negative: forever)")
    faults.add_argument("--crash-after-tokens", type=count_or_zero, default=None, metavar="K", help="kill each response after K tokens...")
    faults.add_argument("--crash-mode", choices=("cut", "exit"), default="cut",
                        help="...by cutting its connection, or by exiting the whole process")
    faults.add_argument("--refuse-connections-s", type=float, default=0.0,
                        help="close the listening socket for this long at start (negative: forever)")
    faults.add_argument("--fault-seed", type=seed, default=0, help="seed of the --error-rate draws")
    p.set_defaults(handler=_run_emulate)


def _run_emulate(args: argparse.Namespace) -> int:
    from fleet.emulator import main_emulate

    return main_emulate(args)


def register_bench(benches: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add this package's `polymorph bench` entries."""
    p = benches.add_parser(
        "emulator",
        help="how many concurrent streams one emulator process serves with faithful timing",
        description=(
            "Start an emulated replica (--speed 1) in a subprocess, open N concurrent streaming requests for "
            "each N in --concurrency, and measure how far the emulator's wall-clock iterations drift from the "
            "engine's planned durations. Prints a table and, last, one JSON line with the largest N whose drift "
            "stays within --max-drift."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default="llama-3.1-8b", help="catalogue model")
    p.add_argument("--gpu", default="H100-SXM", help="catalogue GPU")
    p.add_argument("--concurrency", default="32,64,128,256,512,1024", help="comma-separated stream counts to try")
    p.add_argument("--tokens", type=count, default=200, help="output tokens per request (ignore_eos)")
    p.add_argument("--max-drift", type=positive, default=0.05, help="timing drift allowed (0.05 = 5%%)")
    p.set_defaults(handler=_run_bench_emulator)


def _run_bench_emulator(args: argparse.Namespace) -> int:
    from fleet.emulator.bench import main_bench

    return main_bench(args)
