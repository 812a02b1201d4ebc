"""canaryd in real pods under a real kubelet: ``make e2e-node`` (tests/node).

The image is the one ``make dist`` built and a release publishes (dist/canaryd-V.oci.tar:
the repository's Dockerfile built with buildah on a Debian base); the manifests are
config/ applied with kubectl as the README says (the image set with kustomize), plus
what a cluster without scheduler or registry needs: ``nodeName`` and
``imagePullPolicy: Never``; and the chart as released (dist/canaryd-V.tgz) installed with
``helm install`` as the README says (its values, the operator's service account given as
it says, the released image among them, but for ``image.pullPolicy=Never``, the cycle and
the namespace; its pods bound to
the node by tests/node/cluster.py's ``Binder``). Timings are the shipped ones (probe
periods, thresholds, grace periods, back-off) but for canaryd's cycle, 10 s instead of
1 min. Restarts are read from the pods' status, as ``kubectl get pods`` shows them. In
``make test`` every test here is skipped.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from canaryd import __version__
from tests.node.cluster import CANARYD_IMAGE, DIST
from tests.test_chart import helm_binary
from tests.test_packaging import CHART_DEFAULT_OVERRIDES

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "config"
OVERLAYS = ROOT / ".cache" / "node" / "overlays"
CYCLE = "10s"
"""canaryd's cycle here; everything else is shipped."""
IMAGE_NAME, _, IMAGE_TAG = CANARYD_IMAGE.rpartition(":")
OPERATOR = "flink-kubernetes-operator"

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.environ.get("CANARYD_E2E") != "node", reason="make e2e-node runs these"),
    pytest.mark.timeout(900),
]


@pytest.fixture(scope="module")
def node() -> Iterator[Any]:
    from tests.node.cluster import Node, host_state, one_node_per_machine

    with one_node_per_machine():
        before = host_state()
        global NODE
        started = Node()
        started.start()
        NODE = started
        try:
            yield started
        finally:
            started.stop()
            after = host_state()
            assert after == before, f"the host differs after the node: {before} -> {after}"


NODE: Any = None
"""The running node, for what a failed wait prints."""


def wait(check: Callable[[], Any], what: str, within: float) -> Any:
    """Poll the cluster (no event to wait on from here), bounded, with a message."""
    end = time.monotonic() + within
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > end:
            pods = NODE.kubectl("get", "pods", "-A", "-o", "wide", check=False) if NODE else ""
            raise AssertionError(f"still waiting after {within}s for {what}\n{pods}")
        time.sleep(1)


