"""Kubernetes access: the resource types canaryd names, the one place where API errors
are classified (ErrorKind; failure_cause for people), and every request and watch, over
aiohttp with the credentials of canaryd.credentials.

aiohttp retries a request on a pooled connection the server had closed only for
idempotent methods: a PATCH whose connection failed is reported, never resent here (the
writer resends it identical, see canaryd.writer).
"""

from __future__ import annotations

import asyncio
import enum
import json
import math
import os
import socket
import ssl
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import aiohttp
import structlog
from aiohttp.http_exceptions import LineTooLong

from canaryd import logs, metrics
from canaryd.config import Settings
from canaryd.credentials import Credentials, load

log = structlog.get_logger("canaryd.kube")

FLINK_GROUP = "flink.apache.org"
FLINK_VERSION = "v1beta1"
MERGE_PATCH = "application/merge-patch+json"
PROXY_VARIABLES = ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY")
"""What configures a proxy, upper- or lower-case."""
RESERVED_CONNECTIONS = 64
"""Request connections beyond the bumps' own, which bumps never take: lists (16 scopes
at a time, canaryd.watcher), access reviews (8 at once, canaryd.access), the lease."""
MAX_WATCH_LINE = 2**24
"""A watch line holds one event: an object of at most 1.5 MiB (etcd's limit), encoded."""


@dataclass(frozen=True)
class Kind:
    """A namespaced custom resource type that can be a canary: a Flink one, or any
    other named ``PLURAL.GROUP/VERSION``."""

    plural: str
    kind: str
    group: str = FLINK_GROUP
    version: str = FLINK_VERSION

    @property
    def key(self) -> str:
        """How settings, the registry and logs name it: the bare plural for Flink's
        kinds, ``PLURAL.GROUP/VERSION`` for any other."""
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
    """The Kind a registry key names (see ``Kind.key``)."""
    known = KINDS.get(key)
    if known is not None:
        return known
    resource, _, version = key.partition("/")
    plural, _, group = resource.partition(".")
    return Kind(plural, KIND_NAMES.get(key, plural), group, version)


def object_path(kind: str, namespace: str, name: str) -> str:
    """The path of a registry kind's object."""
    return kind_of(kind).object_path(namespace, name)


def segment(value: str) -> str:
    """One path segment, percent-encoded: a name never adds a segment or a query."""
    return quote(value, safe="")


def decode_json(data: bytes) -> Any:
    """JSON from the API server. Raises ValueError on anything that is not JSON, nested
    past the interpreter's depth included."""
    try:
        return json.loads(data)
    except RecursionError as err:
        raise ValueError(f"JSON nested too deeply: {err}") from err


def _json_object(body: bytes) -> dict[str, Any] | None:
    """The JSON object a body holds; None for anything else."""
    try:
        decoded = decode_json(body)
    except ValueError:
        return None
    return decoded if isinstance(decoded, dict) else None


# -------------------------------------------------------------------- errors


class ErrorKind(enum.Enum):
    """What an API failure means for canaryd; callers branch on this, not on codes."""

    CONFLICT = "conflict"  # 409: someone wrote first; re-read and retry
    GONE = "gone"  # 404, a Status or NOT_SERVED: the object (or its type) does not exist
    FORBIDDEN = "forbidden"  # 403: not ours to touch
    EXPIRED = "expired"  # 410: the resourceVersion was compacted; relist
    TRANSIENT = "transient"  # 5xx, 401, 408, 429, timeouts, connection failures: retry later
    INVALID = "invalid"  # any other 4xx: the request itself is wrong; retrying won't help


class KubeError(Exception):
    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        *,
        status: int | None = None,
        reason: str = "",
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status
        self.reason = reason
        self.retry_after = retry_after

    def __str__(self) -> str:
        code = f"{self.status} " if self.status is not None else ""
        return f"{code}{self.reason or self.kind.value}: {self.args[0]}"


_STATUS_KINDS = {
    409: ErrorKind.CONFLICT,
    404: ErrorKind.GONE,
    403: ErrorKind.FORBIDDEN,
    410: ErrorKind.EXPIRED,
}


def classify_status(status: int) -> ErrorKind:
    if status >= 500 or status in (401, 408, 429):
        return ErrorKind.TRANSIENT
    return _STATUS_KINDS.get(status, ErrorKind.INVALID)


NOT_SERVED = b"404 page not found\n"
"""kube-apiserver's answer to a path it does not serve (discovery of a group version not
installed, a list of a kind whose CRD is gone), Go's http.NotFound, not a Status (checked
on v1.35.4); the very bytes of a Go gateway with nothing behind it (Traefik's default
router). So it shows nothing by itself: a GONE it gives is believed only once the API
server confirms the kind is not served (listwatch.not_served asks /apis)."""


