"""The operator's own config file as the operator reads it: which file of a conf
directory, its keys as flat names, its Prometheus reporter. ``ConfigError`` is here, at
the bottom of configuration: reading the file raises it as a bad flag does."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import structlog
import yaml

if TYPE_CHECKING:
    from canaryd.config import Settings

log = structlog.get_logger("canaryd.config")


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


class OperatorConfig(NamedTuple):
    """The file the operator reads, as canaryd reads it (both spellings of a key)."""

    file: Path  # the file the operator reads: the one given, or a directory's first
    flat: dict[str, Any]  # its keys, flat or nested, as flat names
    nested: list[str]  # the operator's keys it writes nested (the operator sees none)
    ignored: list[Path]  # a directory's other CONFIG_FILE_NAMES


def read_operator_config(path: Path) -> OperatorConfig:
    found = [path]
    try:
        if path.is_dir():
            found = [path / name for name in CONFIG_FILE_NAMES if (path / name).is_file()]
        if not found:
            raise ConfigError(
                f"operator config directory {path} has no {' or '.join(CONFIG_FILE_NAMES)}"
            )
        data = yaml.load(found[0].read_text(encoding="utf-8"), Loader=_FlinkYamlLoader)
    except OSError as err:  # PermissionError on a directory canaryd may not search too
        raise ConfigError(f"cannot read operator config {found[0]}: {err.strerror or err}") from err
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"operator config {found[0]} is not UTF-8 text (byte {err.start}: "
            f"{err.object[err.start : err.start + 1]!r})"
        ) from err
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"operator config {found[0]} is not valid YAML{where}") from err
    if not isinstance(data, Mapping | None):
        raise ConfigError(f"operator config {found[0]} must be a mapping of keys to values")
    data = data or {}
    # Written under a mapping, whether or not also written flat (the operator reads the flat).
    mappings = {key: value for key, value in data.items() if isinstance(value, Mapping)}
    nested = [key for key in flatten(mappings) if key.startswith("kubernetes.operator.")]
    return OperatorConfig(found[0], flatten(data), sorted(nested), found[1:])


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


def reporter_url(flat: Mapping[str, Any]) -> str | None:
    """The Prometheus reporter (the ``<name>`` whose ``REPORTERS<name>.factory.class`` is
    Prometheus's) on this host: its port, or a range's first (a single operator process
    takes it), else Flink's 9249 (PrometheusReporterOptions.PORT); None without one."""
    for key, value in sorted(flat.items()):
        name = key.removeprefix(REPORTERS).removesuffix(".factory.class")
        if key == f"{REPORTERS}{name}.factory.class" and str(value).strip() == PROM_FACTORY:
            first = str(flat.get(f"{REPORTERS}{name}.port", "")).split(",")[0].split("-")[0].strip()
            port = first if first.isdigit() and 0 < int(first) < 65536 else "9249"
            return f"http://127.0.0.1:{port}/metrics"
    return None


def say_operator_config(settings: Settings) -> str | None:
    """Say at start which operator config file is read (returned), warning of what the
    operator reads otherwise (docs/CONFIGURATION.md, ``--operator-config``); with
    operator-metrics, where it reads the reporter, warning when the file sets none up
    (canaries then stay ``pending``)."""
    path, read, configured = settings.operator_config, None, None
    if path is not None:
        read, flat, nested, ignored = read_operator_config(path)
        if ignored:
            log.warning(
                "operator_config_ignored",
                read=str(read),
                ignored=[str(file) for file in ignored],
                why="the operator's Flink 1.20 reads flink-conf.yaml when it exists, "
                "and config.yaml only without it",
            )
        if nested:
            why = nested_keys_why(read)
            log.warning("operator_config_nested_keys", file=str(read), flat_keys=nested, why=why)
        configured = reporter_url(flat) is not None
    if settings.reconciled_by == "operator-metrics":
        hint = None
        if configured is False:
            hint = f"{path} sets up no Prometheus reporter: add {REPORTERS}prom.factory.class: "
            hint += f"{PROM_FACTORY} (and .port)"
        (log.warning if hint else log.info)(
            "operator_metrics",
            url=settings.operator_metrics_url,
            reporter_configured=configured,
            hint=hint,
        )
    return None if read is None else str(read)
