"""A small HTTP/1.1 client for talking to replicas: keep-alive pools, streaming bodies, nothing else.

aiohttp's client costs about 120 µs of CPU per request on this path (tracing hooks, cookie jar,
multidict headers, per-read timers); a request here is one pre-built write and a byte-level parse,
about 15 µs. The proxy needs only POST with a JSON body and a response it can read whole or chunk
by chunk, so that is all this does.

Deadlines live on the connection, not in ``asyncio.timeout`` blocks around each await: one timer for
the whole exchange up to its ``deadline`` (head and body), then, for a stream, one lazily re-armed
timer for the gap between pieces, so a long stream costs a timer per gap length, not one per piece.
A passed deadline raises ``TimeoutError`` from the read that was waiting, and drops the connection.
"""

from __future__ import annotations

import asyncio
from collections import deque

_MAX_HEAD_BYTES = 64 * 1024
_PAUSE_ABOVE_BYTES = 1 << 20  # stop reading from a replica whose client is slower than it
_SPACE = " \t\r\x0b\x0c"  # what bytes.strip() strips (str.strip() would take latin-1's NBSP too)


class UpstreamError(Exception):
    """The replica could not be reached, or broke the connection or the protocol mid-response."""

    def __init__(self, message: str, *, before_response: bool) -> None:
        super().__init__(message)
        self.before_response = before_response  # nothing of the answer arrived: safe to try elsewhere


