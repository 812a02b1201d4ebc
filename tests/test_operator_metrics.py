"""--reconciled-by operator-metrics: a verdict that depends on the operator.

A bump counts as reconciled when the operator's own count of finished reconciles of
the canary rose after the bump was written. The operator here is the stand-in of
canaryd.testing.operator, which serves the format recorded from the real operator's
Prometheus reporter (tests/fixtures/operator-metrics.txt, pinned below); it runs
in-process beside canaryd and the fake API server, on the shipped defaults with a
0.3 s cycle.
"""

from __future__ import annotations

import asyncio
import contextlib
import tracemalloc
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from canaryd import metrics
from canaryd.config import ConfigError, load_settings
from canaryd.logs import wall_time
from canaryd.opmetrics import OperatorMetrics, Read, ScrapeFailed, parse
from canaryd.registry import CanaryState
from canaryd.testing.apiserver import FLINK_DEPLOYMENTS, FakeKube, Fault
from canaryd.testing.operator import FakeOperator
from canaryd.testing.process import free_port
from tests.harness import (
    CYCLE,
    OUTAGES,
    api_server_away,
    blind_everywhere,
    counter,
    create_canary,
    json_lines,
    json_logs,
    running_daemon,
)

FIXTURE = Path(__file__).parent / "fixtures" / "operator-metrics.txt"
CANARY = ("FlinkDeployment", "default", "canary")
SAMPLE = 'x_JOSDK_Reconciliation_finished_Count{resourcetype="A",resourcens="b",resourcename="c"}'


@contextlib.asynccontextmanager
async def operator_for(
    kube: FakeKube, port: int = 0, **options: object
) -> AsyncIterator[FakeOperator]:
    operator = FakeOperator(kube.url, kube.token, **options)  # type: ignore[arg-type]
    await operator.start(metrics_port=port)
    try:
        yield operator
    finally:
        await operator.stop()


def judged_by(operator: FakeOperator) -> dict[str, object]:
    return {"reconciled_by": "operator-metrics", "operator_metrics_url": operator.metrics_url}


# ------------------------------------------------------------ the format itself


def test_the_real_reporters_answer_is_read_as_recorded():
    """Recorded from release-1.15.0 (Flink 1.20.0's Prometheus reporter) on the real
    control plane: the names and labels canaryd relies on, pinned."""
    scrape = parse(FIXTURE.read_text())
    assert scrape.reconciled == {CANARY: 7.0}
    assert scrape.has_operator_series
    assert scrape.start_time is None  # Flink's reporter exports no process start time
    grows = sorted(key.split(b"{")[0] for key in scrape.process)
    assert grows == [b"_KubeClient_HttpRequest_Count", b"_Status_JVM_CPU_Time"]
    # A gauge named _Count goes up and down: never taken for a reset.
    assert not any(b"Threads_Count" in key for key in scrape.process)


def test_the_stand_in_operator_speaks_the_recorded_format():
    """What the fast tests run against has every series canaryd reads, as recorded."""
    operator = FakeOperator("http://127.0.0.1:1")
    operator._event(
        "ADDED",
        "flinkdeployments",
        {"metadata": {"name": "canary", "namespace": "default", "generation": 1}},
    )
    real, fake = parse(FIXTURE.read_text()), parse(operator.render())
    assert set(fake.reconciled) == set(real.reconciled)
    assert set(real.process) <= set(fake.process)
    real_labels = next(
        line
        for line in FIXTURE.read_text().splitlines()
        if line.startswith("flink_k8soperator_namespace_resource_JOSDK_Reconciliation_finished")
    )
    fake_labels = next(
        line
        for line in operator.render().splitlines()
        if line.startswith("flink_k8soperator_namespace_resource_JOSDK_Reconciliation_finished")
    )
    assert real_labels.split("{")[1].split("}")[0] == fake_labels.split("{")[1].split("}")[0]