def overlay(name: str, kustomization: dict[str, Any], *files: tuple[str, Any]) -> Path:
    """A kustomization of the test's own under .cache/node/overlays (kustomize takes
    only relative paths to config/)."""
    directory = OVERLAYS / name
    directory.mkdir(parents=True, exist_ok=True)
    for resource in kustomization.get("resources", []):
        assert not Path(resource).is_absolute()
    (directory / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    for filename, content in files:
        text = content if isinstance(content, str) else yaml.safe_dump_all(content)
        (directory / filename).write_text(text)
    return directory


def relative(path: Path, directory: str) -> str:
    return os.path.relpath(path, OVERLAYS / directory)


def pods(node: Any, namespace: str) -> list[dict[str, Any]]:
    status, body = node.plane.request("GET", f"/api/v1/namespaces/{namespace}/pods")
    assert status == 200, body
    return list(body["items"])


def the_pod(node: Any, namespace: str) -> dict[str, Any] | None:
    found = [p for p in pods(node, namespace) if not p["metadata"].get("deletionTimestamp")]
    return found[0] if len(found) == 1 else None


def statuses(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in pod.get("status", {}).get("containerStatuses") or []}


def restarts(node: Any, namespace: str) -> dict[str, int]:
    pod = the_pod(node, namespace)
    assert pod is not None, f"not one pod in {namespace}: {pods(node, namespace)}"
    return {name: status["restartCount"] for name, status in statuses(pod).items()}


def healthz(node: Any, namespace: str, port: int) -> tuple[int, Any]:
    """canaryd's /healthz (JSON) through the API server's pod proxy."""
    pod = the_pod(node, namespace)
    if pod is None:
        return 0, None
    name = pod["metadata"]["name"]
    path = f"/api/v1/namespaces/{namespace}/pods/{name}:{port}/proxy/healthz?verbose"
    return node.plane.request("GET", path)  # type: ignore[no-any-return]


def canary(node: Any, namespace: str) -> None:
    node.plane.request("POST", "/api/v1/namespaces", {"metadata": {"name": namespace}})
    sample = yaml.safe_load((CONFIG / "samples" / "flinkdeployment-canary.yaml").read_text())
    status, body = node.plane.request(
        "POST", f"/apis/flink.apache.org/v1beta1/namespaces/{namespace}/flinkdeployments", sample
    )
    assert status == 201, body


def canary_state(node: Any, namespace: str, port: int, canaries_in: str) -> str | None:
    status, body = healthz(node, namespace, port)
    if status not in (200, 500) or not isinstance(body, dict):
        return None
    states = [c["state"] for c in body["canaries"] if c["namespace"] == canaries_in]
    return states[0] if states else None


def container_id(node: Any, namespace: str, container: str) -> str:
    pod = the_pod(node, namespace)
    assert pod is not None
    return str(statuses(pod)[container]["containerID"]).removeprefix("containerd://")


MEASURED = ROOT / ".cache" / "node" / "restarts-measured.jsonl"
"""Every count measured here, one JSON line each: what tests/fixtures/node-restarts.json
is refreshed from."""


def against_fixture(scenario: str, topology: str, container: str, count: int) -> None:
    """A measured restart count, checked against tests/fixtures/node-restarts.json's
    real-kubelet figure for the scenario (the simulation's side is checked against the
    same row by ``make test-slow``)."""
    from tests.node import restarts as fixture

    row = fixture.row(scenario, topology, container)
    MEASURED.parent.mkdir(parents=True, exist_ok=True)
    with MEASURED.open("a") as out:
        measured = {"scenario": scenario, "topology": topology, "container": container}
        out.write(json.dumps({**measured, "real": count, "at": time.time()}) + "\n")
    assert fixture.within(row, "real", count), (
        f"{scenario} / {topology} / {container}: restarted {count} times, the fixture says "
        f"{row['real']} (accepted {fixture.bounds(row, 'real')}): tests/fixtures/node-restarts.json"
    )


# ------------------------------------------------------------------ the chart
#
# make dist's chart package installed with `helm install` (Helm of `make helm`) as the
# README says, the operator's service account given as it says, but for the image's pull
# policy (the image is this node's, never pulled), the cycle and the namespace. These run
# first and the release is uninstalled after them: its canaryd watches every namespace,
# and would bump the canaries of the tests below too.

CHART = DIST / f"canaryd-{__version__}.tgz"
"""The chart as released (make dist)."""
CHART_NAMESPACE = "e2e-chart"
"""The release's namespace (the README's is canaryd, which config/standalone takes below)."""
CHART_CANARIES = "e2e-chart-canaries"
RELEASE = "canaryd"
CHART_VALUES = ("image.pullPolicy=Never", f"timeout={CYCLE}")
"""What differs from the README's values here."""


@functools.cache
def readme_install() -> tuple[str, ...]:
    """The README's ``helm install`` of the chart, word for word after the chart's
    reference and version (CHART is the package a release publishes there), but for
    ``--namespace`` (Release.helm gives CHART_NAMESPACE)."""
    text = (ROOT / "README.md").read_text()
    start = r"\n    (helm install canaryd oci://\S+/charts/canaryd "
    (command,) = re.findall(start + r"(?:[^\n]*\\\n)*[^\n]*)", text)
    words = command.replace("\\\n", " ").split()
    assert words[:3] == ["helm", "install", RELEASE] and "#" not in words, words
    for flag in ("--version", "--namespace"):
        at = words.index(flag)
        del words[at : at + 2]
    return tuple(words[4:])


def operator_account() -> tuple[str, str]:
    """The operator's service account (namespace, name) as the README gives it."""
    words = readme_install()
    key = "admissionPolicy.operatorServiceAccount="
    (account,) = [w.removeprefix(key) for w in words if w.startswith(key)]
    namespace, _, name = account.partition("/")
    return namespace, name


def the_operators_account(node: Any) -> None:
    """The operator's namespace and service account, as its chart makes them: the
    README installs the operator first (the chart's Role for that account goes in its
    namespace, and config/standalone's too)."""
    namespace, name = operator_account()
    node.plane.request("POST", "/api/v1/namespaces", {"metadata": {"name": namespace}})
    status, body = node.plane.request(
        "POST", f"/api/v1/namespaces/{namespace}/serviceaccounts", {"metadata": {"name": name}}
    )
    assert status in (201, 409), body


FLINK = "/apis/flink.apache.org/v1beta1/namespaces/{}/flinkdeployments"


class Release:
    """The release of charts/canaryd, and Helm run against the node as the admin."""

    def __init__(self, node: Any, home: Path) -> None:
        self.node = node
        self.home = home
        self.installed_at = 0.0

    def helm(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        env = {
            **os.environ,
            "HELM_CACHE_HOME": str(self.home / "cache"),
            "HELM_CONFIG_HOME": str(self.home / "config"),
            "HELM_DATA_HOME": str(self.home / "data"),
        }
        argv = [str(helm_binary()), *args, "--namespace", CHART_NAMESPACE]
        argv += ["--kubeconfig", str(self.node.plane.kubeconfig("admin"))]
        return subprocess.run(
            argv, capture_output=True, text=True, env=env, timeout=timeout, check=False
        )

    def values(self, *more: str) -> list[str]:
        """The README's --set values, then this node's and ``more``."""
        readme = [w for w in readme_install() if w != "--create-namespace"]
        return [*readme, *(arg for value in (*CHART_VALUES, *more) for arg in ("--set", value))]


def release_pods(node: Any) -> list[dict[str, Any]]:
    """The Deployment's live pods (the helm test pod carries the same labels)."""
    return [
        p
        for p in pods(node, CHART_NAMESPACE)
        if not p["metadata"].get("deletionTimestamp")
        and any(o["kind"] == "ReplicaSet" for o in p["metadata"].get("ownerReferences") or [])
    ]


def pod_ready(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def metrics(node: Any, pod: dict[str, Any]) -> dict[str, float]:
    """A pod's /metrics (port 8085) through the API server's pod proxy: series -> value."""
    name = pod["metadata"]["name"]
    text = node.kubectl(
        "get", "--raw", f"/api/v1/namespaces/{CHART_NAMESPACE}/pods/{name}:8085/proxy/metrics"
    )
    found = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            found[series] = float(value)
    return found


def bumps(series: dict[str, float]) -> dict[str, float]:
    """canaryd_bumps_total by result, the results counted at least once."""
    prefix = 'canaryd_bumps_total{result="'
    return {k[len(prefix) : -2]: v for k, v in series.items() if k.startswith(prefix) and v}


def nonce(node: Any) -> int:
    status, body = node.plane.request("GET", FLINK.format(CHART_CANARIES) + "/canary")
    assert status == 200, body
    return int(body.get("spec", {}).get("restartNonce") or 0)


def as_operator(node: Any, *args: str) -> subprocess.CompletedProcess[str]:
    """kubectl as the operator's service account (the admin impersonates it)."""
    argv = ["kubectl", f"--kubeconfig={node.plane.kubeconfig('admin')}"]
    account = "system:serviceaccount:{}:{}".format(*operator_account())
    argv += [f"--as={account}", "-n", CHART_CANARIES, *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


@pytest.fixture(scope="class")
def release(node: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Release]:
    """charts/canaryd installed (``helm install``, not waited for), a canary in a
    namespace of its own, a binder for the release's pods (no scheduler here); after the
    class, whatever is left is removed so that the tests below start without it."""
    from tests.node.cluster import Binder

    made = Release(node, tmp_path_factory.mktemp("helm"))
    binder = Binder(node)
    binder.start()
    try:
        canary(node, CHART_CANARIES)
        the_operators_account(node)
        made.installed_at = time.monotonic()
        assert "--create-namespace" in readme_install()
        installed = made.helm("install", RELEASE, str(CHART), "--create-namespace", *made.values())
        assert installed.returncode == 0, f"helm install: {installed.stderr}"
        try:
            yield made
        finally:
            made.helm("uninstall", RELEASE, "--wait", "--timeout", "2m")  # after a failure
            for namespace in (CHART_NAMESPACE, CHART_CANARIES):
                node.plane.request("DELETE", f"/api/v1/namespaces/{namespace}")
            wait(
                lambda: all(
                    node.plane.request("GET", f"/api/v1/namespaces/{ns}")[0] == 404
                    for ns in (CHART_NAMESPACE, CHART_CANARIES)
                ),
                "the chart's namespaces deleted",
                180,
            )
    finally:
        binder.stop()


class TestTheChart:
    """charts/canaryd installed for real, in order: one release, upgraded to high
    availability, then uninstalled."""

    def test_its_pod_is_ready_non_root_read_only_and_bumps(self, node, release):
        """The release's pod Ready; non-root 65532 with a read-only root filesystem, in
        its spec and in the running container; it bumps the canary's restartNonce (no
        other canaryd runs meanwhile)."""
        pod = wait(
            lambda: (ps := release_pods(node)) and len(ps) == 1 and pod_ready(ps[0]) and ps[0],
            "the release's pod Ready",
            180,
        )
        ready_after = time.monotonic() - release.installed_at
        container = pod["spec"]["containers"][0]
        assert container["image"] == CANARYD_IMAGE, container["image"]
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True, pod["spec"]
        assert pod["spec"]["securityContext"]["runAsUser"] == 65532, pod["spec"]
        security = container["securityContext"]
        assert security["readOnlyRootFilesystem"] is True, security
        assert security["runAsNonRoot"] is True and security["allowPrivilegeEscalation"] is False
        cid = str(statuses(pod)["canaryd"]["containerID"]).removeprefix("containerd://")
        out = node.exec(cid, "id -u; touch /x 2>&1; touch /tmp/x && echo tmp-ok").splitlines()
        assert out[0] == "65532", out
        assert "Read-only file system" in out[1], out
        assert out[2] == "tmp-ok", out
        at_ready = nonce(node)
        ready_at = time.monotonic()
        wait(lambda: nonce(node) > at_ready, "the release's canaryd to bump the canary", 60)
        bump_after = time.monotonic() - ready_at
        written = bumps(metrics(node, pod)).get("written", 0)
        assert written >= 1, f"the canary was bumped, but not by the release's pod: {written}"
        print(
            f"chart: pod Ready {ready_after:.1f} s after helm install, a bump "
            f"{bump_after:.1f} s after Ready (nonce {at_ready} -> {nonce(node)}, "
            f"{written:.0f} written by the pod)"
        )

    def test_helm_test_passes_and_names_a_removed_patch_permission(self, node, release):
        """``helm test`` (canaryd check) exits 0; with patch removed from the release's
        ClusterRole, it exits non-zero and its pod's log names ``patch flinkdeployments``;
        with the operator's service account deleted, it names that account."""
        passed = release.helm("test", RELEASE, "--timeout", "2m")
        assert passed.returncode == 0, f"helm test: {passed.stdout}{passed.stderr}"
        path = f"/apis/rbac.authorization.k8s.io/v1/clusterroles/{RELEASE}-{CHART_NAMESPACE}"
        status, role = node.plane.request("GET", path)
        assert status == 200, role
        rules = json.loads(json.dumps(role["rules"]))
        for rule in role["rules"]:
            if "flinkdeployments" in rule["resources"]:
                rule["verbs"] = [v for v in rule["verbs"] if v != "patch"]
        status, body = node.plane.request("PUT", path, role)
        assert status == 200, body
        try:
            failed = release.helm("test", RELEASE, "--timeout", "2m")
            log = node.kubectl("-n", CHART_NAMESPACE, "logs", f"{RELEASE}-check")
            _, check = node.plane.request(
                "GET", f"/api/v1/namespaces/{CHART_NAMESPACE}/pods/{RELEASE}-check"
            )
        finally:
            _, role = node.plane.request("GET", path)
            role["rules"] = rules
            status, body = node.plane.request("PUT", path, role)
            assert status == 200, body
        print(f"chart: helm test exit {passed.returncode}; patch removed: exit {failed.returncode}")
        print(log)
        assert failed.returncode != 0, f"helm test passed without patch: {failed.stdout}"
        assert "patch flinkdeployments" in log, log
        terminated = statuses(check)["check"]["state"]["terminated"]
        assert terminated["exitCode"] == 2, terminated
        # The operator's account, which the policy names, gone: helm test fails naming it.
        namespace, name = operator_account()
        status, body = node.plane.request(
            "DELETE", f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}"
        )
        assert status == 200, body
        try:
            gone = release.helm("test", RELEASE, "--timeout", "2m")
            log = node.kubectl("-n", CHART_NAMESPACE, "logs", f"{RELEASE}-check")
        finally:
            the_operators_account(node)
        print(f"chart: the operator's account deleted: helm test exit {gone.returncode}\n{log}")
        assert gone.returncode != 0, f"helm test passed without the account: {gone.stdout}"
        assert f"MISSING serviceaccount {name} in {namespace}: " in log, log

    def test_the_admission_policy_refuses_a_stale_copy_of_the_operator(self, node, release):
        """As the operator's service account (granted update on flinkdeployments here):
        a stale copy of the canary, which would drop a label added since, is refused with
        the policy's message; a bump on a fresh copy passes."""
        name = f"{RELEASE}-{CHART_NAMESPACE}-keep-canary-metadata"
        status, policy = node.plane.request(
            "GET", f"/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies/{name}"
        )
        assert status == 200, policy
        message = " ".join(policy["spec"]["validations"][0]["message"].split())
        grant = {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": "e2e-chart-operator"},
            "rules": [
                {
                    "apiGroups": ["flink.apache.org"],
                    "resources": ["flinkdeployments"],
                    "verbs": ["get", "update"],
                }
            ],
        }
        binding = {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "e2e-chart-operator"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "e2e-chart-operator",
            },
            "subjects": [
                {
                    "kind": "ServiceAccount",
                    "name": operator_account()[1],
                    "namespace": operator_account()[0],
                }
            ],
        }
        rbac = "/apis/rbac.authorization.k8s.io/v1"
        for obj, plural in ((grant, "clusterroles"), (binding, "clusterrolebindings")):
            status, body = node.plane.request("POST", f"{rbac}/{plural}", obj)
            assert status == 201, body
        try:
            stale = json.loads(
                as_operator(node, "get", "flinkdeployment", "canary", "-o", "json").stdout
            )
            status, body = node.plane.request(
                "PATCH",
                FLINK.format(CHART_CANARIES) + "/canary",
                {"metadata": {"labels": {"e2e.canaryd.io/team": "a"}}},
                content_type="application/merge-patch+json",
            )
            assert status == 200, body
            stale["metadata"].pop("resourceVersion")
            stale["spec"]["restartNonce"] = int(stale["spec"].get("restartNonce") or 0) + 1
            copy = release.home / "stale.json"
            copy.write_text(json.dumps(stale))
            # The policy was made with the release; the API server's admission reads it
            # from an informer: server-side dry runs (nothing stored) until it answers.
            wait(
                lambda: (
                    message
                    in as_operator(node, "replace", "--dry-run=server", "-f", str(copy)).stderr
                ),
                "the admission policy to refuse a dry run",
                30,
            )
            refused = as_operator(node, "replace", "-f", str(copy))
            assert refused.returncode != 0 and message in " ".join(refused.stderr.split()), (
                f"the stale copy was not refused by the policy: {refused.stdout}{refused.stderr}"
            )
            status, kept = node.plane.request("GET", FLINK.format(CHART_CANARIES) + "/canary")
            assert kept["metadata"]["labels"].get("e2e.canaryd.io/team") == "a", kept["metadata"]

            def fresh_bump() -> subprocess.CompletedProcess[str] | None:
                fresh = json.loads(
                    as_operator(node, "get", "flinkdeployment", "canary", "-o", "json").stdout
                )
                fresh["spec"]["restartNonce"] = int(fresh["spec"].get("restartNonce") or 0) + 1
                copy.write_text(json.dumps(fresh))
                done = as_operator(node, "replace", "-f", str(copy))
                # canaryd bumps the same canary: a 409 is a race lost, not a refusal
                return None if "the object has been modified" in done.stderr else done

            passed = wait(fresh_bump, "a fresh copy's bump without a conflict", 30)
            assert passed.returncode == 0, f"a fresh copy's bump was refused: {passed.stderr}"
            print(f"chart: the policy refused the stale copy: {refused.stderr.strip()}")
        finally:
            for plural, obj in (("clusterrolebindings", binding), ("clusterroles", grant)):
                node.plane.request("DELETE", f"{rbac}/{plural}/{obj['metadata']['name']}")

    def test_high_availability_one_replica_holds_the_lease_and_bumps(self, node, release):
        """Upgraded with ``highAvailability.enabled=true``: two replicas, the Lease held
        by one of them, which writes bumps; the other writes none and says it follows."""
        upgraded = release.helm(
            "upgrade", RELEASE, str(CHART), *release.values("highAvailability.enabled=true")
        )
        assert upgraded.returncode == 0, f"helm upgrade: {upgraded.stderr}"
        started = time.monotonic()

        def two_ready() -> list[dict[str, Any]] | None:
            found = release_pods(node)
            electing = [p for p in found if "--leader-elect" in p["spec"]["containers"][0]["args"]]
            ok = len(found) == 2 and len(electing) == 2 and all(map(pod_ready, found))
            return found if ok else None

        replicas = wait(two_ready, "two replicas with --leader-elect Ready", 180)
        names = {p["metadata"]["name"] for p in replicas}
        lease = f"/apis/coordination.k8s.io/v1/namespaces/{CHART_NAMESPACE}/leases/{RELEASE}"

        def holder() -> str | None:
            status, body = node.plane.request("GET", lease)
            held = body.get("spec", {}).get("holderIdentity") if status == 200 else None
            return held if held in names else None

        leader_name = wait(holder, "one of the replicas to hold the Lease", 60)
        leader = next(p for p in replicas if p["metadata"]["name"] == leader_name)
        follower = next(p for p in replicas if p["metadata"]["name"] != leader_name)
        # Two bumps of the one canary: the leader wrote for a whole cycle, the follower
        # watching the same canary meanwhile.
        wait(
            lambda: bumps(metrics(node, leader)).get("written", 0) >= 2,
            "the leader to write two bumps",
            60,
        )
        led, followed = metrics(node, leader), metrics(node, follower)
        print(
            f"chart HA: {len(replicas)} replicas Ready {time.monotonic() - started:.1f} s after "
            f"helm upgrade; Lease held by {leader_name}; bumps leader {bumps(led)}, "
            f"follower {bumps(followed)}"
        )
        assert holder() == leader_name, "the Lease changed hands"
        gauges = (led.get("canaryd_leader"), followed.get("canaryd_leader"))
        assert gauges == (1, 0), f"canaryd_leader of the leader and the follower: {gauges}"
        assert bumps(followed) == {}, f"the follower wrote or tried bumps: {bumps(followed)}"

    def test_helm_uninstall_removes_what_the_chart_made(self, node, release):
        """Every object of the release's manifest gone after ``helm uninstall``, and the
        release's pods. Left in the release's namespace, until it goes: the pod of the
        last ``helm test`` (a test hook: Helm deletes it only before the next test) and
        the Lease, canaryd's own object, not the chart's. The leader's release of the
        Lease on SIGTERM is refused (403), since Helm deletes the Lease Role's binding
        and the ServiceAccount while the pods stop: the Lease stays held by the gone
        leader until it expires (15 s), which a new install then waits out."""
        manifest = release.helm("get", "manifest", RELEASE)
        assert manifest.returncode == 0, manifest.stderr
        made = [d for d in yaml.safe_load_all(manifest.stdout) if d]
        # By namespace (kubectl get -f refuses an object of another namespace than -n's):
        # the release's, and the operator's (the Role to get its service account).
        listed = {d["metadata"].get("namespace", CHART_NAMESPACE) for d in made}
        for namespace in listed:
            (release.home / f"manifest-{namespace}.yaml").write_text(
                yaml.safe_dump_all(
                    [
                        d
                        for d in made
                        if d["metadata"].get("namespace", CHART_NAMESPACE) == namespace
                    ]
                )
            )
        kinds = sorted({d["kind"] for d in made})
        names = {p["metadata"]["name"] for p in release_pods(node)}
        kubectl = ["kubectl", f"--kubeconfig={node.plane.kubeconfig('admin')}"]
        logs = [  # each replica's log to its end, for what it did with the Lease
            subprocess.Popen(
                [*kubectl, "-n", CHART_NAMESPACE, "logs", "-f", name],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for name in sorted(names)
        ]
        try:
            uninstalled = release.helm("uninstall", RELEASE, "--wait", "--timeout", "2m")
            assert uninstalled.returncode == 0, f"helm uninstall: {uninstalled.stderr}"
            wait(
                lambda: not {p["metadata"]["name"] for p in pods(node, CHART_NAMESPACE)} & names,
                "the release's pods deleted",
                120,
            )
            said = [log.communicate(timeout=30)[0] for log in logs]
        finally:
            for log in logs:
                log.kill()
        left = "".join(
            node.kubectl(
                "-n",
                namespace,
                "get",
                "-f",
                str(release.home / f"manifest-{namespace}.yaml"),
                "--ignore-not-found",
                "-o",
                "name",
            )
            for namespace in sorted(listed)
        )
        assert left.strip() == "", f"left by helm uninstall: {left}"
        remaining = {
            kind: sorted(
                o["metadata"]["name"]
                for o in node.plane.request("GET", path.format(CHART_NAMESPACE))[1]["items"]
            )
            for kind, path in (
                ("pods", "/api/v1/namespaces/{}/pods"),
                ("leases", "/apis/coordination.k8s.io/v1/namespaces/{}/leases"),
                ("secrets", "/api/v1/namespaces/{}/secrets"),
                ("services", "/api/v1/namespaces/{}/services"),
                ("serviceaccounts", "/api/v1/namespaces/{}/serviceaccounts"),
            )
        }
        _, lease = node.plane.request(
            "GET", f"/apis/coordination.k8s.io/v1/namespaces/{CHART_NAMESPACE}/leases/{RELEASE}"
        )
        released = [line for text in said for line in text.splitlines() if '"lease_release' in line]
        print(f"chart: helm uninstall removed {len(made)} objects ({', '.join(kinds)})")
        print(f"chart: left after it {remaining}; the Lease's holder {lease['spec']}")
        print("chart: " + "\n".join(released))
        assert remaining == {
            "pods": [f"{RELEASE}-check"],
            "leases": [RELEASE],
            "secrets": [],
            "services": [],
            "serviceaccounts": ["default"],
        }, remaining
        holder = lease["spec"].get("holderIdentity") or ""
        assert holder in names | {""}, f"the Lease held by another: {lease['spec']}"


# ---------------------------------------------------------------- standalone


STANDALONE = "canaryd"
"""config/standalone's namespace."""


@pytest.fixture(scope="module")
def standalone(node: Any) -> Iterator[Path]:
    """config/standalone applied with kubectl, the image set with kustomize, as the
    README says; deleted again after its tests."""
    directory = overlay(
        "standalone",
        {
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            "resources": [relative(CONFIG / "standalone", "standalone")],
            "images": [{"name": "canaryd", "newName": IMAGE_NAME, "newTag": IMAGE_TAG}],
            "patches": [
                {
                    "target": {"kind": "Deployment", "name": "canaryd"},
                    "patch": json.dumps(
                        [
                            {
                                "op": "add",
                                "path": "/spec/template/spec/nodeName",
                                "value": "localhost",
                            },
                            {
                                "op": "add",
                                "path": "/spec/template/spec/containers/0/imagePullPolicy",
                                "value": "Never",
                            },
                            {
                                "op": "replace",
                                "path": "/spec/template/spec/containers/0/args",
                                "value": [f"--timeout={CYCLE}"],
                            },
                        ]
                    ),
                }
            ],
        },
    )
    canary(node, "e2e-standalone")
    the_operators_account(node)  # config/standalone's: flink-operator/flink-operator
    node.kubectl("apply", "-k", str(directory))
    try:
        yield directory
    finally:
        node.kubectl("delete", "-k", str(directory), "--wait=true", timeout=300)


def test_the_image_as_shipped(node, standalone):
    """Non-root 65532, a read-only root filesystem with the /tmp emptyDir (in the
    running pod of config/standalone), and ``canaryd --version`` in a pod of the same
    template (its own: a second canaryd process in the running container's 192 Mi
    would be over its memory limit, and the OOM killer picks canaryd)."""
    wait(
        lambda: (p := the_pod(node, STANDALONE)) and statuses(p).get("canaryd", {}).get("ready"),
        "canaryd Ready",
        180,
    )
    cid = container_id(node, STANDALONE, "canaryd")
    out = node.exec(cid, "id -u; id -g; touch /x 2>&1; touch /tmp/x && echo tmp-ok")
    lines = out.splitlines()
    assert lines[:2] == ["65532", "65532"], out
    assert "Read-only file system" in lines[2], out
    assert lines[3] == "tmp-ok", out
    status, deployment = node.plane.request(
        "GET", f"/apis/apps/v1/namespaces/{STANDALONE}/deployments/canaryd"
    )
    assert status == 200, deployment
    template = deployment["spec"]["template"]
    template["spec"]["containers"][0]["args"] = ["--version"]
    template["spec"]["containers"][0].pop("livenessProbe")
    template["spec"]["containers"][0].pop("readinessProbe")
    template["spec"]["restartPolicy"] = "Never"
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "version"}, **template}
    pod["metadata"] = {"name": "version"}
    status, body = node.plane.request("POST", f"/api/v1/namespaces/{STANDALONE}/pods", pod)
    assert status == 201, body

    def finished() -> str | None:
        _, got = node.plane.request("GET", f"/api/v1/namespaces/{STANDALONE}/pods/version")
        phase = got.get("status", {}).get("phase")
        return phase if phase in ("Succeeded", "Failed") else None

    assert wait(finished, "canaryd --version to finish", 120) == "Succeeded"
    status, log = node.plane.request("GET", f"/api/v1/namespaces/{STANDALONE}/pods/version/log")
    assert status == 200 and log is None  # plain text, not JSON: read it raw below
    assert node.kubectl("-n", STANDALONE, "logs", "version").strip() == f"canaryd {__version__}"
    node.plane.request("DELETE", f"/api/v1/namespaces/{STANDALONE}/pods/version")


def test_standalone_authenticates_in_cluster_and_checks(node, standalone):
    """canaryd in its pod, with the projected service-account token and the
    ``kubernetes`` Service's address the kubelet gives it (no kubeconfig): the canary
    healthy, the pod Ready, nothing restarted."""
    state = wait(
        lambda: canary_state(node, STANDALONE, 8085, "e2e-standalone") == "healthy",
        "the canary healthy through canaryd in its pod",
        180,
    )
    assert state
    pod = the_pod(node, STANDALONE)
    assert pod is not None
    assert pod["spec"]["serviceAccountName"] == "canaryd"
    mounts = {m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]}
    assert "/var/run/secrets/kubernetes.io/serviceaccount" in mounts
    assert restarts(node, STANDALONE) == {"canaryd": 0}


