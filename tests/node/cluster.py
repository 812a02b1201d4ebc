"""A real single-node cluster on this machine for ``make e2e-node``: the control plane of
``make e2e`` (etcd, kube-apiserver, kube-controller-manager) set up as a cluster runs
pods, Debian's containerd and runc, and the kubelet built by tests/node/build.sh, with
canaryd's image as released (``make dist``'s OCI archive in dist/) and the pause image of
tests/node/images.sh imported into containerd (pods use them with
``imagePullPolicy: Never``).

What differs from ``make e2e``'s control plane, and why:

- kube-apiserver admits ServiceAccounts (the ServiceAccount admission plugin: pods get
  a projected service-account token) and authorizes the kubelet (Node, RBAC,
  NodeRestriction); kube-controller-manager runs the service-account, token and
  root-CA publisher controllers (the ``default`` ServiceAccount, legacy tokens, the
  ``kube-root-ca.crt`` ConfigMap a projected token volume needs) and the Deployment
  and ReplicaSet controllers. There is no scheduler: pods name their node
  (``spec.nodeName``), which the tests patch into the manifests, or ``Binder`` binds
  them (a chart's pods, installed with ``helm install``).
- There is no kube-proxy: the ``kubernetes`` Service's address (``SERVICE_IP``:443,
  what a pod's in-cluster configuration dials) is an address added to ``lo`` while
  the node runs, where the fault proxy of ``make e2e`` (tests/controlplane/faultproxy)
  forwards to kube-apiserver on 127.0.0.1. Pods reach it through their bridge's
  gateway (a CNI bridge, addresses in ``POD_SUBNET``).
- One node per machine: the kubelet's ports (10248, 10250), its device-plugin socket
  directory and ``/var/log/containers`` are fixed.

The kubelet changes the host: ``vm.overcommit_memory``, ``kernel.panic``,
``kernel.panic_on_oops`` (and the CNI bridge ``net.ipv4.ip_forward``); ``stop()``
puts back what they were, removes the cgroups, mounts, network namespaces, bridge,
address and fixed paths it made, and ``host_state()`` is what a test compares before
and after. With ``makeIPTablesUtilChains: false`` the kubelet adds no iptables chain.

    python -m tests.node.cluster     # a node until Ctrl-C; kubeconfig path printed
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from canaryd import __version__
from tests.controlplane.faultproxy import FaultProxy
from tests.controlplane.faultproxy import build as build_faultproxy
from tests.controlplane.launcher import ROOT, ControlPlane

NODE = "localhost"
"""The node's name: the API server reaches the kubelet by it (another name made it ask
DNS, off this machine)."""
SERVICE_RANGE = "10.0.0.0/24"
SERVICE_IP = "10.0.0.1"
"""The ``kubernetes`` Service's cluster IP: the first of ``SERVICE_RANGE``."""
POD_SUBNET = "10.88.77.0/24"
BRIDGE = "canarydbr0"
SYSCTLS = ("vm.overcommit_memory", "kernel.panic", "kernel.panic_on_oops", "net.ipv4.ip_forward")
FIXED_PATHS = (Path("/var/lib/kubelet/device-plugins"), Path("/var/log/containers"))
KUBELET_PORTS = (10248, 10250)
LOCK = Path("/run/lock/canaryd-node.lock")
"""Held while a node runs: a second ``make e2e-node`` on the machine waits for it."""
LOCK_WAIT = 3600.0
IMAGES = ROOT / ".cache" / "node" / "images"
DIST = ROOT / "dist"
CANARYD_IMAGE = f"ghcr.io/{os.environ.get('ORG', 'ORG').lower()}/canaryd:{__version__}"
"""The name of the image in ``make dist``'s archive (dist/canaryd-V.oci.tar): the released
one, which the chart of dist/ runs by default."""
PAUSE_IMAGE = "localhost/pause:canaryd-node"


def kube_version() -> str:
    gomod = ROOT / "tests" / "controlplane" / "kube" / "go.mod"
    for line in gomod.read_text().splitlines():
        if line.startswith("require k8s.io/kubernetes "):
            return line.split()[2]
    raise RuntimeError(f"{gomod} does not require k8s.io/kubernetes")


def kubelet_binary() -> Path:
    return ROOT / ".cache" / "node" / kube_version() / "bin" / "kubelet"


def run(*argv: str, check: bool = True, timeout: float = 120) -> str:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {result.returncode}: {result.stderr.strip()}")
    return result.stdout


