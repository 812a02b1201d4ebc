"""Kubernetes credentials: loaded by kubernetes-asyncio as kubectl finds them, carried
by requests, reloaded as docs/DEVELOPMENT.md (How it works) tells."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import ssl
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import structlog
import yaml
from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio.config import kube_config
from kubernetes_asyncio.config.config_exception import ConfigException
from kubernetes_asyncio.config.exec_provider import ExecProvider

from canaryd import logs, metrics
from canaryd.backoff import Backoff
from canaryd.config import ConfigError, Settings

log = structlog.get_logger("canaryd.credentials")

IN_CLUSTER = "in-cluster service account"
KUBECONFIG = "~/.kube/config"  # kubectl's without --kubeconfig or KUBECONFIG


class CredentialsError(ConfigError):
    """Credentials not loaded: ``canaryd check`` exits 2; the daemon tries again."""


@dataclass(frozen=True)
class Source:
    """The kubeconfig (its value, its files) or IN_CLUSTER; the context; an exec plugin?"""

    where: str
    context: str | None
    files: tuple[str, ...] = ()
    plugin: bool = False


def source(settings: Settings) -> Source:
    """The kubeconfig read once (a bad one is a ConfigError of one line, not the loader's
    internals); the context given, else the first file's (kubectl's; the loader's is the
    last's)."""
    if settings.kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        return Source(IN_CLUSTER, settings.context)
    where = settings.kubeconfig or KUBECONFIG
    files = [os.path.expanduser(path) for path in where.split(os.pathsep) if path]
    loaded = [_read(path) for path in files if Path(path).exists()]
    if not loaded:
        raise ConfigError(
            f"no kubeconfig at {' or '.join(files) or repr(where)}: pass --kubeconfig or "
            "set KUBECONFIG (in a pod, canaryd uses its service account)"
        )
    current = next((str(d["current-context"]) for d in loaded if d.get("current-context")), None)
    named: dict[str, dict[str, dict[str, Any]]] = {"contexts": {}, "users": {}}
    for data in loaded:
        for section, found in named.items():
            items = data.get(section)
            for item in items if isinstance(items, list) else []:
                if isinstance(item, dict) and isinstance(item.get(section[:-1]), dict):
                    found.setdefault(str(item.get("name")), item[section[:-1]])
    context = settings.context or current
    user = named["contexts"].get(str(context), {}).get("user")
    plugin = "exec" in named["users"].get(str(user), {})
    return Source(where, context, tuple(files), plugin)