def serving(status: int, body: bytes) -> bool:
    """Whether an answer shows the API server serving (docs/DESIGN.md, what counts as
    the API server answering): a 2xx, or a 4xx other than 429 that kube-apiserver sent
    as a Status object. A 5xx, a 429, a redirect, or any other body (a gateway's error
    page, NOT_SERVED) is no sign of it."""
    if 200 <= status < 300:
        return True
    status_object = 400 <= status < 500 and status != 429
    return status_object and (_json_object(body) or {}).get("kind") == "Status"


def classify_answer(status: int, decoded: Mapping[str, Any]) -> ErrorKind:
    """classify_status, reading the Status object where the code alone does not tell:
    kube-apiserver's "Too large resource version" (a 504 Timeout with the cause
    ResourceVersionTooLarge) means the API server this request reached is behind the
    resourceVersion canaryd resumes from (another replica served it). Retrying with the
    same resourceVersion waits for that replica; client-go relists (reflector.go,
    isTooLargeResourceVersionError, which also accepts the message of older servers):
    EXPIRED."""
    if status == 504:
        details = decoded.get("details")
        causes = details.get("causes") if isinstance(details, Mapping) else None
        if isinstance(causes, list) and any(
            isinstance(c, Mapping) and c.get("reason") == "ResourceVersionTooLarge" for c in causes
        ):
            return ErrorKind.EXPIRED
        if "too large resource version" in str(decoded.get("message") or "").lower():
            return ErrorKind.EXPIRED
    return classify_status(status)


def error_from_response(
    status: int, body: bytes, retry_after: str | None, note: str = ""
) -> KubeError:
    """A KubeError from a non-2xx answer, reading the Status object when there is one
    (``note`` is said after its message)."""
    answer = _json_object(body) or {}
    message = str(answer.get("message") or body[:300].decode("utf-8", "replace").strip())
    try:
        seconds: float | None = float(retry_after or "")
    except ValueError:
        seconds = None  # absent, or an HTTP-date: Kubernetes sends seconds
    kind = classify_answer(status, answer)
    if kind is ErrorKind.GONE and answer.get("kind") != "Status" and body != NOT_SERVED:
        kind = ErrorKind.TRANSIENT  # a gateway's page: nothing is known to be gone
    return KubeError(
        kind,
        (message or "(no message)") + note,
        status=status,
        reason=str(answer.get("reason") or ""),
        retry_after=seconds if seconds is not None and seconds >= 0 else None,
    )


def error_from_exception(err: BaseException, reason: str = "ConnectionError") -> KubeError:
    """Transport failures (timeouts, resets, refused connections, a malformed answer)
    and credential failures are transient: the next attempt may well work."""
    name = type(err).__name__
    return KubeError(ErrorKind.TRANSIENT, f"{name}: {logs.scrub(str(err)) or name}", reason=reason)


def failure_cause(err: KubeError) -> str:
    """Why a request failed, in one word a person acts on: ``refused`` (nothing listens
    there), ``unauthorized`` (401: the credentials are wrong or expired, also after a
    reload), ``tls`` (the certificate is not trusted, or the handshake failed),
    ``timeout``, ``dns``, ``forbidden`` (403), ``credentials`` (they could not be
    loaded), ``server_error`` (5xx, 429), ``http_<code>``, else ``connection``."""
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
        if isinstance(seen, aiohttp.ClientConnectorError):
            chain.append(seen.os_error)  # what the connector met
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


def count_request(verb: str, code: int | str) -> None:
    """canaryd_api_requests_total{verb,code}: ``code`` is the answer's, or 'error'."""
    metrics.API_REQUESTS.labels(verb, str(code)).inc()


# -------------------------------------------------------------------- client


