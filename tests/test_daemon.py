"""The daemon beyond the semantics table: watch recovery, scopes, dynamic namespaces,
the HTTP interface, request economy, and the process itself."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from canaryd import metrics
from canaryd.config import Settings
from canaryd.kube import (
    MAX_WATCH_LINE,
    MERGE_PATCH,
    KubeError,
    connect,
    failure_cause,
    object_path,
)
from canaryd.registry import CanaryState
from canaryd.testing.apiserver import FLINK_DEPLOYMENTS, FakeKube, Fault
from tests.conftest import TOKEN
from tests.harness import (
    CYCLE,
    LABEL,
    blind_everywhere,
    counter,
    counting_client,
    create_canary,
    following,
    read_until,
    running_daemon,
    write_dynamic_config,
)
from tests.test_shipping import run_cli
from tests.test_startup import until_true

# ---------------------------------------------------------------- watching


async def test_410_relists_and_prunes_what_the_new_list_lacks(kube, kubeconfig):
    create_canary(kube, "a")
    create_canary(kube, "b")
    async with running_daemon(kube, kubeconfig, kinds=("flinkdeployments",)) as run:
        await run.until_tracked("a")
        await run.until_tracked("b")
        relists = counter(metrics.RELISTS, "flinkdeployments")

        def missed_while_disconnected() -> None:
            kube.delete(FLINK_DEPLOYMENTS, "default", "b")
            kube.compact()

        # While the watch is down, b goes and history is compacted: the re-watch gets
        # 410 Expired, and only a relist can notice that b is gone.
        kube.inject(
            Fault(
                verb="watch", resource="flinkdeployments", code=0, action=missed_while_disconnected
            )
        )
        kube.abort_watches()
        await run.until_gone("b")
        assert run.canary("a") is not None
        assert counter(metrics.RELISTS, "flinkdeployments") == relists + 1
        assert counter(metrics.DROPPED, "relisted") >= 1
        await run.until_state(CanaryState.HEALTHY, "a")


async def test_watch_resumes_from_the_last_resource_version_after_a_stream_ends(kube, kubeconfig):
    create_canary(kube)
    async with running_daemon(kube, kubeconfig, kinds=("flinkdeployments",)) as run:
        await run.until_state(CanaryState.HEALTHY)
        lists = len(kube.requests_for("list", "flinkdeployments"))
        kube.close_watches()
        await run.until(
            lambda: len(kube.requests_for("watch", "flinkdeployments")) >= 2, "a new watch"
        )
        rewatch = kube.requests_for("watch", "flinkdeployments")[-1]
        assert rewatch.query["resourceVersion"] not in ("", "0")
        assert rewatch.query["allowWatchBookmarks"] == "true"
        assert 300 <= int(rewatch.query["timeoutSeconds"]) <= 600  # client-go: 5 to 10 min
        assert len(kube.requests_for("list", "flinkdeployments")) == lists  # no relist
        await run.until_bumps(len(run.bumps()) + 2)
        assert run.tracked().state is CanaryState.HEALTHY


async def test_idle_watch_is_replaced(kube, kubeconfig):
    create_canary(kube)
    async with running_daemon(
        kube, kubeconfig, watch_idle_timeout=0.3, kinds=("flinkdeployments",)
    ) as run:
        await run.until_tracked()
        await run.until(
            lambda: any(w.rtype.plural == "flinkdeployments" for w in kube.watchers),
            "the watch to be open",
        )
        kube.bookmark_interval = 3600  # nothing more arrives on this stream
        before = counter(metrics.WATCH_RESTARTS, "flinkdeployments", "idle")
        kube.hold_watch_events()
        watches = len(kube.requests_for("watch", "flinkdeployments"))
        await run.until(
            lambda: len(kube.requests_for("watch", "flinkdeployments")) > watches,
            "the idle watch to be replaced",
        )
        assert counter(metrics.WATCH_RESTARTS, "flinkdeployments", "idle") > before
        kube.release_watch_events()


async def test_a_watch_line_past_the_limit_backs_off_and_is_no_drop(kube, kubeconfig):
    """An event too long to read (a proxy's garbage; a real API server stores objects
    of at most 1.5 MiB) is a failed watch, counted and backed off: the same line waits
    at the same resourceVersion. Counted as a dropped stream, it was resumed at once, and
    one that took long to read (more than short_watch) was met again and again."""
    create_canary(kube)
    async with running_daemon(kube, kubeconfig, kinds=("flinkdeployments",)) as run:
        await run.until_bumps(2)  # the watch stream has delivered
        errors = counter(metrics.WATCH_RESTARTS, "flinkdeployments", "error")
        dropped = counter(metrics.WATCH_RESTARTS, "flinkdeployments", "dropped")

        def enlarge(obj: dict[str, Any]) -> dict[str, Any]:
            obj["metadata"].setdefault("annotations", {})["big"] = "x" * (MAX_WATCH_LINE + 1)
            return obj

        kube.update(FLINK_DEPLOYMENTS, "default", "canary", enlarge, require_rv=False)
        await run.until(
            lambda: counter(metrics.WATCH_RESTARTS, "flinkdeployments", "error") > errors,
            "the over-long line to count as a failed watch",
        )
        assert counter(metrics.WATCH_RESTARTS, "flinkdeployments", "dropped") == dropped


async def test_flink_session_job_canary(kube, kubeconfig):
    create_canary(kube, "job", kind="flinksessionjobs")
    async with running_daemon(kube, kubeconfig) as run:
        await run.until_state(CanaryState.HEALTHY, "job", kind="flinksessionjobs")
        assert kube.requests_for("patch", "flinksessionjobs", "job")[0].path == (
            "/apis/flink.apache.org/v1beta1/namespaces/default/flinksessionjobs/job"
        )


@pytest.mark.parametrize("value", ["True", "TRUE", "tRuE"])
async def test_label_value_true_in_any_case_is_a_canary(kube, kubeconfig, value):
    create_canary(kube, value=value)
    create_canary(kube, "not-one", value="yes")
    async with running_daemon(kube, kubeconfig) as run:
        await run.until_state(CanaryState.HEALTHY)
        assert run.canary("not-one") is None
        assert not kube.requests_for("patch", name="not-one")


async def test_canary_deleted_after_its_finalizer_was_removed_is_dropped(kube, kubeconfig):
    """FLINK-41050's reproduction: remove the finalizer, delete; health stays 200."""
    create_canary(kube, metadata={"finalizers": ["flinkdeployments.flink.apache.org/finalizer"]})
    async with running_daemon(kube, kubeconfig) as run:
        await run.until_state(CanaryState.HEALTHY)
        kube.update(
            FLINK_DEPLOYMENTS,
            "default",
            "canary",
            lambda o: {**o, "metadata": {**o["metadata"], "finalizers": []}},
        )
        kube.delete(FLINK_DEPLOYMENTS, "default", "canary")
        await run.until_gone()
        writes = len(kube.requests_for("patch"))
        create_canary(kube, "other")
        await run.until_state(CanaryState.HEALTHY, "other")
        # Nothing written to it after the drop but, at most, the bump that was in flight
        # when it was deleted (DESIGN: its answer, a 404, changes nothing).
        late = [r for r in kube.requests_for("patch")[writes:] if r.name != "other"]
        assert len(late) <= 1 and all(r.status == 404 for r in late), late
        assert await run.get("/healthz") == (200, "OK")