@pytest.mark.parametrize(
    "line",
    [
        "",
        "# TYPE x gauge",
        "garbage",
        "x_JOSDK_Reconciliation_finished_Count",
        'x_JOSDK_Reconciliation_finished_Count{resourcetype="A"',
        f"{SAMPLE} NaN",
        f"{SAMPLE} x",
        "\x00\xff{}}}",
    ],
)
def test_malformed_lines_are_skipped_never_raised(line):
    scrape = parse(f"{line}\n" + FIXTURE.read_text())
    assert scrape.reconciled == {CANARY: 7.0}


def test_label_values_are_found_as_the_reporter_filters_them():
    text = (
        'a_JOSDK_Reconciliation_finished_Count{resourcename="my_canary",resourcetype="T",'
        'resourcens="team_a",} 3.0\n'
    )
    assert parse(text).count(("T", "team-a", "my.canary")) == 3.0
    assert parse(text).count(("T", "team-a", "other")) is None


def test_escaped_label_values_and_timestamps():
    text = (
        'a_JOSDK_Reconciliation_finished_Count{resourcename="we\\"ird",resourcetype="T",'
        'resourcens="n",} 3.0 1700000000000\n'
    )
    assert parse(text).reconciled == {("T", "n", 'we"ird'): 3.0}


def test_a_counter_that_went_down_or_an_endpoint_that_refused_is_a_new_operator():
    reader = OperatorMetrics("http://127.0.0.1:1/metrics", connect_timeout=1, read_timeout=1)
    text = FIXTURE.read_text()
    reader.last = parse(text)
    assert reader.restart_seen(parse(text)) is None
    for series, was, now in (
        ("KubeClient_HttpRequest_Count{", "} 38.0", "} 3.0"),
        ("Reconciliation_finished_Count{", "} 7.0", "} 1.0"),
    ):
        line = next(x for x in text.splitlines() if series in x and not x.startswith("#"))
        assert line.endswith(was.removeprefix("}")) or was in line
        lower = text.replace(line, line.replace(was, now))
        assert reader.restart_seen(parse(lower)) is not None, series
    reader._refused_since_answer = True
    assert reader.restart_seen(parse(text)) is not None


# ------------------------------------------------------------- configuration


def test_the_url_follows_the_operator_configs_prometheus_reporter(tmp_path):
    conf = tmp_path / "config.yaml"
    conf.write_text(
        "kubernetes.operator:\n"
        "  metrics.reporter.prom:\n"
        "    factory.class: org.apache.flink.metrics.prometheus.PrometheusReporterFactory\n"
        "    port: 9250-9260\n"
    )
    settings = load_settings(
        ["--reconciled-by", "operator-metrics", "--operator-config", str(conf)], {}
    )
    assert settings.reconciled_by == "operator-metrics"
    assert settings.operator_metrics_url == "http://127.0.0.1:9250/metrics"
    # Flink's default port without a port; a flag or the environment wins.
    conf.write_text(
        "kubernetes.operator.metrics.reporter.p.factory.class: "
        "org.apache.flink.metrics.prometheus.PrometheusReporterFactory\n"
    )
    assert load_settings(["--operator-config", str(conf)], {}).operator_metrics_url == (
        "http://127.0.0.1:9249/metrics"
    )
    env = {"CANARYD_OPERATOR_METRICS_URL": "http://op:1234/metrics"}
    assert load_settings(["--operator-config", str(conf)], env).operator_metrics_url == (
        "http://op:1234/metrics"
    )


@pytest.mark.parametrize("url", ["localhost:9249", "ftp://x/metrics", "http://", "http://h:99999/"])
def test_a_bad_metrics_url_is_one_line(url):
    with pytest.raises(ConfigError, match="operator metrics URL"):
        load_settings(["--operator-metrics-url", url], {})


# ------------------------------------------------------------ the verdicts