def test_standalone_canaryd_wedged_is_restarted_once(node, standalone):
    """SIGSTOP in the container: /livez times out, the kubelet restarts canaryd
    (SIGTERM is not acted on by a stopped process: SIGKILL after the grace period),
    once; the new process checks again."""
    wait(
        lambda: canary_state(node, STANDALONE, 8085, "e2e-standalone") == "healthy",
        "healthy",
        180,
    )
    before = restarts(node, STANDALONE)["canaryd"]
    node.ctr("tasks", "kill", "-a", "-s", "SIGSTOP", container_id(node, STANDALONE, "canaryd"))
    wait(lambda: restarts(node, STANDALONE)["canaryd"] == before + 1, "canaryd restarted", 180)
    wait(
        lambda: canary_state(node, STANDALONE, 8085, "e2e-standalone") == "healthy",
        "the restarted canaryd healthy",
        180,
    )
    # What is asserted is an absence: it needs the time a second restart would take
    # to show (one liveness budget, 3 x 10 s + the timeout), not an event to wait for.
    time.sleep(40)
    assert restarts(node, STANDALONE)["canaryd"] == before + 1
    against_fixture("canaryd wedged (SIGSTOP)", "standalone", "canaryd", 1)


# ------------------------------------------------------------------- sidecar


