"""The upstream Flink Kubernetes Operator as a process of its own, for `make e2e-operator`.

Built by `make operator` (tests/operator/build.sh) into .cache/operator/<ref>-flink<v>:
the shaded operator jar, flink-kubernetes-standalone, the metric reporter plugins,
log4j's SLF4J binding (the image's operator-lib) and the Helm chart. It runs as the
chart's image runs it: `java -cp ... FlinkOperator` with FLINK_CONF_DIR holding a
config.yaml, FLINK_PLUGINS_DIR, and a kubeconfig. It needs no Flink cluster: canaries
are reconciled without one.

Test infrastructure only; nothing of the operator is kept in this repository.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
REF = os.environ.get("FLINK_OPERATOR_REF", "release-1.15.0")
FLINK = os.environ.get("FLINK_VERSION", "1.20.0")
PROM = "org.apache.flink.metrics.prometheus.PrometheusReporterFactory"
NAMESPACE = "flink-operator"
"""Where the operator's ServiceAccount lives (its own namespace, as with the chart)."""


def build_dir() -> Path:
    """Where `make operator` put the build (CANARYD_OPERATOR_DIR wins, as in build.sh)."""
    found = os.environ.get("CANARYD_OPERATOR_DIR")
    return Path(found) if found else ROOT / ".cache" / "operator" / f"{REF}-flink{FLINK}"


def built() -> str | None:
    """Why the operator cannot run here, or None when it can."""
    where = build_dir()
    if not (where / "built").is_file():
        return f"no operator build in {where}: run `make operator FLINK_OPERATOR_SRC=...`"
    if shutil.which("java") is None:
        return "no java on PATH"
    return None


def chart_crds() -> list[dict[str, Any]]:
    crds = sorted((build_dir() / "helm" / "flink-kubernetes-operator" / "crds").glob("*.yml"))
    return [doc for path in crds for doc in yaml.safe_load_all(path.read_text()) if doc]


def install_crds(plane: Any) -> None:
    """The chart's CRDs, server-side applied over the test CRDs (--force-conflicts), as
    a user installs them; then wait until they serve."""
    for crd in chart_crds():
        name = crd["metadata"]["name"]
        status, body = plane.request(
            "PATCH",
            f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}"
            "?fieldManager=canaryd-e2e&force=true",
            crd,
            content_type="application/apply-patch+yaml",
        )
        if status not in (200, 201):
            raise RuntimeError(f"applying CRD {name}: {status} {body}")
    deadline = time.monotonic() + 60
    while plane.request("GET", "/apis/flink.apache.org/v1beta1/flinkstatesnapshots")[0] != 200:
        if time.monotonic() > deadline:
            raise RuntimeError("the chart's CRDs are not served after 60s")
        time.sleep(0.2)