async def test_a_bump_the_operator_reconciled_is_healthy(kube, kubeconfig):
    """Also under the names the reporter filters by default (recorded on the real one:
    namespace team-a is written team_a, name my.canary my_canary)."""
    kube.create_namespace("team-a")
    create_canary(kube, name="my.canary", namespace="team-a")
    create_canary(kube)
    async with (
        operator_for(kube) as operator,
        running_daemon(kube, kubeconfig, **judged_by(operator)) as run,
    ):
        await run.until_state(CanaryState.HEALTHY, name="my.canary", namespace="team-a")
        canary = await run.until_state(CanaryState.HEALTHY)
        assert "the operator reconciled generation" in canary.reason
        # The reconciled stage is measured from the operator's counter too.
        assert "reconciled" in canary.stages
        assert run.daemon.scheduler.operator.problem is None


async def test_a_wedged_operator_is_unhealthy_where_the_watch_sees_nothing_wrong(kube, kubeconfig):
    """The operator's informers stall (its metrics still answer): canaryd's own watch
    still sees every bump, so `watch` mode stays healthy; operator-metrics does not."""
    create_canary(kube)
    async with operator_for(kube) as operator:
        async with running_daemon(kube, kubeconfig) as watch_mode:
            await watch_mode.until_state(CanaryState.HEALTHY)
            operator.wedge()
            bumps = len(watch_mode.bumps())
            await watch_mode.until_bumps(bumps + 3)
            assert watch_mode.tracked().state is CanaryState.HEALTHY
        operator.unwedge()
        async with running_daemon(kube, kubeconfig, **judged_by(operator)) as run:
            await run.until_state(CanaryState.HEALTHY)
            wedged_at = asyncio.get_running_loop().time()
            operator.wedge()
            canary = await run.until_state(CanaryState.UNHEALTHY, within=4 * CYCLE + 2)
            assert asyncio.get_running_loop().time() - wedged_at <= 2 * CYCLE + 1.0
            assert "finished no reconcile" in canary.reason
            status, _ = await run.get("/healthz")
            assert status == 500


@pytest.mark.parametrize("how", ["accepted, unanswered", "backlog full"])
async def test_a_frozen_operator_counts_once_it_answered_nothing_for_a_cycle(kube, kubeconfig, how):
    """A stopped JVM first takes connections into its listen backlog and answers
    nothing; once the backlog is full its connects time out (seen on the real one
    under SIGSTOP). Neither is "gone": both count once a cycle passed unanswered."""
    create_canary(kube)
    async with (
        operator_for(kube) as operator,
        running_daemon(kube, kubeconfig, **judged_by(operator)) as run,
    ):
        canary = await run.until_state(CanaryState.HEALTHY)
        if how == "backlog full":
            await operator.stop_accepting()
        else:
            operator.freeze()
        frozen_at = asyncio.get_running_loop().time()
        canary = await run.until_state(CanaryState.UNHEALTHY, within=5 * CYCLE + 2)
        waited = asyncio.get_running_loop().time() - frozen_at
        assert waited >= CYCLE, "judged before a whole cycle without an answer"
        assert "answered nothing" in canary.reason and "frozen" in canary.reason
        assert counter(metrics.OPERATOR_SCRAPES, "unanswered") > 0


async def test_a_refused_endpoint_is_pending_and_a_restarted_operator_is_checked_afresh(
    kube, kubeconfig
):
    """The sidecar's loop: unhealthy -> the kubelet restarts the operator -> while it is
    gone, pending (no 500 for the new process to inherit) -> the new process is seen
    (its counters start over) -> pending "operator restarted at T", a bump at once, and
    the verdict on a bump written after its start."""
    create_canary(kube)
    port = free_port()
    async with running_daemon(
        kube,
        kubeconfig,
        reconciled_by="operator-metrics",
        operator_metrics_url=f"http://127.0.0.1:{port}/metrics",
    ) as run:
        async with operator_for(kube, port) as first:
            await run.until_state(CanaryState.HEALTHY)
            first.wedge()
            await run.until_state(CanaryState.UNHEALTHY, within=4 * CYCLE + 2)
        # Gone: nothing listens on the port.
        canary = await run.until_state(CanaryState.PENDING, within=2 * CYCLE + 1)
        assert "starting or gone" in canary.reason or "refused" in canary.reason
        assert (await run.get("/healthz"))[0] == 200
        restarts = counter(metrics.OPERATOR_RESTARTS)
        async with operator_for(kube, port) as second:
            await run.until(
                lambda: "operator restarted at" in run.tracked().reason,
                "the restart to be seen",
                within=2 * CYCLE + 1,
            )
            assert counter(metrics.OPERATOR_RESTARTS) == restarts + 1
            bumps_before = len(run.bumps())
            seen_at = asyncio.get_running_loop().time()
            canary = await run.until_state(CanaryState.HEALTHY, within=3 * CYCLE + 2)
            # The fresh check bumped at once, not a cycle later.
            first_bump = run.bumps()[bumps_before]
            assert first_bump.at - seen_at < CYCLE
            assert second.reconciles("canary") >= 1


