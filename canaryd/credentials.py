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
from collections.abc import Awaitable, Callable, Sequence
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
Reload = Callable[[k8s_client.Configuration], Awaitable[float | None]]
"""Loads the credentials into a configuration again; returns when (time.time()) an exec
plugin's token expires."""


class CredentialsError(ConfigError):
    """Credentials not loaded: ``canaryd check`` exits 2; the daemon tries again."""


@dataclass(frozen=True)
class Source:
    """The kubeconfig (its value, its files) or IN_CLUSTER; the context; an exec plugin?"""

    where: str
    context: str | None
    files: tuple[str, ...] = ()
    plugin: bool = False


def _in_cluster(kubeconfig: str | None) -> bool:
    return kubeconfig is None and bool(os.environ.get("KUBERNETES_SERVICE_HOST"))


def source(settings: Settings) -> Source:
    """The kubeconfig read once (a bad one is a ConfigError of one line, not the loader's
    internals); the context given, else the first file's (kubectl's; the loader's is the
    last's)."""
    if _in_cluster(settings.kubeconfig):
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


async def load_configuration(
    kubeconfig: str | None, context: str | None
) -> tuple[k8s_client.Configuration, Reload | None, float | None]:
    configuration = k8s_client.Configuration()
    if _in_cluster(kubeconfig):
        k8s_config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        return configuration, None, None
    path = kubeconfig or KUBECONFIG

    async def reload(target: k8s_client.Configuration) -> float | None:
        loader = await k8s_config.load_kube_config(
            config_file=path, context=context, client_configuration=target, persist_config=False
        )
        expiry = getattr(loader, "exec_plugin_expiry", None)
        return expiry.timestamp() if isinstance(expiry, datetime) else None

    return configuration, reload, await reload(configuration)


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