def operator_config(namespace: str) -> dict[str, Any]:
    """The operator's ConfigMap as the chart renders it (its own defaults: config/sidecar
    replaces nothing of it; the reporter is its override ConfigMap's, on canaryd's default
    port, where the stand-in serves it), the cycle shortened and the watched namespace the
    test's own."""
    conf = CHART_DEFAULT_OVERRIDES
    conf += f"kubernetes.operator.health.canary.resource.timeout: {CYCLE}\n"
    conf += f"kubernetes.operator.watched.namespaces: {namespace}\n"
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "flink-operator-config"},
        "data": {"flink-conf.yaml": conf, "log4j-operator.properties": ""},
    }


STAND_IN = (
    'printf "clusters: [{cluster: {server: \\"https://%s:%s\\"}}]\\n'
    'users: [{user: {token: \\"%s\\"}}]\\n" "$KUBERNETES_SERVICE_HOST" '
    '"$KUBERNETES_SERVICE_PORT" "$(cat /var/run/secrets/kubernetes.io/serviceaccount/token)"'
    " > /tmp/kubeconfig && exec python -m canaryd.testing.operator --kubeconfig /tmp/kubeconfig"
    " --host 0.0.0.0 --metrics-port 9249 --probe-port 8085 --namespace $WATCHED"
)
"""The stand-in operator (canaryd/testing/operator.py, in canaryd's image: an image with
bash, so the operator container's exec probe runs for real): it reconciles the canaries
and serves JOSDK counters as Flink's Prometheus reporter does."""


