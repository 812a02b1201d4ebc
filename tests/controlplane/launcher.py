"""A real Kubernetes control plane on 127.0.0.1 for the e2e tests: etcd, kube-apiserver
and kube-controller-manager as built by ``make controlplane`` (tests/controlplane).

Modelled on controller-runtime's envtest (pkg/internal/testing/controlplane): free
ports, TLS with a CA of its own, RBAC authorization, service-account signing keys, an
admin user (a static token in system:masters) and canaryd's own users, which are the
ServiceAccounts of the project's config/rbac manifests, applied as shipped (cluster-wide)
and as their namespaced variant, with tokens from the TokenRequest API: the tests prove
that those manifests grant enough. The controller manager runs the namespace controller
and the garbage collector, so a deleted namespace really empties and goes, and the
status controller of ValidatingAdmissionPolicies (their CEL type-checked). There is no
kubelet: nothing may create pods.

    python -m tests.controlplane.launcher --kubeconfig /tmp/admin.kubeconfig
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trustme
import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from canaryd.testing.process import free_port

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
RBAC = ROOT / "config" / "rbac"
CANARYD_NAMESPACE = "canaryd"
"""Where the cluster-wide variant's ServiceAccount lives (config/rbac binds it there)."""
NAMESPACED = "canaryd-own"
"""The namespace of the namespaced variant: its ServiceAccount, Role and canaries."""


def built_bin_dir() -> Path:
    """Where ``make controlplane`` put the pinned build (CANARYD_CONTROLPLANE_DIR wins)."""
    if "CANARYD_CONTROLPLANE_DIR" in os.environ:
        return Path(os.environ["CANARYD_CONTROLPLANE_DIR"]) / "bin"
    kube = _required_version(HERE / "kube" / "go.mod", "k8s.io/kubernetes")
    etcd = _required_version(HERE / "etcd" / "go.mod", "go.etcd.io/etcd/server/v3")
    return ROOT / ".cache" / "controlplane" / f"{kube}-{etcd}" / "bin"


def _required_version(gomod: Path, module: str) -> str:
    for line in gomod.read_text().splitlines():
        if line.startswith(f"require {module} "):
            return line.split()[2]
    raise RuntimeError(f"{gomod} does not require {module}")