def _read(path: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read kubeconfig {path}: {err}") from err
    except yaml.YAMLError as err:
        raise ConfigError(f"kubeconfig {path} is not valid YAML") from err
    if not isinstance(data, dict):
        shown = "empty" if data is None else f"a YAML {type(data).__name__}"
        raise ConfigError(
            f"kubeconfig {path} is {shown}, not a kubeconfig (a mapping with clusters, "
            "users, contexts and current-context)"
        )
    return data


async def _load(found: Source) -> tuple[k8s_client.Configuration, float | None]:
    """A configuration loaded from ``found``; when (time.time()) an exec plugin's token
    expires."""
    configuration = k8s_client.Configuration()
    if found.where == IN_CLUSTER:
        k8s_config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        return configuration, None
    loader = await k8s_config.load_kube_config(
        config_file=found.where,
        context=found.context,
        client_configuration=configuration,
        persist_config=False,
    )
    expiry = getattr(loader, "exec_plugin_expiry", None)
    return configuration, expiry.timestamp() if isinstance(expiry, datetime) else None


class _ExecProvider(ExecProvider):
    """kubernetes-asyncio's plugin run, with no terminal, the plugin's process group
    killed and reaped when the run is cancelled (its call's deadline, a shutdown)."""

    async def run(self, previous_response: str | None = None) -> Any:
        spec = {"interactive": False}
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
        answer = json.loads(out)  # ValueError, RecursionError: a failed reload too
        if not isinstance(answer, dict) or answer.get("apiVersion") != self.api_version:
            raise ConfigException(f"exec: not an ExecCredential of {self.api_version}")
        if not isinstance(answer.get("status"), dict):
            raise ConfigException("exec: an ExecCredential without a status")
        return answer["status"]


kube_config.ExecProvider = _ExecProvider  # type: ignore[attr-defined]


def _check_server(found: Source, configuration: k8s_client.Configuration) -> None:
    """A ConfigError unless the cluster server is an http(s) URL with a host."""
    host = str(configuration.host or "")
    try:
        parts = urlsplit(host)
        usable = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
        problem = "not an http(s) URL with a host (and a port other than 0)"
    except ValueError as err:  # a port out of range, a malformed IPv6 address
        usable, problem = False, f"not a usable URL ({err})"
    if not usable:
        raise ConfigError(f"kubeconfig {found.where}: cluster server {host!r} is {problem}")


class Credentials:
    """The headers and TLS context requests carry (aiohttp pools connections by context:
    a new one means new connections), reloaded as docs/DEVELOPMENT.md tells."""

    LOOK = 60.0
    """Seconds between looks for rotated TLS files or kubeconfig."""

    def __init__(
        self, configuration: k8s_client.Configuration | None = None, timeout: float = 10.0
    ) -> None:
        self._timeout = timeout
        self._source: Source | None = None  # None: not loaded, nothing to reload
        self.version = 0  # bumped by every reload that loaded credentials
        self._lock = asyncio.Lock()  # one reload at a time: it answers every waiter
        self._backoff = Backoff(1.0, 30.0)  # a step per reload, reset by an answer
        self._not_before = -math.inf  # no reload before: the last one's backoff step
        self._stamp: tuple[object, ...] | None = None  # the TLS context's files, as seen
        self._use(configuration or k8s_client.Configuration(), None)

    def _use(self, configuration: k8s_client.Configuration, expiry: float | None) -> None:
        """Credentials loaded; a new TLS context when a file it is made of changed."""
        self.configuration = configuration
        self.expiry = expiry  # time.time() an exec plugin's token expires
        logs.register_secret(configuration.api_key.get("BearerToken"))
        stamp = self._tls_files()
        if stamp == self._stamp:
            return
        try:
            self.tls = self._ssl_context()
        except (OSError, ssl.SSLError, ValueError) as err:
            if not self.version:  # the first load: no context to go on with
                raise
            # Half-written files (a rotation in progress): the next look tries again.
            metrics.ERRORS.labels("credentials").inc()
            log.warning("tls_files_reload_failed", error=type(err).__name__)
            return
        if self.version:
            log.info("tls_files_reloaded")
        self._stamp = stamp

    async def load(self, settings: Settings) -> None:
        """The first load, before any request: a CredentialsError when not loaded within
        the request timeout; a ConfigError for a bad kubeconfig or cluster server."""
        found = source(settings)
        try:
            async with asyncio.timeout(settings.request_timeout) as bound:
                configuration, expiry = await _load(found)
        except Exception as err:  # any loader failure
            metrics.ERRORS.labels("credentials").inc()
            detail = logs.scrub(str(err)) or type(err).__name__
            if bound.expired():
                detail = f"not loaded within the request timeout ({settings.request_timeout:g}s)"
            raise CredentialsError(
                f"cannot load Kubernetes credentials ({found.where}): {detail}"
            ) from err
        _check_server(found, configuration)
        self._source = found
        self._use(configuration, expiry)

    async def headers(self) -> dict[str, str]:
        """What requests carry; the in-cluster refresh hook raises while the kubelet
        rotates the token."""
        headers = {
            str(s["key"]): str(s["value"])
            for s in (await self.configuration.auth_settings()).values()
            if s.get("in") == "header" and s.get("value")
        }
        logs.register_secret(headers.get("authorization"))  # a rotated one is masked too
        return headers

    async def answered(
        self, status: int, version: int, deadline: float | None = None, reload: bool = True
    ) -> str | None:
        """An answer (a request's, a watch's) to credentials of ``version``: a success
        resets the reload backoff; a 401 reloads them (unless not ``reload``). What a 401
        adds; None when a request (one with a ``deadline``) is to be sent again with fresh
        ones."""
        if status < 300:
            self._backoff.reset()
        reloaded = False
        if status == 401 and reload:
            reloaded = await self.reload(version, deadline)
            if deadline is not None and asyncio.get_running_loop().time() >= deadline:
                # A slow or hung reload (an exec plugin) used the call's time: not
                # sent again (a leader's write could land past its fence).
                return " (reloading the credentials took the call's time: not sent again)"
            if reloaded and deadline is not None:
                return None
        refused_again = status == 401 and version and not reloaded  # none newer to try
        return " (also after reloading the credentials)" if refused_again else ""

    async def reload(self, version: int, deadline: float | None = None) -> bool:
        """Whether credentials newer than ``version`` (the refused request's) are there: a
        reload since answers it too; none while the last one's backoff step lasts. One
        still running at ``deadline`` (loop time, else the request timeout's) fails."""
        if self._source is None:
            return False
        if deadline is None:
            deadline = asyncio.get_running_loop().time() + self._timeout
        with contextlib.suppress(TimeoutError):  # answered by what refused the request
            async with asyncio.timeout_at(deadline), self._lock:
                if version == self.version and time.monotonic() >= self._not_before:
                    await self._reload(self._source)
        return version != self.version

    async def _reload(self, found: Source) -> None:
        delay = self._backoff.next()
        try:
            configuration, expiry = await _load(found)
            _check_server(found, configuration)  # an edit that broke it: the old ones kept
        # Cancelled: at the deadline, or at shutdown (then cancelled on).
        except (Exception, asyncio.CancelledError) as err:
            metrics.ERRORS.labels("credentials").inc()
            log.warning(
                "credentials_reload_failed", error=type(err).__name__, retry_in=round(delay, 3)
            )
            if isinstance(err, asyncio.CancelledError):
                raise
        else:
            self.version += 1
            self._use(configuration, expiry)
        finally:
            self._not_before = time.monotonic() + delay

    async def keep_fresh(self) -> None:
        """Reloads an exec plugin's token at 80 % of its remaining lifetime (at least 1 s
        on), and the credentials when a TLS file or the kubeconfig changed (a look every
        minute, a long-lived token's renewal or not)."""
        try:
            renew_at = self._renewal()
            while True:
                await asyncio.sleep(min(self.LOOK, max(0.0, renew_at - time.monotonic())))
                if time.monotonic() >= renew_at or self._tls_files() != self._stamp:
                    await self.reload(self.version)
                    renew_at = self._renewal()
        except asyncio.CancelledError:
            log.info("credential_refresher_stopped", why="cancelled")
            raise

    def _renewal(self) -> float:
        """When (time.monotonic(): a step of the wall clock moves nothing) to renew the
        token: at 80 % of its remaining lifetime."""
        if self.expiry is None:
            return math.inf
        return time.monotonic() + max(1.0, 0.8 * (self.expiry - time.time()))

    def _tls_files(self) -> tuple[object, ...]:
        stamp: list[object] = []
        cfg = self.configuration
        files = self._source.files if self._source else ()
        for path in (cfg.ssl_ca_cert, cfg.cert_file, cfg.key_file, *files):
            try:
                info = os.stat(path) if path else None
            except OSError:
                info = None
            stamp.append((path, info.st_mtime_ns, info.st_size) if info else (path, None))
        return tuple(stamp)

    def _ssl_context(self) -> ssl.SSLContext | bool:
        cfg = self.configuration
        if not str(cfg.host).startswith("https"):
            return False
        context = ssl.create_default_context(cafile=cfg.ssl_ca_cert)
        if cfg.cert_file:
            context.load_cert_chain(cfg.cert_file, keyfile=cfg.key_file)
        if not cfg.verify_ssl:  # the kubeconfig says insecure-skip-tls-verify
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        return context
