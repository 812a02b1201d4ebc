"""Logs an operator on call can read in an outage: a failure is told once when it
starts, summarised once per cycle while it lasts and once when it ends; per-canary
and per-watch detail is at debug. The health port counts malformed requests in a
metric and logs at most a line per cycle about them."""

from __future__ import annotations

import asyncio
import math
from collections import Counter

import pytest

from canaryd import metrics
from canaryd.registry import CanaryState
from tests.harness import (
    CYCLE,
    counter,
    create_canary,
    json_lines,
    json_logs,
    running_daemon,
)

NAMESPACES = 100
PER_NAMESPACE = 3
CANARIES = NAMESPACES * PER_NAMESPACE


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_an_api_server_outage_is_one_episode_in_the_log_not_lines_per_canary(
    kube, kubeconfig, capsys
):
    """Before: 300 canaries, a 3-cycle outage wrote a `bump_failed` line per canary, a
    `canary_state` line per canary each way and a `watch_failed` line per scope per
    retry (over a thousand lines)."""
    namespaces = [f"team-{n:03}" for n in range(NAMESPACES)]
    for namespace in namespaces:
        kube.create_namespace(namespace)
        for number in range(PER_NAMESPACE):
            create_canary(kube, f"canary-{number}", namespace)
    cycle = 3.0  # 300 canaries and 200 watches in one process with the fake
    outage_cycles = 3
    with json_logs("info"):
        async with running_daemon(
            kube, kubeconfig, timeout=cycle, namespaces=frozenset(namespaces)
        ) as run:

            def healthy() -> bool:
                return run.registry.counts()["healthy"] == CANARIES

            await run.until(healthy, "every canary healthy", within=6 * cycle)
            capsys.readouterr()  # the start-up lines are not the outage's
            failed_before = counter(metrics.BUMPS, "failed")
            await kube.refuse_connections()
            loop = asyncio.get_running_loop()
            down_at = loop.time()
            await run.until(
                lambda: (
                    counter(metrics.BUMPS, "failed") - failed_before >= outage_cycles * CANARIES
                ),
                f"{outage_cycles} failed bumps per canary",
                within=(outage_cycles + 3) * cycle,
            )
            await kube.accept_connections()
            down_for = loop.time() - down_at
            await run.until(healthy, "every canary healthy again", within=6 * cycle)
            out = capsys.readouterr()
    records = json_lines(out.err + out.out)
    events = Counter(r["event"] for r in records)
    cycles = math.ceil(down_for / cycle) + 6  # the outage and the recovery
    assert len(records) <= 6 + 4 * cycles, (
        f"{len(records)} log lines for an outage of {down_for:.1f}s "
        f"({down_for / cycle:.1f} cycles): {events.most_common(8)}"
    )
    # Nothing per canary or per watch at info or above.
    assert events["bump_failed"] == 0, events
    assert events["canary_state"] == 0, events
    assert events["watch_failed"] == 0 and events["list_failed"] == 0, events
    # The episode: told when it starts, summarised while it lasts, told when it ends.
    started = [r for r in records if r["event"] == "bump_failures_started"]
    # One line per cause (connections refused; bumps that waited past their window).
    causes = [r["cause"] for r in started]
    assert "failed" in causes and len(causes) == len(set(causes)) <= 3, started
    assert all(r["level"] == "warning" and "canary" in r and r["error"] for r in started)
    ongoing = [r for r in records if r["event"] == "bump_failures_ongoing"]
    assert 1 <= len(ongoing) <= cycles, ongoing
    assert max(r["failing"] for r in ongoing) == CANARIES, ongoing
    # Every summary names the outage's causes; the last ones, on a loaded machine, may
    # hold only bumps still backed up behind the writes the outage slowed.
    assert any(r["causes"].get("failed") for r in ongoing), ongoing
    assert all(set(r["causes"]) <= {"failed", "skipped"} for r in ongoing), ongoing
    ended = [r for r in records if r["event"] == "bump_failures_ended"]
    assert len(ended) == 1 and ended[0]["affected"] == CANARIES, ended
    assert ended[0]["level"] == "info" and ended[0]["lasted"] > 0
    watch_started = [r for r in records if r["event"] == "watch_failures_started"]
    assert watch_started and watch_started[0]["level"] == "warning", events
    watch_ended = [r for r in records if r["event"] == "watch_failures_ended"]
    assert len(watch_ended) == 1 and watch_ended[0]["affected"] == 2 * NAMESPACES + 1, (
        watch_ended
    )  # + namespaces