def advertise_address() -> str:
    """kube-apiserver needs a non-loopback address to advertise (it finds none without a
    default route). The machine's own, else one of RFC 5737's documentation range:
    nothing is ever sent to it (it only names the endpoint of the `kubernetes` Service)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            ["ip", "-4", "-o", "addr", "show", "scope", "global"],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        ).stdout
        for line in out.splitlines():
            parts = line.split()
            if "inet" in parts:
                return parts[parts.index("inet") + 1].split("/")[0]
    return "192.0.2.1"


@dataclass
class ControlPlane:
    bin_dir: Path = field(default_factory=built_bin_dir)
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="canaryd-cp-")))
    etcd_port: int = field(default_factory=free_port)
    etcd_peer_port: int = field(default_factory=free_port)
    port: int = field(default_factory=free_port)
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    admin_token: str = field(default_factory=lambda: secrets.token_hex(16))
    ca: Any = None
    """The cluster's CA (trustme.CA), once started."""

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def etcd_url(self) -> str:
        return f"http://127.0.0.1:{self.etcd_port}"

    @property
    def ca_file(self) -> Path:
        return self.workdir / "ca.crt"

    def kubeconfig(self, user: str) -> Path:
        """admin, canaryd (config/rbac) or canaryd-namespaced (config/rbac/namespaced)."""
        return self.workdir / f"{user}.kubeconfig"

    # ------------------------------------------------------------- lifecycle

    def start(self) -> None:
        for binary in ("etcd", "kube-apiserver", "kube-controller-manager"):
            if not (self.bin_dir / binary).is_file():
                raise RuntimeError(f"{self.bin_dir / binary} is missing: run `make controlplane`")
        try:
            self._certificates()
            self._start_etcd()
            self._start_apiserver()
            self._write_kubeconfig("admin", self.admin_token)
            self._start("kube-controller-manager", self._controller_manager_args())
            self._install_crds()
            self._install_rbac()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop every process (newest first) by pid, then remove the working directory."""
        for name in reversed(list(self.processes)):
            self._stop_process(name)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def restart_apiserver(self) -> None:
        """kube-apiserver dies (SIGKILL: a crash, every connection cut) and starts again on
        the same address; etcd keeps the state; its watch cache is rebuilt from a fresh
        list."""
        self._stop_process("kube-apiserver", grace=0)
        self._start_apiserver()

    def _stop_process(self, name: str, grace: float = 10) -> None:
        process = self.processes.pop(name, None)
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM if grace else signal.SIGKILL)
        try:
            process.wait(timeout=grace or 5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)

    def _start(self, name: str, args: list[str]) -> None:
        log = (self.workdir / f"{name}.log").open("ab")
        with _signals_held():
            self.processes[name] = subprocess.Popen(
                [str(self.bin_dir / name), *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def _check_running(self, name: str) -> None:
        process = self.processes[name]
        if process.poll() is not None:
            tail = (self.workdir / f"{name}.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{name} exited with {process.returncode}:\n{tail}")

    # ------------------------------------------------------------- pieces

    def serving_names(self) -> tuple[str, ...]:
        """The names and addresses kube-apiserver's serving certificate is valid for."""
        return ("127.0.0.1", "localhost")

    def _certificates(self) -> None:
        ca = trustme.CA(organization_name="canaryd e2e")
        self.ca = ca
        ca.cert_pem.write_to_path(str(self.ca_file))
        serving = ca.issue_cert(*self.serving_names(), common_name="kube-apiserver")
        serving.private_key_pem.write_to_path(str(self.workdir / "apiserver.key"))
        serving.cert_chain_pems[0].write_to_path(str(self.workdir / "apiserver.crt"))
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        (self.workdir / "sa.key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.TraditionalOpenSSL,
                serialization.NoEncryption(),
            )
        )
        (self.workdir / "sa.pub").write_bytes(
            key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )
        # A static token for the admin (system:masters); canaryd's users are
        # ServiceAccounts with tokens from the TokenRequest API.
        (self.workdir / "tokens.csv").write_text(
            f'{self.admin_token},admin,admin,"system:masters"\n'
        )

    def _start_etcd(self) -> None:
        peer = f"http://127.0.0.1:{self.etcd_peer_port}"
        self._start(
            "etcd",
            [
                "--name=canaryd-e2e",
                f"--data-dir={self.workdir / 'etcd'}",
                f"--listen-client-urls={self.etcd_url}",
                f"--advertise-client-urls={self.etcd_url}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=canaryd-e2e={peer}",
                "--unsafe-no-fsync",  # a test's data: no fsync, as envtest's etcd
                "--log-level=warn",
            ],
        )
        self._wait("etcd", lambda: self._get(self.etcd_url + "/health", tls=False)[0] == 200)

    def _apiserver_args(self) -> list[str]:
        w = self.workdir
        return [
            f"--etcd-servers={self.etcd_url}",
            "--bind-address=127.0.0.1",
            f"--secure-port={self.port}",
            f"--advertise-address={advertise_address()}",
            f"--cert-dir={w / 'certs'}",
            f"--tls-cert-file={w / 'apiserver.crt'}",
            f"--tls-private-key-file={w / 'apiserver.key'}",
            f"--token-auth-file={w / 'tokens.csv'}",
            "--authorization-mode=RBAC",
            f"--service-account-issuer={self.url}",
            f"--service-account-key-file={w / 'sa.pub'}",
            f"--service-account-signing-key-file={w / 'sa.key'}",
            "--service-cluster-ip-range=10.0.0.0/24",
            "--allow-privileged=true",
            # No token controller runs to fill ServiceAccount secrets (envtest does the same).
            "--disable-admission-plugins=ServiceAccount",
        ]

    def _start_apiserver(self) -> None:
        self._start("kube-apiserver", self._apiserver_args())
        self._wait("kube-apiserver", lambda: self._get(self.url + "/readyz")[0] == 200, 90)

    def _controller_manager_args(self) -> list[str]:
        return [
            f"--kubeconfig={self.kubeconfig('admin')}",
            # The namespace controller and the garbage collector, so a deleted namespace
            # really empties and goes; the policy status controller, which type-checks
            # a ValidatingAdmissionPolicy's CEL (config/admission) against the schemas.
            "--controllers=namespace-controller,garbage-collector-controller,"
            "validatingadmissionpolicy-status-controller",
            "--leader-elect=false",
            "--secure-port=0",
        ]

    def _install_crds(self) -> None:
        for crd in yaml.safe_load_all((HERE / "crds.yaml").read_text()):
            if crd:
                self.apply(crd)
        for plural in ("flinkdeployments", "flinksessionjobs"):
            path = (
                f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{plural}.flink.apache.org"
            )

            def established(path: str = path) -> bool:
                status, body = self._get(self.url + path)
                conditions = (body or {}).get("status", {}).get("conditions") or []
                return status == 200 and any(
                    c.get("type") == "Established" and c.get("status") == "True" for c in conditions
                )

            self._wait(f"CRD {plural}", established)
        self._wait(
            "discovery of flink.apache.org/v1beta1",
            lambda: self._get(self.url + "/apis/flink.apache.org/v1beta1")[0] == 200,
        )

    def _install_rbac(self) -> None:
        """config/rbac as shipped (its ServiceAccount in `canaryd`), and
        config/rbac/namespaced into its own namespace, as kustomize's `namespace:` and
        `nameSuffix:` would (cluster-scoped names get a suffix so both variants can
        live in one cluster; ServiceAccount subjects follow the namespace)."""
        self.apply(namespace_object(CANARYD_NAMESPACE))
        for obj in manifests(RBAC):
            self.apply(obj, namespace=CANARYD_NAMESPACE)
        self.apply(namespace_object(NAMESPACED))
        for obj in manifests(RBAC / "namespaced"):
            self.apply(retarget(obj, NAMESPACED), namespace=NAMESPACED)
        for user, namespace in (("canaryd", CANARYD_NAMESPACE), ("canaryd-namespaced", NAMESPACED)):
            token = self.service_account_token(namespace)
            self._write_kubeconfig(user, token)
            # Just started, kube-apiserver may answer 429 or 403 until its priority
            # levels and RBAC caches are filled: ready means canaryd's user gets through.
            path = f"/apis/flink.apache.org/v1beta1/namespaces/{namespace}/flinkdeployments"
            self._wait(
                f"{user} to be served",
                lambda path=path, token=token: self.request("GET", path, token=token)[0] == 200,
            )

    def service_account_token(self, namespace: str, name: str = "canaryd") -> str:
        path = f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token"
        status, body = self.request(
            "POST",
            path,
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {}},
        )
        if status != 201 or not body:
            raise RuntimeError(f"TokenRequest for {namespace}/{name} answered {status}: {body}")
        return str(body["status"]["token"])

    def _write_kubeconfig(self, user: str, token: str) -> None:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "e2e",
                    "cluster": {"server": self.url, "certificate-authority": str(self.ca_file)},
                }
            ],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": user, "context": {"cluster": "e2e", "user": user}}],
            "current-context": user,
        }
        path = self.kubeconfig(user)
        path.write_text(yaml.safe_dump(config))
        path.chmod(0o600)

    # ------------------------------------------------------------- HTTP

    def _ssl(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca_file))

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        token: str | None = None,
        content_type: str = "application/json",
    ) -> tuple[int, Any]:
        """One request as the admin (or ``token``): (status, decoded JSON or None)."""
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + path, data=data, method=method)
        request.add_header("Authorization", f"Bearer {token or self.admin_token}")
        request.add_header("Accept", "application/json")
        if data is not None:
            request.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(request, context=self._ssl(), timeout=30) as response:
                return response.status, _json(response.read())
        except urllib.error.HTTPError as err:
            return err.code, _json(err.read())

    def _get(self, url: str, *, tls: bool = True) -> tuple[int, Any]:
        try:
            if tls:
                return self.request("GET", url.removeprefix(self.url))
            with urllib.request.urlopen(url, timeout=5) as response:
                return response.status, _json(response.read())
        except (OSError, urllib.error.URLError):
            return 0, None

    def apply(self, obj: dict[str, Any], namespace: str | None = None) -> None:
        """Create ``obj`` (already there: fine). Paths from its apiVersion and kind."""
        path = collection_path(obj, namespace)
        status, body = self.request("POST", path, obj)
        if status not in (200, 201, 409):
            raise RuntimeError(f"creating {obj['kind']} {obj['metadata']['name']}: {status} {body}")

    def _wait(self, what: str, ready: Any, within: float = 60) -> None:
        end = time.monotonic() + within
        while not ready():
            for name in self.processes:
                self._check_running(name)
            if time.monotonic() > end:
                raise RuntimeError(f"{what} not ready after {within}s (logs in {self.workdir})")
            time.sleep(0.1)


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return None