class Credentials:
    """The headers and TLS context requests carry (aiohttp pools connections by context:
    a new one means new connections)."""

    def __init__(
        self,
        configuration: k8s_client.Configuration | None = None,
        reload: Reload | None = None,
        timeout: float = 10.0,
    ) -> None:
        self._timeout = timeout
        self.version = 0  # bumped by every reload
        self._lock = asyncio.Lock()
        self._reload_ok = True
        self._not_before = -math.inf
        # After a reload that failed, or whose credentials were refused: 1 s, doubling.
        self._backoff = Backoff(1.0, 30.0)
        self._fresh: int | None = None  # the version a reload for a 401 made, until refused
        self._refused = False  # fresh credentials refused too, until a success
        self._use(configuration or k8s_client.Configuration(), reload, (), None)

    def _use(
        self,
        configuration: k8s_client.Configuration,
        reload: Reload | None,
        files: Sequence[str],
        expiry: float | None,
    ) -> None:
        self.configuration = configuration
        self._reload = reload
        self._files = tuple(files)
        self.expiry = expiry  # time.time() an exec plugin's token expires
        logs.register_secret(configuration.api_key.get("BearerToken"))
        self._stamp = self._tls_files()
        self.tls = self._ssl_context()

    async def load(self, settings: Settings) -> None:
        """The first load, before any request: a CredentialsError when not loaded within
        the request timeout; a ConfigError for a bad kubeconfig or cluster server."""
        found = source(settings)
        try:
            async with asyncio.timeout(settings.request_timeout) as bound:
                configuration, reload, expiry = await load_configuration(
                    settings.kubeconfig, found.context
                )
        except Exception as err:  # any loader failure
            metrics.ERRORS.labels("credentials").inc()
            detail = logs.scrub(str(err)) or type(err).__name__
            if bound.expired():
                detail = f"not loaded within the request timeout ({settings.request_timeout:g}s)"
            raise CredentialsError(
                f"cannot load Kubernetes credentials ({found.where}): {detail}"
            ) from err
        host = str(configuration.host or "")
        try:
            parts = urlsplit(host)
            usable = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
            problem = "not an http(s) URL with a host (and a port other than 0)"
        except ValueError as err:  # a port out of range, a malformed IPv6 address
            usable, problem = False, f"not a usable URL ({err})"
        if not usable:
            raise ConfigError(f"kubeconfig {found.where}: cluster server {host!r} is {problem}")
        self._use(configuration, reload, found.files, expiry)

    async def headers(self) -> dict[str, str]:
        try:
            headers = {
                str(s["key"]): str(s["value"])
                for s in (await self.configuration.auth_settings()).values()
                if s.get("in") == "header" and s.get("value")
            }
        except Exception:  # the in-cluster refresh hook, while the kubelet rotates the token
            metrics.ERRORS.labels("credentials").inc()
            raise
        logs.register_secret(headers.get("authorization"))  # a rotated one is masked too
        return headers

    async def answered(
        self, status: int, version: int, deadline: float | None = None, reload: bool = True
    ) -> str | None:
        """An answer (a request's, a watch's) to credentials of ``version``: a success
        resets the backoff; fresh credentials refused too step it once per ``version``; a
        401 reloads them (unless not ``reload``). What a 401 adds; None when a request
        (one with a ``deadline``) is to be sent again with fresh ones."""
        if status < 300:
            self._backoff.reset()
            self._fresh, self._refused = None, False
        elif status == 401 and version == self._fresh:
            self._fresh, self._refused = None, True
            self._not_before = time.monotonic() + self._backoff.next()
        again = status == 401 and self._refused
        note = " (also after reloading the credentials)" if again else ""
        if status == 401 and reload:
            reloaded = await self.reload(version, deadline)
            if deadline is not None and asyncio.get_running_loop().time() >= deadline:
                # A slow or hung reload (an exec plugin) used the call's time: not
                # sent again (a leader's write could land past its fence).
                return " (reloading the credentials took the call's time: not sent again)"
            if reloaded and deadline is not None:
                return None
        return note

    async def reload(self, version: int | None = None, deadline: float | None = None) -> bool:
        """Whether fresh credentials are there. A reload since ``version`` (the refused
        request's) answers it too; one still running at ``deadline`` (loop time, else the
        request timeout's) fails."""
        if self._reload is None:
            return False
        if deadline is None:
            deadline = asyncio.get_running_loop().time() + self._timeout
        try:
            async with asyncio.timeout_at(deadline), self._lock:
                if version is not None and version != self.version:
                    return self._reload_ok
                if time.monotonic() < self._not_before:
                    return False  # the last reload failed, or was refused: backing off
                self._reload_ok = False
                try:
                    expiry = await self._reload(self.configuration)
                # Cancelled: at the deadline, or at shutdown (then cancelled on).
                except (Exception, asyncio.CancelledError) as err:
                    metrics.ERRORS.labels("credentials").inc()
                    delay = self._backoff.next()
                    self._not_before = time.monotonic() + delay
                    error = type(err).__name__
                    log.warning("credentials_reload_failed", error=error, retry_in=round(delay, 3))
                    if isinstance(err, asyncio.CancelledError):
                        raise
                else:
                    self._reload_ok = True
                    self._fresh = None if version is None else self.version + 1
                    self.expiry = expiry
                    self.tls_rotated()
                finally:
                    self.version += 1  # the waiters have their answer
                return self._reload_ok
        except TimeoutError:
            return False  # the request is answered by what refused it

    def next_refresh_in(self, now: float) -> float | None:
        """At 80 % of an exec token's remaining lifetime (at least 1 s); every minute for
        TLS files; None when nothing expires."""
        if self._reload is not None and self.expiry is not None:
            return max(1.0, 0.8 * (self.expiry - now))
        cfg = self.configuration
        if isinstance(self.tls, ssl.SSLContext) and (cfg.ssl_ca_cert or cfg.cert_file):
            return 60.0
        return None

    async def keep_fresh(self) -> None:
        try:
            while True:
                delay = self.next_refresh_in(time.time())
                await asyncio.sleep(math.inf if delay is None else delay)  # None: nothing expires
                if self._reload is not None and (self.expiry or self._tls_files() != self._stamp):
                    await self.reload()
                else:
                    self.tls_rotated()
        except asyncio.CancelledError:
            log.info("credential_refresher_stopped", why="cancelled")
            raise

    def _tls_files(self) -> tuple[object, ...]:
        stamp: list[object] = []
        cfg = self.configuration
        for path in (cfg.ssl_ca_cert, cfg.cert_file, cfg.key_file, *self._files):
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

    def tls_rotated(self) -> None:
        stamp = self._tls_files()
        if stamp == self._stamp:
            return
        try:
            context = self._ssl_context()
        except (OSError, ssl.SSLError, ValueError) as err:
            # Half-written files (a rotation in progress): the next look tries again.
            metrics.ERRORS.labels("credentials").inc()
            log.warning("tls_files_reload_failed", error=type(err).__name__)
            return
        self._stamp, self.tls = stamp, context
        log.info("tls_files_reloaded")
