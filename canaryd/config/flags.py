"""Flags and environment, resolved with the operator config file into ``Settings``.

Precedence: flag > environment > the operator's config file > default; every value is
checked here, and a bad one is a ``ConfigError``.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from canaryd import __version__
from canaryd.config.operator_config import (
    KEY_CHECK_INTERVAL,
    KEY_NAMESPACES,
    KEY_PORT,
    KEY_TIMEOUT,
    REPORTER_PORT_KEY,
    namespaces_from_operator_config,
    parse_namespaces,
    read_operator_config,
    reporter_url,
)
from canaryd.config.settings import DEFAULT_KINDS, DEFAULT_LABEL, Settings, lease_seconds
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
MIN_WRITE_TIMEOUT = 1.0
"""The shortest write timeout the lease timings may leave a leader (seconds): a bump
that must be answered sooner than this fails on any ordinary delay."""
DURATION_FLAGS = (
    "--timeout",
    "--config-check-interval",
    "--lease-duration",
    "--renew-deadline",
    "--retry-period",
)


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


def _port(value: Any, what: str) -> int:
    try:
        port = int(str(value).strip())
    except ValueError:
        raise ConfigError(f"invalid {what} {value!r}: expected a port number") from None
    if not 0 <= port <= 65535:
        raise ConfigError(f"invalid {what} {port}: expected 0-65535")
    return port


FLOORS = {
    "config check interval": 1.0,
    "lease duration": 1.0,
    "renew deadline": 0.5,
    "retry period": 0.1,
}
"""The shortest value of each duration that makes sense (seconds). A bare number is
milliseconds, as in Flink: without a floor ``CANARYD_LEASE_DURATION=15`` is a 15 ms
lease (hundreds of Lease requests a second) and ``CANARYD_CONFIG_CHECK_INTERVAL=5``
179 discovery requests a second."""


def _floored_duration(value: Any, what: str) -> float:
    seconds = _positive_duration(value, what)
    floor = FLOORS[what]
    if seconds < floor:
        text = str(value).strip()
        bare = (
            f" (a bare number is milliseconds: {text!r} is {text} ms; write '{text}s')"
            if text.replace(".", "", 1).isdigit()
            else ""
        )
        raise ConfigError(
            f"{what} {text!r} is {seconds * 1000:g} ms, below its floor of {floor:g} s{bare}"
        )
    return seconds


def _positive_duration(value: Any, what: str) -> float:
    try:
        seconds = parse_duration(str(value))
    except ConfigError as err:
        raise ConfigError(f"{what}: {err}") from None
    if seconds <= 0:
        raise ConfigError(f"{what}: duration must be greater than zero, got {value!r}")
    return seconds


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse exits 2 itself; keep one clear line
        raise ConfigError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="canaryd",
        description="Canary health checks for the Apache Flink Kubernetes Operator.",
        epilog="Precedence: flag > environment > operator config file > default. "
        "`canaryd check [FLAGS]` checks the configuration and asks the API server whether "
        "canaryd may do what it needs (exit 0 when all is granted, 2 naming what is not).",
    )
    add = parser.add_argument
    add(
        "--kubeconfig",
        metavar="PATH",
        help="kubeconfig file [env KUBECONFIG] (default: in-cluster when "
        "KUBERNETES_SERVICE_HOST is set, else ~/.kube/config)",
    )
    add(
        "--context",
        metavar="NAME",
        help="kubeconfig context [env CANARYD_CONTEXT] (default: its current context)",
    )
    add(
        "--namespace",
        metavar="NS",
        action="append",
        help="watched namespace, repeatable or comma-separated "
        f"[env WATCH_NAMESPACES] [{KEY_NAMESPACES}] (default: all namespaces)",
    )
    add(
        "--operator-config",
        metavar="PATH",
        help="the operator's flink-conf.yaml or config.yaml, or its conf directory "
        "[env CANARYD_OPERATOR_CONFIG] (default: none)",
    )
    add(
        "--label",
        metavar="KEY",
        help=f"canary label, value true in any case [env CANARYD_LABEL] (default: {DEFAULT_LABEL})",
    )
    add(
        "--kind",
        metavar="PLURAL",
        action="append",
        help="canary kinds, repeatable or comma-separated: Flink's plurals, or any "
        "namespaced custom resource as PLURAL.GROUP/VERSION [env CANARYD_KINDS] "
        f"(default: {','.join(DEFAULT_KINDS)})",
    )
    add(
        "--reconciled-by",
        metavar="watch|observed-generation|operator-metrics",
        help="a bump is reconciled when its generation is seen through the watch, when "
        "the canary's status.observedGeneration reaches it, or when the operator's own "
        "count of finished reconciles of the canary rose after it "
        "[env CANARYD_RECONCILED_BY] (default: watch)",
    )
    add(
        "--operator-metrics-url",
        metavar="URL",
        help="the operator's Prometheus reporter, read with --reconciled-by "
        "operator-metrics [env CANARYD_OPERATOR_METRICS_URL] (default: "
        "http://127.0.0.1:PORT/metrics, PORT as the operator config file sets "
        f"{REPORTER_PORT_KEY}, else 9249)",
    )
    add(
        "--timeout",
        metavar="DURATION",
        help="canary cycle: bump every DURATION, judge each bump one DURATION later; "
        "e.g. '30 s', '1 min', 'PT1M', a bare number is milliseconds (below a second "
        f"refused: give a unit) [env CANARYD_TIMEOUT] [{KEY_TIMEOUT}] (default: 1 min; "
        "at least 100 ms)",
    )
    add(
        "--host", metavar="ADDR", help="health server address [env CANARYD_HOST] (default: 0.0.0.0)"
    )
    add(
        "--port",
        metavar="N",
        help=f"health server port [env CANARYD_PORT] [{KEY_PORT}] (default: 8085)",
    )
    add(
        "--config-check-interval",
        metavar="DURATION",
        help=f"operator config re-read interval [env CANARYD_CONFIG_CHECK_INTERVAL] "
        f"[{KEY_CHECK_INTERVAL}] (default: 5 min)",
    )
    add(
        "--log-format",
        metavar="json|console",
        help="log format on stderr: one JSON object a line, or aligned text for people "
        "[env CANARYD_LOG_FORMAT] (default: json)",
    )
    add(
        "--log-level",
        metavar="LEVEL",
        help=f"least severe level logged: {', '.join(LOG_LEVELS)} (or warn), any case "
        "[env CANARYD_LOG_LEVEL] (default: info)",
    )
    add(
        "--leader-elect",
        action="store_true",
        default=None,
        help="run replicated: only the holder of a coordination.k8s.io/v1 Lease bumps, "
        "the others keep their registry warm [env CANARYD_LEADER_ELECT] (default: off)",
    )
    add(
        "--lease-name",
        metavar="NAME",
        help="the Lease [env CANARYD_LEASE_NAME] (default: canaryd)",
    )
    add(
        "--lease-namespace",
        metavar="NS",
        help="the Lease's namespace [env CANARYD_LEASE_NAMESPACE] (default: the service "
        "account's namespace in a pod, else default)",
    )
    add(
        "--identity",
        metavar="ID",
        help="this replica's holder identity [env CANARYD_IDENTITY] (default: the host "
        "name and a random suffix)",
    )
    for flag, env, default, what in (
        (
            "--lease-duration",
            "CANARYD_LEASE_DURATION",
            "15 s",
            "followers wait this long after the lease last changed before they take it",
        ),
        (
            "--renew-deadline",
            "CANARYD_RENEW_DEADLINE",
            "10 s",
            "a leader that cannot renew for this long stops bumping",
        ),
        (
            "--retry-period",
            "CANARYD_RETRY_PERIOD",
            "2 s",
            "how often the lease is renewed or looked at",
        ),
    ):
        add(flag, metavar="DURATION", help=f"{what} [env {env}] (default: {default})")
    add("--version", action="version", version=f"canaryd {__version__}")
    return parser


def _split_list(values: Sequence[str]) -> list[str]:
    return [item.strip() for value in values for item in value.split(",") if item.strip()]


def _join_negative_values(argv: Sequence[str]) -> list[str]:
    """``--timeout -5s`` reaches argparse as two flags; join it as ``--timeout=-5s`` so
    that the duration is refused with the duration's message."""
    out: list[str] = []
    items = list(argv)
    i = 0
    while i < len(items):
        item = items[i]
        if item in DURATION_FLAGS and i + 1 < len(items) and items[i + 1].startswith("-"):
            out.append(f"{item}={items[i + 1]}")
            i += 2
            continue
        out.append(item)
        i += 1
    return out


