"""A small HTTP/1.1 keep-alive client for canaryd's request/response calls.

The bump is the hot path: one PATCH per canary per cycle. aiohttp's request
machinery costs about 0.13 ms of CPU per request on uvloop here; writing the
request bytes and reading the answer over asyncio streams costs about 0.04 ms
(bench/bench.py, docs/PERFORMANCE.md). This client does only what kube-apiserver
needs: one request at a time per connection, ``Content-Length`` request bodies,
``Content-Length`` or ``chunked`` responses, TLS through ``ssl``, and a pool of
idle connections. Watches and proxied setups use aiohttp.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlencode, urlsplit

MAX_HEADER_LINES = 200
MAX_BODY = 64 * 1024 * 1024


class ProtocolError(Exception):
    """The server's answer is not HTTP/1.1 we can read."""


@dataclass(frozen=True)
class Response:
    status: int
    headers: Mapping[str, str]  # names lowercased
    body: bytes


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.used = False

    def close(self) -> None:
        self.writer.close()


class ConnectTimeout(TimeoutError):
    """No connection within the connect timeout."""


class Http1Client:
    def __init__(
        self,
        base_url: str,
        *,
        ssl_context: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
        max_idle: int = 16,
        connect_timeout: float | None = None,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"unsupported API server URL {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.prefix = parts.path.rstrip("/")
        self.ssl = ssl_context if parts.scheme == "https" else None
        self.server_hostname = server_hostname if self.ssl else None
        default_port = 443 if parts.scheme == "https" else 80
        host_header = self.host if self.port == default_port else f"{self.host}:{self.port}"
        if ":" in self.host and not self.host.startswith("["):
            host_header = f"[{self.host}]" + ("" if self.port == default_port else f":{self.port}")
        self._host_header = host_header.encode("ascii")
        self._idle: deque[_Connection] = deque()
        self._max_idle = max_idle
        self._connect_timeout = connect_timeout

    async def _connect(self) -> _Connection:
        """A new connection (TLS included) within the connect timeout: a black-holed
        address fails here, not at the end of a list's minute."""
        try:
            async with asyncio.timeout(self._connect_timeout):
                reader, writer = await asyncio.open_connection(
                    self.host,
                    self.port,
                    ssl=self.ssl,
                    server_hostname=self.server_hostname,
                    limit=2**21,
                )
        except TimeoutError:
            raise ConnectTimeout(
                f"no connection to {self.host}:{self.port} within {self._connect_timeout:g}s"
            ) from None
        return _Connection(reader, writer)

    @staticmethod
    def header_block(headers: Mapping[str, str]) -> bytes:
        """Encode header lines once; callers cache the block (it is the same per request)."""
        return b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in headers.items())

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        headers: bytes = b"",
        body: bytes | None = None,
    ) -> Response:
        """One exchange; ``headers`` is a ``header_block``. A pooled connection the server
        closed meanwhile is retried once on a fresh one (nothing was answered on it)."""
        target = self.prefix + path + (f"?{urlencode(params)}" if params else "")
        length = b"Content-Length: %d\r\n" % len(body) if body is not None else b""
        payload = b"".join(
            (
                f"{method} {target} HTTP/1.1\r\nHost: ".encode("ascii"),
                self._host_header,
                b"\r\n",
                headers,
                length,
                b"\r\n",
                body or b"",
            )
        )
        while True:
            reused = bool(self._idle)
            connection = self._idle.pop() if reused else await self._connect()
            try:
                connection.writer.write(payload)
                response, keep = await self._read_response(connection.reader, method)
            except (ConnectionError, asyncio.IncompleteReadError, EOFError) as err:
                connection.close()
                if reused and isinstance(err, ConnectionError | asyncio.IncompleteReadError):
                    continue  # the server had closed the idle connection
                raise
            except BaseException:
                connection.close()  # cancelled or failed mid-exchange: never reuse it
                raise
            if keep and len(self._idle) < self._max_idle:
                self._idle.append(connection)
            else:
                connection.close()
            return response

    async def _read_response(
        self, reader: asyncio.StreamReader, method: str
    ) -> tuple[Response, bool]:
        status_line = await reader.readuntil(b"\n")
        parts = status_line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise ProtocolError(f"not an HTTP/1.x status line: {status_line[:80]!r}")
        status = int(parts[1])
        headers: dict[str, str] = {}
        for _ in range(MAX_HEADER_LINES):
            line = await reader.readuntil(b"\n")
            if line in (b"\r\n", b"\n"):
                break
            name, sep, value = line.decode("latin-1").partition(":")
            if not sep:
                raise ProtocolError(f"malformed header line {line[:80]!r}")
            headers[name.strip().lower()] = value.strip()
        else:
            raise ProtocolError("too many header lines")
        keep = headers.get("connection", "").lower() != "close" and parts[0] != b"HTTP/1.0"
        if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            return Response(status, headers, b""), keep
        if "chunked" in headers.get("transfer-encoding", "").lower():
            body = await self._read_chunked(reader)
        elif "content-length" in headers:
            try:
                length = int(headers["content-length"])
            except ValueError:
                raise ProtocolError(
                    f"malformed Content-Length {headers['content-length'][:40]!r}"
                ) from None
            if not 0 <= length <= MAX_BODY:
                raise ProtocolError(f"unacceptable Content-Length {length}")
            body = await reader.readexactly(length)
        else:
            body = await self._read_to_eof(reader)  # the server closes to end the body
            keep = False
        return Response(status, headers, body), keep

    @staticmethod
    async def _read_to_eof(reader: asyncio.StreamReader) -> bytes:
        """A close-delimited body: one ``read()`` returns what has arrived so far, not
        the whole body, so read until the server closes."""
        chunks: list[bytes] = []
        total = 0
        while chunk := await reader.read(65536):
            total += len(chunk)
            if total > MAX_BODY:
                raise ProtocolError("response body too large")
            chunks.append(chunk)
        return b"".join(chunks)

    @staticmethod
    async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
        chunks: list[bytes] = []
        total = 0
        while True:
            size_line = await reader.readuntil(b"\n")
            try:
                size = int(size_line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise ProtocolError(f"malformed chunk size {size_line[:40]!r}") from None
            if size == 0:
                while (await reader.readuntil(b"\n")) not in (b"\r\n", b"\n"):
                    pass  # trailers
                return b"".join(chunks)
            total += size
            if total > MAX_BODY:
                raise ProtocolError("response body too large")
            chunks.append(await reader.readexactly(size))
            await reader.readexactly(2)  # the chunk's CRLF

    async def close(self) -> None:
        while self._idle:
            self._idle.pop().close()
