"""Bad input never crashes canaryd: configuration (property-based), malformed objects
and watch lines, odd error bodies, and odd requests to its own endpoints."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from canaryd import metrics
from canaryd.config import ConfigError, load_settings, parse_duration
from canaryd.registry import CanaryState
from canaryd.testing.apiserver import Fault
from tests.harness import create_canary, running_daemon

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
        stale_before = counter_value(metrics.ERRORS, "stale_copy")
        kube.inject_watch_line(json.dumps({"type": "MODIFIED", "object": obj}).encode() + b"\n")
        await run.until(
            lambda: counter_value(metrics.ERRORS, "stale_copy") > stale_before,
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


def counter_value(metric, *labels: str) -> float:
    value: float = metric.labels(*labels)._value.get()
    return value


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
            assert response.status in (405, 413)
        assert await run.get("/healthz") == (200, "OK")
        assert (await run.get("/readyz"))[0] == 200