_PLURALS = {
    "Namespace": ("/api/v1", "namespaces", False),
    "ServiceAccount": ("/api/v1", "serviceaccounts", True),
    "ConfigMap": ("/api/v1", "configmaps", True),
    "ClusterRole": ("/apis/rbac.authorization.k8s.io/v1", "clusterroles", False),
    "ClusterRoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "clusterrolebindings", False),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles", True),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings", True),
    "CustomResourceDefinition": (
        "/apis/apiextensions.k8s.io/v1",
        "customresourcedefinitions",
        False,
    ),
    "ValidatingAdmissionPolicy": (
        "/apis/admissionregistration.k8s.io/v1",
        "validatingadmissionpolicies",
        False,
    ),
    "ValidatingAdmissionPolicyBinding": (
        "/apis/admissionregistration.k8s.io/v1",
        "validatingadmissionpolicybindings",
        False,
    ),
}


def collection_path(obj: dict[str, Any], namespace: str | None) -> str:
    prefix, plural, namespaced = _PLURALS[obj["kind"]]
    if namespaced:
        return f"{prefix}/namespaces/{namespace or obj['metadata'].get('namespace')}/{plural}"
    return f"{prefix}/{plural}"


def namespace_object(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}


def manifests(directory: Path) -> Iterator[dict[str, Any]]:
    """The resources a kustomization lists, in its order."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    for resource in kustomization["resources"]:
        for obj in yaml.safe_load_all((directory / resource).read_text()):
            if obj:
                yield obj


def retarget(obj: dict[str, Any], namespace: str) -> dict[str, Any]:
    obj = json.loads(json.dumps(obj))
    cluster_scoped = obj["kind"] in ("ClusterRole", "ClusterRoleBinding")
    if cluster_scoped:
        obj["metadata"]["name"] += f"-{namespace}"
    if obj["kind"] == "ClusterRoleBinding":
        obj["roleRef"]["name"] += f"-{namespace}"
    for subject in obj.get("subjects") or []:
        if subject.get("kind") == "ServiceAccount":
            subject["namespace"] = namespace
    return obj


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM wait until the child being started is recorded. Popen waits
    for the forked child's exec; the launcher's handler raising there would leave the
    child running unrecorded, where stop() cannot reach it (in a session of its own, no
    Ctrl-C reaches it either). Only the main thread handles signals."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    watched = (signal.SIGINT, signal.SIGTERM)
    previous = [signal.signal(sig, lambda signum, _frame: held.append(signum)) for sig in watched]
    try:
        yield
    finally:
        for sig, handler in zip(watched, previous, strict=True):
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        for sig in held:
            signal.raise_signal(sig)


class _Stop(Exception):
    """A signal asked the control plane to stop."""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tests.controlplane.launcher",
        description="A real control plane on 127.0.0.1 until SIGTERM or Ctrl-C.",
    )
    parser.add_argument("--kubeconfig", required=True, help="write the admin kubeconfig here")
    args = parser.parse_args(argv)
    stopping = False

    def stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        if stopping:
            return  # a second Ctrl-C while stopping: the stop goes on, nothing is left behind
        stopping = True
        raise _Stop(signal.Signals(signum).name)

    # Installed, never inherited: a shell starts a background job (`... &` in a script)
    # with SIGINT ignored, and Python then installs no KeyboardInterrupt handler, so
    # Ctrl-C or `kill -INT` did nothing at all (the processes run in sessions of their
    # own: no signal reaches them but ours). From before the start: an interrupt while
    # starting stops what was started, without a traceback.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    plane = ControlPlane()
    try:
        plane.start()
        target = Path(args.kubeconfig)
        shutil.copy(plane.kubeconfig("admin"), target)
        for user in ("canaryd", "canaryd-namespaced"):
            shutil.copy(plane.kubeconfig(user), target.with_name(f"{target.name}.{user}"))
        print(
            f"control plane at {plane.url}; admin kubeconfig {target}; canaryd's "
            f"{target}.canaryd (cluster-wide) and {target}.canaryd-namespaced "
            f"(namespace {NAMESPACED}); Ctrl-C stops it",
            flush=True,
        )
        while True:
            signal.pause()
    except _Stop as why:
        print(f"{why}: stopping the control plane", flush=True)
    finally:
        plane.stop()


if __name__ == "__main__":
    main()
