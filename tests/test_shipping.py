"""Issue 33, what a platform team asks of a project before deploying it: a licence, a
changelog, a version to ask about (in /metrics and the start-up line), and no quiet
mismatches between what canaryd is told and what it does."""

from __future__ import annotations

import asyncio
import io
import os
import platform
import re
import signal
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from canaryd import __version__, metrics
from canaryd.__main__ import check, main
from canaryd.access import ACCESS_REVIEWS, KIND_VERBS
from canaryd.config import ConfigError, load_settings
from canaryd.testing.apiserver import FLINK_DEPLOYMENTS, SERVICE_ACCOUNTS, FakeKube
from tests.conftest import TOKEN
from tests.controlplane.launcher import ControlPlane, built_bin_dir
from tests.harness import create_canary, json_lines, json_logs, running_daemon, start_records

ROOT = Path(__file__).resolve().parents[1]


def events(records: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [r for r in records if r.get("event") == name]


# ---------------------------------------------------------------- versioned


def test_the_licence_is_the_apache_2_text_pyproject_names():
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"] == (
        "Apache-2.0"
    )
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License")
    for phrase in (
        "Version 2.0, January 2004",
        "http://www.apache.org/licenses/",
        "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION",
        "1. Definitions.",
        "9. Accepting Warranty or Additional Liability.",
        "END OF TERMS AND CONDITIONS",
        "APPENDIX: How to apply the Apache License to your work.",
    ):
        assert phrase in text, phrase
    # All nine sections, in order: the full text, not a summary.
    sections = [int(n) for n in re.findall(r"^\s*(\d)\. [A-Z]", text, re.M)]
    assert sections == list(range(1, 10)), sections


def test_the_wheel_carries_the_licence(tmp_path):
    """What pip installs (and the image): the licence file in the wheel's metadata."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(tmp_path), ROOT],
        check=True,
        timeout=300,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob(
        "flink_canaryd-*.whl"
    )  # the distribution's name (PyPI's canaryd is another project)
    with zipfile.ZipFile(wheel) as archive:
        info = f"flink_canaryd-{__version__}.dist-info"
        assert archive.read(f"{info}/licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()
        metadata = archive.read(f"{info}/METADATA").decode()
    assert "License-Expression: Apache-2.0" in metadata.splitlines()


def test_the_changelog_keeps_a_changelog_with_an_unreleased_section():
    text = (ROOT / "CHANGELOG.md").read_text()
    assert text.startswith("# Changelog")
    assert "keepachangelog.com" in text and "semver.org" in text
    headings = re.findall(r"^## \[([^\]]+)\]", text, re.M)
    assert headings[0] == "Unreleased", headings
    assert __version__ in text, f"the changelog does not name the version {__version__}"
    known = {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}
    for section in text.split("\n## [")[1:]:  # Unreleased may be empty; a version may not
        version = section.split("]", 1)[0]
        kinds = re.findall(r"^### (\w+)", section, re.M)
        assert set(kinds) <= known, (version, kinds)
        if version != "Unreleased":
            assert kinds and re.search(r"^- \S", section, re.M), f"[{version}] has no entry"


async def test_metrics_show_the_build_and_the_process(kube, kubeconfig):
    async with running_daemon(kube, kubeconfig) as run:
        status, text = await run.get("/metrics")
    assert status == 200
    build = (
        f'canaryd_build_info{{python="{platform.python_version()}",version="{__version__}"}} 1.0'
    )
    assert build in text, [line for line in text.splitlines() if "build_info" in line]
    for series in (
        "process_resident_memory_bytes",
        "process_start_time_seconds",
        "process_cpu_seconds_total",
        "process_open_fds",
    ):
        assert re.search(rf"^{series} \d", text, re.M), series


async def test_the_start_up_line_names_the_version(kube, kubeconfig, capsys):
    with json_logs("info"):
        async with running_daemon(kube, kubeconfig) as run:
            await run.until(lambda: run.daemon.watcher is not None, "the watcher")
        records = json_lines(capsys.readouterr().err)
    (started,) = events(records, "canaryd_started")
    assert started["version"] == __version__, started
    assert started["python"] == platform.python_version(), started


# ---------------------------------------------------------- quiet mismatches


NESTED = """\
kubernetes:
  operator:
    watched:
      namespaces: team-a,team-b
    dynamic.namespaces.enabled: true