HTTP_PROBE = {
    "httpGet": {"path": "/healthz", "port": 8086},
    "periodSeconds": 10,
    "failureThreshold": 3,
    "timeoutSeconds": 2,
}
"""The operator's liveness as config/sidecar had it before the exec probe."""


def sidecar(
    node: Any,
    namespace: str,
    canaryd_image: str,
    *canaryd_args: str,
    liveness: dict[str, Any] | None = None,
) -> Path:
    """config/sidecar-example (config/sidecar on a stand-in of the chart's Deployment)
    in ``namespace``, its operator container the stand-in operator (``liveness``:
    another livenessProbe for it)."""
    name = f"sidecar-{namespace}"
    new_name, _, tag = canaryd_image.partition(":")
    patches = [
        {"op": "add", "path": "/spec/template/spec/nodeName", "value": "localhost"},
        {"op": "add", "path": "/spec/template/spec/containers/0/imagePullPolicy", "value": "Never"},
        {
            "op": "add",
            "path": "/spec/template/spec/containers/0/command",
            "value": ["bash", "-c", STAND_IN],
        },
        {
            "op": "add",
            "path": "/spec/template/spec/containers/0/env",
            "value": [
                {
                    "name": "SSL_CERT_FILE",
                    "value": "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt",
                },
                {"name": "WATCHED", "value": namespace},
            ],
        },
        {"op": "add", "path": "/spec/template/spec/containers/1/imagePullPolicy", "value": "Never"},
    ]
    patches += [
        {"op": "add", "path": "/spec/template/spec/containers/1/args/-", "value": arg}
        for arg in canaryd_args
    ]
    if liveness is not None:
        patches.append(
            {
                "op": "replace",
                "path": "/spec/template/spec/containers/0/livenessProbe",
                "value": liveness,
            }
        )
    directory = overlay(
        name,
        {
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            "namespace": namespace,
            "resources": [relative(CONFIG / "sidecar-example", name), "operator.yaml"],
            "images": [
                {"name": "canaryd", "newName": new_name, "newTag": tag},
                {
                    "name": "ghcr.io/apache/flink-kubernetes-operator",
                    "newName": IMAGE_NAME,
                    "newTag": IMAGE_TAG,
                },
            ],
            "patches": [
                {"target": {"kind": "Deployment", "name": OPERATOR}, "patch": json.dumps(patches)}
            ],
        },
        (
            "operator.yaml",
            [
                {
                    "apiVersion": "v1",
                    "kind": "ServiceAccount",
                    "metadata": {"name": "flink-operator"},
                },
                operator_config(namespace),
                {
                    "apiVersion": "rbac.authorization.k8s.io/v1",
                    "kind": "RoleBinding",
                    "metadata": {"name": "flink-operator"},
                    "roleRef": {
                        "apiGroup": "rbac.authorization.k8s.io",
                        "kind": "ClusterRole",
                        "name": "e2e-flink-operator",
                    },
                    "subjects": [{"kind": "ServiceAccount", "name": "flink-operator"}],
                },
            ],
        ),
    )
    canary(node, namespace)
    node.kubectl("apply", "-k", str(directory))
    return directory


