"""Flags and environment, resolved with the operator config file into ``Settings``.

Precedence: flag > environment > the operator's config file > default; every value is
checked here, and a bad one is a ``ConfigError``. Each option is declared once, in
``OPTIONS``; the parser and the precedence are both made from that table.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from canaryd import __version__
from canaryd.config.operator_config import (
    KEY_CHECK_INTERVAL,
    KEY_DYNAMIC,
    KEY_NAMESPACES,
    KEY_PORT,
    KEY_TIMEOUT,
    REPORTER_PORT_KEY,
    operator_config_file,
    parse_namespaces,
    read_operator_config,
    reporter_url,
)
from canaryd.config.settings import (
    DEFAULT_KINDS,
    DEFAULT_LABEL,
    Settings,
    check_lease_timings,
)
from canaryd.config.values import ConfigError, parse_bool, parse_duration

KNOWN_KINDS = frozenset(DEFAULT_KINDS)
# PLURAL.GROUP/VERSION: a DNS label, a DNS subdomain with a dot, a version.
CUSTOM_KIND = re.compile(
    r"[a-z0-9]([-a-z0-9]*[a-z0-9])?\.[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)+"
    r"/v[0-9]+((alpha|beta)[0-9]+)?"
)
RECONCILED_BY = ("watch", "observed-generation", "operator-metrics")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_LEVEL_ALIASES = {"warn": "warning"}
"""Other names of levels, as Python's logging and most tools take them (any case)."""
MIN_TIMEOUT = 0.1
"""The shortest cycle canaryd keeps (seconds): below it bumps, watches and judging
cannot keep pace and verdicts flap. Below a second is for tests."""


# Converters: a flag's or environment variable's text (or the operator config file's
# value) to the Settings value, or a ConfigError.


def _label(value: str) -> str:
    label = value.strip()
    if not re.fullmatch(
        r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?", label
    ):
        raise ConfigError(f"invalid label key {label!r}")
    return label


def _kinds(value: str) -> tuple[str, ...]:
    flink = {f"{k}.flink.apache.org/v1beta1": k for k in DEFAULT_KINDS}
    given = (item.strip().lower() for item in value.split(","))
    parsed = tuple(dict.fromkeys(flink.get(k, k) for k in given if k))
    unknown = sorted(k for k in parsed if k not in KNOWN_KINDS and not CUSTOM_KIND.fullmatch(k))
    if unknown or not parsed:
        raise ConfigError(
            f"invalid kind {', '.join(unknown) or '(empty)'}: expected "
            f"{' and/or '.join(DEFAULT_KINDS)}, or any namespaced custom resource as "
            "PLURAL.GROUP/VERSION (e.g. widgets.example.com/v1)"
        )
    versions: dict[str, list[str]] = {}
    for key in parsed:
        resource, _, version = key.partition("/")
        if key in KNOWN_KINDS:
            resource, version = f"{key}.flink.apache.org", "v1beta1"
        versions.setdefault(resource, []).append(version)
    twice = {resource: found for resource, found in versions.items() if len(found) > 1}
    if twice:
        resource, found = sorted(twice.items())[0]
        raise ConfigError(
            f"kind {resource} given twice, as {' and '.join(found)}: give one version "
            "(every version serves the same objects, which would be bumped twice a cycle)"
        )
    return parsed


def _reconciled_by(value: str) -> str:
    chosen = value.strip().lower()
    if chosen not in RECONCILED_BY:
        raise ConfigError(f"invalid reconciled-by {value!r}: expected {' or '.join(RECONCILED_BY)}")
    return chosen


def _metrics_url(value: str) -> str:
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


def _positive_duration(value: Any) -> float:
    seconds = parse_duration(str(value))
    if seconds <= 0:
        raise ConfigError(f"duration must be greater than zero, got {value!r}")
    return seconds


def _timeout(value: Any) -> float:
    seconds = _positive_duration(value)
    text = str(value).strip()
    if seconds < 1.0 and text.replace(".", "", 1).isdigit():
        # Flink's syntax reads a bare number as milliseconds: CANARYD_TIMEOUT=300 is a
        # 300 ms cycle against a real cluster, rarely what was meant.
        raise ConfigError(
            f"{text!r} is {seconds * 1000:g} ms: a bare number is milliseconds; "
            f"give a unit, e.g. '{text}s' (or '{text}ms' for a cycle below a second)"
        )
    if seconds < MIN_TIMEOUT:
        raise ConfigError(
            f"{text!r} is {seconds * 1000:g} ms, below the "
            f"{MIN_TIMEOUT * 1000:g} ms cycle canaryd can keep"
        )
    return seconds