kubernetes.operator.health.probe.port: 9000
"""


@pytest.mark.parametrize("name", ["flink-conf.yaml", "config.yaml"])
async def test_nested_operator_keys_get_a_warning_naming_the_flat_key(
    kube, kubeconfig, tmp_path, capsys, name
):
    """Flink 2 nests keys; the operator's flink-conf.yaml parser reads flat lines only.
    canaryd still reads both spellings, and says which keys the operator reads flat."""
    conf = tmp_path / name
    conf.write_text(NESTED)
    settings = load_settings(["--operator-config", str(conf)], {})
    assert settings.namespaces == frozenset({"team-a", "team-b"})  # read as today
    assert settings.dynamic_namespaces and settings.port == 9000
    records = await start_records(kube, kubeconfig, conf, capsys)
    (warning,) = events(records, "operator_config_nested_keys")
    assert warning["level"] == "warning" and warning["file"] == str(conf), warning
    assert warning["flat_keys"] == [
        "kubernetes.operator.dynamic.namespaces.enabled",
        "kubernetes.operator.watched.namespaces",
    ], warning
    assert ("flat parser" in warning["why"]) is (name == "flink-conf.yaml"), warning


async def test_flat_operator_keys_get_no_nested_key_warning(kube, kubeconfig, tmp_path, capsys):
    conf = tmp_path / "flink-conf.yaml"
    conf.write_text("kubernetes.operator.watched.namespaces: team-a\nrest: {port: 8081}\n")
    with json_logs("info"):
        async with running_daemon(
            kube, kubeconfig, operator_config=conf, namespaces=frozenset({"team-a"})
        ) as run:
            await run.until(lambda: run.daemon.watcher is not None, "the watcher")
        records = json_lines(capsys.readouterr().err)
    assert events(records, "canaryd_started")
    assert events(records, "operator_config_nested_keys") == []


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        ([], {"CANARYD_TIMEOUT": "300"}),
        (["--timeout", "999"], {}),
        (["--timeout", "500.5"], {}),
    ],
)
def test_a_sub_second_cycle_from_a_bare_number_is_refused_with_a_unit_hint(
    argv, env, capsys, monkeypatch
):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    text = (argv[1:] or list(env.values()))[0]
    source = "--timeout" if argv else f"CANARYD_TIMEOUT={text}"
    assert lines[0] == (
        f"canaryd: {source}: '{text}' is {float(text):g} ms: a bare number is milliseconds; "
        f"give a unit, e.g. '{text}s' (or '{text}ms' for a cycle below a second)"
    )


def test_a_bare_number_in_the_operator_config_gets_the_same_hint(tmp_path):
    conf = tmp_path / "flink-conf.yaml"
    conf.write_text("kubernetes.operator.health.canary.resource.timeout: 300\n")
    with pytest.raises(ConfigError, match=r"'300' is 300 ms.*give a unit, e.g. '300s'"):
        load_settings(["--operator-config", str(conf)], {})


@pytest.mark.parametrize(
    ("text", "seconds"), [("300ms", 0.3), ("300 ms", 0.3), ("1000", 1.0), ("60000", 60.0)]
)
def test_a_unit_or_a_bare_number_of_a_second_or_more_stays_allowed(text, seconds):
    assert load_settings(["--timeout", text], {}).timeout == pytest.approx(seconds)
    assert load_settings([], {"CANARYD_TIMEOUT": text}).timeout == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("text", "level"),
    [
        ("warn", "warning"),
        ("WARN", "warning"),
        ("Warn", "warning"),
        ("WARNING", "warning"),
        ("DEBUG", "debug"),
        (" Error ", "error"),
    ],
)
def test_log_levels_take_warn_in_any_case(text, level):
    assert load_settings(["--log-level", text], {}).log_level == level
    assert load_settings([], {"CANARYD_LOG_LEVEL": text}).log_level == level


def test_an_unknown_log_level_is_still_refused():
    with pytest.raises(ConfigError, match=r"invalid log level 'loud'"):
        load_settings(["--log-level", "loud"], {})


# ------------------------------------------------- the control-plane launcher


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc: field 4 of stat is the ppid)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def _until_children(pid: int, within: float) -> list[int]:
    """The processes the launcher started, once there is one: re-read from /proc every
    10 ms (nothing tells of a fork), bounded."""
    try:
        async with asyncio.timeout(within):
            while not (found := _children(pid)):  # noqa: ASYNC110 - see above
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"the launcher started no process within {within}s") from None
    return found


@pytest.mark.skipif(
    not all((built_bin_dir() / b).is_file() for b in ("etcd", "kube-apiserver")),
    reason="no control plane built (make controlplane)",
)
@pytest.mark.parametrize("when", ["up", "starting"])
@pytest.mark.timeout(240)
async def test_the_control_plane_launcher_stops_on_ctrl_c(tmp_path, when):
    """Started as a shell script's background job starts it (SIGINT ignored, inherited),
    then Ctrl-C (SIGINT to its process group), once it is up or while it starts: it stops
    every process it started and exits 0, without a traceback. Before the fix it
    ignored the signal and ran on."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.controlplane.launcher",
        "--kubeconfig",
        str(tmp_path / "admin.kubeconfig"),
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    assert process.stdout is not None
    output: list[str] = []
    try:
        if when == "up":
            async with asyncio.timeout(150):
                while not output or "Ctrl-C stops it" not in output[-1]:
                    line = await process.stdout.readline()
                    assert line, f"the launcher ended before it was up: {''.join(output)[-3000:]}"
                    output.append(line.decode(errors="replace"))
            started = _children(process.pid)
            assert len(started) == 3, started  # etcd, kube-apiserver, kube-controller-manager
        else:
            started = await _until_children(process.pid, 60)  # etcd: the start goes on
        os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C sends to the foreground group
        try:
            async with asyncio.timeout(60):
                rest, _ = await process.communicate()
        except TimeoutError:
            raise AssertionError("the launcher still runs 60 s after SIGINT") from None
        output.append(rest.decode(errors="replace"))
        text = "".join(output)
        assert process.returncode == 0, text[-3000:]
        assert "SIGINT: stopping the control plane" in output[-1], text[-3000:]
        assert "Traceback" not in text, text[-3000:]
        assert [pid for pid in started if _alive(pid)] == []
    finally:
        if process.returncode is None:
            os.killpg(process.pid, signal.SIGTERM)
            await process.wait()