@pytest.fixture(scope="module")
def operator_role(node: Any) -> None:
    """What the chart grants the operator on the canary kinds (and what canaryd, its
    sidecar, uses with the operator's service account)."""
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": "e2e-flink-operator"},
        "rules": [
            {
                "apiGroups": ["flink.apache.org"],
                "resources": ["flinkdeployments", "flinksessionjobs"],
                "verbs": ["get", "list", "watch", "patch", "update"],
            }
        ],
    }
    status, body = node.plane.request(
        "POST", "/apis/rbac.authorization.k8s.io/v1/clusterroles", role
    )
    assert status in (201, 409), body


ABSENT_FOR = 300.0
"""Seconds canaryd stays absent: five minutes of the shipped probe timings."""


def test_canaryd_absent_never_restarts_the_operator(node, operator_role):
    """canaryd's image missing (ErrImageNeverPull), canaryd exiting 2 on a bad
    configuration (CrashLoopBackOff): the operator restarted 0 times in 5 minutes. The
    same stand-in with the httpGet probe this replaced is restarted meanwhile (so the
    kubelet did probe)."""
    sidecar(node, "e2e-no-image", "localhost/canaryd:not-there")
    sidecar(node, "e2e-exit-2", CANARYD_IMAGE, "--timeout=soon")
    sidecar(node, "e2e-http-probe", "localhost/canaryd:not-there", liveness=HTTP_PROBE)
    for namespace in ("e2e-no-image", "e2e-exit-2", "e2e-http-probe"):
        wait(
            lambda ns=namespace: (
                (p := the_pod(node, ns)) and statuses(p).get(OPERATOR, {}).get("started")
            ),
            f"the operator started in {namespace}",
            180,
        )
    # The scenario is five minutes of canaryd's absence: restarts are counted after it.
    time.sleep(ABSENT_FOR)
    no_image = restarts(node, "e2e-no-image")
    exit_2 = restarts(node, "e2e-exit-2")
    http = restarts(node, "e2e-http-probe")
    print(
        f"restarts after {ABSENT_FOR:.0f} s: image missing {no_image}, exit 2 {exit_2}, "
        f"httpGet probe {http}"
    )
    waiting = statuses(the_pod(node, "e2e-no-image") or {})["canaryd"]["state"]
    assert waiting.get("waiting", {}).get("reason") == "ErrImageNeverPull", waiting
    assert no_image == {OPERATOR: 0, "canaryd": 0}, no_image
    assert exit_2[OPERATOR] == 0 and exit_2["canaryd"] >= 2, exit_2
    last = statuses(the_pod(node, "e2e-exit-2") or {})["canaryd"]["lastState"]["terminated"]
    assert last["exitCode"] == 2, last
    assert http[OPERATOR] >= 1, f"the httpGet probe would have restarted the operator: {http}"
    against_fixture("canaryd's image missing, 5 min", "sidecar", OPERATOR, no_image[OPERATOR])
    against_fixture("canaryd exits 2, 5 min", "sidecar", OPERATOR, exit_2[OPERATOR])
    against_fixture("canaryd exits 2, 5 min", "sidecar", "canaryd", exit_2["canaryd"])
    for namespace in ("e2e-no-image", "e2e-exit-2", "e2e-http-probe"):
        node.plane.request("DELETE", f"/api/v1/namespaces/{namespace}")  # less load after


