"""A small kubelet: the shipped manifests' probes, run against real processes.

What it reads comes from the rendered manifests (``kubectl kustomize``; without
kubectl, the subset of kustomize that config/ uses: resources, components, patches
as strategic merges, namespace, images): per container its args, env, ports, volume
mounts, and its liveness, readiness and startup probes with ``periodSeconds``,
``timeoutSeconds``, ``failureThreshold``, ``successThreshold`` and
``initialDelaySeconds`` (Kubernetes' defaults where unset). Probes are ``httpGet``, or
``exec`` of a bash script that talks to a port of the pod through ``/dev/tcp`` (the
sidecar's operator liveness, config/sidecar).

What it does is the kubelet's (pkg/kubelet/prober/worker.go, kuberuntime's
doBackOff): each probe runs on its own ticker from the container's start; a startup
probe gates liveness and readiness until it succeeds; ``failureThreshold`` failures
in a row of liveness (or startup) kill the container (SIGTERM, SIGKILL after the
grace period) and it is restarted (restartPolicy Always) after the CrashLoopBackOff
delay (10 s doubling to 5 min, forgotten after 10 min); readiness only marks the
container NotReady. An HTTP probe succeeds on a status from 200 to 399 within its
timeout, on a new connection each time; an exec probe on exit status 0 within its
timeout (a timed-out exec probe is a failure, as the kubelet has counted it since
1.20), whether or not the port it talks to is listening.

Time is scaled: canaryd's cycle is shortened and every period, delay, threshold
window, grace period and backoff is multiplied by the same factor, so their ratios
to the cycle are the shipped ones. Two things are this machine's and are not
scaled: how fast a process answers (a probe's or a scrape's timeout, and the grace
period, are at least ``ANSWER_FLOOR``) and how long a Python process takes to start
(about a second: two shipped minutes at 1/120). So a container's probes start once
its process accepts connections on its first port, and a probe addressed to another
container of the pod that is (re)starting waits until it listens; a process that
does not listen within ``START_WITHIN`` fails the test. At shipped scale an answer
takes milliseconds and a start-up a second or two, a small part of any probe's
budget, so neither floor changes which process is restarted; they do stretch a
restart's gap in the recorded scrapes (the gap is real seconds, scaled up).

A pod's network namespace is a port map: every declared containerPort maps to a
free port on 127.0.0.1, and a probe or a process addresses another container's port
through it. Volumes are directories; a path under a mount in a container's args is
rewritten into its volume's directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import math
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from canaryd.config.parse import parse_duration
from canaryd.testing.process import free_port
from tests.harness import until_poked

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "config"
KUBECTL = shutil.which("kubectl")

ANSWER_FLOOR = 0.5
"""Seconds: the least time a probe or a scrape gives a process to answer, whatever the
scale (a probe's 2 s at 1/120 is 17 ms, which a loaded 2-core machine does not
guarantee even to a process that is fine)."""
START_WITHIN = 30.0
"""Seconds a container's process has to accept connections after it was started."""

# Kubernetes' defaults (k8s.io/api core/v1 Probe, PodSpec) and the kubelet's
# CrashLoopBackOff (pkg/kubelet/kubelet.go: backOffPeriod, MaxContainerBackOff).
PERIOD, TIMEOUT, FAILURE_THRESHOLD, SUCCESS_THRESHOLD = 10.0, 1.0, 3, 1
GRACE = 30.0
BACKOFF_INITIAL, BACKOFF_MAX = 10.0, 300.0


# ------------------------------------------------------------------ rendering


def docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def render(directory: Path) -> list[dict[str, Any]]:
    """The kustomization's output: kubectl's when present, else ``kustomize``'s below."""
    if KUBECTL:
        out = subprocess.run(
            [KUBECTL, "kustomize", str(directory)],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        return [d for d in yaml.safe_load_all(out) if d]
    return kustomize(directory)


def kustomize(directory: Path) -> list[dict[str, Any]]:
    """The subset of kustomize that config/ uses, for machines without kubectl."""
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    objects: list[dict[str, Any]] = []
    for entry in spec.get("resources", []):
        path = directory / entry
        objects += kustomize(path) if path.is_dir() else docs(path)
    for entry in spec.get("components", []):
        objects = with_component(objects, directory / entry)
    objects = patched(objects, directory)
    namespace = spec.get("namespace")
    for obj in objects:  # before the replacements, as kustomize: they may set one
        if namespace and obj["kind"] not in CLUSTER_SCOPED:
            obj["metadata"]["namespace"] = namespace
    objects = replaced(objects, directory)
    for obj in objects:
        for image in spec.get("images", []):
            for container in pod_template(obj).get("containers", []):
                name, _, _ = str(container.get("image", "")).partition(":")
                if name == image["name"]:
                    tag = image.get("newTag")
                    container["image"] = f"{image.get('newName', name)}" + (
                        f":{tag}" if tag else ""
                    )
    return objects


CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"}


def kustomize_resources(directory: Path) -> list[dict[str, Any]]:
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    return [d for entry in spec.get("resources", []) for d in docs(directory / entry)]


def with_component(objects: list[dict[str, Any]], directory: Path) -> list[dict[str, Any]]:
    """A component: its resources and its own components added, then its patches and
    replacements applied to everything so far."""
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    objects = objects + kustomize_resources(directory)
    for entry in spec.get("components", []):
        objects = with_component(objects, directory / entry)
    return replaced(patched(objects, directory), directory)


def replaced(objects: list[dict[str, Any]], directory: Path) -> list[dict[str, Any]]:
    """kustomize's replacements as config/ uses them: a source field by kind and name
    into target fields (a ``[name=X]`` step picks a list item by name), each whole or
    as one ``delimiter``-separated part (``index``)."""
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())

    def select(obj: dict[str, Any], selector: Mapping[str, Any]) -> bool:
        return obj["kind"] == selector["kind"] and obj["metadata"]["name"] == selector["name"]

    def steps(path: str) -> list[str]:
        return re.findall(r"\[[^\]]*\]|[^.\[\]]+", path)

    def walk(obj: Any, path: list[str]) -> Any:
        for step in path:
            if step.startswith("[name="):
                obj = next(item for item in obj if item.get("name") == step[6:-1])
            else:
                obj = obj[int(step) if isinstance(obj, list) else step]
        return obj

    def parents(obj: Any, path: list[str]) -> list[Any]:
        """The objects a field path's last step is in: a ``*`` step takes every list
        item that has the rest of the path (kustomize's wildcard)."""
        if "*" not in path:
            return [walk(obj, path)]
        at = path.index("*")
        found = []
        for item in walk(obj, path[:at]):
            with contextlib.suppress(KeyError, TypeError, StopIteration):
                found += parents(item, path[at + 1 :])
        return found

    for replacement in spec.get("replacements", []):
        source = replacement["source"]
        (origin,) = [o for o in objects if select(o, source)]
        value = walk(origin, steps(source["fieldPath"]))
        if "options" in source:
            value = str(value).split(source["options"]["delimiter"])[source["options"]["index"]]
        for target in replacement["targets"]:
            for obj in (o for o in objects if select(o, target["select"])):
                for field_path in target["fieldPaths"]:
                    *parent_path, key = steps(field_path)
                    for parent in parents(obj, parent_path):
                        if "*" in parent_path and key not in parent:
                            continue  # a wildcard's item without the field
                        last: Any = int(key) if isinstance(parent, list) else key
                        options = target.get("options", {})
                        if "delimiter" in options:
                            parts = str(parent[last]).split(options["delimiter"])
                            parts[options["index"]] = value
                            parent[last] = options["delimiter"].join(parts)
                        else:
                            parent[last] = value
    # Objects annotated as local configuration are the kustomization's, not output.
    local = "config.kubernetes.io/local-config"
    return [o for o in objects if o["metadata"].get("annotations", {}).get(local) != "true"]


def patched(objects: list[dict[str, Any]], directory: Path) -> list[dict[str, Any]]:
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    for entry in spec.get("patches", []):
        target = entry.get("target", {})
        for patch in docs(directory / entry["path"]):
            kind = target.get("kind", patch["kind"])
            name = target.get("name", patch["metadata"]["name"])
            objects = [
                strategic_merge(obj, patch)
                if obj["kind"] == kind and obj["metadata"]["name"] == name
                else obj
                for obj in objects
            ]
    return objects


