"""A daemon that cannot be crashed, and the small things a review found: every failure at
the Kubernetes boundary is a KubeError, long-lived tasks survive their own bugs, the
health server outlives them, and odd answers are handled on purpose."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio.config import ConfigException
from structlog.testing import capture_logs

from canaryd import judge, metrics
from canaryd import kube as kube_module
from canaryd import writer as writer_module
from canaryd.access import Permission, reviews
from canaryd.config import ConfigError, Settings, load_settings, read_operator_config
from canaryd.credentials import Credentials
from canaryd.daemon import Daemon
from canaryd.kube import KINDS, ErrorKind, KubeClient, KubeError
from canaryd.registry import INT64_MAX, Canary, CanaryKey, CanaryState, Registry, read_nonce
from canaryd.scheduler import Scheduler
from canaryd.sync import ScopeSync
from canaryd.testing.apiserver import Fault
from tests.harness import (
    CYCLE,
    LABEL,
    HalfOpenProxy,
    counter,
    create_canary,
    following,
    running_daemon,
    write_dynamic_config,
)

# ------------------------------------------------------ the Kubernetes boundary


async def test_a_token_refresh_error_is_a_kube_error_and_the_daemon_lives_on(
    kube, kubeconfig, monkeypatch
):
    """kubernetes-asyncio's in-cluster refresh hook raises ConfigException ("Token file
    exists but empty") or FileNotFoundError while the kubelet rotates the token; it
    escaped discovery, ended the watcher and the TaskGroup, and /healthz with them."""
    create_canary(kube)
    original = k8s_client.Configuration.auth_settings
    failures = {"left": 4}

    async def flaky(self):  # type: ignore[no-untyped-def]
        if failures["left"] > 0:
            failures["left"] -= 1
            raise (ConfigException if failures["left"] % 2 else FileNotFoundError)(
                "Token file exists but empty."
            )
        return await original(self)

    monkeypatch.setattr(k8s_client.Configuration, "auth_settings", flaky)
    before = counter(metrics.ERRORS, "credentials")
    async with running_daemon(kube, kubeconfig) as run:
        await run.until_state(CanaryState.HEALTHY)
        assert failures["left"] == 0
        assert counter(metrics.ERRORS, "credentials") >= before + 4
        failures["left"] = 3  # and once more while it runs: bumps and watches meet it
        await run.until(lambda: failures["left"] == 0, "the refresh to fail again")
        await run.until_bumps(len(run.bumps()) + 2)
        assert (await run.get("/healthz"))[0] == 200


async def test_any_exception_from_a_request_is_a_kube_error(kube, kubeconfig, monkeypatch):
    configuration = k8s_client.Configuration()
    configuration.host = kube.url
    kube_client = KubeClient(Credentials(configuration), Settings(timeout=2.0))

    def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("a bug below the client")

    monkeypatch.setattr(aiohttp.ClientSession, "request", broken)
    try:
        with pytest.raises(KubeError) as caught:
            await kube_client.request("get", "GET", "/version")
        assert caught.value.kind is ErrorKind.TRANSIENT
        assert "RuntimeError" in str(caught.value)
    finally:
        await kube_client.close()


def test_object_names_are_percent_encoded_in_paths():
    path = KINDS["flinkdeployments"].object_path("team a", "odd/name?x=1#y")
    assert path == (
        "/apis/flink.apache.org/v1beta1/namespaces/team%20a/flinkdeployments/odd%2Fname%3Fx%3D1%23y"
    )


# ------------------------------------------------------ long-lived tasks


async def test_a_task_that_fails_is_restarted_and_the_health_server_outlives_it(
    kube, kubeconfig, monkeypatch
):
    create_canary(kube)
    original = Scheduler.run
    calls = {"n": 0}

    async def failing_once(self):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("a bug in the scheduler")
        await original(self)

    monkeypatch.setattr(Scheduler, "run", failing_once)
    before = counter(metrics.ERRORS, "task_scheduler")
    async with running_daemon(kube, kubeconfig) as run:
        assert (await run.get("/healthz"))[0] == 200
        await run.until_state(CanaryState.HEALTHY)
        assert calls["n"] == 2
        assert counter(metrics.ERRORS, "task_scheduler") == before + 1
        assert run.daemon.stuck() is None


async def test_a_task_that_ran_well_for_a_while_restarts_at_the_first_backoff_step():
    """The restart backoff grows while a task fails at once, and starts over once it ran
    for the longest backoff step: a bug met again hours later is not 30 s without it."""
    settings = replace(Settings(), timeout=CYCLE)
    daemon = Daemon(settings)
    calls, done = 0, asyncio.Event()

    async def run() -> None:
        nonlocal calls
        calls += 1
        if calls == 6:  # a while running well, then the same bug
            await asyncio.sleep(1.5 * settings.backoff_max)  # the scenario, not a wait
        if calls == 7:
            done.set()
            await asyncio.Event().wait()
        raise RuntimeError("a bug")

    with capture_logs() as records:
        supervised = asyncio.create_task(daemon._supervise("t", run))
        async with asyncio.timeout(10):
            await done.wait()
        supervised.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await supervised
    delays = [r["restart_in"] for r in records if r["event"] == "task_restarting"]
    assert len(delays) == 6, delays
    assert delays[4] > 2 * settings.backoff_initial, delays  # grown while failing at once
    assert delays[5] <= 1.2 * settings.backoff_initial + 0.001, delays  # started over


# ------------------------------------------------------ the operator config


def test_a_non_utf8_operator_config_is_one_clear_config_error(tmp_path: Path):
    path = tmp_path / "flink-conf.yaml"
    path.write_bytes(b"kubernetes.operator.watched.namespaces: caf\xe9\n")
    with pytest.raises(ConfigError) as caught:
        load_settings(["--operator-config", str(path)], {})
    message = str(caught.value)
    assert "\n" not in message
    assert str(path) in message and "UTF-8" in message


def test_an_operator_config_directory_that_cannot_be_searched_is_a_config_error(
    tmp_path: Path, monkeypatch
):
    def denied(self):  # type: ignore[no-untyped-def]
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "is_dir", denied)
    with pytest.raises(ConfigError, match="Permission denied"):
        read_operator_config(tmp_path)


async def test_an_unreadable_operator_config_at_runtime_keeps_the_settings(
    kube, kubeconfig, tmp_path: Path, capsys
):
    kube.create_namespace("team")
    create_canary(kube, namespace="team")
    path = tmp_path / "flink-conf.yaml"
    write_dynamic_config(path, "team")
    async with running_daemon(kube, kubeconfig, **following(path, "team")) as run:
        await run.until_state(CanaryState.HEALTHY, namespace="team")
        failed = counter(metrics.CONFIG_RELOADS, "failed")
        path.write_bytes(b"kubernetes.operator.watched.namespaces: t\xffam\n")
        for attempt in range(1, 4):
            run.daemon.reload()  # SIGHUP
            await run.until(
                lambda n=attempt: counter(metrics.CONFIG_RELOADS, "failed") >= failed + n,
                "the failed re-read",
            )
        assert run.daemon.watcher.namespaces == frozenset({"team"})
        await run.until_bumps(len(run.bumps()) + 2)
        assert run.tracked(namespace="team").state is CanaryState.HEALTHY
    logged = [line for line in capsys.readouterr().err.splitlines() if "reload_failed" in line]
    assert len(logged) == 1, logged  # said once, counted every time


# ------------------------------------------------------ the small things


async def test_retry_after_0_is_not_a_tight_retry_loop(kube, kubeconfig):
    create_canary(kube)
    async with running_daemon(kube, kubeconfig) as run:
        await run.until_state(CanaryState.HEALTHY)
        throttled = kube.inject(Fault(verb="patch", code=429, retry_after=0, times=-1))
        await run.until_state(CanaryState.UNKNOWN)
        first = kube.requests_for("patch")[-1].at
        await run.until(lambda: throttled.hits >= 30, "throttled retries", within=20 * CYCLE)
        cycles = (kube.requests_for("patch")[-1].at - first) / CYCLE
        settings = run.daemon.settings
        per_cycle = (settings.timeout / 2) / settings.backoff_initial + 1
        assert throttled.hits <= (cycles + 2) * per_cycle, (throttled.hits, cycles)
        kube.faults.remove(throttled)
        await run.until_state(CanaryState.HEALTHY)


async def test_a_reason_with_newlines_stays_one_line_in_verbose(kube, kubeconfig):
    create_canary(kube, "a")
    create_canary(kube, "b")
    async with running_daemon(kube, kubeconfig) as run:
        await run.until_state(CanaryState.HEALTHY, "a")
        await run.until_state(CanaryState.HEALTHY, "b")
        kube.inject(Fault(verb="patch", name="a", code=500, times=-1, message="first\nsecond"))
        canary = await run.until_state(CanaryState.UNKNOWN, "a")
        assert "\n" not in canary.reason and "first second" in canary.reason
        status, text = await run.get("/healthz?verbose")
        assert status == 200
        assert len(text.strip().splitlines()) == 3  # OK + one line per canary


def canary_copy(generation: int = 2, rv: str = "5") -> dict[str, Any]:
    """A copy of canary ns/c (uid "uid") as a list or watch would carry it."""
    return {
        "metadata": {
            "name": "c",
            "namespace": "ns",
            "uid": "uid",
            "resourceVersion": rv,
            "generation": generation,
            "labels": {LABEL: "true"},
        }
    }


def _canary(generation: int = 2) -> Canary:
    return Canary(CanaryKey("flinkdeployments", "ns", "c"), "uid", "5", generation, 1)


def test_a_bump_answered_without_a_generation_rise_is_no_bump_to_judge():
    registry = Registry(LABEL)
    canary = _canary()
    registry.observe("flinkdeployments", canary_copy())
    canary = registry.get(canary.key)
    assert canary is not None
    scheduler = Scheduler(Settings(timeout=CYCLE), registry, kube=UNSENT, clock=lambda: 100.0)  # type: ignore[arg-type]
    answer = {"metadata": {"resourceVersion": "6", "generation": 2}, "spec": {"restartNonce": 2}}
    attempt = scheduler.writer._next_attempt(canary)
    outcome = scheduler.writer._written(canary, answer, attempt)
    assert outcome == writer_module.NotWritten(
        "no_change", "the bump was answered with generation 2, not above 2"
    )
    next_due = scheduler._bumped(canary, 100.0, outcome)
    assert canary.bumped_generation is None  # nothing to judge
    assert canary.state is CanaryState.UNKNOWN
    assert "not above 2" in canary.reason
    assert next_due == 100.0 + CYCLE


def test_int64_nonce_messages():
    assert read_nonce({"spec": {"restartNonce": INT64_MAX}})[1] == (
        f"spec.restartNonce {INT64_MAX} is the largest 64-bit integer; it cannot grow"
    )
    assert "does not fit" in str(read_nonce({"spec": {"restartNonce": INT64_MAX + 1}})[1])
    assert read_nonce({"spec": {"restartNonce": INT64_MAX - 1}}) == (INT64_MAX - 1, None)


def test_an_older_copy_never_moves_generation_backwards():
    registry = Registry(LABEL)

    registry.observe("flinkdeployments", canary_copy(3, "30"))
    registry.observe("flinkdeployments", canary_copy(2, "20"))  # replayed, older
    canary = registry.get(CanaryKey("flinkdeployments", "ns", "c"))
    assert canary is not None and canary.generation == 3 and canary.resource_version == "30"
    registry.observe("flinkdeployments", canary_copy(4, "40"))
    assert canary.generation == 4


class _Unsent:
    """No API server: these tests send nothing."""

    answered_since = math.inf


UNSENT = _Unsent()


def _one_canary(
    copy: dict[str, Any], clock: Callable[[], float]
) -> tuple[Registry, Scheduler, Canary]:
    """A registry tracking one canary (``copy``) and a scheduler on it with its own
    clock and no API server: the judge and the transitions, driven by hand."""
    registry = Registry(LABEL)
    scheduler = Scheduler(Settings(timeout=CYCLE), registry, kube=UNSENT, clock=clock)  # type: ignore[arg-type]
    registry.observe("flinkdeployments", copy)
    scheduler.take_news()  # as its loop does: the canary is scheduled
    canary = registry.get(CanaryKey("flinkdeployments", "ns", "c"))
    assert canary is not None
    return registry, scheduler, canary


def test_a_judge_that_runs_late_rechecks_before_an_unhealthy_verdict():
    """canaryd's own stall (GC, CPU starvation) delays the judge while the bump's event
    sits unread in a socket: the late judge must not decide alone."""
    now = [100.0]
    copy = canary_copy()
    registry, scheduler, canary = _one_canary(copy, lambda: now[0])
    registry.bumped(canary, 3, 100.0, 100.0, 100.0 + CYCLE, 0.0)
    now[0] = 100.0 + 3 * CYCLE  # the loop stalled for two cycles past the deadline
    scheduler._on_due(100.0 + CYCLE, canary)
    assert canary.state is CanaryState.PENDING  # not judged on a stale view
    registry.observe(
        "flinkdeployments", {**copy, "metadata": {**copy["metadata"], "generation": 3}}
    )
    now[0] += scheduler.settings.judge_slack
    place = scheduler._places[canary.key]
    assert (place.what, place.due, place.canary) == ("due", now[0], canary)
    due = place.due
    scheduler._on_due(due, canary)
    assert canary.state is CanaryState.HEALTHY


def test_a_late_judge_still_finds_a_bump_that_never_arrived():
    now = [100.0]
    registry, scheduler, canary = _one_canary(canary_copy(), lambda: now[0])
    registry.bumped(canary, 3, 100.0, 100.0, 100.0 + CYCLE, 0.0)
    now[0] = 100.0 + 3 * CYCLE
    scheduler._on_due(100.0 + CYCLE, canary)
    now[0] += scheduler.settings.judge_slack
    scheduler._on_due(now[0], canary)
    assert canary.state is CanaryState.UNHEALTHY


async def test_kubeconfig_a_colon_b_is_merged_as_kubectl_merges_it(kube, tmp_path):
    """KUBECONFIG=a:b: clusters, users and contexts from every file (the first to name
    one wins), missing files skipped, and the current context of the first file that
    sets one, as kubectl does (kubernetes-asyncio's merge takes the last file's). Here
    the cluster and user are in a, the context in b, and a later file's current context
    points at a server nobody listens on."""
    import yaml

    full = kube.kubeconfig()
    a = tmp_path / "a.yaml"
    a.write_text(yaml.safe_dump({"clusters": full["clusters"], "users": full["users"]}))
    b = tmp_path / "b.yaml"
    b.write_text(
        yaml.safe_dump({"contexts": full["contexts"], "current-context": full["current-context"]})
    )
    elsewhere = tmp_path / "c.yaml"
    elsewhere.write_text(
        yaml.safe_dump(
            {
                "clusters": [{"name": "away", "cluster": {"server": "http://127.0.0.1:9"}}],
                "users": [{"name": "away", "user": {}}],
                "contexts": [{"name": "away", "context": {"cluster": "away", "user": "away"}}],
                "current-context": "away",
            }
        )
    )
    create_canary(kube)
    merged = ":".join(map(str, (a, tmp_path / "missing.yaml", b, elsewhere)))
    async with running_daemon(kube, Path(merged)) as run:
        await run.until_state(CanaryState.HEALTHY)
    with pytest.raises(ConfigError, match=r"no kubeconfig at .*nowhere\.yaml or .*gone\.yaml"):
        async with running_daemon(kube, Path(f"{tmp_path}/nowhere.yaml:{tmp_path}/gone.yaml")):
            pass


async def _until(condition: Any, what: str, turns: int = 1000) -> None:
    """Let the loop run until ``condition()`` holds (bounded, by loop turns: no timers)."""
    for _ in range(turns):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{what}: not within {turns} loop turns")


async def test_the_scheduler_takes_the_deadlines_of_a_tick_together(monkeypatch):
    """One wake of the loop per tick, not per canary: a deadline closer than a tick is
    waited for a whole tick, after which every deadline due by then is taken without
    waiting again. The tick is an eighth of the judge's slack, at most 25 ms."""
    assert Settings(timeout=60.0).scheduler_tick == 0.025
    assert Settings(timeout=5.0).scheduler_tick == 0.025
    assert Settings(timeout=1.0).scheduler_tick == pytest.approx(0.0125)
    assert Settings(timeout=0.2).scheduler_tick == pytest.approx(0.0025)
    now = [100.0]
    registry = Registry(LABEL)
    scheduler = Scheduler(Settings(timeout=CYCLE), registry, kube=UNSENT, clock=lambda: now[0])  # type: ignore[arg-type]
    canaries = []
    for i in range(3):
        registry.observe(
            "flinkdeployments",
            {
                **canary_copy(),
                "metadata": {**canary_copy()["metadata"], "name": f"c{i}", "uid": f"u{i}"},
            },
        )
        scheduler.take_news()  # scheduled at its phase, then pushed by hand
        canary = registry.get(CanaryKey("flinkdeployments", "ns", f"c{i}"))
        assert canary is not None
        canaries.append(canary)
        scheduler.push(now[0] + 0.001 * (i + 1), canary)
    loop = asyncio.get_running_loop()
    delays: list[float] = []
    real_call_later = loop.call_later

    def call_later(delay: float, callback: Any, *args: Any) -> asyncio.TimerHandle:
        delays.append(delay)
        return real_call_later(0, callback, *args)  # the tick "passes" at once

    monkeypatch.setattr(loop, "call_later", call_later)
    taken = []
    waiting = asyncio.create_task(scheduler._next_due())
    await _until(lambda: bool(delays), "the scheduler waiting for its first deadline")
    assert delays == [scheduler.settings.scheduler_tick], "a deadline 1 ms away waits a tick"
    now[0] += scheduler.settings.scheduler_tick
    taken.append((await waiting)[1])
    taken.append((await scheduler._next_due())[1])
    taken.append((await scheduler._next_due())[1])
    assert taken == canaries and len(delays) == 1, "the tick's deadlines taken with no wait"


