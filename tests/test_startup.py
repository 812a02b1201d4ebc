"""Start-up as a user meets it (issue 21): an API server that cannot be reached or
refuses the credentials is one episode whose cause /readyz and the first line name; an
episode still open at SIGTERM is not told as ended; the operator config file read is
the one the operator reads, and the log says which."""

from __future__ import annotations

import asyncio
import itertools
import socket
import ssl
from collections.abc import Callable

import pytest
import trustme
import yaml

from canaryd import metrics
from canaryd.config import load_settings
from canaryd.kube import ErrorKind, KubeError, error_from_exception, failure_cause
from canaryd.testing.apiserver import FakeKube
from tests.conftest import TOKEN
from tests.harness import (
    Running,
    counter,
    create_canary,
    json_lines,
    json_logs,
    running_daemon,
    start_records,
)


async def until_true(predicate: Callable[[], bool], what: str, within: float = 10.0) -> None:
    """For what the fake cannot tell (a refused connection, a failed handshake never
    reaches it): re-checked every 10 ms, bounded, with a message."""
    try:
        async with asyncio.timeout(within):
            while not predicate():  # noqa: ASYNC110 - nothing to wait on: see above
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"still waiting after {within}s for {what}") from None


def failed_requests() -> float:
    return counter(metrics.API_REQUESTS, "list", "error")


async def ready(run: Running) -> tuple[int, str]:
    return await run.get("/readyz")


def events(records: list[dict[str, object]], name: str) -> list[dict[str, object]]:
    return [r for r in records if r["event"] == name]


def one_episode(records: list[dict[str, object]], cause: str) -> None:
    """Told once when it starts (a warning naming the cause), once when it ends, and a
    summary a cycle while it lasts; every retry at debug only (every scope's list fails
    alike: one episode)."""
    started = events(records, "watch_failures_started")
    assert len(started) == 1, started
    assert started[0]["level"] == "warning" and started[0]["cause"] == cause, started
    assert len(events(records, "watch_failures_ended")) == 1
    retries = events(records, "watch_failed")
    assert len(retries) >= 3 and {r["level"] for r in retries} == {"debug"}, retries
    ongoing = events(records, "watch_failures_ongoing")
    assert not [
        r for r in records if r["level"] == "warning" and r not in started + retries + ongoing
    ]


async def test_an_api_server_that_refuses_connections_is_one_episode_named_in_readyz(
    kube, kubeconfig, capsys
):
    create_canary(kube)
    await kube.refuse_connections()
    with json_logs("debug"):
        async with running_daemon(kube, kubeconfig) as run:
            before = failed_requests()
            await until_true(lambda: failed_requests() >= before + 3, "three refused attempts")
            status, text = await ready(run)
            assert status == 503 and "not listed or not connected: " in text, text
            assert "(refused: " in text, text
            assert await run.get("/healthz") == (200, "OK")  # nothing tracked: healthy
            await kube.accept_connections()
            await run.until_tracked()
            await run.until(lambda: run.daemon.not_ready() is None, "ready")
        records = json_lines(capsys.readouterr().err)
    one_episode(records, "list_error")


async def test_a_token_refused_after_a_credential_reload_is_named_and_a_fixed_one_is_read(
    kube, kubeconfig, capsys
):
    """401: canaryd re-reads the kubeconfig for a refused request, and while the
    re-read credentials are refused too it re-reads them at a backed-off pace (1 s,
    doubling); a token fixed in the file is picked up then, with no restart."""
    create_canary(kube)
    config = yaml.safe_load(kubeconfig.read_text())
    config["users"][0]["user"]["token"] = "wrong-token-0123456789"
    kubeconfig.write_text(yaml.safe_dump(config))
    with json_logs("debug"):
        async with running_daemon(kube, kubeconfig) as run:
            refused = lambda: [r for r in kube.requests if r.status == 401]  # noqa: E731
            await run.until(lambda: len(refused()) >= 6, "three attempts, each reloaded once")
            status, text = await ready(run)
            assert status == 503, text
            assert "(unauthorized: 401" in text, text
            assert "(also after reloading the credentials)" in text, text
            assert "wrong-token" not in text
            config["users"][0]["user"]["token"] = TOKEN
            kubeconfig.write_text(yaml.safe_dump(config))
            await run.until_tracked(within=20)
            await run.until(lambda: run.daemon.not_ready() is None, "every scope listed")
        err = capsys.readouterr().err
    assert "wrong-token" not in err and TOKEN not in err
    one_episode(json_lines(err), "list_unauthorized")


