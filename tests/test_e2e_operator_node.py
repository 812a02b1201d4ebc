"""The real Flink Kubernetes Operator in a real pod under the real kubelet: part of
``make e2e-operator``.

The node of ``make e2e-node`` (tests/node), without the launcher's stand-in CRDs: the
operator's own chart (release-1.15.0, copied by ``make operator``) is installed with
``helm install`` (Helm of ``make helm``), which creates the chart's CRDs. The
operator's image is the jars ``make operator`` built, laid out as the operator's
Dockerfile lays them out, on a Debian bookworm JRE base made here
(tests/operator/image.sh); ``image.pullPolicy=Never``. Webhook off. There is no
scheduler: a binder of this test binds the release's pods to the node, as
kube-scheduler would. The same values for both installs: config/sidecar/helm-values.yaml
and a canary timeout of ``CYCLE`` (the operator's default is 1 min):

- ``upstream``: the chart as it is, the operator's liveness its own probe (:8085);
- ``canaryd``: the same chart through config/helm/post-render: canaryd beside the
  operator, the operator's liveness canaryd's verdict, config/admission's policy.

On each, with the default canary label, the bug report's reproductions: a label and an
annotation added (failure 1), the canary label removed (failure 2), a canary deleted
after its finalizer was removed by hand (failure 4). Restarts are read from pod
status, as ``kubectl get pods`` shows them; the operator's own probe (:8085, through
the API server's pod proxy) is polled every second; the operator's cycles are counted
in its own log ("Scheduling canary check for ..."). What was measured is appended to
``.cache/e2e-operator.jsonl``; docs/OPERATOR.md holds a run's figures.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.node.cluster import CANARYD_IMAGE
from tests.operator import real
from tests.test_helm import _built as tool

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "config"
POST_RENDER = CONFIG / "helm" / "post-render"
HELM_VALUES = CONFIG / "sidecar" / "helm-values.yaml"
IMAGES = ROOT / ".cache" / "node" / "images"
RELEASE = "flink-kubernetes-operator"
RELEASE_NAMESPACE = "flink-operator"
OPERATOR = "flink-kubernetes-operator"
"""The operator's container (the chart's name)."""
CYCLE = 10
"""The operator's canary timeout here, seconds (canaryd reads it from the operator's
config)."""
LABEL = "flink.apache.org/canary"
FD = "/apis/flink.apache.org/v1beta1/namespaces/{ns}/flinkdeployments"
REPORT = Path(
    os.environ.get("CANARYD_OPERATOR_REPORT", real.ROOT / ".cache" / "e2e-operator.jsonl")
)

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        os.environ.get("CANARYD_E2E") != "operator",
        reason="make e2e-operator runs these (the node, the operator's image, Helm)",
    ),
    pytest.mark.timeout(1500),
]


# ------------------------------------------------------------------ the world


@pytest.fixture(scope="module")
def node() -> Iterator[Any]:
    """The node, the chart's CRDs to come, the operator's image in containerd."""
    from tests.node.cluster import Binder, Node, host_state, one_node_per_machine

    problem = real.built()
    if problem is not None:
        pytest.fail(problem)
    image = IMAGES / "flink-kubernetes-operator.tar"
    assert image.is_file(), f"{image} is missing: run tests/operator/image.sh (make e2e-operator)"
    with one_node_per_machine():
        before = host_state()
        started = Node(stand_in_crds=False)
        started.start()
        try:
            started.ctr("images", "import", str(image), timeout=600)
            binder = Binder(started)
            binder.start()
            try:
                yield started
            finally:
                binder.stop()
        finally:
            started.stop()
            after = host_state()
            assert after == before, f"the host differs after the node: {before} -> {after}"


def wait(check: Callable[[], Any], what: str, within: float, node: Any = None) -> Any:
    """Poll the cluster (nothing to wait on from here), bounded, with a message."""
    end = time.monotonic() + within
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > end:
            pods = node.kubectl("get", "pods", "-A", check=False) if node else ""
            raise AssertionError(f"still waiting after {within}s for {what}\n{pods}")
        time.sleep(0.5)


def image_name() -> tuple[str, str]:
    name = (IMAGES / "flink-kubernetes-operator.image").read_text().strip()
    repository, _, tag = name.rpartition(":")
    return repository, tag


def install(node: Any, tmp: Path, *, sidecar: bool) -> str:
    """``helm install`` of the operator's chart (through the post-renderer when
    ``sidecar``); returns what Helm said."""
    helm = tool("helm", ROOT / "tests" / "helm" / "go.mod", "helm.sh/helm/v3")
    kustomize = tool(
        "kustomize",
        ROOT / "tests" / "helm" / "kustomize" / "go.mod",
        "sigs.k8s.io/kustomize/kustomize/v5",
    )
    # The chart appends this to its built-in flink-conf.yaml (defaultConfiguration.append);
    # canaryd's reporter settings come from config/sidecar's own ConfigMap.
    conf = f"kubernetes.operator.health.canary.resource.timeout: {CYCLE} s\n"
    cycle_values = tmp / "cycle-values.yaml"
    cycle_values.write_text(yaml.safe_dump({"defaultConfiguration": {"flink-conf.yaml": conf}}))
    repository, tag = image_name()
    argv = [
        str(helm),
        "install",
        RELEASE,
        str(real.build_dir() / "helm" / "flink-kubernetes-operator"),
        "--namespace",
        RELEASE_NAMESPACE,
        "--create-namespace",
        "--kubeconfig",
        str(node.plane.kubeconfig("admin")),
        "--values",
        str(HELM_VALUES),
        "--values",
        str(cycle_values),
        "--set",
        "webhook.create=false",
        "--set",
        f"image.repository={repository}",
        "--set",
        f"image.tag={tag}",
        "--set",
        "image.pullPolicy=Never",
    ]
    if sidecar:
        argv += ["--post-renderer", str(POST_RENDER)]
    env = {
        **os.environ,
        "CANARYD_IMAGE": CANARYD_IMAGE,
        "KUSTOMIZE": str(kustomize),
        "HELM_CACHE_HOME": str(tmp / "helm-cache"),
        "HELM_CONFIG_HOME": str(tmp / "helm-config"),
        "HELM_DATA_HOME": str(tmp / "helm-data"),
    }
    result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert result.returncode == 0, f"helm install: {result.stderr}"
    return result.stdout


def uninstall(node: Any, tmp: Path) -> None:
    helm = tool("helm", ROOT / "tests" / "helm" / "go.mod", "helm.sh/helm/v3")
    subprocess.run(
        [
            str(helm),
            "uninstall",
            RELEASE,
            "--namespace",
            RELEASE_NAMESPACE,
            "--kubeconfig",
            str(node.plane.kubeconfig("admin")),
            "--wait",
            "--timeout",
            "3m",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "HELM_CACHE_HOME": str(tmp / "helm-cache")},
        timeout=300,
        check=True,
    )
    wait(lambda: not live_pods(node, RELEASE_NAMESPACE), "the operator's pod gone", 180, node)


def live_pods(node: Any, namespace: str) -> list[dict[str, Any]]:
    status, body = node.plane.request("GET", f"/api/v1/namespaces/{namespace}/pods")
    assert status == 200, body
    return [p for p in body["items"] if not p["metadata"].get("deletionTimestamp")]


def the_pod(node: Any) -> dict[str, Any] | None:
    found = live_pods(node, RELEASE_NAMESPACE)
    return found[0] if len(found) == 1 else None


def statuses(pod: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    if pod is None:
        return {}
    return {c["name"]: c for c in pod.get("status", {}).get("containerStatuses") or []}


def restarts(node: Any) -> dict[str, int]:
    pod = the_pod(node)
    assert pod is not None, live_pods(node, RELEASE_NAMESPACE)
    return {name: s["restartCount"] for name, s in statuses(pod).items()}


def get_pods(node: Any) -> str:
    """``kubectl get pods`` in the release's namespace, as the bug report shows it."""
    return str(node.kubectl("-n", RELEASE_NAMESPACE, "get", "pods", check=False)).strip()


