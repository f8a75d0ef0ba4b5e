"""Reload the config when its files change or on SIGHUP, without dropping a request.

An invalid new version is rejected with its file, line and reason, and the previous one keeps
serving. In-flight requests finish on the runtime they started with.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from classifiers.request import ClassifierLoadError
from gateway.background import BackgroundTask
from gateway.config import load_config
from kernels.yamlsrc import ConfigError

if TYPE_CHECKING:
    from gateway.state import GatewayState


def _fingerprint(config_file: Path, tenants_dir: Path | None) -> tuple[object, ...]:
    """The config file's and every tenant-folder file's stamp. Every file of the folder, not the tenant
    files the current version read: those change with the version, so a reload that added a tenant file
    changed the fingerprint by itself and was followed by a second, empty reload (the version went up twice)."""
    files = [config_file]
    if tenants_dir is not None and tenants_dir.is_dir():
        files += sorted(p for p in tenants_dir.iterdir() if p.is_file())  # a kubelet's ..data links are followed
    stamps: list[object] = []
    for file in files:
        try:
            stat = file.stat()
            stamps.append((str(file), stat.st_mtime_ns, stat.st_size))
        except OSError:
            stamps.append((str(file), None))
    return tuple(stamps)


class ConfigWatcher:
    def __init__(self, state: GatewayState, config_path: Path, poll_interval_s: float = 1.0) -> None:
        self.state = state
        self.config_path = config_path
        self.poll_interval_s = poll_interval_s
        self._seen = self._current()
        self.task = BackgroundTask(self.run)
        self._wake = asyncio.Event()

    def _current(self) -> tuple[object, ...]:
        return _fingerprint(self.config_path, self.state.runtime.config.tenants_dir)

    def reload(self) -> bool:
        """Try the files as they are now; True when a new version was applied."""
        try:
            config = load_config(self.config_path)
            runtime = self.state.apply(config)
        except (ConfigError, ClassifierLoadError) as exc:
            self.state.metrics.child(self.state.metrics.reloads, "rejected").inc()
            print(f"polymorph: config reload rejected, still serving version {self.state.runtime.version}: {exc}", file=sys.stderr, flush=True)
            return False
        self.state.metrics.child(self.state.metrics.reloads, "applied").inc()
        print(f"polymorph: config version {runtime.version} applied from {self.config_path}", file=sys.stderr, flush=True)
        return True

    async def run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.poll_interval_s)
                forced = True
            except TimeoutError:
                forced = False
            self._wake.clear()
            current = self._current()
            if forced or current != self._seen:
                # Editors write in several steps: wait a moment so we read the finished file.
                await asyncio.sleep(0.05)
                self._seen = self._current()
                self.reload()

    def start(self) -> None:
        self.task.start()
        try:
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self._wake.set)
        except (NotImplementedError, RuntimeError):
            pass

    async def stop(self) -> None:
        await self.task.stop()