def role(namespace: str) -> dict[str, Any]:
    """What the operator may do in one watched namespace (the chart's namespaced Role,
    broadened: everything in the namespace)."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": "flink-operator", "namespace": namespace},
        "rules": [{"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]}],
    }


def role_binding(namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": "flink-operator", "namespace": namespace},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": "flink-operator",
        },
        "subjects": [{"kind": "ServiceAccount", "name": "flink-operator", "namespace": NAMESPACE}],
    }


def grant(plane: Any, namespace: str) -> None:
    plane.apply(role(namespace), namespace=namespace)
    plane.apply(role_binding(namespace), namespace=namespace)


def revoke(plane: Any, namespace: str) -> None:
    """Remove the operator's Role there (what the chart does when a namespace leaves
    watchNamespaces): its requests there answer 403."""
    base = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}"
    for kind in ("rolebindings", "roles"):
        plane.request("DELETE", f"{base}/{kind}/flink-operator")


def account(plane: Any, workdir: Path) -> Path:
    """The operator's ServiceAccount (in its own namespace, cluster-wide reads of
    namespaces and CRDs, nothing else cluster-wide) and a kubeconfig with its token.
    Each watched namespace needs ``grant``."""
    plane.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    plane.apply(
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "flink-operator"}},
        namespace=NAMESPACE,
    )
    plane.apply(
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": "flink-operator-cluster"},
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["namespaces", "nodes"],
                    "verbs": ["get", "list", "watch"],
                },
                {
                    "apiGroups": ["apiextensions.k8s.io"],
                    "resources": ["customresourcedefinitions"],
                    "verbs": ["get", "list", "watch"],
                },
            ],
        }
    )
    plane.apply(
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "flink-operator-cluster"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "flink-operator-cluster",
            },
            "subjects": [
                {"kind": "ServiceAccount", "name": "flink-operator", "namespace": NAMESPACE}
            ],
        }
    )
    grant(plane, NAMESPACE)
    token = plane.service_account_token(NAMESPACE, "flink-operator")
    admin = yaml.safe_load(plane.kubeconfig("admin").read_text())
    admin["users"] = [{"name": "flink-operator", "user": {"token": token}}]
    admin["contexts"][0]["context"]["user"] = "flink-operator"
    path = workdir / "flink-operator.kubeconfig"
    path.write_text(yaml.safe_dump(admin))
    path.chmod(0o600)
    return path


def free_port() -> int:
    from canaryd.testing.process import free_port as pick

    return pick()


class RealOperator:
    """One operator process. ``config`` holds flat config.yaml keys (the operator's
    own); the health probe and the Prometheus reporter get free ports."""

    def __init__(self, kubeconfig: Path, config: dict[str, Any], *, name: str = "operator"):
        self.kubeconfig = kubeconfig
        self.workdir = Path(tempfile.mkdtemp(prefix=f"canaryd-{name}-"))
        self.conf_dir = self.workdir / "conf"
        self.conf_dir.mkdir()
        self.probe_port = free_port()
        self.metrics_port = free_port()
        self.config: dict[str, Any] = {
            "kubernetes.operator.health.probe.enabled": "true",
            "kubernetes.operator.health.probe.port": self.probe_port,
            "kubernetes.operator.leader-election.enabled": "false",
            "kubernetes.operator.metrics.reporter.prom.factory.class": PROM,
            "kubernetes.operator.metrics.reporter.prom.port": self.metrics_port,
            **config,
        }
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.log = self.workdir / "operator.log"

    @property
    def probe_url(self) -> str:
        return f"http://127.0.0.1:{self.probe_port}/"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def write_config(self, **changes: Any) -> None:
        """(Re)write config.yaml; the operator re-reads it every dynamic config check
        interval when dynamic config is on."""
        self.config.update(changes)
        (self.conf_dir / "config.yaml").write_text(
            "".join(f"{key}: {value}\n" for key, value in self.config.items())
        )

    def start(self) -> None:
        where = build_dir()
        chart_conf = where / "helm" / "flink-kubernetes-operator" / "conf"
        shutil.copy(chart_conf / "log4j-operator.properties", self.conf_dir)
        self.write_config()
        classpath = ":".join(
            [str(where / "lib" / "standalone.jar"), str(where / "lib" / "operator.jar")]
            + [str(jar) for jar in sorted((where / "log4j").glob("*.jar"))]
        )
        env = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "FLINK_CONF_DIR": str(self.conf_dir),
            "FLINK_PLUGINS_DIR": str(where / "plugins"),
            "OPERATOR_NAMESPACE": NAMESPACE,
            "HOST_NAME": "localhost",
        }
        log = self.log.open("ab")
        self.process = subprocess.Popen(
            [
                "java",
                "-Xmx384m",
                "-XX:+UseSerialGC",
                f"-Dlog4j.configurationFile={self.conf_dir / 'log4j-operator.properties'}",
                "-cp",
                classpath,
                "org.apache.flink.kubernetes.operator.FlinkOperator",
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.starts += 1

    def probe(self, path: str = "/", port: int | None = None, timeout: float = 1.0) -> int:
        """The operator's own health probe (or another of its ports): the status, or 0
        when nothing answered."""
        url = f"http://127.0.0.1:{port or self.probe_port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response:  # 127.0.0.1
                return int(response.status)
        except urllib.error.HTTPError as err:
            return int(err.code)
        except (OSError, urllib.error.URLError):
            return 0

    def wait_ready(self, within: float = 120) -> float:
        """Until its probe answers 200 (seconds it took)."""
        started = time.monotonic()
        while self.probe() != 200:
            self.check_running()
            if time.monotonic() - started > within:
                raise AssertionError(f"operator not ready after {within}s:\n{self.tail()}")
            time.sleep(0.5)
        return time.monotonic() - started

    def check_running(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            raise AssertionError(f"operator exited with {self.process.returncode}:\n{self.tail()}")

    def pause(self) -> None:
        """SIGSTOP: a frozen JVM (its sockets still accept connections)."""
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGSTOP)

    def kill(self) -> None:
        """What the kubelet does on a failed liveness probe, in the end: SIGKILL."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)
        self.process = None

    def stop(self) -> None:
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGCONT)
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()
        self.process = None

    def tail(self, size: int = 4000) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-size:]
        return ""

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


