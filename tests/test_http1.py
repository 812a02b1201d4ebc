"""canaryd's lean HTTP/1.1 client, against a scripted raw server on 127.0.0.1."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from canaryd.http1 import Http1Client, ProtocolError

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
