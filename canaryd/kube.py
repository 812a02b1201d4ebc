"""Kubernetes access: the resource types, API errors classified once (ErrorKind;
failure_cause for people), every request and watch over aiohttp. A PATCH whose
connection failed is never resent here: the writer resends it identical."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import json
import math
import os
import socket
import ssl
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from dataclasses import KW_ONLY, dataclass
from typing import Any
from urllib.parse import quote

import aiohttp
import structlog
from aiohttp.http_exceptions import LineTooLong

from canaryd import logs, metrics
from canaryd.config import Settings
from canaryd.credentials import Credentials

log = structlog.get_logger("canaryd.kube")

FLINK_GROUP = "flink.apache.org"
FLINK_VERSION = "v1beta1"
MERGE_PATCH = "application/merge-patch+json"
PROXY_VARIABLES = ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY")  # upper- or lower-case
RESERVED_CONNECTIONS = 64
"""Request connections bumps never take: lists (16 scopes at a time), reviews, the lease."""
MAX_WATCH_LINE = 2**24  # one event: an object of at most 1.5 MiB (etcd's limit), encoded


@dataclass(frozen=True)
class Kind:
    """A namespaced custom resource type that can be a canary."""

    plural: str
    kind: str
    group: str = FLINK_GROUP
    version: str = FLINK_VERSION

    @property
    def key(self) -> str:
        """The bare plural for Flink's kinds, ``PLURAL.GROUP/VERSION`` for any other."""
        if (self.group, self.version) == (FLINK_GROUP, FLINK_VERSION):
            return self.plural
        return f"{self.plural}.{self.group}/{self.version}"

    def collection_path(self, namespace: str | None) -> str:
        if namespace is None:
            return f"/apis/{self.group}/{self.version}/{self.plural}"
        return f"/apis/{self.group}/{self.version}/namespaces/{segment(namespace)}/{self.plural}"

    def object_path(self, namespace: str, name: str) -> str:
        return f"{self.collection_path(namespace)}/{segment(name)}"


KINDS = {
    "flinkdeployments": Kind("flinkdeployments", "FlinkDeployment"),
    "flinksessionjobs": Kind("flinksessionjobs", "FlinkSessionJob"),
}
NAMESPACES_PATH = "/api/v1/namespaces"
KIND_NAMES: dict[str, str] = {}
"""The Kind names list answers gave for kinds given as PLURAL.GROUP/VERSION."""


def kind_of(key: str) -> Kind:
    if key in KINDS:
        return KINDS[key]
    resource, _, version = key.partition("/")
    plural, _, group = resource.partition(".")
    return Kind(plural, KIND_NAMES.get(key, plural), group, version)


def object_path(kind: str, namespace: str, name: str) -> str:
    return kind_of(kind).object_path(namespace, name)


def segment(value: str) -> str:
    """One path segment, percent-encoded: a name never adds a segment or a query."""
    return quote(value, safe="")


def json_object(data: bytes) -> dict[str, Any] | None:
    """A JSON object from the API server; None for anything else, too deep nesting
    included."""
    try:
        decoded = json.loads(data)
    except (ValueError, RecursionError):
        return None
    return decoded if isinstance(decoded, dict) else None


class ErrorKind(enum.Enum):
    """What an API failure means for canaryd; callers branch on this, not on codes."""

    CONFLICT = "conflict"  # 409: someone wrote first; re-read and retry
    GONE = "gone"  # 404, a Status or NOT_SERVED: the object (or its type) does not exist
    FORBIDDEN = "forbidden"  # 403: not ours to touch
    EXPIRED = "expired"  # 410: the resourceVersion was compacted; relist
    TRANSIENT = "transient"  # 5xx, 401, 408, 429, timeouts, connection failures: retry later
    INVALID = "invalid"  # any other 4xx: the request itself is wrong; retrying won't help


@dataclass(eq=False)
class KubeError(Exception):
    kind: ErrorKind
    message: str
    _: KW_ONLY
    status: int | None = None
    reason: str = ""
    retry_after: float | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def __str__(self) -> str:
        code = f"{self.status} " if self.status is not None else ""
        return f"{code}{self.reason or self.kind.value}: {self.message}"


