"""The operator's own config file: which file the operator reads, how, and what canaryd
takes from it (watched namespaces, the dynamic flag, the cycle, the probe port, the
Prometheus reporter).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from canaryd.config.values import ConfigError

# The operator's own keys (flink-kubernetes-operator KubernetesOperatorConfigOptions).
KEY_NAMESPACES = "kubernetes.operator.watched.namespaces"
KEY_DYNAMIC = "kubernetes.operator.dynamic.namespaces.enabled"
KEY_TIMEOUT = "kubernetes.operator.health.canary.resource.timeout"
KEY_PORT = "kubernetes.operator.health.probe.port"
KEY_CHECK_INTERVAL = "kubernetes.operator.dynamic.config.check.interval"
REPORTER_PORT_KEY = "kubernetes.operator.metrics.reporter.<name>.port"
PROM_FACTORY = "org.apache.flink.metrics.prometheus.PrometheusReporterFactory"
DEFAULT_REPORTER_PORT = 9249
"""Flink's Prometheus reporter's default port (PrometheusReporterOptions.PORT)."""
# The operator's "watch all namespaces" value (JOSDK Constants.WATCH_ALL_NAMESPACES).
ALL_NAMESPACES_VALUE = "JOSDK_ALL_NAMESPACES"


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` → ``{"a.b": 1}``: config.yaml's nested keys as flat ones."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


# What the operator's Flink (1.19 and 1.20: GlobalConfiguration.loadConfiguration) reads
# in a conf directory, in order: the legacy flink-conf.yaml when it exists, else
# config.yaml. Flink 2 reads config.yaml only; the operator's 1.x releases run on 1.20.
CONFIG_FILE_NAMES = ("flink-conf.yaml", "config.yaml")


def operator_config_files(path: Path) -> tuple[Path, list[Path]]:
    """The file the operator reads, and the ones it ignores: the file itself, or in a
    directory (the operator's /opt/flink/conf) its flink-conf.yaml, else its
    config.yaml, as the operator's Flink decides."""
    try:
        is_dir = path.is_dir()
        found = [path / name for name in CONFIG_FILE_NAMES if is_dir and (path / name).is_file()]
    except OSError as err:  # PermissionError on a directory canaryd may not search
        raise ConfigError(f"cannot read operator config {path}: {err.strerror or err}") from err
    if is_dir:
        if found:
            return found[0], found[1:]
        raise ConfigError(
            f"operator config directory {path} has no {' or '.join(CONFIG_FILE_NAMES)}"
        )
    return path, []


def operator_config_file(path: Path) -> Path:
    """The file the operator reads (``operator_config_files``)."""
    return operator_config_files(path)[0]


class _FlinkYamlLoader(yaml.SafeLoader):
    """YAML with only ``true`` and ``false`` as booleans (YAML 1.2, as Flink's parser
    reads config.yaml; its legacy flink-conf.yaml parser keeps every value a string).
    PyYAML's YAML 1.1 rules would read ``yes``, ``no``, ``on`` and ``off`` as booleans
    that the operator itself refuses."""


_FlinkYamlLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_FlinkYamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def _load_operator_yaml(path: Path) -> tuple[Path, Mapping[str, Any]]:
    """The file the operator reads and its YAML mapping (empty when the file is)."""
    path = operator_config_file(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"cannot read operator config {path}: {err.strerror or err}") from err
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"operator config {path} is not UTF-8 text (byte {err.start}: "
            f"{err.object[err.start : err.start + 1]!r})"
        ) from err
    try:
        data = yaml.load(text, Loader=_FlinkYamlLoader)  # a SafeLoader: no object tags
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"operator config {path} is not valid YAML{where}") from err
    if data is None:
        return path, {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"operator config {path} must be a mapping of keys to values")
    return path, data


def read_operator_config(path: Path) -> dict[str, Any]:
    """Read flink-conf.yaml (flat keys) or config.yaml (nested keys) into flat keys."""
    path, data = _load_operator_yaml(path)
    flat = flatten(data)
    for key in (KEY_NAMESPACES, KEY_DYNAMIC, KEY_TIMEOUT, KEY_PORT, KEY_CHECK_INTERVAL):
        if any(name.startswith(f"{key}.") for name in flat):
            raise ConfigError(
                f"operator config {path}: {key} must be a value (namespaces: a "
                "comma-separated string or a list), not a mapping"
            )
    return flat


OPERATOR_PREFIX = "kubernetes.operator."


def nested_operator_keys(path: Path) -> tuple[Path, list[str]]:
    """The file the operator reads, and the operator's keys (``kubernetes.operator.*``)
    it writes nested, as Flink 2's config.yaml does (``kubernetes: {operator: {watched:
    {namespaces: ...}}}``), each as the flat key the operator reads. canaryd reads
    both spellings; the operator's flink-conf.yaml parser reads flat ``key: value``
    lines only, so there the two would disagree (on the watched namespaces, say)."""
    path, data = _load_operator_yaml(path)
    nested = [
        name
        for key, value in data.items()
        if isinstance(value, Mapping)
        for name in flatten(value, f"{key}.")
        if name.startswith(OPERATOR_PREFIX)
    ]
    return path, sorted(nested)


def nested_keys_why(read: Path) -> str:
    """Why nested keys in the file the operator reads are worth a warning."""
    if read.name == "flink-conf.yaml":
        return (
            "the operator reads flink-conf.yaml with Flink's flat parser, one 'key: value' "
            "line at a time: it does not see nested keys, canaryd does; write these flat"
        )
    return (
        "Flink 1.19+ and 2 read nested keys in config.yaml, the operator's flink-conf.yaml "
        "parser does not: write these flat so that every reader of the file sees them"
    )


def parse_namespaces(value: Any) -> frozenset[str] | None:
    """Comma-separated namespaces; empty, null (a YAML key with no value) or
    JOSDK_ALL_NAMESPACES means all (None), as in the operator."""
    if value is None:
        return None
    items = value if isinstance(value, list | tuple) else str(value).split(",")
    names = {str(item).strip() for item in items if str(item).strip()}
    if not names or ALL_NAMESPACES_VALUE in names:
        return None
    for name in names:
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", name):
            raise ConfigError(f"invalid namespace name {name!r}")
    return frozenset(names)


def reporter_url(flat: Mapping[str, Any]) -> str:
    """The operator's Prometheus reporter on this host, as its config file sets it up
    (``kubernetes.operator.metrics.reporter.<name>.factory.class`` the Prometheus
    factory and ``...<name>.port`` a port or a range, whose first port a single
    operator process takes), else Flink's default port."""
    port = DEFAULT_REPORTER_PORT
    prefix = "kubernetes.operator.metrics.reporter."
    for key, value in sorted(flat.items()):
        if not (key.startswith(prefix) and key.endswith(".factory.class")):
            continue
        if str(value).strip() != PROM_FACTORY:
            continue
        name = key[len(prefix) : -len(".factory.class")]
        first = str(flat.get(f"{prefix}{name}.port", "")).split(",")[0].split("-")[0].strip()
        if first.isdigit() and 0 < int(first) < 65536:
            port = int(first)
        break
    return f"http://127.0.0.1:{port}/metrics"


def has_prometheus_reporter(flat: Mapping[str, Any]) -> bool:
    """Does the operator config set up Flink's Prometheus reporter?"""
    prefix = "kubernetes.operator.metrics.reporter."
    return any(
        key.startswith(prefix) and key.endswith(".factory.class") and str(v).strip() == PROM_FACTORY
        for key, v in flat.items()
    )
