"""canaryd as a process of its own against a real Kubernetes API server.

``make e2e`` starts etcd, kube-apiserver and kube-controller-manager built from Go
modules (tests/controlplane) and runs these tests against them, none skipped; canaryd
authenticates as the ServiceAccounts that the project's config/rbac manifests bind,
so the tests also prove those manifests grant enough. With CANARYD_E2E_KUBECONFIG set
instead, the tests that need only a cluster with the Flink CRDs run against it (those
that restart the API server or use the RBAC variants then skip). In ``make test``,
with neither, every test here is skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException

from canaryd.testing.process import canaryd_argv, free_port

EXTERNAL = os.path.expanduser(os.environ.get("CANARYD_E2E_KUBECONFIG") or "") or None
LAUNCH = os.environ.get("CANARYD_E2E") == "controlplane"
LABEL = "flink.apache.org/canary"
G, V, FD = "flink.apache.org", "v1beta1", "flinkdeployments"
MERGE = "application/merge-patch+json"
CYCLE = 1.0 if LAUNCH else 5.0

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not (LAUNCH or EXTERNAL), reason="make e2e (or CANARYD_E2E_KUBECONFIG) runs these"
    ),
    pytest.mark.timeout(300),
]


@dataclass
class Cluster:
    admin: Path
    canaryd: Path
    """canaryd's kubeconfig: config/rbac's ServiceAccount (the admin's elsewhere)."""
    namespaced: Path | None
    """config/rbac/namespaced's ServiceAccount, in namespace OWN (launched only)."""
    plane: Any = None

    def needs_plane(self) -> Any:
        if self.plane is None:
            pytest.skip("needs the control plane of make e2e")
        return self.plane


OWN = "canaryd-own"
ROOT = Path(__file__).resolve().parent.parent


def kubectl_of(cluster: Cluster) -> str | None:
    """The kubectl `make controlplane` builds (the control plane's release), else one on
    PATH (CANARYD_E2E_KUBECONFIG)."""
    if cluster.plane is not None and (cluster.plane.bin_dir / "kubectl").is_file():
        return str(cluster.plane.bin_dir / "kubectl")
    return shutil.which("kubectl")


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    if not LAUNCH:
        assert EXTERNAL is not None
        yield Cluster(Path(EXTERNAL), Path(EXTERNAL), None)
        return
    from tests.controlplane.launcher import NAMESPACED, ControlPlane

    assert NAMESPACED == OWN
    plane = ControlPlane()
    plane.start()
    try:
        yield Cluster(
            plane.kubeconfig("admin"),
            plane.kubeconfig("canaryd"),
            plane.kubeconfig("canaryd-namespaced"),
            plane,
        )
    finally:
        plane.stop()


_namespaces = iter(range(1, 10_000))


@pytest.fixture
async def api(cluster: Cluster) -> AsyncIterator[client.ApiClient]:
    configuration = client.Configuration()
    await config.load_kube_config(
        config_file=str(cluster.admin), client_configuration=configuration
    )
    async with client.ApiClient(configuration) as api_client:
        yield api_client


@pytest.fixture
async def namespace(api: client.ApiClient) -> AsyncIterator[str]:
    """A namespace of the test's own, deleted after it."""
    name = f"e2e-{os.getpid()}-{next(_namespaces)}"
    core = client.CoreV1Api(api)
    await core.create_namespace({"metadata": {"name": name}})
    try:
        yield name
    finally:
        with contextlib.suppress(ApiException):
            await core.delete_namespace(name)


PIDS: dict[str, int] = {}
"""canaryd's process by its URL."""


@contextlib.asynccontextmanager
async def canaryd(
    kubeconfig: Path,
    *args: str,
    logs: list[dict[str, Any]] | None = None,
    cycle: float = CYCLE,
    open_files: int | None = None,
    ready_within: float = 30,
) -> AsyncIterator[str]:
    """canaryd as a process; with ``logs``, its JSON log records are collected there
    (and echoed); ``open_files`` starts it with that soft RLIMIT_NOFILE."""
    port = free_port()
    fmt = ("--log-format", "json") if logs is not None else ("--log-format", "console")

    def limit() -> None:
        if open_files is not None:
            _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, hard))

    process = await asyncio.create_subprocess_exec(
        *canaryd_argv(kubeconfig, port, cycle, *fmt, *args),
        stderr=asyncio.subprocess.PIPE if logs is not None else sys.stderr,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        preexec_fn=limit,
    )
    reader = None
    if logs is not None:

        async def read() -> None:
            assert process.stderr is not None
            async for raw in process.stderr:
                line = raw.decode(errors="replace")
                sys.stderr.write(line)
                with contextlib.suppress(ValueError):
                    logs.append(json.loads(line))

        reader = asyncio.create_task(read())
    try:
        url = f"http://127.0.0.1:{port}"
        PIDS[url] = process.pid

        async def listening() -> bool:
            async with aiohttp.ClientSession() as http, http.get(url + "/readyz") as response:
                return response.status == 200

        await eventually(listening, "canaryd to be ready", within=ready_within)
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(15):
            assert await process.wait() == 0
        if reader is not None:
            await reader


def crd(api: client.ApiClient) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(api)


async def create_canary(api: client.ApiClient, namespace: str, name: str = "canary") -> None:
    await crd(api).create_namespaced_custom_object(
        G,
        V,
        namespace,
        FD,
        {
            "apiVersion": f"{G}/{V}",
            "kind": "FlinkDeployment",
            "metadata": {"name": name, "labels": {LABEL: "true"}},
        },
    )


async def get_canary(api: client.ApiClient, namespace: str, name: str = "canary") -> Any:
    return await crd(api).get_namespaced_custom_object(G, V, namespace, FD, name)


async def health(url: str) -> tuple[int, dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as http,
        http.get(url + "/healthz", headers={"Accept": "application/json"}) as response,
    ):
        return response.status, await response.json()


async def metric(url: str, name: str) -> float:
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as response:
        text = await response.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#")
    )


async def eventually(check: Any, what: str, within: float = 8 * CYCLE) -> Any:
    """Poll a real cluster (no events to wait on from here), bounded, with a message."""
    loop = asyncio.get_running_loop()
    end = loop.time() + within
    while True:
        with contextlib.suppress(aiohttp.ClientError):
            result = await check()
            if result:
                return result
        if loop.time() > end:
            raise AssertionError(f"still waiting after {within}s for {what}")
        await asyncio.sleep(0.2)


def states(body: dict[str, Any], namespace: str) -> dict[str, str]:
    return {c["name"]: c["state"] for c in body["canaries"] if c["namespace"] == namespace}


class HealthLog:
    """/healthz polled for a test's whole length: proves it never failed."""

    def __init__(self, url: str) -> None:
        self.url, self.statuses = url, []
        self._task = asyncio.create_task(self._poll())

    async def _poll(self) -> None:
        while True:
            with contextlib.suppress(aiohttp.ClientError):
                self.statuses.append((await health(self.url))[0])
            await asyncio.sleep(CYCLE / 5)

    async def stop(self) -> set[int]:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        return set(self.statuses)


async def until_healthy(url: str, namespace: str, name: str = "canary") -> None:
    async def healthy() -> bool:
        status, body = await health(url)
        return status == 200 and states(body, namespace).get(name) == "healthy"

    await eventually(healthy, f"{namespace}/{name} to be healthy")


# ------------------------------- the bug report's (FLINK-41050) reproductions


async def test_metadata_is_kept_and_a_removed_label_stops_the_checks(api, cluster, namespace):
    """FLINK-41050 #1 and #2: users' labels and annotations survive the bumps; removing
    the canary label stops the checks, and the label is never re-added."""
    await create_canary(api, namespace)
    async with canaryd(cluster.canaryd, "--namespace", namespace) as url:
        await until_healthy(url, namespace)
        await crd(api).patch_namespaced_custom_object(
            G,
            V,
            namespace,
            FD,
            "canary",
            {"metadata": {"labels": {"repro": "409"}, "annotations": {"repro/note": "keep-me"}}},
            _content_type=MERGE,
        )
        before = (await get_canary(api, namespace))["spec"].get("restartNonce", 0)

        async def bumped_twice() -> Any:
            obj = await get_canary(api, namespace)
            return obj if obj["spec"].get("restartNonce", 0) >= before + 2 else None

        obj = await eventually(bumped_twice, "two more bumps")
        assert obj["metadata"]["labels"]["repro"] == "409"
        assert obj["metadata"]["annotations"]["repro/note"] == "keep-me"
        await crd(api).patch_namespaced_custom_object(
            G,
            V,
            namespace,
            FD,
            "canary",
            {"metadata": {"labels": {LABEL: None}}},
            _content_type=MERGE,
        )

        async def dropped() -> bool:
            return not states((await health(url))[1], namespace)

        await eventually(dropped, "the canary to be dropped")
        nonce = (await get_canary(api, namespace))["spec"].get("restartNonce", 0)
        await asyncio.sleep(3 * CYCLE)  # three cycles of a real cluster: nothing written
        obj = await get_canary(api, namespace)
        assert obj["spec"].get("restartNonce", 0) == nonce
        assert LABEL not in (obj["metadata"].get("labels") or {})
        assert (await health(url))[0] == 200


