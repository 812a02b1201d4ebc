"""Configuration from text, and the operator's config file as the operator reads it:
durations as Flink writes them, booleans as Flink reads them, names, kinds, URLs, ports;
which file of a conf directory, its keys as flat names, its Prometheus reporter. Every
one raises ``ConfigError`` as a bad flag does."""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import yaml


class ConfigError(Exception):
    """Bad configuration: canaryd exits with status 2 and this message on one line."""


_UNITS = {
    **dict.fromkeys(["ns", "nano", "nanos", "nanosecond", "nanoseconds"], 1e-9),
    **dict.fromkeys(["µs", "us", "micro", "micros", "microsecond", "microseconds"], 1e-6),
    **dict.fromkeys(["ms", "milli", "millis", "millisecond", "milliseconds"], 1e-3),
    **dict.fromkeys(["s", "sec", "secs", "second", "seconds"], 1.0),
    **dict.fromkeys(["m", "min", "mins", "minute", "minutes"], 60.0),
    **dict.fromkeys(["h", "hour", "hours"], 3600.0),
    **dict.fromkeys(["d", "day", "days"], 86400.0),
}
_FLINK_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zµ]*)\s*$", re.IGNORECASE)
_ISO_RE = re.compile(
    r"^P(?:(\d+(?:\.\d+)?)D)?(?:T(?:(\d+(?:\.\d+)?)H)?(?:(\d+(?:\.\d+)?)M)?(?:(\d+(?:\.\d+)?)S)?)?$",
    re.IGNORECASE,
)


def parse_duration(text: Any, floor: float = 0.0, bare_floor: float = 0.0) -> float:
    """Flink's duration syntax (TimeUtils.parseDuration: a bare number is milliseconds)
    or ISO-8601 (``PT1M``), in seconds. With a ``floor``, at least that, and a bare
    number (``CANARYD_LEASE_DURATION=15`` is 15 ms) at least ``bare_floor``."""
    value = str(text).strip()
    iso, flink = _ISO_RE.match(value), _FLINK_RE.match(value)
    if iso and any(iso.groups()):
        days, hours, minutes, seconds = (float(g) if g else 0.0 for g in iso.groups())
        seconds += days * 86400 + hours * 3600 + minutes * 60
    elif not flink:
        raise ConfigError(f"invalid duration {value!r}: expected e.g. '500 ms', '1 min', 'PT1M'")
    elif (unit := flink.group(2).lower()) and unit not in _UNITS:
        raise ConfigError(
            f"invalid duration {value!r}: unknown unit {unit!r} (use ns, us, ms, s, min/m, h or d)"
        )
    else:
        seconds = float(flink.group(1)) * _UNITS[unit] if unit else float(flink.group(1)) / 1000
    bare = value.replace(".", "", 1).isdigit()
    if not math.isfinite(seconds):
        raise ConfigError(f"invalid duration {value!r}: too large")
    if floor and seconds <= 0:
        raise ConfigError(f"duration must be greater than zero, got {value!r}")
    if seconds < floor:
        hint = f" (a bare number is milliseconds: write '{value}s')" if bare else ""
        raise ConfigError(
            f"{value!r} is {seconds * 1000:g} ms, below its floor of {floor:g} s{hint}"
        )
    if bare and seconds < bare_floor:
        raise ConfigError(
            f"{value!r} is {seconds * 1000:g} ms: a bare number is milliseconds; give a "
            f"unit, e.g. '{value}s' (or '{value}ms' for a cycle below a second)"
        )
    return seconds


def duration(floor: float, bare_floor: float = 0.0) -> Callable[[Any], float]:
    """The parser of a duration of at least ``floor`` seconds."""
    return functools.partial(parse_duration, floor=floor, bare_floor=bare_floor)


def parse_bool(value: Any) -> bool:
    """As Flink reads the operator's own booleans (ConfigurationUtils.convertToBoolean)."""
    text = str(value).strip().lower()
    if text not in ("true", "false"):
        raise ConfigError(f"expected true or false, got {str(value).strip()!r}")
    return text == "true"