async def test_an_answer_without_the_canarys_series_is_unknown_with_one_warning(
    kube, kubeconfig, capsys
):
    kube.create_namespace("elsewhere")
    create_canary(kube, namespace="elsewhere")
    with json_logs("info"):
        async with (
            operator_for(kube, namespaces=["default"]) as operator,
            running_daemon(kube, kubeconfig, **judged_by(operator)) as run,
        ):
            canary = await run.until_state(CanaryState.UNKNOWN, namespace="elsewhere", within=3)
            assert 'resourcens="elsewhere"' in canary.reason
            body = await blind_everywhere(run, "operator_metrics_no_series")
            assert "no series for flinkdeployments/elsewhere/canary" in body, body
            count = len(run.bumps())
            await run.until_bumps(count + 3)
            assert (await run.get("/healthz"))[0] == 200
    warnings = [
        r for r in json_lines(capsys.readouterr().err) if r["event"] == "operator_series_missing"
    ]
    assert len(warnings) == 1, warnings


async def test_an_endpoint_that_is_not_the_operators_is_blind_no_series(kube, kubeconfig):
    create_canary(kube)
    # canaryd's own /metrics: it answers, but holds no operator series.
    port = free_port()
    async with running_daemon(
        kube,
        kubeconfig,
        port=port,
        reconciled_by="operator-metrics",
        operator_metrics_url=f"http://127.0.0.1:{port}/metrics",
    ) as run:
        await run.until_state(CanaryState.UNKNOWN, within=3)
        body = await blind_everywhere(run, "operator_metrics_no_series")
        assert "answered without the operator's metrics" in body, body


def test_the_operator_metrics_are_blind_after_a_cycle_of_unusable_reads():
    """A start-up's grace, on the injected clock: refused reads for less than a cycle
    are not blind (the operator's reporter listens some seconds after it starts); for a
    whole cycle, unreachable; an answer without the operator's series, no_series; an
    answer with them, nothing."""
    now = [100.0]
    url = "http://127.0.0.1:1/metrics"
    judge = OperatorMetrics(url, connect_timeout=1, read_timeout=10, clock=lambda: now[0])
    refused = ScrapeFailed("refused", "nothing listens")
    judge._note(Read(now[0], None, refused))
    now[0] += 9.9
    judge._note(Read(now[0], None, refused))
    assert judge.blind() == {}
    now[0] += 0.1
    assert judge.blind() == {"operator_metrics_unreachable": "nothing listens"}
    judge._note(Read(now[0], parse("some_other_exporter_total 1\n"), None))
    assert set(judge.blind()) == {"operator_metrics_no_series"}  # the same episode
    judge._note(Read(now[0], parse(FIXTURE.read_text()), None))
    assert judge.blind() == {}
    judge._note(Read(now[0], None, refused))
    assert judge.blind() == {}  # a new grace


