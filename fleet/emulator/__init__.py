"""The emulated replica: an aiohttp server that answers like sglang on a given GPU and engine
configuration, timed by ``kernels.engine`` on the wall clock, with live fault injection."""

from fleet.emulator.app import EmulatorSettings, build_app
from fleet.emulator.faults import FaultSpec
from fleet.emulator.server import load_engine_config, main_emulate, serve

__all__ = ["EmulatorSettings", "FaultSpec", "build_app", "load_engine_config", "main_emulate", "serve"]