_STATUS_KINDS = {
    409: ErrorKind.CONFLICT,
    404: ErrorKind.GONE,
    403: ErrorKind.FORBIDDEN,
    410: ErrorKind.EXPIRED,
}


def classify_answer(status: int, answer: Mapping[str, Any] | None = None) -> ErrorKind:
    """What an answer's code means, reading its Status where the code does not tell: a
    504 "Too large resource version" (kube-apiserver's message, its cause
    ResourceVersionTooLarge or not) is an API server behind canaryd's resourceVersion:
    EXPIRED, a relist, as in client-go."""
    message = str((answer or {}).get("message") or "").lower()
    if status == 504 and "too large resource version" in message:
        return ErrorKind.EXPIRED
    if status >= 500 or status in (401, 408, 429):
        return ErrorKind.TRANSIENT
    return _STATUS_KINDS.get(status, ErrorKind.INVALID)


NOT_SERVED = b"404 page not found\n"
"""kube-apiserver's answer to a path it does not serve, and a Go gateway's with nothing
behind it: GONE once listwatch.not_served confirms it (docs/DESIGN.md, a 404 not a Status)."""


def serving(status: int, body: bytes) -> bool:
    """Whether an answer shows the API server serving: a 2xx, or a 4xx other than 429
    sent as a Status object (docs/DESIGN.md, the API server away)."""
    if 400 <= status < 500 and status != 429:
        return (json_object(body) or {}).get("kind") == "Status"
    return 200 <= status < 300


def error_from_response(response: aiohttp.ClientResponse, body: bytes, note: str = "") -> KubeError:
    status, answer = response.status, json_object(body) or {}
    message = str(answer.get("message") or body[:300].decode("utf-8", "replace").strip())
    try:
        seconds: float | None = float(response.headers.get("Retry-After") or "")
    except ValueError:
        seconds = None  # absent, or an HTTP-date: Kubernetes sends seconds
    kind = classify_answer(status, answer)
    if status in (403, 404) and answer.get("kind") != "Status" and body != NOT_SERVED:
        kind = ErrorKind.TRANSIENT  # a proxy's or gateway's page: nothing known gone or refused
    return KubeError(
        kind,
        (message or "(no message)") + note,
        status=status,
        reason=str(answer.get("reason") or ""),
        retry_after=seconds if seconds is not None and seconds >= 0 else None,
    )


def error_from_exception(err: BaseException, reason: str = "ConnectionError") -> KubeError:
    """Transport and credential failures are transient: the next attempt may work."""
    name = type(err).__name__
    return KubeError(ErrorKind.TRANSIENT, f"{name}: {logs.scrub(str(err)) or name}", reason=reason)


def failure_cause(err: KubeError) -> str:
    """Why a request failed, in one word a person acts on: ``refused``,
    ``unauthorized`` (401, also after a reload), ``tls``, ``timeout``, ``dns``,
    ``forbidden``, ``credentials`` (not loaded), ``server_error`` (5xx, 429),
    ``http_<code>``, else ``connection``."""
    if err.status is not None:
        if err.status in (401, 403):
            return "unauthorized" if err.status == 401 else "forbidden"
        return "server_error" if err.status >= 500 or err.status == 429 else f"http_{err.status}"
    if err.reason in ("Credentials", "ConnectTimeout"):
        return "credentials" if err.reason == "Credentials" else "timeout"
    # The whole chain, the most telling cause first: a certificate that failed
    # verification while the connect timed out is a TLS problem, not a slow network.
    chain: list[BaseException] = []
    seen: BaseException | None = err.__cause__
    while seen is not None and len(chain) < 16:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    for cause, kinds in (
        ("tls", (ssl.SSLError, aiohttp.ClientSSLError)),
        ("refused", (ConnectionRefusedError,)),
        ("dns", (socket.gaierror,)),
        ("timeout", (TimeoutError, aiohttp.ServerTimeoutError)),
    ):
        if any(isinstance(link, kinds) for link in chain):
            return cause
    return "connection"