def test_an_unhealthy_verdict_ages_at_the_second_cycles_failed_write_whoever_ran_later():
    """Writes fall due a cycle apart from the deadline whose judge reached the verdict;
    the judge may have run later than the second cycle's write does (the scheduler's
    tick, a busy loop). The verdict still ages at that write, not a cycle later."""
    now = [100.0]
    registry, scheduler, canary = _one_canary(canary_copy(), lambda: now[0])
    late = scheduler.settings.scheduler_tick
    now[0] = 100.0 + late  # the judge of the deadline at 100.0 ran a tick late
    registry.judged(canary, CanaryState.UNHEALTHY, "not seen in time", "not_observed", now[0])
    now[0] = 100.0 + CYCLE  # the first cycle's write, on time, fails
    scheduler.role.no_bump(canary, "forbidden", "forbidden")
    assert canary.state is CanaryState.UNHEALTHY, "one cycle: the verdict stands"
    now[0] = 100.0 + 2 * CYCLE  # the second cycle's write, on time, fails
    scheduler.role.no_bump(canary, "forbidden", "forbidden")
    assert canary.state is CanaryState.UNKNOWN, canary.reason
    assert "no bump written since: forbidden" in canary.reason


@contextlib.asynccontextmanager
async def _raw_server(
    handle: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
    request_timeout: float,
    token: str | None = None,
) -> AsyncIterator[tuple[KubeClient, k8s_client.Configuration]]:
    """A KubeClient against a raw asyncio server that answers as ``handle`` does."""
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    configuration = k8s_client.Configuration()
    configuration.host = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    if token is not None:
        configuration.api_key = {"BearerToken": token}
    kube_client = KubeClient(Credentials(configuration), Settings(timeout=2 * request_timeout))
    try:
        yield kube_client, configuration
    finally:
        await kube_client.close()
        server.close()
        await server.wait_closed()