async def test_operator_metrics_unreachable_past_a_cycle_are_blind_until_they_answer(
    kube, kubeconfig
):
    """The sidecar's blindness (a wrong port, the reporter off): every canary stays
    ``pending`` (refused: starting or gone) and /healthz 200, so a wedged operator would
    never be restarted. After a cycle of refused reads (a start-up's grace) it is
    canaryd_blind{reason="operator_metrics_unreachable"}, in /readyz's body (still 200)
    and /healthz?verbose; an operator that answers there clears it."""
    create_canary(kube)
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    async with running_daemon(
        kube, kubeconfig, reconciled_by="operator-metrics", operator_metrics_url=url
    ) as run:
        operator = run.daemon.scheduler.operator
        await run.until(lambda: operator.problem is not None, "a refused read")
        body = await blind_everywhere(run, "operator_metrics_unreachable")
        assert body.startswith("OK\n") and "refused" in body, body
        # No verdict: pending, or unknown when a busy machine's late tick skipped a bump.
        assert run.canary().state in (CanaryState.PENDING, CanaryState.UNKNOWN)
        async with operator_for(kube, port=port):
            await run.until_state(CanaryState.HEALTHY, within=5)
            await blind_everywhere(run)


async def test_reads_are_per_interval_not_per_canary(kube, kubeconfig):
    for i in range(40):
        create_canary(kube, name=f"c{i}")
    async with (
        operator_for(kube) as operator,
        running_daemon(kube, kubeconfig, **judged_by(operator)) as run,
    ):
        await run.until(
            lambda: (
                len(run.registry) == 40
                and all(c.state is CanaryState.HEALTHY for c in run.registry.canaries())
            ),
            "40 healthy canaries",
            within=5,
        )
        before = counter(metrics.OPERATOR_SCRAPES, "ok")
        bumps = len(kube.requests_for("patch"))
        await run.until(
            lambda: len(kube.requests_for("patch")) >= bumps + 80, "two cycles of bumps"
        )
        reads = counter(metrics.OPERATOR_SCRAPES, "ok") - before
        # 80 bumps judged over about two cycles: at most one read per scrape interval
        # (a tenth of the cycle), far fewer than one per canary.
        assert reads <= 2.5 * 10 + 5, reads


def test_every_read_result_is_exported_at_zero_in_this_mode():
    metrics.operator_metrics_exported()
    families = {m.name: m for m in metrics.REGISTRY.collect()}
    results = {s.labels["result"] for s in families["canaryd_operator_scrapes"].samples}
    assert {"ok", "refused", "unanswered", "bad_answer"} <= results


# ------------------------------------------------ what an answer can be, on the wire


@contextlib.asynccontextmanager
async def raw_server(answer: bytes | None) -> AsyncIterator[str]:
    """A TCP server on 127.0.0.1 that sends ``answer`` to every request and closes
    (None: it reads and never answers)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        if answer is None:
            await asyncio.Event().wait()
        writer.write(answer)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/metrics"
    finally:
        server.close()


@pytest.mark.parametrize(
    ("answer", "cause"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 900\r\n\r\ntruncated", "bad_answer"),
        (b"garbage that is no HTTP\r\n\r\n", "bad_answer"),
        (b"", "bad_answer"),  # accepted, closed without a word
        (b"HTTP/1.1 500 Oops\r\nContent-Length: 0\r\n\r\n", "bad_answer"),
        (None, "unanswered"),
    ],
    ids=["truncated", "garbage", "closed", "http-500", "silent"],
)
async def test_a_broken_answer_is_no_sign_of_a_restart(answer, cause):
    """Only a refused connection says the process is gone (the next answer is then a
    new one); a broken, truncated or failing answer says nothing of the kind."""
    async with raw_server(answer) as url:
        reader = OperatorMetrics(url, connect_timeout=0.5, read_timeout=0.3)
        reader.last = parse(FIXTURE.read_text())
        with pytest.raises(ScrapeFailed) as failed:
            await reader.scrape()
        await reader.close()
    assert failed.value.cause == cause, failed.value
    assert not reader._refused_since_answer
    port = free_port()
    reader = OperatorMetrics(f"http://127.0.0.1:{port}/m", connect_timeout=0.5, read_timeout=0.3)
    with pytest.raises(ScrapeFailed) as failed:
        await reader.scrape()
    await reader.close()
    assert failed.value.cause == "refused" and reader._refused_since_answer


async def test_an_endless_answer_is_read_in_bounded_memory():
    """An answer that never ends (or is hundreds of MB) is read chunk by chunk and
    kept only as far as canaryd needs it: memory stays flat, and the read ends."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        line = b'junk_metric_total{a="b"} 1.0\n' * 4096
        with contextlib.suppress(ConnectionError):
            while True:
                writer.write(b"%x\r\n%s\r\n" % (len(line), line))
                await writer.drain()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/metrics"
    tracemalloc.start()
    try:
        reader = OperatorMetrics(url, connect_timeout=0.5, read_timeout=1.0)
        with pytest.raises(ScrapeFailed) as failed:
            await reader.scrape()
        _, peak = tracemalloc.get_traced_memory()
        await reader.close()
    finally:
        tracemalloc.stop()
        server.close()
    # Ended by its size or by its time, whichever comes first on this machine.
    assert failed.value.cause in ("unanswered", "bad_answer"), failed.value
    assert "did not finish" in str(failed.value) or "more than" in str(failed.value)
    assert peak < 16 * 1024 * 1024, f"peak {peak / 2**20:.1f} MiB while reading"


