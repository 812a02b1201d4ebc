"""config/monitoring: what Prometheus and Grafana users install beside canaryd.

The rules and the dashboard may only name metrics (and labels) that a running
canaryd exports; the ServiceMonitor and PodMonitor select what config/standalone
and config/sidecar deploy; and `promtool` (Prometheus' own checker) accepts the
rules and runs their unit tests (config/monitoring/alerts-test.yaml) when it can
be had from the package registries here.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from canaryd import metrics
from canaryd.registry import CanaryState
from canaryd.testing.apiserver import FLINK_DEPLOYMENTS
from tests.harness import create_canary, running_daemon
from tests.kubelet import kustomize, parse_metrics, render
from tests.promseries import promtool

ROOT = Path(__file__).resolve().parents[1]
MONITORING = ROOT / "config" / "monitoring"
NAME = re.compile(r"\b(canaryd_[a-z_]+)(\{[^}]*\})?")
LABEL = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
MATCHER = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|=)\s*"([^"]*)"')
# The labels Prometheus Operator's scrape adds to every sample (target labels).
TARGET_LABELS = {"namespace", "pod", "job", "instance", "service", "container", "endpoint"}
STATE = "canaryd_canary_state"
ALERTS = {
    "CanarydCanaryUnhealthy",
    "CanarydOperatorRestartLoop",
    "CanarydNoBumpWritten",
    "CanarydWatchRestartsHigh",
    "CanarydNotReady",
    "CanarydDown",
    "CanarydInternalErrors",
    "CanarydBlind",
    "CanarydBumpLatencyBudgetBurn",
    "CanarydBumpLatencyBudgetBurnSlow",
}


def load(name: str) -> Any:
    return yaml.safe_load((MONITORING / name).read_text())


def rules() -> list[dict[str, Any]]:
    rule_doc = load("prometheusrule.yaml")
    return [rule for group in rule_doc["spec"]["groups"] for rule in group["rules"]]


def dashboard_exprs() -> list[str]:
    board = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    return [
        target["expr"]
        for panel in board["panels"]
        for target in panel.get("targets", [])
        if "expr" in target
    ]


def label_names() -> dict[str, set[str]]:
    """Each exported family's labels, from canaryd's metric definitions."""
    names: dict[str, set[str]] = {
        "canaryd_canaries": {"state"},
        "canaryd_ready": set(),
        "canaryd_watch_scopes": {"state"},
        "canaryd_blind": {"reason"},
        STATE: {"kind", "canary_namespace", "name", "state", "reason"},
    }
    for value in vars(metrics).values():
        name = getattr(value, "_name", None)
        if isinstance(name, str) and name.startswith("canaryd_"):
            labels = set(getattr(value, "_labelnames", ()))
            kind = getattr(value, "_type", "")
            if kind == "counter":
                names[f"{name}_total"] = labels
            elif kind == "histogram":
                for suffix in ("_bucket", "_sum", "_count"):
                    names[f"{name}{suffix}"] = labels | ({"le"} if suffix == "_bucket" else set())
            else:
                names[name] = labels
    return names


def exported(text: str) -> set[str]:
    """Every sample name /metrics can carry: the TYPE lines' families with their
    suffixes, and the samples present."""
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split()
            suffixes = {
                "counter": ["_total", ""],
                "histogram": ["_bucket", "_sum", "_count"],
            }.get(kind, [""])
            names.update(
                family.removesuffix("_total") + s if kind == "counter" else family + s
                for s in suffixes
            )
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def test_the_prometheus_rule_has_the_alerts_users_expect():
    rule_doc = load("prometheusrule.yaml")
    assert rule_doc["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule_doc["kind"] == "PrometheusRule"
    alerts = {rule["alert"]: rule for rule in rules() if "alert" in rule}
    records = [rule["record"] for rule in rules() if "record" in rule]
    assert all(name.startswith("canaryd:") for name in records), records
    assert set(alerts) == ALERTS
    for name, rule in alerts.items():
        assert rule["expr"].strip(), name
        assert re.fullmatch(r"\d+[smh]", rule["for"]), name
        assert rule["labels"]["severity"] in {"critical", "warning"}, name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name
        assert "runbook" in rule["annotations"]["description"].lower() or rule["annotations"].get(
            "runbook_url"
        ), name


async def test_every_metric_and_label_the_rules_and_dashboard_name_is_exported(kube, kubeconfig):
    create_canary(kube)
    async with running_daemon(kube, kubeconfig) as run:
        await run.until_state(CanaryState.HEALTHY)
        status, text = await run.get("/metrics")
    assert status == 200
    names = exported(text)
    labels = label_names()
    exprs = [rule["expr"] for rule in rules()] + dashboard_exprs()
    assert len(dashboard_exprs()) >= 10
    used: set[str] = set()
    for expr in exprs:
        for name, selector in NAME.findall(expr):
            used.add(name)
            assert name in names, f"{name} (in {expr!r}) is not exported by canaryd"
            for label in LABEL.findall(selector or ""):
                known = labels.get(name, set()) | TARGET_LABELS
                assert label in known, f"{name} has no label {label!r} (in {expr!r})"
    # A value selected with = (or each of a plain a|b|c alternation) is one canaryd
    # exports: le="1" selects nothing where canaryd writes le="1.0".
    values: dict[tuple[str, str], set[str]] = {}
    for (name, sample_labels), _ in parse_metrics(text).items():
        for label, value in sample_labels:
            values.setdefault((name, label), set()).add(value)
    # A canary's series carries the state it is in (here healthy), any of them.
    values[(STATE, "state")] |= {state.value for state in CanaryState}
    for expr in exprs:
        for name, selector in NAME.findall(expr):
            for label, op, value in MATCHER.findall(selector or ""):
                if label in TARGET_LABELS or "$" in value:
                    continue
                wanted = value.split("|") if op == "=~" else [value]
                if op == "=~" and not all(re.fullmatch(r"[\w.+-]+", w) for w in wanted):
                    continue
                for one in wanted:
                    assert one in values.get((name, label), set()), (
                        f'{name}{{{label}="{one}"}} (in {expr!r}) is never exported; canaryd '
                        f"writes {sorted(values.get((name, label), set()))}"
                    )
    # The alerts cover the verdicts, the writes, the watches and readiness.
    for needed in (
        "canaryd_canaries",
        "canaryd_bumps_total",
        "canaryd_watch_restarts_total",
        "canaryd_ready",
    ):
        assert needed in used, needed


async def test_each_canary_has_a_series_naming_its_state_and_reason_class(kube, kubeconfig):
    """canaryd_canary_state: one series per tracked canary (kind, canary_namespace,
    name) with its state and the class of its reason; a dropped canary has none."""
    kube.create_namespace("team-a")
    create_canary(kube, "a", namespace="team-a")
    create_canary(kube, "b")
    async with running_daemon(kube, kubeconfig) as run:
        await run.until_state(CanaryState.HEALTHY, "a", "team-a")
        await run.until_state(CanaryState.HEALTHY, "b")
        kube.deny(verb="patch", resource="flinkdeployments", namespace="team-a")
        await run.until_state(CanaryState.UNKNOWN, "a", "team-a")

        async def series() -> dict[tuple[tuple[str, str], ...], float]:
            status, text = await run.get("/metrics")
            assert status == 200
            samples = parse_metrics(text).items()
            return {labels: value for (name, labels), value in samples if name == STATE}

        def one(namespace: str, name: str, state: str, reason: str) -> tuple[tuple[str, str], ...]:
            return tuple(
                sorted(
                    {
                        "kind": "flinkdeployments",
                        "canary_namespace": namespace,
                        "name": name,
                        "state": state,
                        "reason": reason,
                    }.items()
                )
            )

        assert await series() == {
            one("team-a", "a", "unknown", "forbidden"): 1.0,
            one("default", "b", "healthy", "in_time"): 1.0,
        }
        kube.delete(FLINK_DEPLOYMENTS, "default", "b")
        await run.until_gone("b")
        assert await series() == {one("team-a", "a", "unknown", "forbidden"): 1.0}


def test_the_grafana_dashboard_is_importable():
    board = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    assert board["uid"] and board["title"] and board["schemaVersion"] >= 36
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]


def test_the_monitors_select_what_the_manifests_deploy():
    service_monitor = load("servicemonitor.yaml")
    service = yaml.safe_load((ROOT / "config/standalone/service.yaml").read_text())
    assert service_monitor["kind"] == "ServiceMonitor"
    selector = service_monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    ports = {p["name"] for p in service["spec"]["ports"]}
    assert {e["port"] for e in service_monitor["spec"]["endpoints"]} <= ports
    assert all(e["path"] == "/metrics" for e in service_monitor["spec"]["endpoints"])
    # A pod that is not Ready is scraped too (canaryd_ready 0, canaryd_blind): its
    # Service publishes it, whatever the scrape's relabeling does with readiness.
    assert service["spec"]["publishNotReadyAddresses"] is True

    pod_monitor = load("podmonitor.yaml")
    assert pod_monitor["kind"] == "PodMonitor"
    operator = yaml.safe_load(
        (ROOT / "config/sidecar-example/operator-deployment.yaml").read_text()
    )
    pod_labels = operator["spec"]["template"]["metadata"]["labels"]
    assert pod_monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    patch = yaml.safe_load((ROOT / "config/sidecar/operator-patch.yaml").read_text())
    sidecar_ports = {
        port["name"]
        for container in patch["spec"]["template"]["spec"]["containers"]
        for port in container.get("ports", [])
    }
    assert {e["port"] for e in pod_monitor["spec"]["podMetricsEndpoints"]} <= sidecar_ports
    kustomization = load("kustomization.yaml")
    assert set(kustomization["resources"]) == {
        "servicemonitor.yaml",
        "prometheusrule.yaml",
        "runbook.yaml",
    }


def runbook_urls(objects: list[dict[str, Any]]) -> list[str]:
    (rule,) = [o for o in objects if o["kind"] == "PrometheusRule"]
    return [
        r["annotations"]["runbook_url"]
        for group in rule["spec"]["groups"]
        for r in group["rules"]
        if "alert" in r
    ]


def test_every_runbook_url_is_absolute_and_set_in_one_place(tmp_path):
    """Alertmanager shows runbook_url as a link: a path in the repository is none.
    prometheusrule.yaml carries runbook.yaml's default address; the kustomization
    writes the one runbook.yaml sets into every rule, and outputs no ConfigMap."""
    base = load("runbook.yaml")["data"]["baseURL"]
    assert base.startswith("https://") and not base.endswith("/")
    shipped = runbook_urls([load("prometheusrule.yaml")])
    assert len(shipped) == len(ALERTS)
    assert all(u.startswith(f"{base}/docs/OPERATIONS.md#") for u in shipped), shipped
    assert runbook_urls(render(MONITORING)) == shipped
    copy = tmp_path / "monitoring"
    shutil.copytree(MONITORING, copy)
    runbook = copy / "runbook.yaml"
    runbook.write_text(runbook.read_text().replace(base, "https://docs.example/canaryd/v9"))
    built = render(copy)
    assert [o["kind"] for o in built if o["kind"] == "ConfigMap"] == []
    theirs = [u.replace(base, "https://docs.example/canaryd/v9", 1) for u in shipped]
    assert runbook_urls(built) == theirs
    assert runbook_urls(kustomize(copy)) == runbook_urls(built)  # without kubectl too


def test_promtool_accepts_the_rules_and_their_unit_tests_pass(tmp_path):
    tool = promtool()
    if tool is None:
        pytest.skip("promtool is neither on PATH nor downloadable (apt-get download prometheus)")
    rule_file = tmp_path / "canaryd-rules.yaml"
    rule_file.write_text(yaml.safe_dump(load("prometheusrule.yaml")["spec"]))
    checked = subprocess.run(
        [tool, "check", "rules", str(rule_file)], capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(rules())} rules found" in checked.stdout + checked.stderr
    tests = yaml.safe_load((MONITORING / "alerts-test.yaml").read_text())
    tests["rule_files"] = [str(rule_file)]
    test_file = tmp_path / "alerts-test.yaml"
    test_file.write_text(yaml.safe_dump(tests))
    ran = subprocess.run([tool, "test", "rules", str(test_file)], capture_output=True, text=True)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    tested = {
        alert["alertname"] for test in tests["tests"] for alert in test.get("alert_rule_test", [])
    }
    assert tested == ALERTS, f"alerts without a unit test: {ALERTS - tested}"


async def test_every_labelled_counter_an_alert_reads_is_exported_at_0_from_the_start(
    kube, kubeconfig
):
    """increase() cannot see a series' first step from absent to 1: a counter an alert
    reads must exist, at 0, before the first event it counts. A fresh process (this
    test process's counters have long been touched by other tests)."""
    import asyncio
    import os
    import signal

    import aiohttp

    from canaryd.testing.process import canaryd_argv, free_port

    create_canary(kube)
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        *canaryd_argv(kubeconfig, port, 0.3), env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    try:
        async with aiohttp.ClientSession() as http:
            await kube.wait_for(lambda: len(kube.watchers) >= 3, within=20, what="the watches")
            text = ""
            for _ in range(50):  # until the server answers (bounded)
                try:
                    async with http.get(f"http://127.0.0.1:{port}/metrics") as response:
                        text = await response.text()
                    break
                except aiohttp.ClientConnectionError:
                    await asyncio.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        await proc.wait()
    samples = {line.rsplit(" ", 1)[0] for line in text.splitlines() if not line.startswith("#")}
    for where in metrics.ERROR_PLACES:
        assert f'canaryd_errors_total{{where="{where}"}}' in samples, where
    for result in metrics.BUMP_RESULTS:
        assert f'canaryd_bumps_total{{result="{result}"}}' in samples, result
    for why in metrics.WATCH_RESTART_WHYS:
        for resource in ("flinkdeployments", "flinksessionjobs", "namespaces"):
            series = f'canaryd_watch_restarts_total{{resource="{resource}",why="{why}"}}'
            assert series in samples, series
    for verdict in metrics.VERDICT_KINDS:
        assert f'canaryd_verdicts_total{{verdict="{verdict}"}}' in samples, verdict
    for reason in metrics.BLIND_REASONS:
        assert f'canaryd_blind{{reason="{reason}"}}' in samples, reason


async def test_the_blind_alert_fires_on_what_a_blind_sidecar_exports(kube, kubeconfig, tmp_path):
    """The sidecar's blindness, recorded: canaryd judges by the operator's metrics, which
    refuse every read (a wrong port, the reporter off), while its canary stays pending
    and /healthz 200. Scraped every 30 s (shipped; the cycle is 1 s here for 60 s), the
    shipped rules over what it really exported: CanarydBlind fires for its pod within
    two cycles of canaryd's start-up grace (a cycle of refused reads)."""
    import asyncio

    from canaryd.testing.process import free_port
    from tests.kubelet import Recording, Scale, Scrape, Target
    from tests.promseries import Expect, check_alerts

    tool = promtool()
    if tool is None:
        pytest.skip("promtool is neither on PATH nor downloadable")
    create_canary(kube)
    cycle, shipped_cycle = 1.0, 60.0
    url = f"http://127.0.0.1:{free_port()}/metrics"
    async with running_daemon(
        kube, kubeconfig, timeout=cycle, reconciled_by="operator-metrics", operator_metrics_url=url
    ) as run:
        loop = asyncio.get_running_loop()
        scale = Scale(cycle / shipped_cycle)
        recording = Recording(scale, 30.0, loop.time())
        labels = {"namespace": "flink", "pod": "operator-0", "job": "flink/canaryd"}
        target = Target("operator-0", "canaryd", 8085, tuple(sorted(labels.items())))
        for tick in range(9):  # 0 to 240 s shipped
            at = recording.start + scale(30.0 * tick)
            await asyncio.sleep(max(0.0, at - loop.time()))  # the scrape interval
            status, text = await run.get("/metrics")
            recording.scrapes.append(Scrape(at, target, status == 200, parse_metrics(text)))
        assert run.tracked().state is CanaryState.PENDING
        assert (await run.get("/healthz"))[0] == 200
    check_alerts(
        recording,
        [
            Expect("CanarydBlind", 0, [], why="within canaryd's start-up grace"),
            Expect("CanarydBlind", 3 * shipped_cycle, ["operator-0"], why="two cycles past it"),
        ],
        tmp_path,
        tool,
    )