def _duration_at_least(floor: float, value: Any) -> float:
    """A duration of at least ``floor`` seconds, the shortest that makes sense. A bare
    number is milliseconds, as in Flink: without a floor ``CANARYD_LEASE_DURATION=15``
    is a 15 ms lease (hundreds of Lease requests a second) and
    ``CANARYD_CONFIG_CHECK_INTERVAL=5`` 179 discovery requests a second."""
    seconds = _positive_duration(value)
    if seconds < floor:
        text = str(value).strip()
        bare = (
            f" (a bare number is milliseconds: write '{text}s')"
            if text.replace(".", "", 1).isdigit()
            else ""
        )
        raise ConfigError(
            f"{text!r} is {seconds * 1000:g} ms, below its floor of {floor:g} s{bare}"
        )
    return seconds


def _not_empty(what: str, value: str) -> str:
    text = value.strip()
    if not text:
        raise ConfigError(f"invalid {what}: empty")
    return text


def _port(value: Any) -> int:
    try:
        port = int(str(value).strip())
    except ValueError:
        if str(value).startswith("tcp://"):  # the kubelet's, for a Service named canaryd
            raise ConfigError(
                "looks like a Kubernetes service link (a Service named canaryd in this "
                "namespace): set enableServiceLinks: false on the pod, or --port"
            ) from None
        raise ConfigError(f"invalid port {value!r}: expected a port number") from None
    if not 0 <= port <= 65535:
        raise ConfigError(f"invalid port {port}: expected 0-65535")
    return port


def _log_format(value: str) -> str:
    if value.lower() not in ("json", "console"):
        raise ConfigError(f"invalid log format {value!r}: expected json or console")
    return value.lower()


def _log_level(value: str) -> str:
    level = value.strip().lower()
    level = LOG_LEVEL_ALIASES.get(level, level)
    if level not in LOG_LEVELS:
        raise ConfigError(f"invalid log level {value!r}: expected one of {', '.join(LOG_LEVELS)}")
    return level


def _dns_name(what: str, value: str) -> str:
    name = value.strip()
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", name):
        raise ConfigError(f"invalid {what} {name!r}: not a DNS name")
    return name


def _account(value: str) -> tuple[str, str]:
    namespace, slash, name = value.strip().partition("/")
    if not slash:
        raise ConfigError(f"invalid operator account {value!r}: expected NAMESPACE/NAME")
    return _dns_name("operator account namespace", namespace), _dns_name(
        "operator account name", name
    )


@dataclass(frozen=True)
class Option:
    """One setting, declared once: ``canaryd --help`` and ``load_settings`` read it."""

    flag: str
    metavar: str | None
    """None: a switch, given or not (its environment variable: true or false)."""
    env: str
    convert: Callable[[Any], Any]
    """Text (or the file's value) to the Settings value; ConfigError when bad."""
    default: str
    """The default as ``--help`` tells it (``Settings`` holds the value)."""
    help: str
    key: str | None = None
    """The operator config file's key, read when neither flag nor environment is set."""
    many: bool = False
    """Repeatable: its values are joined with commas, as the environment gives them."""

    @property
    def full_help(self) -> str:
        key = f" [{self.key}]" if self.key else ""
        return f"{self.help} [env {self.env}]{key} (default: {self.default})"