async def test_an_untrusted_certificate_is_named_tls(tmp_path, capsys):
    ca = trustme.CA()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1", "localhost").configure_cert(context)
    handshakes = asyncio.Event()
    context.sni_callback = lambda *_: handshakes.set()
    kube = FakeKube(token=TOKEN)
    async with kube.running(ssl_context=context):
        kube.create_namespace("default")
        config = kube.write_kubeconfig(tmp_path / "kubeconfig")  # no CA: not trusted
        with json_logs("info"):
            async with running_daemon(kube, config) as run:
                before = failed_requests()
                await until_true(lambda: failed_requests() >= before + 3, "three handshakes")
                status, text = await ready(run)
                assert status == 503 and "(tls: " in text, text
                assert "CERTIFICATE_VERIFY_FAILED" in text, text
            records = json_lines(capsys.readouterr().err)
    started = events(records, "watch_failures_started")
    # One episode line for the cause, whichever scope failed first (a loaded machine
    # may also time a handshake out: the same cause, a failed list).
    assert [r["cause"] for r in started] == ["list_error"], started
    assert events(records, "watch_failed") == []  # per retry: debug only
    # Stopped while it still failed: told as such, never as an end.
    (still,) = events(records, "watch_failures_still_failing")
    assert still["failing"] == 3 and set(still["causes"]) == {"list_error"}, still
    assert events(records, "watch_failures_ended") == []


async def test_a_403_episode_still_open_at_sigterm_is_not_told_as_ended(kube, kubeconfig, capsys):
    kube.create_namespace("locked")
    create_canary(kube)
    kube.deny(verb="list", resource="flinkdeployments", namespace="locked")
    with json_logs("info"):
        async with running_daemon(
            kube, kubeconfig, namespaces=frozenset({"default", "locked"})
        ) as run:
            await run.until_tracked()
            await run.until(
                lambda: any(
                    r.status == 403 and r.namespace == "locked" for r in kube.requests_for("list")
                ),
                "the 403 on the locked namespace",
            )
        records = json_lines(capsys.readouterr().err)
    assert len(events(records, "watch_failures_started")) == 1
    assert events(records, "watch_failures_ended") == []
    (still,) = events(records, "watch_failures_still_failing")
    assert still["failing"] == 1 and still["scopes"] == ["flinkdeployments@locked"], still
    assert still["why"] == "the watches stopped"


@pytest.mark.parametrize(
    "names", [["flink-conf.yaml"], ["config.yaml"], ["config.yaml", "flink-conf.yaml"]]
)
async def test_the_start_up_log_names_the_operator_config_file_the_operator_reads(
    kube, kubeconfig, tmp_path, capsys, names
):
    """In a conf directory with both files the operator (Flink 1.20) reads
    flink-conf.yaml; so does canaryd, and it says so."""
    conf = tmp_path / "conf"
    conf.mkdir()
    for name in names:
        namespace = f"from-{name.split('.')[0]}"
        (conf / name).write_text(f"kubernetes.operator.watched.namespaces: {namespace}\n")
    settings = load_settings(["--operator-config", str(conf)], {})
    wanted = "flink-conf.yaml" if "flink-conf.yaml" in names else "config.yaml"
    assert settings.namespaces == frozenset({f"from-{wanted.split('.')[0]}"})
    records = await start_records(kube, kubeconfig, conf, capsys)
    (started,) = events(records, "canaryd_started")
    assert started["operator_config"] == str(conf / wanted), started
    ignored = events(records, "operator_config_ignored")
    if len(names) == 1:
        assert ignored == []
    else:
        (line,) = ignored
        assert line["level"] == "warning" and line["read"] == str(conf / "flink-conf.yaml")
        assert line["ignored"] == [str(conf / "config.yaml")], line


