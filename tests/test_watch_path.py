"""The watch path at the scale users run and under the faults they meet: every watch gets
a connection, a watch that ends at once is not reopened in a busy loop, a dropped
stream resumes at once, and canaryd's own reconnects never decide a verdict.

Every test runs the shipped defaults with a short cycle (tests/harness.py)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import resource
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest.mock import patch

import aiohttp
import pytest

from canaryd import metrics
from canaryd.kube import KubeError
from canaryd.registry import CanaryState
from canaryd.testing.apiserver import FLINK_DEPLOYMENTS, FakeKube, Fault
from canaryd.testing.process import canaryd_argv, free_port
from tests.harness import (
    CYCLE,
    LABEL,
    TEST_SETTINGS,
    black_hole,
    counter,
    create_canary,
    json_lines,
    read_until,
    running_daemon,
)

NAMESPACES = 250


def open_watches(kube: FakeKube, plural: str | None = None) -> int:
    return sum(1 for w in kube.watchers if plural is None or w.rtype.plural == plural)


@pytest.mark.slow
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


async def test_a_black_holed_address_is_a_connect_timeout_that_backs_off():
    """aiohttp's ConnectionTimeoutError subclasses ServerTimeoutError: a black-holed
    address was told as "no event for 180 s", and since the connect time counted as an
    established stream, every reconnect retried at once, forever, with no episode."""
    from kubernetes_asyncio import client as k8s_client

    from canaryd.credentials import Credentials
    from canaryd.kube import KINDS, KubeClient
    from canaryd.listwatch import ListWatch, Scope, Sync

    settings = TEST_SETTINGS
    with black_hole() as url:
        configuration = k8s_client.Configuration()
        configuration.host = url
        kube = KubeClient(Credentials(configuration), settings)
        try:
            with pytest.raises(KubeError) as raised:
                async for _ in kube.watch("/apis/x", {}, idle_timeout=180.0):
                    pass
            assert raised.value.reason == "ConnectTimeout", raised.value
            with pytest.raises(KubeError) as raised:
                await kube.request("list", "GET", "/apis/x", time_limit=settings.list_timeout)
            assert "ConnectTimeout" in str(raised.value), raised.value
            scope = Scope(KINDS["flinkdeployments"], "default")
            lw = ListWatch(kube, settings, scope)
            idle = counter(metrics.WATCH_RESTARTS, "flinkdeployments", "idle")
            errors = counter(metrics.WATCH_RESTARTS, "flinkdeployments", "error")
            changes: list[object] = []
            third = asyncio.Event()

            def told(change: object) -> None:
                changes.append(change)
                if len(changes) == 3:
                    third.set()

            loop = asyncio.get_running_loop()
            started = loop.time()
            with patch.object(ListWatch, "_list", autospec=True, return_value="5"):
                task = asyncio.create_task(lw.run(told))
                await third.wait()
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            # Three connect timeouts, each followed by a backoff sleep: not at once.
            assert loop.time() - started >= 3 * settings.connect_timeout
            assert lw.failures.cause(scope) == "watch_error"
            assert counter(metrics.WATCH_RESTARTS, "flinkdeployments", "idle") == idle
            assert counter(metrics.WATCH_RESTARTS, "flinkdeployments", "error") == errors + 3
            assert changes == [Sync.DROPPED] * 3, changes  # never opened, each dropped
        finally:
            await kube.close()


def _nofile(soft: int, hard: int) -> Callable[[], None]:
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    return apply


async def _start_canaryd(
    kubeconfig: Path, namespaces: list[str], soft: int, hard: int, cycle: float = 2.0
) -> tuple[asyncio.subprocess.Process, int]:
    port = free_port()
    argv = canaryd_argv(kubeconfig, port, cycle, "--namespace", ",".join(namespaces))
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        preexec_fn=_nofile(soft, hard),
    )
    return proc, port


async def _until_readyz(
    port: int, wanted: Callable[[int, str], bool], attempts: int = 100
) -> tuple[int, str]:
    """/readyz until it answers as wanted: a bounded poll (the last answer otherwise)."""
    status, body = 0, ""
    async with aiohttp.ClientSession() as http:
        for _ in range(attempts):
            try:
                async with http.get(f"http://127.0.0.1:{port}/readyz") as response:
                    status, body = response.status, await response.text()
            except aiohttp.ClientConnectionError:
                status, body = 0, "no answer"
            if wanted(status, body):
                break
            await asyncio.sleep(0.1)  # a poll's pace; the answer decides, not the time
    return status, body


async def _poll_health(
    port: int, answers: list[tuple[float, int, str]], stop: asyncio.Event
) -> None:
    """(seconds taken, status, body) of /healthz?verbose, asked back to back from the
    first answer on (a probe's pace at most: 0.1 s between asks)."""
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as http:
        while not stop.is_set():
            asked = loop.time()
            try:
                async with http.get(f"http://127.0.0.1:{port}/healthz?verbose") as response:
                    answers.append((loop.time() - asked, response.status, await response.text()))
            except aiohttp.ClientConnectionError:
                if answers:
                    answers.append((loop.time() - asked, 0, "connection failed"))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.1):
                    await stop.wait()


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "hard", [pytest.param(None, marks=pytest.mark.slow), 1024], ids=["hard-unchanged", "hard-1024"]
)
async def test_600_namespaces_at_a_soft_open_files_limit_of_1024(kube, kubeconfig, hard):
    """A systemd service's (and many runtimes') soft limit is 1024: canaryd raises it to
    the hard limit at start, so 600 namespaces x 2 kinds all get their watches; where
    the hard limit is 1024 too, /readyz and the log say so instead of going blind."""
    own_soft, own_hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if own_hard != resource.RLIM_INFINITY and own_hard < 4096:
        pytest.skip(f"this test's own server needs ~1300 sockets; hard limit {own_hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(own_soft, 4096), own_hard))
    hard = own_hard if hard is None else hard
    namespaces = [f"team-{n:03}" for n in range(600)]
    for namespace in namespaces:
        kube.create_namespace(namespace)
    create_canary(kube, "canary", namespaces[-1])
    proc, port = await _start_canaryd(kubeconfig, namespaces, 1024, hard, cycle=1.0)
    seen: list[str] = []
    answers: list[tuple[float, int, str]] = []
    stop = asyncio.Event()
    poller = asyncio.create_task(_poll_health(port, answers, stop))
    try:
        if hard > 1024:
            await kube.wait_for(
                lambda: open_watches(kube) >= 2 * 600 + 1, within=120, what="1,201 watches"
            )
            status, body = await _until_readyz(port, lambda status, body: status == 200)
            assert status == 200, body
            # Starting 1,201 watches starves neither the health server nor the verdict:
            # /healthz answered throughout, and the canary (bumped meanwhile) is never
            # judged unhealthy for canaryd's own slowness.
            bumps = len(kube.requests_for("patch"))
            await kube.wait_for(
                lambda: len(kube.requests_for("patch")) >= bumps + 3, within=30, what="3 bumps"
            )
            stop.set()
            await poller
            assert answers, "/healthz never answered"
            assert not [a for a in answers if a[1] != 200 or "unhealthy" in a[2]], answers
            slowest = max(took for took, _, _ in answers)
            print(f"/healthz during the start of 1,201 watches: slowest answer {slowest:.2f}s")
            assert slowest < 5.0, f"/healthz took {slowest:.2f}s while the watches started"
        else:
            await read_until(proc, "open_files_limit_too_low", seen, within=60)
            status, body = await _until_readyz(port, lambda status, body: status == 503)
            assert status == 503 and "open files limit 1024 is below" in body, (status, body)
    finally:
        stop.set()
        await poller
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            _, rest = await proc.communicate()
    rest = "".join(seen).encode() + rest
    records = json_lines(rest.decode())
    (limit,) = [r for r in records if r.get("event") == "open_files_limit"]
    if hard > 1024:
        assert limit["soft"] == hard and limit["raised_from"] == 1024, limit
    else:
        assert limit["soft"] == 1024, limit
        assert any(r.get("event") == "open_files_limit_too_low" for r in records)


async def test_a_504_too_large_resource_version_relists_at_once(kube, kubeconfig):
    """One API server replica behind the resourceVersion canaryd resumes from answers
    504 "Too large resource version": client-go relists; retrying the same
    resourceVersion only waits for that replica."""
    create_canary(kube)
    async with running_daemon(kube, kubeconfig, kinds=("flinkdeployments",)) as run:
        await run.until_state(CanaryState.HEALTHY)
        lists = len(kube.requests_for("list", "flinkdeployments"))
        kube.inject(
            Fault(
                verb="watch",
                resource="flinkdeployments",
                code=504,
                message="Too large resource version: 100000, current: 12",
            )
        )
        kube.abort_watches()
        await run.until(
            lambda: len(kube.requests_for("list", "flinkdeployments")) > lists,
            "a relist after the 504",
        )
        watches = kube.requests_for("watch", "flinkdeployments")
        refused = next(i for i, r in enumerate(watches) if r.status == 504)
        relist = kube.requests_for("list", "flinkdeployments")[-1]
        # No second watch from the resourceVersion that was too large: a relist first.
        assert all(w.at > relist.at for w in watches[refused + 1 :])
        await run.until_state(CanaryState.HEALTHY)


@pytest.mark.timeout(120)
async def test_lists_come_in_pages_of_500_and_an_expired_continue_lists_whole(kube, kubeconfig):
    """client-go's pager: no answer grows with the canary count past 500 objects; a
    continue token whose snapshot was compacted (410) falls back to one whole list."""
    names = [f"c-{n:04}" for n in range(1_100)]
    for name in names:
        create_canary(kube, name)
    compacted: list[int] = []

    def compact_between_pages(req):  # the second page of the second list finds it gone
        pages = kube.requests_for("list", "flinkdeployments")  # logged on arrival
        if req.verb == "list" and len(pages) == 5 and not compacted:
            compacted.append(1)
            return Fault(code=0, action=kube.compact)
        return None

    # A 3 s cycle: 1,100 canaries bump about twice as often as 10,000 at the default
    # cycle. (At the harness's 0.3 s they asked this one process for 3,700 bumps a
    # second, more than it can answer; test_robustness proves that a relist never waits
    # for a connection behind bumps.)
    async with running_daemon(kube, kubeconfig, kinds=("flinkdeployments",), timeout=3.0) as run:
        await run.until(lambda: len(run.registry) == len(names), "every canary tracked", 60)
        first = kube.requests_for("list", "flinkdeployments")
        assert len(first) == 3  # 500 + 500 + 100
        assert [r.query.get("limit") for r in first] == ["500"] * 3
        assert "continue" not in first[0].query and first[1].query.get("continue")
        kube.hooks.append(compact_between_pages)
        # The resumed watch meets 410: a relist, paged again, and compacted between pages.
        kube.inject(Fault(verb="watch", resource="flinkdeployments", code=410))
        kube.abort_watches()
        await run.until(lambda: any(r.status == 410 for r in kube.requests_for("list")), "410", 60)
        await run.until(
            lambda: (
                kube.requests_for("list", "flinkdeployments")[-1].status == 200
                and "limit" not in kube.requests_for("list", "flinkdeployments")[-1].query
            ),
            "a whole list after the expired continue",
            60,
        )
        kube.hooks.remove(compact_between_pages)
        assert len(run.registry) == len(names)


async def test_a_mass_label_removal_reads_back_at_most_eight_canaries_at_once(kube, kubeconfig):
    """Each canary whose label is removed is read back once to tell a deletion from a
    label removal; 40 at once (slow reads) hold at most DROP_READS_AT_ONCE connections,
    so the request pool keeps room for lists and the lease."""
    from canaryd.watcher import DROP_READS_AT_ONCE

    names = [f"c-{n:02}" for n in range(40)]
    for name in names:
        create_canary(kube, name)

    def slow_reads(req: Any) -> Fault | None:
        return Fault(latency=0.05, code=0) if req.verb == "get" else None

    async with running_daemon(kube, kubeconfig) as run:
        await run.until(lambda: len(run.registry) == 40, "every canary tracked")
        kube.hooks.append(slow_reads)
        for name in names:
            kube.update(FLINK_DEPLOYMENTS, "default", name, without_label)
        await run.until(
            lambda: (
                sum(r.ended_at is not None for r in kube.requests_for("get", "flinkdeployments"))
                == 40
            ),
            "every dropped canary read back",
            10,
        )
        kube.hooks.remove(slow_reads)
        reads = kube.requests_for("get", "flinkdeployments")
        edges = sorted([(r.at, 1) for r in reads] + [(r.ended_at or 0.0, -1) for r in reads])
        at_once = max(itertools.accumulate(step for _, step in edges))
        assert 1 < at_once <= DROP_READS_AT_ONCE, at_once
        assert len(run.registry) == 0


def without_label(obj: dict[str, Any]) -> dict[str, Any]:
    obj["metadata"]["labels"].pop(LABEL)
    return obj


async def test_an_open_files_limit_too_low_is_said_but_does_not_withhold_ready(
    kube, kubeconfig, monkeypatch
):
    """/readyz names the shortfall; the watcher's own readiness (systemd's READY=1 under
    Type=notify) stays the scopes': a unit must not be killed at start for it."""
    from canaryd.limits import OpenFiles

    create_canary(kube)
    async with running_daemon(kube, kubeconfig) as run:
        watcher = run.daemon.watcher
        await run.until(lambda: watcher.ready, "the watches to be ready")
        monkeypatch.setattr(watcher, "open_files", OpenFiles(soft=100, hard=100))
        watcher._check_open_files()
        status, text = await run.get("/readyz")
        assert status == 503 and "open files limit 100 is below" in text, (status, text)
        assert watcher.ready and run.daemon._ready()