def host_state() -> dict[str, Any]:
    """What the node must leave as it found it."""
    return {
        "sysctls": {name: read_sysctl(name) for name in SYSCTLS},
        "iptables": sorted(
            line
            for line in run("iptables-save", check=False).splitlines()
            if line.startswith((":", "-A"))
        ),
        "fixed paths": sorted(str(p) for p in FIXED_PATHS if p.exists()),
        "links": sorted(
            line.split(":")[1].strip() for line in run("ip", "-o", "link").splitlines()
        ),
        "addresses": sorted(
            " ".join(line.split()[1:4]) for line in run("ip", "-o", "addr").splitlines()
        ),
        "cgroups": sorted(str(p) for p in Path("/sys/fs/cgroup").glob("*/canaryd-node-*")),
        "mounts": sorted(
            line.split()[1]
            for line in Path("/proc/self/mounts").read_text().splitlines()
            if "canaryd-node" in line or "/run/netns" in line
        ),
    }


@contextlib.contextmanager
def one_node_per_machine() -> Iterator[None]:
    """Held around a node's life and the host checks on both sides of it: a second
    ``make e2e-node`` (or a developer's ``python -m tests.node.cluster``) waits, bounded."""
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    with LOCK.open("w") as lock:
        deadline = time.monotonic() + LOCK_WAIT
        announced = False
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{LOCK} still held after {LOCK_WAIT:.0f}s") from None
                if not announced:
                    print(f"another node runs on this machine; waiting for {LOCK}", flush=True)
                    announced = True
                time.sleep(2)
        yield  # the lock goes with the file's closing


def read_sysctl(name: str) -> str:
    return Path("/proc/sys", *name.split(".")).read_text().strip()


def write_sysctl(name: str, value: str) -> None:
    Path("/proc/sys", *name.split(".")).write_text(value)


class NodePlane(ControlPlane):
    """``make e2e``'s control plane, set up to run pods (see the module)."""

    stand_in_crds = True
    """The launcher's stand-in CRDs of the canary kinds; off where a chart brings its own
    (``make e2e-operator``: the operator's chart, installed with ``helm install``)."""

    def _install_crds(self) -> None:
        if self.stand_in_crds:
            super()._install_crds()

    def serving_names(self) -> tuple[str, ...]:
        return (*super().serving_names(), SERVICE_IP, "kubernetes", "kubernetes.default.svc")

    def _apiserver_args(self) -> list[str]:
        w = self.workdir
        args = [
            a
            for a in super()._apiserver_args()
            if not a.startswith(
                ("--disable-admission-plugins", "--authorization-mode", "--service-cluster")
            )
        ]
        return [
            *args,
            f"--service-cluster-ip-range={SERVICE_RANGE}",
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction",
            f"--client-ca-file={self.ca_file}",
            f"--kubelet-client-certificate={w / 'kubelet-client.crt'}",
            f"--kubelet-client-key={w / 'kubelet-client.key'}",
            "--kubelet-preferred-address-types=Hostname",
        ]

    def _certificates(self) -> None:
        super()._certificates()
        # kube-apiserver's client certificate for the kubelet (logs), in system:masters.
        client = self.ca.issue_cert(
            "kube-apiserver-kubelet-client",
            common_name="kube-apiserver-kubelet-client",
            organization_name="system:masters",
        )
        client.private_key_pem.write_to_path(str(self.workdir / "kubelet-client.key"))
        client.cert_chain_pems[0].write_to_path(str(self.workdir / "kubelet-client.crt"))

    def _install_rbac(self) -> None:
        """Nothing of canaryd's: the tests apply config/ as a user does."""

    def _controller_manager_args(self) -> list[str]:
        controllers = [
            "namespace-controller",
            "garbage-collector-controller",
            "serviceaccount-controller",
            "serviceaccount-token-controller",
            "root-ca-certificate-publisher-controller",
            "deployment-controller",
            "replicaset-controller",
            "validatingadmissionpolicy-status-controller",
        ]
        args = [a for a in super()._controller_manager_args() if not a.startswith("--controllers")]
        return [
            *args,
            f"--controllers={','.join(controllers)}",
            f"--service-account-private-key-file={self.workdir / 'sa.key'}",
            f"--root-ca-file={self.ca_file}",
        ]


