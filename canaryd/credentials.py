"""Where the Kubernetes credentials come from, and their first load: the client's start.

The kubeconfig kubectl would read (several files separated by ':' as KUBECONFIG lists
them, else ~/.kube/config), read here once for a clear error, its context and whether an
exec plugin gives the credentials; or, with no kubeconfig given and
KUBERNETES_SERVICE_HOST set, the in-cluster service account (its token re-read by
kubernetes-asyncio's refresh hook). kubernetes-asyncio loads them and merges the files
(the first to name a cluster, user or context wins); its exec plugin run is replaced by
one that a deadline or a shutdown ends (``_ExecProvider``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml
from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio.config import kube_config
from kubernetes_asyncio.config.config_exception import ConfigException
from kubernetes_asyncio.config.exec_provider import ExecProvider

from canaryd import logs, metrics
from canaryd.config import ConfigError, Settings
from canaryd.kube import KubeClient, Reload, decode_json

IN_CLUSTER = "in-cluster service account"


class CredentialsError(ConfigError):
    """Credentials not loaded: ``canaryd check`` exits 2; the daemon tries again."""


@dataclass(frozen=True)
class Source:
    """Where the credentials come from: the kubeconfig (its value and files) or
    IN_CLUSTER; the context; whether an exec plugin gives them (it may fail or hang
    for a while: the daemon loads them once its health server runs)."""

    where: str
    context: str | None
    files: tuple[str, ...] = ()
    plugin: bool = False


def kubeconfig_path(kubeconfig: str | None) -> str:
    """The kubeconfig kubectl would read: the given one, else ~/.kube/config."""
    return kubeconfig or os.path.expanduser("~/.kube/config")


def source(settings: Settings) -> Source:
    """The settings' credentials. The kubeconfig's files are each checked: one that is
    unreadable or not a mapping, or none there at all, is a ``ConfigError`` of one clear
    line, not the loader's internals ("list indices must be integers", a NoneType). The
    context is the given one, else the current context kubectl would use: the first
    file's that sets one (kubernetes-asyncio's merge takes the last file's)."""
    if settings.kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        return Source(IN_CLUSTER, settings.context)
    where = kubeconfig_path(settings.kubeconfig)
    files = [os.path.expanduser(path) for path in where.split(os.pathsep) if path]
    present = [path for path in files if Path(path).exists()]
    if not present:
        raise ConfigError(
            f"no kubeconfig at {' or '.join(files) or repr(where)}: pass --kubeconfig or "
            "set KUBECONFIG (in a pod, canaryd uses its service account)"
        )
    current = None
    named: dict[str, dict[str, dict[str, Any]]] = {"contexts": {}, "users": {}}
    for path in present:
        data = _read(path)
        if current is None and data.get("current-context"):
            current = str(data["current-context"])
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


def runs_a_plugin(settings: Settings) -> bool:
    """Whether an exec plugin gives the credentials (retried at start:
    ``Daemon._connect``); any other kubeconfig or the in-cluster account that cannot be
    loaded is bad configuration (exit 2 before anything runs)."""
    return source(settings).plugin


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


async def load_configuration(
    kubeconfig: str | None, context: str | None
) -> tuple[k8s_client.Configuration, Reload | None, Any]:
    """Credentials as kubectl finds them; returns the configuration, a reload function
    (None in-cluster) and the loader (what it knows of the credentials' lifetime)."""
    configuration = k8s_client.Configuration()
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        k8s_config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        return configuration, None, None
    path = kubeconfig_path(kubeconfig)

    async def reload(target: k8s_client.Configuration) -> Any:
        return await k8s_config.load_kube_config(
            config_file=path, context=context, client_configuration=target, persist_config=False
        )

    return configuration, reload, await reload(configuration)


async def connect(settings: Settings) -> KubeClient:
    """A client with the settings' credentials, timings and pool. Credentials not loaded
    within the request timeout (an exec plugin still running then is killed and reaped)
    are a ``CredentialsError``; a kubeconfig missing, bad, or with a cluster server that
    is no URL, a ``ConfigError``."""
    found = source(settings)
    try:
        async with asyncio.timeout(settings.request_timeout) as bound:
            configuration, reload, loader = await load_configuration(
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
    problem = server_url_problem(str(configuration.host or ""))
    if problem is not None:
        raise ConfigError(f"kubeconfig {found.where}: {problem}")
    logs.register_secret(configuration.api_key.get("BearerToken"))
    kube = KubeClient(
        configuration,
        request_timeout=settings.request_timeout,
        connect_timeout=settings.connect_timeout,
        keepalive_timeout=settings.keepalive_timeout,
        writes_in_flight=settings.max_bumps_in_flight,
        reload=reload,
        kubeconfig=found.files,
    )
    kube.credentials.note(loader)
    return kube


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
