"""Kubernetes access: the resource types canaryd names, credentials from
kubernetes-asyncio, every request and watch over aiohttp, and the one place where API
errors are classified (ErrorKind; failure_cause for people).

kubernetes-asyncio loads kubeconfig and in-cluster credentials and refreshes
service-account tokens; canaryd builds the TLS context from what it loaded. Requests
and watches go through two ``aiohttp.ClientSession``s (watches hold their connection
for minutes: a pool of their own). ``trust_env`` (a per-request proxy/netrc lookup) is
on only when a proxy is configured in the environment.

A reloaded client certificate or CA bundle makes a new TLS context: aiohttp pools
connections by context, so no request after the reload goes over a connection made
with the old one (those left idle are closed by the pool's keep-alive timeout). aiohttp
retries a request on a pooled connection the server had closed only for idempotent
methods: a PATCH whose connection failed is reported, never resent here (the
scheduler resends it identical, see canaryd.scheduler).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import math
import os
import signal
import socket
import ssl
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import quote, urlsplit

import aiohttp
import structlog
from aiohttp.http_exceptions import LineTooLong
from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio.config import kube_config
from kubernetes_asyncio.config.config_exception import ConfigException
from kubernetes_asyncio.config.exec_provider import ExecProvider

from canaryd import logs, metrics
from canaryd.backoff import Backoff

log = structlog.get_logger("canaryd.kube")

FLINK_GROUP = "flink.apache.org"
FLINK_VERSION = "v1beta1"
MERGE_PATCH = "application/merge-patch+json"
PROXY_VARIABLES = (
    "HTTPS_PROXY",
    "https_proxy",
    "HTTP_PROXY",
    "http_proxy",
    "ALL_PROXY",
    "all_proxy",
)
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


def server_url_problem(host: str) -> str | None:
    """What is wrong with a kubeconfig's cluster server, or None when it can be used."""
    try:
        parts = urlsplit(host)
        port = parts.port
    except ValueError as err:
        return f"cluster server {host!r} is not a usable URL ({err})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"cluster server {host!r} is not an http(s) URL with a host"
    if port == 0:
        return f"cluster server {host!r} has port 0"
    return None


def decode_json(data: bytes) -> Any:
    """JSON from the API server. Raises ValueError on anything that is not JSON, nested
    past the interpreter's depth included."""
    try:
        return json.loads(data)
    except RecursionError as err:
        raise ValueError(f"JSON nested too deeply: {err}") from err


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
    401: ErrorKind.TRANSIENT,
    408: ErrorKind.TRANSIENT,
    429: ErrorKind.TRANSIENT,
}


