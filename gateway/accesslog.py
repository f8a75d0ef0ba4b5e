"""One JSON line a request, written in batches so logging stays off the latency path.

Only routing facts go in: no API keys, no prompts, no client-supplied strings except the model id,
which is escaped by JSON encoding (no CR/LF can split a line).
"""

from __future__ import annotations

import asyncio
import sys
from typing import IO

import orjson

from gateway.background import BackgroundTask


class AccessLog:
    def __init__(self, stream: IO[bytes] | None = None, flush_interval_s: float = 0.25, max_buffered: int = 4096) -> None:
        self.stream = stream if stream is not None else sys.stderr.buffer
        self.flush_interval_s = flush_interval_s
        self.max_buffered = max_buffered
        self.lines: list[bytes] = []
        self.flusher = BackgroundTask(self._flush_forever)

    def write(self, record: dict[str, object]) -> None:
        self.lines.append(orjson.dumps(record))
        if len(self.lines) >= self.max_buffered:
            self.flush()

    def flush(self) -> None:
        if not self.lines:
            return
        lines, self.lines = self.lines, []
        try:
            self.stream.write(b"\n".join(lines) + b"\n")
            self.stream.flush()
        except (OSError, ValueError):
            pass  # a closed or full log stream must never fail a request

    async def _flush_forever(self) -> None:
        while True:
            await asyncio.sleep(self.flush_interval_s)
            self.flush()

    def start(self) -> None:
        self.flusher.start()

    async def stop(self) -> None:
        await self.flusher.stop()
        self.flush()