def load_settings(argv: Sequence[str], environ: Mapping[str, str]) -> Settings:
    """Resolve every setting by precedence; raises ConfigError on any bad value."""
    args = build_parser().parse_args(_join_negative_values(argv))

    def pick(flag: Any, env: str | None) -> Any:
        if flag is not None:
            return flag
        if env is not None and environ.get(env, "") != "":
            return environ[env]
        return None

    operator_path = pick(args.operator_config, "CANARYD_OPERATOR_CONFIG")
    flat: dict[str, Any] = {}
    if operator_path is not None:
        flat = read_operator_config(Path(operator_path))

    def resolve(flag: Any, env: str | None, key: str | None) -> Any:
        value = pick(flag, env)
        if value is None and key is not None:
            value = flat.get(key)
        return value

    settings = Settings(operator_config=Path(operator_path) if operator_path else None)
    changes: dict[str, Any] = {}

    changes["kubeconfig"] = pick(args.kubeconfig, "KUBECONFIG")
    changes["context"] = pick(args.context, "CANARYD_CONTEXT")

    if args.namespace:
        changes["namespaces"] = parse_namespaces(_split_list(args.namespace))
    elif environ.get("WATCH_NAMESPACES", "") != "":
        changes["namespaces"] = parse_namespaces(environ["WATCH_NAMESPACES"])
    elif flat:
        namespaces, dynamic = namespaces_from_operator_config(flat)
        changes.update(namespaces=namespaces, namespaces_from_file=True, dynamic_namespaces=dynamic)

    label = pick(args.label, "CANARYD_LABEL")
    if label is not None:
        label = label.strip()
        if not re.fullmatch(
            r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?", label
        ):
            raise ConfigError(f"invalid label key {label!r}")
        changes["label"] = label

    kinds = args.kind or ([environ["CANARYD_KINDS"]] if environ.get("CANARYD_KINDS") else None)
    if kinds is not None:
        flink = {f"{k}.flink.apache.org/v1beta1": k for k in DEFAULT_KINDS}
        parsed = tuple(dict.fromkeys(flink.get(k.lower(), k.lower()) for k in _split_list(kinds)))
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
        changes["kinds"] = parsed

    reconciled_by = pick(args.reconciled_by, "CANARYD_RECONCILED_BY")
    if reconciled_by is not None:
        if reconciled_by.strip().lower() not in RECONCILED_BY:
            raise ConfigError(
                f"invalid reconciled-by {reconciled_by!r}: expected {' or '.join(RECONCILED_BY)}"
            )
        changes["reconciled_by"] = reconciled_by.strip().lower()

    metrics_url = pick(args.operator_metrics_url, "CANARYD_OPERATOR_METRICS_URL")
    if metrics_url is not None:
        changes["operator_metrics_url"] = _metrics_url(metrics_url)
    elif flat:
        changes["operator_metrics_url"] = reporter_url(flat)

    timeout = resolve(args.timeout, "CANARYD_TIMEOUT", KEY_TIMEOUT)
    if timeout is not None:
        seconds = _positive_duration(timeout, "timeout")
        text = str(timeout).strip()
        if seconds < 1.0 and text.replace(".", "", 1).isdigit():
            # Flink's syntax reads a bare number as milliseconds: CANARYD_TIMEOUT=300 is a
            # 300 ms cycle against a real cluster, rarely what was meant.
            raise ConfigError(
                f"timeout {text!r} is {seconds * 1000:g} ms: a bare number is milliseconds; "
                f"give a unit, e.g. '{text}s' (or '{text}ms' for a cycle below a second)"
            )
        if seconds < MIN_TIMEOUT:
            raise ConfigError(
                f"timeout {text!r} is {seconds * 1000:g} ms, below the "
                f"{MIN_TIMEOUT * 1000:g} ms cycle canaryd can keep"
            )
        changes["timeout"] = seconds

    host = pick(args.host, "CANARYD_HOST")
    if host is not None:
        if not host.strip():
            raise ConfigError("invalid host: empty")
        changes["host"] = host.strip()

    port = resolve(args.port, "CANARYD_PORT", KEY_PORT)
    if port is not None:
        changes["port"] = _port(port, "port")

    interval = resolve(
        args.config_check_interval, "CANARYD_CONFIG_CHECK_INTERVAL", KEY_CHECK_INTERVAL
    )
    if interval is not None:
        changes["config_check_interval"] = _floored_duration(interval, "config check interval")

    log_format = pick(args.log_format, "CANARYD_LOG_FORMAT")
    if log_format is not None:
        if log_format.lower() not in ("json", "console"):
            raise ConfigError(f"invalid log format {log_format!r}: expected json or console")
        changes["log_format"] = log_format.lower()

    log_level = pick(args.log_level, "CANARYD_LOG_LEVEL")
    if log_level is not None:
        level = log_level.strip().lower()
        level = LOG_LEVEL_ALIASES.get(level, level)
        if level not in LOG_LEVELS:
            raise ConfigError(
                f"invalid log level {log_level!r}: expected one of {', '.join(LOG_LEVELS)}"
            )
        changes["log_level"] = level

    changes.update(_leader_election(args, pick, environ))

    # Every value left out of ``changes`` (or None in it) is the default.
    return replace(settings, **changes)