async def test_a_missing_crd_is_skipped_with_a_warning(tmp_path, capsys):
    """A kind whose list answers 404 (confirmed: its group version does not serve it)
    is not served: its lists are retried, nothing else is sent for it, one warning."""
    from canaryd.testing.apiserver import FLINK_DEPLOYMENTS as FD
    from tests.harness import json_lines, json_logs

    kube = FakeKube(crds=[FD])
    async with kube.running():
        kube.create_namespace("default")
        create_canary(kube)
        config = kube.write_kubeconfig(tmp_path / "kubeconfig")
        with json_logs("info"):
            async with running_daemon(kube, config) as run:
                await run.until_state(CanaryState.HEALTHY)
                assert run.daemon.watcher is not None
                await run.until(
                    lambda: [k.plural for k in run.daemon.watcher.kinds] == ["flinkdeployments"],
                    "the 404 confirmed",
                )
                sent = [r for r in kube.requests if r.path.endswith("/flinksessionjobs")]
                assert sent and {(r.method, r.status) for r in sent} == {("GET", 404)}, sent
                assert "watch" not in {key for r in sent for key in r.query}, sent
    err = capsys.readouterr().err
    warned = [e for e in json_lines(err) if e["event"] == "kind_not_served"]
    assert len(warned) == 1, err  # once, not once a retry
    assert "flinksessionjobs.flink.apache.org is not served in flink.apache.org/v1beta1" in err


async def test_a_label_of_its_own_owns_only_those_canaries(kube, kubeconfig):
    create_canary(kube, "ours", metadata={"labels": {"example.com/canary": "True"}})
    create_canary(kube, "operators")  # flink.apache.org/canary: the operator's, not ours
    async with running_daemon(kube, kubeconfig, label="example.com/canary") as run:
        await run.until_state(CanaryState.HEALTHY, "ours")
        await run.until_bumps(2, "ours")
        assert run.canary("operators") is None
        assert not kube.requests_for("patch", name="operators")
        watch = kube.requests_for("watch", "flinkdeployments")[-1]
        assert watch.query["labelSelector"] == "example.com/canary"


async def test_a_crd_installed_or_removed_later_is_followed(tmp_path):
    from canaryd.testing.apiserver import FLINK_DEPLOYMENTS as FD
    from canaryd.testing.apiserver import FLINK_SESSION_JOBS as SJ

    kube = FakeKube(crds=[FD])
    async with kube.running():
        kube.create_namespace("default")
        config = kube.write_kubeconfig(tmp_path / "kubeconfig")
        async with running_daemon(kube, config, config_check_interval=0.2) as run:
            await run.until(lambda: run.daemon.watcher.ready, "readiness")
            kube.install_crd(SJ)
            create_canary(kube, "job", kind="flinksessionjobs")
            await run.until_state(CanaryState.HEALTHY, "job", kind="flinksessionjobs")
            kube.remove_crd("flinksessionjobs")
            await run.until_gone("job", kind="flinksessionjobs")
            await run.until(
                lambda: [k.plural for k in run.daemon.watcher.kinds] == ["flinkdeployments"],
                "the kind to be dropped",
            )


# ------------------------------------------------------- namespaces at runtime


async def test_namespace_removed_from_the_watched_list_at_runtime_is_dropped(
    kube, kubeconfig, tmp_path
):
    """FLINK-41050's reproduction: watchNamespaces [default, canary] -> [default] with
    dynamic namespaces; the Role in 'canary' is removed (403). Health stays 200."""
    kube.create_namespace("canary")
    create_canary(kube, namespace="canary")
    create_canary(kube, namespace="default")
    conf = tmp_path / "flink-conf.yaml"
    write_dynamic_config(conf, "default,canary")
    async with running_daemon(
        kube,
        kubeconfig,
        **following(conf, "default", "canary"),
    ) as run:
        await run.until_state(CanaryState.HEALTHY, namespace="canary")
        write_dynamic_config(conf, "default")
        kube.deny(namespace="canary")  # helm upgrade removed the Role there
        run.daemon.reload()  # what SIGHUP does; the check interval does the same
        await run.until_gone(namespace="canary")
        await run.until(
            lambda: not any(w.namespace == "canary" for w in kube.watchers),
            "the canary namespace's watches to stop",
        )
        writes = len(kube.requests_for("patch"))
        await run.until_bumps(len(run.bumps()) + 2)
        assert all(r.namespace == "default" for r in kube.requests_for("patch")[writes:])
        assert await run.get("/healthz") == (200, "OK")
        # And back: the namespace is watched again once the file says so.
        kube.rbac_denies.clear()
        write_dynamic_config(conf, "default,canary")
        run.daemon.reload()
        await run.until_state(CanaryState.HEALTHY, namespace="canary")


async def test_the_operator_config_is_re_read_every_check_interval(kube, kubeconfig, tmp_path):
    kube.create_namespace("canary")
    create_canary(kube, namespace="canary")
    conf = tmp_path / "config.yaml"
    conf.write_text(
        "kubernetes:\n  operator:\n    watched:\n      namespaces: canary\n"
        "    dynamic:\n      namespaces:\n        enabled: true\n"
    )
    async with running_daemon(
        kube,
        kubeconfig,
        **following(conf, "canary"),
        config_check_interval=0.2,
    ) as run:
        await run.until_tracked(namespace="canary")
        conf.write_text(conf.read_text().replace("namespaces: canary", "namespaces: default"))
        await run.until_gone(namespace="canary")  # no SIGHUP: the interval did it
        assert run.daemon.watcher.namespaces == frozenset({"default"})


