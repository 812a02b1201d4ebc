"""Configuration: Flink durations, precedence, the operator's config file, bad values."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from canaryd.config import ConfigError, Settings, load_settings
from canaryd.config.parse import parse_duration


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("500ms", 0.5),
        ("500 ms", 0.5),
        ("2 s", 2.0),
        ("2s", 2.0),
        ("1 min", 60.0),
        ("1min", 60.0),
        ("5m", 300.0),
        ("1 h", 3600.0),
        ("1d", 86400.0),
        ("60000", 60.0),  # a bare number is milliseconds, as in Flink
        ("PT1M", 60.0),
        ("PT0.5S", 0.5),
        ("P1DT1H", 90000.0),
        ("pt30s", 30.0),
        ("10 SECONDS", 10.0),
        ("250 millis", 0.25),
    ],
)
def test_flink_durations(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "min", "5x", "-1 s", "1 min 5 s", "P", "PT", "1e3"])
def test_bad_durations_are_config_errors(text):
    with pytest.raises(ConfigError):
        parse_duration(text)


def test_defaults_match_design():
    settings = load_settings([], {})
    assert settings == Settings()
    assert settings.timeout == 60.0 and settings.port == 8085
    assert settings.host == "0.0.0.0" and settings.config_check_interval == 300.0
    assert settings.kinds == ("flinkdeployments", "flinksessionjobs")
    assert settings.label == "flink.apache.org/canary"
    assert settings.namespaces is None and settings.log_format == "json"


FLAT = """\
kubernetes.operator.health.canary.resource.timeout: 2 min
kubernetes.operator.health.probe.port: 9000
kubernetes.operator.watched.namespaces: default,canary
kubernetes.operator.dynamic.namespaces.enabled: true
kubernetes.operator.dynamic.config.check.interval: 30 s
"""

NESTED = """\
kubernetes:
  operator:
    health:
      canary:
        resource:
          timeout: 2 min
      probe:
        port: 9000
    watched:
      namespaces: default,canary
    dynamic:
      namespaces:
        enabled: true
      config:
        check:
          interval: 30 s
"""


@pytest.mark.parametrize("text", [FLAT, NESTED], ids=["flink-conf.yaml", "config.yaml"])
def test_operator_config_file_flat_or_nested(tmp_path, text):
    path = tmp_path / "conf.yaml"
    path.write_text(text)
    settings = load_settings(["--operator-config", str(path)], {})
    assert settings.timeout == 120.0 and settings.port == 9000
    assert settings.namespaces == frozenset({"default", "canary"})
    assert "namespaces" in settings.from_file and settings.dynamic_namespaces
    assert settings.config_check_interval == 30.0


def test_precedence_flag_over_env_over_file_over_default(tmp_path):
    path = tmp_path / "flink-conf.yaml"
    path.write_text(FLAT)
    env = {"CANARYD_OPERATOR_CONFIG": str(path), "CANARYD_TIMEOUT": "30 s", "CANARYD_PORT": "9100"}
    assert load_settings([], env).timeout == 30.0  # env over file
    assert load_settings([], env).port == 9100
    assert load_settings(["--timeout", "10s"], env).timeout == 10.0  # flag over env
    del env["CANARYD_TIMEOUT"]
    assert load_settings([], env).timeout == 120.0  # file over default
    assert load_settings([], {}).timeout == 60.0


@pytest.mark.parametrize(
    "names", [["config.yaml"], ["flink-conf.yaml"], ["flink-conf.yaml", "config.yaml"]]
)
def test_operator_config_directory_reads_what_the_operator_reads(tmp_path, names):
    """Flink 1.19 and 1.20 (GlobalConfiguration.loadConfiguration, the operator's 1.x
    releases run on 1.20) read flink-conf.yaml when it exists, else config.yaml."""
    for name in names:
        (tmp_path / name).write_text(FLAT.replace("2 min", f"{len(name)} s"))
    settings = load_settings(["--operator-config", str(tmp_path)], {})
    assert settings.timeout == float(len(names[0]))


def test_operator_config_directory_without_a_config_file(tmp_path):
    with pytest.raises(ConfigError, match=r"has no flink-conf\.yaml or config\.yaml"):
        load_settings(["--operator-config", str(tmp_path)], {})


def test_watch_namespaces_wins_over_the_file_and_turns_off_following(tmp_path):
    path = tmp_path / "flink-conf.yaml"
    path.write_text(FLAT)
    settings = load_settings(["--operator-config", str(path)], {"WATCH_NAMESPACES": "prod"})
    assert settings.namespaces == frozenset({"prod"})
    assert "namespaces" not in settings.from_file


def test_namespaces_repeatable_and_comma_separated():
    settings = load_settings(["--namespace", "a,b", "--namespace", "c"], {})
    assert settings.namespaces == frozenset({"a", "b", "c"})


@pytest.mark.parametrize("value", ["", "JOSDK_ALL_NAMESPACES", " , "])
def test_all_namespaces_values(tmp_path, value):
    path = tmp_path / "flink-conf.yaml"
    path.write_text(f'kubernetes.operator.watched.namespaces: "{value}"\n')
    assert load_settings(["--operator-config", str(path)], {}).namespaces is None


@pytest.mark.parametrize(
    "text",
    [
        "kubernetes.operator.watched.namespaces:\n",
        "kubernetes.operator.watched.namespaces: null\n",
        "kubernetes:\n  operator:\n    watched:\n      namespaces: ~\n",
    ],
    ids=["empty", "null", "nested-tilde"],
)
def test_a_null_watched_namespaces_means_all_namespaces(tmp_path, text):
    """As in the operator (an unset key is all namespaces), not "invalid namespace name
    'None'"."""
    path = tmp_path / "config.yaml"
    path.write_text(text + "kubernetes.operator.dynamic.namespaces.enabled: true\n")
    settings = load_settings(["--operator-config", str(path)], {})
    assert settings.namespaces is None and "namespaces" in settings.from_file