def proxied(node: Any, port: int, path: str) -> tuple[int, Any]:
    """A port of the operator's pod through the API server's pod proxy (the API server
    reaches pod addresses on the node's bridge); 0: no pod."""
    pod = the_pod(node)
    if pod is None:
        return 0, None
    name = pod["metadata"]["name"]
    return node.plane.request(  # type: ignore[no-any-return]
        "GET", f"/api/v1/namespaces/{RELEASE_NAMESPACE}/pods/{name}:{port}/proxy{path}"
    )


def operator_log(node: Any) -> str:
    """The operator container's log (its current process)."""
    pod = the_pod(node)
    if pod is None:
        return ""
    return str(
        node.kubectl(
            "-n", RELEASE_NAMESPACE, "logs", pod["metadata"]["name"], "-c", OPERATOR, check=False
        )
    )


def cycles(node: Any, namespace: str, name: str) -> int:
    """The operator's canary cycles on one canary in its current process: one
    "Scheduling canary check" line per bump it tried (written or not)."""
    marker = f"Scheduling canary check for ResourceID{{name='{name}', namespace='{namespace}'}}"
    return operator_log(node).count(marker)


REFUSED = "canaryd: the operator's update of a canary would change its labels"
"""The policy's message, in the operator's log when its write was refused."""