def test_a_start_time_that_is_no_date_is_none_and_never_raises():
    for value in ("1.7e12", "+Inf", "-1", "NaN"):
        assert parse(f"process_start_time_seconds {value}\n").start_time is None, value
    assert parse("process_start_time_seconds 1.7e9\n").start_time == 1.7e9
    assert wall_time(float("inf")) == "inf" and wall_time(1.7e12)  # shown, not raised


async def test_a_broken_answer_neither_clears_a_verdict_nor_counts_as_a_restart(kube, kubeconfig):
    create_canary(kube)
    async with (
        operator_for(kube) as operator,
        running_daemon(kube, kubeconfig, **judged_by(operator)) as run,
    ):
        await run.until_state(CanaryState.HEALTHY)
        operator.wedge()
        await run.until_state(CanaryState.UNHEALTHY, within=4 * CYCLE + 2)
        restarts = counter(metrics.OPERATOR_RESTARTS)
        broken = counter(metrics.OPERATOR_SCRAPES, "bad_answer")
        operator.broken_answers = 3
        await run.until(
            lambda: counter(metrics.OPERATOR_SCRAPES, "bad_answer") >= broken + 3,
            "three broken answers",
        )
        bumps = len(run.bumps())
        await run.until_bumps(bumps + 2)
        assert run.tracked().state is CanaryState.UNHEALTHY, run.tracked().reason
        assert counter(metrics.OPERATOR_RESTARTS) == restarts


async def test_a_slow_operator_is_not_a_frozen_one(kube, kubeconfig):
    """Answers that take half a cycle (longer than a connect may) are answers."""
    create_canary(kube)
    async with (
        operator_for(kube) as operator,
        running_daemon(kube, kubeconfig, **judged_by(operator)) as run,
    ):
        operator.answer_delay = CYCLE / 2
        await run.until_state(CanaryState.HEALTHY, within=6 * CYCLE + 2)
        watch = [run.tracked().state]
        for _ in range(3):
            seen = len(run.bumps())
            await run.until(lambda seen=seen: len(run.bumps()) > seen, "a bump")
            watch.append(run.tracked().state)
        assert set(watch) == {CanaryState.HEALTHY}, watch


@pytest.mark.parametrize("how", OUTAGES)
async def test_an_api_server_away_is_no_verdict_on_the_operator(kube, kubeconfig, how):
    """The operator reconciles through the API server: one that goes away right after a
    bump, before the operator reconciled it (connections refused, a load balancer's 503
    with none behind it, every request shed with 429), is no reason to restart the
    operator (as in the watch mode): no verdict, /healthz 200 throughout, and the canary
    is judged as usual once it is back."""
    create_canary(kube)
    async with (
        operator_for(kube) as operator,
        running_daemon(kube, kubeconfig, **judged_by(operator)) as run,
    ):
        canary = await run.until_state(CanaryState.HEALTHY)
        states: list[CanaryState] = []
        run.registry.listeners.append(lambda: states.append(run.tracked().state))
        bumps = len(run.bumps())
        kube.hold_watch_events()
        await run.until_bumps(bumps + 1)
        async with api_server_away(kube, how):
            await run.until(
                lambda: "API server is not answering" in run.tracked().reason,
                "no verdict while the API server is away",
                within=4 * CYCLE + 2,
            )
            assert await run.get("/healthz") == (200, "OK")
            kube.release_watch_events()
        await run.until_state(CanaryState.HEALTHY, within=6 * CYCLE + 2)
        assert CanaryState.UNHEALTHY not in states, run.tracked().reason
        assert canary is run.tracked()


