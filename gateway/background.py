"""One long-running task owned by an object of the gateway, started and stopped with the app."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


class BackgroundTask:
    def __init__(self, run: Callable[[], Awaitable[None]]) -> None:
        self._run = run
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