async def test_a_real_concurrent_writer_meets_409_and_nothing_turns_unhealthy(
    api, cluster, namespace
):
    """FLINK-41050 #3: a write that fails is no verdict. A concurrent writer changes the
    canary's spec and labels as fast as it can: canaryd's bumps meet real 409s, re-read,
    retry on the fresh copy, and keep every label."""
    await create_canary(api, namespace)
    async with canaryd(cluster.canaryd, "--namespace", namespace) as url:
        await until_healthy(url, namespace)
        conflicts = await metric(url, "canaryd_conflicts_total")
        watch = HealthLog(url)
        writes = 0
        loop = asyncio.get_running_loop()
        # Five cycles at least, and until a bump met a 409 (a loaded machine writes
        # slower: the race is won later), at most thirty.
        end, limit = loop.time() + 5 * CYCLE, loop.time() + 30 * CYCLE
        while loop.time() < end or (
            loop.time() < limit and await metric(url, "canaryd_conflicts_total") <= conflicts
        ):
            obj = await get_canary(api, namespace)
            writes += 1
            with contextlib.suppress(ApiException):  # our own stale writes meet 409 too
                await crd(api).patch_namespaced_custom_object(
                    G,
                    V,
                    namespace,
                    FD,
                    "canary",
                    {
                        "metadata": {
                            "resourceVersion": obj["metadata"]["resourceVersion"],
                            "labels": {f"writer-{writes % 4}": str(writes)},
                        },
                        "spec": {"flinkVersion": f"v1_{writes % 20}"},
                    },
                    _content_type=MERGE,
                )
        assert await metric(url, "canaryd_conflicts_total") > conflicts, "no 409 was met"
        await until_healthy(url, namespace)
        assert await watch.stop() == {200}
        labels = (await get_canary(api, namespace))["metadata"]["labels"]
        assert {f"writer-{n}" for n in range(4)} <= set(labels)


async def test_a_canary_deleted_after_its_finalizer_was_removed_is_dropped(api, cluster, namespace):
    """FLINK-41050 #4, the first half: a canary that is gone (404) is dropped."""
    await create_canary(api, namespace, "gone")
    await create_canary(api, namespace, "stays")
    async with canaryd(cluster.canaryd, "--namespace", namespace) as url:
        await until_healthy(url, namespace, "gone")
        await crd(api).patch_namespaced_custom_object(
            G,
            V,
            namespace,
            FD,
            "gone",
            {"metadata": {"finalizers": ["e2e/hold"]}},
            _content_type=MERGE,
        )
        await crd(api).delete_namespaced_custom_object(G, V, namespace, FD, "gone")

        async def dropped() -> bool:  # deletionTimestamp set: no longer a canary to check
            return "gone" not in states((await health(url))[1], namespace)

        await eventually(dropped, "the canary being deleted to be dropped")
        await crd(api).patch_namespaced_custom_object(
            G, V, namespace, FD, "gone", {"metadata": {"finalizers": None}}, _content_type=MERGE
        )
        await asyncio.sleep(2 * CYCLE)  # two more cycles: still 200, the other still checked
        status, body = await health(url)
        assert status == 200 and states(body, namespace) == {"stays": "healthy"}


async def test_a_namespace_dropped_at_runtime_with_its_role_removed_is_forgotten(
    api, cluster, namespace, tmp_path
):
    """FLINK-41050 #4, the second half: dynamic namespaces drop a namespace and its Role
    goes (helm upgrade): canaryd forgets its canaries and never fails on them."""
    cluster.needs_plane()
    assert cluster.namespaced is not None
    rbac = client.RbacAuthorizationV1Api(api)
    await create_canary(api, OWN, "own")
    conf = tmp_path / "flink-conf.yaml"
    conf.write_text(
        f"kubernetes.operator.watched.namespaces: {OWN},{namespace}\n"
        "kubernetes.operator.dynamic.namespaces.enabled: true\n"
    )
    try:
        async with canaryd(cluster.namespaced, "--operator-config", str(conf)) as url:
            await until_healthy(url, OWN, "own")
            # The namespaced variant grants nothing in `namespace`: its list is a real 403.
            assert not states((await health(url))[1], namespace)
            assert (
                await metric(
                    url, 'canaryd_watch_restarts_total{resource="flinkdeployments",why="forbidden"}'
                )
                >= 1
            )
            conf.write_text(
                f"kubernetes.operator.watched.namespaces: {namespace}\n"
                "kubernetes.operator.dynamic.namespaces.enabled: true\n"
            )
            await rbac.delete_namespaced_role_binding("canaryd", OWN)
            os.kill(PIDS[url], signal.SIGHUP)

            async def forgotten() -> bool:
                status, body = await health(url)
                return status == 200 and not states(body, OWN)

            await eventually(forgotten, "the unwatched namespace's canaries to be dropped")
            await asyncio.sleep(3 * CYCLE)
            assert (await health(url))[0] == 200
    finally:
        with contextlib.suppress(ApiException):
            await rbac.create_namespaced_role_binding(OWN, role_binding())
        with contextlib.suppress(ApiException):
            await crd(api).delete_namespaced_custom_object(G, V, OWN, FD, "own")


def role_binding() -> dict[str, Any]:
    return {
        "metadata": {"name": "canaryd", "labels": {"app.kubernetes.io/name": "canaryd"}},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "canaryd"},
        "subjects": [{"kind": "ServiceAccount", "name": "canaryd", "namespace": OWN}],
    }


# ------------------------------------------------- Kubernetes' own behaviour


async def test_a_role_removed_at_runtime_is_a_real_403_that_never_fails_health(api, cluster):
    cluster.needs_plane()
    assert cluster.namespaced is not None
    rbac = client.RbacAuthorizationV1Api(api)
    await create_canary(api, OWN, "held")
    try:
        async with canaryd(cluster.namespaced, "--namespace", OWN) as url:
            await until_healthy(url, OWN, "held")
            watch = HealthLog(url)
            await rbac.delete_namespaced_role_binding("canaryd", OWN)

            # Authorization is checked per request: the open watch goes on, the bumps
            # are refused. A 403 on a bump is no verdict (unknown, retried each cycle);
            # only a watch or list refused drops a scope's canaries.
            async def refused() -> bool:
                return states((await health(url))[1], OWN).get("held") == "unknown"

            await eventually(refused, "the refused bumps to make the canary unknown")
            await rbac.create_namespaced_role_binding(OWN, role_binding())
            await until_healthy(url, OWN, "held")  # the scope is retried and owned again
            assert await watch.stop() == {200}
    finally:
        with contextlib.suppress(ApiException):
            await rbac.create_namespaced_role_binding(OWN, role_binding())
        with contextlib.suppress(ApiException):
            await crd(api).delete_namespaced_custom_object(G, V, OWN, FD, "held")


async def test_a_real_namespace_deletion_drops_its_canaries(api, cluster, namespace):
    """Terminating first (canaries dropped at once), emptied by the namespace controller,
    then gone."""
    await create_canary(api, namespace)
    core = client.CoreV1Api(api)
    async with canaryd(cluster.canaryd) as url:  # all namespaces: the Namespaces watch
        await until_healthy(url, namespace)
        await core.delete_namespace(namespace)

        async def dropped() -> bool:
            status, body = await health(url)
            return status == 200 and not states(body, namespace)

        await eventually(dropped, "the terminating namespace's canaries to be dropped")

        async def gone() -> bool:
            try:
                await core.read_namespace(namespace)
            except ApiException as err:
                return err.status == 404
            return False

        await eventually(gone, "the namespace to be emptied and deleted", within=60)
        assert (await health(url))[0] == 200