class KubeClient:
    """Single-object calls on one session, watches (each holding its connection for
    minutes) on another."""

    def __init__(self, credentials: Credentials, settings: Settings) -> None:
        self.credentials = credentials
        self._request_timeout = settings.request_timeout
        # A request's bound on its connection, the wait for the pool included.
        self._timeout = aiohttp.ClientTimeout(connect=settings.connect_timeout)
        self._answered = self._unanswered = -math.inf
        """Send times of the latest exchange answered serving, and of the latest not."""
        # trust_env costs a proxy and netrc lookup per request: only with a proxy.
        trust_env = any(os.environ.get(v) or os.environ.get(v.lower()) for v in PROXY_VARIABLES)
        headers = {"Accept": "application/json", "User-Agent": "canaryd"}
        session = functools.partial(aiohttp.ClientSession, trust_env=trust_env, headers=headers)
        limit = settings.max_bumps_in_flight + RESERVED_CONNECTIONS
        keepalive = settings.keepalive_timeout
        self._session = session(
            connector=aiohttp.TCPConnector(limit=limit, keepalive_timeout=keepalive),
            cookie_jar=aiohttp.DummyCookieJar(),  # the API server sets none
        )
        # Watches: a pool of their own, unlimited: every scope connects, never behind a bump.
        self._watch_session = session(connector=aiohttp.TCPConnector(limit=0))

    @property
    def host(self) -> str:
        return str(self.credentials.configuration.host).rstrip("/")

    @property
    def answered_since(self) -> float:
        """When (time.monotonic()) the latest request answered ``serving`` was sent: an
        answer to a request sent before some moment says nothing about after it. -inf
        while one sent later got no such answer: the server stopped serving since."""
        return self._answered if self._answered >= self._unanswered else -math.inf

    def _note_answer(self, sent: float, status: int = 0, body: bytes = b"") -> None:
        if serving(status, body):
            self._answered = max(self._answered, sent)
        else:
            self._unanswered = max(self._unanswered, sent)

    async def close(self) -> None:
        await self._session.close()
        await self._watch_session.close()

    @contextlib.asynccontextmanager
    async def _exchange(
        self,
        verb: str,
        method: str,
        path: str,
        deadline: float | None,
        bounds: aiohttp.ClientTimeout,
        content_type: str | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[tuple[aiohttp.ClientResponse, bytes]]:
        """The answer and its body (unread for a watch's 2xx) within ``deadline`` (loop
        time; a watch's None), counted and noted; whatever goes wrong is a KubeError."""
        watch = verb == "watch"
        cfg = self.credentials.configuration
        headers: dict[str, str] | None = None
        sent, answered = time.monotonic(), False
        try:
            async with asyncio.timeout_at(deadline):
                headers = await self.credentials.headers()
                if content_type is not None:
                    headers["Content-Type"] = content_type
                sent = time.monotonic()
                async with (self._watch_session if watch else self._session).request(
                    method,
                    self.host + path,
                    headers=headers,
                    ssl=self.credentials.tls,
                    proxy=cfg.proxy or None,
                    server_hostname=cfg.tls_server_name or None,
                    timeout=bounds,
                    **kwargs,
                ) as response:
                    body = b"" if watch and response.status < 300 else await response.read()
                    metrics.API_REQUESTS.labels(verb, str(response.status)).inc()
                    answered = True  # counted once: a stream cut later is not a request
                    self._note_answer(sent, response.status, body)
                    yield response, body
        except KubeError:
            raise
        except Exception as err:
            if headers is None:  # the credentials could not be had (in time)
                metrics.ERRORS.labels("credentials").inc()
                raise error_from_exception(err, "Credentials") from err
            self._note_answer(sent)
            if isinstance(err, aiohttp.SocketTimeoutError):  # only a watch reads with one
                idle = f"no event for {bounds.sock_read}s"
                raise KubeError(ErrorKind.TRANSIENT, idle, reason="Idle") from err
            if not answered:
                metrics.API_REQUESTS.labels(verb, "error").inc()
            if isinstance(err, aiohttp.ConnectionTimeoutError):  # a black-holed address
                late = f"no connection within {self._timeout.connect:g}s"
                raise KubeError(ErrorKind.TRANSIENT, late, reason="ConnectTimeout") from err
            if isinstance(err, (TimeoutError, aiohttp.ClientError, OSError)):
                raise error_from_exception(err) from err
            # The boundary: all else is a KubeError too.
            metrics.ERRORS.labels("watch_request" if watch else "request").inc()
            event = "watch_failed_unexpectedly" if watch else "request_failed_unexpectedly"
            log.warning(event, verb=verb, path=path, error=type(err).__name__)
            raise error_from_exception(err, "ClientError") from err

    async def request(
        self,
        verb: str,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        body: Any = None,
        data: str | None = None,
        content_type: str = "application/json",
        time_limit: float | None = None,
    ) -> dict[str, Any]:
        """The decoded JSON object, or a KubeError. ``data`` is a serialised body, ``body``
        one to serialise; one deadline covers the call, a retry after a 401 included."""
        if body is not None:
            data = json.dumps(body, separators=(",", ":"))
        deadline = asyncio.get_running_loop().time() + (time_limit or self._request_timeout)
        content = content_type if data is not None else None
        for retried in (False, True):
            version = self.credentials.version
            async with self._exchange(
                verb, method, path, deadline, self._timeout, content, params=params, data=data
            ) as (reply, payload):
                pass
            note = await self.credentials.answered(reply.status, version, deadline, not retried)
            if note is None:
                continue  # fresh credentials, within the deadline: sent again
            if reply.status >= 300:
                raise error_from_response(reply, payload, note)
            break
        decoded = json_object(payload)
        if decoded is None:
            not_json = "the API server sent a body that is not a JSON object"
            raise KubeError(ErrorKind.TRANSIENT, not_json, status=reply.status)
        return decoded

    async def watch(
        self,
        path: str,
        params: Mapping[str, str],
        *,
        idle_timeout: float,
        on_connected: Callable[[], None] | None = None,
    ) -> AsyncGenerator[dict[str, Any]]:
        """The watch's events until the server ends the stream; ``on_connected()`` once
        it answered 200. A KubeError whatever goes wrong: reason ``Idle`` when nothing, not
        even a bookmark, arrives for ``idle_timeout`` s, ``LineTooLong`` past MAX_WATCH_LINE."""
        version = self.credentials.version
        # No total: a watch lasts minutes. aiohttp's line limit is twice read_bufsize.
        connect = self._timeout.connect
        timeout = aiohttp.ClientTimeout(
            sock_read=idle_timeout, connect=connect, sock_connect=connect
        )
        params = {**params, "watch": "true"}
        async with self._exchange(
            "watch", "GET", path, None, timeout, params=params, read_bufsize=MAX_WATCH_LINE // 2
        ) as (response, body):
            note = await self.credentials.answered(response.status, version)
            if response.status >= 300:
                raise error_from_response(response, body, note or "")
            if on_connected is not None:
                on_connected()
            try:
                async for line in response.content:  # until the end of the stream
                    event = json_object(line)
                    if event is not None:
                        yield event
                    elif not line.isspace():
                        metrics.ERRORS.labels("watch_decode").inc()
                        log.warning("watch_line_not_an_object", path=path, size=len(line))
            except LineTooLong as err:
                too_long = f"a watch line longer than {MAX_WATCH_LINE} bytes"
                raise KubeError(ErrorKind.TRANSIENT, too_long, reason="LineTooLong") from err


async def connect(settings: Settings, *, load: bool = True) -> KubeClient:
    """A client, its credentials loaded unless not ``load`` (Credentials.load later)."""
    credentials = Credentials(timeout=settings.request_timeout)
    if load:
        await credentials.load(settings)
    return KubeClient(credentials, settings)