def test_kinds_and_label():
    settings = load_settings(["--kind", "FlinkSessionJobs", "--label", "example.com/canary"], {})
    assert settings.kinds == ("flinksessionjobs",)
    assert settings.label == "example.com/canary"
    assert load_settings([], {"CANARYD_KINDS": "flinkdeployments"}).kinds == ("flinkdeployments",)


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--timeout", "soon"], {}, "invalid duration"),
        (["--timeout", "0"], {}, "greater than zero"),
        (["--port", "70000"], {}, "0-65535"),
        ([], {"CANARYD_PORT": "http"}, "port"),
        (["--kind", "pods"], {}, "invalid kind pods"),
        # One kind in two versions is the same objects: bumped twice a cycle.
        (
            ["--kind", "widgets.example.com/v1,widgets.example.com/v1beta1"],
            {},
            "kind widgets.example.com given twice, as v1 and v1beta1: give one version",
        ),
        (
            [],
            {"CANARYD_KINDS": "flinkdeployments,flinkdeployments.flink.apache.org/v1beta2"},
            "kind flinkdeployments.flink.apache.org given twice, as v1beta1 and v1beta2",
        ),
        (["--namespace", "Bad_Name"], {}, "invalid namespace"),
        (["--log-format", "xml"], {}, "log format"),
        (["--log-level", "loud"], {}, "log level"),
        (["--label", "not a label"], {}, "invalid label"),
        (["--operator-config", "/nonexistent/flink-conf.yaml"], {}, "cannot read"),
        (["--bogus"], {}, "unrecognized arguments"),
    ],
)
def test_bad_configuration_is_one_clear_error(argv, env, message):
    with pytest.raises(ConfigError, match=message):
        load_settings(argv, env)