async def test_a_watch_that_really_expires_is_relisted(api, cluster, namespace):
    """kube-apiserver restarts and rebuilds its watch cache from a fresh list at the
    current resourceVersion; a watch resumed from an older one is too old for it and is
    answered 410 Expired (staging/src/k8s.io/apiserver/pkg/storage/cacher/watch_cache.go,
    getAllEventsSinceLocked: "too old resource version"). canaryd relists.

    canaryd runs as the admin here: right after a restart kube-apiserver answers a
    ServiceAccount 403 until its RBAC caches are filled (seen on v1.35.4), and a 403
    on a watch makes canaryd drop the scope and relist one retry later, so the resumed
    watch would never meet its 410."""
    plane = cluster.needs_plane()
    await create_canary(api, namespace)
    core = client.CoreV1Api(api)
    async with canaryd(cluster.admin, "--namespace", namespace) as url:
        await until_healthy(url, namespace)
        relists = await metric(url, 'canaryd_relists_total{resource="flinkdeployments"}')
        for n in range(5):  # the resourceVersion moves on where canaryd's watch sees nothing
            await core.create_namespaced_config_map(
                namespace, {"metadata": {"name": f"rv-{n}"}, "data": {"n": str(n)}}
            )
        await asyncio.to_thread(plane.restart_apiserver)

        async def relisted() -> bool:
            return await metric(url, 'canaryd_relists_total{resource="flinkdeployments"}') > relists

        await eventually(relisted, "a relist after 410 Expired")
        expired = await metric(
            url, 'canaryd_watch_restarts_total{resource="flinkdeployments",why="expired"}'
        )
        assert expired >= 1
        await until_healthy(url, namespace)


