"""canaryd's lean HTTP/1.1 client, against a scripted raw server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from canaryd.http1 import Http1Client, ProtocolError, Response, _Connection

Answer = Callable[[bytes], bytes | None]  # request bytes -> raw answer (None: close)


@pytest.fixture
async def server() -> AsyncIterator[Callable[[list[Answer]], Awaitable[str]]]:
    servers: list[asyncio.Server] = []

    async def serve(answers: list[Answer]) -> str:
        script = iter(answers)

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    length = 0
                    for line in head.split(b"\r\n"):
                        if line.lower().startswith(b"content-length:"):
                            length = int(line.split(b":")[1])
                    request = head + await reader.readexactly(length)
                    answer = next(script)(request)
                    if answer is None:
                        writer.close()
                        return
                    writer.write(answer)
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()

        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        servers.append(srv)
        port = srv.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    yield serve
    for srv in servers:
        srv.close()
        await srv.wait_closed()


def ok(body: bytes = b'{"a":1}', extra: bytes = b"") -> Answer:
    return lambda _: (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d"
        b"\r\n%s\r\n%s" % (len(body), extra, body)
    )


@contextlib.asynccontextmanager
async def holding(
    hold: Callable[[bytes], bool],
) -> AsyncIterator[tuple[Http1Client, asyncio.Event]]:
    """A client of a server that answers ``{}`` to every request but holds the answer to
    those whose head ``hold`` picks until the event is set (a slow or stuck server)."""
    release = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                if hold(await reader.readuntil(b"\r\n\r\n")):
                    await release.wait()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    client = Http1Client(f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}")
    try:
        yield client, release
    finally:
        await client.close()
        srv.close()
        await srv.wait_closed()


async def test_request_bytes_and_content_length_answer(server):
    seen: list[bytes] = []

    def answer(request: bytes) -> bytes:
        seen.append(request)
        return ok()(request)  # type: ignore[return-value]

    client = Http1Client(await server([answer]))
    response = await client.request(
        "PATCH",
        "/x",
        params={"a": "b c"},
        headers=Http1Client.header_block({"Content-Type": "application/merge-patch+json"}),
        body=b'{"spec":{}}',
    )
    assert response.status == 200 and response.body == b'{"a":1}'
    assert response.headers["content-type"] == "application/json"
    request = seen[0]
    assert request.startswith(b"PATCH /x?a=b+c HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"Content-Type: application/merge-patch+json\r\n" in request
    assert b'Content-Length: 11\r\n\r\n{"spec":{}}' in request
    await client.close()


async def test_chunked_answer_and_keep_alive_reuse(server):
    chunked = (
        b"HTTP/1.1 500 Internal Server Error\r\nTransfer-Encoding: chunked\r\n"
        b'Retry-After: 2\r\n\r\n4\r\n{"a"\r\n3;ext=1\r\n:1}\r\n0\r\nX-Trailer: y\r\n\r\n'
    )
    client = Http1Client(await server([lambda _: chunked, ok(b"{}")]))
    first = await client.request("GET", "/a")
    assert (first.status, first.body, first.headers["retry-after"]) == (500, b'{"a":1}', "2")
    second = await client.request("GET", "/b")  # same connection: the script continues
    assert second.body == b"{}"
    await client.close()


async def test_a_pooled_connection_closed_by_the_server_is_retried_once(server):
    url = await server([ok(), lambda _: None, ok(b'{"b":2}')])
    client = Http1Client(url)
    assert (await client.request("GET", "/1")).body == b'{"a":1}'
    # The server closes the pooled connection instead of answering: a fresh one is used.
    assert (await client.request("GET", "/2")).body == b'{"b":2}'
    await client.close()


async def test_a_fresh_connection_closed_without_answer_is_an_error(server):
    client = Http1Client(await server([lambda _: None]))
    with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
        await client.request("GET", "/")


async def test_connection_close_is_honoured(server):
    url = await server([ok(extra=b"Connection: close\r\n"), ok(b'{"c":3}')])
    client = Http1Client(url)
    await client.request("GET", "/")
    assert not client._idle  # not pooled
    await client.close()


@pytest.mark.parametrize(
    "raw",
    [
        b"SPDY/3 200 OK\r\n\r\n",
        b"HTTP/1.1 abc OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 2\xb20 OK\r\n\r\n",  # a Latin-1 superscript two is no digit
        b"HTTP/1.1 200 OK\r\nContent-Length: +2\r\n\r\n{}",
        b"HTTP/1.1 200 OK\r\nContent-Length: 1_0\r\n\r\n{}",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x2\r\n{}\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}XY0\r\n\r\n",
    ],
)
async def test_malformed_answers_are_protocol_errors(server, raw):
    client = Http1Client(await server([lambda _: raw]))
    with pytest.raises(ProtocolError):
        await client.request("GET", "/")


def test_only_http_and_https_urls():
    with pytest.raises(ValueError):
        Http1Client("unix:///var/run/x.sock")
    assert Http1Client("https://example.invalid:6443/prefix/").prefix == "/prefix"


async def test_an_answer_in_pieces_with_bare_line_feeds(server):
    """The answer is parsed as it arrives, however the server cuts it; bare LF line
    ends are read too (RFC 9112 lets a recipient accept them)."""
    body = b'{"items":["' + b"x" * 70_000 + b'"]}'
    answer = b"HTTP/1.1 200 OK\nContent-Length: %d\n\n%s" % (len(body), body)
    chunked = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"".join(
            b"%x\r\n%s\r\n" % (len(part), part)
            for part in (body[:3], body[3:40_000], body[40_000:])
        )
        + b"0\r\n\r\n"
    )

    pieces: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for raw in (answer, chunked):
            await reader.readuntil(b"\r\n\r\n")
            for i in range(0, len(raw), 997):  # many small writes, each one sent
                writer.write(raw[i : i + 997])
                await writer.drain()
                pieces.append(raw[i : i + 997])
        writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    client = Http1Client(f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}")
    try:
        assert (await client.request("GET", "/a")).body == body
        assert (await client.request("GET", "/b")).body == body  # the same connection
        assert len(pieces) > 100
    finally:
        await client.close()
        srv.close()
        await srv.wait_closed()


async def test_an_idle_connection_the_server_closed_is_not_written_to():
    """The server answers and closes while the connection is pooled: the next request
    goes on a new connection, and the old one is never written to."""
    requests: list[bytes] = []
    connections = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        requests.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
        await writer.drain()
        writer.close()  # without Connection: close

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    client = Http1Client(f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}")
    try:
        await client.request("GET", "/1")
        closed = asyncio.Event()
        idle = client._idle[0]
        eof_received = idle.eof_received

        def noted() -> bool:
            closed.set()
            return eof_received()

        idle.eof_received = noted  # type: ignore[method-assign]
        if idle.usable():  # else the FIN came with the answer
            async with asyncio.timeout(5):
                await closed.wait()  # the server's FIN reached the pooled connection
        assert not idle.usable()
        assert (await client.request("GET", "/2")).body == b"{}"
        assert connections == 2 and len(requests) == 2
    finally:
        await client.close()
        srv.close()
        await srv.wait_closed()


def test_on_uvloop():
    """canaryd runs on uvloop, whose transports are not asyncio's classes."""
    uvloop = pytest.importorskip("uvloop")

    async def exchange() -> bytes:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(ok(b'{"uv":1}')(b"") or b"")
            await writer.drain()

        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        client = Http1Client(f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}")
        try:
            return (await client.request("GET", "/")).body
        finally:
            await client.close()
            srv.close()
            await srv.wait_closed()

    assert uvloop.run(exchange()) == b'{"uv":1}'