def report(path: Path, row: dict[str, Any]) -> None:
    """Append one measured row to the e2e-operator report (JSON lines)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as out:
        out.write(json.dumps(row) + "\n")


# ------------------------------------------------------------ the kubelet's part


@dataclass(frozen=True)
class ProbeSpec:
    """One container probe as the kubelet runs it (Kubernetes' defaults where unset)."""

    path: str
    port: int | str
    period: float = 10.0
    failure_threshold: int = 3
    timeout: float = 1.0
    initial_delay: float = 0.0

    @classmethod
    def of(cls, probe: dict[str, Any], base: dict[str, Any] | None = None) -> ProbeSpec:
        merged = {**(base or {}), **probe}
        http = merged.get("httpGet") or {}
        return cls(
            path=str(http.get("path", "/")),
            port=http.get("port", 0),
            period=float(merged.get("periodSeconds", 10)),
            failure_threshold=int(merged.get("failureThreshold", 3)),
            timeout=float(merged.get("timeoutSeconds", 1)),
            initial_delay=float(merged.get("initialDelaySeconds", 0)),
        )


def sidecar_probes() -> tuple[ProbeSpec, ProbeSpec]:
    """The operator container's liveness and startup probes as the shipped sidecar
    component leaves them on the real chart: the chart's `operatorHealth` values
    (values.yaml), with config/sidecar's patch of the liveness probe merged on top as
    kustomize's strategic merge does."""
    values = yaml.safe_load(
        (build_dir() / "helm" / "flink-kubernetes-operator" / "values.yaml").read_text()
    )["operatorHealth"]
    patch = yaml.safe_load((ROOT / "config" / "sidecar" / "operator-patch.yaml").read_text())
    containers = patch["spec"]["template"]["spec"]["containers"]
    op = next(c for c in containers if c["name"] == "flink-kubernetes-operator")
    liveness = ProbeSpec.of(op["livenessProbe"], values["livenessProbe"])
    startup = ProbeSpec.of(
        {**values["startupProbe"], "httpGet": {"path": "/", "port": "health-port"}}
    )
    return liveness, startup


class Kubelet:
    """Runs an operator process's startup and liveness probes as the kubelet does, and
    restarts it when its liveness probe fails ``failure_threshold`` times in a row
    (SIGKILL at once: the grace period is skipped). Liveness starts only after the
    startup probe succeeded, ``initial_delay`` after the container started."""

    def __init__(
        self,
        operator: RealOperator,
        liveness_url: str,
        liveness: ProbeSpec,
        startup: ProbeSpec,
        on_restart: Any = lambda: None,
    ) -> None:
        self.operator, self.liveness_url = operator, liveness_url
        self.liveness, self.startup = liveness, startup
        self.on_restart = on_restart
        self.restarts: list[float] = []
        self.events: list[tuple[float, str]] = []

    def _note(self, what: str) -> None:
        self.events.append((time.monotonic(), what))
        print(f"kubelet: {what}", flush=True)

    async def _check(self, url: str, within: float) -> bool:
        """One probe: 2xx or 3xx within its timeout (as the kubelet's httpGet)."""
        import aiohttp

        try:
            async with (
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=within)) as http,
                http.get(url) as answer,
            ):
                return 200 <= answer.status < 400
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def _started_ok(self, started: float) -> bool:
        spec = self.startup
        await asyncio.sleep(max(0.0, started + spec.initial_delay - time.monotonic()))
        failures = 0
        while not await self._check(self.operator.probe_url, spec.timeout):
            failures += 1
            if failures >= spec.failure_threshold:
                self._note("startup probe failed")
                return False
            await asyncio.sleep(spec.period)
        self._note("started")
        return True

    async def _live(self, started: float) -> None:
        """Returns when liveness failed failure_threshold times in a row."""
        spec = self.liveness
        await asyncio.sleep(max(0.0, started + spec.initial_delay - time.monotonic()))
        failures = 0
        while True:
            if await self._check(self.liveness_url, spec.timeout):
                failures = 0
            else:
                failures += 1
                self._note(f"liveness failed ({failures}/{spec.failure_threshold})")
                if failures >= spec.failure_threshold:
                    return
            await asyncio.sleep(spec.period)

    async def run(self) -> None:
        while True:
            started = time.monotonic()
            if await self._started_ok(started):
                await self._live(started)
            self.restarts.append(time.monotonic())
            self._note(f"restarting the operator (restart {len(self.restarts)})")
            await asyncio.to_thread(self.operator.kill)
            self.on_restart()
            self.operator.start()
