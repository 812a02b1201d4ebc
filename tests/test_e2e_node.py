"""canaryd in real pods under a real kubelet: ``make e2e-node`` (tests/node).

The image is the repository's Dockerfile built with buildah on a local Debian base; the
manifests are config/ applied with kubectl as the README says (the image set with
kustomize), plus what a cluster without scheduler or registry needs: ``nodeName`` and
``imagePullPolicy: Never``. Timings are the shipped ones (probe periods, thresholds,
grace periods, back-off) but for canaryd's cycle, 10 s instead of 1 min. Restarts are
read from the pods' status, as ``kubectl get pods`` shows them. In ``make test`` every
test here is skipped.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.test_packaging import CHART_DEFAULT_OVERRIDES

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "config"
OVERLAYS = ROOT / ".cache" / "node" / "overlays"
CYCLE = "10s"
"""canaryd's cycle here; everything else is shipped."""
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
    same row by ``make test``)."""
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
            "images": [{"name": "canaryd", "newName": "localhost/canaryd", "newTag": "e2e"}],
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
    assert node.kubectl("-n", STANDALONE, "logs", "version").strip() == "canaryd 0.1.0"
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
                    "newName": "localhost/canaryd",
                    "newTag": "e2e",
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
    sidecar(node, "e2e-exit-2", "localhost/canaryd:e2e", "--timeout=soon")
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
    sidecar(node, namespace, "localhost/canaryd:e2e")
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
    sidecar(node, FAULTS, "localhost/canaryd:e2e")
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