async def test_a_re_read_logs_each_setting_the_file_changed(kube, kubeconfig, tmp_path, capsys):
    """Issue 42: a SIGHUP that changed the cycle logged nothing. Each setting the file
    decides and changed is logged once (old -> new), and whether it applies now (the
    followed namespaces) or at a restart."""
    from tests.harness import json_lines, json_logs

    kube.create_namespace("canary")
    create_canary(kube, namespace="canary")
    conf = tmp_path / "flink-conf.yaml"
    write_dynamic_config(conf, "canary")
    settings = {**following(conf, "canary"), "from_file": frozenset({"namespaces", "timeout"})}
    with json_logs("info"):
        async with running_daemon(kube, kubeconfig, **settings) as run:
            await run.until_tracked(namespace="canary")
            write_dynamic_config(conf, "canary,default")
            with conf.open("a") as file:
                file.write("kubernetes.operator.health.canary.resource.timeout: 2 min\n")

            def reads() -> float:
                return sum(counter(metrics.CONFIG_RELOADS, r) for r in ("changed", "unchanged"))

            for _ in range(2):  # the second read changes nothing and says nothing
                before = reads()
                run.daemon.reload()  # SIGHUP
                await run.until(lambda before=before: reads() > before, "the re-read")
            assert run.daemon.watcher.namespaces == frozenset({"canary", "default"})
    changed = [
        (r["setting"], r["was"], r["now"], r["applied"])
        for r in json_lines(capsys.readouterr().err)
        if r["event"] == "operator_config_changed"
    ]
    assert sorted(changed) == [
        ("namespaces", ["canary"], ["canary", "default"], "now"),
        ("timeout", CYCLE, 120.0, "at a restart"),
    ], changed


async def test_unreadable_operator_config_at_runtime_keeps_the_namespaces(
    kube, kubeconfig, tmp_path
):
    create_canary(kube)
    conf = tmp_path / "flink-conf.yaml"
    conf.write_text("kubernetes.operator.watched.namespaces: default\n")
    async with running_daemon(
        kube,
        kubeconfig,
        **following(conf, "default"),
    ) as run:
        await run.until_state(CanaryState.HEALTHY)
        failed = counter(metrics.CONFIG_RELOADS, "failed")
        conf.write_text("kubernetes.operator.watched.namespaces: [unclosed\n")
        run.daemon.reload()
        await run.until(
            lambda: counter(metrics.CONFIG_RELOADS, "failed") > failed, "the failed reload"
        )
        assert run.daemon.watcher.namespaces == frozenset({"default"})
        assert run.canary() is not None


async def test_watch_forbidden_in_a_namespace_drops_its_canaries_and_stays_ready(kube, kubeconfig):
    kube.create_namespace("other")
    create_canary(kube, namespace="other")
    create_canary(kube)
    kube.deny(verb="list", resource="flinkdeployments", namespace="other")
    async with running_daemon(kube, kubeconfig, namespaces=frozenset({"default", "other"})) as run:
        await run.until_state(CanaryState.HEALTHY)
        assert run.canary(namespace="other") is None
        await run.until(lambda: run.daemon.watcher.ready, "readiness")
        assert (await run.get("/readyz"))[0] == 200


async def test_namespaces_not_watchable_still_checks_canaries(kube, kubeconfig):
    kube.deny(resource="namespaces")
    create_canary(kube)
    async with running_daemon(kube, kubeconfig) as run:
        await run.until_state(CanaryState.HEALTHY)
        await run.until(lambda: run.daemon.watcher.ready, "readiness")


# ------------------------------------------------------------------- HTTP


async def test_health_endpoints_text_verbose_and_json(kube, kubeconfig):
    create_canary(kube, "a")
    create_canary(kube, "b", kind="flinksessionjobs")
    async with running_daemon(kube, kubeconfig) as run:
        await run.until_state(CanaryState.HEALTHY, "a")
        await run.until_state(CanaryState.HEALTHY, "b", kind="flinksessionjobs")
        for path in ("/healthz", "/livez", "/"):
            assert await run.get(path) == (200, "OK")
            async with run.http.get(run.url + path) as response:
                assert response.content_type == "text/plain"  # as upstream
        status, text = await run.get("/healthz?verbose")
        lines = text.strip().splitlines()
        assert status == 200 and lines[0] == "OK"
        assert lines[1].startswith("healthy FlinkDeployment default/a: ")
        assert lines[2].startswith("healthy FlinkSessionJob default/b: ")
        status, body = await run.get("/healthz", Accept="application/json")
        doc = json.loads(body)
        assert status == 200 and doc["healthy"] is True
        first = doc["canaries"][0]
        assert set(first) == {
            "kind",
            "namespace",
            "name",
            "state",
            "reason",
            "bumpedGeneration",
            "observedGeneration",
            "lastBumpAt",
            "judgedGeneration",
            "pendingGeneration",
            "statusObservedGeneration",
            "bumpSeconds",
        }
        assert first["kind"] == "FlinkDeployment" and first["state"] == "healthy"
        assert first["observedGeneration"] >= first["bumpedGeneration"] - 1
        assert first["lastBumpAt"].endswith("Z")
        kube.hold_watch_events()
        await run.until_state(CanaryState.UNHEALTHY, "a")
        status, body = await run.get("/", Accept="application/json")
        assert status == 500 and json.loads(body)["healthy"] is False
        # /livez is canaryd's own process: a stuck watch path is no reason to restart it.
        assert await run.get("/livez") == (200, "OK")
        kube.release_watch_events()


async def test_livez_fails_only_when_canaryd_itself_is_stuck(kube, kubeconfig, monkeypatch):
    """A liveness probe on /livez restarts canaryd for canaryd's own faults (a task that
    ended, a scheduler a cycle behind its deadlines: what the systemd watchdog reads),
    never for a verdict."""
    create_canary(kube)
    async with running_daemon(kube, kubeconfig) as run:
        await run.until_state(CanaryState.HEALTHY)
        assert await run.get("/livez") == (200, "OK")
        scheduler = run.daemon.scheduler
        monkeypatch.setattr(scheduler, "lag", lambda: 2 * run.daemon.settings.timeout)
        status, text = await run.get("/livez")
        assert status == 500 and "behind its deadlines" in text, (status, text)
        assert await run.get("/healthz") == (200, "OK")  # the verdict is another matter
        monkeypatch.undo()
        assert await run.get("/livez") == (200, "OK")


async def test_readyz_waits_for_every_initial_list(kube, kubeconfig):
    create_canary(kube)
    gate = kube.inject(Fault(verb="list", resource="flinksessionjobs", code=503, times=-1))
    async with running_daemon(kube, kubeconfig) as run:
        await run.until_tracked()
        await run.until(lambda: gate.hits >= 2, "the list to fail twice")
        assert (await run.get("/readyz"))[0] == 503
        kube.faults.remove(gate)
        await run.until(lambda: run.daemon.watcher.ready, "readiness")
        assert await run.get("/readyz") == (200, "OK")


async def test_metrics_endpoint(kube, kubeconfig):
    create_canary(kube)
    async with running_daemon(kube, kubeconfig) as run:
        await run.until_state(CanaryState.HEALTHY)
        await run.until_bumps(2)
        status, text = await run.get("/metrics")
        assert status == 200
        assert 'canaryd_canaries{state="healthy"} 1.0' in text
        assert 'canaryd_bumps_total{result="written"}' in text
        assert 'canaryd_api_requests_total{code="200",verb="patch"}' in text
        assert "canaryd_verdict_lateness_seconds_bucket" in text
        assert "canaryd_relists_total" in text and "canaryd_watch_restarts_total" in text