OPTIONS = {
    "kubeconfig": Option(
        "--kubeconfig",
        "PATH",
        "KUBECONFIG",
        str,
        "in-cluster when KUBERNETES_SERVICE_HOST is set, else ~/.kube/config",
        "kubeconfig file",
    ),
    "context": Option(
        "--context", "NAME", "CANARYD_CONTEXT", str, "its current context", "kubeconfig context"
    ),
    "namespaces": Option(
        "--namespace",
        "NS",
        "WATCH_NAMESPACES",
        parse_namespaces,
        "all namespaces",
        "watched namespace, repeatable or comma-separated",
        key=KEY_NAMESPACES,
        many=True,
    ),
    "operator_config": Option(
        "--operator-config",
        "PATH",
        "CANARYD_OPERATOR_CONFIG",
        lambda path: Path(path) if path else None,  # empty: read where it runs, not followed
        "none",
        "the operator's flink-conf.yaml or config.yaml, or its conf directory",
    ),
    "label": Option(
        "--label",
        "KEY",
        "CANARYD_LABEL",
        _label,
        DEFAULT_LABEL,
        "canary label, value true in any case",
    ),
    "kinds": Option(
        "--kind",
        "PLURAL",
        "CANARYD_KINDS",
        _kinds,
        ",".join(DEFAULT_KINDS),
        "canary kinds, repeatable or comma-separated: Flink's plurals, or any namespaced "
        "custom resource as PLURAL.GROUP/VERSION",
        many=True,
    ),
    "reconciled_by": Option(
        "--reconciled-by",
        "|".join(RECONCILED_BY),
        "CANARYD_RECONCILED_BY",
        _reconciled_by,
        "watch",
        "a bump is reconciled when its generation is seen through the watch, when the "
        "canary's status.observedGeneration reaches it, or when the operator's own count "
        "of finished reconciles of the canary rose after it",
    ),
    "operator_metrics_url": Option(
        "--operator-metrics-url",
        "URL",
        "CANARYD_OPERATOR_METRICS_URL",
        _metrics_url,
        "http://127.0.0.1:PORT/metrics, PORT as the operator config file sets "
        f"{REPORTER_PORT_KEY}, else 9249",
        "the operator's Prometheus reporter, read with --reconciled-by operator-metrics",
    ),
    "operator_account": Option(
        "--operator-account",
        "NS/NAME",
        "CANARYD_OPERATOR_ACCOUNT",
        _account,
        "none",
        "the operator's service account, whose stale writes of canaries the admission "
        "policy refuses (config/admission): canaryd check and the start-up log say when "
        "it does not exist",
    ),
    "timeout": Option(
        "--timeout",
        "DURATION",
        "CANARYD_TIMEOUT",
        _timeout,
        "1 min; at least 100 ms",
        "canary cycle: bump every DURATION, judge each bump one DURATION later; e.g. "
        "'30 s', '1 min', 'PT1M', a bare number is milliseconds (below a second refused: "
        "give a unit)",
        key=KEY_TIMEOUT,
    ),
    "host": Option(
        "--host",
        "ADDR",
        "CANARYD_HOST",
        partial(_not_empty, "host"),
        "0.0.0.0",
        "health server address",
    ),
    "port": Option(
        "--port", "N", "CANARYD_PORT", _port, "8085", "health server port", key=KEY_PORT
    ),
    "config_check_interval": Option(
        "--config-check-interval",
        "DURATION",
        "CANARYD_CONFIG_CHECK_INTERVAL",
        partial(_duration_at_least, 1.0),
        "5 min",
        "operator config re-read interval",
        key=KEY_CHECK_INTERVAL,
    ),
    "log_format": Option(
        "--log-format",
        "json|console",
        "CANARYD_LOG_FORMAT",
        _log_format,
        "json",
        "log format on stderr: one JSON object a line, or aligned text for people",
    ),
    "log_level": Option(
        "--log-level",
        "LEVEL",
        "CANARYD_LOG_LEVEL",
        _log_level,
        "info",
        f"least severe level logged: {', '.join(LOG_LEVELS)} (or warn), any case",
    ),
    "leader_elect": Option(
        "--leader-elect",
        None,
        "CANARYD_LEADER_ELECT",
        parse_bool,
        "off",
        "run replicated: only the holder of a coordination.k8s.io/v1 Lease bumps, the "
        "others keep their registry warm",
    ),
    "lease_name": Option(
        "--lease-name",
        "NAME",
        "CANARYD_LEASE_NAME",
        partial(_dns_name, "lease name"),
        "canaryd",
        "the Lease",
    ),
    "lease_namespace": Option(
        "--lease-namespace",
        "NS",
        "CANARYD_LEASE_NAMESPACE",
        partial(_dns_name, "lease namespace"),
        "the service account's namespace in a pod, else default",
        "the Lease's namespace",
    ),
    "identity": Option(
        "--identity",
        "ID",
        "CANARYD_IDENTITY",
        partial(_not_empty, "identity"),
        "the host name and a random suffix",
        "this replica's holder identity",
    ),
    "lease_duration": Option(
        "--lease-duration",
        "DURATION",
        "CANARYD_LEASE_DURATION",
        partial(_duration_at_least, 1.0),
        "15 s",
        "followers wait this long after the lease last changed before they take it",
    ),
    "renew_deadline": Option(
        "--renew-deadline",
        "DURATION",
        "CANARYD_RENEW_DEADLINE",
        partial(_duration_at_least, 0.5),
        "10 s",
        "a leader that cannot renew for this long stops bumping",
    ),
    "retry_period": Option(
        "--retry-period",
        "DURATION",
        "CANARYD_RETRY_PERIOD",
        partial(_duration_at_least, 0.1),
        "2 s",
        "how often the lease is renewed or looked at",
    ),
}
"""Each Settings field a flag sets, and its option."""
DURATION_FLAGS = tuple(o.flag for o in OPTIONS.values() if o.metavar == "DURATION")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse exits 2 itself; keep one clear line
        raise ConfigError(message)


