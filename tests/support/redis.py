"""A real Redis for the tests of limits and spend shared between gateways: Debian's redis-server (installed on
first use by ``tests.support.tools.redis_server_bin``) on a loopback port, without persistence."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest import procs as loadtest_procs
from tests.conftest import free_port


class RedisServer:
    """Debian's redis-server on a loopback port, no persistence; stop and start again on the same port."""

    def __init__(self, binary: str, tmp: Path) -> None:
        self.binary, self.tmp, self.port = binary, tmp, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        argv = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(self.tmp)]
        self.process = loadtest_procs.start(argv, self.tmp / "redis.log")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(64).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not answer on port {self.port}: {(self.tmp / 'redis.log').read_text()[-2000:]}")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


@pytest.fixture
def redis(redis_server_bin: str, tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(redis_server_bin, tmp_path)
    server.start()
    yield server
    server.kill()
