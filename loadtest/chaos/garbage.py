"""A "replica" that breaks the protocol on purpose: raw bytes on a socket, chosen by the request's prompt.

The prompt names the misbehaviour (``mode:<name>``); ``/health`` and ``/v1/models`` answer normally
so the gateway keeps sending it traffic. Every mode must reach the client as a clear error: a 5xx
envelope before the first byte, or an SSE error event after it.
"""

from __future__ import annotations

import asyncio
import re
import threading

_OK_JSON = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
_SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"

MODES: dict[str, bytes] = {
    "not-http": b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
    "status-out-of-range": b"HTTP/1.1 1000000 Huge\r\nContent-Length: 2\r\n\r\n{}",
    "status-999": b"HTTP/1.1 999 Odd\r\nContent-Length: 2\r\n\r\n{}",
    "header-with-newline": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\nX-Injected: yes\r\nContent-Length: 2\r\n\r\n{}",
    "json-garbage": _OK_JSON % (9, b"not json!"),
    "sse-garbage": _SSE_HEAD + b"\r\n\x00\xff\xfegarbage without any event\r\n",
    "sse-no-done": _SSE_HEAD + b"\r\n" + b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n',
    "sse-bad-chunk": _SSE_HEAD + b"Transfer-Encoding: chunked\r\n\r\n5\r\ndata:\r\nzz\r\n",
    "huge-head": b"HTTP/1.1 200 OK\r\nX-Pad: " + b"a" * 70000 + b"\r\n\r\n",
    "bad-content-length": b"HTTP/1.1 200 OK\r\nContent-Length: 1e3\r\n\r\n{}",
    "reset-after-head": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"cho",
}
_MODELS = b'{"object":"list","data":[{"id":"garbage-model","object":"model"}]}'


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
        length = re.search(rb"(?i)content-length: *(\d+)", head)
        body = await reader.readexactly(int(length.group(1))) if length else b""
        if head.startswith(b"GET /health"):
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        elif head.startswith(b"GET /v1/models"):
            writer.write(_OK_JSON % (len(_MODELS), _MODELS))
        else:
            mode = re.search(rb"mode:([a-z0-9-]+)", body)
            writer.write(MODES.get(mode.group(1).decode() if mode else "", MODES["not-http"]))
        await writer.drain()
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
        pass
    finally:
        writer.close()  # one answer per connection: the close ends bodies that have no length


class GarbageReplica:
    """Serves on 127.0.0.1:``port`` from a background thread until ``stop()``."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._server: asyncio.AbstractServer | None = None

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(_handle, "127.0.0.1", self.port))
        self._ready.set()
        self._loop.run_forever()
        self._server.close()
        self._loop.run_until_complete(self._server.wait_closed())
        self._loop.close()

    def start(self) -> GarbageReplica:
        self._thread.start()
        self._ready.wait(10)
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