async def test_verdict_changes_are_events_on_the_canary_that_kubectl_describe_shows(
    api, cluster, namespace
):
    """A canary nobody reconciles (--reconciled-by observed-generation, no operator) is
    judged unhealthy: an events.k8s.io/v1 Event on it says so with the reason and its
    class, written by config/rbac's ServiceAccount; the events API finds it by
    regarding.name, and kubectl describe shows it. Reconciled again (status written as
    an operator writes it): a Recovered Event; left again: the Unhealthy Event's series
    (a PATCH kube-apiserver accepts)."""
    await create_canary(api, namespace)
    events = client.EventsV1Api(api)

    async def about_canary(reason: str, count: int | None = None) -> list[Any]:
        found = await events.list_namespaced_event(
            namespace, field_selector="regarding.name=canary"
        )
        return [
            e
            for e in found.items
            if e.reason == reason and (count is None or (e.series and e.series.count) == count)
        ]

    async def reconcile(stop: asyncio.Event) -> None:
        """An operator's part: status.observedGeneration follows the generation."""
        while not stop.is_set():
            body = await get_canary(api, namespace)
            generation = body["metadata"]["generation"]
            if (body.get("status") or {}).get("observedGeneration") != generation:
                with contextlib.suppress(ApiException):  # a bump came between: next round
                    await crd(api).patch_namespaced_custom_object_status(
                        G,
                        V,
                        namespace,
                        FD,
                        "canary",
                        {"status": {"observedGeneration": generation}},
                        _content_type=MERGE,
                    )
            await asyncio.sleep(0.05)

    args = ("--namespace", namespace, "--reconciled-by", "observed-generation")
    async with canaryd(cluster.canaryd, *args):
        (event,) = await eventually(lambda: about_canary("Unhealthy"), "the Unhealthy Event")
        stop = asyncio.Event()
        operator = asyncio.create_task(reconcile(stop))
        try:
            (recovered,) = await eventually(
                lambda: about_canary("Recovered"), "the Recovered Event"
            )
        finally:
            stop.set()
            await operator
        await eventually(lambda: about_canary("Unhealthy", 2), "the Unhealthy Event's series")
    uid = (await get_canary(api, namespace))["metadata"]["uid"]
    assert (event.regarding.kind, event.regarding.name, event.regarding.uid) == (
        "FlinkDeployment",
        "canary",
        uid,
    )
    assert event.type == "Warning" and event.reporting_controller == "canaryd"
    assert event.note.startswith("not_reconciled: status.observedGeneration did not reach")
    assert recovered.type == "Normal" and recovered.note.startswith("in_time: ")
    kubectl = kubectl_of(cluster)
    if kubectl is None:
        return  # the events API said it all; kubectl is not installed here
    described = await asyncio.create_subprocess_exec(
        kubectl,
        "--kubeconfig",
        str(cluster.admin),
        "--namespace",
        namespace,
        "describe",
        f"{FD}.{G}",
        "canary",
        stdout=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(30):
        out, _ = await described.communicate()
    text = out.decode()
    assert described.returncode == 0, text
    shown = text.split("Events:", 1)[1]
    assert "Unhealthy" in shown and "not_reconciled: status.observedGeneration" in shown, text
    assert "Recovered" in shown, text


async def test_the_rbac_manifests_grant_what_canaryd_uses_and_no_more(cluster):
    plane = cluster.needs_plane()
    from tests.controlplane.launcher import CANARYD_NAMESPACE

    token = plane.service_account_token(CANARYD_NAMESPACE)
    path = f"/apis/{G}/{V}/namespaces/default/{FD}"
    assert plane.request("GET", path, token=token)[0] == 200  # list
    assert plane.request("DELETE", path + "/x", token=token)[0] == 403
    assert plane.request("PUT", path + "/x", {"metadata": {"name": "x"}}, token=token)[0] == 403
    assert plane.request("GET", "/api/v1/namespaces/default/secrets", token=token)[0] == 403
    # Namespaces: listed and watched, never read one by one.
    assert plane.request("GET", "/api/v1/namespaces", token=token)[0] == 200
    assert plane.request("GET", "/api/v1/namespaces/default", token=token)[0] == 403
    own = plane.service_account_token(OWN)
    assert plane.request("GET", f"/apis/{G}/{V}/namespaces/{OWN}/{FD}", token=own)[0] == 200
    assert plane.request("GET", f"/apis/{G}/{V}/namespaces/default/{FD}", token=own)[0] == 403
    assert plane.request("GET", "/api/v1/namespaces", token=own)[0] == 200


def rules_review(plane: Any, token: str, namespace: str) -> tuple[set[Any], set[Any]]:
    """What ``kubectl auth can-i --list`` shows: a SelfSubjectRulesReview, flattened to
    (group, resource, verb) and (non-resource URL, verb) pairs."""
    status, body = plane.request(
        "POST",
        "/apis/authorization.k8s.io/v1/selfsubjectrulesreviews",
        {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SelfSubjectRulesReview",
            "spec": {"namespace": namespace},
        },
        token=token,
    )
    assert status == 201, body
    resources = {
        (group, resource, verb)
        for rule in body["status"]["resourceRules"]
        for group in rule.get("apiGroups", [""])
        for resource in rule.get("resources", [])
        for verb in rule["verbs"]
    }
    urls = {
        (url, verb)
        for rule in body["status"]["nonResourceRules"]
        for url in rule["nonResourceURLs"]
        for verb in rule["verbs"]
    }
    return resources, urls


async def make_kubeconfig(plane: Any, output: Path, *args: str) -> tuple[int, str]:
    """config/systemd/kubeconfig.sh (`make kubeconfig`) with the admin's kubeconfig and
    the control plane's kubectl: its exit status and what it said."""
    kubectl = plane.bin_dir / "kubectl"
    assert kubectl.is_file(), f"{kubectl} is missing: run `make controlplane`"
    process = await asyncio.create_subprocess_exec(
        ROOT / "config" / "systemd" / "kubeconfig.sh",
        *args,
        str(output),
        cwd=ROOT,
        env={
            **os.environ,
            "PATH": f"{plane.bin_dir}:{os.environ['PATH']}",
            "KUBECONFIG": str(plane.kubeconfig("admin")),
        },
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    async with asyncio.timeout(90):
        said, _ = await process.communicate()
    assert process.returncode is not None
    return process.returncode, said.decode()


async def test_the_least_privilege_kubeconfig_can_do_what_canaryd_needs_and_no_more(
    api, cluster, namespace, tmp_path
):
    """config/systemd/kubeconfig.sh: a ServiceAccount with config/rbac's roles and a
    kubeconfig (mode 0600, standing alone) with its token. What it may do, beyond what
    every authenticated user may, is exactly config/rbac's rules; `canaryd check` passes
    and canaryd runs with it; nothing it says holds the token. The namespaced variant
    may list in its namespace only. A kubectl that fails leaves no file."""
    plane = cluster.needs_plane()
    import yaml

    output = tmp_path / "etc" / "canaryd" / "kubeconfig"
    args = ("--namespace", "canaryd-systemd", "--name-suffix", "-systemd", "--duration", "1h")
    code, said = await make_kubeconfig(plane, output, *args)
    assert code == 0, said
    assert (
        f"wrote {output} (mode 0600): ServiceAccount canaryd-systemd/canaryd-systemd, "
        "token valid until 20"
    ) in said, said
    assert output.stat().st_mode & 0o777 == 0o600
    assert list(output.parent.iterdir()) == [output]  # its scratch directory gone
    config = yaml.safe_load(output.read_text())
    token = config["users"][0]["user"]["token"]
    assert token not in said and plane.admin_token not in output.read_text()
    assert config["clusters"][0]["cluster"]["server"] == plane.url
    assert "certificate-authority-data" in config["clusters"][0]["cluster"]  # stands alone

    # Every authenticated user's rules (system:basic-user, system:discovery, ...): those
    # of a ServiceAccount bound to nothing.
    plane.apply(
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "nobody"}}, namespace
    )
    nobody = plane.service_account_token(namespace, "nobody")
    granted = {
        (rule_group, resource, verb)
        for doc in yaml.safe_load_all((ROOT / "config" / "rbac" / "clusterrole.yaml").read_text())
        for rule in doc["rules"]
        for rule_group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    for where in (namespace, "default"):
        resources, urls = rules_review(plane, token, where)
        everyone, everyone_urls = rules_review(plane, nobody, where)
        assert resources - everyone == granted, sorted(resources - everyone)
        assert urls == everyone_urls, sorted(urls ^ everyone_urls)
    # Not an admin, whatever the review may leave out.
    assert plane.request("GET", "/api/v1/namespaces/default/secrets", token=token)[0] == 403
    path = f"/apis/{G}/{V}/namespaces/{namespace}/{FD}"
    assert plane.request("DELETE", path + "/x", token=token)[0] == 403

    await create_canary(api, namespace)
    code, lines = await canaryd_check(output, "--namespace", namespace)
    assert (code, lines[-1]) == (0, f"canaryd check: all 8 permissions granted on {plane.url}")
    async with canaryd(output, "--namespace", namespace) as url:
        await until_healthy(url, namespace)

    namespaced = tmp_path / "namespaced"
    args = ("--rbac", "config/rbac/namespaced", "--namespace", namespace)
    code, said = await make_kubeconfig(plane, namespaced, *args, "--name-suffix", "-own")
    assert code == 0, said
    own = yaml.safe_load(namespaced.read_text())["users"][0]["user"]["token"]
    assert plane.request("GET", path, token=own)[0] == 200
    assert plane.request("GET", f"/apis/{G}/{V}/namespaces/default/{FD}", token=own)[0] == 403
    code, lines = await canaryd_check(namespaced, "--namespace", namespace)
    assert code == 0, lines

    code, said = await make_kubeconfig(plane, tmp_path / "nowhere", "--context", "nope")
    assert code != 0 and "nope" in said, said
    assert not (tmp_path / "nowhere").exists()


async def test_the_demo_plays_on_the_real_control_plane(cluster):
    """`make demo CONTROLPLANE=1`: the demo's scenario on a control plane of its own."""
    cluster.needs_plane()
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.controlplane.demo",
        "--timeout",
        "1s",
        "--once",
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    async with asyncio.timeout(120):
        output, _ = await process.communicate()
    text = output.decode(errors="replace")
    assert process.returncode == 0, text[-3000:]
    assert "<- kept" in text and "<- not re-added" in text
    assert "steps 1-3 done: /healthz stayed 200 throughout" in text
    assert "steps 4 and 5 need the fake API server" in text


# ------------------------------------------------------------ leader election


async def test_leader_election_on_a_real_lease(api, cluster, namespace):
    """Two replicas as config/rbac's ServiceAccount with config/standalone-ha's Lease
    Role: one writes; SIGTERM hands over within a retry period, SIGKILL within lease
    duration + retry period (the shipped timings: 15 s, 10 s, 2 s)."""
    plane = cluster.needs_plane()
    import yaml

    for name in ("lease-role.yaml", "lease-rolebinding.yaml"):
        doc = yaml.safe_load((ROOT / "config" / "standalone-ha" / name).read_text())
        plane.apply(doc, "canaryd")
    from tests.controlplane.launcher import CANARYD_NAMESPACE

    token = plane.service_account_token(CANARYD_NAMESPACE)
    leases = "/apis/coordination.k8s.io/v1/namespaces/canaryd/leases"
    # get and update on its own Lease only (create cannot be limited to a name).
    assert plane.request("GET", f"{leases}/canaryd", token=token)[0] in (200, 404)
    assert plane.request("GET", f"{leases}/another-lease", token=token)[0] == 403
    await create_canary(api, namespace)
    lease_path = "/apis/coordination.k8s.io/v1/namespaces/canaryd/leases/canaryd"
    loop = asyncio.get_running_loop()
    processes: dict[str, tuple[asyncio.subprocess.Process, str]] = {}

    async def start(identity: str) -> None:
        port = free_port()
        proc = await asyncio.create_subprocess_exec(
            *canaryd_argv(
                cluster.canaryd,
                port,
                CYCLE,
                "--namespace",
                namespace,
                "--leader-elect",
                "--identity",
                identity,
                "--lease-namespace",
                "canaryd",
                "--log-level",
                "warning",
            ),
            stderr=sys.stderr,
        )
        processes[identity] = (proc, f"http://127.0.0.1:{port}")

    def holder() -> str | None:
        status, body = plane.request("GET", lease_path)
        return (body or {}).get("spec", {}).get("holderIdentity") if status == 200 else None

    async def leads(identity: str) -> bool:
        if holder() != identity:
            return False
        status, body = await health(processes[identity][1])
        return status == 200 and body["role"] == "leader"

    try:
        await start("replica-a")
        await eventually(lambda: leads("replica-a"), "replica-a to lead", within=20)
        await start("replica-b")
        b_url = processes["replica-b"][1]

        async def b_follows() -> bool:
            status, body = await health(b_url)
            return status == 200 and body["role"] == "follower" and body["leader"] == "replica-a"

        await eventually(b_follows, "replica-b to follow replica-a", within=20)
        await until_healthy(processes["replica-a"][1], namespace)
        assert await metric(b_url, 'canaryd_bumps_total{result="written"}') == 0

        processes["replica-a"][0].send_signal(signal.SIGTERM)
        stopped = loop.time()
        assert await processes["replica-a"][0].wait() == 0
        await eventually(lambda: leads("replica-b"), "replica-b to take over", within=10)
        sigterm = loop.time() - stopped
        await until_healthy(b_url, namespace)

        await start("replica-a")
        await eventually(lambda: health(processes["replica-a"][1]), "replica-a back", within=20)
        processes["replica-b"][0].send_signal(signal.SIGKILL)
        await processes["replica-b"][0].wait()
        killed = loop.time()
        await eventually(lambda: leads("replica-a"), "replica-a to take over", within=30)
        sigkill = loop.time() - killed
        await until_healthy(processes["replica-a"][1], namespace)
        print(f"real Lease: SIGTERM hand-over {sigterm:.2f}s, SIGKILL hand-over {sigkill:.2f}s")
        assert sigterm < 2.0 + 1.0  # a retry period, and the process's own stop
        assert sigkill <= 15.0 + 2.0 + 1.0
    finally:
        for proc, _ in processes.values():
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
                async with asyncio.timeout(15):
                    await proc.wait()


# ----------------------------------------------- the network misbehaving, for real


@pytest.fixture
def proxy(cluster: Cluster) -> Iterator[Any]:
    """A fault proxy between canaryd and the real kube-apiserver."""
    plane = cluster.needs_plane()
    from tests.controlplane.faultproxy import fault_proxy

    tls = (plane.workdir / "apiserver.crt", plane.workdir / "apiserver.key")
    with fault_proxy(plane.url, tls) as running:
        yield running


@pytest.fixture
def proxied(cluster: Cluster, proxy: Any, tmp_path: Path) -> Path:
    """canaryd's kubeconfig (config/rbac's ServiceAccount) through the fault proxy."""
    return proxy.kubeconfig(cluster.canaryd, tmp_path / "proxied.kubeconfig")


def events(logs: list[dict[str, Any]], name: str, **fields: Any) -> list[dict[str, Any]]:
    return [
        r for r in logs if r.get("event") == name and all(r.get(k) == v for k, v in fields.items())
    ]


async def test_a_black_holed_api_server_times_out_backs_off_and_is_one_episode(
    api, proxy, proxied, namespace
):
    """The API server's address stops answering (new connects time out) and its open
    connections are cut: connect timeouts, a growing backoff, one failure episode in
    the log, the canary unknown, never unhealthy; back to healthy once the route
    returns. (Frozen connections that are never cut are the half-open test's.)"""
    await create_canary(api, namespace)
    logs: list[dict[str, Any]] = []
    async with canaryd(proxied, "--namespace", namespace, "--log-level", "debug", logs=logs) as url:
        await until_healthy(url, namespace)
        health_log = HealthLog(url)
        idle = await metric(
            url, 'canaryd_watch_restarts_total{resource="flinkdeployments",why="idle"}'
        )
        proxy.blackhole()
        proxy.reset()

        async def unknown() -> bool:
            return states((await health(url))[1], namespace).get("canary") == "unknown"

        await eventually(unknown, "the canary to be unknown", within=6 * CYCLE)
        scope = f"flinkdeployments@{namespace}"
        await eventually(
            lambda: _async(len(events(logs, "watch_failed", scope=scope)) >= 3),
            "three failed watch attempts",
            within=10 * CYCLE,
        )
        proxy.heal()
        await until_healthy(url, namespace)
        assert await health_log.stop() == {200}
        assert (
            await metric(
                url, 'canaryd_watch_restarts_total{resource="flinkdeployments",why="idle"}'
            )
            == idle
        )
    failed = events(logs, "watch_failed", scope=scope)
    assert any("no connection within" in str(r.get("error")) for r in failed), failed[:3]
    delays = [float(str(r["error"]).rsplit("retry in ", 1)[1].rstrip("s)")) for r in failed]
    assert max(delays) > min(delays), delays  # it backs off, not at once forever
    assert max(delays) <= CYCLE / 4 + 1e-6, delays  # and never past a quarter cycle
    started = events(logs, "watch_failures_started")
    assert len(started) == 1, started  # one episode for every scope, not a line per retry
    assert len(events(logs, "watch_failures_ended")) == 1
    assert events(logs, "canary_unhealthy") == []


async def _async(value: Any) -> Any:
    return value


async def test_a_half_open_watch_is_replaced_and_never_fails_health(api, proxy, proxied, namespace):
    """Established connections go silent with no FIN or RST (a crashed replica behind a
    load balancer) while new connections work: canaryd replaces its watch at the first
    deadline instead of calling the operator unhealthy."""
    await create_canary(api, namespace)
    async with canaryd(proxied, "--namespace", namespace) as url:
        await until_healthy(url, namespace)
        health_log = HealthLog(url)
        suspected = 'canaryd_watch_restarts_total{resource="flinkdeployments",why="suspected"}'
        before = await metric(url, suspected)
        proxy.freeze()

        async def replaced() -> bool:
            return await metric(url, suspected) > before

        await eventually(replaced, "the silent watch to be replaced", within=6 * CYCLE)
        judged = await metric(url, 'canaryd_verdicts_total{verdict="healthy"}')

        async def judged_again() -> bool:
            return await metric(url, 'canaryd_verdicts_total{verdict="healthy"}') > judged

        await eventually(judged_again, "a healthy verdict after the replacement")
        await until_healthy(url, namespace)
        assert await health_log.stop() == {200}
        assert await metric(url, 'canaryd_verdicts_total{verdict="unhealthy"}') == 0
        proxy.heal()


async def test_an_outage_behind_a_load_balancer_answering_503_is_no_verdict(
    api, proxy, proxied, namespace
):
    """The API server goes away behind a load balancer that answers every request 503
    "no healthy upstream" (not a Kubernetes answer), between a bump's answer and its
    watch event: no sign of the API server serving, so no verdict (unknown, /healthz 200
    throughout) as with refused connections, not "the watch has not resumed"; once it
    is back the canary is judged as usual."""
    await create_canary(api, namespace)
    async with canaryd(proxied, "--namespace", namespace) as url:
        await until_healthy(url, namespace)
        health_log = HealthLog(url)
        proxy.outage(after_bytes=1000)  # after the next bump's answer: its event is lost
        await eventually(lambda: _async(proxy.outage_state() == "on"), "the outage", 4 * CYCLE)

        async def away() -> bool:
            body = (await health(url))[1]
            return "not answering" in str(body) and states(body, namespace)["canary"] == "unknown"

        await eventually(away, "no verdict: the API server is not answering", 6 * CYCLE)
        proxy.heal()
        judged = await metric(url, 'canaryd_verdicts_total{verdict="healthy"}')

        async def judged_again() -> bool:
            return await metric(url, 'canaryd_verdicts_total{verdict="healthy"}') > judged

        await eventually(judged_again, "a healthy verdict once it is back", 6 * CYCLE)
        await until_healthy(url, namespace)
        assert await health_log.stop() == {200}
        assert await metric(url, 'canaryd_verdicts_total{verdict="unhealthy"}') == 0


async def test_connections_reset_mid_stream_cost_no_verdict(api, proxy, proxied, namespace):
    await create_canary(api, namespace)
    async with canaryd(proxied, "--namespace", namespace) as url:
        await until_healthy(url, namespace)
        health_log = HealthLog(url)
        for _ in range(5):
            proxy.reset()
            await asyncio.sleep(CYCLE)  # the fault's pace: one reset a cycle
        await until_healthy(url, namespace)
        assert await health_log.stop() == {200}
        assert await metric(url, 'canaryd_verdicts_total{verdict="unhealthy"}') == 0
        assert (
            await metric(
                url, 'canaryd_watch_restarts_total{resource="flinkdeployments",why="dropped"}'
            )
            >= 1
        )


async def test_a_bump_whose_answer_is_lost_is_applied_once_on_a_real_api_server(
    api, proxy, proxied, namespace
):
    """The connection of a bump is reset after kube-apiserver got the whole request,
    before any byte of its answer: the write may have been applied. canaryd resends it
    identical (same resourceVersion precondition), so kube-apiserver applies it at most
    once; a 409 and a re-read tell canaryd it landed. Every nonce canaryd's writes
    raised is one it counts as written: none applied twice, none judged unhealthy."""
    await create_canary(api, namespace)
    written = 'canaryd_bumps_total{result="written"}'
    async with canaryd(proxied, "--namespace", namespace) as url:
        await until_healthy(url, namespace)
        health_log = HealthLog(url)

        async def counted_and_nonce() -> tuple[float, int]:
            """The written count and the nonce, read with no bump answered between."""
            while True:
                before = await metric(url, written)
                nonce = int((await get_canary(api, namespace))["spec"].get("restartNonce", 0))
                if await metric(url, written) == before:
                    return before, nonce

        count0, nonce0 = await counted_and_nonce()
        proxy.cut_next_answer()
        await eventually(lambda: _async(proxy.cuts() == 1), "a bump's answer cut", 4 * CYCLE)

        async def two_more() -> bool:
            return await metric(url, written) >= count0 + 3

        await eventually(two_more, "bumps after the cut", within=6 * CYCLE)
        count, nonce = await counted_and_nonce()
        assert nonce - nonce0 == count - count0, (
            f"the nonce rose {nonce - nonce0} for {count - count0} bumps written: "
            "a bump was applied twice"
        )
        await until_healthy(url, namespace)
        assert await health_log.stop() == {200}
        assert await metric(url, 'canaryd_verdicts_total{verdict="unhealthy"}') == 0


@pytest.mark.timeout(240)
async def test_slow_lease_renewals_keep_every_canary_checked_on_a_real_lease(
    api, cluster, proxy, proxied, namespace
):
    """Every answer 1.5 s late (the Lease renewals too, well inside the renew deadline)
    at a 12 s cycle: a write the leader's fence holds back waits for the next renewal.
    Every canary is bumped every cycle and none is out of the schedule."""
    plane = cluster.needs_plane()
    import yaml

    for name in ("lease-role.yaml", "lease-rolebinding.yaml"):
        doc = yaml.safe_load((ROOT / "config" / "standalone-ha" / name).read_text())
        plane.apply(doc, "canaryd")
    cycle, names = 12.0, [f"canary-{n:02}" for n in range(12)]
    for name in names:
        await create_canary(api, namespace, name)
    args = ("--namespace", namespace, "--leader-elect", "--lease-namespace", "canaryd")
    async with canaryd(proxied, *args, "--identity", "slow", cycle=cycle) as url:

        async def all_healthy() -> bool:
            status, body = await health(url)
            seen = states(body, namespace)
            return status == 200 and all(seen.get(n) == "healthy" for n in names)

        await eventually(all_healthy, "every canary healthy", within=3 * cycle + 10)
        proxy.latency(1.5)
        nonces = {n: (await get_canary(api, namespace, n))["spec"]["restartNonce"] for n in names}

        async def every_one_bumped_twice() -> bool:
            for name in names:
                obj = await get_canary(api, namespace, name)
                if obj["spec"].get("restartNonce", 0) < nonces[name] + 2:
                    return False
            return True

        await eventually(every_one_bumped_twice, "every canary bumped twice", 3 * cycle + 6)
        assert await metric(url, "canaryd_canaries_unscheduled") == 0
        assert await metric(url, "canaryd_leader ") == 1  # not canaryd_leader_transitions
        proxy.heal()
        assert (await health(url))[0] == 200


@pytest.mark.timeout(240)
async def test_a_brownout_of_5s_on_every_answer_for_30s_restarts_nothing(
    api, proxy, proxied, namespace
):
    """Every answer 5 s late for 30 s (an overloaded API server): with the shipped
    request timeout (10 s, at most half the cycle) at a 12 s cycle, bumps are slow but
    written, their events arrive late but in time: zero unhealthy, the same process."""
    cycle = 12.0
    await create_canary(api, namespace)
    async with canaryd(proxied, "--namespace", namespace, cycle=cycle) as url:
        pid = PIDS[url]
        await eventually(lambda: _healthy(url, namespace), "healthy", within=4 * cycle)
        health_log = HealthLog(url)
        written = await metric(url, 'canaryd_bumps_total{result="written"}')
        failed = await metric(url, 'canaryd_bumps_total{result="failed"}')
        proxy.latency(5.0)
        await asyncio.sleep(30)  # the brownout's length
        proxy.latency(0)
        await eventually(lambda: _healthy(url, namespace), "healthy after", within=3 * cycle)
        assert await health_log.stop() == {200}
        assert await metric(url, 'canaryd_verdicts_total{verdict="unhealthy"}') == 0
        assert PIDS[url] == pid and os.kill(pid, 0) is None  # never restarted
        written = await metric(url, 'canaryd_bumps_total{result="written"}') - written
        failed = await metric(url, 'canaryd_bumps_total{result="failed"}') - failed
        # A warm connection answers in 5 s; a new one pays the TLS handshake's delayed
        # answer too (10 s and more: past the 6 s request timeout): unknown, no verdict.
        print(f"brownout: {written:.0f} bumps written, {failed:.0f} failed (unknown)")


async def _healthy(url: str, namespace: str) -> bool:
    status, body = await health(url)
    return status == 200 and states(body, namespace).get("canary") == "healthy"


@pytest.mark.timeout(400)
async def test_600_watched_namespaces_at_a_soft_limit_of_1024_open_files(api, cluster):
    """A systemd service's default soft limit: canaryd raises it to the hard limit, and
    all 1,200 watches (two kinds) of 600 namespaces get their connections."""
    cluster.needs_plane()
    core = client.CoreV1Api(api)
    names = [f"fd-{os.getpid()}-{n:03}" for n in range(600)]
    for batch in range(0, len(names), 50):
        await asyncio.gather(
            *(core.create_namespace({"metadata": {"name": n}}) for n in names[batch : batch + 50])
        )
    try:
        await create_canary(api, names[-1])
        logs: list[dict[str, Any]] = []
        async with canaryd(
            cluster.canaryd,
            "--namespace",
            ",".join(names),
            logs=logs,
            open_files=1024,
            ready_within=180,
        ) as url:
            await until_healthy(url, names[-1])
            (limit,) = events(logs, "open_files_limit")
            assert limit["raised_from"] == 1024 and limit["soft"] > 2 * 600 + 256, limit
            assert events(logs, "open_files_limit_too_low") == []
    finally:
        for batch in range(0, len(names), 50):
            await asyncio.gather(
                *(core.delete_namespace(n) for n in names[batch : batch + 50]),
                return_exceptions=True,
            )


async def test_the_bump_stages_are_measured_on_a_real_api_server(api, cluster, namespace):
    """The SLI on a real kube-apiserver: every bump's answer and its watch event, from
    its PATCH. On a real server the event often arrives before the answer."""
    await create_canary(api, namespace)
    async with canaryd(cluster.canaryd, "--namespace", namespace) as url:
        await until_healthy(url, namespace)

        async def measured() -> Any:
            _, body = await health(url)
            (canary,) = [c for c in body["canaries"] if c["namespace"] == namespace]
            stages = canary["bumpSeconds"]
            return stages if {"answered", "observed"} <= set(stages) else None

        stages = await eventually(measured, "a bump answered and observed")
        count = await metric(
            url, 'canaryd_bump_duration_seconds_count{kind="flinkdeployments",stage="observed"}'
        )
        total = await metric(
            url, 'canaryd_bump_duration_seconds_sum{kind="flinkdeployments",stage="observed"}'
        )
    mean = total / count
    print(f"real API server, last bump: {stages}; observed: mean {mean:.4f}s of {count:.0f}")
    assert 0 <= stages["answered"] < CYCLE and 0 <= stages["observed"] < CYCLE, stages
    assert count >= 1 and mean < 1.0  # the SLO's threshold, on an idle machine


# --------------------------------------------------------- canaryd check


async def canaryd_check(kubeconfig: Path, *args: str) -> tuple[int, list[str]]:
    """``canaryd check``: its exit status and its lines (stdout, then stderr)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "canaryd",
        "check",
        "--kubeconfig",
        str(kubeconfig),
        *args,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(60):
        out, err = await process.communicate()
    assert process.returncode is not None
    return process.returncode, (out.decode() + err.decode()).splitlines()


def a_canary_to_check(plane: Any, namespace: str) -> None:
    """A canary where ``canaryd check`` looks: without one, canaryd would be blind
    (no_canaries), and the check exits 1."""
    canary = {
        "apiVersion": f"{G}/{V}",
        "kind": "FlinkDeployment",
        "metadata": {"name": "checked", "labels": {LABEL: "true"}},
    }
    status, body = plane.request("POST", f"/apis/{G}/{V}/namespaces/{namespace}/{FD}", canary)
    assert status in (201, 409), body


async def test_canaryd_check_names_patch_when_a_role_lacks_it_on_a_real_api_server(
    cluster, namespace, tmp_path
):
    """kube-apiserver's own SelfSubjectAccessReview: a ServiceAccount whose Role is
    config/rbac/namespaced's without patch gets exit 2 and `MISSING patch
    flinkdeployments`; the shipped roles (namespaced, cluster-wide, and the Lease Role
    of config/standalone-ha under --leader-elect) get exit 0."""
    plane = cluster.needs_plane()
    import yaml

    from tests.controlplane.launcher import CANARYD_NAMESPACE

    role = yaml.safe_load((ROOT / "config" / "rbac" / "namespaced" / "role.yaml").read_text())
    for rule in role["rules"]:
        rule["verbs"] = [verb for verb in rule["verbs"] if verb != "patch"]
    role["metadata"]["name"] = "no-patch"
    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "no-patch"}}
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": "no-patch"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "no-patch"},
        "subjects": [{"kind": "ServiceAccount", "name": "no-patch", "namespace": namespace}],
    }
    for obj in (account, role, binding):
        plane.apply(obj, namespace)
    kubeconfig = tmp_path / "no-patch.kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "e2e",
                        "cluster": {
                            "server": plane.url,
                            "certificate-authority": str(plane.ca_file),
                        },
                    }
                ],
                "users": [
                    {
                        "name": "no-patch",
                        "user": {"token": plane.service_account_token(namespace, "no-patch")},
                    }
                ],
                "contexts": [
                    {"name": "no-patch", "context": {"cluster": "e2e", "user": "no-patch"}}
                ],
                "current-context": "no-patch",
            }
        )
    )

    async def check_until_bound(*args: str) -> tuple[int, list[str]]:
        """A new RoleBinding takes a moment to reach the authorizer's cache: the list it
        grants is asked again until granted (bounded)."""

        async def listed() -> Any:
            code, lines = await canaryd_check(*args)
            return (code, lines) if f"ok   list flinkdeployments in {namespace}" in lines else None

        result: tuple[int, list[str]] = await eventually(listed, "the Role to be in effect", 30)
        return result

    code, lines = await check_until_bound(kubeconfig, "--namespace", namespace)
    assert code == 2, lines
    assert f"MISSING patch flinkdeployments in {namespace}" in lines, lines
    assert f"MISSING patch flinksessionjobs in {namespace}" in lines, lines
    assert f"ok   watch flinkdeployments in {namespace}" in lines, lines
    assert "MISSING list namespaces (cluster-scoped)" in lines, lines  # not in this Role
    assert lines[-1].startswith(f"canaryd check: 4 of 8 permissions missing on {plane.url}: ")

    assert cluster.namespaced is not None
    code, lines = await canaryd_check(cluster.namespaced, "--namespace", OWN)
    assert code == 1 and lines[-2] == f"BLIND no canary labelled {LABEL}=true in {OWN}", lines
    a_canary_to_check(plane, OWN)
    code, lines = await canaryd_check(cluster.namespaced, "--namespace", OWN)
    assert code == 0, lines
    assert lines[-1] == f"canaryd check: all 8 permissions granted on {plane.url}", lines
    code, lines = await canaryd_check(cluster.namespaced, "--namespace", namespace)
    assert code == 2 and f"MISSING list flinkdeployments in {namespace}" in lines, lines

    for name in ("lease-role.yaml", "lease-rolebinding.yaml"):
        doc = yaml.safe_load((ROOT / "config" / "standalone-ha" / name).read_text())
        plane.apply(doc, CANARYD_NAMESPACE)
    args = ("--leader-elect", "--lease-namespace", CANARYD_NAMESPACE)
    code, lines = await canaryd_check(cluster.canaryd, *args)
    assert code == 0, lines
    assert f"ok   update leases/canaryd in {CANARYD_NAMESPACE}" in lines, lines
    assert "ok   patch flinkdeployments in all namespaces" in lines, lines
    code, lines = await canaryd_check(cluster.canaryd, *args, "--lease-name", "another")
    assert code == 2 and f"MISSING update leases/another in {CANARYD_NAMESPACE}" in lines, lines


async def test_the_charts_objects_are_admitted_and_its_rbac_is_what_canaryd_check_asks(
    cluster, tmp_path
):
    """charts/canaryd on a real kube-apiserver: every object it renders (default, HA with
    monitoring off, namespaced) admitted by a server-side dry run; its ServiceAccount and
    RBAC applied, `canaryd check` as that ServiceAccount with the Deployment's own args
    and env (what `helm test` runs) exits 0; without the chart's RBAC it exits 2 naming
    patch."""
    plane = cluster.needs_plane()
    import yaml

    from tests.controlplane.launcher import namespace_object
    from tests.test_chart import canaryd_container, helm_binary, one, template
    from tests.test_helm import Discovery

    helm = helm_binary()
    release = f"chart-e2e-{os.getpid()}"
    plane.apply(namespace_object(release))
    watched = f"{release}-watched"
    plane.apply(namespace_object(watched))
    a_canary_to_check(plane, watched)
    discovery = Discovery(plane)
    variants = {
        "default": [],
        "ha": ["highAvailability.enabled=true"],
        "namespaced": [f"watchNamespaces={{{watched}}}"],
        "no-rbac": ["rbac.create=false", "admissionPolicy.enabled=false"],
    }
    # The operator's account in a namespace that exists here (its Role goes there).
    account = f"admissionPolicy.operatorServiceAccount={release}/flink-operator"
    rendered = {
        name: template(helm, account, *values, release=release, namespace=release)
        for name, values in variants.items()
    }
    for name, objects in rendered.items():
        for obj in objects:
            if obj["kind"] == "Pod":
                continue  # helm test's pod: the check below runs what it runs
            namespaced = "/namespaces/" in discovery.path(
                {**obj, "metadata": {**obj["metadata"], "namespace": release}}
            )
            if namespaced:
                obj["metadata"].setdefault("namespace", release)
            path = discovery.path(obj) + "?dryRun=All&fieldValidation=Strict"
            status, body = plane.request("POST", path, obj)
            assert status == 201, (name, obj["kind"], obj["metadata"]["name"], status, body)

    def kubeconfig(account: str) -> Path:
        path = tmp_path / f"{account}.kubeconfig"
        token = plane.service_account_token(release, account)
        path.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [
                        {
                            "name": "e2e",
                            "cluster": {
                                "server": plane.url,
                                "certificate-authority": str(plane.ca_file),
                            },
                        }
                    ],
                    "users": [{"name": account, "user": {"token": token}}],
                    "contexts": [{"name": "c", "context": {"cluster": "e2e", "user": account}}],
                    "current-context": "c",
                }
            )
        )
        return path

    async def check_as_helm_test(
        objects: list[dict[str, Any]], until: Any = lambda code, lines: code == 0
    ) -> tuple[int, list[str]]:
        """The chart's ServiceAccount and RBAC applied (the rest is not needed to ask),
        then `canaryd check` with the Deployment's args and env, until the new bindings
        are in the authorizer's cache (bounded): until it exits 0, or as ``until`` says."""
        for obj in objects:
            if obj["kind"] in (
                "ServiceAccount",
                "Role",
                "RoleBinding",
                "ClusterRole",
                "ClusterRoleBinding",
            ):
                plane.apply(obj, obj["metadata"].get("namespace", release))
        container = canaryd_container(one(objects, "Deployment"))
        account = one(objects, "ServiceAccount")["metadata"]["name"]
        env = [f"{e['name']}={e['value']}" for e in container["env"] if "value" in e]
        env += [f"CANARYD_LEASE_NAMESPACE={release}", "CANARYD_IDENTITY=check"]
        path = kubeconfig(account)

        async def granted() -> Any:
            process = await asyncio.create_subprocess_exec(
                "env",
                *env,
                sys.executable,
                "-m",
                "canaryd",
                "check",
                "--kubeconfig",
                str(path),
                *container["args"],
                cwd=ROOT,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            async with asyncio.timeout(60):
                out, err = await process.communicate()
            lines = (out.decode() + err.decode()).splitlines()
            return (process.returncode, lines) if until(process.returncode, lines) else None

        result: tuple[int, list[str]] = await eventually(granted, "the chart's RBAC in effect", 30)
        return result

    # The operator's account, which the policy names, does not exist yet: helm test fails.
    missing = f"MISSING serviceaccount flink-operator in {release}: "
    code, lines = await check_as_helm_test(
        rendered["ha"], lambda code, lines: code == 2 and lines[-2].startswith(missing)
    )
    assert lines[-1].endswith(f"service account {release}/flink-operator does not exist"), lines
    operator_account = {"apiVersion": "v1", "kind": "ServiceAccount"}
    plane.apply({**operator_account, "metadata": {"name": "flink-operator"}}, release)
    code, lines = await check_as_helm_test(rendered["ha"])
    assert f"ok   get serviceaccounts/flink-operator in {release}" in lines, lines
    assert lines[-1].startswith("canaryd check: all ") and plane.url in lines[-1], lines
    (lease,) = [
        e["value"]
        for e in canaryd_container(one(rendered["ha"], "Deployment"))["env"]
        if e["name"] == "CANARYD_LEASE_NAME"
    ]
    assert f"ok   update leases/{lease} in {release}" in lines, lines
    code, lines = await check_as_helm_test(rendered["namespaced"])
    assert f"ok   patch flinkdeployments in {watched}" in lines, lines
    # Without the chart's RBAC: what is missing, named.
    bare = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "bare"}}
    plane.apply(bare, release)
    code, lines = await canaryd_check(kubeconfig("bare"))
    assert code == 2 and "MISSING patch flinkdeployments in all namespaces" in lines, lines


# ------------- config/admission: the operator's stale replace, refused where it lands

OPERATOR_NAMESPACE, OPERATOR_SA = "flink-operator", "flink-operator"
"""The operator's service account as the chart names it (config/admission's default)."""


@dataclass
class Operator:
    """The upstream operator's writes, as its service account sends them: replace() of
    a copy it read earlier (fabric8 refreshes only resourceVersion on a 409)."""

    plane: Any
    token: str

    def get(self, path: str) -> dict[str, Any]:
        status, body = self.plane.request("GET", path, token=self.token)
        assert status == 200, body
        return dict(body)

    def put(self, path: str, obj: dict[str, Any], query: str = "") -> tuple[int, Any]:
        return self.plane.request("PUT", path + query, obj, token=self.token)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def operator(cluster: Cluster) -> Operator:
    """config/admission's policy and binding as config/standalone renders them (kubectl's
    kustomize, as a user applies them: cluster-scoped, whatever namespace the
    kustomization sets), and the operator's service account with the operator's rights
    on the canary kinds."""
    plane = cluster.needs_plane()
    from tests.kubelet import render

    policy = [
        d
        for d in render(ROOT / "config" / "standalone")
        if d["apiVersion"].startswith("admissionregistration.k8s.io/")
    ]
    assert sorted(d["kind"] for d in policy) == [
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    ]
    for obj in policy:
        plane.apply(obj)
    plane.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": OPERATOR_NAMESPACE}})
    plane.apply(
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": OPERATOR_SA}},
        namespace=OPERATOR_NAMESPACE,
    )
    plane.apply(
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": "e2e-flink-operator"},
            "rules": [
                {
                    "apiGroups": [G],
                    "resources": [FD, f"{FD}/status", "flinksessionjobs"],
                    "verbs": ["get", "list", "watch", "update", "patch"],
                }
            ],
        }
    )
    plane.apply(
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "e2e-flink-operator"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "e2e-flink-operator",
            },
            "subjects": [
                {"kind": "ServiceAccount", "name": OPERATOR_SA, "namespace": OPERATOR_NAMESPACE}
            ],
        }
    )
    return Operator(plane, plane.service_account_token(OPERATOR_NAMESPACE, OPERATOR_SA))


POLICY_PATH = (
    "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies/canaryd-keep-canary-metadata"
)


def canary_path(namespace: str, name: str = "canary") -> str:
    return f"/apis/{G}/{V}/namespaces/{namespace}/{FD}/{name}"


def bumped(stale: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
    """The operator's bump: its cached copy, nonce + 1, resourceVersion refreshed."""
    obj = json.loads(json.dumps(stale))
    obj["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
    spec = obj.setdefault("spec", {})
    spec["restartNonce"] = (spec.get("restartNonce") or 0) + 1
    return obj


async def refused(operator: Operator, path: str, obj: dict[str, Any]) -> None:
    """The policy is read by kube-apiserver a moment after it is created: until a dry
    run of ``obj`` is refused (nothing stored either way), bounded."""

    async def denied() -> bool:
        return operator.put(path, obj, "?dryRun=All")[0] in (403, 422)

    await eventually(denied, "the policy to refuse the operator's stale copy", within=30)
    status, body = operator.put(path, obj)
    assert status in (403, 422), body
    assert "canary-metadata" in body["message"] and "stale copy" in body["message"], body


async def test_the_policy_refuses_the_operators_stale_replace_of_a_canary(api, operator, namespace):
    """Seed failure 1 beside the operator: a label and an annotation a user added since
    the operator's copy are not wiped by its replace(); the bump it retries on a fresh
    copy, its finalizers and its status writes pass."""
    await create_canary(api, namespace)
    path = canary_path(namespace)

    async def type_checked() -> Any:
        status, body = operator.plane.request("GET", POLICY_PATH)
        assert status == 200, body
        checked = body.get("status", {}).get("observedGeneration") == body["metadata"]["generation"]
        return body["status"] if checked else None

    # kube-apiserver's type check of the CEL against the CRD's schema: no warning.
    checked = await eventually(type_checked, "the policy's type check", within=30)
    assert not checked.get("typeChecking", {}).get("expressionWarnings"), checked
    stale = operator.get(path)
    await crd(api).patch_namespaced_custom_object(
        G,
        V,
        namespace,
        FD,
        "canary",
        {"metadata": {"labels": {"argocd.argoproj.io/instance": "x"}, "annotations": {"a": "b"}}},
        _content_type=MERGE,
    )
    current = operator.get(path)
    await refused(operator, path, bumped(stale, current))
    kept = operator.get(path)
    assert kept["metadata"]["labels"]["argocd.argoproj.io/instance"] == "x"
    assert kept["metadata"]["annotations"] == {"a": "b"}
    assert kept["metadata"]["generation"] == current["metadata"]["generation"]
    # The same bump on a fresh copy passes, and raises the generation.
    status, body = operator.put(path, bumped(kept, kept))
    assert status == 200, body
    assert body["metadata"]["generation"] == kept["metadata"]["generation"] + 1
    assert body["metadata"]["labels"] == kept["metadata"]["labels"]
    # Finalizers (metadata, not labels or annotations): added and removed.
    fresh = operator.get(path)
    fresh["metadata"]["finalizers"] = ["flinkdeployments.flink.apache.org/finalizer"]
    status, body = operator.put(path, fresh)
    assert status == 200, body
    body["metadata"]["finalizers"] = []
    status, body = operator.put(path, body)
    assert status == 200, body
    # /status is not the main resource: a status write from the stale copy passes.
    # (The CRD's status strategy keeps the stored metadata on /status anyway, so the
    # policy would find nothing to refuse there either: this pins that it passes.)
    status_obj = json.loads(json.dumps(stale))
    status_obj["metadata"]["resourceVersion"] = body["metadata"]["resourceVersion"]
    status_obj["status"] = {"lifecycleState": "STABLE"}
    status, body = operator.put(path + "/status", status_obj)
    assert status == 200, body
    assert body["status"] == {"lifecycleState": "STABLE"}
    assert body["metadata"]["labels"]["argocd.argoproj.io/instance"] == "x"


async def test_the_policy_keeps_a_removed_canary_label_removed(api, operator, namespace):
    """Seed failure 2 beside the operator: a canary label (any case of true) removed by
    its user is not put back by the operator's copy from before."""
    await crd(api).create_namespaced_custom_object(
        G,
        V,
        namespace,
        FD,
        {
            "apiVersion": f"{G}/{V}",
            "kind": "FlinkDeployment",
            "metadata": {"name": "canary", "labels": {LABEL: "True"}},
        },
    )
    path = canary_path(namespace)
    stale = operator.get(path)
    await crd(api).patch_namespaced_custom_object(
        G, V, namespace, FD, "canary", {"metadata": {"labels": {LABEL: None}}}, _content_type=MERGE
    )
    current = operator.get(path)
    await refused(operator, path, bumped(stale, current))
    after = operator.get(path)
    assert LABEL not in (after["metadata"].get("labels") or {})
    assert after["metadata"]["resourceVersion"] == current["metadata"]["resourceVersion"]


async def test_the_policy_keeps_a_canary_label_added_since_the_operators_copy(
    api, operator, namespace
):
    """The other way round: an ordinary FlinkDeployment made a canary by its user is a
    canary as stored, so the operator's copy from before (no canary label) may not
    wipe the label."""
    await crd(api).create_namespaced_custom_object(
        G,
        V,
        namespace,
        FD,
        {"apiVersion": f"{G}/{V}", "kind": "FlinkDeployment", "metadata": {"name": "canary"}},
    )
    path = canary_path(namespace)
    stale = operator.get(path)
    await crd(api).patch_namespaced_custom_object(
        G,
        V,
        namespace,
        FD,
        "canary",
        {"metadata": {"labels": {LABEL: "true"}}},
        _content_type=MERGE,
    )
    await refused(operator, path, bumped(stale, operator.get(path)))
    assert operator.get(path)["metadata"]["labels"][LABEL] == "true"


def operations_policy_check(namespace: str) -> list[str]:
    """docs/OPERATIONS.md's check that the policy is live, as written there, for the
    canary ``canary`` in ``namespace``."""
    text = (ROOT / "docs" / "OPERATIONS.md").read_text()
    (command,) = re.findall(r"\n    (kubectl --as=system:serviceaccount:[^\n]*\\\n[^\n]*)", text)
    words = command.replace("\\\n", " ").split()
    return [{"NAMESPACE": namespace, "CANARY": "canary"}.get(w, w) for w in words]


async def test_the_operations_check_that_the_policy_is_live(api, cluster, operator, namespace):
    """docs/OPERATIONS.md's command (kubectl, the admin impersonating the operator's
    account, a server-side dry run of a label on a canary) is refused by the policy;
    without --as (the admin: an account the policy does not name) it passes."""
    kubectl = kubectl_of(cluster)
    if kubectl is None:
        pytest.skip("no kubectl")
    await create_canary(api, namespace)
    argv = [kubectl, *operations_policy_check(namespace)[1:]]
    assert argv[1] == f"--as=system:serviceaccount:{OPERATOR_NAMESPACE}:{OPERATOR_SA}", argv
    admin = f"--kubeconfig={cluster.plane.kubeconfig('admin')}"

    async def run(*args: str) -> Any:
        done = await asyncio.to_thread(
            subprocess.run, [args[0], admin, *args[1:]], capture_output=True, text=True, timeout=60
        )
        return done

    async def refused() -> Any:
        done = await run(*argv)
        return done if "canary-metadata" in done.stderr else None

    done = await eventually(refused, "the policy to refuse the documented dry run", within=30)
    assert done.returncode != 0 and "would change its labels or annotations" in " ".join(
        done.stderr.split()
    ), done.stderr
    as_admin = await run(argv[0], *argv[2:])
    assert as_admin.returncode == 0 and "(server dry run)" in as_admin.stdout, as_admin
    labels = (await crd(api).get_namespaced_custom_object(G, V, namespace, FD, "canary"))[
        "metadata"
    ]["labels"]
    assert "canaryd.io/policy-check" not in labels, labels


async def test_the_policy_leaves_other_objects_and_other_users_alone(
    api, cluster, operator, namespace
):
    """Only the operator's writes to canaries are checked: its replace() of an ordinary
    FlinkDeployment, and a stale replace() of a canary by anyone else, pass (the first
    proves the policy is in effect)."""
    await create_canary(api, namespace)
    path = canary_path(namespace)
    stale = operator.get(path)
    await crd(api).patch_namespaced_custom_object(
        G,
        V,
        namespace,
        FD,
        "canary",
        {"metadata": {"annotations": {"a": "b"}}},
        _content_type=MERGE,
    )
    await refused(operator, path, bumped(stale, operator.get(path)))  # annotations alone
    status, body = cluster.plane.request("PUT", path, bumped(stale, operator.get(path)))
    assert status == 200, body  # the admin's: not the operator's service account
    await crd(api).create_namespaced_custom_object(
        G,
        V,
        namespace,
        FD,
        {"apiVersion": f"{G}/{V}", "kind": "FlinkDeployment", "metadata": {"name": "job"}},
    )
    job = canary_path(namespace, "job")
    stale = operator.get(job)
    await crd(api).patch_namespaced_custom_object(
        G, V, namespace, FD, "job", {"metadata": {"labels": {"team": "a"}}}, _content_type=MERGE
    )
    status, body = operator.put(job, bumped(stale, operator.get(job)))
    assert status == 200, body