async def test_only_the_listed_endpoints_exist(kube, kubeconfig):
    async with running_daemon(kube, kubeconfig) as run:
        assert (await run.get("/admin"))[0] == 404
        async with run.http.post(run.url + "/healthz", data=b"x") as response:
            assert response.status == 405
        async with run.http.head(run.url + "/healthz") as response:
            assert response.status == 200


# --------------------------------------------------------- request economy


async def test_steady_state_costs_one_patch_per_canary_per_cycle(kube, kubeconfig):
    for i in range(5):
        create_canary(kube, f"c{i}")
    async with running_daemon(kube, kubeconfig, timeout=0.2) as run:
        for i in range(5):
            await run.until_state(CanaryState.HEALTHY, f"c{i}")
        start = len(kube.requests)
        await run.until(
            lambda: all(len(run.bumps(f"c{i}")) >= 6 for i in range(5)), "five more cycles"
        )
        window = kube.requests[start:]
        verbs = {v: sum(1 for r in window if r.verb == v) for v in ("patch", "get", "list")}
        assert verbs["get"] == 0 and verbs["list"] == 0
        assert all(r.status == 200 for r in window if r.verb == "patch")


async def test_a_concurrent_writer_costs_at_most_three_requests_per_bump(kube, kubeconfig):
    create_canary(kube)
    async with running_daemon(kube, kubeconfig) as run:
        await run.until_state(CanaryState.HEALTHY)
        n = iter(range(10**6))
        kube.inject(
            Fault(
                verb="patch",
                code=0,
                times=5,
                action=lambda: kube.update(
                    FLINK_DEPLOYMENTS,
                    "default",
                    "canary",
                    lambda o: {
                        **o,
                        "metadata": {**o["metadata"], "annotations": {"writer": str(next(n))}},
                    },
                ),
            )
        )
        start, bumps = len(kube.requests), len(run.bumps())
        await run.until_bumps(bumps + 5)
        window = [r for r in kube.requests[start:] if r.verb in ("patch", "get")]
        written = sum(1 for r in window if r.verb == "patch" and r.status == 200)
        assert len(window) / written <= 3


async def test_first_bumps_are_spread_over_the_cycle(kube, kubeconfig):
    for i in range(20):
        create_canary(kube, f"c{i:02}")
    async with running_daemon(kube, kubeconfig, timeout=1.0) as run:
        await run.until(
            lambda: (
                len(kube.requests_for("patch")) >= 20
                and len({r.name for r in kube.requests_for("patch")}) == 20
            ),
            "a bump of each",
        )
        firsts = sorted(
            min(r.at for r in kube.requests_for("patch", name=f"c{i:02}")) for i in range(20)
        )
        assert firsts[-1] - firsts[0] >= 0.5  # not 20 writes at once
        gaps = [b - a for a, b in itertools.pairwise(firsts)]
        assert max(gaps) < 0.5


# ------------------------------------------------------------- the process


async def start_process(kubeconfig: Path, *args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "canaryd",
        "--kubeconfig",
        str(kubeconfig),
        "--port",
        "0",
        "--host",
        "127.0.0.1",
        "--timeout",
        "300ms",
        "--log-level",
        "debug",
        *args,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


async def test_sigterm_stops_cleanly_with_exit_0_and_json_logs(kube, kubeconfig):
    create_canary(kube)
    proc = await start_process(kubeconfig)
    lines: list[str] = []
    await read_until(proc, '"canary_state"', lines)
    proc.send_signal(signal.SIGTERM)
    async with asyncio.timeout(5):
        await proc.communicate()
    assert proc.returncode == 0
    records = [json.loads(line) for line in lines if line.startswith("{")]
    assert records and all("event" in r and "level" in r and "timestamp" in r for r in records)
    assert any(r["event"] == "canary_state" and r["state"] == "healthy" for r in records)


async def test_sighup_reloads_and_sigint_stops(kube, kubeconfig, tmp_path):
    kube.create_namespace("canary")
    create_canary(kube, namespace="canary")
    conf = tmp_path / "flink-conf.yaml"
    write_dynamic_config(conf, "canary")
    proc = await start_process(kubeconfig, "--operator-config", str(conf))
    lines: list[str] = []
    await read_until(proc, '"canary_state"', lines)
    write_dynamic_config(conf, "default")
    proc.send_signal(signal.SIGHUP)
    await read_until(proc, '"canary_dropped"', lines)
    proc.send_signal(signal.SIGINT)
    async with asyncio.timeout(5):
        await proc.communicate()
    assert proc.returncode == 0


async def test_the_bearer_token_never_appears_in_logs(kube, kubeconfig):
    create_canary(kube)
    kube.inject(Fault(verb="patch", code=401, times=1))
    kube.inject(Fault(verb="list", code=500, times=1, message=f"echo Bearer {TOKEN}"))
    proc = await start_process(kubeconfig)
    lines: list[str] = []
    await read_until(proc, '"canary_state"', lines)
    proc.send_signal(signal.SIGTERM)
    async with asyncio.timeout(5):
        _, rest = await proc.communicate()
    output = "".join(lines) + rest.decode()
    assert TOKEN not in output
    assert "[REDACTED]" in output  # the echoed token was there, masked
    assert LABEL in output


async def test_a_rotated_token_is_picked_up_from_the_kubeconfig_on_401(kube, kubeconfig):
    create_canary(kube)
    async with running_daemon(kube, kubeconfig) as run:
        await run.until_state(CanaryState.HEALTHY)
        kube.token = "rotated-token-0987654321"  # the old one is now refused
        kube.write_kubeconfig(kubeconfig)
        before = len(run.bumps())
        await run.until_bumps(before + 2)
        assert any(r.status == 401 for r in kube.requests_for("patch"))
        await run.until_state(CanaryState.HEALTHY)
        # A watch that meets the new token also reloads before it retries (no canary
        # left: no bump reloads the credentials for it).
        kube.delete(FLINK_DEPLOYMENTS, "default", "canary")
        await run.until_gone()
        kube.token = "rotated-again-1122334455"
        kube.write_kubeconfig(kubeconfig)
        kube.close_watches()
        await run.until(
            lambda: any(r.verb == "watch" and r.status == 401 for r in kube.requests),
            "a watch refused",
        )
        await run.until(lambda: len(kube.watchers) == 3, "all three watches open again")


async def test_sighup_without_a_followed_operator_config_is_ignored_and_logged(
    kube, kubeconfig, capsys
):
    create_canary(kube)
    async with running_daemon(kube, kubeconfig) as run:
        await run.until_state(CanaryState.HEALTHY)
        run.daemon.reload()
        await run.until_bumps(len(run.bumps()) + 1)
        assert run.tracked().state is CanaryState.HEALTHY
    assert "sighup_ignored" in capsys.readouterr().err


async def test_a_released_watch_backlog_does_not_make_bumps_conflict(kube, kubeconfig):
    """Older copies replayed by a watch that catches up must not replace the newer
    resourceVersion canaryd got from its own writes: no 409 storm after recovery."""
    for i in range(5):
        create_canary(kube, f"c{i}")
    async with running_daemon(kube, kubeconfig, kinds=("flinkdeployments",)) as run:
        for i in range(5):
            await run.until_state(CanaryState.HEALTHY, f"c{i}")
        kube.hold_watch_events()
        for i in range(5):
            await run.until_state(CanaryState.UNHEALTHY, f"c{i}")
        released_at = len(kube.requests)
        kube.release_watch_events()
        for i in range(5):
            await run.until_state(CanaryState.HEALTHY, f"c{i}")
        await run.until(
            lambda: all(
                sum(
                    1
                    for r in kube.requests[released_at:]
                    if r.verb == "patch" and r.name == f"c{i}" and r.status == 200
                )
                >= 2
                for i in range(5)
            ),
            "two more bumps of each",
        )
        after = kube.requests[released_at:]
        assert [r.name for r in after if r.verb == "patch" and r.status == 409] == []
        assert [r.name for r in after if r.verb == "get"] == []


async def test_a_scope_not_listed_yet_after_a_namespace_switch_defers_the_verdict(
    kube, kubeconfig, tmp_path
):
    """All namespaces -> one, with dynamic namespaces: the canary stays tracked while the
    replacement scope's first list fails. That scope is not in sync (canaryd.sync), so
    the bump it could not deliver waits for it instead of turning unhealthy."""
    create_canary(kube)
    conf = tmp_path / "flink-conf.yaml"
    write_dynamic_config(conf, "JOSDK_ALL_NAMESPACES")
    settings = {**following(conf), "namespaces": None}
    async with running_daemon(kube, kubeconfig, **settings) as run:
        canary = await run.until_state(CanaryState.HEALTHY)
        statuses: list[int] = []
        stop = asyncio.Event()

        async def poll() -> None:
            while not stop.is_set():
                statuses.append((await run.get("/healthz"))[0])
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.02)

        poller = asyncio.create_task(poll())
        failing = kube.inject(
            Fault(verb="list", resource="flinkdeployments", namespace="default", times=-1)
        )
        write_dynamic_config(conf, "default")
        run.daemon.reload()
        await run.until(
            lambda: canary.deferred_until is not None, "the verdict to wait for the new scope"
        )
        assert run.canary() is canary and canary.state is not CanaryState.UNHEALTHY
        assert "flinkdeployments@default" in (await run.get("/readyz"))[1]
        kube.faults.remove(failing)
        await run.until(
            lambda: canary.state is CanaryState.HEALTHY and canary.deferred_until is None,
            "a verdict once the new scope listed",
        )
        stop.set()
        await poller
        assert set(statuses) == {200}, statuses