def _chained(*errors: BaseException) -> KubeError:
    """A KubeError raised from the first error, each error raised while handling the
    next (the way asyncio.timeout wraps what it interrupted)."""
    for outer, inner in itertools.pairwise(errors):
        outer.__context__ = inner
    failure = error_from_exception(errors[0])
    failure.__cause__ = errors[0]
    return failure


@pytest.mark.parametrize(
    ("error", "cause"),
    [
        (_chained(ConnectionRefusedError(111, "refused")), "refused"),
        (_chained(TimeoutError()), "timeout"),
        (_chained(TimeoutError(), ssl.SSLCertVerificationError("unable to get issuer")), "tls"),
        (_chained(socket.gaierror(-2, "Name or service not known")), "dns"),
        (KubeError(ErrorKind.TRANSIENT, "Unauthorized", status=401), "unauthorized"),
        (KubeError(ErrorKind.TRANSIENT, "boom", status=503), "server_error"),
        (_chained(OSError("odd")), "connection"),
    ],
)
def test_the_cause_named_is_the_most_telling_one_in_the_chain(error, cause):
    assert failure_cause(error) == cause


async def test_a_busy_port_exits_2_naming_it_and_leaves_nothing_behind(kube, kubeconfig):
    """The health port taken: a ConfigError (exit 2) naming it, before any task runs; the
    client closed and the state gauges unregistered (a second start says the same)."""
    from dataclasses import replace

    from canaryd.config import ConfigError
    from canaryd.daemon import Daemon
    from tests.harness import TEST_SETTINGS

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        settings = replace(TEST_SETTINGS, kubeconfig=str(kubeconfig), port=port)
        for _ in range(2):
            with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}: "):
                await Daemon(settings).run()
    assert kube.requests_for("list") == []  # nothing watched


async def test_a_failure_while_wiring_the_components_leaves_no_port_or_connection_open(
    kube, kubeconfig, monkeypatch
):
    """A bug raised while the elector, scheduler or watcher is built: the daemon stops
    with it before its health server listens (none left listening with nobody behind
    it) and before anything is watched."""
    from dataclasses import replace

    from canaryd.daemon import Daemon
    from tests.harness import TEST_SETTINGS

    def broken(*args: object) -> None:
        raise RuntimeError("a bug in the wiring")

    monkeypatch.setattr("canaryd.daemon.Watcher", broken)
    daemon = Daemon(replace(TEST_SETTINGS, kubeconfig=str(kubeconfig)))
    with pytest.raises(RuntimeError, match="a bug in the wiring"):
        await daemon.run()
    assert not hasattr(daemon, "server")  # no health server was made, none listens
    client = daemon.scheduler.kube  # its API client's connections closed all the same
    assert client._session.closed and client._watch_session.closed
    assert kube.requests_for("list") == []


async def test_a_daemon_cancelled_again_while_its_health_server_stops_still_lets_go(
    kube, kubeconfig, monkeypatch
):
    """Cancelled, then cancelled again while its health server stops (a second signal,
    a supervisor's cancel): its metrics collector is unregistered and its API client's
    connections closed all the same."""
    from dataclasses import replace

    from canaryd.daemon import Daemon
    from canaryd.server import HealthServer
    from tests.harness import TEST_SETTINGS

    stopping = asyncio.Event()

    async def hung_stop(self: HealthServer) -> None:
        stopping.set()
        await asyncio.Event().wait()

    monkeypatch.setattr(HealthServer, "stop", hung_stop)
    daemon = Daemon(replace(TEST_SETTINGS, kubeconfig=str(kubeconfig)))
    run = asyncio.create_task(daemon.run())
    async with asyncio.timeout(10):
        await daemon.started.wait()
    run.cancel()
    async with asyncio.timeout(10):
        await stopping.wait()
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    assert daemon.scheduler is not None
    client = daemon.scheduler.kube
    assert client._session.closed and client._watch_session.closed
    assert daemon.server not in metrics.REGISTRY._collector_to_names
