"""The operator's own config file as the operator reads it: which file of a conf
directory, its keys as flat names, its Prometheus reporter. ``ConfigError`` is here, at
the bottom of configuration: reading the file raises it as a bad flag does."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml


class ConfigError(Exception):
    """Bad configuration: canaryd exits with status 2 and this message on one line."""


# The operator's Flink 1.20 (GlobalConfiguration.loadConfiguration) reads the legacy
# flink-conf.yaml when it exists, else config.yaml.
CONFIG_FILE_NAMES = ("flink-conf.yaml", "config.yaml")
REPORTERS = "kubernetes.operator.metrics.reporter."
PROM_FACTORY = "org.apache.flink.metrics.prometheus.PrometheusReporterFactory"


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` → ``{"a.b": 1}``."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def operator_config_files(path: Path) -> tuple[Path, list[Path]]:
    """The file the operator reads (``path``, or in a directory its first of
    CONFIG_FILE_NAMES), and the ones it ignores."""
    try:
        if not path.is_dir():
            return path, []
        found = [path / name for name in CONFIG_FILE_NAMES if (path / name).is_file()]
    except OSError as err:  # PermissionError on a directory canaryd may not search
        raise ConfigError(f"cannot read operator config {path}: {err.strerror or err}") from err
    if not found:
        raise ConfigError(
            f"operator config directory {path} has no {' or '.join(CONFIG_FILE_NAMES)}"
        )
    return found[0], found[1:]


class _FlinkYamlLoader(yaml.SafeLoader):
    """Only ``true`` and ``false`` are booleans (YAML 1.2, as Flink reads config.yaml):
    PyYAML's YAML 1.1 ``yes``, ``on`` and ``off`` are refused by the operator itself."""


_FlinkYamlLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_FlinkYamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def _load(path: Path) -> tuple[Path, Mapping[str, Any]]:
    path = operator_config_files(path)[0]
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_FlinkYamlLoader)
    except OSError as err:
        raise ConfigError(f"cannot read operator config {path}: {err.strerror or err}") from err
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"operator config {path} is not UTF-8 text (byte {err.start}: "
            f"{err.object[err.start : err.start + 1]!r})"
        ) from err
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"operator config {path} is not valid YAML{where}") from err
    if not isinstance(data, Mapping | None):
        raise ConfigError(f"operator config {path} must be a mapping of keys to values")
    return path, data or {}


def read_operator_config(path: Path) -> dict[str, Any]:
    """The keys of the file the operator reads, flat or nested, as flat names."""
    return flatten(_load(path)[1])


def nested_operator_keys(path: Path) -> tuple[Path, list[str]]:
    """The file the operator reads, and the operator's keys it writes nested, as flat
    names: canaryd reads both spellings, the operator's flink-conf.yaml parser flat
    ones only (nested_keys_why)."""
    path, data = _load(path)
    nested = [
        name
        for key, value in data.items()
        if isinstance(value, Mapping)
        for name in flatten(value, f"{key}.")
        if name.startswith("kubernetes.operator.")
    ]
    return path, sorted(nested)


def nested_keys_why(read: Path) -> str:
    if read.name == "flink-conf.yaml":
        return (
            "the operator reads flink-conf.yaml with Flink's flat parser, one 'key: value' "
            "line at a time: it does not see nested keys, canaryd does; write these flat"
        )
    return (
        "Flink 1.19+ and 2 read nested keys in config.yaml, the operator's flink-conf.yaml "
        "parser does not: write these flat so that every reader of the file sees them"
    )


def prometheus_reporter(flat: Mapping[str, Any]) -> str | None:
    """The ``<name>`` whose ``REPORTERS<name>.factory.class`` is Prometheus's, or None."""
    for key, value in sorted(flat.items()):
        name = key.removeprefix(REPORTERS).removesuffix(".factory.class")
        if key == f"{REPORTERS}{name}.factory.class" and str(value).strip() == PROM_FACTORY:
            return name
    return None


def reporter_url(flat: Mapping[str, Any]) -> str:
    """The reporter on this host: its port, or a range's first (a single operator
    process takes it), else Flink's 9249 (PrometheusReporterOptions.PORT)."""
    name, port = prometheus_reporter(flat), "9249"
    first = str(flat.get(f"{REPORTERS}{name}.port", "")).split(",")[0].split("-")[0].strip()
    if name is not None and first.isdigit() and 0 < int(first) < 65536:
        port = first
    return f"http://127.0.0.1:{port}/metrics"