EXEC_PLUGIN = """\
import datetime, json, os, pathlib, subprocess, sys
here = pathlib.Path(sys.argv[1])
runs = here / "runs"
# Counted atomically: the test reads the count while the plugin may be running.
(here / "runs.new").write_text(str(int(runs.read_text() or 0) + 1) if runs.exists() else "1")
os.replace(here / "runs.new", runs)
if (here / "fail").exists():
    sys.exit("the identity provider is down")
if (here / "hang").exists():  # hung, with a child of its own (a shell plugin's command)
    child = subprocess.Popen(["sleep", "3600"])
    (here / "hung.new").write_text(f"{os.getpid()} {child.pid}")
    os.replace(here / "hung.new", here / "hung")
    child.wait()
lifetime = float((here / "lifetime").read_text())
expiry = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=lifetime)
print(json.dumps({
    "apiVersion": "client.authentication.k8s.io/v1",
    "kind": "ExecCredential",
    "status": {
        "token": (here / "token").read_text().strip(),
        "expirationTimestamp": expiry.strftime("%Y-%m-%dT%H:%M:%SZ"),
    },
}))
"""


def exec_kubeconfig(kube: FakeKube, tmp_path: Path, token: str, lifetime: float) -> Path:
    """A kubeconfig whose credentials come from an exec plugin (EKS, GKE, OIDC helpers)
    that counts its runs."""
    (tmp_path / "plugin.py").write_text(EXEC_PLUGIN)
    (tmp_path / "token").write_text(token)
    (tmp_path / "lifetime").write_text(str(lifetime))
    config = kube.kubeconfig()
    config["users"][0]["user"] = {
        "exec": {
            "apiVersion": "client.authentication.k8s.io/v1",
            "command": sys.executable,
            "args": [str(tmp_path / "plugin.py"), str(tmp_path)],
            "interactiveMode": "Never",
        }
    }
    path = tmp_path / "exec.kubeconfig"
    path.write_text(yaml.safe_dump(config))
    return path


EXEC_CYCLE = 2.0
"""The cycle of the daemons on an exec plugin: a run of it (a Python process, 0.2-0.4 s
on a loaded machine) must end within its call's time limit, half the cycle."""


def plugin_runs(tmp_path: Path) -> int:
    return int((tmp_path / "runs").read_text())


@pytest.mark.slow
async def test_exec_credentials_are_renewed_before_they_expire(kube, tmp_path):
    """An exec plugin's token says when it expires: canaryd runs the plugin again at 80 %
    of its lifetime, so no request is ever refused for an expired token."""
    create_canary(kube)
    kubeconfig = exec_kubeconfig(kube, tmp_path, TOKEN, lifetime=2.0)
    async with running_daemon(kube, kubeconfig, timeout=EXEC_CYCLE) as run:
        await run.until_state(CanaryState.HEALTHY, within=3 * EXEC_CYCLE)
        runs = plugin_runs(tmp_path)
        await run.until(lambda: plugin_runs(tmp_path) >= runs + 2, "two renewals", within=10)
        assert not [r for r in kube.requests if r.status == 401]


@contextlib.asynccontextmanager
async def thirty_canaries_on_an_exec_plugin(
    kube: FakeKube, tmp_path: Path
) -> AsyncIterator[tuple[Any, list[str], int]]:
    """A daemon whose credentials come from an exec plugin, each of 30 canaries bumped;
    yields the run, the names and the plugin's runs so far."""
    names = [f"c-{n:02}" for n in range(30)]
    for name in names:
        create_canary(kube, name)
    kubeconfig = exec_kubeconfig(kube, tmp_path, TOKEN, lifetime=3600)
    async with running_daemon(kube, kubeconfig, timeout=EXEC_CYCLE) as run:
        await run.until(
            lambda: all(run.bumps(n) for n in names), "every canary bumped", 3 * EXEC_CYCLE
        )
        yield run, names, plugin_runs(tmp_path)