def matching(what: str, pattern: str, why: str = "") -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        text = str(value).strip()
        if not re.fullmatch(pattern, text):
            raise ConfigError(f"invalid {what} {text!r}{why}")
        return text

    return parse


def choice(what: str, *choices: str, **aliases: str) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        chosen = str(value).strip().lower()
        chosen = aliases.get(chosen, chosen)
        if chosen not in choices:
            raise ConfigError(f"invalid {what} {value!r}: expected {' or '.join(choices)}")
        return chosen

    return parse


def dns_name(what: str) -> Callable[[Any], str]:
    return matching(what, r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", ": not a DNS name")


def path(value: Any) -> Path | None:
    return Path(value) if value else None  # empty: none


namespace = matching("namespace name", r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
label = matching(
    "label key", r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
)
FLINK_KINDS = ("flinkdeployments", "flinksessionjobs")
_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
# PLURAL.GROUP/VERSION: a DNS label, a DNS subdomain with a dot, a version.
CUSTOM_KIND = re.compile(rf"{_LABEL}(\.{_LABEL}){{2,}}/v[0-9]+((alpha|beta)[0-9]+)?")


def namespaces(value: Any) -> frozenset[str] | None:
    """Comma-separated (or the file's list); empty, null or JOSDK_ALL_NAMESPACES (JOSDK's
    Constants.WATCH_ALL_NAMESPACES) mean all (None), as in the operator."""
    items = value if isinstance(value, list | tuple) else str(value or "").split(",")
    names = {str(item).strip() for item in items} - {""}
    if not names or "JOSDK_ALL_NAMESPACES" in names:
        return None
    return frozenset(namespace(name) for name in names)


def kinds(value: str) -> tuple[str, ...]:
    full = {k: f"{k}.flink.apache.org/v1beta1" for k in FLINK_KINDS}
    short = {name: k for k, name in full.items()}
    given = (item.strip().lower() for item in value.split(","))
    kinds = tuple(dict.fromkeys(short.get(k, k) for k in given if k))
    unknown = sorted(k for k in kinds if k not in FLINK_KINDS and not CUSTOM_KIND.fullmatch(k))
    if unknown or not kinds:
        raise ConfigError(
            f"invalid kind {', '.join(unknown) or '(empty)'}: expected "
            f"{' and/or '.join(FLINK_KINDS)}, or any namespaced custom resource as "
            "PLURAL.GROUP/VERSION (e.g. widgets.example.com/v1)"
        )
    versions: dict[str, list[str]] = {}
    for kind in kinds:
        resource, _, version = full.get(kind, kind).partition("/")
        versions.setdefault(resource, []).append(version)
    for resource, found in sorted(versions.items()):
        if len(found) > 1:
            raise ConfigError(
                f"kind {resource} given twice, as {' and '.join(found)}: give one version "
                "(every version serves the same objects, which would be bumped twice a cycle)"
            )
    return kinds


def metrics_url(value: str) -> str:
    url = value.strip()
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 -- raises on a bad port
    except ValueError as err:
        raise ConfigError(f"invalid operator metrics URL {url!r}: {err}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"invalid operator metrics URL {url!r}: expected http(s)://HOST:PORT/PATH"
        )
    return url


def port(value: Any) -> int:
    text = str(value).strip()
    if text.startswith("tcp://"):  # the kubelet's, for a Service named canaryd
        raise ConfigError(
            "looks like a Kubernetes service link (a Service named canaryd in this "
            "namespace): set enableServiceLinks: false on the pod, or --port"
        )
    if not text.isdecimal() or int(text) > 65535:
        raise ConfigError(f"invalid port {text}: expected 0-65535")
    return int(text)


def account(value: str) -> tuple[str, str]:
    namespace, slash, name = value.strip().partition("/")
    if not slash:
        raise ConfigError(f"invalid operator account {value!r}: expected NAMESPACE/NAME")
    namespace = dns_name("operator account namespace")(namespace)
    return namespace, dns_name("operator account name")(name)


# ---------------------------------------------- the operator's own config file

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
