"""The real Flink Kubernetes Operator in the loop (`make e2e-operator`).

The upstream operator (release-1.15.0 on Flink 1.20.0, built from its source by
`make operator`) runs against the real control plane of `make e2e`, as the chart's
image runs it. These tests:

- walk the bug report's reproductions (FLINK-41050: metadata reverted, a removed
  canary label, a canary deleted without its finalizer, a namespace dropped from
  the watched namespaces with its Role removed) on the operator's own probe and on
  canaryd's /healthz, with the same objects and timings, and write what they
  measured to the report (docs/OPERATOR.md holds a run's table);
- pin the metric names canaryd's `operator-metrics` mode reads, on the real reporter;
- wedge the operator for real (its API connections half-open through the fault
  proxy; SIGSTOP of its JVM) with canaryd beside it in `operator-metrics` mode under
  the sidecar manifest's probe settings, a kubelet-like prober restarting the
  operator: unhealthy within two cycles, exactly one restart, healthy again; and
  the same wedges in `watch` mode, which cannot see them.

Skipped unless CANARYD_E2E=operator (make e2e-operator sets it); they need Java 17,
the operator build and Go (the control plane), none of which CI's `make test` has.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException

from canaryd.opmetrics import parse
from tests.operator import real
from tests.test_e2e import FD, LABEL, MERGE, G, V, canaryd, crd, health, states

ENABLED = os.environ.get("CANARYD_E2E") == "operator"
CYCLE = 10.0
"""The canary timeout of both the operator and canaryd here (the operator's default is a
minute; 10 s keeps each reproduction to a minute or two)."""
REPORT = Path(
    os.environ.get("CANARYD_OPERATOR_REPORT", real.ROOT / ".cache" / "e2e-operator.jsonl")
)

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not ENABLED, reason="make e2e-operator runs these (Java, the operator build)"
    ),
    pytest.mark.timeout(900),
]


# --------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def plane() -> Iterator[Any]:
    problem = real.built()
    if problem is not None:
        pytest.fail(problem)  # make e2e-operator builds it first: a missing build is a failure
    from tests.controlplane.launcher import ControlPlane

    started = ControlPlane()
    started.start()
    try:
        real.install_crds(started)
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def operator_kubeconfig(plane: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return real.account(plane, tmp_path_factory.mktemp("operator"))


@pytest.fixture
async def api(plane: Any) -> AsyncIterator[client.ApiClient]:
    configuration = client.Configuration()
    await config.load_kube_config(
        config_file=str(plane.kubeconfig("admin")), client_configuration=configuration
    )
    async with client.ApiClient(configuration) as api_client:
        yield api_client


_names = iter(range(1, 1000))


@pytest.fixture
def namespace(plane: Any) -> Iterator[str]:
    name = f"op-{os.getpid()}-{next(_names)}"
    plane.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    real.grant(plane, name)
    try:
        yield name
    finally:
        plane.request("DELETE", f"/api/v1/namespaces/{name}")


@contextlib.contextmanager
def operator(kubeconfig: Path, namespaces: str, **conf: Any) -> Iterator[real.RealOperator]:
    process = real.RealOperator(
        kubeconfig,
        {
            "kubernetes.operator.watched.namespaces": namespaces,
            "kubernetes.operator.health.canary.resource.timeout": f"{CYCLE:g} s",
            **conf,
        },
    )
    process.start()
    try:
        yield process
    except BaseException:
        print(process.tail())  # what the operator said, for the failure's report
        raise
    finally:
        process.close()


def record(**row: Any) -> None:
    row["at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    real.report(REPORT, row)
    print("report:", json.dumps(row))


async def create(
    api: client.ApiClient, namespace: str, name: str = "canary", **labels: str
) -> None:
    await crd(api).create_namespaced_custom_object(
        G,
        V,
        namespace,
        FD,
        {
            "apiVersion": f"{G}/{V}",
            "kind": "FlinkDeployment",
            "metadata": {"name": name, "labels": {LABEL: "true", **labels}},
        },
    )


async def obj(api: client.ApiClient, namespace: str, name: str = "canary") -> dict[str, Any]:
    found: dict[str, Any] = await crd(api).get_namespaced_custom_object(G, V, namespace, FD, name)
    return found


async def merge(
    api: client.ApiClient, namespace: str, patch: dict[str, Any], name: str = "canary"
) -> None:
    await crd(api).patch_namespaced_custom_object(
        G, V, namespace, FD, name, patch, _content_type=MERGE
    )


def nonce(found: dict[str, Any]) -> int:
    return int((found.get("spec") or {}).get("restartNonce") or 0)


async def until(check: Any, what: str, within: float) -> Any:
    """Poll (a real cluster, real processes: nothing to wait on), bounded."""
    end = time.monotonic() + within
    while True:
        with contextlib.suppress(aiohttp.ClientError, ApiException):
            result = await check()
            if result:
                return result
        if time.monotonic() > end:
            raise AssertionError(f"still waiting after {within}s for {what}")
        await asyncio.sleep(0.5)


class Probe:
    """An HTTP probe polled every second for a test's length: the statuses seen, and
    whether a liveness probe with the chart's settings (10 s period, 3 failures) would
    have restarted the process (30 s of consecutive failures)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.seen: list[tuple[float, int]] = []
        self._task = asyncio.create_task(self._poll())

    async def _poll(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
            while True:
                status = 0
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with http.get(self.url) as answer:
                        status = answer.status
                self.seen.append((time.monotonic(), status))
                await asyncio.sleep(1.0)

    async def stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    def first_failure(self, since: float) -> float | None:
        return next((t - since for t, s in self.seen if t >= since and s != 200), None)

    def longest_failure(self) -> float:
        longest, start = 0.0, None
        for t, status in self.seen:
            if status != 200:
                start = t if start is None else start
                longest = max(longest, t - start)
            else:
                start = None
        return longest

    def summary(self, since: float) -> dict[str, Any]:
        statuses = sorted({s for t, s in self.seen if t >= since})
        longest = self.longest_failure()
        first = self.first_failure(since)
        return {
            "statuses": statuses,
            "first_failure_after_s": None if first is None else round(first, 1),
            "longest_failure_s": round(longest, 1),
            "liveness_restart": longest >= 30,
        }


# ------------------------------------------------------ the reporter's names


async def test_the_reporter_exports_the_series_operator_metrics_reads(
    api, operator_kubeconfig, namespace
):
    """Pinned on the real operator: its Prometheus reporter exports, per canary, the
    count of finished reconciles (`..._JOSDK_Reconciliation_finished_Count` with
    resourcetype, resourcens and resourcename), and it rises with every bump."""
    await create(api, namespace)
    with operator(operator_kubeconfig, namespace) as op:
        await asyncio.to_thread(op.wait_ready)
        key = ("FlinkDeployment", namespace, "canary")

        async def count() -> float | None:
            async with aiohttp.ClientSession() as http, http.get(op.metrics_url) as answer:
                return parse(await answer.text()).count(key)

        first = await until(count, "the canary's reconcile counter", within=60)
        await merge(
            api, namespace, {"spec": {"restartNonce": nonce(await obj(api, namespace)) + 100}}
        )
        risen = await until(lambda: _above(count, first), "the counter to rise after a bump", 30)
        record(
            test="reporter",
            series="*_JOSDK_Reconciliation_finished_Count",
            before=first,
            after=risen,
        )


async def _above(count: Any, value: float) -> float | None:
    now = await count()
    return now if now is not None and now > value else None


# ------------------------------------------------- the bug report, side by side


async def test_seed_1_and_2_metadata_and_the_canary_label(
    api, operator_kubeconfig, namespace, plane
):
    """#1 labels and annotations added after a check, #2 the canary label removed: on
    the operator (alone), then on canaryd (alone), the same object and timings."""
    await create(api, namespace)
    with operator(operator_kubeconfig, namespace) as op:
        await asyncio.to_thread(op.wait_ready)
        probe = Probe(op.probe_url)
        start = nonce(await until(lambda: _nonce_at_least(api, namespace, 2), "two bumps", 60))
        t0 = time.monotonic()
        await merge(
            api,
            namespace,
            {"metadata": {"labels": {"repro": "409"}, "annotations": {"repro/note": "keep-me"}}},
        )
        wiped_after = None
        while nonce(await obj(api, namespace)) < start + 3:
            found = await obj(api, namespace)
            if wiped_after is None and "repro" not in (found["metadata"].get("labels") or {}):
                wiped_after = round(time.monotonic() - t0, 1)
            await asyncio.sleep(0.5)
            assert time.monotonic() - t0 < 6 * CYCLE, "the operator stopped bumping"
        found = await obj(api, namespace)
        labels, notes = (
            found["metadata"].get("labels") or {},
            found["metadata"].get("annotations") or {},
        )
        record(
            test="seed-1",
            who="operator",
            label_kept="repro" in labels,
            annotation_kept="repro/note" in notes,
            wiped_after_s=wiped_after,
            probe=probe.summary(t0),
        )
        # #2: remove the canary label; does it come back, do the checks go on?
        t1 = time.monotonic()
        await merge(api, namespace, {"metadata": {"labels": {LABEL: None}}})
        before = nonce(await obj(api, namespace))
        back_after = None
        while time.monotonic() - t1 < 3 * CYCLE:
            found = await obj(api, namespace)
            if back_after is None and LABEL in (found["metadata"].get("labels") or {}):
                back_after = round(time.monotonic() - t1, 1)
            await asyncio.sleep(0.5)
        found = await obj(api, namespace)
        record(
            test="seed-2",
            who="operator",
            label_back_after_s=back_after,
            bumps_after_removal=nonce(found) - before,
            probe=probe.summary(t1),
        )
        await probe.stop()
    # canaryd, alone, on the same object: the label (back or not) set again.
    await merge(api, namespace, {"metadata": {"labels": {LABEL: "true", "repro": None}}})
    async with canaryd(plane.kubeconfig("canaryd"), "--namespace", namespace, cycle=CYCLE) as url:
        probe = Probe(url + "/healthz")
        await until(lambda: _state(url, namespace, "healthy"), "canaryd's verdict", 4 * CYCLE)
        start = nonce(await obj(api, namespace))
        t0 = time.monotonic()
        await merge(
            api,
            namespace,
            {"metadata": {"labels": {"repro": "409"}, "annotations": {"repro/note": "keep-me"}}},
        )
        found = await until(
            lambda: _nonce_at_least(api, namespace, start + 3), "3 bumps", 5 * CYCLE
        )
        labels, notes = (
            found["metadata"].get("labels") or {},
            found["metadata"].get("annotations") or {},
        )
        record(
            test="seed-1",
            who="canaryd",
            label_kept="repro" in labels,
            annotation_kept="repro/note" in notes,
            wiped_after_s=None,
            probe=probe.summary(t0),
        )
        assert "repro" in labels and notes.get("repro/note") == "keep-me"
        t1 = time.monotonic()
        await merge(api, namespace, {"metadata": {"labels": {LABEL: None}}})
        await until(lambda: _state(url, namespace, None), "the canary to be dropped", 2 * CYCLE)
        dropped_after = round(time.monotonic() - t1, 1)
        before = nonce(await obj(api, namespace))
        await asyncio.sleep(3 * CYCLE)  # three cycles of a real cluster: is anything written?
        found = await obj(api, namespace)
        back = LABEL in (found["metadata"].get("labels") or {})
        record(
            test="seed-2",
            who="canaryd",
            label_back_after_s=None if not back else "yes",
            bumps_after_removal=nonce(found) - before,
            dropped_after_s=dropped_after,
            probe=probe.summary(t1),
        )
        await probe.stop()
        assert not back and nonce(found) == before


async def _state(url: str, namespace: str, state: str | None, name: str = "canary") -> bool:
    _, body = await health(url)
    return states(body, namespace).get(name) == state


async def side_by_side(
    test: str, op: real.RealOperator, url: str, namespace: str, act: Any, drop_within: float
) -> None:
    """Do ``act`` with the operator and canaryd both watching, then watch both probes
    for eight cycles and record them: canaryd drops the canary and stays 200."""
    upstream, ours = Probe(op.probe_url), Probe(url + "/healthz")
    t0 = time.monotonic()
    await act()
    await until(lambda: _state(url, namespace, None), "canaryd to drop it", drop_within)
    dropped_after = round(time.monotonic() - t0, 1)
    await asyncio.sleep(8 * CYCLE)  # eight cycles of real processes: what do the probes do?
    await upstream.stop()
    await ours.stop()
    record(test=test, who="operator", probe=upstream.summary(t0))
    record(test=test, who="canaryd", dropped_after_s=dropped_after, probe=ours.summary(t0))
    assert ours.summary(t0)["statuses"] == [200]


async def _nonce_at_least(
    api: client.ApiClient, namespace: str, value: int
) -> dict[str, Any] | None:
    found = await obj(api, namespace)
    return found if nonce(found) >= value else None


async def test_seed_4_a_canary_deleted_after_its_finalizer_was_removed(
    api, operator_kubeconfig, namespace, plane
):
    """#4, the first half: the canary is deleted with its finalizer removed by hand (the
    operator's cleanup never runs). The operator and canaryd side by side, on the same
    object; both probes watched for eight cycles."""
    await create(api, namespace)
    with operator(operator_kubeconfig, namespace) as op:
        await asyncio.to_thread(op.wait_ready)
        async with canaryd(
            plane.kubeconfig("canaryd"), "--namespace", namespace, cycle=CYCLE
        ) as url:
            await until(lambda: _state(url, namespace, "healthy"), "canaryd's verdict", 4 * CYCLE)

            async def delete() -> None:
                await merge(api, namespace, {"metadata": {"finalizers": None}})
                await crd(api).delete_namespaced_custom_object(G, V, namespace, FD, "canary")

            await side_by_side("seed-4-deleted", op, url, namespace, delete, 2 * CYCLE)


async def test_seed_4_a_namespace_dropped_from_the_watched_ones_with_its_role_removed(
    api, operator_kubeconfig, plane
):
    """#4, the second half: dynamic namespaces on, a namespace leaves
    `kubernetes.operator.watched.namespaces` and its Role goes (what a helm upgrade
    does). canaryd runs as the sidecar does: the operator's ServiceAccount, the
    operator's own config file."""
    names = [f"op-{os.getpid()}-{next(_names)}" for _ in range(2)]
    for name in names:
        plane.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
        real.grant(plane, name)
        await create(api, name)
    kept, dropped = names
    dynamic = {
        "kubernetes.operator.dynamic.namespaces.enabled": "true",
        "kubernetes.operator.dynamic.config.enabled": "true",
        "kubernetes.operator.dynamic.config.check.interval": "5 s",
    }
    with operator(operator_kubeconfig, ",".join(names), **dynamic) as op:
        await asyncio.to_thread(op.wait_ready)
        async with canaryd(
            operator_kubeconfig, "--operator-config", str(op.conf_dir), cycle=CYCLE
        ) as url:
            for name in names:
                await until(lambda n=name: _state(url, n, "healthy"), f"{name} healthy", 4 * CYCLE)

            async def unwatch() -> None:
                op.write_config(**{"kubernetes.operator.watched.namespaces": kept})
                real.revoke(plane, dropped)

            await side_by_side("seed-4-unwatched", op, url, dropped, unwatch, 3 * CYCLE)
            assert await _state(url, kept, "healthy")
    for name in names:
        plane.request("DELETE", f"/api/v1/namespaces/{name}")


# --------------------------------------------------------- the operator wedged


@contextlib.asynccontextmanager
async def wedge_world(
    plane: Any, operator_kubeconfig: Path, namespace: str, mode: str, tmp: Path, proxied: bool
) -> AsyncIterator[tuple[real.RealOperator, str, real.Kubelet, Any]]:
    """The sidecar topology on the real control plane: the operator (through the fault
    proxy when ``proxied``), canaryd beside it as the sidecar runs it (the operator's
    ServiceAccount, straight to the API server), and a kubelet running the operator
    container's probes as the shipped sidecar component leaves them."""
    from tests.controlplane.faultproxy import fault_proxy

    with contextlib.ExitStack() as stack:
        proxy = stack.enter_context(fault_proxy(plane.url)) if proxied else None
        kubeconfig = (
            proxy.kubeconfig(operator_kubeconfig, tmp / "operator-proxied.kubeconfig")
            if proxy is not None
            else operator_kubeconfig
        )
        op = stack.enter_context(operator(kubeconfig, namespace))
        args = ["--namespace", namespace, "--reconciled-by", mode]
        if mode == "operator-metrics":
            args += ["--operator-metrics-url", op.metrics_url]
        async with canaryd(operator_kubeconfig, *args, cycle=CYCLE) as url:
            liveness, startup = real.sidecar_probes()
            kubelet = real.Kubelet(
                op,
                url + liveness.path,
                liveness,
                startup,
                # A restarted operator opens fresh connections: the fault is left behind.
                on_restart=(proxy.heal if proxy is not None else lambda: None),
            )
            task = asyncio.create_task(kubelet.run())
            try:
                yield op, url, kubelet, proxy
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task


async def _reason(url: str, namespace: str) -> str:
    _, body = await health(url)
    return next((c["reason"] for c in body["canaries"] if c["namespace"] == namespace), "")


@pytest.mark.parametrize("wedge", ["half-open", "sigstop"])
async def test_a_wedged_operator_is_restarted_once_and_checked_afresh(
    api, operator_kubeconfig, namespace, plane, tmp_path, wedge
):
    """operator-metrics under the sidecar's probes: the operator's API connections go
    half-open (its informers stall, its metrics still answer) or its JVM is stopped.
    canaryd is unhealthy within two cycles, the kubelet restarts the operator (the
    fault left behind), the new instance is checked afresh and is healthy: exactly
    one restart."""
    await create(api, namespace)
    async with wedge_world(
        plane, operator_kubeconfig, namespace, "operator-metrics", tmp_path, wedge == "half-open"
    ) as (op, url, kubelet, proxy):
        await until(lambda: _state(url, namespace, "healthy"), "a first verdict", 12 * CYCLE)
        assert "the operator reconciled" in await _reason(url, namespace)
        t0 = time.monotonic()
        if proxy is not None:
            proxy.freeze()
        else:
            op.pause()
        await until(lambda: _state(url, namespace, "unhealthy"), "unhealthy", 3 * CYCLE)
        unhealthy_after = time.monotonic() - t0
        reason = await _reason(url, namespace)
        liveness, _ = real.sidecar_probes()
        budget = liveness.period * (liveness.failure_threshold + 1) + 5
        await until(lambda: _true(bool(kubelet.restarts)), "the kubelet's restart", budget)
        restarted_after = kubelet.restarts[0] - t0
        await until(
            lambda: _contains(url, namespace, "operator restarted at"),
            "the new instance to be seen",
            12 * CYCLE,
        )
        await until(lambda: _state(url, namespace, "healthy"), "healthy again", 12 * CYCLE)
        healthy_after = time.monotonic() - t0
        await asyncio.sleep(4 * CYCLE)  # and it stays so: no second restart
        record(
            test="wedge",
            wedge=wedge,
            mode="operator-metrics",
            unhealthy_after_s=round(unhealthy_after, 1),
            reason=reason,
            restarted_after_s=round(restarted_after, 1),
            healthy_after_s=round(healthy_after, 1),
            restarts=len(kubelet.restarts),
            operator_starts=op.starts,
        )
        # Two cycles (a bump just reconciled before the wedge, then one not), plus
        # canaryd's own reads: a verdict waits for the first read after its deadline
        # (twice), and a frozen endpoint for a connect to time out.
        reads = 2 * min(2.0, CYCLE / 10) + min(2.5, CYCLE / 8)
        assert unhealthy_after <= 2 * CYCLE + reads + 1, unhealthy_after
        assert len(kubelet.restarts) == 1, kubelet.events
        assert await _state(url, namespace, "healthy")


@pytest.mark.parametrize("wedge", ["half-open", "sigstop"])
async def test_the_watch_mode_cannot_see_a_wedged_operator(
    api, operator_kubeconfig, namespace, plane, tmp_path, wedge
):
    """The same wedges with `--reconciled-by watch`: the API server raises the
    generation on canaryd's own write and canaryd's own watch delivers it, so the
    verdict stays healthy and nothing restarts the wedged operator."""
    await create(api, namespace)
    async with wedge_world(
        plane, operator_kubeconfig, namespace, "watch", tmp_path, wedge == "half-open"
    ) as (op, url, kubelet, proxy):
        await until(lambda: _state(url, namespace, "healthy"), "a first verdict", 12 * CYCLE)
        t0 = time.monotonic()
        if proxy is not None:
            proxy.freeze()
        else:
            op.pause()
        ours = Probe(url + "/healthz")
        await asyncio.sleep(6 * CYCLE)
        await ours.stop()
        record(
            test="wedge",
            wedge=wedge,
            mode="watch",
            probe=ours.summary(t0),
            restarts=len(kubelet.restarts),
        )
        assert ours.summary(t0)["statuses"] == [200]
        assert not kubelet.restarts


async def _true(value: bool) -> bool:
    return value


async def _contains(url: str, namespace: str, text: str) -> bool:
    return text in await _reason(url, namespace)
