"""The replica HTTP client against a raw socket server that sends exactly the bytes each case needs."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from gateway.upstream import UpstreamError, UpstreamPool

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    return head + await reader.readexactly(length)


def _serve(handler: Handler, check: Callable[[str, UpstreamPool], Awaitable[None]]) -> None:
    async def closing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await handler(reader, writer)
        finally:
            writer.close()
            try:
                await writer.wait_closed()
            except ConnectionError:
                pass

    async def main() -> None:
        server = await asyncio.start_server(closing, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = UpstreamPool()
        try:
            await check(f"http://127.0.0.1:{port}", pool)
        finally:
            pool.close()
            server.close()
            await server.wait_closed()

    asyncio.run(main())


def test_content_length_body_and_keep_alive_reuse() -> None:
    connections = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)
        while True:
            try:
                request = await _read_request(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            assert request.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
            body = request.split(b"\r\n\r\n", 1)[1]
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        writer.close()

    async def check(url: str, pool: UpstreamPool) -> None:
        for i in range(3):
            response = await pool.post(url, "/v1/chat/completions", b'{"n":%d}' % i + b"  ", 1.0)
            assert response.status == 200 and response.headers["content-type"] == "application/json"
            assert await response.read() == b'{"n":%d}' % i + b"  "
        assert len(connections) == 1  # one kept-alive connection served all three

    _serve(handler, check)


def test_chunked_stream_arrives_piece_by_piece_with_an_interim_head() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for event in (b"data: a\n\n", b"data: bb\n\n", b"data: [DONE]\n\n"):
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            await asyncio.sleep(0.01)
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def check(url: str, pool: UpstreamPool) -> None:
        response = await pool.post(url, "/v1/completions", b"{}", 1.0)
        pieces = []
        while piece := await response.read_chunk():
            pieces.append(piece)
        assert pieces == [b"data: a\n\n", b"data: bb\n\n", b"data: [DONE]\n\n"]

    _serve(handler, check)


def test_chunk_boundaries_split_anywhere() -> None:
    body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (b"hello ", b"world")) + b"0\r\n\r\n"

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        raw = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + body
        for i in range(len(raw)):  # one byte at a time
            writer.write(raw[i : i + 1])
            await writer.drain()

    async def check(url: str, pool: UpstreamPool) -> None:
        response = await pool.post(url, "/x", b"{}", 1.0)
        assert await response.read() == b"hello world"

    _serve(handler, check)


def test_connection_cut_mid_body_is_an_error_after_the_response_started() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
        await writer.drain()
        writer.close()

    async def check(url: str, pool: UpstreamPool) -> None:
        response = await pool.post(url, "/x", b"{}", 1.0)
        with pytest.raises(UpstreamError) as info:
            await response.read()
        assert not info.value.before_response

    _serve(handler, check)


def test_refused_connection_is_an_error_before_the_response() -> None:
    async def check() -> None:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        with pytest.raises(UpstreamError) as info:
            await UpstreamPool().post(f"http://127.0.0.1:{port}", "/x", b"{}", 1.0)
        assert info.value.before_response

    asyncio.run(check())


def test_a_stale_kept_alive_connection_is_replaced_transparently() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.close()  # the replica closes its idle keep-alive connection

    async def check(url: str, pool: UpstreamPool) -> None:
        assert await (await pool.post(url, "/x", b"{}", 1.0)).read() == b"ok"
        await asyncio.sleep(0.2)
        assert await (await pool.post(url, "/x", b"{}", 1.0)).read() == b"ok"

    _serve(handler, check)


def test_garbage_instead_of_http_is_an_error() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        await writer.drain()

    async def check(url: str, pool: UpstreamPool) -> None:
        with pytest.raises(UpstreamError, match="HTTP/1"):
            await pool.post(url, "/x", b"{}", 1.0)

    _serve(handler, check)


def test_a_passed_deadline_raises_timeout_and_drops_the_connection() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\npart")  # the rest never comes
        await writer.drain()
        await reader.read()  # until the client drops the connection

    async def check(url: str, pool: UpstreamPool) -> None:
        deadline = asyncio.get_running_loop().time() + 0.3
        response = await pool.post(url, "/x", b"{}", 1.0, deadline)
        with pytest.raises(TimeoutError):
            await response.read()
        assert not pool.idle.get(("127.0.0.1", int(url.rsplit(":", 1)[1])))

    _serve(handler, check)


def test_gap_limit_applies_to_each_wait_not_to_the_whole_stream() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(30):  # 1.5 s of pieces 0.05 s apart: longer than the gap limit, no gap near it
            writer.write(b"2\r\nok\r\n")
            await writer.drain()
            await asyncio.sleep(0.05)
        await reader.read()  # then silence until the client gives up

    async def check(url: str, pool: UpstreamPool) -> None:
        deadline = asyncio.get_running_loop().time() + 0.5  # lifted by limit_gaps once the first piece is in
        response = await pool.post(url, "/x", b"{}", 1.0, deadline)
        assert await response.read_chunk() == b"ok"
        response.limit_gaps(1.0)
        pieces = 1
        with pytest.raises(TimeoutError):
            while await response.read_chunk():
                pieces += 1
        assert pieces == 30

    _serve(handler, check)