def refused(node: Any, namespace: str, name: str) -> int:
    """The operator's writes of one canary that the policy refused, in its current
    process' log (one exception line each; its "Caused by" repeats it)."""
    target = f"flinkdeployments/{name}. Message"
    return sum(
        1
        for line in operator_log(node).splitlines()
        if line.startswith("io.fabric8") and REFUSED in line and f"/{namespace}/{target}" in line
    )


# ------------------------------------------------------------------ canaries


def create_canary(node: Any, namespace: str, name: str) -> None:
    node.plane.request("POST", "/api/v1/namespaces", {"metadata": {"name": namespace}})
    body = {
        "apiVersion": "flink.apache.org/v1beta1",
        "kind": "FlinkDeployment",
        "metadata": {"name": name, "labels": {LABEL: "true"}},
    }
    status, answer = node.plane.request("POST", FD.format(ns=namespace), body)
    assert status == 201, answer


def canary(node: Any, namespace: str, name: str) -> dict[str, Any] | None:
    status, body = node.plane.request("GET", f"{FD.format(ns=namespace)}/{name}")
    return body if status == 200 else None


def merge(node: Any, namespace: str, name: str, patch: dict[str, Any]) -> None:
    status, body = node.plane.request(
        "PATCH",
        f"{FD.format(ns=namespace)}/{name}",
        patch,
        content_type="application/merge-patch+json",
    )
    assert status == 200, body


def nonce(obj: dict[str, Any] | None) -> int:
    return int(((obj or {}).get("spec") or {}).get("restartNonce") or 0)


def labels(obj: dict[str, Any] | None) -> dict[str, str]:
    return dict(((obj or {}).get("metadata") or {}).get("labels") or {})


def annotations(obj: dict[str, Any] | None) -> dict[str, str]:
    return dict(((obj or {}).get("metadata") or {}).get("annotations") or {})