def _leader_election(
    args: argparse.Namespace, pick: Any, environ: Mapping[str, str]
) -> dict[str, Any]:
    changes: dict[str, Any] = {}
    elect = args.leader_elect
    if elect is None and environ.get("CANARYD_LEADER_ELECT", "") != "":
        elect = parse_bool(environ["CANARYD_LEADER_ELECT"], "CANARYD_LEADER_ELECT")
    if elect is not None:
        changes["leader_elect"] = elect
    for field, flag, env in (
        ("lease_name", args.lease_name, "CANARYD_LEASE_NAME"),
        ("lease_namespace", args.lease_namespace, "CANARYD_LEASE_NAMESPACE"),
        ("identity", args.identity, "CANARYD_IDENTITY"),
    ):
        value = pick(flag, env)
        if value is not None:
            value = value.strip()
            if field != "identity" and not re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", value):
                raise ConfigError(f"invalid {field.replace('_', ' ')} {value!r}: not a DNS name")
            if not value:
                raise ConfigError(f"invalid {field}: empty")
            changes[field] = value
    defaults = Settings()
    timings = {}
    for field, flag, env in (
        ("lease_duration", args.lease_duration, "CANARYD_LEASE_DURATION"),
        ("renew_deadline", args.renew_deadline, "CANARYD_RENEW_DEADLINE"),
        ("retry_period", args.retry_period, "CANARYD_RETRY_PERIOD"),
    ):
        value = pick(flag, env)
        timings[field] = (
            _floored_duration(value, field.replace("_", " "))
            if value is not None
            else getattr(defaults, field)
        )
        if value is not None:
            changes[field] = timings[field]
    # client-go's NewLeaderElector: LeaseDuration > RenewDeadline > JitterFactor (1.2) x
    # RetryPeriod, or a leader could lose its lease before it notices.
    if not timings["lease_duration"] > timings["renew_deadline"]:
        raise ConfigError("lease duration must be greater than the renew deadline")
    # What followers see is what the Lease stores: whole seconds (client-go truncates).
    stored = lease_seconds(timings["lease_duration"])
    if not stored > timings["renew_deadline"]:
        raise ConfigError(
            f"lease duration {timings['lease_duration']:g}s is stored in the Lease as "
            f"{stored} s (whole seconds), which must be greater than the renew deadline "
            f"{timings['renew_deadline']:g}s"
        )
    if not timings["renew_deadline"] > 1.2 * timings["retry_period"]:
        raise ConfigError("renew deadline must be greater than 1.2 x the retry period")
    if elect:
        budget = timings["renew_deadline"] - 2 * timings["retry_period"]
        if budget < MIN_WRITE_TIMEOUT:
            raise ConfigError(
                f"renew deadline {timings['renew_deadline']:g}s less twice the retry period "
                f"{timings['retry_period']:g}s leaves {budget:g}s for a write, below "
                f"{MIN_WRITE_TIMEOUT:g}s: a leader sends a bump only while that much of its "
                "renew deadline is left (raise --renew-deadline or lower --retry-period)"
            )
    return changes