@pytest.mark.slow
async def test_many_requests_refused_at_once_make_one_reload(kube, tmp_path):
    """Every bump in flight refused at once (a revoked token): one run of the plugin
    answers them all (before: one reload per refused request). The fake holds the next
    four PATCHes together and answers each 401, so that they are refused at once however
    the scheduler spreads its bumps."""
    async with thirty_canaries_on_an_exec_plugin(kube, tmp_path) as (run, names, runs):
        written = len([r for r in kube.requests_for("patch") if r.status == 200])
        refusal = kube.inject(
            Fault(verb="patch", code=401, latency=EXEC_CYCLE / 4, times=4, message="Unauthorized")
        )
        await run.until(
            lambda: (
                len([r for r in kube.requests_for("patch") if r.status == 200])
                >= written + len(names)
            ),
            "a cycle of bumps after the refusals",
            3 * EXEC_CYCLE,
        )
        refused = len([r for r in kube.requests if r.status == 401])
        assert refusal.hits == 4 and refused == 4, (refusal.hits, refused)
        assert plugin_runs(tmp_path) - runs <= 2, (plugin_runs(tmp_path) - runs, refused)


async def test_watches_refused_401_run_the_credential_plugin_on_the_reload_backoff(kube, tmp_path):
    """A revoked token the exec plugin keeps returning, while 41 scopes retry their
    watches (no canary: no request but the watches): the plugin runs on the reload
    backoff (1 s doubling, ±20 %), not once per refused watch."""
    namespaces = frozenset(f"team-{n:02}" for n in range(40))
    for namespace in namespaces:
        kube.create_namespace(namespace)
    kubeconfig = exec_kubeconfig(kube, tmp_path, TOKEN, lifetime=3600)
    async with running_daemon(
        kube, kubeconfig, timeout=EXEC_CYCLE, namespaces=namespaces, kinds=("flinkdeployments",)
    ) as run:
        await run.until(lambda: len(kube.watchers) > len(namespaces), "every scope watching")
        runs, loop = plugin_runs(tmp_path), asyncio.get_running_loop()
        start = loop.time()
        kube.token = "revoked-0123456789"
        kube.close_watches()
        refused = lambda: len([r for r in kube.requests_for("watch") if r.status == 401])  # noqa: E731
        await run.until(
            lambda: refused() >= 8 * len(namespaces), "each scope's watch refused 8 times", 15
        )
        window = loop.time() - start
        # Reloads at most 0.8 s, 0.8 + 1.6 s, ... apart after the first.
        bound = 1 + int(math.log2(window / 0.8 + 1))
        assert plugin_runs(tmp_path) - runs <= bound, (plugin_runs(tmp_path) - runs, window)


async def test_a_watch_refused_after_a_reload_steps_the_backoff_and_one_answered_resets_it(
    kube, tmp_path, monkeypatch
):
    """A watch refused again after a reload backs the next reload off (1 s); one
    answered 200 resets the backoff: its next step is 1 s again, not 2 s."""
    client, reloads = await counting_client(kube, tmp_path, monkeypatch)

    async def watch() -> int | None:
        try:
            async for _ in client.watch("/api/v1/namespaces", {}, idle_timeout=5.0):
                return 200  # the namespace's ADDED
        except KubeError as err:
            return err.status
        return None

    try:
        kube.inject(Fault(verb="watch", code=401, times=3))
        assert [await watch(), await watch(), await watch()] == [401, 401, 401]
        assert len(reloads) == 1  # refused again after it: backing off, not reloading
        assert client.credentials._backoff._next == 2.0
        assert await watch() == 200
        assert client.credentials._backoff._next == 1.0
    finally:
        await client.close()


async def test_a_canaryd_that_checks_nothing_says_so(kube, kubeconfig, capsys):
    """A namespace that does not exist, a kind that is not served and a namespace whose
    RBAC answers 403, and so no canary: /healthz stays upstream's 200 (no canaries), but
    canaryd_blind (one reason each), the scope gauge, /readyz's body (still 200),
    /healthz?verbose and one warning say what is not checked."""
    from tests.harness import json_lines, json_logs

    kube.create_namespace("locked")
    kube.deny(namespace="locked")
    with json_logs("info"):
        async with running_daemon(
            kube,
            kubeconfig,
            namespaces=frozenset({"does-not-exist", "locked"}),
            kinds=("flinkdeployments", "widgets.example.com/v1"),
        ) as run:
            watcher = run.daemon.watcher
            await blind_everywhere(
                run, "list_forbidden", "namespace_missing", "kind_not_served", "no_canaries"
            )
            coverage = watcher.coverage()
            assert coverage["kind_not_served"] == 2  # a kind x two namespaces
            # flinkdeployments@does-not-exist lists (an empty 200) but counts as missing
            # only: each of the 2 x 2 wanted scopes once.
            assert coverage["listed"] == 0
            assert sum(coverage.values()) == 4, coverage
            status, text = await run.get("/readyz")
            assert status == 200, text
            assert "blind list_forbidden: flinkdeployments@locked" in text
            assert "blind namespace_missing: does-not-exist" in text
            assert "blind kind_not_served: widgets.example.com/v1" in text
            label = "flink.apache.org/canary"
            assert f"blind no_canaries: no flinkdeployments labelled {label}=true in " in text
            _, scraped = await run.get("/metrics")
            assert 'canaryd_watch_scopes{state="forbidden"} 1.0' in scraped
            assert 'canaryd_watch_scopes{state="kind_not_served"} 2.0' in scraped
            # A canary matched: no longer blind for want of one.
            kube.create_namespace("does-not-exist")
            create_canary(kube, namespace="does-not-exist")
            await blind_everywhere(run, "list_forbidden", "kind_not_served")
    warned = [r for r in json_lines(capsys.readouterr().err) if r.get("event") == "not_checked"]
    assert warned and warned[-1]["level"] == "warning", warned
    assert len(warned) <= 4, warned  # once per change, not per scope or per retry


async def test_a_label_no_canary_carries_is_blind_no_canaries(kube, kubeconfig):
    """A wrong --label: every scope lists, nothing matches: blind at once, not only an
    alert ten minutes later."""
    create_canary(kube)  # flink.apache.org/canary
    async with running_daemon(kube, kubeconfig, label="example.com/canary") as run:
        ready = await blind_everywhere(run, "no_canaries")
        assert ready.startswith("OK\nblind no_canaries: no flinkdeployments/flinksessionjobs ")
        assert "labelled example.com/canary=true in any namespace" in ready, ready