def delete_canaries(node: Any, namespace: str) -> None:
    """Finalizers off (no operator runs any more to remove them), then the namespace."""
    status, body = node.plane.request("GET", FD.format(ns=namespace))
    for item in body.get("items", []) if status == 200 else []:
        name = item["metadata"]["name"]
        merge(node, namespace, name, {"metadata": {"finalizers": None}})
    node.plane.request("DELETE", f"/api/v1/namespaces/{namespace}")
    wait(
        lambda: node.plane.request("GET", f"/api/v1/namespaces/{namespace}")[0] == 404,
        f"namespace {namespace} gone",
        180,
        node,
    )


# ------------------------------------------------------------------ the watcher


@dataclass
class Sample:
    at: float
    probe: int
    """The operator's own probe (:8085): its status, 0 when the pod did not answer."""
    canaryd: int | None
    """canaryd's /healthz (:8086) in the sidecar topology."""
    restarts: dict[str, int]
    why: str = ""
    """canaryd's reasons when its /healthz did not answer 200."""


@dataclass
class Watcher:
    """Polls the operator's probe (and canaryd's /healthz) and the pod's restarts every
    second while a topology runs."""

    node: Any
    sidecar: bool
    samples: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="watcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def _run(self) -> None:
        while not self._stop.wait(1.0):  # the probe's poll, every second
            pod = the_pod(self.node)
            counts = {n: s["restartCount"] for n, s in statuses(pod).items()}
            probe = proxied(self.node, 8085, "/")[0]
            ours, why = None, ""
            if self.sidecar:
                ours, body = proxied(self.node, 8086, "/healthz?verbose")
                if ours != 200 and isinstance(body, dict):
                    why = "; ".join(
                        f"{c['name']}: {c['state']} ({c.get('reason', '')})"
                        for c in body.get("canaries", [])
                        if c["state"] != "healthy"
                    )
            self.samples.append(Sample(time.monotonic(), probe, ours, counts, why))

    def window(self, since: float, until: float | None = None) -> list[Sample]:
        end = until if until is not None else float("inf")
        return [s for s in self.samples if since <= s.at <= end]

    def summary(self, since: float, until: float | None = None) -> dict[str, Any]:
        """The probe's statuses in the window, when it first failed, its longest run of
        failures (the chart's liveness restarts after 30 s of them), canaryd's."""
        window = self.window(since, until)
        failures = [s.at - since for s in window if s.probe != 200]
        longest, start = 0.0, None
        for s in window:
            if s.probe != 200:
                start = s.at if start is None else start
                longest = max(longest, s.at - start)
            else:
                start = None
        found: dict[str, Any] = {
            "probe_8085": sorted({s.probe for s in window}),
            "probe_first_failure_s": round(failures[0], 1) if failures else None,
            "probe_longest_failure_s": round(longest, 1),
        }
        if self.sidecar:
            longest, start = 0.0, None
            for s in window:
                if s.canaryd not in (200, None):
                    start = s.at if start is None else start
                    longest = max(longest, s.at - start)
                else:
                    start = None
            found["canaryd_longest_not_200_s"] = round(longest, 1)
            found["canaryd_healthz"] = sorted({s.canaryd for s in window if s.canaryd})
            found["canaryd_not_200"] = sorted(
                {f"{round(s.at - since)}s {s.canaryd} {s.why}" for s in window if s.canaryd != 200}
            )[:6]
        return found