class _Conn(asyncio.Protocol):
    """One connection: parses one response at a time and hands body pieces to its reader."""

    def __init__(self, pool: UpstreamPool, pool_key: tuple[str, int]) -> None:
        self.pool = pool
        self.pool_key = pool_key
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.paused = False
        self.head_waiter: asyncio.Future[None] | None = None
        self.body_waiter: asyncio.Future[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self._reset()

    def _reset(self) -> None:
        self.buf = bytearray()
        self.status = 0
        self.headers: dict[str, str] = {}
        self.head_done = False
        self.chunked = False
        self.remaining = -1  # body bytes still expected; -1: until the connection closes
        self.chunk_left = 0  # bytes left in the current chunk of a chunked body
        self.chunk_state = 0  # 0: size line, 1: data, 2: CRLF after data, 3: trailers
        self.pieces: deque[bytes] = deque()
        self.num_buffered = 0
        self.complete = False
        self.keep_alive = True
        self.error: UpstreamError | TimeoutError | None = None
        self.received_any = False
        self.gap_s = 0.0  # > 0: the longest wait for the next body piece (a stream), instead of a deadline
        self.waiting_since = 0.0  # when the reader began waiting for the next piece

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.disarm()
        if not self.complete:
            if self.error is None and self.remaining == -1 and self.head_done and not self.chunked:
                self.complete = True  # a body delimited by the close itself
            elif self.error is None:
                self.error = UpstreamError("the replica closed the connection mid-response", before_response=not self.received_any)
        self._wake()

    def data_received(self, data: bytes) -> None:
        self.received_any = True
        if self.head_done:
            self._body(data)
        else:
            self.buf += data
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buf) > _MAX_HEAD_BYTES:
                    self._fail("the replica's response head is too large")
                return
            head = bytes(self.buf[:end])
            rest = bytes(self.buf[end + 4 :])
            self.buf = bytearray()
            if not self._head(head):
                return
            if not self.head_done:  # that was an interim 1xx head: the rest starts the real one
                if rest:
                    self.data_received(rest)
                return
            if rest:
                self._body(rest)
        if self.num_buffered > _PAUSE_ABOVE_BYTES and not self.paused and self.transport is not None:
            self.transport.pause_reading()
            self.paused = True
        self._wake()

    # -- parsing ----------------------------------------------------------------------------

    def _head(self, head: bytes) -> bool:
        # A bare LF ends a line too (RFC 9112 allows it): otherwise it would hide inside a header value.
        lines = head.decode("latin-1").split("\n")
        parts = lines[0].rstrip("\r").split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            self._fail("the replica did not answer with HTTP/1.x")
            return False
        if len(parts[1]) != 3 or not parts[1].isascii() or not 100 <= int(parts[1]) <= 599:
            self._fail(f"the replica answered with an invalid status {parts[1][:8]}")
            return False
        self.status = int(parts[1])
        headers = self.headers
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip(_SPACE).lower()] = value.strip(_SPACE)  # takes the CR of a CRLF too
        if self.status < 200:  # 1xx: an interim answer; the real head follows
            self.status = 0
            self.headers = {}
            return True
        self.head_done = True
        self.keep_alive = self.headers.get("connection", "").lower() != "close" and parts[0] == "HTTP/1.1"
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            self.chunked = True
        elif "content-length" in self.headers:
            try:
                self.remaining = int(self.headers["content-length"])
            except ValueError:
                self._fail("the replica sent an invalid Content-Length")
                return False
            if self.remaining == 0:
                self.complete = True
        elif self.status in (204, 304):
            self.remaining = 0
            self.complete = True
        else:
            self.keep_alive = False
        return True

    def _push(self, piece: bytes) -> None:
        if piece:
            self.pieces.append(piece)
            self.num_buffered += len(piece)

    def _body(self, data: bytes) -> None:
        if self.complete:
            return
        if not self.chunked:
            if self.remaining >= 0:
                piece = data[: self.remaining]
                self.remaining -= len(piece)
                if self.remaining == 0:
                    self.complete = True
                self._push(piece)
            else:
                self._push(data)
            return
        self.buf += data
        self._dechunk()

    def _dechunk(self) -> None:
        buf = self.buf
        pos = 0
        size = len(buf)
        while pos < size and not self.complete:
            if self.chunk_state == 0:
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    break
                try:
                    left = int(buf[pos:end].split(b";", 1)[0], 16)  # int() ignores surrounding whitespace
                except ValueError:
                    self._fail("the replica sent an invalid chunk size")
                    return
                pos = end + 2
                if left and pos + left + 2 <= size:  # the whole chunk and its CRLF are here (the usual case)
                    self._push(bytes(buf[pos : pos + left]))
                    pos += left + 2
                    continue
                self.chunk_left = left
                self.chunk_state = 1 if left else 3
            elif self.chunk_state == 1:
                take = min(self.chunk_left, size - pos)
                self._push(bytes(buf[pos : pos + take]))
                pos += take
                self.chunk_left -= take
                if self.chunk_left == 0:
                    self.chunk_state = 2
            elif self.chunk_state == 2:
                if size - pos < 2:
                    break
                pos += 2
                self.chunk_state = 0
            else:  # trailers end with an empty line
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    break
                if end == pos:
                    self.complete = True
                pos = end + 2
        del buf[:pos]

    def _fail(self, reason: str) -> None:
        self.error = UpstreamError(reason, before_response=False)
        self.keep_alive = False
        if self.transport is not None:
            self.transport.close()
        self._wake()

    # -- deadlines ------------------------------------------------------------------------

    def arm(self, deadline: float) -> None:
        self.disarm()
        self.gap_s = 0.0
        self.timer = asyncio.get_running_loop().call_at(deadline, self._expire, "did not answer in time")

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def limit_gaps(self, gap_s: float) -> None:
        """From now on, wait at most ``gap_s`` for each next piece (instead of the exchange's deadline)."""
        self.disarm()
        self.gap_s = gap_s

    def begin_wait(self, now: float) -> None:
        self.waiting_since = now
        if self.gap_s > 0 and self.timer is None:
            self.timer = asyncio.get_running_loop().call_at(now + self.gap_s, self._check_gap)

    def _check_gap(self) -> None:
        # Armed once per gap length, not per piece: a reader that got pieces meanwhile is re-checked
        # at the end of its current wait, and one that is not waiting re-arms when it next waits.
        self.timer = None
        if self.body_waiter is None or self.complete or self.error is not None:
            return
        due = self.waiting_since + self.gap_s
        loop = asyncio.get_running_loop()
        if loop.time() < due:
            self.timer = loop.call_at(due, self._check_gap)
        else:
            self._expire("stalled between pieces")

    def _expire(self, reason: str) -> None:
        self.timer = None
        if self.complete or self.error is not None:
            return
        self.error = TimeoutError(f"the replica {reason}")
        self.keep_alive = False
        if self.transport is not None:
            self.transport.close()
        self._wake()

    def _wake(self) -> None:
        for waiter in (self.head_waiter, self.body_waiter):
            if waiter is not None and not waiter.done():
                waiter.set_result(None)