async def test_lists_refused_401_are_blind_unauthorized(kube, kubeconfig):
    """Credentials refused on every request (401, also after a reload): /readyz 503
    (nothing is listed) and canaryd_blind{reason="unauthorized"}, named in its body."""
    create_canary(kube)
    config = yaml.safe_load(kubeconfig.read_text())
    config["users"][0]["user"]["token"] = "wrong-token-0123456789"
    kubeconfig.write_text(yaml.safe_dump(config))
    async with running_daemon(kube, kubeconfig) as run:
        ready = await blind_everywhere(run, "unauthorized")
        assert ready.startswith("NOT READY: not listed or not connected: "), ready
        assert "(unauthorized: 401" in ready, ready
        assert "\nblind unauthorized: flinkdeployments, flinksessionjobs, namespaces" in ready


async def test_a_token_revoked_while_running_is_blind_unauthorized_on_the_scopes(kube, kubeconfig):
    """The scopes' lists refused 401 after a start that worked: each scope is named."""
    create_canary(kube)
    async with running_daemon(kube, kubeconfig, kinds=("flinkdeployments",)) as run:
        await run.until_tracked()
        kube.token = "revoked-0123456789"
        kube.close_watches()
        ready = await blind_everywhere(run, "unauthorized")
        assert "blind unauthorized: flinkdeployments, namespaces" in ready, ready


async def test_a_missing_patch_permission_is_said_at_start_not_only_by_unknown_canaries(
    kube, kubeconfig, capsys
):
    """Issue 33: with patch refused in one watched namespace (list and watch granted),
    the first bumps' 403s there say so in /readyz's body, the scope gauge
    (patch_forbidden) and one warning, while the other namespace is listed (the daemon
    asks no access review: issue 44)."""
    from tests.harness import json_lines, json_logs

    for namespace in ("team-a", "team-b"):
        kube.create_namespace(namespace)
        create_canary(kube, namespace=namespace)
    kube.deny(verb="patch", resource="flinkdeployments", namespace="team-b")
    with json_logs("info"):
        async with running_daemon(
            kube,
            kubeconfig,
            namespaces=frozenset({"team-a", "team-b"}),
            kinds=("flinkdeployments",),
        ) as run:
            watcher = run.daemon.watcher
            assert watcher is not None
            await run.until(
                lambda: watcher.coverage()["patch_forbidden"] == 1, "the first bumps' 403s"
            )
            coverage = watcher.coverage()
            assert coverage["listed"] == 1 and sum(coverage.values()) == 2, coverage
            text = await blind_everywhere(run, "patch_forbidden")
            assert text.startswith("OK\n"), text  # a sidecar's readiness must not take the pod out
            assert "blind patch_forbidden: flinkdeployments@team-b" in text, text
            _, scraped = await run.get("/metrics")
            assert 'canaryd_watch_scopes{state="patch_forbidden"} 1.0' in scraped
            await run.until(lambda: bool(watcher.uncovered), "the warning (within a cycle)")
    warned = [r for r in json_lines(capsys.readouterr().err) if r.get("event") == "not_checked"]
    assert warned and "patch_forbidden: flinkdeployments@team-b" in warned[-1]["what"], warned
    assert kube.requests_for("create", "selfsubjectaccessreviews") == []


async def test_a_failing_credential_plugin_is_run_once_for_all_and_backed_off(kube, tmp_path):
    """The token is revoked and the plugin that would renew it fails: every refused
    request at that moment shares one run of it (not one each, in a row behind a
    lock), and the next tries back off."""
    async with thirty_canaries_on_an_exec_plugin(kube, tmp_path) as (run, names, runs):
        (tmp_path / "fail").write_text("1")
        kube.token = "revoked-and-not-renewed-123"
        await run.until(
            lambda: len([r for r in kube.requests if r.status == 401]) >= len(names),
            "a cycle of refused bumps",
            within=3 * EXEC_CYCLE,
        )
        assert run.daemon.watcher is not None
        assert plugin_runs(tmp_path) - runs <= 3, plugin_runs(tmp_path) - runs


def running(pid: int) -> bool:
    """Whether a process is there and not a zombie (ended, not yet reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def reaped(pid: int) -> bool:
    """Whether a process is gone, its exit status collected: no zombie left."""
    return not Path(f"/proc/{pid}").exists()


@contextlib.contextmanager
def hung_plugin(tmp_path: Path) -> Iterator[Callable[[], list[int]]]:
    """The exec plugin hangs from here (the token it would renew is revoked); yields
    what it wrote once hung: its pid and its child's. Whatever the test leaves of them
    is killed at the end."""
    (tmp_path / "hang").write_text("1")
    hung = tmp_path / "hung"
    pids = lambda: [int(pid) for pid in hung.read_text().split()] if hung.exists() else []  # noqa: E731
    try:
        yield pids
    finally:
        for pid in pids():
            if running(pid):
                os.kill(pid, signal.SIGKILL)


async def test_a_hung_credential_plugin_ends_with_the_request_that_ran_it(kube, tmp_path):
    """Issue 42: a PATCH refused (401) reloads the credentials and the exec plugin hangs:
    the PATCH ends within its time limit as unauthorised, the plugin is killed and
    reaped, its child killed too (before: the PATCH waited on the plugin for good)."""
    create_canary(kube)
    config = exec_kubeconfig(kube, tmp_path, TOKEN, lifetime=3600)
    client = await connect(Settings(kubeconfig=str(config)))
    limit = 3.0
    with hung_plugin(tmp_path) as pids:
        kube.token = "revoked-and-not-renewed-123"
        started = asyncio.get_running_loop().time()
        patch = asyncio.create_task(
            client.request(
                "patch",
                "PATCH",
                object_path("flinkdeployments", "default", "canary"),
                body={"spec": {"restartNonce": 1}},
                content_type=MERGE_PATCH,
                time_limit=limit,
            )
        )
        try:
            await until_true(lambda: bool(pids()) or patch.done(), "the plugin to hang")
            assert pids(), "the plugin did not start within the PATCH's time limit"
            plugin, child = pids()
            done, _ = await asyncio.wait({patch}, timeout=limit + 5)
            assert done, "the PATCH outlived its time limit: it waits on the hung plugin"
            elapsed = asyncio.get_running_loop().time() - started
            assert elapsed < limit + 1, elapsed
            error = patch.exception()
            assert isinstance(error, KubeError) and failure_cause(error) == "unauthorized", error
            assert "reloading the credentials took the call's time" in str(error), error
            assert reaped(plugin), "the plugin was not reaped"
            await until_true(lambda: not running(child), "the plugin's child to be killed")
        finally:
            patch.cancel()
            await client.close()


@pytest.mark.slow
async def test_sigterm_while_a_credential_plugin_hangs_exits_0_in_time(kube, tmp_path):
    """Issue 42: bumps refused and the plugin that would renew the token hung: SIGTERM
    stops canaryd within its write timeout (1 s on a 2 s cycle), exit 0, and the plugin
    is gone (before: canaryd waited on the plugin for good)."""
    create_canary(kube)
    config = exec_kubeconfig(kube, tmp_path, TOKEN, lifetime=3600)
    proc = await start_process(config, "--timeout", "2s")
    output = asyncio.ensure_future(proc.communicate())  # read all along: never a full pipe
    try:
        patches = lambda status: [r for r in kube.requests_for("patch") if r.status == status]  # noqa: E731
        await until_true(lambda: bool(patches(200)), "a bump", within=20)
        with hung_plugin(tmp_path) as pids:
            kube.token = "revoked-and-not-renewed-123"
            await until_true(lambda: bool(pids() and patches(401)), "a refused bump", within=20)
            await stopped_with_its_plugin(proc, output, pids, within=8)
    finally:
        if proc.returncode is None:
            proc.kill()
        await output


async def stopped_with_its_plugin(proc: Any, output: Any, pids: Any, within: float) -> None:
    """SIGTERM to canaryd while its exec plugin hangs: it exits 0 within ``within``
    seconds, and the plugin's processes end with it."""
    proc.send_signal(signal.SIGTERM)
    done, _ = await asyncio.wait({output}, timeout=within)
    assert done, f"canaryd still runs {within:g} s after SIGTERM: it waits on the hung plugin"
    assert proc.returncode == 0, output.result()[1].decode()[-2000:]
    for pid in pids():
        await until_true(lambda: not running(pid), f"process {pid} to end")  # noqa: B023