def test_a_ctrl_c_while_the_launcher_forks_a_process_still_stops_that_process(
    tmp_path, monkeypatch
):
    """Ctrl-C can arrive inside Popen: the child is forked, its exec not yet confirmed.
    The launcher's handler raises; it must wait until the child is recorded, or stop()
    never reaches it (it runs in a session of its own). The likely cause of the one
    failure of the test above seen under load (its detail was not kept)."""
    (tmp_path / "sleeper").write_text("#!/bin/sh\nexec sleep 60\n")
    (tmp_path / "sleeper").chmod(0o755)
    plane = ControlPlane(bin_dir=tmp_path, workdir=tmp_path)
    forked = subprocess.Popen._execute_child

    def interrupted(self: subprocess.Popen[bytes], *args: Any) -> None:
        forked(self, *args)
        signal.raise_signal(signal.SIGINT)  # after the fork, before Popen returns

    class Interrupted(Exception):
        pass

    def stop(_signum: int, _frame: object) -> None:
        raise Interrupted

    monkeypatch.setattr(subprocess.Popen, "_execute_child", interrupted)
    previous = signal.signal(signal.SIGINT, stop)
    try:
        with pytest.raises(Interrupted):
            plane._start("sleeper", [])
    finally:
        signal.signal(signal.SIGINT, previous)
    assert "sleeper" in plane.processes, "the forked child was not recorded"
    child = plane.processes["sleeper"]
    plane.stop()
    assert child.poll() is not None


# ------------------------------------------------------- the pre-flight check