CHECK = (
    "checks the configuration and asks the API server whether canaryd may do what it "
    "needs with it (exit 0 when all is granted, 2 naming what is not)"
)


def build_parser(prog: str = "canaryd") -> argparse.ArgumentParser:
    """The daemon's parser, or ``canaryd check``'s: the same flags, its own usage."""
    parser = _Parser(
        prog=prog,
        description=f"canaryd check {CHECK}."
        if prog == "canaryd check"
        else "Canary health checks for the Apache Flink Kubernetes Operator.",
        epilog="Precedence: flag > environment > operator config file > default."
        + ("" if prog == "canaryd check" else f" `canaryd check [FLAGS]` {CHECK}."),
    )
    for field, option in OPTIONS.items():
        if option.metavar is None:  # None when not given: the environment decides
            kind: dict[str, Any] = {"action": "store_true", "default": None}
        else:
            kind = {"metavar": option.metavar, "action": "append" if option.many else "store"}
        parser.add_argument(option.flag, dest=field, help=option.full_help, **kind)
    parser.add_argument("--version", action="version", version=f"canaryd {__version__}")
    return parser


def _join_negative_values(argv: Sequence[str]) -> list[str]:
    """``--timeout -5s`` reaches argparse as two flags; join it as ``--timeout=-5s`` so
    that the duration is refused with the duration's message."""
    out: list[str] = []
    for item in argv:
        if out and out[-1] in DURATION_FLAGS and item.startswith("-"):
            out[-1] = f"{out[-1]}={item}"
        else:
            out.append(item)
    return out


def _converted(convert: Callable[[Any], Any], value: Any, source: str) -> Any:
    """The value converted, or a ConfigError that names where it came from."""
    try:
        return convert(value)
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None


def load_settings(
    argv: Sequence[str], environ: Mapping[str, str], prog: str = "canaryd"
) -> Settings:
    """Resolve every setting by precedence; raises ConfigError on any bad value, naming
    its source: ``--timeout: ...``, ``CANARYD_TIMEOUT=30x: ...`` or ``FILE: KEY: ...``."""
    args = vars(build_parser(prog).parse_args(_join_negative_values(argv)))
    changes: dict[str, Any] = {}  # field: its flag's value, else its environment variable's
    for field, option in OPTIONS.items():
        value, source = args[field], option.flag
        if value is None and environ.get(option.env, "") != "":
            value = environ[option.env]
            source = f"{option.env}={value}"
        if value is not None:
            joined = ",".join(value) if isinstance(value, list) else value
            changes[field] = _converted(option.convert, joined, source)
    path = changes.get("operator_config")
    if path is not None:
        from_file = {f for f, o in OPTIONS.items() if o.key and f not in changes}
        if "operator_metrics_url" not in changes:  # the port of its Prometheus reporter
            from_file.add("operator_metrics_url")
        changes["from_file"] = frozenset(from_file)
        changes.update(operator_config_values(path, changes["from_file"]))
    # Every value left out of ``changes`` is the default.
    settings = replace(Settings(), **changes)
    check_lease_timings(settings)
    return settings


def operator_config_values(path: Path, fields: frozenset[str]) -> dict[str, Any]:
    """The settings the operator config file decides (these ``fields``, those neither a
    flag nor the environment gives), as it says now: its value or the default; with
    ``namespaces`` the dynamic flag. A bad value names ``FILE: KEY``."""
    file = operator_config_file(path)
    flat = read_operator_config(file)
    values: dict[str, Any] = {}
    for field in fields:
        key = OPTIONS[field].key
        value = flat.get(key) if key else None
        default = getattr(Settings(), field)
        convert = OPTIONS[field].convert
        values[field] = default if value is None else _converted(convert, value, f"{file}: {key}")
    if "namespaces" in fields:
        dynamic = flat.get(KEY_DYNAMIC, False)
        values["dynamic_namespaces"] = _converted(parse_bool, dynamic, f"{file}: {KEY_DYNAMIC}")
    if "operator_metrics_url" in fields:
        values["operator_metrics_url"] = reporter_url(flat)
    return values