async def _watch_answering(stream: bytes, sizes: tuple[int, ...]) -> list[dict[str, Any]]:
    """The events KubeClient.watch yields from a raw server that sends ``stream`` as
    chunks of these sizes in turn, each written and sent on its own."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        at, turn = 0, 0
        while at < len(stream):
            part = stream[at : at + sizes[turn % len(sizes)]]
            at, turn = at + len(part), turn + 1
            writer.write(b"%x\r\n%s\r\n" % (len(part), part))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    async with _raw_server(handle, request_timeout=1.0) as (kube_client, _):
        return [e async for e in kube_client.watch("/w", {}, idle_timeout=5.0)]


async def test_watch_lines_are_split_however_the_stream_is_cut():
    """Several events in one read, one across many, a last one without its newline:
    each is yielded once and whole. Blank lines are skipped; a line that is not a JSON
    object is counted and skipped."""
    events = [
        {"type": "ADDED", "object": {"metadata": {"name": f"c{i}", "resourceVersion": str(i)}}}
        for i in range(40)
    ]
    events[7]["object"]["spec"] = {"restartNonce": INT64_MAX * 4}  # any size of integer
    lines = b"".join(json.dumps(e).encode() + b"\n" for e in events[:-1])
    first = lines.index(b"\n") + 1
    deep = b"[" * 5000 + b"]" * 5000  # nested past the decoder's depth
    last = json.dumps(events[-1]).encode()  # no newline after it
    stream = lines[:first] + b"\n\r\n" + lines[first:] + b"[1,2]\nnot json\n" + deep + b"\n" + last
    decode_errors = metrics.ERRORS.labels("watch_decode")
    before = decode_errors._value.get()
    assert await _watch_answering(stream, (1, 5, 300, 7, 2000, 211)) == events
    assert decode_errors._value.get() == before + 3


@pytest.mark.parametrize("rv", ["12345", 'a"b', "\\", "\u00e9\n\x00", "", "\U0001f600"])
def test_the_bump_body_quotes_any_resource_version(rv):
    """resourceVersion is opaque: whatever it holds, the merge patch is JSON that carries
    it unchanged, with the nonce and nothing else."""
    assert json.loads(writer_module.bump_body(rv, 2**63 - 2)) == {
        "metadata": {"resourceVersion": rv},
        "spec": {"restartNonce": 2**63 - 2},
    }


async def test_a_watch_line_past_the_limit_is_a_kube_error(monkeypatch):
    monkeypatch.setattr(kube_module, "MAX_WATCH_LINE", 10_000)
    ok = json.dumps({"type": "ADDED", "object": {"metadata": {"name": "a"}}}).encode()
    with pytest.raises(KubeError) as caught:
        await _watch_answering(ok + b"\n" + b"x" * 20_000 + b"\n" + ok + b"\n", (4096,))
    assert caught.value.kind is ErrorKind.TRANSIENT and caught.value.reason == "LineTooLong"


async def test_a_watch_cut_after_its_answer_is_one_request_counted_as_answered(monkeypatch):
    """canaryd_api_requests_total counts a request once: a watch answered 200 whose
    stream then breaks (cut mid-chunk, or a line past the limit) is not also an error."""

    def requests() -> tuple[float, float]:
        return counter(metrics.API_REQUESTS, "watch", "200"), counter(
            metrics.API_REQUESTS, "watch", "error"
        )

    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b'HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{"a"')
        await writer.drain()
        writer.close()  # mid-chunk, no last chunk

    before = requests()
    async with _raw_server(cut, request_timeout=1.0) as (kube_client, _):
        with pytest.raises(KubeError):
            _ = [e async for e in kube_client.watch("/w", {}, idle_timeout=5.0)]
    monkeypatch.setattr(kube_module, "MAX_WATCH_LINE", 10_000)
    with pytest.raises(KubeError):
        await _watch_answering(b"x" * 20_000 + b"\n", (4096,))
    after = requests()
    assert (after[0] - before[0], after[1] - before[1]) == (2, 0)


async def test_a_half_open_pool_costs_no_bump_per_idle_connection(kube, tmp_path):
    """Every connection to the API server goes silent at once, with no FIN or RST (a
    crashed replica behind a load balancer), while new ones work. The start-up burst
    (eight access reviews at once, the lists) left connections idle in the request pool;
    none of them is reused for a bump a cycle later, as none is at the default cycle
    (Settings.keepalive_timeout): a bump is not spent on each of them in turn."""
    namespaces = [f"team-{i}" for i in range(8)]
    for namespace in namespaces:
        kube.create_namespace(namespace)
    create_canary(kube, namespace=namespaces[0])
    async with HalfOpenProxy(kube.url).running() as proxy:
        config = kube.kubeconfig()
        config["clusters"][0]["cluster"]["server"] = proxy.url
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump(config))
        async with running_daemon(kube, kubeconfig, namespaces=frozenset(namespaces)) as run:
            await run.until_state(CanaryState.HEALTHY, namespace=namespaces[0])
            lost = counter(metrics.API_REQUESTS, "patch", "error")
            bumps = len(run.bumps())
            proxy.freeze()
            await run.until_bumps(bumps + 3, within=12 * CYCLE)
            timed_out = counter(metrics.API_REQUESTS, "patch", "error") - lost
            # At most the bump in flight at the freeze.
            assert timed_out <= 1, f"{timed_out:g} bumps timed out on frozen idle connections"
            canary = run.canary(namespace=namespaces[0])
            assert canary is not None and canary.state is not CanaryState.UNHEALTHY


async def test_lists_and_the_lease_get_a_connection_while_every_bump_hangs(kube, kubeconfig):
    """A brownout: as many bumps as may be in flight (the shipped default) all hang for
    their whole timeout, each holding a connection. A relist, an access review or a
    lease renewal still gets one at once; on a pool of exactly the bumps' size it
    waited for one until its connect timeout ("no connection within")."""
    from canaryd.kube import connect

    canary = create_canary(kube)
    settings = replace(Settings(), timeout=4.0, kubeconfig=str(kubeconfig))  # connect: 2 s
    client = await connect(settings)
    hung: list[Any] = []
    every_bump_hangs = asyncio.Event()

    def hang(req: Any) -> Fault | None:
        if req.verb != "patch":
            return None
        hung.append(req)
        if len(hung) == settings.max_bumps_in_flight:
            every_bump_hangs.set()
        return Fault(latency=3600, code=0)  # until the client gives up

    kube.hooks.append(hang)
    path = KINDS["flinkdeployments"].object_path("default", canary["metadata"]["name"])
    bumps = [
        asyncio.create_task(
            client.request(
                "patch", "PATCH", path, body={"spec": {"restartNonce": n}}, time_limit=3600
            )
        )
        for n in range(settings.max_bumps_in_flight)
    ]
    try:
        try:
            await asyncio.wait_for(every_bump_hangs.wait(), 30)
        except TimeoutError:
            raise AssertionError(f"only {len(hung)} bumps reached the API server in 30s") from None
        kind = KINDS["flinkdeployments"]
        listed = await client.request("list", "GET", kind.collection_path(None))
        assert [item["metadata"]["name"] for item in listed["items"]] == ["canary"]
        patch = Permission("patch", kind.plural, kind.group, "default")
        assert await reviews(client, [patch] * 8) == [True] * 8
    finally:
        for bump in bumps:
            bump.cancel()
        await asyncio.gather(*bumps, return_exceptions=True)
        await client.close()


async def test_the_deadline_covers_credentials_that_wait_and_answers_that_do_not_come():
    """One deadline for the whole request: an async refresh hook that never returns
    fails it as a credentials problem, a server that never answers as a timeout."""
    held = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await held.wait()  # never answers

    async with _raw_server(handle, 0.2, token="Bearer t") as (kube_client, configuration):
        try:

            async def stuck_hook(_: Any) -> None:
                await held.wait()

            configuration.refresh_api_key_hook = stuck_hook
            with pytest.raises(KubeError) as caught:
                await kube_client.request("get", "GET", "/version")
            assert caught.value.reason == "Credentials"

            def file_hook(_: Any) -> None:
                pass

            configuration.refresh_api_key_hook = file_hook
            with pytest.raises(KubeError) as caught:
                await kube_client.request("get", "GET", "/version")
            assert caught.value.kind is ErrorKind.TRANSIENT
            assert caught.value.reason != "Credentials" and "TimeoutError" in str(caught.value)
        finally:
            held.set()


async def test_an_answer_to_a_request_sent_before_an_outage_is_no_sign_of_the_server_after():
    """The soak's outage race (CI, stop 39): a bump's answer already in the socket when
    the API server went away is read after the watch's drop. Taken for an answer after
    the drop, it made every canary `unhealthy` a cycle later ("the watch has not
    resumed") instead of no verdict (the API server is away). What counts is when the
    answered request was sent."""
    entered, release = asyncio.Event(), asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        entered.set()
        await release.wait()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n")
        writer.write(b"Content-Length: 2\r\n\r\n{}")
        await writer.drain()
        writer.close()

    async with _raw_server(handle, request_timeout=10.0) as (kube_client, _):
        try:
            request = asyncio.create_task(kube_client.request("get", "GET", "/version"))
            async with asyncio.timeout(10):
                await entered.wait()
            dropped = time.monotonic()  # the watch drops here, the request is in flight
            release.set()
            assert await request == {}
            assert kube_client.answered_since < dropped, (
                "an answer to a request sent before the drop counted as one after it"
            )
            assert await kube_client.request("get", "GET", "/version") == {}
            assert kube_client.answered_since >= dropped  # one sent after it does
        finally:
            release.set()


async def test_an_api_server_that_answered_after_the_drop_then_stopped_is_away():
    """A watch that rotates (its stream ends at timeoutSeconds) is out of sync until
    the resumed stream delivers; the resumed watch is answered 200, then the API server
    goes away before the first event. Answered after the drop, yet nobody can reconcile
    through it now: a request sent after its last answer that gets none makes it away
    (no verdict), not a watch that has not resumed (unhealthy). Found by review."""
    away: str | None = None
    silent = asyncio.Event()  # set when the test ends: a silent server's handlers end

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        if away == "reset":  # no answer
            writer.transport.abort()
            return
        if away == "silent":  # accepted, never answered (a frozen server)
            await silent.wait()
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n")
        writer.write(b"Connection: close\r\nContent-Length: 2\r\n\r\n{}")
        await writer.drain()
        writer.close()

    canary = _canary()
    async with _raw_server(handle, request_timeout=5.0) as (kube_client, _):
        try:
            sync = ScopeSync(time.monotonic())  # out of sync from here (a rotation)
            assert await kube_client.request("get", "GET", "/version") == {}
            answered = kube_client.answered_since
            assert judge.api_server_away(canary, sync, answered, time.monotonic()) is None

            away = "reset"
            with pytest.raises(KubeError):
                await kube_client.request("get", "GET", "/version")
            now = time.monotonic()
            reason = judge.api_server_away(canary, sync, kube_client.answered_since, now)
            assert reason is not None and "not answering" in reason, reason
            for mode in ("reset", "silent"):  # a watch's too: reset, or accepted, silent
                away = None
                assert await kube_client.request("get", "GET", "/version") == {}
                assert kube_client.answered_since > answered  # answering again
                assert judge.api_server_away(canary, sync, kube_client.answered_since, now) is None
                away = mode
                with pytest.raises(KubeError):
                    async for _ in kube_client.watch("/w", {}, idle_timeout=0.2):
                        pass
                assert kube_client.answered_since == -math.inf, mode
        finally:
            silent.set()


def _status(code: int, reason: str) -> str:
    return json.dumps({"kind": "Status", "apiVersion": "v1", "reason": reason, "code": code})


JSON, TEXT = "Content-Type: application/json", "Content-Type: text/plain; charset=utf-8"


@pytest.mark.parametrize(
    ("answer", "serving"),
    [
        (f"200 OK\r\n{JSON}\r\n\r\n{{}}", True),
        (f"403 Forbidden\r\n{JSON}\r\n\r\n{_status(403, 'Forbidden')}", True),
        (f"410 Gone\r\n{JSON}\r\n\r\n{_status(410, 'Expired')}", True),
        # kube-apiserver's answer to a path it does not serve (a kind not installed), but
        # also a Go gateway's with nothing behind it (Traefik's default router)
        (f"404 Not Found\r\n{TEXT}\r\n\r\n404 page not found\n", False),
        (f"503 Service Unavailable\r\n{TEXT}\r\n\r\nno healthy upstream", False),
        (f"503 Service Unavailable\r\n{JSON}\r\n\r\n{_status(503, 'ServiceUnavailable')}", False),
        (f"429 Too Many Requests\r\n{JSON}\r\n\r\n{_status(429, 'TooManyRequests')}", False),
        ("404 Not Found\r\nContent-Type: text/html\r\n\r\n<html>404 Not Found</html>", False),
        (f'403 Forbidden\r\n{JSON}\r\n\r\n{{"message": "Forbidden"}}', False),
    ],
)
async def test_only_an_answer_that_shows_the_api_server_serving_counts_as_one(answer, serving):
    """docs/DESIGN.md, what counts as the API server answering: a 2xx, or a 4xx other
    than 429 that kube-apiserver sent as a Status; not a 5xx, a 429, or a gateway's own
    page (Go's 404 page not found included, though kube-apiserver's mux sends it too).
    The same for a request and a watch: an outage behind a load balancer that answers
    503 is no verdict, as refused connections are."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        head, _, body = answer.partition("\r\n\r\n")
        writer.write(f"HTTP/1.1 {head}\r\nConnection: close\r\n".encode())
        writer.write(f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        await writer.drain()
        writer.close()

    async with _raw_server(handle, request_timeout=5.0) as (kube_client, _):
        for exchange in ("request", "watch"):
            sent = time.monotonic()
            with contextlib.suppress(KubeError):
                if exchange == "request":
                    await kube_client.request("get", "GET", "/x")
                else:
                    async for _ in kube_client.watch("/w", {}, idle_timeout=5.0):
                        pass
            assert (kube_client.answered_since >= sent) is serving, (exchange, answer)


async def test_a_404_is_believed_only_as_a_status_or_once_the_api_server_confirms_it(kube):
    """Issue 44 (no discovery): a kind's list answered 404 means the kind is not served
    only as a kube-apiserver Status, or as Go's plain page once the API server's own
    lists confirm it (its /apis/GROUP/VERSION lacks the kind, has it cluster-scoped, or
    /apis lacks the group version). A gateway's page for every path confirms nothing:
    an outage, transient (canaries kept, no verdict)."""
    from canaryd.kube import kind_of
    from canaryd.listwatch import ListWatch, Scope, not_served

    kube.remove_crd("flinksessionjobs")
    configuration = k8s_client.Configuration()
    configuration.host = kube.url
    configuration.api_key = {"BearerToken": f"Bearer {kube.token}"}
    client = KubeClient(Credentials(configuration), Settings(timeout=4.0))
    try:
        assert await not_served(client, KINDS["flinkdeployments"]) is None
        missing = await not_served(client, KINDS["flinksessionjobs"])
        assert (
            missing == "flinksessionjobs.flink.apache.org is not served in flink.apache.org/v1beta1"
        )
        nowhere = await not_served(client, kind_of("things.nowhere.example/v1"))
        assert nowhere == "things.nowhere.example is not served: no nowhere.example/v1 in /apis"

        def confirmed(err: KubeError, scope: Scope) -> Awaitable[KubeError]:
            return ListWatch(client, Settings(timeout=CYCLE), scope)._confirmed(err)

        plain = KubeError(ErrorKind.GONE, "404 page not found", status=404)
        status = KubeError(ErrorKind.GONE, "not found", status=404, reason="NotFound")
        served, gone = (
            Scope(KINDS["flinkdeployments"], None),
            Scope(KINDS["flinksessionjobs"], None),
        )
        assert (await confirmed(plain, gone)).kind is ErrorKind.GONE
        assert (await confirmed(plain, served)).kind is ErrorKind.TRANSIENT
        assert (await confirmed(status, served)) is status  # a Status is believed
        # A gateway with nothing behind it answers its 404 page on every path, /apis too.
        kube.unavailable = Fault(code=404, page="404 page not found\n")
        assert await not_served(client, KINDS["flinksessionjobs"]) is None
        assert (await confirmed(plain, gone)).kind is ErrorKind.TRANSIENT
    finally:
        kube.unavailable = None
        await client.close()


async def test_a_malformed_discovery_answer_confirms_nothing():
    """The lists that confirm a 404 answering with the right kind but not a list where
    one belongs (a broken aggregated API server, a gateway's rewrite) confirm nothing;
    they raised TypeError, and the scope's watch started over as a bug each time."""
    from canaryd.kube import kind_of
    from canaryd.listwatch import not_served

    answers = {
        b"/apis/a.example/v1": (404, {"kind": "Status", "code": 404}),
        b"/apis": (200, {"kind": "APIGroupList", "groups": 5}),
        b"/apis/b.example/v1": (200, {"kind": "APIResourceList", "resources": {"x": 1}}),
        b"/apis/c.example/v1": (200, {"kind": "APIResourceList", "resources": None}),
    }

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while head := await reader.readuntil(b"\r\n\r\n"):
                await answer(head.split(b" ")[1].split(b"?")[0], writer)

    async def answer(path: bytes, writer: asyncio.StreamWriter) -> None:
        code, body = answers[path]
        data = json.dumps(body).encode()
        writer.write(
            b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (code, len(data), data)
        )
        await writer.drain()

    async with _raw_server(handle, request_timeout=2.0) as (client, _):
        assert await not_served(client, kind_of("things.a.example/v1")) is None
        assert await not_served(client, kind_of("things.b.example/v1")) is None
        # Go writes an empty list as null: a group version that serves nothing, said.
        empty = await not_served(client, kind_of("things.c.example/v1"))
        assert empty == "things.c.example is not served in c.example/v1"


async def test_a_gateways_403_page_drops_no_canary(kube, kubeconfig):
    """kube-apiserver refuses with a Status; a 403 that is a page (an auth proxy's, a
    WAF's) is no sign of RBAC: an outage, transient. The canary stays tracked and
    judged, and nothing says list_forbidden (before: dropped, its verdict lost)."""
    create_canary(kube)
    async with running_daemon(kube, kubeconfig) as run:
        await run.until_state(CanaryState.HEALTHY)
        page = kube.inject(
            Fault(verb="watch", resource="flinkdeployments", code=403, page="<html>403</html>")
        )
        kube.close_watches()
        watches = lambda: [  # noqa: E731
            r for r in kube.requests if r.verb == "watch" and r.resource == "flinkdeployments"
        ]
        before = len(watches())
        # The page, then a watch again (open: no status yet), within the backoff.
        await run.until(lambda: page.hits == 1 and len(watches()) >= before + 2, "a watch again")
        assert run.tracked() is not None and run.tracked().state is CanaryState.HEALTHY
        assert "list_forbidden" not in run.daemon.blind()


async def test_a_stream_replaced_while_a_404_is_confirmed_is_left_alone():
    """A watch answered Go's plain 404 is confirmed with the API server's own lists,
    which may take a while; the judge suspecting the stream meanwhile (replace) or a
    start-over must not touch the stream that already ended (before: RuntimeError from
    the finished timeout, and the whole watcher restarted)."""
    from canaryd.listwatch import ListWatch, Scope

    confirming = asyncio.Event()

    class SlowConfirmation:
        async def request(self, verb: str, method: str, path: str, **_: Any) -> Any:
            if verb == "list":
                return {"kind": "FlinkDeploymentList", "metadata": {"resourceVersion": "5"}}
            confirming.set()  # /apis/flink.apache.org/v1beta1, in a brownout
            await asyncio.Event().wait()

        async def watch(self, path: str, params: Any, **_: Any) -> AsyncIterator[Any]:
            raise KubeError(ErrorKind.GONE, "404 page not found", status=404)
            yield  # an async generator, as KubeClient.watch

    scope = Scope(KINDS["flinkdeployments"], None)
    lw = ListWatch(SlowConfirmation(), Settings(timeout=CYCLE), scope)  # type: ignore[arg-type]
    task = asyncio.create_task(lw.run(lambda change: None))
    try:
        async with asyncio.timeout(10):
            await confirming.wait()
        lw.replace("nothing delivered")
        lw.start_over()
        assert not task.done()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@contextlib.asynccontextmanager
async def _list_watch(
    kubeconfig: Path, raise_on: Callable[[object, list[object]], bool]
) -> AsyncIterator[tuple[KubeClient, asyncio.Task[None], asyncio.Event, str]]:
    """A ListWatch of flinkdeployments in default running, telling a list of changes
    that raises where ``raise_on(change, told)`` says (a bug in what it tells): its
    client, its task, an event set when it listed a second time, and its scope's name."""
    from canaryd.kube import connect
    from canaryd.listwatch import Listed, ListWatch, Scope

    settings = replace(Settings(timeout=CYCLE), kubeconfig=str(kubeconfig))
    client = await connect(settings)
    scope = Scope(KINDS["flinkdeployments"], "default")
    told: list[object] = []
    listed_again = asyncio.Event()

    def tell(change: object) -> None:
        told.append(change)
        if raise_on(change, told):
            raise RuntimeError("a bug in what the watcher does with it")
        if len([c for c in told if isinstance(c, Listed)]) == 2:
            listed_again.set()

    task = asyncio.create_task(ListWatch(client, settings, scope).run(tell))
    try:
        yield client, task, listed_again, str(scope)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await client.close()


async def test_a_bug_in_what_a_list_watch_tells_of_an_opened_stream_is_its_own(kube, kubeconfig):
    """A bug raised by what the ListWatch tells is its own catch-all's, whatever it told:
    said with the scope, counted, a new list. Told of a stream opened, it was raised
    inside the client's request (before: taken for a failed watch request, the API
    server for away, the stream resumed with no new list)."""
    from canaryd.listwatch import Sync

    def first_opened(change: object, told: list[object]) -> bool:
        return change is Sync.OPENED and told.count(Sync.OPENED) == 1

    bugs, requests = counter(metrics.ERRORS, "watch"), counter(metrics.ERRORS, "watch_request")
    async with _list_watch(kubeconfig, first_opened) as (client, _, listed_again, scope):
        with capture_logs() as records:
            async with asyncio.timeout(10):
                await listed_again.wait()
        said = [r for r in records if r["event"] == "watch_failed_unexpectedly"]
        assert [r.get("scope") for r in said] == [scope], said
        assert counter(metrics.ERRORS, "watch") == bugs + 1
        assert counter(metrics.ERRORS, "watch_request") == requests
        assert client.answered_since > -math.inf  # the API server answered all along


async def test_a_bug_in_what_a_list_watch_tells_of_a_drop_does_not_end_it(kube, kubeconfig):
    """A bug met each time a drop is told (the scope's sync model, say) is said and
    counted each time, and the ListWatch lives on and lists again (before: its catch-all
    told the drop again, the bug raised there ended its task, and with it every watch of
    the watcher's task group)."""
    from canaryd.listwatch import Sync

    kube.inject(Fault(verb="watch", resource="flinkdeployments", code=500))
    bugs = counter(metrics.ERRORS, "watch")

    def dropped(change: object, told: list[object]) -> bool:
        return change is Sync.DROPPED

    async with _list_watch(kubeconfig, dropped) as (_, task, listed_again, _):
        listed = asyncio.ensure_future(listed_again.wait())
        try:
            async with asyncio.timeout(10):
                await asyncio.wait({task, listed}, return_when=asyncio.FIRST_COMPLETED)
            assert not task.done(), task
            assert counter(metrics.ERRORS, "watch") >= bugs + 2  # each raise said and counted
        finally:
            listed.cancel()


async def test_a_list_answered_with_no_list_drops_no_canary(kube, kubeconfig):
    """A 200 whose body is no list (a gateway's ``{}``) says nothing is gone: the relist
    fails, transient, and is retried; the canary keeps its record and its verdict
    (before: an empty list, every canary of the scope dropped and tracked anew)."""
    create_canary(kube)
    async with running_daemon(kube, kubeconfig) as run:
        await run.until_state(CanaryState.HEALTHY)
        before = run.tracked()
        page = kube.inject(Fault(verb="list", resource="flinkdeployments", code=200, page="{}"))
        kube.inject(Fault(verb="watch", resource="flinkdeployments", code=410))
        kube.close_watches()  # a 410 on resuming: a relist
        await run.until(lambda: page.hits == 1, "the relist answered with no list")
        await run.until_bumps(len(run.bumps()) + 2)
        assert run.tracked() is before and before.state is CanaryState.HEALTHY


def test_scopes_resumed_together_take_one_pass_over_the_canaries():
    """Review: after an API server's restart every watch resumes at once, and a pass over
    the tracked canaries per resumed scope held the loop O(scopes x canaries) (0.8 s at
    1,000 scopes and 10,000 canaries). Each deferred canary of a resumed scope is judged
    a resume grace later; one of a scope not resumed keeps its place."""
    registry = Registry(LABEL)
    for namespace in ("a", "b", "c"):
        copy = canary_copy()
        copy["metadata"] |= {"namespace": namespace, "uid": namespace}
        registry.observe("flinkdeployments", copy)
    settings = Settings(timeout=CYCLE)
    scheduler = Scheduler(settings, registry, kube=UNSENT, clock=lambda: 100.0)  # type: ignore[arg-type]
    scheduler.take_news()  # each new canary placed
    keys = {ns: CanaryKey("flinkdeployments", ns, "c") for ns in ("a", "b", "c")}
    for key in keys.values():
        canary = registry.get(key)
        assert canary is not None
        canary.deferred_until = 100.0 + CYCLE  # its verdict waits for its scope
    before = scheduler._places[keys["c"]]
    passes: list[int] = []
    tracked = registry.tracked

    def counted() -> Any:
        passes.append(1)
        return tracked()

    registry.tracked = counted  # type: ignore[method-assign]
    for namespace in ("a", "b", "elsewhere"):
        registry.scope_resumed(("flinkdeployments", namespace))
    scheduler.take_news()
    assert len(passes) == 1, f"{len(passes)} passes over the canaries for one batch"
    at = 100.0 + settings.resume_grace
    assert [scheduler._places[keys[ns]].due for ns in ("a", "b")] == [at, at]
    assert scheduler._places[keys["c"]] is before