async def run_cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """``python -m canaryd ARGS``: its exit status, stdout and stderr."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "canaryd",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )
    try:
        async with asyncio.timeout(40):
            out, err = await process.communicate()
    except TimeoutError:
        process.kill()
        await process.wait()
        raise AssertionError(f"canaryd {' '.join(args)} still runs after 40 s") from None
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


def reviews(kube: FakeKube) -> list[dict[str, Any]]:
    """The resourceAttributes of every SelfSubjectAccessReview the fake was sent."""
    return [
        r.body["spec"]["resourceAttributes"]
        for r in kube.requests
        if r.resource == "selfsubjectaccessreviews"
    ]


async def test_check_exits_2_naming_patch_when_patch_is_denied(kube, kubeconfig):
    kube.deny("patch", "flinkdeployments", "team-a")
    code, out, err = await run_cli(
        "check", "--kubeconfig", str(kubeconfig), "--namespace", "team-a,team-b"
    )
    assert code == 2, (out, err)
    lines = out.splitlines()
    assert "MISSING patch flinkdeployments in team-a" in lines, out
    assert "ok   patch flinkdeployments in team-b" in lines, out
    assert "ok   list flinkdeployments in team-a" in lines, out
    assert "ok   watch flinksessionjobs in team-a" in lines, out
    assert "ok   list namespaces (cluster-scoped)" in lines, out
    assert lines[-1] == (
        f"canaryd check: 1 of 14 permissions missing on {kube.url}: "
        "patch flinkdeployments in team-a"
    ), out
    assert err == "", err
    # Asked, never done: no canary was listed, watched or patched.
    assert {r.resource for r in kube.requests} == {"selfsubjectaccessreviews"}


async def test_check_exits_0_when_all_is_allowed(kube, kubeconfig):
    kube.create_namespace("team-a")
    for namespace in ("default", "team-a"):
        create_canary(kube, namespace=namespace)
    create_canary(kube, name="not-one", namespace="team-a", value="false")  # not a canary
    code, out, err = await run_cli("check", "--kubeconfig", str(kubeconfig))
    assert code == 0, (out, err)
    lines = out.splitlines()
    assert lines[:-1] == [
        "ok   list flinkdeployments in all namespaces",
        "ok   watch flinkdeployments in all namespaces",
        "ok   patch flinkdeployments in all namespaces",
        "ok   list flinksessionjobs in all namespaces",
        "ok   watch flinksessionjobs in all namespaces",
        "ok   patch flinksessionjobs in all namespaces",
        "ok   list namespaces (cluster-scoped)",
        "ok   watch namespaces (cluster-scoped)",
        "ok   kind flinkdeployments is served",
        "ok   kind flinksessionjobs is served",
        "ok   1 canaries in default",
        "ok   1 canaries in team-a",
    ], out
    assert lines[-1] == f"canaryd check: all 8 permissions granted on {kube.url}"
    # Cluster-wide: reviews without a namespace, as kube-apiserver reads them.
    assert all("namespace" not in attributes for attributes in reviews(kube))


async def test_check_asks_for_the_lease_and_custom_kinds_as_configured(kube, kubeconfig):
    kube.deny("create", "leases")
    out = io.StringIO()
    settings = load_settings(
        [
            "--kubeconfig",
            str(kubeconfig),
            "--namespace",
            "team-a",
            "--kind",
            "widgets.example.com/v1",
            "--leader-elect",
            "--lease-namespace",
            "ops",
            "--lease-name",
            "canary-lease",
        ],
        {},
    )
    assert await check(settings, out) == 2
    lines = out.getvalue().splitlines()
    assert lines[:-1] == [
        "ok   list widgets.example.com in team-a",
        "ok   watch widgets.example.com in team-a",
        "ok   patch widgets.example.com in team-a",
        "ok   list namespaces (cluster-scoped)",
        "ok   watch namespaces (cluster-scoped)",
        "ok   get leases/canary-lease in ops",
        "MISSING create leases in ops",
        "ok   update leases/canary-lease in ops",
    ], lines
    asked = reviews(kube)
    assert {
        "verb": "patch",
        "group": "example.com",
        "resource": "widgets",
        "namespace": "team-a",
    } in asked
    assert {
        "verb": "update",
        "group": "coordination.k8s.io",
        "resource": "leases",
        "namespace": "ops",
        "name": "canary-lease",
    } in asked


async def test_check_exits_1_naming_a_missing_namespace_and_a_kind_not_served(kube, kubeconfig):
    """Every permission granted, but canaryd would be blind: a watched namespace that
    does not exist, a kind whose CRD is not served (found before deployment, not by a
    daemon whose /healthz says OK)."""
    kube.create_namespace("canary-0")
    create_canary(kube, namespace="canary-0")
    code, out, err = await run_cli(
        "check",
        "--kubeconfig",
        str(kubeconfig),
        "--namespace",
        "canary-0,nope",
        "--kind",
        "flinkdeployments,widgets.example.com/v1",
    )
    assert code == 1, (out, err)
    lines = out.splitlines()
    assert lines[-6:-1] == [
        "ok   kind flinkdeployments is served",
        "BLIND kind widgets.example.com/v1 is not served (its CRD is not installed)",
        "ok   namespace canary-0 exists",
        "BLIND namespace nope does not exist",
        "ok   1 canaries in canary-0",
    ], out
    assert lines[-1] == (
        f"canaryd check: all 14 permissions granted on {kube.url}, but canaryd would be "
        "blind: kind_not_served: kind widgets.example.com/v1 is not served (its CRD is not "
        "installed); namespace_missing: namespace nope does not exist"
    ), out


async def test_check_exits_1_when_no_canary_matches(kube, kubeconfig):
    """A wrong --label: no canary matches, whatever is labelled with the other."""
    create_canary(kube)
    code, out, _ = await run_cli(
        "check", "--kubeconfig", str(kubeconfig), "--label", "example.com/canary"
    )
    assert code == 1, out
    assert "BLIND no canary labelled example.com/canary=true in any namespace" in out, out
    assert out.splitlines()[-1].endswith(
        "but canaryd would be blind: no_canaries: no canary labelled "
        "example.com/canary=true in any namespace"
    ), out


async def test_check_does_not_count_a_canary_being_deleted(kube, kubeconfig):
    """Review: check counted a canary a finalizer holds after its delete, which the
    daemon does not check (its deletionTimestamp is set): "1 canaries" where the daemon
    would be blind (no_canaries)."""
    create_canary(kube, metadata={"finalizers": ["flinkdeployments.flink.apache.org/finalizer"]})
    kube.delete(FLINK_DEPLOYMENTS, "default", "canary")
    assert (kube.get("flinkdeployments", "default", "canary") or {})["metadata"][
        "deletionTimestamp"
    ]
    code, out, _ = await run_cli("check", "--kubeconfig", str(kubeconfig))
    assert code == 1, out
    assert "canaries in default" not in out, out
    assert "BLIND no canary labelled flink.apache.org/canary=true in any namespace" in out, out


async def test_check_says_where_it_found_no_canary_when_no_watched_namespace_exists(
    kube, kubeconfig
):
    """Review: the line ended with "in " and nothing after it."""
    create_canary(kube)
    code, out, _ = await run_cli("check", "--kubeconfig", str(kubeconfig), "--namespace", "nope")
    assert code == 1, out
    assert (
        "BLIND no canary labelled flink.apache.org/canary=true in the watched namespaces: "
        "none exist\n" in out
    ), out


async def test_check_reads_the_operators_metrics_for_every_canarys_series(kube, kubeconfig):
    """--reconciled-by operator-metrics: the metrics answer and carry each canary's
    series (the operator watching only default: the canary elsewhere has none); an
    address where nothing listens is blind too."""
    from canaryd.testing.operator import FakeOperator
    from canaryd.testing.process import free_port

    kube.create_namespace("elsewhere")
    create_canary(kube)
    create_canary(kube, namespace="elsewhere")
    operator = FakeOperator(
        kube.url, kube.token, namespaces=["default"], kinds=("flinkdeployments",)
    )
    await operator.start()
    try:
        async with asyncio.timeout(5):
            await operator.listed.wait()  # its list reconciled the canary of default
        args = ["--kubeconfig", str(kubeconfig), "--reconciled-by", "operator-metrics"]
        out = io.StringIO()
        url = operator.metrics_url
        settings = load_settings([*args, "--operator-metrics-url", url], {})
        assert await check(settings, out) == 1
        lines = out.getvalue().splitlines()
        assert (
            f"BLIND {url} has the series of 1 of 2 canaries, not of "
            "flinkdeployments/elsewhere/canary"
        ) in lines, lines
        nowhere = f"http://127.0.0.1:{free_port()}/metrics"
        out = io.StringIO()
        settings = load_settings([*args, "--operator-metrics-url", nowhere], {})
        assert await check(settings, out) == 1
        assert "blind: operator_metrics_unreachable: the operator's metrics: " in out.getvalue()
    finally:
        await operator.stop()


async def test_check_says_nested_operator_keys_and_follows_the_operator_configs_namespaces(
    kube, kubeconfig, tmp_path
):
    conf = tmp_path / "flink-conf.yaml"
    conf.write_text(NESTED)
    for namespace in ("team-a", "team-b"):
        kube.create_namespace(namespace)
    create_canary(kube, namespace="team-b")
    settings = load_settings(
        [
            "--kubeconfig",
            str(kubeconfig),
            "--operator-config",
            str(conf),
            "--kind",
            "flinkdeployments",
        ],
        {},
    )
    out = io.StringIO()
    assert await check(settings, out) == 0
    lines = out.getvalue().splitlines()
    assert lines[0].startswith(
        f"warn kubernetes.operator.dynamic.namespaces.enabled is nested in {conf}: "
    ), lines
    assert lines[1].startswith(f"warn kubernetes.operator.watched.namespaces is nested in {conf}")
    assert "ok   patch flinkdeployments in team-b" in lines, lines


@pytest.mark.parametrize(
    ("problem", "says"),
    [
        ("refused", "cannot reach the API server at {url} (refused)"),
        ("token", "the API server at {url} refused the credentials (401)"),
    ],
)
async def test_check_that_cannot_ask_is_one_line_and_exit_2(
    kube, kubeconfig, tmp_path, problem, says
):
    url = kube.url
    if problem == "refused":
        await kube.refuse_connections()
    else:
        kube.token = "another-token"
    code, out, err = await run_cli("check", "--kubeconfig", str(kubeconfig), "--timeout", "2s")
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"canaryd: {says.format(url=url)}"), err
    assert "Traceback" not in err and TOKEN not in err + out


async def test_check_says_when_the_operators_account_does_not_exist(kube, kubeconfig):
    """With --operator-account (the chart and config/standalone set it as the admission
    policy's account): asked whether canaryd may get it, then whether it exists. A
    policy for an account that does not exist refuses nothing: exit 2, named."""
    args = ("check", "--kubeconfig", str(kubeconfig), "--operator-account", "flink/operator")
    code, out, err = await run_cli(*args)
    assert code == 2, (out, err)
    lines = out.splitlines()
    assert "ok   get serviceaccounts/operator in flink" in lines, out
    assert lines[-2].startswith("MISSING serviceaccount operator in flink: "), out
    assert lines[-1] == (
        f"canaryd check: all 9 permissions granted on {kube.url}, but the operator's "
        "service account flink/operator does not exist"
    ), out
    kube.create_namespace("flink")
    kube.create(SERVICE_ACCOUNTS, "flink", {"metadata": {"name": "operator"}})
    create_canary(kube)  # else canaryd would be blind (no_canaries): exit 1
    code, out, err = await run_cli(*args)
    assert (code, out.splitlines()[-1]) == (
        0,
        f"canaryd check: all 9 permissions granted on {kube.url}",
    ), (out, err)
    kube.deny("get", "serviceaccounts", "flink")
    code, out, err = await run_cli(*args)
    assert code == 2 and "MISSING get serviceaccounts/operator in flink" in out, (out, err)


@pytest.mark.parametrize("exists", [False, True, None])
async def test_the_start_up_log_says_whether_the_operators_account_exists(
    kube, kubeconfig, capsys, exists
):
    """None: canaryd may not get it (403), so cannot say: a warning and an error counted."""
    if exists:
        kube.create(SERVICE_ACCOUNTS, "default", {"metadata": {"name": "operator"}})
    if exists is None:
        kube.deny("get", "serviceaccounts")
    errors = ("canaryd_errors_total", {"where": "operator_account"})
    before = metrics.REGISTRY.get_sample_value(*errors)
    with json_logs("info"):
        async with running_daemon(kube, kubeconfig, operator_account=("default", "operator")):
            said = [t for t in asyncio.all_tasks() if t.get_name() == "operator-account"]
            if said:  # else already done
                async with asyncio.timeout(5):
                    await asyncio.wait(said)
        records = json_lines(capsys.readouterr().err)
    counted = metrics.REGISTRY.get_sample_value(*errors) - before
    if exists:
        (line,) = events(records, "operator_account")
        assert (line["level"], line["exists"]) == ("info", True), line
        assert not events(records, "operator_account_missing")
    elif exists is None:
        (line,) = events(records, "operator_account_unknown")
        assert line["level"] == "warning" and "403" in line["error"], line
        assert counted == 1, counted
    else:
        (line,) = events(records, "operator_account_missing")
        assert line["level"] == "warning" and "refuses nothing" in line["why"], line
    assert (line["namespace"], line["name"]) == ("default", "operator"), line


async def test_check_with_bad_configuration_is_one_line_and_exit_2():
    code, out, err = await run_cli("check", "--timeout", "300")
    assert code == 2 and out == ""
    assert err.strip() == (
        "canaryd: --timeout: '300' is 300 ms: a bare number is milliseconds; give a unit, "
        "e.g. '300s' (or '300ms' for a cycle below a second)"
    )


async def test_the_fakes_access_reviews_answer_as_its_requests_are_answered(kube, kubeconfig):
    """A review says allowed exactly when the request it describes is not 403."""
    kube.deny("patch", "flinkdeployments", "team-a")
    kube.deny("watch", "namespaces")
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as http:

        async def allowed(attributes: dict[str, str]) -> bool:
            body = {
                "apiVersion": "authorization.k8s.io/v1",
                "kind": "SelfSubjectAccessReview",
                "spec": {"resourceAttributes": attributes},
            }
            async with http.post(kube.url + ACCESS_REVIEWS, json=body) as answer:
                assert answer.status == 201
                review = await answer.json()
            assert review["kind"] == "SelfSubjectAccessReview" and review["spec"] == body["spec"]
            return bool(review["status"]["allowed"])

        flink = {"group": "flink.apache.org", "resource": "flinkdeployments"}
        assert not await allowed({**flink, "verb": "patch", "namespace": "team-a"})
        assert await allowed({**flink, "verb": "patch", "namespace": "team-b"})
        assert await allowed({**flink, "verb": "list", "namespace": "team-a"})
        assert await allowed({**flink, "verb": "patch"})  # cluster-wide: not team-a's rule
        assert not await allowed({"verb": "watch", "group": "", "resource": "namespaces"})
        assert await allowed({"verb": "list", "group": "", "resource": "namespaces"})
        kube.create_namespace("team-a")
        create_canary(kube, namespace="team-a")
        path = "/apis/flink.apache.org/v1beta1/namespaces/team-a/flinkdeployments/canary"
        patch = {"Content-Type": "application/merge-patch+json"}
        async with http.patch(kube.url + path, data="{}", headers=patch) as answer:
            assert answer.status == 403  # what the review said
        async with http.post(kube.url + ACCESS_REVIEWS, json={"spec": {}}) as answer:
            assert answer.status == 422 and (await answer.json())["reason"] == "Invalid"


def test_the_docs_document_check_and_version():
    """docs/OPERATIONS.md has the whole of it; the README's deploy section says what it
    asks and what its exit status means."""
    operations = (ROOT / "docs" / "OPERATIONS.md").read_text()
    section = operations.split("## Before you deploy: `canaryd check`, and `--version`", 1)[1]
    section = section.split("\n## ", 1)[0]
    assert "canaryd check --kubeconfig" in section and "canaryd --version" in section
    for verb in KIND_VERBS:
        assert f"`{verb}`" in section, verb
    assert "exits 2 naming what is missing" in section
    assert "is a `BLIND` line, and it exits 1 naming each; else 0" in " ".join(section.split())
    assert "    ok   list flinkdeployments in team-a" in section
    assert "    MISSING patch flinkdeployments in team-a" in section
    readme = (ROOT / "README.md").read_text()
    brief = " ".join(readme.split("### Before you deploy: `canaryd check`", 1)[1].split())
    assert brief.startswith(".venv/bin/canaryd check --kubeconfig")
    assert "exit 2 naming what is missing" in brief
    assert "exit 1 naming why canaryd would be blind, else 0" in brief
    for verb in KIND_VERBS:
        assert verb in brief.split("###", 1)[0], verb
    assert "canaryd --version" in readme


BOTH_SPELLINGS = """\
kubernetes.operator.watched.namespaces: team-a
kubernetes:
  operator:
    watched:
      namespaces: team-b
"""


async def test_a_key_written_both_flat_and_nested_still_gets_the_nested_key_warning(
    kube, kubeconfig, tmp_path, capsys
):
    """The operator's flink-conf.yaml parser sees the flat line only; canaryd takes the
    later spelling: here they watch different namespaces, which only the warning says."""
    conf = tmp_path / "flink-conf.yaml"
    conf.write_text(BOTH_SPELLINGS)
    settings = load_settings(["--operator-config", str(conf)], {})
    assert settings.namespaces == frozenset({"team-b"})  # the operator watches team-a
    records = await start_records(kube, kubeconfig, conf, capsys)
    (warning,) = events(records, "operator_config_nested_keys")
    assert warning["flat_keys"] == ["kubernetes.operator.watched.namespaces"], warning