async def test_after_a_restart_the_bumps_are_spread_over_the_cycle_again(kube, kubeconfig):
    count = 40
    for i in range(count):
        create_canary(kube, name=f"c{i}")
    port = free_port()
    settings = {
        "reconciled_by": "operator-metrics",
        "operator_metrics_url": f"http://127.0.0.1:{port}/metrics",
    }
    async with running_daemon(kube, kubeconfig, **settings) as run:

        def written(since: float = 0.0) -> list[float]:
            return sorted(
                r.at for r in kube.requests_for("patch") if r.status == 200 and r.at >= since
            )

        def densest(since: float) -> int:
            times = written(since)
            window = CYCLE / 4
            return max(
                (sum(1 for t in times[i:] if t - start < window) for i, start in enumerate(times)),
                default=0,
            )

        async with operator_for(kube, port):
            await run.until(
                lambda: (
                    sum(c.state is CanaryState.HEALTHY for c in run.registry.canaries()) == count
                ),
                "every canary healthy",
            )
        # Without the spread, every restart gives 40 at once. With it, a quarter of the
        # cycle holds about a quarter of the bumps, unless this machine stalled the event
        # loop for a cycle in the window (the deadlines that fell due in a stall are met
        # together): such a restart proves nothing, and another one is tried.
        seen: list[int] = []
        before = counter(metrics.OPERATOR_RESTARTS)
        for restarts in range(1, 4):
            async with operator_for(kube, port):
                await run.until(
                    lambda n=restarts: (
                        counter(metrics.OPERATOR_RESTARTS) >= before + n
                        and all(c.state is CanaryState.HEALTHY for c in run.registry.canaries())
                    ),
                    "the restart seen and every canary healthy again",
                    within=6 * CYCLE + 3,
                )
                since = asyncio.get_running_loop().time()
                await run.until(lambda t=since: len(written(t)) >= 2 * count, "two more cycles")
                seen.append(densest(since))
                if seen[-1] <= count * 5 // 8:
                    break
        else:
            pytest.fail(f"bumps in the densest quarter cycle after each restart: {seen}")


async def test_a_follower_leaves_an_operator_restart_to_the_leader(kube, kubeconfig):
    from canaryd.testing.apiserver import LEASES
    from tests.test_leader_election import lease

    create_canary(kube)
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    held = lease("other", renewed=now)
    held["spec"]["leaseDurationSeconds"] = 3600
    kube.create(LEASES, "default", held)
    port = free_port()
    async with running_daemon(
        kube,
        kubeconfig,
        leader_elect=True,
        identity="me",
        lease_namespace="default",
        reconciled_by="operator-metrics",
        operator_metrics_url=f"http://127.0.0.1:{port}/metrics",
    ) as run:
        async with operator_for(kube, port):
            reader = run.daemon.scheduler.operator
            await run.until(lambda: reader.last is not None, "a first answer read")
        restarted = run.daemon.scheduler.operator.instance
        async with operator_for(kube, port):
            await run.until(
                lambda: run.daemon.scheduler.operator.instance > restarted,
                "the new process to be seen",
            )
            assert run.tracked().reason == "standby: other holds the lease"
            assert not [p for p in run.daemon.scheduler._places.values() if p.what == "waiting"]
            assert not run.bumps()


