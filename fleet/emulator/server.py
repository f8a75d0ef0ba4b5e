"""Running the emulated replica: `polymorph emulate` and the listener it controls.

The listener is owned here (not by ``web.run_app``) so that the ``refuse_connections_s`` fault can
close the listening socket and open it again while requests in flight carry on.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from pathlib import Path
from typing import Any

from aiohttp import web

from fleet.emulator.app import STATE, EmulatorSettings, build_app
from fleet.emulator.faults import FaultSpec
from kernels.config import EngineConfig
from kernels.yamlsrc import ConfigError, load_yaml


def load_engine_config(text: str | None) -> EngineConfig:
    """``--config``: an inline JSON object (starting with "{") or a YAML/JSON file of EngineConfig fields."""
    if not text:
        return EngineConfig()
    if text.lstrip().startswith("{"):
        try:
            values: Any = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--config: inline JSON is invalid: {exc}") from exc
    else:
        path = Path(text)
        if not path.is_file():
            raise ValueError(f"--config: no such file {path}")
        try:
            values = load_yaml(path).data
        except ConfigError as exc:  # invalid YAML/JSON, or a key given twice
            raise ValueError(f"--config: {exc}") from None
    if not isinstance(values, dict):
        raise ValueError("--config must hold a mapping of engine config fields")
    return EngineConfig.from_dict(values)


def faults_from_args(args: argparse.Namespace) -> FaultSpec:
    return FaultSpec(
        fail_after_requests=args.fail_after_requests,
        error_rate=args.error_rate,
        error_status=args.error_status,
        slowdown=args.slowdown,
        hang_before_first_byte_s=args.hang_before_first_byte_s,
        stall_after_tokens=args.stall_after_tokens,
        stall_s=args.stall_s,
        crash_after_tokens=args.crash_after_tokens,
        crash_mode=args.crash_mode,
        refuse_connections_s=args.refuse_connections_s,
        seed=args.fault_seed,
    )


class Listener:
    """The listening socket of a running app; can close it for a while (the refuse fault)."""

    def __init__(self, runner: web.AppRunner, host: str, port: int) -> None:
        self._runner = runner
        self.host = host
        self.port = port
        self._site: web.TCPSite | None = None

    async def open(self) -> None:
        self._site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
        await self._site.start()

    async def refuse_for(self, duration_s: float) -> None:
        """Close the socket (and idle keep-alive connections) for ``duration_s``; < 0 keeps it closed."""
        if self._site is None:
            return
        await self._site.stop()
        self._site = None
        server = self._runner.server
        if server is not None:
            for connection in list(server.connections):
                connection.close()  # graceful: requests in flight finish first
        if duration_s < 0:
            return
        await asyncio.sleep(duration_s)
        await self.open()


async def serve(settings: EmulatorSettings, host: str, port: int, ready_line: bool = True) -> None:
    """Serve until SIGINT/SIGTERM."""
    app = build_app(settings)
    # handler_cancellation: a client that disconnects cancels its handler, which aborts the request.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    listener = Listener(runner, host, port)
    await listener.open()
    app[STATE].refuse_connections = listener.refuse_for
    if settings.faults.refuse_connections_s:
        asyncio.get_running_loop().create_task(listener.refuse_for(settings.faults.refuse_connections_s))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    if ready_line:
        state = app[STATE]
        print(json.dumps({
            "event": "listening", "url": f"http://{host}:{port}", "model": state.served_model_name,
            "gpu": state.gpu.name, "kv_capacity_tokens": state.perf.kv_capacity_tokens, "speed": settings.speed,
        }), flush=True)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def _adapters(items: list[str]) -> tuple[tuple[str, str], ...]:
    """``--adapter NAME=PATH`` items (vLLM's ``--lora-modules`` item form), each name once."""
    pairs: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--adapter takes NAME=PATH, not {item!r}")
        if name in pairs:  # before, the last path silently won
            raise ValueError(f"--adapter {name!r} is given twice")
        pairs[name] = path
    return tuple(pairs.items())


def main_emulate(args: argparse.Namespace) -> int:
    """Entry point of `polymorph emulate`."""
    import uvloop

    try:
        settings = EmulatorSettings(
            model=args.model,
            gpu=args.gpu,
            config=load_engine_config(args.config),
            served_model_name=args.served_model_name,
            adapters=_adapters(args.adapter),
            speed=args.speed,
            faults=faults_from_args(args),
        )
        if settings.speed <= 0:
            raise ValueError(f"--speed must be positive, got {settings.speed}")
    except (KeyError, ValueError) as exc:
        print(f"polymorph emulate: {exc}")
        return 2
    try:
        uvloop.run(serve(settings, args.host, args.port))
    except (KeyError, ValueError) as exc:
        print(f"polymorph emulate: {exc}")
        return 2
    except OSError as exc:  # an address it cannot listen on (was a traceback)
        print(f"polymorph emulate: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    return 0
