"""A small HTTP/1.1 keep-alive client for canaryd's request/response calls.

The bump is the hot path: one PATCH per canary per cycle. aiohttp's request
machinery costs about 0.13 ms of CPU per request on uvloop here; writing the
request bytes and parsing the answer in an asyncio.Protocol as it arrives costs a
fraction of that (bench/bench.py, docs/PERFORMANCE.md). This client does only what
kube-apiserver needs: one request at a time per connection, ``Content-Length`` request bodies,
``Content-Length`` or ``chunked`` responses, TLS through ``ssl``, and a pool of
idle connections. Watches and proxied setups use aiohttp.
"""

from __future__ import annotations

import asyncio
import math
import re
import ssl
from collections import deque
from collections.abc import Callable, Mapping
from functools import partial
from typing import NamedTuple, cast
from urllib.parse import urlencode, urlsplit

import structlog

log = structlog.get_logger("canaryd.http1")

MAX_HEADER_LINES = 200
MAX_HEAD = 2**20
MAX_BODY = 64 * 1024 * 1024


class ProtocolError(Exception):
    """The server's answer is not HTTP/1.1 we can read."""


class Response(NamedTuple):
    status: int
    headers: Mapping[str, str]  # names lowercased
    body: bytes


Answered = Callable[[Response | BaseException, bool], None]
"""Told a request's outcome, once: the answer and whether its connection can be kept,
or what ended the exchange (IncompleteReadError with what arrived before the server
closed, ProtocolError, TimeoutError at the deadline, the transport's error)."""