async def test_no_answer_by_the_deadline_is_a_timeout_and_the_connection_is_dropped():
    """The deadline is one timer on the loop: past it the request fails with
    TimeoutError and its connection is closed, so the late answer is never read; the
    next request gets its answer on a new connection."""
    loop = asyncio.get_running_loop()
    async with holding(lambda head: b"/slow" in head) as (client, release):
        with pytest.raises(TimeoutError):
            await client.request("GET", "/slow", deadline=loop.time() + 0.05)
        assert not client._idle, "a connection whose answer was abandoned is not pooled"
        release.set()
        response = await client.request("GET", "/next", deadline=loop.time() + 5)
        assert response.body == b"{}"
        with pytest.raises(TimeoutError):  # a deadline already past
            await client.request("GET", "/past", deadline=loop.time() - 1)


@pytest.mark.parametrize(
    ("raw", "body"),
    [
        (  # an interim answer, then the answer
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}",
            b"{}",
        ),
        (  # many interim answers in one read: read in a loop, not one call deep each
            b"HTTP/1.1 103 Early Hints\r\n\r\n" * 5000
            + b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}",
            b"{}",
        ),
        (  # bare LF line ends, a body holding CRLF CRLF
            b'HTTP/1.1 200 OK\nContent-Length: 11\n\n{"a":\r\n\r\n1}',
            b'{"a":\r\n\r\n1}',
        ),
        (  # bare LF chunk lines
            b'HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\n{"a"\n3\n:1}\n0\n\n',
            b'{"a":1}',
        ),
    ],
)
async def test_odd_but_valid_answers(server, raw, body):
    client = Http1Client(await server([lambda _: raw]))
    response = await client.request("GET", "/")
    assert (response.status, response.body) == (200, body)
    await client.close()