class KubeClient:
    """The requests canaryd makes, over aiohttp: single-object calls on one session,
    watches on another (each holds its connection for minutes)."""

    def __init__(
        self,
        credentials: Credentials,
        *,
        request_timeout: float = 10.0,
        connect_timeout: float = 5.0,
        keepalive_timeout: float = 15.0,
        writes_in_flight: int = 256,
    ) -> None:
        self.credentials = credentials
        self.host = str(credentials.configuration.host).rstrip("/")
        self._request_timeout = request_timeout
        self._connect_timeout = min(connect_timeout, request_timeout)
        self._timeout = aiohttp.ClientTimeout(connect=self._connect_timeout)
        """A request's own bound on its connection (the wait for the pool included); the
        whole call is bounded by its deadline (asyncio.timeout_at)."""
        self._answered = self._unanswered = -math.inf
        """Send times of the latest exchange answered serving, and of the latest not."""
        # trust_env (a proxy and netrc lookup per request) only when a proxy is configured.
        trust_env = any(os.environ.get(v) or os.environ.get(v.lower()) for v in PROXY_VARIABLES)
        headers = {"Accept": "application/json", "User-Agent": "canaryd"}
        # Bounded (ClientTimeout's connect covers the wait for the pool): bumps in flight
        # hold at most ``writes_in_flight`` connections, and RESERVED_CONNECTIONS more keep
        # lists, access reviews and the lease from waiting behind bumps that all hang in
        # a brownout. aiohttp hands out the idle connection released first, so a burst's
        # connections take turns and stay alive while reused within keepalive_timeout.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=writes_in_flight + RESERVED_CONNECTIONS, keepalive_timeout=keepalive_timeout
            ),
            trust_env=trust_env,
            headers=headers,
            cookie_jar=aiohttp.DummyCookieJar(),  # the API server sets none
        )
        # Watches: a pool of their own with no limit, so that every scope always gets a
        # connection however many namespaces are watched, never behind a bump.
        self._watch_session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), trust_env=trust_env, headers=headers
        )

    @property
    def answered_since(self) -> float:
        """time.monotonic() at which the latest request the API server answered serving
        (``serving``; a watch's included) was sent: whether it was serving at all after
        some moment. The send time, not the answer's: an answer read after that moment to a
        request sent before it (already in the socket when the server went away) says
        nothing about after. -inf while a request sent later got no such answer (no
        connection, none in time, a 503): the server has stopped serving since."""
        return self._answered if self._answered >= self._unanswered else -math.inf

    def _note_answer(self, sent: float, status: int = 0, body: bytes = b"") -> None:
        """An exchange sent at ``sent`` was answered ``status`` with ``body`` (0: it
        failed). A watch that failed after its 200 changes nothing: ``_answered`` is
        already at least ``sent``."""
        if serving(status, body):
            self._answered = max(self._answered, sent)
        else:
            self._unanswered = max(self._unanswered, sent)

    async def keep_credentials_fresh(self) -> None:
        await self.credentials.keep_fresh()

    async def close(self) -> None:
        await self._session.close()
        await self._watch_session.close()

    async def _headers(self) -> dict[str, str]:
        """The credentials' headers; a KubeError (transient) when they cannot be had."""
        try:
            return await self.credentials.headers()
        except Exception as err:  # any loader failure; the next try may work
            raise error_from_exception(err, "Credentials") from err

    def _request_kwargs(self) -> dict[str, Any]:
        cfg = self.credentials.configuration
        kwargs: dict[str, Any] = {"ssl": self.credentials.tls}
        if cfg.proxy:
            kwargs["proxy"] = cfg.proxy
        if cfg.tls_server_name:
            kwargs["server_hostname"] = cfg.tls_server_name
        return kwargs

    def _no_answer(self, verb: str, path: str, sent: float, err: BaseException) -> KubeError:
        """An exchange sent at ``sent`` that ended without an answer, counted and noted:
        the KubeError it is."""
        self._note_answer(sent)
        count_request(verb, "error")
        if isinstance(err, aiohttp.ConnectionTimeoutError):
            # A black-holed address: no connection (or none from the pool) in time.
            return KubeError(
                ErrorKind.TRANSIENT,
                f"no connection within {self._connect_timeout:g}s",
                reason="ConnectTimeout",
            )
        if isinstance(err, (TimeoutError, aiohttp.ClientError, OSError)):
            return error_from_exception(err)
        # The boundary: all else is a KubeError too.
        watch = verb == "watch"
        metrics.ERRORS.labels("watch_request" if watch else "request").inc()
        event = "watch_failed_unexpectedly" if watch else "request_failed_unexpectedly"
        log.warning(event, verb=verb, path=path, error=type(err).__name__)
        return error_from_exception(err, "ClientError")

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
        """One request: the decoded JSON object, or a KubeError whatever went wrong.

        ``verb`` (get, list, patch, ...) labels it in the metrics; ``data`` is a serialised
        JSON body, ``body`` one to serialise; ``time_limit`` replaces the request timeout.
        One deadline covers the whole call (credentials, the one retry after a 401 with
        reloaded credentials): what is not answered by then is abandoned, its connection
        closed, so a late answer is never read."""
        if body is not None:
            data = json.dumps(body, separators=(",", ":"))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (time_limit or self._request_timeout)
        for retried in (False, True):
            version = self.credentials.version
            headers: dict[str, str] | None = None
            try:
                async with asyncio.timeout_at(deadline):
                    headers = await self._headers()
                    if data is not None:
                        headers["Content-Type"] = content_type
                    sent = time.monotonic()
                    async with self._session.request(
                        method,
                        self.host + path,
                        params=params,
                        data=data,
                        headers=headers,
                        timeout=self._timeout,
                        **self._request_kwargs(),
                    ) as reply:
                        status, payload = reply.status, await reply.read()
                        retry_after = reply.headers.get("Retry-After")
                        self._note_answer(sent, status, payload)
            except KubeError:
                raise  # the credentials could not be had
            except Exception as err:
                if headers is None:  # the deadline passed while they were being had
                    raise error_from_exception(err, "Credentials") from err
                raise self._no_answer(verb, path, sent, err) from err
            count_request(verb, status)
            if status == 401 and not retried:
                reloaded = await self.credentials.reload(version, deadline)
                if loop.time() >= deadline:
                    # A slow or hung reload (an exec plugin) used the call's time: not
                    # sent again (a leader's write could land past its fence).
                    note = " (reloading the credentials took the call's time: not sent again)"
                    raise error_from_response(status, payload, retry_after, note)
                if reloaded:
                    continue
            note = self.credentials.answered(status, version, retried)
            if status >= 300:
                raise error_from_response(status, payload, retry_after, note)
            decoded = _json_object(payload)
            if decoded is None:
                raise KubeError(
                    ErrorKind.TRANSIENT,
                    "the API server sent a body that is not a JSON object",
                    status=status,
                )
            return decoded
        raise AssertionError("unreachable")  # pragma: no cover

    async def watch(
        self,
        path: str,
        params: Mapping[str, str],
        *,
        idle_timeout: float,
        on_connected: Callable[[], None] | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        """Yield decoded watch events, one a line; ends when the server ends the stream.

        ``on_connected()`` is called once the server answered 200. Raises KubeError
        (TRANSIENT, reason ``Idle``) when nothing, not even a bookmark, arrives for
        ``idle_timeout`` seconds: a silently dead connection; (reason ``LineTooLong``) for
        a line longer than MAX_WATCH_LINE; and KubeError for anything else that goes wrong.
        """
        version = self.credentials.version
        headers = await self._headers()
        sent = time.monotonic()
        timeout = aiohttp.ClientTimeout(  # no total: a watch lasts minutes
            sock_read=idle_timeout,
            connect=self._connect_timeout,
            sock_connect=self._connect_timeout,
        )
        try:
            async with self._watch_session.get(
                self.host + path,
                params={**params, "watch": "true"},
                headers=headers,
                timeout=timeout,
                read_bufsize=MAX_WATCH_LINE // 2,  # aiohttp's line limit is twice this
                **self._request_kwargs(),
            ) as response:
                count_request("watch", response.status)
                body = await response.read() if response.status >= 300 else b""
                self._note_answer(sent, response.status, body)
                if response.status == 401:
                    await self.credentials.reload(version)  # the retry uses fresh ones
                if response.status >= 300:
                    raise error_from_response(
                        response.status, body, response.headers.get("Retry-After")
                    )
                if on_connected is not None:
                    on_connected()
                while True:
                    try:
                        line = await response.content.readline()
                    except (LineTooLong, ValueError) as err:  # ValueError: aiohttp < 3.14
                        count_request("watch", "error")
                        raise KubeError(
                            ErrorKind.TRANSIENT,
                            f"a watch line longer than {MAX_WATCH_LINE} bytes",
                            reason="LineTooLong",
                        ) from err
                    if not line:
                        break  # the end of the stream
                    if (event := _watch_event(line, path)) is not None:
                        yield event
        except KubeError:
            raise
        except Exception as err:
            connecting = isinstance(err, aiohttp.ConnectionTimeoutError)
            if isinstance(err, aiohttp.ServerTimeoutError) and not connecting:
                self._note_answer(sent)
                raise KubeError(
                    ErrorKind.TRANSIENT, f"no event for {idle_timeout}s", reason="Idle"
                ) from err
            raise self._no_answer("watch", path, sent, err) from err


def _watch_event(line: bytes, path: str) -> dict[str, Any] | None:
    """One watch line's event; None (counted and logged) for a blank line or one that is
    not a JSON object."""
    if line.isspace():
        return None
    event = _json_object(line)
    if event is None:
        metrics.ERRORS.labels("watch_decode").inc()
        log.warning("watch_line_not_an_object", path=path, size=len(line))
    return event


async def connect(settings: Settings) -> KubeClient:
    """A client with the settings' credentials (canaryd.credentials.load), timings and
    pool."""
    return KubeClient(
        await load(settings),
        request_timeout=settings.request_timeout,
        connect_timeout=settings.connect_timeout,
        keepalive_timeout=settings.keepalive_timeout,
        writes_in_flight=settings.max_bumps_in_flight,
    )