def classify_status(status: int) -> ErrorKind:
    if status >= 500:
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
    if status < 400 or status >= 500 or status == 429:
        return False
    try:
        answer = decode_json(body)
    except ValueError:
        return False
    return isinstance(answer, dict) and answer.get("kind") == "Status"


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
    try:
        decoded = decode_json(body)
    except ValueError:
        decoded = None
    answer = decoded if isinstance(decoded, dict) else {}
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
        if err.status == 401:
            return "unauthorized"
        if err.status == 403:
            return "forbidden"
        return "server_error" if err.status >= 500 or err.status == 429 else f"http_{err.status}"
    if err.reason == "Credentials":
        return "credentials"
    if err.reason == "ConnectTimeout":
        return "timeout"
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
        configuration: k8s_client.Configuration,
        *,
        request_timeout: float = 10.0,
        connect_timeout: float = 5.0,
        keepalive_timeout: float = 15.0,
        writes_in_flight: int = 256,
        reload: Any = None,
        kubeconfig: Sequence[str] = (),
    ) -> None:
        self._config = configuration
        self._reload = reload
        self._kubeconfig = tuple(kubeconfig)
        """The files ``reload`` reads: a change is a rotation too (certificate-authority-data)."""
        self.host = str(configuration.host).rstrip("/")
        self._request_timeout = request_timeout
        self._connect_timeout = min(connect_timeout, request_timeout)
        self._proxy = configuration.proxy or None
        self._timeout = aiohttp.ClientTimeout(connect=self._connect_timeout)
        """A request's own bound on its connection (the wait for the pool included); the
        whole call is bounded by its deadline (asyncio.timeout_at)."""
        self._last_authorization: str | None = None
        self._reload_lock = asyncio.Lock()
        self._reload_ok = True
        self._reload_not_before = -math.inf
        self._reload_backoff = Backoff(1.0, 30.0)
        """A failing credential plugin, or credentials refused again right after a
        reload (an authentication webhook down), is retried after 1 s, doubling to 30 s:
        a lasting 401 runs no reload per refused request."""
        self._refused_version: int | None = None
        """The credentials refused right after a reload (until a request succeeds): their
        retries refused at once are one refusal, one backoff step."""
        self._credentials_version = 0
        """Bumped by every reload: a 401 on credentials older than the current ones is
        answered by the reload that already happened (one reload per expiry)."""
        self.credentials_expiry: float | None = None
        """time.time() at which the loaded credentials expire (an exec plugin's
        expirationTimestamp), when known."""
        self._answered = -math.inf
        """time.monotonic() at which the latest request answered was sent."""
        self._unanswered = -math.inf
        """time.monotonic() at which the latest request that got no answer was sent."""
        self._tls_stamp = self._tls_files()
        self._tls: ssl.SSLContext | bool = self._ssl_context()
        trust_env = any(os.environ.get(v) for v in PROXY_VARIABLES)
        headers = {"Accept": "application/json", "User-Agent": "canaryd"}
        # Bounded: a request that cannot get a connection in time fails (ClientTimeout's
        # connect covers the wait for the pool). Bumps in flight hold at most
        # ``writes_in_flight`` connections (Settings.max_bumps_in_flight); the pool has
        # RESERVED_CONNECTIONS more, so that lists, access reviews and the lease never
        # wait behind bumps that all hang in a brownout. aiohttp hands out the idle
        # connection released first, so a burst's connections take turns and all stay
        # alive while they are reused within keepalive_timeout (Settings.keepalive_timeout).
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=writes_in_flight + RESERVED_CONNECTIONS, keepalive_timeout=keepalive_timeout
            ),
            trust_env=trust_env,
            headers=headers,
            cookie_jar=aiohttp.DummyCookieJar(),  # the API server sets none
        )
        # Watches, each holding its connection for minutes: a pool of their own with no
        # limit, so that every scope always gets one however many namespaces are watched
        # and no watch ever waits behind another, or behind a bump.
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
        failed): answered when that shows the server serving, else unanswered. Whether a
        watch that failed was answered first (its 200 came, then the stream broke) need
        not be known: then ``_answered`` is already at least ``sent``, and
        ``answered_since`` is unchanged."""
        if serving(status, body):
            self._answered = max(self._answered, sent)
        else:
            self._unanswered = max(self._unanswered, sent)

    def _tls_files(self) -> tuple[object, ...]:
        """What tells rotated TLS files (CA bundle, client certificate and key, and the
        kubeconfig, which may hold them as data): each one's path, modification time and
        size."""
        stamp: list[object] = []
        cfg = self._config
        for path in (cfg.ssl_ca_cert, cfg.cert_file, cfg.key_file, *self._kubeconfig):
            try:
                info = os.stat(path) if path else None
            except OSError:
                info = None
            stamp.append((path, info.st_mtime_ns, info.st_size) if info else (path, None))
        return tuple(stamp)

    def _ssl_context(self) -> ssl.SSLContext | bool:
        if not self.host.startswith("https"):
            return False
        cfg = self._config
        context = ssl.create_default_context(cafile=cfg.ssl_ca_cert)
        if cfg.cert_file:
            context.load_cert_chain(cfg.cert_file, keyfile=cfg.key_file)
        if not cfg.verify_ssl:
            # Only when the kubeconfig says insecure-skip-tls-verify.
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        return context

    def tls_rotated(self) -> bool:
        """Re-read the TLS files (CA bundle, client certificate and key) when they changed
        on disk: a new context, so every later request and watch opens a connection that
        presents and trusts the new ones. Returns whether they changed."""
        stamp = self._tls_files()
        if stamp == self._tls_stamp:
            return False
        try:
            context = self._ssl_context()
        except (OSError, ssl.SSLError, ValueError) as err:
            # Half-written files (a rotation in progress): the old context stays, and
            # the next look tries again.
            metrics.ERRORS.labels("credentials").inc()
            log.warning("tls_files_reload_failed", error=type(err).__name__)
            return False
        self._tls_stamp, self._tls = stamp, context
        log.info("tls_files_reloaded")
        return True

    async def close(self) -> None:
        await self._session.close()
        await self._watch_session.close()

    async def _headers(self) -> dict[str, str]:
        """The credential headers (auth_settings() calls the in-cluster token refresh
        hook). Raises KubeError (transient) when they cannot be had: that hook raises
        ConfigException ("Token file exists but empty") or FileNotFoundError while the
        kubelet rotates the token."""
        try:
            headers = {
                str(s["key"]): str(s["value"])
                for s in (await self._config.auth_settings()).values()
                if s.get("in") == "header" and s.get("value")
            }
        except Exception as err:  # any loader failure; the next try may work
            metrics.ERRORS.labels("credentials").inc()
            raise error_from_exception(err, "Credentials") from err
        authorization = headers.get("authorization")
        if authorization is not None and authorization != self._last_authorization:
            self._last_authorization = authorization
            logs.register_secret(authorization)  # a rotated token is masked in logs too
        return headers

    def _request_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"ssl": self._tls}
        if self._proxy:
            kwargs["proxy"] = self._proxy
        if self._config.tls_server_name:
            kwargs["server_hostname"] = self._config.tls_server_name
        return kwargs

    def _no_answer(self, verb: str, path: str, err: BaseException) -> KubeError:
        """An exchange that ended without an answer, counted: the KubeError it is."""
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
        """One request; returns the decoded JSON object or raises KubeError, whatever
        went wrong: this is the Kubernetes boundary.

        ``verb`` (get, list, patch, ...) labels the request in the metrics; ``data`` is
        an already serialised JSON body, ``body`` one to serialise; ``time_limit``
        replaces the request timeout (lists, a leader's writes). Whatever has not been
        answered within it is abandoned: its connection is closed, so a late answer is
        never read. One deadline covers the whole call (credentials, and the one retry
        after a 401 with reloaded credentials).
        """
        if body is not None:
            data = json.dumps(body, separators=(",", ":"))
        deadline = asyncio.get_running_loop().time() + (time_limit or self._request_timeout)
        for attempt in (1, 2):
            version = self._credentials_version
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
                self._note_answer(sent)
                raise self._no_answer(verb, path, err) from err
            count_request(verb, status)
            late = False
            if status == 401 and attempt == 1:
                reloaded = await self._reload_credentials(version, deadline)
                # A slow or hung reload (an exec plugin) used the call's time: not sent
                # again (a leader's write could land past its fence).
                late = asyncio.get_running_loop().time() >= deadline
                if reloaded and not late:
                    continue
            if status == 401 and attempt == 2 and self._refused_version != version:
                # Freshly reloaded credentials were refused too: the next reload waits
                # (an authentication webhook down would otherwise cost a reload, an exec
                # plugin run, per refused request).
                self._refused_version = version
                self._reload_not_before = time.monotonic() + self._reload_backoff.next()
            elif status < 300:
                self._reload_backoff.reset()
                self._refused_version = None
            if status >= 300:
                again = status == 401 and self._refused_version is not None
                note = " (also after reloading the credentials)" if again else ""
                if late:
                    note = " (reloading the credentials took the call's time: not sent again)"
                raise error_from_response(status, payload, retry_after, note)
            try:
                decoded = decode_json(payload)
            except ValueError as err:
                raise KubeError(
                    ErrorKind.TRANSIENT,
                    "the API server sent a body that is not JSON",
                    status=status,
                ) from err
            if not isinstance(decoded, dict):
                raise KubeError(
                    ErrorKind.TRANSIENT,
                    "the API server sent JSON that is not an object",
                    status=status,
                )
            return decoded
        raise AssertionError("unreachable")  # pragma: no cover

    async def _reload_credentials(
        self, version: int | None = None, deadline: float | None = None
    ) -> bool:
        """Re-read the kubeconfig (an exec plugin's token expired, a certificate was
        rotated). ``version``: the credentials a refused request was sent with; when a
        reload has happened since, that one answers it (100 requests refused at once
        make one reload, not 100 runs of an exec plugin). Within ``deadline`` (the
        call's; else the request timeout): a reload still running then fails (its exec
        plugin killed), and a wait for another's ends."""
        if self._reload is None:
            return False
        if deadline is None:
            deadline = asyncio.get_running_loop().time() + self._request_timeout
        try:
            async with asyncio.timeout_at(deadline), self._reload_lock:
                if version is not None and version != self._credentials_version:
                    return self._reload_ok  # a reload since answers this request too
                if time.monotonic() < self._reload_not_before:
                    return False  # the last reload failed, or was refused: backing off
                try:
                    loaded = await self._reload(self._config)
                # Cancelled: at the deadline, or at shutdown (then cancelled on).
                except (Exception, asyncio.CancelledError) as err:
                    metrics.ERRORS.labels("credentials").inc()
                    delay = self._reload_backoff.next()
                    self._reload_not_before = time.monotonic() + delay
                    self._credentials_version += 1  # the waiters have their answer: no
                    self._reload_ok = False
                    log.warning(
                        "credentials_reload_failed",
                        error=type(err).__name__,
                        retry_in=round(delay, 3),
                    )
                    if isinstance(err, asyncio.CancelledError):
                        raise
                    return False
                self._credentials_version += 1
                self._reload_ok = True
                self.note_credentials(loaded)
                self.tls_rotated()
                return True
        except TimeoutError:
            return False  # the request is answered by what refused it

    def note_credentials(self, loader: Any) -> None:
        """What the kubeconfig loader tells of the credentials' lifetime."""
        expiry = getattr(loader, "exec_plugin_expiry", None)
        self.credentials_expiry = expiry.timestamp() if isinstance(expiry, datetime) else None

    def next_refresh_in(self, now: float) -> float | None:
        """Seconds until the credentials should be renewed: at 80 % of an exec token's
        remaining lifetime (at least 1 s); every minute where TLS files (a CA bundle, a
        client certificate: in-cluster ``ca.crt`` too) may be rotated on disk; None when
        nothing expires."""
        if self._reload is not None and self.credentials_expiry is not None:
            return max(1.0, 0.8 * (self.credentials_expiry - now))
        cfg = self._config
        if isinstance(self._tls, ssl.SSLContext) and (cfg.ssl_ca_cert or cfg.cert_file):
            return 60.0
        return None

    async def keep_credentials_fresh(self) -> None:
        """Long-lived: renew credentials before they expire, not only after a 401, and
        pick up TLS files rotated on disk."""
        try:
            while True:
                delay = self.next_refresh_in(time.time())
                if delay is None:
                    await asyncio.Event().wait()  # nothing expires: until cancelled
                    continue
                await asyncio.sleep(delay)
                if self._reload is not None and (
                    self.credentials_expiry or self._tls_files() != self._tls_stamp
                ):
                    await self._reload_credentials()
                else:
                    self.tls_rotated()
        except asyncio.CancelledError:
            log.info("credential_refresher_stopped", why="cancelled")
            raise

    async def watch(
        self,
        path: str,
        params: Mapping[str, str],
        *,
        idle_timeout: float,
        on_connected: Any = None,
    ) -> AsyncIterator[dict[str, Any]]:
        """Yield decoded watch events, one a line; ends when the server ends the stream.

        ``on_connected()`` is called once the server answered 200. Raises KubeError
        (TRANSIENT, reason ``Idle``) when nothing, not even a bookmark, arrives for
        ``idle_timeout`` seconds: a silently dead connection; (reason ``LineTooLong``) for
        a line longer than MAX_WATCH_LINE; and KubeError for anything else that goes wrong.
        """
        version = self._credentials_version
        headers = await self._headers()
        sent = time.monotonic()
        timeout = aiohttp.ClientTimeout(
            total=None,
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
                    await self._reload_credentials(version)  # the retry uses fresh ones
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
            self._note_answer(sent)
            connecting = isinstance(err, aiohttp.ConnectionTimeoutError)
            if isinstance(err, aiohttp.ServerTimeoutError) and not connecting:
                raise KubeError(
                    ErrorKind.TRANSIENT, f"no event for {idle_timeout}s", reason="Idle"
                ) from err
            raise self._no_answer("watch", path, err) from err


def _watch_event(line: bytes, path: str) -> dict[str, Any] | None:
    """One watch line's event; None (counted and logged) for a blank line or one that is
    not a JSON object."""
    if line.isspace():
        return None
    try:
        event = decode_json(line)
    except ValueError:
        metrics.ERRORS.labels("watch_decode").inc()
        log.warning("watch_line_not_json", path=path, size=len(line))
        return None
    if isinstance(event, dict):
        return event
    metrics.ERRORS.labels("watch_decode").inc()
    log.warning("watch_line_not_an_object", path=path)
    return None


# --------------------------------------------------------------- credentials


class _ExecProvider(ExecProvider):
    """kubernetes-asyncio's exec credential plugin run (kube_config's, replaced below),
    with the plugin in a process group of its own that is killed and reaped when the run
    ends otherwise than by the plugin's exit: cancelled at its call's deadline or at
    shutdown. A hung plugin, or a command it started, outlives neither."""

    async def run(self, previous_response: str | None = None) -> Any:
        spec = {"interactive": False}  # a daemon: no terminal, nothing typed in
        info = {"apiVersion": self.api_version, "kind": "ExecCredential", "spec": spec}
        process = await asyncio.create_subprocess_exec(
            *self.args,
            env={**self.env, "KUBERNETES_EXEC_INFO": json.dumps(info)},
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        try:
            out, err = await process.communicate()
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
            raise
        if process.returncode:
            said = err.decode("utf-8", "replace").strip()
            raise ConfigException(f"exec: process returned {process.returncode}. {said}")
        answer = decode_json(out)  # ValueError: a failed reload too
        if not isinstance(answer, dict) or answer.get("apiVersion") != self.api_version:
            raise ConfigException(f"exec: not an ExecCredential of {self.api_version}")
        if not isinstance(answer.get("status"), dict):
            raise ConfigException("exec: an ExecCredential without a status")
        return answer["status"]


kube_config.ExecProvider = _ExecProvider  # type: ignore[attr-defined]


def kubeconfig_path(kubeconfig: str | None) -> str:
    """The kubeconfig kubectl would read: the given one, else ~/.kube/config."""
    return kubeconfig or os.path.expanduser("~/.kube/config")


def kubeconfig_files(value: str) -> list[str]:
    """The files of a kubeconfig value: several separated by ':' (';' on Windows), as
    KUBECONFIG lists them; kubectl merges them, and kubernetes-asyncio's loader does
    too (KubeConfigMerger: the first file to name a cluster, user or context wins)."""
    return [os.path.expanduser(path) for path in value.split(os.pathsep) if path]


async def load_configuration(
    kubeconfig: str | None, context: str | None
) -> tuple[k8s_client.Configuration, Any, Any]:
    """Credentials as kubectl finds them; returns the configuration, a reload function
    and the loader (what it knows of the credentials' lifetime).

    In-cluster when no kubeconfig is given and KUBERNETES_SERVICE_HOST is set (its token
    is re-read by kubernetes-asyncio's refresh hook), else the kubeconfig.
    """
    configuration = k8s_client.Configuration()
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        k8s_config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        return configuration, None, None
    path = kubeconfig_path(kubeconfig)

    async def reload(target: k8s_client.Configuration) -> Any:
        return await k8s_config.load_kube_config(
            config_file=path, context=context, client_configuration=target, persist_config=False
        )

    loader = await reload(configuration)
    return configuration, reload, loader