async def test_a_reset_during_a_close_delimited_body_is_an_error():
    """A body that ends when the server closes is whole only if the server closed the
    connection; a reset may have cut it short."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b'HTTP/1.1 200 OK\r\n\r\n{"a":1, "b"')
        await writer.drain()
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()  # RST, not FIN

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    client = Http1Client(f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}")
    try:
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            await client.request("GET", "/")
    finally:
        await client.close()
        srv.close()
        await srv.wait_closed()


async def test_a_request_the_server_drops_unanswered_is_sent_twice_at_most():
    """A pooled connection that fails with nothing answered is retried once, on a fresh
    connection: not once per idle connection in the pool."""
    seen = 0
    answering = True

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal seen
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                if not answering:
                    seen += 1
                    writer.close()  # read it, answer nothing
                    return
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    client = Http1Client(f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}")
    try:
        await asyncio.gather(*(client.request("GET", f"/{i}") for i in range(6)))
        assert len(client._idle) == 6
        answering = False
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            await client.request("PATCH", "/x", body=b"{}")
        assert seen == 2
    finally:
        await client.close()
        srv.close()
        await srv.wait_closed()


async def test_bytes_nobody_asked_for_close_an_idle_connection():
    pooled = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
        await writer.drain()
        await pooled.wait()
        writer.write(b"x" * 1_000_000)  # unasked
        await writer.drain()
        await reader.read()  # until the client closes

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    client = Http1Client(f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}")
    try:
        await client.request("GET", "/")
        idle = client._idle[0]
        closed = asyncio.Event()
        lost = idle.connection_lost

        def noted(exc: Exception | None) -> None:
            lost(exc)
            closed.set()

        idle.connection_lost = noted  # type: ignore[method-assign]
        pooled.set()
        async with asyncio.timeout(5):
            await closed.wait()
        assert not idle.usable() and len(idle._buffer) == 0
    finally:
        await client.close()
        srv.close()
        await srv.wait_closed()


async def _sent(
    client: Http1Client, path: str, deadline: float
) -> tuple[bool, asyncio.Future[object]]:
    """``send`` with a future for its outcome (the answer, the error, or None)."""
    told: asyncio.Future[object] = asyncio.get_running_loop().create_future()

    def on_outcome(outcome: object) -> None:
        assert not told.done(), "an outcome is told once"
        told.set_result(outcome)

    return client.send("PATCH", path, on_outcome, body=b"{}", deadline=deadline), told


async def test_send_goes_out_on_an_idle_connection_only(server):
    """``send`` (no task: the outcome is told in a callback) needs an idle
    pooled connection; without one nothing is sent and it says so. Its connection goes
    back to the pool when the answer keeps it."""
    seen: list[bytes] = []

    def answer(request: bytes) -> bytes:
        seen.append(request)
        return ok(b'{"n":%d}' % len(seen))(request)  # type: ignore[return-value]

    client = Http1Client(await server([answer, answer, answer]))
    loop = asyncio.get_running_loop()
    sent, _ = await _sent(client, "/x", loop.time() + 5)
    assert not sent and not seen, "no idle connection: nothing sent"
    assert (await client.request("GET", "/first")).body == b'{"n":1}'
    sent, told = await _sent(client, "/x", loop.time() + 5)
    assert sent and not client._idle
    response = await asyncio.wait_for(told, 5)
    assert isinstance(response, Response) and response.body == b'{"n":2}'
    assert seen[1].startswith(b"PATCH /x HTTP/1.1\r\n") and seen[1].endswith(b"\r\n\r\n{}")
    assert len(client._idle) == 1, "kept for the next request"
    sent, told = await _sent(client, "/y", loop.time() + 5)
    assert sent and (await asyncio.wait_for(told, 5)).body == b'{"n":3}'  # type: ignore[attr-defined]
    await client.close()


async def test_send_tells_a_closed_pooled_connection_as_nothing_answered(server):
    """The server closed the pooled connection instead of answering: nothing was
    answered, told as None (``request`` retries it on a fresh connection), and the
    connection is not pooled again."""
    client = Http1Client(await server([ok(), lambda _: None, ok(b'{"b":2}')]))
    await client.request("GET", "/1")
    sent, told = await _sent(client, "/2", asyncio.get_running_loop().time() + 5)
    assert sent and await asyncio.wait_for(told, 5) is None and not client._idle
    assert (await client.request("GET", "/3")).body == b'{"b":2}'
    await client.close()


async def test_send_past_its_deadline_is_a_timeout_and_a_callback_bug_is_contained():
    """No answer by the deadline: TimeoutError told, the connection closed (its late
    answer never read). A callback that raises is logged; the transport carries on."""
    loop = asyncio.get_running_loop()
    async with holding(lambda head: b"/slow" in head) as (client, release):
        await client.request("GET", "/warm")
        sent, told = await _sent(client, "/slow", loop.time() + 0.05)
        assert sent and isinstance(await asyncio.wait_for(told, 5), TimeoutError)
        assert not client._idle, "a connection whose answer was abandoned is not pooled"
        release.set()
        await client.request("GET", "/warm-again")

        called = asyncio.Event()

        def broken(outcome: object) -> None:
            called.set()
            raise RuntimeError("a bug in the caller")

        assert client.send("GET", "/a", broken, deadline=loop.time() + 5)
        await asyncio.wait_for(called.wait(), 5)
        assert client._idle, "answered and pooled despite the callback's bug"
        assert (await client.request("GET", "/after")).body == b"{}"


async def test_close_ends_the_sends_in_flight_and_pools_nothing_after():
    """No task owns a ``send``: closing the client closes its connection too (its outcome
    told as for any connection lost), and an answer that comes later pools nothing."""
    loop = asyncio.get_running_loop()
    async with holding(lambda head: head.startswith(b"PATCH")) as (client, release):
        await client.request("GET", "/warm")
        sent, told = await _sent(client, "/held", loop.time() + 5)
        assert sent
        await client.close()
        outcome = await asyncio.wait_for(told, 5)
        assert outcome is None or isinstance(outcome, BaseException), outcome
        release.set()
        assert (await client.request("GET", "/after")).body == b"{}"
        assert not client._idle, "a closed client pools nothing"


class _Transport:
    """Writes go nowhere: the answer is fed to the protocol by hand."""

    def write(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        pass

    def is_closing(self) -> bool:
        return False


async def test_an_answer_is_told_after_what_was_queued_before_it():
    """The judge relies on order: a watch event read before a bump's answer is handled
    before it (a task woken by the event runs first). So ``send`` tells its outcome a
    loop turn after the answer is parsed, never inside the read."""
    loop = asyncio.get_running_loop()
    client = Http1Client("http://127.0.0.1:1")
    connection = _Connection(loop)
    connection.connection_made(_Transport())  # type: ignore[arg-type]
    client._idle.append(connection)
    order: list[str] = []
    assert client.send("PATCH", "/x", lambda _: order.append("answer"), deadline=loop.time() + 5)
    loop.call_soon(order.append, "the event read before it")
    connection.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
    assert order == [] and client._idle == deque([connection]), "parsed and pooled, not told"
    for _ in range(3):
        await asyncio.sleep(0)
    assert order == ["the event read before it", "answer"]