async def test_per_canary_and_per_watch_detail_is_at_debug(kube, kubeconfig, capsys):
    for name in ("a", "b"):
        create_canary(kube, name)
    with json_logs("debug"):
        async with running_daemon(kube, kubeconfig, namespaces=frozenset({"default"})) as run:
            for name in ("a", "b"):
                await run.until_state(CanaryState.HEALTHY, name)
            failed_before = counter(metrics.BUMPS, "failed")
            await kube.refuse_connections()
            await run.until(
                lambda: counter(metrics.BUMPS, "failed") - failed_before >= 2,
                "a failed bump per canary",
                within=4 * CYCLE,
            )
            await kube.accept_connections()
            for name in ("a", "b"):
                await run.until_state(CanaryState.HEALTHY, name, within=6 * CYCLE)
            out = capsys.readouterr()
    records = json_lines(out.err + out.out)
    failed = {r["canary"] for r in records if r["event"] == "bump_failed"}
    assert failed == {"flinkdeployments/default/a", "flinkdeployments/default/b"}, failed
    assert all(r["level"] == "debug" for r in records if r["event"] == "bump_failed")
    states = [r for r in records if r["event"] == "canary_state" and r["state"] == "unknown"]
    assert {r["canary"] for r in states} == failed and all(r["level"] == "debug" for r in states)
    assert any(r["event"] == "watch_failed" and r["level"] == "debug" for r in records)


async def test_a_canary_turning_unhealthy_is_a_warning_with_its_name(kube, kubeconfig, capsys):
    """What stays at warning, per canary: the verdict an operator is paged for."""
    create_canary(kube)
    with json_logs("info"):
        async with running_daemon(kube, kubeconfig) as run:
            await run.until_state(CanaryState.HEALTHY)
            kube.hold_watch_events()
            await run.until_state(CanaryState.UNHEALTHY, within=4 * CYCLE)
            kube.release_watch_events()
            await run.until_state(CanaryState.HEALTHY, within=6 * CYCLE)
            out = capsys.readouterr()
    records = json_lines(out.err + out.out)
    unhealthy = [r for r in records if r["event"] == "canary_unhealthy"]
    assert unhealthy and unhealthy[0]["level"] == "warning"
    assert unhealthy[0]["canary"] == "flinkdeployments/default/canary"
    back = [r for r in records if r["event"] == "canary_state" and r["state"] == "healthy"]
    assert back and back[-1]["previous"] == "unhealthy" and back[-1]["level"] == "info"


BAD_REQUESTS = 300


async def _bad_request(port: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n")
    await writer.drain()
    await reader.read()  # aiohttp answers 400 and closes
    writer.close()
    await writer.wait_closed()


async def test_malformed_requests_to_the_health_port_are_counted_not_logged_each(
    kube, kubeconfig, capsys
):
    """Before: each one an ERROR with aiohttp's traceback (1,000 in 0.5 s: 690 KB)."""
    create_canary(kube)
    with json_logs("info"):
        async with running_daemon(kube, kubeconfig) as run:
            await run.until_state(CanaryState.HEALTHY)
            capsys.readouterr()
            before = counter(metrics.BAD_HTTP_REQUESTS)
            assert run.daemon.server is not None and run.daemon.server.port is not None
            port = run.daemon.server.port
            for _ in range(BAD_REQUESTS):
                await _bad_request(port)
            assert counter(metrics.BAD_HTTP_REQUESTS) - before == BAD_REQUESTS
            status, _ = await run.get("/healthz")
            assert status == 200
            out = capsys.readouterr()
    text = out.err + out.out
    assert "Traceback" not in text
    records = json_lines(text)
    bad = [r for r in records if r["event"] == "bad_http_requests"]
    # At most one line per cycle, and the burst took far less than a few cycles.
    assert 1 <= len(bad) <= 3, bad
    assert bad[0]["level"] == "warning" and "Content-Length" in bad[0]["error"]
    assert len(text) < 5_000, f"{len(text)} bytes of log for {BAD_REQUESTS} bad requests"