class Node:
    """The cluster: ``start()``, then ``stop()`` (always: it restores the host)."""

    def __init__(self, *, stand_in_crds: bool = True) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="canaryd-node-"))
        self.plane = NodePlane(workdir=self.workdir / "plane")
        self.plane.stand_in_crds = stand_in_crds
        self.plane.workdir.mkdir()
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.sysctls: dict[str, str] = {}
        self.created_paths: list[Path] = []
        self.cgroup_root = f"canaryd-node-{os.getpid()}"
        self.proxy: FaultProxy | None = None
        self._proxy_process: subprocess.Popen[str] | None = None
        self.alias_added = False

    @property
    def socket(self) -> Path:
        return self.workdir / "containerd.sock"

    def ctr(self, *args: str, check: bool = True, timeout: float = 120) -> str:
        return run(
            "ctr",
            "--address",
            str(self.socket),
            "-n",
            "k8s.io",
            *args,
            check=check,
            timeout=timeout,
        )

    def exec(self, container_id: str, script: str) -> str:
        """``sh -c SCRIPT`` in a running container (its process spec: user, env, mounts);
        its stdout and stderr."""
        result = subprocess.run(
            [
                "ctr",
                "--address",
                str(self.socket),
                "-n",
                "k8s.io",
                "tasks",
                "exec",
                "--exec-id",
                f"e2e-{time.monotonic_ns()}",
                container_id,
                "sh",
                "-c",
                script,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=60,
            check=False,
        )
        return result.stdout

    # ------------------------------------------------------------- lifecycle

    def start(self) -> None:
        self._preflight()
        try:
            self.plane.start()
            self._start_containerd()
            self._service_address()
            self._start_kubelet()
        except BaseException:
            self.stop()
            raise

    def _preflight(self) -> None:
        if os.geteuid() != 0:
            raise RuntimeError("make e2e-node runs a kubelet: it needs root")
        missing = [
            str(p)
            for p in (
                kubelet_binary(),
                DIST / f"canaryd-{__version__}.oci.tar",
                IMAGES / "pause.tar",
                Path("/usr/lib/cni/bridge"),
            )
            if not p.exists()
        ] + [
            tool
            for tool in ("containerd", "ctr", "runc", "iptables-save")
            if not shutil.which(tool)
        ]
        if missing:
            raise RuntimeError(f"missing {', '.join(missing)}: run `make node` and `make dist`")
        busy = [p for p in KUBELET_PORTS if _listening(p)]
        if busy or Path("/var/lib/kubelet/device-plugins/kubelet.sock").exists():
            raise RuntimeError(f"another kubelet runs here (ports {busy}): one node per machine")

    def stop(self) -> None:
        """Everything started, by pid, newest first; then the host as it was."""
        self._stop_process("kubelet", grace=30)
        if self.socket.exists():
            self._remove_containers()
        if self._proxy_process is not None:
            self._proxy_process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proxy_process.wait(timeout=10)
        if self.alias_added:
            run("ip", "addr", "del", f"{SERVICE_IP}/32", "dev", "lo", check=False)
        self._stop_process("containerd", grace=30)
        self.plane.stop()
        for line in reversed(Path("/proc/self/mounts").read_text().splitlines()):
            mount = line.split()[1]
            if mount.startswith(str(self.workdir)):
                run("umount", "-l", mount, check=False)
        for netns in Path("/run/netns").glob("cni-*") if Path("/run/netns").exists() else []:
            if run("umount", str(netns), check=False) == "":
                with contextlib.suppress(OSError):
                    netns.unlink()
        for hierarchy in Path("/sys/fs/cgroup").iterdir():
            directory = hierarchy / self.cgroup_root
            if directory.is_dir():
                for sub in sorted(directory.rglob("*"), key=lambda p: -len(p.parts)):
                    if sub.is_dir():
                        with contextlib.suppress(OSError):
                            sub.rmdir()
                with contextlib.suppress(OSError):
                    directory.rmdir()
        run("ip", "link", "del", BRIDGE, check=False)
        for name, value in self.sysctls.items():
            if read_sysctl(name) != value:
                write_sysctl(name, value)
        for path in reversed(self.created_paths):
            shutil.rmtree(path, ignore_errors=True)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def _remove_containers(self) -> None:
        for task in self.ctr("tasks", "ls", "-q", check=False).split():
            self.ctr("tasks", "kill", "-s", "SIGKILL", task, check=False)
        deadline = time.monotonic() + 30
        while self.ctr("tasks", "ls", "-q", check=False).split() and time.monotonic() < deadline:
            for task in self.ctr("tasks", "ls", "-q", check=False).split():
                self.ctr("tasks", "rm", "-f", task, check=False)
            time.sleep(0.2)  # bounded: the shims report their tasks' exit on their own
        for container in self.ctr("containers", "ls", "-q", check=False).split():
            self.ctr("containers", "rm", container, check=False)

    def _start(self, name: str, argv: list[str]) -> None:
        log = (self.workdir / f"{name}.log").open("ab")
        self.processes[name] = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def _stop_process(self, name: str, grace: float) -> None:
        process = self.processes.pop(name, None)
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)

    def _wait(self, what: str, ready: Any, within: float = 60) -> None:
        end = time.monotonic() + within
        while not ready():
            for name, process in self.processes.items():
                if process.poll() is not None:
                    log = (self.workdir / f"{name}.log").read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"{name} exited with {process.returncode}:\n{log}")
            if time.monotonic() > end:
                raise RuntimeError(f"{what} not ready after {within}s (logs in {self.workdir})")
            time.sleep(0.1)

    # ------------------------------------------------------------- pieces

    def _start_containerd(self) -> None:
        w = self.workdir
        (w / "cni").mkdir()
        (w / "cni" / "10-canaryd-node.conflist").write_text(
            json.dumps(
                {
                    "cniVersion": "1.0.0",
                    "name": "canaryd-node",
                    "plugins": [
                        {
                            "type": "bridge",
                            "bridge": BRIDGE,
                            "isGateway": True,
                            "ipMasq": False,
                            "ipam": {
                                "type": "host-local",
                                "ranges": [[{"subnet": POD_SUBNET}]],
                                # Pods reach the kubernetes Service through the bridge.
                                "routes": [{"dst": f"{SERVICE_IP}/32"}],
                                "dataDir": str(w / "cni-ipam"),
                            },
                        },
                        {"type": "portmap", "capabilities": {"portMappings": True}},
                    ],
                }
            )
        )
        (w / "containerd.toml").write_text(
            f"""version = 2
root = "{w / "containerd" / "root"}"
state = "{w / "containerd" / "state"}"
[grpc]
  address = "{self.socket}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{w / "cni"}"
"""
        )
        self.sysctls["net.ipv4.ip_forward"] = read_sysctl("net.ipv4.ip_forward")
        self._start("containerd", ["containerd", "--config", str(w / "containerd.toml")])
        self._wait("containerd", self.socket.exists)
        self._wait("containerd's API", lambda: self.ctr("version", check=False) != "")
        self.ctr("images", "import", str(IMAGES / "pause.tar"), timeout=300)
        self.ctr("images", "import", str(DIST / f"canaryd-{__version__}.oci.tar"), timeout=300)
        if CANARYD_IMAGE not in self.ctr("images", "ls", "-q").split():
            raise RuntimeError(f"dist/canaryd-{__version__}.oci.tar has no {CANARYD_IMAGE}")

    def _service_address(self) -> None:
        """The ``kubernetes`` Service's address on this host, forwarded to kube-apiserver."""
        run("ip", "addr", "add", f"{SERVICE_IP}/32", "dev", "lo")
        self.alias_added = True
        binary = build_faultproxy()
        upstream = f"127.0.0.1:{self.plane.port}"
        self._proxy_process = subprocess.Popen(
            [str(binary), "-upstream", upstream, "-listen", f"{SERVICE_IP}:443"],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._proxy_process.stdout is not None
        words = self._proxy_process.stdout.readline().split()  # "proxy ADDR control ADDR"
        if len(words) != 4:
            raise RuntimeError(f"faultproxy did not start: {words}")
        self.proxy = FaultProxy(self._proxy_process, words[1], words[3])

    def _start_kubelet(self) -> None:
        w = self.workdir
        for name in ("vm.overcommit_memory", "kernel.panic", "kernel.panic_on_oops"):
            self.sysctls[name] = read_sysctl(name)
        for path in FIXED_PATHS:
            if not path.exists():
                self.created_paths.append(path)
        if not Path("/var/lib/kubelet").exists():
            self.created_paths.insert(0, Path("/var/lib/kubelet"))
        # A private cgroup root, present in every hierarchy first (cgroup v1 here).
        for hierarchy in Path("/sys/fs/cgroup").iterdir():
            if hierarchy.is_dir() and hierarchy.name != "unified":
                (hierarchy / self.cgroup_root).mkdir(exist_ok=True)
        cpuset = Path("/sys/fs/cgroup/cpuset")
        for name in ("cpuset.cpus", "cpuset.mems"):
            (cpuset / self.cgroup_root / name).write_text((cpuset / name).read_text())
        ca = self.plane.ca
        client = ca.issue_cert(
            NODE, common_name=f"system:node:{NODE}", organization_name="system:nodes"
        )
        client.private_key_pem.write_to_path(str(w / "kubelet.key"))
        client.cert_chain_pems[0].write_to_path(str(w / "kubelet.crt"))
        kubeconfig = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "node",
                    "cluster": {
                        "server": self.plane.url,
                        "certificate-authority": str(self.plane.ca_file),
                    },
                }
            ],
            "users": [
                {
                    "name": "kubelet",
                    "user": {
                        "client-certificate": str(w / "kubelet.crt"),
                        "client-key": str(w / "kubelet.key"),
                    },
                }
            ],
            "contexts": [{"name": "node", "context": {"cluster": "node", "user": "kubelet"}}],
            "current-context": "node",
        }
        (w / "kubelet.kubeconfig").write_text(yaml.safe_dump(kubeconfig))
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "failCgroupV1": False,  # cgroup v2 cannot be mounted here
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": f"/{self.cgroup_root}",
            "containerRuntimeEndpoint": f"unix://{self.socket}",
            "staticPodPath": str(w / "manifests"),
            "podLogsDir": str(w / "pod-logs"),
            "address": "127.0.0.1",
            "healthzBindAddress": "127.0.0.1",
            "readOnlyPort": 0,
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": False},
                "x509": {"clientCAFile": str(self.plane.ca_file)},
            },
            "authorization": {"mode": "AlwaysAllow"},
            "failSwapOn": False,
            "makeIPTablesUtilChains": False,
            "volumePluginDir": str(w / "volume-plugins"),
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "evictionHard": {
                "memory.available": "50Mi",
                "nodefs.available": "1%",
                "imagefs.available": "1%",
                "nodefs.inodesFree": "1%",
            },
            "serializeImagePulls": False,
        }
        (w / "manifests").mkdir()
        (w / "kubelet.yaml").write_text(yaml.safe_dump(config))
        self._start(
            "kubelet",
            [
                str(kubelet_binary()),
                f"--config={w / 'kubelet.yaml'}",
                f"--kubeconfig={w / 'kubelet.kubeconfig'}",
                f"--hostname-override={NODE}",
                f"--root-dir={w / 'kubelet'}",
                f"--cert-dir={w / 'kubelet-pki'}",
                "--v=2",
            ],
        )
        self._wait("the node to be Ready", self.ready, within=120)

    def ready(self) -> bool:
        status, body = self.plane.request("GET", f"/api/v1/nodes/{NODE}")
        if status != 200:
            return False
        conditions = body.get("status", {}).get("conditions") or []
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    def kubectl(self, *args: str, check: bool = True, timeout: float = 120) -> str:
        """kubectl as the admin (kubectl on PATH)."""
        return run(
            "kubectl",
            f"--kubeconfig={self.plane.kubeconfig('admin')}",
            *args,
            check=check,
            timeout=timeout,
        )