def strategic_merge(base: Any, patch: Any) -> Any:
    """A strategic merge patch as the manifests here need it: maps merge, lists of
    named objects (containers, env, ports, volumes, mounts) merge by name, any other
    list (args, command) is replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = copy.deepcopy(base)
        for key, value in patch.items():
            if value is None:
                merged.pop(key, None)
            else:
                merged[key] = strategic_merge(base[key], value) if key in base else value
        return merged
    if (
        isinstance(base, list)
        and isinstance(patch, list)
        and all(isinstance(item, dict) and "name" in item for item in base + patch)
    ):
        merged_list = [copy.deepcopy(item) for item in base]
        index = {item["name"]: i for i, item in enumerate(merged_list)}
        for item in patch:
            if item["name"] in index:
                i = index[item["name"]]
                merged_list[i] = strategic_merge(merged_list[i], item)
            else:
                merged_list.append(copy.deepcopy(item))
        return merged_list
    return copy.deepcopy(patch)


def pod_template(obj: Mapping[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = obj.get("spec", {}).get("template", {}).get("spec", {})
    return spec


# ---------------------------------------------------------------- pod specs


@dataclass(frozen=True)
class ProbeSpec:
    """A probe as the manifest declares it (seconds, unscaled), with Kubernetes'
    defaults where a field is unset."""

    kind: str
    path: str
    """An HTTP probe's path; an exec probe's bash script."""
    port: int | str
    """An HTTP probe's port; the port an exec probe's script opens with /dev/tcp."""
    period: float = PERIOD
    timeout: float = TIMEOUT
    failure_threshold: int = FAILURE_THRESHOLD
    success_threshold: int = SUCCESS_THRESHOLD
    initial_delay: float = 0.0
    exec: bool = False

    @classmethod
    def parse(cls, kind: str, probe: Mapping[str, Any]) -> ProbeSpec:
        http, exec_ = probe.get("httpGet"), probe.get("exec")
        if exec_ is not None:
            command = exec_["command"]
            assert command[:2] == ["bash", "-c"] and len(command) == 3, (
                f"{kind} probe {command}: only `bash -c SCRIPT` is modelled here"
            )
            ports = re.findall(r"/dev/tcp/127\.0\.0\.1/(\d+)", command[2])
            assert len(set(ports)) == 1, f"{kind} probe: one /dev/tcp port, not {ports}"
            path, port, is_exec = str(command[2]), int(ports[0]), True
        else:
            assert http is not None, f"{kind} probe {probe}: httpGet or exec only"
            path, port, is_exec = str(http.get("path", "/")), http["port"], False
        return cls(
            kind=kind,
            path=path,
            port=port,
            exec=is_exec,
            period=float(probe.get("periodSeconds", PERIOD)),
            timeout=float(probe.get("timeoutSeconds", TIMEOUT)),
            failure_threshold=int(probe.get("failureThreshold", FAILURE_THRESHOLD)),
            success_threshold=int(probe.get("successThreshold", SUCCESS_THRESHOLD)),
            initial_delay=float(probe.get("initialDelaySeconds", 0)),
        )


@dataclass(frozen=True)
class ContainerSpec:
    name: str
    image: str
    args: tuple[str, ...]
    env: tuple[Mapping[str, Any], ...]
    ports: Mapping[str, int]
    """Named container ports (an unnamed one under its number as a string)."""
    mounts: Mapping[str, str]
    """mountPath -> volume name."""
    probes: Mapping[str, ProbeSpec]
    """By kind: liveness, readiness, startup (only those declared)."""

    def port(self, port: int | str) -> int:
        """A probe's port: a name is looked up in this container's own ports."""
        if isinstance(port, int):
            return port
        if port.isdigit():
            return int(port)
        assert port in self.ports, f"container {self.name} declares no port named {port!r}"
        return self.ports[port]

    def flag(self, flag: str) -> str | None:
        for i, arg in enumerate(self.args):
            if arg.startswith(f"{flag}="):
                return arg.split("=", 1)[1]
            if arg == flag and i + 1 < len(self.args):
                return self.args[i + 1]
        return None


@dataclass(frozen=True)
class PodSpec:
    name: str
    namespace: str
    labels: Mapping[str, str]
    containers: tuple[ContainerSpec, ...]
    volumes: Mapping[str, Mapping[str, Any]]
    grace: float
    service_env: Mapping[str, str] = field(default_factory=dict)
    """The Services' environment variables the kubelet sets in every container
    (``enableServiceLinks``, on unless the pod turns it off)."""

    def container(self, name: str) -> ContainerSpec:
        return next(c for c in self.containers if c.name == name)


SERVICE_IP = "10.0.0.10"
"""The cluster IP a Service gets here (nothing is sent to it)."""


def service_links(objects: Sequence[Mapping[str, Any]], namespace: str | None) -> dict[str, str]:
    """The kubelet's environment variables for the Services of a namespace
    (pkg/kubelet/envvars: NAME_SERVICE_HOST, NAME_SERVICE_PORT, and the Docker links
    NAME_PORT=tcp://IP:PORT, NAME_PORT_PORT_TCP, ...), NAME the Service's name in upper
    case with - as _."""
    env: dict[str, str] = {}
    for service in objects:
        if service["kind"] != "Service" or service["metadata"].get("namespace") != namespace:
            continue
        if service["spec"].get("clusterIP") == "None":
            continue
        name = service["metadata"]["name"].upper().replace("-", "_")
        ports = service["spec"].get("ports") or []
        if not ports:
            continue
        env[f"{name}_SERVICE_HOST"] = SERVICE_IP
        env[f"{name}_SERVICE_PORT"] = str(ports[0]["port"])
        for port in ports:
            if port.get("name"):
                port_name = port["name"].upper().replace("-", "_")
                env[f"{name}_SERVICE_PORT_{port_name}"] = str(port["port"])
        env[f"{name}_PORT"] = f"tcp://{SERVICE_IP}:{ports[0]['port']}"
        for port in ports:
            protocol = port.get("protocol", "TCP")
            prefix = f"{name}_PORT_{port['port']}_{protocol}"
            env[prefix] = f"{protocol.lower()}://{SERVICE_IP}:{port['port']}"
            env[f"{prefix}_PROTO"] = protocol.lower()
            env[f"{prefix}_PORT"] = str(port["port"])
            env[f"{prefix}_ADDR"] = SERVICE_IP
    return env


def pods(objects: Sequence[Mapping[str, Any]]) -> list[PodSpec]:
    """One PodSpec per replica of every Deployment: NAME-0, NAME-1, ..."""
    found = []
    for obj in objects:
        if obj["kind"] != "Deployment":
            continue
        template = obj["spec"]["template"]
        spec = template["spec"]
        links = spec.get("enableServiceLinks", True)
        containers = tuple(
            ContainerSpec(
                name=c["name"],
                image=c.get("image", ""),
                args=tuple(str(a) for a in c.get("args", [])),
                env=tuple(c.get("env", [])),
                ports={
                    str(p.get("name", p["containerPort"])): p["containerPort"]
                    for p in c.get("ports", [])
                },
                mounts={m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])},
                probes={
                    kind: ProbeSpec.parse(kind, c[f"{kind}Probe"])
                    for kind in ("startup", "liveness", "readiness")
                    if f"{kind}Probe" in c
                },
            )
            for c in spec["containers"]
        )
        for replica in range(int(obj["spec"].get("replicas", 1))):
            found.append(
                PodSpec(
                    name=f"{obj['metadata']['name']}-{replica}",
                    namespace=obj["metadata"].get("namespace", "default"),
                    labels=template["metadata"].get("labels", {}),
                    containers=containers,
                    volumes={v["name"]: v for v in spec.get("volumes", [])},
                    grace=float(spec.get("terminationGracePeriodSeconds", GRACE)),
                    service_env=(
                        service_links(objects, obj["metadata"].get("namespace")) if links else {}
                    ),
                )
            )
    return found


# ------------------------------------------------------------- time scaling


@dataclass(frozen=True)
class Scale:
    """Shipped seconds -> seconds here: ``factor`` = the test's cycle / the shipped one."""

    factor: float

    def __call__(self, shipped: float) -> float:
        return shipped * self.factor

    def answer(self, shipped_timeout: float) -> float:
        """A timeout for an answer: scaled, but never below ``ANSWER_FLOOR``."""
        return max(self(shipped_timeout), ANSWER_FLOOR)

    def shipped(self, here: float) -> float:
        return here / self.factor


# -------------------------------------------------------- running containers


@dataclass
class Command:
    argv: list[str]
    env: dict[str, str]


class PodHost:
    """What a pod's containers share here: the port map, the volumes, the identity."""

    def __init__(
        self,
        spec: PodSpec,
        workdir: Path,
        config_maps: Callable[[PodHost], Mapping[str, Mapping[str, str]]],
        kubeconfig: Path,
    ) -> None:
        self.spec = spec
        self.workdir = workdir
        self.kubeconfig = kubeconfig
        """The pod's service account, as a kubeconfig (its token is the pod's user)."""
        self.net = {port: free_port() for c in spec.containers for port in c.ports.values()}
        self.volumes: dict[str, Path] = {}
        maps = config_maps(self) if any("configMap" in v for v in spec.volumes.values()) else {}
        for name, volume in spec.volumes.items():
            path = workdir / "volumes" / name
            path.mkdir(parents=True, exist_ok=True)
            if "configMap" in volume:
                data = maps.get(volume["configMap"]["name"])
                assert data is not None, f"no ConfigMap {volume['configMap']['name']} given"
                items = volume["configMap"].get("items") or [{"key": k, "path": k} for k in data]
                for item in items:
                    (path / item["path"]).write_text(data.get(item["key"], ""))
            self.volumes[name] = path

    def port(self, container_port: int) -> int:
        """The local port of a container port of this pod."""
        assert container_port in self.net, (
            f"pod {self.spec.name} declares no containerPort {container_port}"
        )
        return self.net[container_port]

    def path(self, container: ContainerSpec, value: str) -> str:
        """A path as the container sees it, in its volume's directory here."""
        for mount, volume in sorted(container.mounts.items(), key=lambda m: -len(m[0])):
            if value == mount or value.startswith(mount.rstrip("/") + "/"):
                return str(self.volumes[volume]) + value[len(mount.rstrip("/")) :]
        return value

    def env(self, container: ContainerSpec) -> dict[str, str]:
        """The container's environment: the Services' variables (service links), then
        the manifest's (values, and the downward API's metadata.name /
        metadata.namespace), which win."""
        fields = {"metadata.name": self.spec.name, "metadata.namespace": self.spec.namespace}
        env: dict[str, str] = dict(self.spec.service_env)
        for entry in container.env:
            if "value" in entry:
                env[entry["name"]] = str(entry["value"])
            else:
                path = entry["valueFrom"]["fieldRef"]["fieldPath"]
                assert path in fields, f"{entry['name']}: fieldRef {path} not modelled"
                env[entry["name"]] = fields[path]
        return env


Launch = Callable[[ContainerSpec, PodHost], Command | None]
"""How a container's image runs here: its command line and environment (None: its
image cannot be pulled, so the container never runs: ErrImagePull, ImagePullBackOff)."""


def canaryd_launch(scale: Scale) -> Launch:
    """canaryd's image: ``canaryd`` with the manifest's args and env; the cycle
    (``--timeout``, the only timing in the shipped args) scaled, the port and paths
    mapped, the kubeconfig in place of the service account."""

    def launch(container: ContainerSpec, host: PodHost) -> Command:
        args = []
        for arg in container.args:
            flag, eq, value = arg.partition("=")
            if flag == "--timeout" and eq:
                arg = f"--timeout={scale(parse_duration(value))}s"
            elif flag == "--port" and eq:
                arg = f"--port={host.port(int(value))}"
            elif eq:
                arg = f"{flag}={host.path(container, value)}"
            args.append(arg)
        env = {
            **os.environ,
            **host.env(container),
            "KUBECONFIG": str(host.kubeconfig),
            "CANARYD_HOST": "127.0.0.1",
            "PYTHONUNBUFFERED": "1",
        }
        # canaryd's default port, the image's 8085, unless the environment sets one (a
        # Service link named CANARYD_PORT does: canaryd reads it as its port).
        if container.flag("--port") is None and "CANARYD_PORT" not in host.env(container):
            env["CANARYD_PORT"] = str(host.port(next(iter(container.ports.values()))))
        return Command([sys.executable, "-m", "canaryd", *args], env)

    return launch


@dataclass
class Event:
    at: float
    pod: str
    container: str
    what: str
    detail: str = ""


@dataclass
class ContainerRun:
    """One container of a running pod, across its restarts."""

    pod: PodHost
    spec: ContainerSpec
    log: Path
    restarts: int = 0
    reasons: list[str] = field(default_factory=list)
    ready: bool = False
    not_ready_episodes: int = 0
    """Ready -> NotReady transitions (readiness never restarts anything)."""
    started: bool = False
    listening: bool = False
    """Its process accepts connections (it is not starting, nor gone)."""
    proc: asyncio.subprocess.Process | None = None
    running_since: float | None = None
    kill: asyncio.Future[str] | None = None
    task: asyncio.Task[None] | None = None


class Kubelet:
    """Runs pods: their containers' processes, probes and restarts (see the module)."""

    def __init__(
        self,
        scale: Scale,
        launchers: Mapping[str, Launch],
        workdir: Path,
        service_account: Callable[[PodSpec, Path], Path],
        config_maps: Callable[[PodHost], Mapping[str, Mapping[str, str]]] = lambda host: {},
    ) -> None:
        self.scale = scale
        self.launchers = launchers
        self.workdir = workdir
        self.service_account = service_account
        """Writes a pod's kubeconfig into the directory given and returns its path."""
        self.config_maps = config_maps
        """The ConfigMaps a pod's volumes name, per pod: a port in them is the pod's own
        (``PodHost.port``)."""
        self.pods: dict[str, PodHost] = {}
        self.containers: dict[tuple[str, str], ContainerRun] = {}
        self.deleted: list[ContainerRun] = []
        """Containers of deleted pods."""
        self.events: list[Event] = []
        self.listeners: list[Callable[[], None]] = []
        self._http: aiohttp.ClientSession | None = None
        self._loop = asyncio.get_running_loop()

    # ------------------------------------------------------------ lifecycle

    @contextlib.asynccontextmanager
    async def running(self, specs: Sequence[PodSpec]) -> AsyncIterator[Kubelet]:
        # A new connection per probe, as the kubelet's HTTP prober does.
        self._http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
        try:
            for spec in specs:
                self.start_pod(spec)
            yield self
        finally:
            for key in list(self.containers):
                await self._stop_container(self.containers[key])
            await self._http.close()

    def start_pod(self, spec: PodSpec) -> PodHost:
        workdir = self.workdir / spec.name
        workdir.mkdir(parents=True, exist_ok=True)
        host = PodHost(spec, workdir, self.config_maps, self.service_account(spec, workdir))
        self.pods[spec.name] = host
        for container in spec.containers:
            assert container.name in self.launchers, f"no way to run container {container.name}"
            run = ContainerRun(host, container, self.workdir / spec.name / f"{container.name}.log")
            self.containers[(spec.name, container.name)] = run
            run.task = asyncio.create_task(
                self._supervise(run), name=f"kubelet {spec.name}/{container.name}"
            )
        return host

    async def delete_pod(self, name: str) -> None:
        """The pod is deleted (a drain, a rolling update): every container gets SIGTERM
        and, after the grace period, SIGKILL. Not a restart."""
        for key in [k for k in self.containers if k[0] == name]:
            run = self.containers.pop(key)
            await self._stop_container(run)
            self.deleted.append(run)
        del self.pods[name]
        self._note(name, "", "deleted")

    async def _stop_container(self, run: ContainerRun) -> None:
        if run.task is not None:
            run.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await run.task
        if run.proc is not None and run.proc.returncode is None:
            await self._terminate(run)

    def container(self, pod: str, name: str) -> ContainerRun:
        return self.containers[(pod, name)]

    def _note(self, pod: str, container: str, what: str, detail: str = "") -> None:
        self.events.append(Event(self._loop.time(), pod, container, what, detail))
        self.poke()

    def poke(self) -> None:
        """Something changed: re-check what ``until`` waits for."""
        for listener in list(self.listeners):
            listener()

    async def until(self, predicate: Callable[[], bool], what: str, within: float) -> None:
        """Wait until ``predicate()`` holds, re-checked at every kubelet event."""
        await until_poked(predicate, what, within, self.listeners, prefix="kubelet: ")

    # ------------------------------------------------------- one container

    async def _supervise(self, run: ContainerRun) -> None:
        """Start, probe, kill and restart one container for as long as its pod runs."""
        pod, name = run.pod.spec.name, run.spec.name
        backoff: float | None = None
        backoff_since = -math.inf
        if self.launchers[name](run.spec, run.pod) is None:
            self._note(pod, name, "waiting", "ImagePullBackOff")
            await asyncio.get_running_loop().create_future()  # until the pod goes
        while True:
            await self._start(run)
            run.kill = self._loop.create_future()
            exited = asyncio.ensure_future(run.proc.wait())  # type: ignore[union-attr]
            probes = [
                asyncio.create_task(self._probe(run, probe), name=f"{probe.kind} {pod}/{name}")
                for probe in run.spec.probes.values()
            ]
            try:
                await asyncio.wait({exited, run.kill}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in probes:
                    task.cancel()
                await asyncio.gather(*probes, return_exceptions=True)
            if run.kill.done():
                why = run.kill.result()
                exited.cancel()
                await self._terminate(run)
            else:
                why = f"exited with status {exited.result()}"
            run.listening = False
            finished = self._loop.time()
            run.restarts += 1
            run.reasons.append(why)
            self._set_ready(run, False)
            self._note(pod, name, "restart", why)
            # kuberuntime doBackOff: the first restart is immediate, then 10 s doubling
            # up to 5 min, counted from when the container finished; forgotten after
            # twice the maximum without a restart.
            if backoff is None or finished - backoff_since > self.scale(2 * BACKOFF_MAX):
                delay, backoff = 0.0, self.scale(BACKOFF_INITIAL)
            else:
                delay, backoff = backoff, min(2 * backoff, self.scale(BACKOFF_MAX))
            backoff_since = finished
            await asyncio.sleep(delay)  # CrashLoopBackOff: a clock, not synchronisation

    async def _start(self, run: ContainerRun) -> None:
        command = self.launchers[run.spec.name](run.spec, run.pod)
        assert command is not None
        with run.log.open("ab") as log:
            run.proc = await asyncio.create_subprocess_exec(
                *command.argv,
                env=command.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                start_new_session=True,
            )
        run.started = "startup" not in run.spec.probes
        first_port = next(iter(run.spec.ports.values()), None)
        if first_port is not None:
            await self._until_listening(run, run.pod.port(first_port))
        run.running_since = self._loop.time()
        run.listening = run.proc.returncode is None
        self._note(run.pod.spec.name, run.spec.name, "running", f"pid {run.proc.pid}")

    async def _until_listening(self, run: ContainerRun, port: int) -> None:
        """Bounded: the process accepts connections on its first port."""
        assert run.proc is not None
        deadline = self._loop.time() + START_WITHIN
        while True:
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                if run.proc.returncode is not None:
                    return  # exited: _supervise sees it and restarts it
                if self._loop.time() > deadline:
                    raise AssertionError(
                        f"{run.pod.spec.name}/{run.spec.name} did not listen on {port} within "
                        f"{START_WITHIN}s: {self.tail(run)}"
                    ) from None
                await asyncio.sleep(0.02)  # bounded poll: the kernel has no event for it
            else:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
                return

    async def _terminate(self, run: ContainerRun) -> None:
        """SIGTERM, then SIGKILL after the pod's grace period (scaled)."""
        proc = run.proc
        assert proc is not None
        if proc.returncode is None:
            # A wedged (stopped) process does not act on it: SIGKILL ends it.
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(self.scale.answer(run.pod.spec.grace)):
                    await proc.wait()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()

    def _set_ready(self, run: ContainerRun, ready: bool) -> None:
        if run.ready and not ready:
            run.not_ready_episodes += 1
        if run.ready != ready:
            run.ready = ready
            self._note(run.pod.spec.name, run.spec.name, "ready" if ready else "not ready")

    # -------------------------------------------------------------- probes

    async def _probe(self, run: ContainerRun, probe: ProbeSpec) -> None:
        """prober/worker.go for one probe of one container incarnation."""
        period = self.scale(probe.period)
        if probe.kind != "startup":
            await self.until(lambda: run.started, "startup", math.inf)
        assert run.running_since is not None
        container_port = run.spec.port(probe.port)
        url = f"http://127.0.0.1:{run.pod.port(container_port)}{probe.path}"
        owner = self._owner(run.pod, container_port)
        failures = successes = 0
        tick = self._loop.time()
        while True:
            # A probe addressed to a container whose process is starting waits until it
            # listens: start-up is not scaled (see the module), and at shipped scale it
            # is a small part of one probe period. Not when no process runs there (its
            # image not pulled, an exit waiting out its back-off): the kubelet's probe
            # meets connection refused. Nor an exec probe: what it does when nothing
            # listens is what it is there to decide.
            def starting() -> bool:
                return (
                    not owner.listening
                    and owner.proc is not None
                    and owner.proc.returncode is None
                    and not probe.exec
                )

            if starting():
                await self.until(lambda: not starting(), f"{owner.spec.name} to listen", math.inf)
            # A probe is skipped (as a success) until initialDelaySeconds have passed
            # since the container started.
            if self._loop.time() - run.running_since >= self.scale(probe.initial_delay):
                if probe.exec:
                    ok, detail = await self._exec(run, probe, container_port)
                else:
                    ok, detail = await self._http_get(url, self.scale.answer(probe.timeout))
                failures, successes = (0, successes + 1) if ok else (failures + 1, 0)
                if probe.kind == "readiness":
                    if ok and successes >= probe.success_threshold:
                        self._set_ready(run, True)
                    elif not ok and failures >= probe.failure_threshold:
                        self._set_ready(run, False)
                elif ok and probe.kind == "startup":
                    run.started = True
                    self._note(run.pod.spec.name, run.spec.name, "started")
                    return
                elif not ok and failures >= probe.failure_threshold:
                    assert run.kill is not None
                    if not run.kill.done():
                        run.kill.set_result(
                            f"{probe.kind} probe failed {failures}x: "
                            f"{'exec' if probe.exec else probe.path} {detail}"
                        )
                    return
            # Go's ticker: a probe that ran past its next tick starts the next one at once
            # (one tick is kept), and the period runs on from there.
            tick = max(tick + period, self._loop.time())
            await asyncio.sleep(tick - self._loop.time())  # the probe period: a clock

    def _owner(self, pod: PodHost, container_port: int) -> ContainerRun:
        """The container of the pod that declares this port."""
        for container in pod.spec.containers:
            if container_port in container.ports.values():
                return self.containers[(pod.spec.name, container.name)]
        raise AssertionError(f"pod {pod.spec.name} declares no containerPort {container_port}")

    async def _exec(
        self, run: ContainerRun, probe: ProbeSpec, container_port: int
    ) -> tuple[bool, str]:
        """An exec probe: its script with bash, its /dev/tcp port the pod's, and its
        own ``timeout N`` bounds scaled as the probe's timeout is (floored at
        ``ANSWER_FLOOR``, the kubelet's timeout kept in the same ratio above them)."""
        local = run.pod.port(container_port)
        script = probe.path.replace(
            f"/dev/tcp/127.0.0.1/{container_port}", f"/dev/tcp/127.0.0.1/{local}"
        )
        within = self.scale.answer(probe.timeout)
        for bound in {int(b) for b in re.findall(r"\btimeout (\d+)\b", script)}:
            scaled = self.scale.answer(bound)
            within = max(within, scaled * probe.timeout / bound)
            script = re.sub(rf"\btimeout {bound}\b", f"timeout {scaled:.3f}", script)
        process = await asyncio.create_subprocess_exec(
            "bash",
            "-c",
            script,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            async with asyncio.timeout(within):
                status = await process.wait()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
            return False, "timeout"
        return status == 0, f"exit status {status}"

    async def _http_get(self, url: str, within: float) -> tuple[bool, str]:
        assert self._http is not None
        try:
            async with asyncio.timeout(within), self._http.get(url) as response:
                await response.read()
                return 200 <= response.status < 400, str(response.status)
        except TimeoutError:
            return False, "timeout"
        except aiohttp.ClientError as err:
            return False, type(err).__name__

    # -------------------------------------------------------------- reading

    def tail(self, run: ContainerRun, lines: int = 15) -> str:
        try:
            return "\n".join(run.log.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no output)"

    def signal(self, pod: str, container: str, signum: int) -> None:
        """Send the container's process a signal (a fault it models on one)."""
        run = self.container(pod, container)
        assert run.proc is not None and run.proc.returncode is None
        run.proc.send_signal(signum)
        self._note(pod, container, "signal", signal.Signals(signum).name)

    @contextlib.contextmanager
    def frozen(self, pod: str, container: str) -> Iterator[None]:
        """The container's process stops answering (SIGSTOP): a wedged process."""
        run = self.container(pod, container)
        assert run.proc is not None and run.proc.returncode is None
        os.killpg(run.proc.pid, signal.SIGSTOP)
        self._note(pod, container, "frozen")
        try:
            yield
        finally:
            if run.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(run.proc.pid, signal.SIGCONT)


# -------------------------------------------------------- Prometheus' scrape


@dataclass(frozen=True)
class Target:
    """A scrape target with the labels Prometheus Operator gives its samples."""

    pod: str
    container: str
    port: int
    labels: tuple[tuple[str, str], ...]


@dataclass
class Scrape:
    at: float
    target: Target
    ok: bool
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]

    def value(self, name: str, **labels: str) -> float | None:
        """The first sample of ``name`` that carries these labels (None: none)."""
        want = set(labels.items())
        for (sample, sample_labels), value in self.samples.items():
            if sample == name and want <= set(sample_labels):
                return value
        return None


@dataclass
class Recording:
    """/metrics scrapes of every target on the scaled scrape interval, with marks of
    what the scenario did when."""

    scale: Scale
    interval: float
    """The monitor's scrape interval, shipped seconds."""
    start: float
    scrapes: list[Scrape] = field(default_factory=list)
    marks: dict[str, float] = field(default_factory=dict)

    def shipped(self, at: float) -> float:
        """Loop time -> shipped seconds since the recording started."""
        return self.scale.shipped(at - self.start)


def monitor_targets(
    pod: PodSpec, monitor: Mapping[str, Any], objects: Sequence[Mapping[str, Any]]
) -> list[tuple[str, int, dict[str, str]]]:
    """(container, container port, target labels) that a ServiceMonitor or PodMonitor of
    config/monitoring scrapes in this pod, with the labels Prometheus Operator gives
    them (job: the Service's name, or NAMESPACE/NAME of the PodMonitor)."""
    selector = monitor["spec"]["selector"]["matchLabels"]
    ports: list[tuple[str, str]] = []  # (endpoint port, container port name)
    if monitor["kind"] == "ServiceMonitor":
        for service in (o for o in objects if o["kind"] == "Service"):
            if selector.items() <= service["metadata"].get("labels", {}).items() and (
                service["spec"]["selector"].items() <= pod.labels.items()
            ):
                job = service["metadata"]["name"]
                for endpoint in monitor["spec"]["endpoints"]:
                    port = next(
                        p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]
                    )
                    ports.append((endpoint["port"], str(port["targetPort"])))
    elif selector.items() <= pod.labels.items():
        job = f"{pod.namespace}/{monitor['metadata']['name']}"
        ports = [(e["port"], e["port"]) for e in monitor["spec"]["podMetricsEndpoints"]]
    found = []
    for endpoint, port_name in ports:
        for container in pod.containers:
            if port_name in container.ports:
                labels = {
                    "job": job,
                    "namespace": pod.namespace,
                    "pod": pod.name,
                    "container": container.name,
                    "endpoint": endpoint,
                }
                found.append((container.name, container.ports[port_name], labels))
    return found


SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$")
LABEL_PAIR = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus text format -> {(name, sorted labels): value}."""
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = SAMPLE.match(line)
        assert match, f"not a sample line: {line!r}"
        labels = tuple(sorted(LABEL_PAIR.findall(match.group(3) or "")))
        samples[(match.group(1), labels)] = float(match.group(4))
    return samples


class Scraper:
    """Prometheus: scrapes every target on the scaled interval (each scrape is stamped
    with its tick, as Prometheus stamps the scrape's start)."""

    def __init__(
        self, kubelet: Kubelet, monitor: Mapping[str, Any], objects: Sequence[Mapping[str, Any]]
    ) -> None:
        self.kubelet = kubelet
        self.monitor = monitor
        self.objects = objects
        endpoints = monitor["spec"].get("endpoints") or monitor["spec"]["podMetricsEndpoints"]
        interval = parse_duration(endpoints[0]["interval"])
        self.recording = Recording(kubelet.scale, interval, asyncio.get_running_loop().time())
        self.latest: dict[str, Scrape] = {}
        """Per pod, its latest scrape that answered."""
        self._task: asyncio.Task[None] | None = None

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Scraper]:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
            self._task = asyncio.create_task(self._run(http), name="prometheus")
            try:
                yield self
            finally:
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task

    def mark(self, name: str) -> None:
        self.recording.marks[name] = asyncio.get_running_loop().time()

    async def _run(self, http: aiohttp.ClientSession) -> None:
        loop = asyncio.get_running_loop()
        period = self.kubelet.scale(self.recording.interval)
        tick = self.recording.start
        pending: set[asyncio.Task[None]] = set()
        try:
            while True:
                for host in list(self.kubelet.pods.values()):
                    for container, port, labels in monitor_targets(
                        host.spec, self.monitor, self.objects
                    ):
                        target = Target(
                            host.spec.name,
                            container,
                            port,
                            tuple(
                                sorted(
                                    {**labels, "instance": f"127.0.0.1:{host.port(port)}"}.items()
                                )
                            ),
                        )
                        task = asyncio.create_task(self._scrape(http, target, host, tick))
                        pending.add(task)
                        task.add_done_callback(pending.discard)
                tick += period
                await asyncio.sleep(max(0.0, tick - loop.time()))  # the scrape interval
        finally:
            for task in pending:
                task.cancel()

    async def _scrape(
        self, http: aiohttp.ClientSession, target: Target, host: PodHost, tick: float
    ) -> None:
        # Prometheus' scrape timeout (10 s) is shorter than its interval; scaled, it is
        # floored like a probe's (ANSWER_FLOOR), and scrapes may overlap.
        url = f"http://127.0.0.1:{host.port(target.port)}/metrics"
        samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        try:
            async with asyncio.timeout(self.kubelet.scale.answer(10.0)), http.get(url) as response:
                ok = response.status == 200
                if ok:
                    samples = parse_metrics(await response.text())
        except (TimeoutError, aiohttp.ClientError):
            ok = False
        scrape = Scrape(tick, target, ok, samples)
        self.recording.scrapes.append(scrape)
        if ok and (target.pod not in self.latest or self.latest[target.pod].at <= tick):
            self.latest[target.pod] = scrape
        self.kubelet.poke()

    def value(self, pod: str, name: str, **labels: str) -> float | None:
        """A sample of the pod's latest answered scrape (None: not there)."""
        scrape = self.latest.get(pod)
        return None if scrape is None else scrape.value(name, **labels)

    async def until(self, predicate: Callable[[], bool], what: str, within: float) -> None:
        await self.kubelet.until(predicate, what, within)


# ------------------------------------------------------------------ the table


@dataclass(frozen=True)
class Row:
    topology: str
    scenario: str
    container: str
    restarts: int
    why: list[str]
    not_ready: int


RESTARTS: list[Row] = []
"""Every scenario's restarts, printed at the end of the session (tests/conftest.py)."""


def restarts_table() -> str:
    lines = [
        "| topology | scenario | pod/container | restarts | NotReady | why |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in RESTARTS:
        why = "; ".join(row.why) or "-"
        lines.append(
            f"| {row.topology} | {row.scenario} | {row.container} | {row.restarts} "
            f"| {row.not_ready} | {why} |"
        )
    return "\n".join(lines)