Outcome = Callable[[Response | BaseException | None], None]
"""``Http1Client.send``'s callback: the answer, what failed it, or None when nothing was
answered on a pooled connection the server had closed (the awaitable ``request``
retries that on a fresh connection)."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection. The answer is parsed as its bytes arrive, in the
    transport's callback: no stream reader, no await per header line."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        # The loop is kept: asyncio.get_running_loop() costs a getpid() system call per
        # call on Python 3.11, several per bump.
        self._loop = loop
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._on_answer: Answered | None = None  # the request in flight's, if any
        self._method = "GET"
        self._eof = False
        self._lost: BaseException | None = None
        self._head: tuple[int, dict[str, str], bool] | None = None  # status, headers, keep
        self._length = -1  # body bytes left to wait for; -1: chunked or to EOF
        self._chunked = False
        self._chunk = _CHUNK_SIZE_LINE  # in a chunked body: what comes next
        self._chunks: list[bytes] = []
        self._chunked_size = 0
        self._received = False

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not registered as asyncio.Transport: no isinstance.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self._on_answer is None:
            # Bytes nobody asked for (no request in flight): the connection is out of
            # step with the server. Dropped, not buffered.
            self.close()
            return
        self._buffer += data
        self._received = True
        self._advance()

    def eof_received(self) -> bool:
        self._eof = True
        if self._on_answer is not None:
            self._advance()
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._eof = True
        self._lost = exc
        if self._on_answer is not None:
            self._advance()

    # the exchange

    def usable(self) -> bool:
        """Idle and still open: the server has not closed it (nor sent unasked bytes)."""
        return (
            not self._eof
            and not self._buffer
            and self.transport is not None
            and not self.transport.is_closing()
        )

    def exchange(self, payload: bytes, method: str, on_answer: Answered) -> None:
        """Send one request; ``on_answer`` is told its outcome once, from the transport's
        callback (never from within this call)."""
        assert self.transport is not None and self._on_answer is None
        self._method = method
        self._head, self._length, self._chunked = None, -1, False
        self._chunk, self._chunks, self._chunked_size = _CHUNK_SIZE_LINE, [], 0
        self._received = False
        self._on_answer = on_answer
        try:
            self.transport.write(payload)
        except BaseException:
            self._on_answer = None
            raise

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def expire_at(self, deadline: float) -> asyncio.TimerHandle:
        """At ``deadline`` the answer is abandoned with its connection (TimeoutError)."""
        return self._loop.call_at(deadline, self._expire)

    def _expire(self) -> None:
        self._fail(TimeoutError("no answer before the deadline"))

    def nothing_received(self) -> bool:
        return not self._received

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        self._eof = True

    def _finish(self, body: bytes) -> None:
        assert self._head is not None and self._on_answer is not None
        status, headers, keep = self._head
        # A pooled connection keeps nothing of the answer it delivered.
        self._head, self._chunks = None, []
        on_answer, self._on_answer = self._on_answer, None
        on_answer(Response(status, headers, body), keep and not self._eof)

    def _fail(self, error: BaseException) -> None:
        on_answer, self._on_answer = self._on_answer, None
        if self.transport is not None:
            self.transport.close()
        self._eof = True
        if on_answer is not None:
            on_answer(error, False)

    def _truncated(self) -> None:
        if self._lost is not None and isinstance(self._lost, OSError):
            self._fail(self._lost)
        else:
            self._fail(asyncio.IncompleteReadError(bytes(self._buffer), None))

    def _advance(self) -> None:
        try:
            if self._head is None and not self._read_head():
                return
            if self._chunked:
                self._read_chunks()
            elif self._length >= 0:
                if len(self._buffer) >= self._length:
                    body = bytes(self._buffer[: self._length])
                    del self._buffer[: self._length]
                    self._finish(body)
                elif self._eof:
                    self._truncated()
            elif self._eof:  # a close-delimited body: whole only if the server closed it
                if self._lost is not None:
                    self._truncated()  # reset, not closed: the body may be cut short
                    return
                body = bytes(self._buffer)
                self._buffer.clear()
                self._finish(body)
            elif len(self._buffer) > MAX_BODY:
                raise ProtocolError("response body too large")
        except ProtocolError as err:
            self._fail(err)
        except Exception as err:  # a bug here must fail the request, not the transport
            log.exception("http1_answer_unreadable")
            error = ProtocolError(f"unreadable answer ({type(err).__name__}: {err})")
            error.__cause__ = err
            self._fail(error)

    def _read_head(self) -> bool:
        """Parse the status line and headers once they are all in; False: not yet."""
        while True:  # past any interim answers
            buffer = self._buffer
            # The head ends at its first empty line: CRLF, or a bare LF (tolerated).
            end, size = buffer.find(b"\n\r\n"), 3
            bare = buffer.find(b"\n\n", 0, end if end >= 0 else len(buffer))
            if bare >= 0:
                end, size = bare, 2
            if end < 0:
                if len(buffer) > MAX_HEAD:
                    raise ProtocolError("response head too large")
                if self._eof:
                    self._truncated()
                return False
            text = buffer[:end].decode("latin-1")
            del buffer[: end + size]
            status_line, _, fields = text.partition("\n")
            status_line = status_line.rstrip("\r")
            parts = status_line.split(None, 2)
            if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not _DIGITS(parts[1]):
                raise ProtocolError(f"not an HTTP/1.x status line: {status_line[:80]!r}")
            status = int(parts[1])
            if 100 <= status < 200 and status != 101:
                # An interim answer (100 Continue, 103 Early Hints): the real one follows.
                continue
            headers = _fields(fields)
            keep = headers.get("connection", "").lower() != "close" and parts[0] != "HTTP/1.0"
            self._head = (status, headers, keep)
            if self._method == "HEAD" or status in (204, 304, 101):
                self._length = 0
            elif "chunked" in headers.get("transfer-encoding", "").lower():
                self._chunked = True
            elif "content-length" in headers:
                value = headers["content-length"]
                if not _DIGITS(value):
                    raise ProtocolError(f"malformed Content-Length {value[:40]!r}")
                length = int(value)
                if not 0 <= length <= MAX_BODY:
                    raise ProtocolError(f"unacceptable Content-Length {length}")
                self._length = length
            else:
                self._head = (status, headers, False)  # the server closes to end the body
            return True

    def _read_chunks(self) -> None:
        buffer = self._buffer
        while True:
            if self._chunk == _CHUNK_SIZE_LINE or self._chunk == _CHUNK_TRAILER:
                newline = buffer.find(b"\n")
                if newline < 0:
                    if len(buffer) > MAX_HEAD:
                        raise ProtocolError("chunk size line too long")
                    if self._eof:
                        self._truncated()
                    return
                line = bytes(buffer[:newline])
                del buffer[: newline + 1]
                if self._chunk == _CHUNK_TRAILER:
                    if line in (b"", b"\r"):
                        self._finish(b"".join(self._chunks))
                        return
                    continue  # a trailer line
                digits = line.split(b";", 1)[0].strip()
                if not _HEX(digits):
                    raise ProtocolError(f"malformed chunk size {line[:40]!r}")
                size = int(digits, 16)
                if size == 0:
                    self._chunk = _CHUNK_TRAILER
                    continue
                self._chunked_size += size
                if self._chunked_size > MAX_BODY:
                    raise ProtocolError("response body too large")
                self._chunk = size
            size = self._chunk
            if len(buffer) < size + 1 or (len(buffer) == size + 1 and buffer[size] == 13):
                if self._eof:
                    self._truncated()
                return  # the chunk, or its line end, is not all in yet
            if buffer[size : size + 2] == b"\r\n":
                ending = 2
            elif buffer[size] == 10:  # a bare LF
                ending = 1
            else:
                raise ProtocolError("a chunk not followed by its line end")
            self._chunks.append(bytes(buffer[:size]))
            del buffer[: size + ending]
            self._chunk = _CHUNK_SIZE_LINE


def _fields(text: str) -> dict[str, str]:
    """The header lines (after the status line) as a dict, names lowercased."""
    if not text:
        return {}
    lines = text.split("\n")
    if len(lines) >= MAX_HEADER_LINES:
        raise ProtocolError("too many header lines")
    headers: dict[str, str] = {}
    for line in lines:
        name, sep, value = line.partition(":")
        if not sep:
            raise ProtocolError(f"malformed header line {line[:80]!r}")
        headers[name.strip().lower()] = value.strip()
    return headers


_CHUNK_SIZE_LINE = -1
_CHUNK_TRAILER = -2
_DIGITS = re.compile(r"[0-9]{1,18}").fullmatch
"""A status code or Content-Length: ASCII digits only (int() also takes "+1", "1_0",
"²" and spaces)."""
_HEX = re.compile(rb"[0-9A-Fa-f]{1,15}").fullmatch


class ConnectTimeout(TimeoutError):
    """No connection within the connect timeout."""


def _settle(
    waiter: asyncio.Future[tuple[Response, bool]], outcome: Response | BaseException, keep: bool
) -> None:
    if waiter.done():
        return  # the request was cancelled meanwhile
    if isinstance(outcome, BaseException):
        waiter.set_exception(outcome)
    else:
        waiter.set_result((outcome, keep))


class _Sent:
    """One ``Http1Client.send`` in flight: its connection, its deadline's timer, and who
    is told its outcome, a turn of the loop after it came (a bug there is logged, never
    the transport's).

    The turn keeps the order in which things arrived: an answer is handled after what
    came in before it in the same read of the sockets (a watch event, whose task was
    woken first), as an awaiting task's would be. Handled at once, inside the read, a
    bump could count as answered before an older event of its watch was delivered,
    and the judge would take that event for a sign that the stream still works."""

    __slots__ = ("client", "connection", "on_outcome", "timer")

    def __init__(
        self,
        client: Http1Client,
        connection: _Connection,
        timer: asyncio.TimerHandle,
        on_outcome: Outcome,
    ) -> None:
        self.client, self.connection, self.timer = client, connection, timer
        self.on_outcome = on_outcome

    def __call__(self, outcome: Response | BaseException, keep: bool) -> None:
        self.timer.cancel()
        self.client._sent.discard(self)
        told: Response | BaseException | None = outcome
        if isinstance(outcome, BaseException):
            self.connection.close()
            if (
                isinstance(outcome, (ConnectionError, asyncio.IncompleteReadError))
                and self.connection.nothing_received()
            ):
                told = None  # the server had closed the pooled connection: not answered
        else:
            self.client._done_with(self.connection, keep)
        self.connection.loop.call_soon(self._tell, told)

    def _tell(self, told: Response | BaseException | None) -> None:
        try:
            self.on_outcome(told)
        except Exception:
            log.exception("http1_outcome_callback_failed")


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
        self._sent: set[_Sent] = set()
        """``send``s in flight: ``close`` ends them too (no task owns them)."""
        self._closed = False
        self._connect_timeout = connect_timeout

    async def _connect(self, deadline: float | None = None) -> _Connection:
        """A new connection (TLS included) within the connect timeout: a black-holed
        address fails here, not at the end of a list's minute. A request's deadline
        that comes sooner is a TimeoutError as the exchange's is."""
        loop = asyncio.get_running_loop()
        connect_by = (
            math.inf if self._connect_timeout is None else loop.time() + self._connect_timeout
        )
        by = connect_by if deadline is None else min(deadline, connect_by)
        try:
            async with asyncio.timeout_at(None if by == math.inf else by):
                _, connection = await loop.create_connection(
                    lambda: _Connection(loop),
                    self.host,
                    self.port,
                    ssl=self.ssl,
                    server_hostname=self.server_hostname,
                )
        except TimeoutError:
            if by < connect_by:
                raise  # the request's own deadline
            raise ConnectTimeout(
                f"no connection to {self.host}:{self.port} within {self._connect_timeout:g}s"
            ) from None
        return connection

    @staticmethod
    def header_block(headers: Mapping[str, str]) -> bytes:
        """Encode header lines once; callers cache the block (it is the same per request)."""
        return b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in headers.items())

    def _payload(
        self,
        method: str,
        path: str,
        params: Mapping[str, str] | None,
        headers: bytes,
        body: bytes | None,
    ) -> bytes:
        target = self.prefix + path + (f"?{urlencode(params)}" if params else "")
        length = b"Content-Length: %d\r\n" % len(body) if body is not None else b""
        return b"".join(
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

    def _pooled(self) -> _Connection | None:
        """An idle connection the server has not closed meanwhile (nor sent unasked
        bytes on), if there is one; those it closed are dropped."""
        while self._idle:
            connection = self._idle.pop()
            if connection.usable():
                return connection
            connection.close()
        return None

    def _done_with(self, connection: _Connection, keep: bool) -> None:
        if keep and not self._closed and len(self._idle) < self._max_idle:
            self._idle.append(connection)
        else:
            connection.close()

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        headers: bytes = b"",
        body: bytes | None = None,
        deadline: float | None = None,
    ) -> Response:
        """One exchange; ``headers`` is a ``header_block``. A pooled connection the server
        closed meanwhile is retried once on a fresh one (nothing was answered on it).

        ``deadline`` (the loop's clock): TimeoutError when no answer came by then, its
        connection closed so that a late answer is never read. One timer on the loop,
        not a timeout scope: a scope costs more than the rest of the exchange."""
        payload = self._payload(method, path, params, headers, body)
        retried = False
        while True:
            connection = None if retried else self._pooled()
            reused = connection is not None
            if connection is None:
                connection = await self._connect(deadline)
            timer = None
            try:
                waiter: asyncio.Future[tuple[Response, bool]] = connection.loop.create_future()
                connection.exchange(payload, method, partial(_settle, waiter))
                if deadline is not None:
                    timer = connection.expire_at(deadline)
                response, keep = await waiter
            except (ConnectionError, asyncio.IncompleteReadError) as err:
                connection.close()
                if reused and connection.nothing_received():
                    # The server had closed the idle connection: nothing was answered.
                    # Once, on a fresh connection (never on the next idle one).
                    retried = True
                    continue
                raise err from None
            except BaseException:
                connection.close()  # cancelled or failed mid-exchange: never reuse it
                raise
            finally:
                if timer is not None:
                    timer.cancel()
            self._done_with(connection, keep)
            return response

    def send(
        self,
        method: str,
        path: str,
        on_outcome: Outcome,
        *,
        headers: bytes = b"",
        body: bytes | None = None,
        deadline: float,
    ) -> bool:
        """``request`` without a task: sent now on an idle pooled connection, and
        ``on_outcome`` told a turn of the loop after it came (the answer, what failed it, or
        None: the server had closed the pooled connection, nothing was answered, the
        awaitable ``request`` retries it on a fresh one). False, and nothing sent, when no
        idle connection is open (``request`` makes one)."""
        connection = self._pooled()
        if connection is None:
            return False
        timer = connection.expire_at(deadline)
        sent = _Sent(self, connection, timer, on_outcome)
        try:
            connection.exchange(self._payload(method, path, None, headers, body), method, sent)
        except (OSError, RuntimeError):
            # The transport refused the bytes: whatever went out, the server gets no
            # whole request once the connection is closed; ``request`` tries anew.
            timer.cancel()
            connection.close()
            return False
        self._sent.add(sent)
        return True

    async def close(self) -> None:
        """Close every connection: the idle ones, and those of ``send``s in flight (their
        outcome: the connection's error). Nothing is pooled after this."""
        self._closed = True
        while self._idle:
            self._idle.pop().close()
        for sent in list(self._sent):
            sent.connection.close()
