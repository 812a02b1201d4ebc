"""Bad input never crashes canaryd: configuration (property-based), malformed objects
and watch lines, odd error bodies, and odd requests to its own endpoints."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from canaryd import metrics
from canaryd.config import ConfigError, load_settings
from canaryd.config.parse import parse_duration
from canaryd.registry import CanaryState
from canaryd.testing.apiserver import Fault
from tests.harness import counter, create_canary, running_daemon

UNITS = {"ms": 1e-3, "s": 1.0, "sec": 1.0, "min": 60.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


# ----------------------------------------------------------- configuration


@given(
    st.integers(min_value=0, max_value=10**6),
    st.sampled_from(sorted(UNITS)),
    st.sampled_from(["", " "]),
)
def test_duration_number_and_unit(number, unit, space):
    assert parse_duration(f"{number}{space}{unit}") == pytest.approx(number * UNITS[unit])


@given(st.integers(min_value=0, max_value=10**9))
def test_bare_number_is_milliseconds(number):
    assert parse_duration(str(number)) == pytest.approx(number / 1000)


@given(st.text(max_size=40))
def test_any_text_is_a_duration_or_a_config_error(text):
    try:
        seconds = parse_duration(text)
    except ConfigError:
        return
    assert seconds >= 0


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=60)
@given(
    flag=st.none() | st.integers(1, 999),
    env=st.none() | st.integers(1, 999),
    file=st.none() | st.integers(1, 999),
)
def test_precedence_is_flag_env_file_default(tmp_path, flag, env, file):
    argv, environ = [], {}
    path = tmp_path / "flink-conf.yaml"
    path.write_text(
        "" if file is None else f"kubernetes.operator.health.canary.resource.timeout: {file} s\n"
    )
    argv += ["--operator-config", str(path)]
    if flag is not None:
        argv += ["--timeout", f"{flag}s"]
    if env is not None:
        environ["CANARYD_TIMEOUT"] = f"{env} s"
    expected = next((v for v in (flag, env, file) if v is not None), 60)
    assert load_settings(argv, environ).timeout == expected


@given(st.lists(st.text(max_size=12), max_size=6))
def test_random_arguments_parse_or_raise_config_error(argv):
    try:
        load_settings(argv, {})
    except ConfigError:
        pass
    except SystemExit as exit_:  # --help / --version
        assert exit_.code == 0


# -------------------------------------------------- malformed watch input


@pytest.mark.parametrize(
    "line",
    [
        b"not json at all\n",
        b"[1, 2, 3]\n",
        b'{"type": "MODIFIED"}\n',
        b'{"type": "MODIFIED", "object": null}\n',
        b'{"type": "MODIFIED", "object": {"metadata": "nope"}}\n',
        b'{"type": "ADDED", "object": {"metadata": {"name": 7}}}\n',
        b'{"type": "SURPRISE", "object": {"metadata": {}}}\n',
        b'{"type": "ERROR", "object": {"code": "x", "message": {"a": 1}}}\n',
        b'{"type": "MODIFIED", "object": {"metadata": {"name": "canary", "namespace": '
        b'"default", "uid": "other", "labels": {"flink.apache.org/canary": "true"}}}}\n',
        b"\n\n\n",
    ],
    ids=[
        "not-json",
        "array",
        "no-object",
        "null-object",
        "metadata-string",
        "name-int",
        "unknown-type",
        "bad-error",
        "no-generation-other-uid",
        "blank-lines",
    ],
)
async def test_malformed_watch_lines_are_skipped_and_logged(kube, kubeconfig, line):
    create_canary(kube)
    async with running_daemon(kube, kubeconfig, kinds=("flinkdeployments",)) as run:
        await run.until_state(CanaryState.HEALTHY)
        await run.until(
            lambda: any(w.rtype.plural == "flinkdeployments" for w in kube.watchers), "the watch"
        )
        kube.inject_watch_line(line)
        bumps = len(run.bumps())
        await run.until_bumps(bumps + 3)
        await run.until_state(CanaryState.HEALTHY)
        assert (await run.get("/healthz"))[0] == 200


async def test_a_copy_without_generation_never_moves_the_canary_backwards(kube, kubeconfig):
    """A copy of the same object (same uid) that shows no generation, or an older one,
    is stale or malformed: generation never goes backwards within one uid."""
    create_canary(kube)
    async with running_daemon(kube, kubeconfig, kinds=("flinkdeployments",)) as run:
        canary = await run.until_state(CanaryState.HEALTHY)
        await run.until(lambda: bool(kube.watchers), "the watch")
        obj = kube.get("flinkdeployments", "default", "canary")
        del obj["metadata"]["generation"]
        stale_before = counter(metrics.ERRORS, "stale_copy")
        kube.inject_watch_line(json.dumps({"type": "MODIFIED", "object": obj}).encode() + b"\n")
        await run.until(
            lambda: counter(metrics.ERRORS, "stale_copy") > stale_before,
            "the generation-less copy",
        )
        assert canary.generation >= 2
        await run.until_bumps(len(run.bumps()) + 2)
        assert run.tracked().state is CanaryState.HEALTHY


async def test_pretty_printed_error_bodies_are_understood(kube, kubeconfig):
    create_canary(kube)
    kube.pretty_errors = True
    async with running_daemon(kube, kubeconfig) as run:
        await run.until_state(CanaryState.HEALTHY)
        kube.inject(Fault(verb="patch", code=403, message="denied, pretty"))
        canary = await run.until_state(CanaryState.UNKNOWN)
        assert canary.reason.endswith("403 Forbidden: denied, pretty")


# ---------------------------------------------- odd requests to canaryd


async def raw_request(port: int, data: bytes, *, read: bool = True) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        if not read:
            return b""
        async with asyncio.timeout(5):
            return await reader.read(65536)
    finally:
        writer.close()


async def test_odd_requests_get_clear_errors_and_the_daemon_keeps_answering(kube, kubeconfig):
    create_canary(kube)
    async with running_daemon(kube, kubeconfig) as run:
        await run.until_state(CanaryState.HEALTHY)
        port = run.daemon.server.port
        for method in ("PUT", "DELETE", "PATCH", "OPTIONS", "TRACE"):
            async with run.http.request(method, run.url + "/healthz") as response:
                assert response.status == 405, method
        for path in (
            "/healthz/",
            "/HEALTHZ",
            "/.env",
            "/debug/pprof",
            "/metrics/x",
            "/" + "a" * 4000,
            "/%00",
            "/healthz%2F..%2Fmetrics",
        ):
            async with run.http.get(run.url + path) as response:
                assert response.status in (404, 400), path
        async with run.http.get(run.url + "/healthz", headers={"X-Big": "x" * 20000}) as r:
            assert r.status in (400, 431)
        garbage = await raw_request(port, b"\x16\x03\x01\x02\x00garbage\r\n\r\n")
        assert garbage.startswith(b"HTTP/1.") and b" 400 " in garbage.split(b"\r\n")[0]
        # A slow client holds a half-sent request; others are still served.
        slow_reader, slow_writer = await asyncio.open_connection("127.0.0.1", port)
        slow_writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        await slow_writer.drain()
        for _ in range(5):
            assert await run.get("/healthz") == (200, "OK")
        slow_writer.write(b"\r\n")
        await slow_writer.drain()
        async with asyncio.timeout(5):
            answer = await slow_reader.read(4096)
        assert b"200 OK" in answer
        slow_writer.close()
        async with run.http.post(run.url + "/healthz", data=b"x" * 100_000) as response:
            assert response.status in (405, 413, 431)  # 431: more than MAX_HEAD_BYTES at once
        assert await run.get("/healthz") == (200, "OK")
        assert (await run.get("/readyz"))[0] == 200


# ---------------------------------------------- one clear line, exit 2 (issue 12)


def run_main(argv: list[str], capsys, monkeypatch) -> tuple[int, list[str]]:
    from canaryd.__main__ import main

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBECONFIG", raising=False)
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--host", "127.0.0.1", "--port", "0"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    return int(exited.value.code or 0), lines


def kubeconfig_with_server(tmp_path, server: str):
    path = tmp_path / "kubeconfig"
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        f"clusters: [{{name: c, cluster: {{server: '{server}'}}}}]\n"
        "users: [{name: c, user: {token: t}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: c}}]\n"
    )
    return path


@pytest.mark.parametrize(
    "server", ["not a url", "ftp://example.invalid", "http://", "https://127.0.0.1:99999", ""]
)
def test_a_kubeconfig_server_that_is_not_a_url_is_one_line(tmp_path, capsys, monkeypatch, server):
    path = kubeconfig_with_server(tmp_path, server)
    code, lines = run_main(["--kubeconfig", str(path)], capsys, monkeypatch)
    assert code == 2 and len(lines) == 1, lines
    assert str(path) in lines[0] and "server" in lines[0]


def test_no_kubeconfig_at_all_says_so(tmp_path, capsys, monkeypatch):
    missing = tmp_path / "nowhere" / "config"
    code, lines = run_main(["--kubeconfig", str(missing)], capsys, monkeypatch)
    assert code == 2 and len(lines) == 1, lines
    assert str(missing) in lines[0] and "no kubeconfig" in lines[0]


@pytest.mark.parametrize("text", ["", "- a\n- b\n", "just text\n", "clusters: 5\n"])
def test_a_kubeconfig_that_is_not_a_mapping_is_one_line(tmp_path, capsys, monkeypatch, text):
    path = tmp_path / "kubeconfig"
    path.write_text(text)
    code, lines = run_main(["--kubeconfig", str(path)], capsys, monkeypatch)
    assert code == 2 and len(lines) == 1, lines
    assert str(path) in lines[0]
    assert "Traceback" not in lines[0] and "NoneType" not in lines[0]


def test_watched_namespaces_as_a_mapping_is_refused(tmp_path, capsys, monkeypatch):
    conf = tmp_path / "flink-conf.yaml"
    conf.write_text("kubernetes.operator.watched.namespaces: {a: 1}\n")
    code, lines = run_main(["--operator-config", str(conf)], capsys, monkeypatch)
    assert code == 2 and len(lines) == 1, lines
    assert "kubernetes.operator.watched.namespaces" in lines[0] and str(conf) in lines[0]


@pytest.mark.parametrize("value", ["1ms", "50ms", "5", "-5s", "0"])
def test_a_cycle_the_daemon_cannot_keep_is_refused_with_its_unit(
    tmp_path, capsys, monkeypatch, value
):
    code, lines = run_main(["--timeout", value], capsys, monkeypatch)
    assert code == 2 and len(lines) == 1, lines
    assert "timeout" in lines[0]
    assert "ms" in lines[0] or "greater than zero" in lines[0]


def test_a_timeout_in_the_operator_config_as_a_bare_number_is_milliseconds(tmp_path):
    conf = tmp_path / "flink-conf.yaml"
    conf.write_text("kubernetes.operator.health.canary.resource.timeout: 5\n")
    with pytest.raises(ConfigError, match=r"5 ms.*milliseconds"):
        load_settings(["--operator-config", str(conf)], {})


@pytest.mark.parametrize(
    ("args", "env", "says"),
    [
        (["--renew-deadline", "20s"], {}, "lease duration must be greater than the renew deadline"),
        (["--retry-period", "9s"], {}, "renew deadline must be greater than 1.2 x the retry"),
        (["--lease-duration", "-1s"], {}, "--lease-duration: invalid duration '-1s'"),
        (["--lease-name", "Not_A_Name"], {}, "invalid lease name"),
        ([], {"CANARYD_LEADER_ELECT": "perhaps"}, "CANARYD_LEADER_ELECT=perhaps: expected true"),
        # Bare numbers are milliseconds everywhere: every duration has a floor.
        (
            [],
            {"CANARYD_LEASE_DURATION": "15", "CANARYD_RENEW_DEADLINE": "10"},
            "CANARYD_LEASE_DURATION=15: '15' is 15 ms, below its floor of 1 s (a bare number "
            "is milliseconds: write '15s')",
        ),
        ([], {"CANARYD_RETRY_PERIOD": "2"}, "CANARYD_RETRY_PERIOD=2: '2' is 2 ms"),
        (["--renew-deadline", "200ms"], {}, "--renew-deadline: '200ms' is 200 ms, below"),
        # The Lease stores whole seconds: what followers wait is what is written.
        (
            ["--lease-duration", "1.4s", "--renew-deadline", "1.3s", "--retry-period", "0.5s"],
            {},
            "lease duration 1.4s is stored in the Lease as 1 s (whole seconds), which must "
            "be greater than the renew deadline 1.3s",
        ),
        # The same where the write budget passes (5.2 s - 2 x 2 s leaves 1.2 s): only
        # the whole seconds the Lease stores refuse it.
        (
            ["--lease-duration", "5.5s", "--renew-deadline", "5.2s", "--retry-period", "2s"],
            {},
            "lease duration 5.5s is stored in the Lease as 5 s (whole seconds), which must "
            "be greater than the renew deadline 5.2s",
        ),
        # client-go's rule passes (5 > 1.2 x 2.5), but a leader renewing every 2.5 s
        # would have no time left to send a write that ends by its renew deadline.
        (
            ["--renew-deadline", "5s", "--retry-period", "2.5s"],
            {},
            "renew deadline 5s less twice the retry period 2.5s leaves 0s for a write, below 1s",
        ),
        # Both of those pass, but a renewal answered within its 1 s request timeout may
        # leave 0.5 s of the renew deadline: the fence shut while the leader renews.
        (
            [
                "--renew-deadline",
                "1.5s",
                "--retry-period",
                "0.1s",
                "--timeout",
                "2s",
                "--lease-duration",
                "2s",
            ],
            {},
            "--renew-deadline 1.5s, --retry-period 0.1s and --timeout 2s: a lease renewal "
            "answered within its request timeout (1s) may leave 0.5s of the renew deadline, "
            "below the 1s a write needs",
        ),
    ],
)
def test_bad_leader_election_settings_are_one_line(tmp_path, capsys, monkeypatch, args, env, says):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    flag = [] if env else ["--leader-elect"]  # the flag wins over the environment
    code, lines = run_main([*flag, *args], capsys, monkeypatch)
    assert code == 2 and len(lines) == 1, lines
    assert says in lines[0], lines


def test_canaryd_check_refuses_the_same_lease_timings(capsys):
    """The lease timings are checked beside the leader (leader.lease_timings_problem):
    both entry points exit 2 with its line before connecting to anything."""
    from canaryd.__main__ import main

    with pytest.raises(SystemExit) as exited:
        main(["check", "--leader-elect", "--renew-deadline", "20s"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "canaryd: lease duration must be greater than the renew deadline"
    ]


def test_a_bare_config_check_interval_is_refused_with_the_hint(capsys, monkeypatch):
    monkeypatch.setenv("CANARYD_CONFIG_CHECK_INTERVAL", "5")
    code, lines = run_main([], capsys, monkeypatch)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(
        "canaryd: CANARYD_CONFIG_CHECK_INTERVAL=5: '5' is 5 ms, below its floor of 1 s"
    ), lines


def test_the_default_identity_is_the_host_name_and_a_random_suffix():
    """Two replicas on hosts of one name (systemd, VMs) must not both lead."""
    import socket

    from canaryd.leader import LeaderElector

    chosen = load_settings(["--leader-elect", "--lease-namespace", "default"], {})
    first, second = (
        LeaderElector(chosen, kube=None).identity  # type: ignore[arg-type]
        for _ in range(2)
    )
    assert first.startswith(f"{socket.gethostname()}_") and first != second
    assert load_settings(["--identity", "pod-0"], {}).identity == "pod-0"  # as given


def test_leader_election_settings_by_flag_and_environment():
    settings = load_settings(
        ["--leader-elect", "--lease-duration", "30s", "--identity", "pod-0"],
        {"CANARYD_RENEW_DEADLINE": "20 s", "CANARYD_LEASE_NAMESPACE": "ops"},
    )
    assert settings.leader_elect and settings.identity == "pod-0"
    assert (settings.lease_duration, settings.renew_deadline, settings.retry_period) == (
        30.0,
        20.0,
        2.0,
    )
    assert settings.lease_namespace == "ops" and settings.lease_name == "canaryd"
    assert load_settings([], {"CANARYD_LEADER_ELECT": "true"}).leader_elect
    assert not load_settings([], {}).leader_elect


@pytest.mark.parametrize("value", ["yes", "no", "1", "0", "on", "maybe"])
def test_every_boolean_is_true_or_false_only(tmp_path, capsys, monkeypatch, value):
    """The same booleans everywhere, as Flink reads the operator's own: the environment
    and the operator config file alike refuse what is not true or false (any case)."""
    monkeypatch.setenv("CANARYD_LEADER_ELECT", value)
    code, lines = run_main([], capsys, monkeypatch)
    assert code == 2 and len(lines) == 1, lines
    says = f"CANARYD_LEADER_ELECT={value}: expected true or false, got '{value}'"
    assert lines[0] == f"canaryd: {says}"
    monkeypatch.delenv("CANARYD_LEADER_ELECT")
    conf = tmp_path / "flink-conf.yaml"
    conf.write_text(
        "kubernetes.operator.watched.namespaces: a\n"
        f"kubernetes.operator.dynamic.namespaces.enabled: {value}\n"
    )
    code, lines = run_main(["--operator-config", str(conf)], capsys, monkeypatch)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0] == (
        f"canaryd: {conf}: kubernetes.operator.dynamic.namespaces.enabled: expected true or "
        f"false, got '{value}'"
    )


@pytest.mark.parametrize(("value", "wanted"), [("TRUE", True), ("true", True), ("False", False)])
def test_true_and_false_in_any_case_are_taken_everywhere(tmp_path, value, wanted):
    assert load_settings([], {"CANARYD_LEADER_ELECT": value}).leader_elect is wanted
    conf = tmp_path / "config.yaml"
    conf.write_text(
        "kubernetes:\n  operator:\n    watched.namespaces: a\n"
        f"    dynamic.namespaces.enabled: {value}\n"
    )
    assert load_settings(["--operator-config", str(conf)], {}).dynamic_namespaces is wanted


def test_a_leaders_write_timeout_leaves_its_renew_deadline_room():
    """Under --leader-elect a write is sent only while write_timeout of the renew
    deadline is left after the last renew: the timeout is the request timeout, at most
    the renew deadline less two retry periods; the same timings without election are
    not refused."""
    plain = load_settings([], {})
    assert plain.write_timeout == plain.request_timeout == 10.0
    elected = load_settings(["--leader-elect"], {})
    assert elected.write_timeout == 10.0 - 2 * 2.0
    short = load_settings(["--leader-elect", "--timeout", "2s"], {})
    assert short.write_timeout == short.request_timeout == 1.0
    assert load_settings(["--renew-deadline", "5s", "--retry-period", "2.5s"], {}).write_timeout
