"""The watch path at the scale users run and under the faults they meet: every watch gets
a connection, a watch that ends at once is not reopened in a busy loop, a dropped
stream resumes at once, and canaryd's own reconnects never decide a verdict.

Every test runs the shipped defaults with a short cycle (tests/harness.py)."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from canaryd import metrics
from canaryd.registry import CanaryState
from canaryd.testing.apiserver import FakeKube, Fault
from tests.harness import CYCLE, counter, create_canary, running_daemon

NAMESPACES = 250


def open_watches(kube: FakeKube, plural: str | None = None) -> int:
    return sum(1 for w in kube.watchers if plural is None or w.rtype.plural == plural)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("proxy", [False, True], ids=["direct", "proxy-configured"])
async def test_every_watch_gets_a_connection_at_250_namespaces_and_2_kinds(
    kube, kubeconfig, monkeypatch, proxy
):
    """kube.py's shared pool had 64 connections: past 32 namespaces a watch waited for
    one forever and its scope went blind (and with a proxy configured, bumps starved)."""
    if proxy:
        # A proxy in the environment puts every request on aiohttp; NO_PROXY keeps the
        # traffic on 127.0.0.1 (no proxy runs here).
        monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    namespaces = [f"team-{n:03}" for n in range(NAMESPACES)]
    for namespace in namespaces:
        kube.create_namespace(namespace)
        create_canary(kube, "canary", namespace)
    for namespace in namespaces[:50]:
        create_canary(kube, "job", namespace, kind="flinksessionjobs")
    cycle = 4.0  # 300 canaries in one process with the fake: a cycle one core can carry
    async with running_daemon(
        kube, kubeconfig, timeout=cycle, namespaces=frozenset(namespaces)
    ) as run:
        await run.until(
            lambda: open_watches(kube) == 2 * NAMESPACES + 1,
            f"{2 * NAMESPACES + 1} open watches (2 kinds x {NAMESPACES} namespaces + namespaces)",
            within=60,
        )
        await run.until(lambda: run.daemon.watcher.ready, "/readyz to be ready", within=60)
        assert (await run.get("/readyz"))[0] == 200
        assert len(run.registry) == NAMESPACES + 50

        def all_healthy() -> bool:
            return run.registry.counts()["healthy"] == NAMESPACES + 50

        await run.until(all_healthy, "every canary to be judged healthy", within=4 * cycle)
        assert run.registry.counts()["unhealthy"] == 0
        assert run.registry.counts()["unknown"] == 0
        # A stream that ends is replaced, and its scope still gets a connection.
        kube.close_watches()
        await run.until(
            lambda: open_watches(kube) == 2 * NAMESPACES + 1, "every watch reopened", within=60
        )
        assert (await run.get("/healthz"))[0] == 200


async def test_readyz_names_a_scope_whose_watch_is_not_connected(kube, kubeconfig):
    kube.create_namespace("blind")
    create_canary(kube, namespace="blind")
    async with running_daemon(kube, kubeconfig, namespaces=frozenset({"blind"})) as run:
        await run.until(lambda: run.daemon.watcher.ready, "ready")
        assert (await run.get("/readyz"))[0] == 200
        refused = kube.inject(
            Fault(verb="watch", resource="flinkdeployments", namespace="blind", times=-1)
        )
        kube.abort_watches()
        await run.until(lambda: refused.hits >= 1, "the re-watch to be refused")
        status, body = await run.get("/readyz")
        assert status == 503
        assert "flinkdeployments@blind" in body
        kube.faults.remove(refused)
        await run.until(lambda: run.daemon.watcher.ready, "the watch to reconnect")
        assert (await run.get("/readyz"))[0] == 200


async def test_a_watch_that_ends_at_once_backs_off_instead_of_a_busy_loop(kube, kubeconfig):
    """client-go: a watch that lasted under a second with no event is a failure."""
    create_canary(kube)
    async with running_daemon(kube, kubeconfig, kinds=("flinkdeployments",)) as run:
        await run.until_state(CanaryState.HEALTHY)
        loop = asyncio.get_running_loop()
        empty = kube.inject(Fault(verb="watch", resource="flinkdeployments", empty_watch=True))
        empty.times = -1
        kube.close_watches()
        started = loop.time()
        await run.until(lambda: empty.hits >= 10, "ten watches that end at once", within=10)
        elapsed = loop.time() - started
        # The backoff sequence from the cycle's backoff_initial doubling to its cap, with
        # the jitter's lower bound: reopening at once would take a few milliseconds.
        settings = run.daemon.settings
        step, floor = settings.backoff_initial, 0.0
        for _ in range(9):
            floor += 0.8 * min(step, settings.backoff_max)
            step *= 2
        assert elapsed >= floor, f"10 empty watches in {elapsed:.3f}s: a busy loop"
        assert counter(metrics.WATCH_RESTARTS, "flinkdeployments", "short") >= 9
        kube.faults.remove(empty)
        await run.until_bumps(len(run.bumps()) + 2)
        assert run.tracked().state is CanaryState.HEALTHY


async def test_a_dropped_stream_resumes_at_once_at_the_default_cycle(kube, kubeconfig):
    """After an established stream drops, the watcher waited backoff_initial (0.8 s at
    the default cycle) before resuming; it must resume at once from its last
    resourceVersion, and only failures in a row back off."""
    async with running_daemon(kube, kubeconfig, timeout=60.0, kinds=("flinkdeployments",)) as run:
        await run.until(lambda: open_watches(kube, "flinkdeployments") == 1, "the watch")
        create_canary(kube)
        await run.until_tracked()  # the stream delivered: it is established
        watches = len(kube.requests_for("watch", "flinkdeployments"))
        loop = asyncio.get_running_loop()
        dropped_at = loop.time()
        kube.abort_watches()
        await run.until(
            lambda: len(kube.requests_for("watch", "flinkdeployments")) > watches, "the re-watch"
        )
        rewatch = kube.requests_for("watch", "flinkdeployments")[-1]
        assert rewatch.query["resourceVersion"] not in ("", "0")
        waited = rewatch.at - dropped_at
        assert waited < run.daemon.settings.backoff_initial / 2, f"resumed after {waited:.3f}s"


async def test_backoff_never_exceeds_a_quarter_of_the_cycle(kube, kubeconfig):
    create_canary(kube)
    async with running_daemon(kube, kubeconfig, kinds=("flinkdeployments",)) as run:
        await run.until_state(CanaryState.HEALTHY)
        refused = kube.inject(Fault(verb="watch", resource="flinkdeployments", times=-1))
        kube.abort_watches()
        await run.until(lambda: refused.hits >= 12, "a dozen refused watches", within=10)
        times = [r.at for r in kube.requests_for("watch", "flinkdeployments")][-12:]
        gaps = [b - a for a, b in itertools.pairwise(times)]
        # Scheduling slack on a loaded machine, on top of the cap's +20% jitter bound.
        assert max(gaps) <= CYCLE / 4 + 0.1, f"gaps {gaps}"
        kube.faults.remove(refused)
        await run.until_bumps(len(run.bumps()) + 2)