def test_an_unhealthy_verdict_restarts_the_operator_once(node, operator_role):
    """The stand-in operator's informers stall (SIGUSR1: its metrics still answer):
    canaryd's verdict is unhealthy, the exec probe fails on the 500, the kubelet
    restarts the operator container; the new operator process reconciles, so it is
    restarted exactly once."""
    namespace = "e2e-verdict"
    sidecar(node, namespace, CANARYD_IMAGE)
    wait(
        lambda: canary_state(node, namespace, 8086, namespace) == "healthy",
        "the canary healthy through the sidecar",
        240,
    )
    node.ctr("tasks", "kill", "-s", "SIGUSR1", container_id(node, namespace, OPERATOR))
    wait(lambda: restarts(node, namespace)[OPERATOR] == 1, "the operator restarted", 240)
    wait(
        lambda: canary_state(node, namespace, 8086, namespace) == "healthy",
        "healthy with the new operator process",
        240,
    )
    # An absence again: a second restart would show within a liveness budget.
    time.sleep(60)
    assert restarts(node, namespace) == {OPERATOR: 1, "canaryd": 0}
    for container in (OPERATOR, "canaryd"):
        count = restarts(node, namespace)[container]
        against_fixture("unhealthy verdict (operator wedged)", "sidecar", container, count)
    node.plane.request("DELETE", f"/api/v1/namespaces/{namespace}")  # less load after