async def start_on(plugin: Path, kube: FakeKube) -> asyncio.subprocess.Process:
    """canaryd on an exec plugin (hung by the test), one canary there to bump."""
    create_canary(kube)
    config = exec_kubeconfig(kube, plugin, TOKEN, lifetime=3600)
    return await start_process(config, "--timeout", f"{EXEC_CYCLE:g}s")


@pytest.mark.slow
async def test_a_credential_plugin_hung_at_start_is_an_episode_named_in_readyz(kube, tmp_path):
    """Issue 42: the exec plugin hangs at start: each run ends at the request timeout
    (1 s on a 2 s cycle), killed and reaped, and is tried again with backoff, the
    failure named in /readyz and told as one episode; once the plugin answers, canaryd
    starts (before: canaryd waited on the plugin for good, no health port open)."""
    with hung_plugin(tmp_path) as pids:
        proc = await start_on(tmp_path, kube)
        lines: list[str] = []
        try:
            await read_until(proc, '"health_server_listening"', lines, within=10)
        except TimeoutError:
            proc.kill()
            await proc.communicate()
            raise AssertionError("no health port within 10 s: it waits on the plugin") from None
        port = json.loads(lines[-1])["port"]
        output = asyncio.ensure_future(proc.communicate())  # read all along
        http = aiohttp.ClientSession()
        try:
            await until_true(lambda: bool(pids()), "the plugin to hang", within=20)
            first = pids()
            await until_true(lambda: plugin_runs(tmp_path) >= 2, "a second run", within=20)
            for pid in first:
                await until_true(lambda: not running(pid), f"process {pid} to end")  # noqa: B023
            async with http.get(f"http://127.0.0.1:{port}/readyz") as response:
                status, text = response.status, await response.text()
            assert status == 503, text
            assert "cannot load Kubernetes credentials" in text, text
            assert "not loaded within the request timeout (1s)" in text, text
            async with http.get(f"http://127.0.0.1:{port}/metrics") as response:
                scraped = await response.text()
            assert 'canaryd_blind{reason="unauthorized"} 1.0' in scraped, (
                "not blind: checks nothing"
            )
            (tmp_path / "hang").unlink()  # the plugin answers again
            await until_true(lambda: bool(kube.requests_for("patch")), "a bump", within=20)
            proc.send_signal(signal.SIGTERM)
            async with asyncio.timeout(10):
                await output
        finally:
            await http.close()
            if proc.returncode is None:
                proc.kill()
            await output
    assert proc.returncode == 0
    logged = [*lines, *output.result()[1].decode().splitlines()]
    records = [json.loads(line) for line in logged if line.startswith("{")]
    started = [r for r in records if r["event"] == "credential_failures_started"]
    assert len(started) == 1 and started[0]["cause"] == "credentials", started
    assert len([r for r in records if r["event"] == "credential_failures_ended"]) == 1


async def test_sigterm_while_a_credential_plugin_hangs_at_start_exits_0_in_time(kube, tmp_path):
    """Issue 42: SIGTERM while the exec plugin of the first credential load hangs: exit 0
    within 5 s, the plugin and its child killed and reaped (before: the signal handlers
    were not installed yet, so SIGTERM killed canaryd (-15) and left the plugin
    running)."""
    with hung_plugin(tmp_path) as pids:
        proc = await start_on(tmp_path, kube)
        output = asyncio.ensure_future(proc.communicate())
        try:
            await until_true(lambda: bool(pids()), "the plugin to hang", within=20)
            await stopped_with_its_plugin(proc, output, pids, within=5)
        finally:
            if proc.returncode is None:
                proc.kill()
            await output


async def test_check_on_a_hung_credential_plugin_exits_2_in_time(kube, tmp_path):
    """Issue 42: ``canaryd check`` gives the exec plugin the request timeout (1 s on a
    2 s cycle), then exits 2 naming it, the plugin killed and reaped (before: it hung)."""
    config = exec_kubeconfig(kube, tmp_path, TOKEN, lifetime=3600)
    with hung_plugin(tmp_path) as pids:
        code, _, err = await run_cli("check", "--kubeconfig", str(config), "--timeout", "2s")
        assert code == 2 and "not loaded within the request timeout (1s)" in err, err
        for pid in pids():
            await until_true(lambda: not running(pid), f"process {pid} to end")  # noqa: B023


async def test_one_unconfirmed_404_does_not_drop_every_canary(kube, kubeconfig):
    """One API server replica briefly not serving the group answers a resumed watch
    Go's plain 404 page: its group version still lists the kind, so the 404 is not
    believed and nothing is dropped (the watch is retried)."""
    create_canary(kube)
    async with running_daemon(kube, kubeconfig) as run:
        canary = await run.until_state(CanaryState.HEALTHY)
        flaky = kube.inject(
            Fault(verb="watch", resource="flinkdeployments", code=404, page="404 page not found\n")
        )
        kube.close_watches()
        await run.until(lambda: flaky.hits == 1, "the 404", within=5)
        await run.until(
            lambda: bool(kube.requests_for("get", None, None)), "the API server asked", within=5
        )
        await run.until_bumps(len(run.bumps()) + 2)
        assert run.canary() is canary and run.daemon.watcher.kinds
        assert "kind_not_served" not in run.daemon.watcher.blind()
        kube.remove_crd("flinksessionjobs")  # a real removal is still followed
        await run.until(
            lambda: [k.key for k in run.daemon.watcher.kinds] == ["flinkdeployments"],
            "the removed kind to be dropped",
            within=5,
        )
        assert run.canary() is canary