async def test_a_dropped_canary_leaves_nothing_behind(kube, kubeconfig):
    kube.create_namespace("elsewhere")
    create_canary(kube, namespace="elsewhere")
    async with (
        operator_for(kube, namespaces=["default"]) as operator,
        running_daemon(kube, kubeconfig, **judged_by(operator)) as run,
    ):
        canary = await run.until_state(CanaryState.UNKNOWN, namespace="elsewhere", within=3)
        assert str(canary.key) in run.daemon.scheduler.operator.missing
        kube.delete(FLINK_DEPLOYMENTS, "elsewhere", "canary")
        await run.until_gone(namespace="elsewhere")
        assert str(canary.key) not in run.daemon.scheduler.operator.missing


async def test_the_label_sets_remembered_are_those_of_the_last_answer():
    """The operator's per-resource counters carry every resource it manages (not only
    canaries) and its pod's host name: resources created and deleted (CI session jobs),
    and each replaced operator pod, give label sets never seen again. The reader keeps
    what it parsed only for the label sets the operator still answers with; keeping
    every one ever seen held ~530 bytes each up to 200,000 of them (~105 MB, past the
    120 MB budget at 10,000 canaries)."""
    served = {"answer": b""}

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        body = served["answer"]
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.close()

    def answer(host: str, names: range) -> bytes:
        name = "flink_k8soperator_namespace_resource_JOSDK_Reconciliation_finished_Count"
        return "".join(
            f'{name}{{resourcename="job_{n}",resourcetype="FlinkSessionJob",'
            f'resourcens="ci",name="flink_kubernetes_operator",host="{host}",'
            f'namespace="flink",}} 3.0\n'
            for n in names
        ).encode()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/metrics"
    reader = OperatorMetrics(url, connect_timeout=1.0, read_timeout=5.0)
    series = 500
    try:
        for read in range(20):
            # Every 5th read a new operator pod; between, a fifth of the jobs replaced.
            host = f"flink_kubernetes_operator_7d9f_{read // 5}"
            first = read * series // 5
            served["answer"] = answer(host, range(first, first + series))
            scrape = await reader.scrape()
            assert len(scrape.reconciled) == series
    finally:
        await reader.close()
        server.close()
    assert reader.last is not None and len(reader.last.keys) <= series, (
        f"{len(reader.last.keys)} label sets remembered for an answer of {series} series"
    )


async def test_a_bug_in_a_reads_bookkeeping_loses_no_bump_in_flight(kube, kubeconfig, monkeypatch):
    """What a restart of the scheduler task costs: a read's bookkeeping (its scrape count,
    its episode, ``blind``) that raises must not cancel a bump whose PATCH is in flight."""
    create_canary(kube)
    async with (
        operator_for(kube) as operator,
        running_daemon(kube, kubeconfig, **judged_by(operator)) as run,
    ):
        await run.until_state(CanaryState.HEALTHY)
        scrapes, writer = metrics.OPERATOR_SCRAPES, run.daemon.scheduler.writer

        def generation() -> int:
            stored = kube.get("flinkdeployments", "default", "canary")
            assert stored is not None
            return int(stored["metadata"]["generation"])

        held = generation() + 1  # what the held bump writes
        sprung = asyncio.Event()

        class Bug:  # a bug in the bookkeeping, met while a bump's answer is on its way
            def labels(self, *values: str) -> object:
                if writer.in_flight and generation() == held and not sprung.is_set():
                    sprung.set()
                    raise RuntimeError("a bug in a read's bookkeeping")
                return scrapes.labels(*values)

        monkeypatch.setattr(metrics, "OPERATOR_SCRAPES", Bug())
        # The next bump is applied at once, its answer held past a few reads.
        kube.inject(Fault(verb="patch", name="canary", code=0, delay_answer=CYCLE / 3))
        await run.until(sprung.is_set, "the bug met with an applied bump in flight")
        # Answered, the held bump is the one judged (not abandoned, re-bumped a cycle on).
        await run.until(
            lambda: (run.tracked().last_bumped_generation or 0) >= held,
            f"the held bump (generation {held}) recorded",
        )
        assert run.tracked().last_bumped_generation == held