# -------------------------------------------------------------------- faults
#
# Through the fault proxy every pod's in-cluster configuration dials (the ``kubernetes``
# Service's address): the standalone canaryd and a sidecar pod meet each fault at once.


FAULTS = "e2e-faults"
"""The sidecar pod the faults below are measured on."""


@pytest.fixture(scope="module")
def faults_sidecar(node: Any, operator_role: None, standalone: Path) -> str:
    sidecar(node, FAULTS, CANARYD_IMAGE)
    return FAULTS


def both_healthy(node: Any) -> bool:
    return (
        canary_state(node, STANDALONE, 8085, "e2e-standalone") == "healthy"
        and canary_state(node, FAULTS, 8086, FAULTS) == "healthy"
    )


def deltas(node: Any, before: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    return {
        namespace: {c: n - counts[c] for c, n in restarts(node, namespace).items()}
        for namespace, counts in before.items()
    }


def test_a_stuck_delivery_path(node, standalone, faults_sidecar):
    """Every established connection to the API server goes silent (half-open: no FIN, no
    RST; new connections work), held until the sidecar's operator was restarted and
    checked again. Standalone: canaryd replaces its silent watch, is never restarted.
    Sidecar: the stand-in operator's informer waits on its silent watch for ever (as a
    real informer without a read timeout does), canaryd's verdict is unhealthy, the exec
    probe fails on the 500, the kubelet restarts the operator: once (the new process'
    connections are new). canaryd is never restarted."""
    wait(lambda: both_healthy(node), "both canaries healthy", 240)
    before = {STANDALONE: restarts(node, STANDALONE), FAULTS: restarts(node, FAULTS)}
    assert node.proxy is not None
    node.proxy.freeze()
    try:
        wait(
            lambda: restarts(node, FAULTS)[OPERATOR] > before[FAULTS][OPERATOR],
            "the sidecar's operator restarted",
            240,
        )
        wait(lambda: both_healthy(node), "both healthy with the new operator process", 240)
    finally:
        node.proxy.heal()
    # An absence: a second restart would show within one liveness budget (3 x 10 s + 5).
    time.sleep(40)
    found = deltas(node, before)
    print(f"stuck delivery path: restarts {found}")
    against_fixture("stuck delivery path", "standalone", "canaryd", found[STANDALONE]["canaryd"])
    for container in (OPERATOR, "canaryd"):
        against_fixture("stuck delivery path", "sidecar", container, found[FAULTS][container])


OUTAGE_FOR = 60.0
"""Seconds the API server's address is black-holed: six of canaryd's cycles here, twice
the liveness budget of either container."""


def test_a_write_outage(node, standalone, faults_sidecar):
    """The API server's address black-holed for a minute (new connects time out,
    established connections freeze), then healed: no write of canaryd's can land, so
    there is no verdict either way (unknown), and nothing is restarted, in either
    topology; both are healthy again after it."""
    wait(lambda: both_healthy(node), "both canaries healthy", 240)
    before = {STANDALONE: restarts(node, STANDALONE), FAULTS: restarts(node, FAULTS)}
    assert node.proxy is not None
    seen: dict[str, set[str | None]] = {STANDALONE: set(), FAULTS: set()}
    node.proxy.blackhole()
    started = time.monotonic()
    try:
        # The outage is a duration: its states are read each second until it ends.
        while time.monotonic() - started < OUTAGE_FOR:
            seen[STANDALONE].add(canary_state(node, STANDALONE, 8085, "e2e-standalone"))
            seen[FAULTS].add(canary_state(node, FAULTS, 8086, FAULTS))
            time.sleep(1)
    finally:
        node.proxy.heal()
    wait(lambda: both_healthy(node), "both healthy after the outage", 240)
    time.sleep(40)  # an absence again: a restart decided late would show meanwhile
    found = deltas(node, before)
    print(f"write outage: states seen {seen}, restarts {found}")
    assert "unknown" in seen[STANDALONE], seen
    against_fixture("write outage", "standalone", "canaryd", found[STANDALONE]["canaryd"])
    for container in (OPERATOR, "canaryd"):
        against_fixture("write outage", "sidecar", container, found[FAULTS][container])