def test_operator_config_that_is_not_yaml_or_not_a_mapping(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("key: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_settings(["--operator-config", str(bad)], {})
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_settings(["--operator-config", str(bad)], {})
    bad.write_text("kubernetes.operator.dynamic.namespaces.enabled: maybe\n")
    with pytest.raises(ConfigError, match="true or false"):
        load_settings(["--operator-config", str(bad)], {})


def test_an_operator_config_key_given_as_a_mapping_names_the_file_and_key(tmp_path):
    """A mapping where the operator reads a value (``port: {a: 1}``) is not read as
    "no value": it exits 2 naming the file and the key, unless a flag overrides it."""
    conf = tmp_path / "config.yaml"
    conf.write_text("kubernetes.operator.health.probe.port:\n  number: 9000\n")
    with pytest.raises(ConfigError) as caught:
        load_settings(["--operator-config", str(conf)], {})
    assert str(caught.value).startswith(
        f"{conf}: kubernetes.operator.health.probe.port: must be a value"
    ), caught.value
    assert load_settings(["--operator-config", str(conf), "--port", "9100"], {}).port == 9100


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "canaryd", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_cli_bad_configuration_exits_2_with_one_line_and_no_traceback():
    result = run_cli("--timeout", "5 fortnights")
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("canaryd: --timeout: invalid duration '5 fortnights'")
    assert "Traceback" not in result.stderr


def test_cli_missing_kubeconfig_exits_2(tmp_path: Path):
    result = run_cli(
        "--kubeconfig",
        str(tmp_path / "missing"),
        "--port",
        "0",
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "no kubeconfig at" in lines[0] and "missing" in lines[0]
    assert "Traceback" not in result.stderr


def test_cli_help_and_version():
    assert run_cli("--help").returncode == 0
    version = run_cli("--version")
    assert version.returncode == 0 and version.stdout.startswith("canaryd ")


@pytest.mark.parametrize(
    ("argv", "env", "file", "says"),
    [
        (["--timeout", "ten seconds"], {}, "", "--timeout: invalid duration 'ten seconds'"),
        ([], {"CANARYD_TIMEOUT": "30x"}, "", "CANARYD_TIMEOUT=30x: invalid duration '30x'"),
        (
            [],
            {},
            "kubernetes.operator.health.canary.resource.timeout: ten seconds\n",
            "{file}: kubernetes.operator.health.canary.resource.timeout: invalid duration "
            "'ten seconds'",
        ),
        (["--port", "99999"], {}, "", "--port: invalid port 99999: expected 0-65535"),
        (
            [],
            {},
            "kubernetes.operator.health.probe.port: 99999\n",
            "{file}: kubernetes.operator.health.probe.port: invalid port 99999",
        ),
        # What the kubelet sets for a Service named canaryd in the pod's namespace.
        (
            [],
            {"CANARYD_PORT": "tcp://10.0.0.1:8085"},
            "",
            "CANARYD_PORT=tcp://10.0.0.1:8085: looks like a Kubernetes service link (a "
            "Service named canaryd in this namespace): set enableServiceLinks: false on the "
            "pod, or --port",
        ),
        ([], {"WATCH_NAMESPACES": "Bad_Name"}, "", "WATCH_NAMESPACES=Bad_Name: invalid namespace"),
    ],
)
def test_a_bad_value_names_where_it_came_from(tmp_path, argv, env, file, says):
    """Issue 42: the flag, the environment variable and its value, or the operator
    config file and its key."""
    conf = tmp_path / "flink-conf.yaml"
    conf.write_text(file)
    argv = [*argv, "--operator-config", str(conf)] if file else argv
    with pytest.raises(ConfigError) as caught:
        load_settings(argv, env)
    assert str(caught.value).startswith(says.format(file=conf)), caught.value


def test_a_bad_value_in_the_file_that_a_flag_overrides_is_not_read(tmp_path):
    conf = tmp_path / "flink-conf.yaml"
    conf.write_text("kubernetes.operator.health.canary.resource.timeout: ten seconds\n")
    settings = load_settings(["--operator-config", str(conf), "--timeout", "30s"], {})
    assert settings.timeout == 30.0 and "timeout" not in settings.from_file


def test_the_service_link_clash_exits_2_with_one_line():
    result = run_cli(env={**os.environ, "CANARYD_PORT": "tcp://10.0.0.1:8085"})
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        "canaryd: CANARYD_PORT=tcp://10.0.0.1:8085: looks like a Kubernetes service link (a "
        "Service named canaryd in this namespace): set enableServiceLinks: false on the pod, "
        "or --port"
    ], result.stderr


def test_check_has_its_own_usage():
    """`canaryd check --help` printed the daemon's usage."""
    result = run_cli("check", "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: canaryd check [-h]"), result.stdout
    assert "canaryd check checks the configuration and asks the API server" in result.stdout
    assert "--timeout DURATION" in result.stdout  # the daemon's flags, as it reads them
    daemon = run_cli("--help").stdout
    assert daemon.startswith("usage: canaryd [-h]") and "Canary health checks" in daemon