class UpstreamResponse:
    """A replica's answer: status and headers at once, the body whole (``read``) or piece by piece."""

    __slots__ = ("_conn", "_released", "headers", "status")

    def __init__(self, conn: _Conn) -> None:
        self._conn = conn
        self.status = conn.status
        self.headers = conn.headers
        self._released = False

    async def read_chunk(self) -> bytes:
        """The next piece of the body; b"" once it is complete. Raises UpstreamError if it breaks."""
        conn = self._conn
        while True:
            if conn.pieces:
                piece = conn.pieces.popleft()
                conn.num_buffered -= len(piece)
                if conn.paused and conn.num_buffered < _PAUSE_ABOVE_BYTES // 2 and conn.transport is not None:
                    conn.transport.resume_reading()
                    conn.paused = False
                return piece
            if conn.complete:
                self.release()
                return b""
            if conn.error is not None:
                self.close()
                raise conn.error
            loop = asyncio.get_running_loop()
            if conn.gap_s > 0:
                conn.begin_wait(loop.time())
            waiter = conn.body_waiter = loop.create_future()
            try:
                await waiter
            finally:
                conn.body_waiter = None

    async def read(self) -> bytes:
        parts = []
        while piece := await self.read_chunk():
            parts.append(piece)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def limit_gaps(self, gap_s: float) -> None:
        """Stop the exchange's deadline; from now on each next piece may take at most ``gap_s``."""
        if not self._released:  # a body already complete gave its connection back for reuse
            self._conn.limit_gaps(gap_s)

    def release(self) -> None:
        """Give the connection back for reuse (only a complete, keep-alive answer can be reused)."""
        if self._released:
            return
        self._released = True
        conn = self._conn
        conn.disarm()
        if conn.complete and conn.keep_alive and not conn.closed and not conn.pieces:
            conn.pool.put_back(conn)
        elif conn.transport is not None:
            conn.transport.close()

    def close(self) -> None:
        """Drop the connection: the replica sees a disconnect and stops generating."""
        self._released = True
        self._conn.disarm()
        if self._conn.transport is not None:
            self._conn.transport.close()


class UpstreamPool:
    """Keep-alive connections to replicas, keyed by (host, port)."""

    def __init__(self, max_idle_per_host: int = 256) -> None:
        self.max_idle_per_host = max_idle_per_host
        self.idle: dict[tuple[str, int], list[_Conn]] = {}
        self.head_cache: dict[tuple[str, str], tuple[str, int, bytes]] = {}

    def _target(self, base_url: str, path: str) -> tuple[str, int, bytes]:
        found = self.head_cache.get((base_url, path))
        if found is None:
            rest = base_url.split("://", 1)[1]
            hostport = rest.split("/", 1)[0]
            host, _, port = hostport.rpartition(":") if ":" in hostport else (hostport, "", "80")
            prefix = "/" + rest.split("/", 1)[1] if "/" in rest else ""
            line = f"POST {prefix.rstrip('/')}{path} HTTP/1.1\r\nHost: {hostport}\r\nContent-Type: application/json\r\n"
            found = (host.strip("[]"), int(port), line.encode("latin-1"))
            self.head_cache[(base_url, path)] = found
        return found

    def put_back(self, conn: _Conn) -> None:
        idle = self.idle.setdefault(conn.pool_key, [])
        if len(idle) < self.max_idle_per_host:
            conn._reset()
            idle.append(conn)
        elif conn.transport is not None:
            conn.transport.close()

    async def _connect(self, host: str, port: int) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(lambda: _Conn(self, (host, port)), host, port)
        except OSError as exc:
            raise UpstreamError(f"cannot connect ({exc.strerror or type(exc).__name__})", before_response=True) from None
        return conn

    async def post(
        self, base_url: str, path: str, body: bytes, connect_timeout_s: float, deadline: float | None = None, extra_headers: bytes = b""
    ) -> UpstreamResponse:
        """Send ``body`` to ``base_url + path`` and wait for the response head.

        With ``deadline`` (loop time), the head and the body must arrive by then, or the waiting read
        raises TimeoutError (``UpstreamResponse.limit_gaps`` lifts it for a stream). ``extra_headers``:
        whole header lines (``Name: value\\r\\n``, already checked), e.g. the trace context."""
        host, port, head = self._target(base_url, path)
        request = b"".join((head, extra_headers, b"Content-Length: %d\r\n\r\n" % len(body), body))
        idle = self.idle.get((host, port))
        while idle:
            conn = idle.pop()
            if not conn.closed:
                try:
                    return await self._exchange(conn, request, deadline)
                except UpstreamError as exc:
                    if not exc.before_response:
                        raise
                    # A kept-alive connection the replica had already closed: try a fresh one.
        connect_by = asyncio.get_running_loop().time() + connect_timeout_s
        async with asyncio.timeout_at(connect_by if deadline is None else min(connect_by, deadline)):
            conn = await self._connect(host, port)
        return await self._exchange(conn, request, deadline)

    async def _exchange(self, conn: _Conn, request: bytes, deadline: float | None) -> UpstreamResponse:
        assert conn.transport is not None
        if deadline is not None:
            conn.arm(deadline)
        conn.transport.write(request)
        while not conn.head_done:
            if conn.error is not None:
                conn.disarm()
                raise conn.error
            waiter = conn.head_waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            except asyncio.CancelledError:
                conn.disarm()
                conn.transport.close()
                raise
            finally:
                conn.head_waiter = None
        return UpstreamResponse(conn)

    def close(self) -> None:
        for conns in self.idle.values():
            for conn in conns:
                if conn.transport is not None:
                    conn.transport.close()
        self.idle.clear()