def record(**row: Any) -> None:
    row["at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    real.report(REPORT, row)
    print("report:", json.dumps(row), flush=True)


def memory(node: Any) -> dict[str, dict[str, int]]:
    """Each container of the operator's pod: its cgroup's memory use, page cache, what
    is left (the process' own) and limit, MiB (containerd's task metrics)."""
    found = {}
    for name, status in statuses(the_pod(node)).items():
        cid = str(status.get("containerID", "")).removeprefix("containerd://")
        metrics = dict(
            line.split()[:2]
            for line in node.ctr("tasks", "metrics", cid, check=False).splitlines()
            if line.startswith("memory.")
        )
        mib = {k: int(v) // 2**20 for k, v in metrics.items() if v.isdigit()}
        found[name] = {
            "usage_mib": mib.get("memory.usage_in_bytes", 0),
            "cache_mib": mib.get("memory.stat.cache", 0),
            "limit_mib": mib.get("memory.limit_in_bytes", 0),
        }
    return found


def canaryd_canaries(node: Any, namespace: str) -> dict[str, str]:
    """canaryd's verdicts of the canaries in ``namespace`` (its /healthz?verbose)."""
    status, body = proxied(node, 8086, "/healthz?verbose")
    if status not in (200, 500) or not isinstance(body, dict):
        return {}
    return {c["name"]: c["state"] for c in body["canaries"] if c["namespace"] == namespace}


# ------------------------------------------------------------------ the runs


@dataclass
class Run:
    topology: str
    node: Any
    namespace: str
    watcher: Watcher
    results: dict[str, Any] = field(default_factory=dict)


@pytest.fixture(scope="module")
def runs() -> dict[str, Run]:
    return {}


def bring_up(node: Any, tmp: Path, topology: str) -> Run:
    sidecar = topology == "canaryd"
    namespace = f"e2e-op-{topology}"
    started = time.monotonic()
    install(node, tmp, sidecar=sidecar)

    def started_ok() -> bool:
        found = statuses(the_pod(node))
        return bool(found.get(OPERATOR, {}).get("started")) and (
            not sidecar or bool(found.get("canaryd", {}).get("started"))
        )

    wait(started_ok, "the operator started (its startup probe passed)", 300, node)
    up_after = round(time.monotonic() - started, 1)
    watcher = Watcher(node, sidecar)
    watcher.start()
    for name in ("meta", "gone"):
        create_canary(node, namespace, name)
    run = Run(topology, node, namespace, watcher)
    wait(
        lambda: (
            nonce(canary(node, namespace, "meta")) >= 2
            and nonce(canary(node, namespace, "gone")) >= 2
        ),
        "the canaries bumped twice",
        6 * CYCLE,
        node,
    )
    if sidecar:
        wait(
            lambda: canaryd_canaries(node, namespace) == {"meta": "healthy", "gone": "healthy"},
            "canaryd: both canaries healthy",
            12 * CYCLE,
            node,
        )
    run.results["up_after_s"] = up_after
    return run


def seed_1(run: Run) -> dict[str, Any]:
    """A label and an annotation added after a check; kept or wiped across three of
    the operator's own cycles on that canary?"""
    node, ns = run.node, run.namespace
    mark = cycles(node, ns, "meta")
    refused_before = refused(node, ns, "meta")
    t0 = time.monotonic()
    merge(
        node,
        ns,
        "meta",
        {"metadata": {"labels": {"repro": "409"}, "annotations": {"repro/note": "keep-me"}}},
    )
    wiped_after = None

    def three_cycles() -> bool:
        nonlocal wiped_after
        found = canary(node, ns, "meta")
        if wiped_after is None and "repro" not in labels(found):
            wiped_after = round(time.monotonic() - t0, 1)
        return cycles(node, ns, "meta") >= mark + 3

    wait(three_cycles, "three of the operator's cycles on the canary", 6 * CYCLE, node)
    found = canary(node, ns, "meta")
    return {
        "label_kept": labels(found).get("repro") == "409",
        "annotation_kept": annotations(found).get("repro/note") == "keep-me",
        "wiped_after_s": wiped_after,
        "operator_cycles": cycles(node, ns, "meta") - mark,
        "operator_writes_refused": refused(node, ns, "meta") - refused_before,
        **run.watcher.summary(t0),
    }


def seed_2(run: Run) -> dict[str, Any]:
    """The canary label removed: does it come back across three of the operator's
    cycles? Then put back by hand (as a user undoing it would)."""
    node, ns = run.node, run.namespace
    mark = cycles(node, ns, "meta")
    refused_before = refused(node, ns, "meta")
    t0 = time.monotonic()
    merge(node, ns, "meta", {"metadata": {"labels": {LABEL: None}}})
    back_after = None

    def three_cycles() -> bool:
        nonlocal back_after
        if back_after is None and LABEL in labels(canary(node, ns, "meta")):
            back_after = round(time.monotonic() - t0, 1)
        return cycles(node, ns, "meta") >= mark + 3

    wait(three_cycles, "three of the operator's cycles after the removal", 6 * CYCLE, node)
    t1 = time.monotonic()
    found = canary(node, ns, "meta")
    result: dict[str, Any] = {
        "label_back": LABEL in labels(found),
        "label_back_after_s": back_after,
        "operator_cycles": cycles(node, ns, "meta") - mark,
        "operator_writes_refused": refused(node, ns, "meta") - refused_before,
        **run.watcher.summary(t0),
    }
    if run.watcher.sidecar:
        result["canaryd_still_checks_it"] = "meta" in canaryd_canaries(node, ns)
    if not result["label_back"]:
        merge(node, ns, "meta", {"metadata": {"labels": {LABEL: "true"}}})

        def probe_ok() -> bool:
            latest = run.watcher.window(time.monotonic() - 1.5)
            return bool(latest) and all(s.probe == 200 for s in latest)

        try:
            wait(probe_ok, ":8085 answering 200 again", 6 * CYCLE)
            result["probe_200_again_after_label_back_s"] = round(time.monotonic() - t1, 1)
        except AssertionError:
            result["probe_200_again_after_label_back_s"] = None
    return result


LIVENESS_WINDOW = 150.0
"""Seconds a canary deleted without cleanup is watched: the chart's liveness budget
(30 s initial delay, 3 x 10 s) after a first failed check (one cycle), a restart and
the new process' start, twice over."""


def seed_4(run: Run) -> dict[str, Any]:
    """A canary deleted after its finalizer was removed by hand: restarts of each
    container over ``LIVENESS_WINDOW``."""
    node, ns = run.node, run.namespace
    before = restarts(node)
    t0 = time.monotonic()
    merge(node, ns, "gone", {"metadata": {"finalizers": None}})
    status, body = node.plane.request("DELETE", f"{FD.format(ns=ns)}/gone")
    assert status == 200, body
    restarted_after = None

    def watched() -> bool:
        nonlocal restarted_after
        now = restarts(node) if the_pod(node) else before
        if restarted_after is None and now.get(OPERATOR, 0) > before.get(OPERATOR, 0):
            restarted_after = round(time.monotonic() - t0, 1)
        return time.monotonic() - t0 >= LIVENESS_WINDOW

    # What is asserted is a count over a window (the restarts the chart's liveness
    # makes in it), not an event: the window is polled to its end.
    wait(watched, "the window's end", LIVENESS_WINDOW + 30, node)
    after = restarts(node)
    pod = the_pod(node)
    last = statuses(pod).get(OPERATOR, {}).get("lastState", {}).get("terminated") or {}
    result: dict[str, Any] = {
        "restarts": {c: after[c] - before.get(c, 0) for c in after},
        "operator_restarted_after_s": restarted_after,
        "operator_last_terminated": {k: last.get(k) for k in ("reason", "exitCode")}
        if last
        else None,
        "unhealthy_events": unhealthy_events(node),
        **run.watcher.summary(t0),
    }
    if run.watcher.sidecar:
        result["canaryd_canaries"] = canaryd_canaries(node, ns)
    return result


def unhealthy_events(node: Any) -> list[str]:
    """The kubelet's probe and kill events of the operator's current pod."""
    status, body = node.plane.request("GET", f"/api/v1/namespaces/{RELEASE_NAMESPACE}/events")
    pod = the_pod(node)
    if status != 200 or pod is None:
        return []
    return sorted(
        {
            f"{e['involvedObject'].get('fieldPath', '')}: {e['message'][:120]}"
            f" (x{e.get('count', 1)})"
            for e in body["items"]
            if e.get("reason") in ("Unhealthy", "Killing")
            and e["involvedObject"].get("name") == pod["metadata"]["name"]
        }
    )


def other_pods(node: Any) -> list[str]:
    """Every pod in the cluster but the operator's: a Flink cluster would show here."""
    status, body = node.plane.request("GET", "/api/v1/pods")
    assert status == 200, body
    return [
        f"{p['metadata']['namespace']}/{p['metadata']['name']}"
        for p in body["items"]
        if p["metadata"]["namespace"] != RELEASE_NAMESPACE
    ]


def walk(node: Any, tmp: Path, topology: str) -> dict[str, Any]:
    run = bring_up(node, tmp, topology)
    try:
        results = run.results
        results["seed_1"] = seed_1(run)
        results["seed_2"] = seed_2(run)
        results["seed_4"] = seed_4(run)
        results["other_pods"] = other_pods(node)
        results["flink_deployments_made"] = node.plane.request(
            "GET", f"/apis/apps/v1/namespaces/{run.namespace}/deployments"
        )[1]["items"]
        results["memory"] = memory(node)
        results["restarts_total"] = restarts(node)
        results["kubectl_get_pods"] = get_pods(node)
        log = REPORT.parent / f"e2e-operator-node-{topology}.log"
        log.write_text(operator_log(node))
        results["operator_log"] = str(log)
        print(results["kubectl_get_pods"], flush=True)
        record(test="node", topology=topology, **results)
        return results
    except BaseException:
        print(operator_log(node)[-6000:])
        raise
    finally:
        run.watcher.stop()
        uninstall(node, tmp)
        delete_canaries(node, run.namespace)


def test_upstream_the_operators_own_probe(node, tmp_path):
    """The chart as it is: failures 1 and 2 reproduce with the operator running (the
    label and annotation wiped, the removed label back), and a canary deleted without
    cleanup restarts the operator: RESTARTS 1 (a new process forgets the canary)."""
    found = walk(node, tmp_path, "upstream")
    assert found["seed_1"]["wiped_after_s"] is not None, found["seed_1"]
    assert not found["seed_1"]["label_kept"], found["seed_1"]
    assert found["seed_2"]["label_back"], found["seed_2"]
    assert found["seed_4"]["restarts"][OPERATOR] == 1, found["seed_4"]
    assert found["other_pods"] == [] and found["flink_deployments_made"] == [], found


def test_with_canaryd_beside_it_and_the_policy(node, tmp_path):
    """The same chart through config/helm/post-render, the default canary label: the
    label and annotation kept across three of the operator's own cycles (its stale
    write refused by the policy), the removed label stays removed, a canary deleted
    without cleanup restarts nothing; canaryd's verdict never fails long enough to
    restart the operator. The operator's own probe (:8085) is measured, not asserted:
    after start-up nothing reads it in this topology."""
    found = walk(node, tmp_path, "canaryd")
    one, two, four = found["seed_1"], found["seed_2"], found["seed_4"]
    assert one["label_kept"] and one["annotation_kept"], one
    assert one["operator_cycles"] >= 3, one
    assert one["operator_writes_refused"] >= 1, one
    assert not two["label_back"] and two["label_back_after_s"] is None, two
    assert not two["canaryd_still_checks_it"], two
    assert four["restarts"] == {OPERATOR: 0, "canaryd": 0}, four
    assert "gone" not in four["canaryd_canaries"], four
    # canaryd's verdict never failed long enough for the exec probe to restart the
    # operator (3 failures 10 s apart): what it said when it did fail is in the report.
    for seed in (one, two, four):
        assert seed["canaryd_longest_not_200_s"] < 20, seed
    assert found["restarts_total"] == {OPERATOR: 0, "canaryd": 0}, found
    assert found["other_pods"] == [] and found["flink_deployments_made"] == [], found