class Binder:
    """kube-scheduler's part for a one-node cluster: every pod without a node is bound
    to it (POST pods/NAME/binding)."""

    def __init__(self, node: Any) -> None:
        self.node = node
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="binder", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        plane = self.node.plane
        while not self._stop.wait(0.5):  # a poll of the pods, bounded by stop()
            try:
                self._bind(plane)
            except OSError:  # the API server not answering (a fault, or the node stopping)
                continue

    @staticmethod
    def _bind(plane: Any) -> None:
        status, body = plane.request("GET", "/api/v1/pods?fieldSelector=spec.nodeName%3D")
        if status != 200:
            return
        for pod in body["items"]:
            meta = pod["metadata"]
            binding = {
                "apiVersion": "v1",
                "kind": "Binding",
                "metadata": {"name": meta["name"]},
                "target": {"apiVersion": "v1", "kind": "Node", "name": NODE},
            }
            plane.request(
                "POST",
                f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/binding",
                binding,
            )


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def main() -> None:
    with one_node_per_machine():
        node = Node()
        node.start()
        try:
            kubeconfig = node.plane.kubeconfig("admin")
            print(f"node {NODE} ready; admin kubeconfig {kubeconfig}", flush=True)
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
            with contextlib.suppress(KeyboardInterrupt):
                while True:
                    time.sleep(3600)
        finally:
            node.stop()


if __name__ == "__main__":
    main()
