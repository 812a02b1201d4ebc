"""Configuration: flags > environment > the operator's config file > defaults.

Each option is one row, a field of ``Settings``: its flag, environment variable,
operator config key, parser, default and help. ``canaryd --help``, the precedence and
the operator config file's re-reads are made from the rows; nothing else in canaryd
sees strings. A bad value is a ``ConfigError`` naming where it came from. The lease
timings are checked together beside the leader (``canaryd.leader``).
"""

from __future__ import annotations

import argparse
import math
import re
import secrets
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from canaryd import __version__
from canaryd.config.operator_config import (
    ConfigError,
    has_prometheus_reporter,
    nested_keys_why,
    nested_operator_keys,
    operator_config_files,
    read_operator_config,
    reporter_url,
)

__all__ = [  # and the operator config file's readers the daemon and check use
    "KEY_DYNAMIC",
    "MIN_WRITE_TIMEOUT",
    "OPTIONS",
    "ConfigError",
    "Settings",
    "build_parser",
    "default_identity",
    "has_prometheus_reporter",
    "lease_namespace",
    "lease_seconds",
    "load_settings",
    "nested_keys_why",
    "nested_operator_keys",
    "operator_config_files",
    "operator_config_values",
    "parse_duration",
    "read_operator_config",
]

T = TypeVar("T")

# ------------------------------------------------------------------ values from text

_UNITS = {
    unit: factor
    for factor, units in (
        (1e-9, "ns nano nanos nanosecond nanoseconds"),
        (1e-6, "µs us micro micros microsecond microseconds"),
        (1e-3, "ms milli millis millisecond milliseconds"),
        (1.0, "s sec secs second seconds"),
        (60.0, "m min mins minute minutes"),
        (3600.0, "h hour hours"),
        (86400.0, "d day days"),
    )
    for unit in units.split()
}
_FLINK_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zµ]*)\s*$", re.IGNORECASE)
_ISO_RE = re.compile(
    r"^P(?:(\d+(?:\.\d+)?)D)?(?:T(?:(\d+(?:\.\d+)?)H)?(?:(\d+(?:\.\d+)?)M)?(?:(\d+(?:\.\d+)?)S)?)?$",
    re.IGNORECASE,
)


def parse_duration(text: str) -> float:
    """Flink's duration syntax (TimeUtils.parseDuration) or ISO-8601, in seconds.

    ``500ms``, ``2 s``, ``1 min``, ``5m``, ``PT1M``; a bare number is milliseconds.
    """
    value = str(text).strip()
    iso = _ISO_RE.match(value)
    if iso and any(iso.groups()):
        days, hours, minutes, seconds = (float(g) if g else 0.0 for g in iso.groups())
        return days * 86400 + hours * 3600 + minutes * 60 + seconds
    flink = _FLINK_RE.match(value)
    if not flink:
        raise ConfigError(f"invalid duration {text!r}: expected e.g. '500 ms', '1 min', 'PT1M'")
    number, unit = float(flink.group(1)), flink.group(2).lower()
    if unit and unit not in _UNITS:
        raise ConfigError(
            f"invalid duration {text!r}: unknown unit {unit!r} (use ns, us, ms, s, min/m, h or d)"
        )
    seconds = number * _UNITS[unit] if unit else number / 1000.0
    if not math.isfinite(seconds):
        raise ConfigError(f"invalid duration {text!r}: too large")
    return seconds


def duration(floor: float, bare_floor: float = 0.0) -> Callable[[Any], float]:
    """The parser of a duration of at least ``floor`` seconds, the shortest that makes
    sense. A bare number is milliseconds, as in Flink: without a floor
    ``CANARYD_LEASE_DURATION=15`` is a 15 ms lease (hundreds of Lease requests a
    second). The cycle also refuses a bare number under ``bare_floor``:
    ``CANARYD_TIMEOUT=300``, a 300 ms cycle against a real cluster, is rarely meant."""

    def parse(value: Any) -> float:
        text = str(value).strip()
        seconds = parse_duration(text)
        bare = text.replace(".", "", 1).isdigit()
        if seconds <= 0:
            raise ConfigError(f"duration must be greater than zero, got {text!r}")
        if seconds < floor:
            hint = f" (a bare number is milliseconds: write '{text}s')" if bare else ""
            raise ConfigError(
                f"{text!r} is {seconds * 1000:g} ms, below its floor of {floor:g} s{hint}"
            )
        if bare and seconds < bare_floor:
            raise ConfigError(
                f"{text!r} is {seconds * 1000:g} ms: a bare number is milliseconds; give a "
                f"unit, e.g. '{text}s' (or '{text}ms' for a cycle below a second)"
            )
        return seconds

    return parse


def parse_bool(value: Any) -> bool:
    """``true`` or ``false`` in any case, as Flink reads the operator's own booleans
    (ConfigurationUtils.convertToBoolean); ``yes``, ``1`` or ``on`` are refused."""
    text = str(value).strip().lower()
    if text not in ("true", "false"):
        raise ConfigError(f"expected true or false, got {str(value).strip()!r}")
    return text == "true"


def _matching(what: str, pattern: str, why: str = "") -> Callable[[Any], str]:
    """The parser of text (stripped) that matches ``pattern``."""

    def parse(value: Any) -> str:
        text = str(value).strip()
        if not re.fullmatch(pattern, text):
            raise ConfigError(f"invalid {what} {text!r}{why}")
        return text

    return parse


def _choice(what: str, *choices: str, **aliases: str) -> Callable[[Any], str]:
    """The parser of one of ``choices`` (or an alias of one), in any case."""

    def parse(value: Any) -> str:
        chosen = str(value).strip().lower()
        chosen = aliases.get(chosen, chosen)
        if chosen not in choices:
            raise ConfigError(f"invalid {what} {value!r}: expected {' or '.join(choices)}")
        return chosen

    return parse


def _dns_name(what: str) -> Callable[[Any], str]:
    return _matching(what, r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", ": not a DNS name")


_namespace = _matching("namespace name", r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
FLINK_KINDS = ("flinkdeployments", "flinksessionjobs")
# PLURAL.GROUP/VERSION: a DNS label, a DNS subdomain with a dot, a version.
CUSTOM_KIND = re.compile(
    r"[a-z0-9]([-a-z0-9]*[a-z0-9])?\.[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)+"
    r"/v[0-9]+((alpha|beta)[0-9]+)?"
)


def _namespaces(value: Any) -> frozenset[str] | None:
    """Comma-separated (or the file's list); empty, null (a YAML key with no value) or
    JOSDK_ALL_NAMESPACES (JOSDK's Constants.WATCH_ALL_NAMESPACES) mean all (None), as
    in the operator."""
    items = value if isinstance(value, list | tuple) else str(value or "").split(",")
    names = {str(item).strip() for item in items} - {""}
    if not names or "JOSDK_ALL_NAMESPACES" in names:
        return None
    return frozenset(_namespace(name) for name in names)


def _kinds(value: str) -> tuple[str, ...]:
    flink = {f"{k}.flink.apache.org/v1beta1": k for k in FLINK_KINDS}
    given = (item.strip().lower() for item in value.split(","))
    kinds = tuple(dict.fromkeys(flink.get(k, k) for k in given if k))
    unknown = sorted(k for k in kinds if k not in FLINK_KINDS and not CUSTOM_KIND.fullmatch(k))
    if unknown or not kinds:
        raise ConfigError(
            f"invalid kind {', '.join(unknown) or '(empty)'}: expected "
            f"{' and/or '.join(FLINK_KINDS)}, or any namespaced custom resource as "
            "PLURAL.GROUP/VERSION (e.g. widgets.example.com/v1)"
        )
    versions: dict[str, list[str]] = {}
    for kind in kinds:
        resource, _, version = kind.partition("/")
        if kind in FLINK_KINDS:
            resource, version = f"{kind}.flink.apache.org", "v1beta1"
        versions.setdefault(resource, []).append(version)
    for resource, found in sorted(versions.items()):
        if len(found) > 1:
            raise ConfigError(
                f"kind {resource} given twice, as {' and '.join(found)}: give one version "
                "(every version serves the same objects, which would be bumped twice a cycle)"
            )
    return kinds


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


def _account(value: str) -> tuple[str, str]:
    namespace, slash, name = value.strip().partition("/")
    if not slash:
        raise ConfigError(f"invalid operator account {value!r}: expected NAMESPACE/NAME")
    namespace = _dns_name("operator account namespace")(namespace)
    return namespace, _dns_name("operator account name")(name)


# ------------------------------------------------------------------------- the rows


@dataclass(frozen=True)
class Option:
    """One option: how ``canaryd --help``, the environment and the operator config
    file give the ``Settings`` field it belongs to."""

    flag: str
    """``--flag METAVAR``, or ``--flag`` for a switch (its variable: true or false)."""
    env: str
    parse: Callable[[Any], Any]
    """Text (or the file's value) to the field's value; ConfigError when bad."""
    help: str
    shown: str
    """The default as ``--help`` tells it."""
    key: str | None
    """The operator config file's key, read when neither flag nor environment is set."""
    many: bool
    """Repeatable: its values are joined with commas, as the environment gives them."""


def option(
    default: T,
    flag: str,
    env: str,
    parse: Callable[[Any], T],
    help: str,
    shown: str | None = None,
    key: str | None = None,
    many: bool = False,
) -> T:
    """A ``Settings`` field (its ``default``) and its row: ``--flag METAVAR``, the
    environment variable, the parser and the help; ``shown`` when the default is told
    otherwise than as itself, the operator config ``key``, and whether ``many``."""
    row = Option(flag, env, parse, help, str(default) if shown is None else shown, key, many)
    return field(default=default, metadata={"option": row})


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
KEY_DYNAMIC = "kubernetes.operator.dynamic.namespaces.enabled"


@dataclass(frozen=True)
class Settings:
    """Everything canaryd runs with, typed; durations are float seconds."""

    kubeconfig: str | None = option(
        None,
        "--kubeconfig PATH",
        "KUBECONFIG",
        str,
        "kubeconfig file",
        "in-cluster when KUBERNETES_SERVICE_HOST is set, else ~/.kube/config",
    )
    context: str | None = option(
        None, "--context NAME", "CANARYD_CONTEXT", str, "kubeconfig context", "its current context"
    )
    namespaces: frozenset[str] | None = option(
        None,
        "--namespace NS",
        "WATCH_NAMESPACES",
        _namespaces,
        "watched namespace, repeatable or comma-separated",
        "all namespaces",
        key="kubernetes.operator.watched.namespaces",
        many=True,
    )
    operator_config: Path | None = option(  # noqa: RUF009 -- option() is a field()
        None,
        "--operator-config PATH",
        "CANARYD_OPERATOR_CONFIG",
        lambda path: Path(path) if path else None,  # empty: none
        "the operator's flink-conf.yaml or config.yaml, or its conf directory",
        "none",
    )
    label: str = option(
        "flink.apache.org/canary",
        "--label KEY",
        "CANARYD_LABEL",
        _matching(
            "label key",
            r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?",
        ),
        "canary label, value true in any case",
    )
    kinds: tuple[str, ...] = option(
        FLINK_KINDS,
        "--kind PLURAL",
        "CANARYD_KINDS",
        _kinds,
        "canary kinds, repeatable or comma-separated: Flink's plurals, or any namespaced "
        "custom resource as PLURAL.GROUP/VERSION",
        ",".join(FLINK_KINDS),
        many=True,
    )
    reconciled_by: str = option(
        "watch",
        "--reconciled-by watch|observed-generation|operator-metrics",
        "CANARYD_RECONCILED_BY",
        _choice("reconciled-by", "watch", "observed-generation", "operator-metrics"),
        "a bump is reconciled when its generation is seen through the watch, when the "
        "canary's status.observedGeneration reaches it, or when the operator's own count "
        "of finished reconciles of the canary rose after it",
    )
    operator_metrics_url: str = option(
        "http://127.0.0.1:9249/metrics",
        "--operator-metrics-url URL",
        "CANARYD_OPERATOR_METRICS_URL",
        _metrics_url,
        "the operator's Prometheus reporter, read with --reconciled-by operator-metrics",
        "http://127.0.0.1:PORT/metrics, PORT as the operator config file sets for its "
        "Prometheus reporter, else 9249",
        key="kubernetes.operator.metrics.reporter.<name>.port",
    )
    operator_account: tuple[str, str] | None = option(
        None,
        "--operator-account NS/NAME",
        "CANARYD_OPERATOR_ACCOUNT",
        _account,
        "the operator's service account, whose stale writes of canaries the admission "
        "policy refuses (config/admission): canaryd check and the start-up log say when "
        "it does not exist",
        "none",
    )
    timeout: float = option(
        60.0,
        "--timeout DURATION",
        "CANARYD_TIMEOUT",
        duration(0.1, bare_floor=1.0),
        "canary cycle: bump every DURATION, judge each bump one DURATION later; e.g. "
        "'30 s', '1 min', 'PT1M', a bare number is milliseconds (below a second refused: "
        "give a unit)",
        "1 min; at least 100 ms",
        key="kubernetes.operator.health.canary.resource.timeout",
    )
    host: str = option(
        "0.0.0.0",
        "--host ADDR",
        "CANARYD_HOST",
        _matching("host", ".+", ": empty"),
        "health server address",
    )
    port: int = option(
        8085,
        "--port N",
        "CANARYD_PORT",
        _port,
        "health server port",
        key="kubernetes.operator.health.probe.port",
    )
    config_check_interval: float = option(
        300.0,
        "--config-check-interval DURATION",
        "CANARYD_CONFIG_CHECK_INTERVAL",
        duration(1.0),
        "operator config re-read interval",
        "5 min",
        key="kubernetes.operator.dynamic.config.check.interval",
    )
    log_format: str = option(
        "json",
        "--log-format json|console",
        "CANARYD_LOG_FORMAT",
        _choice("log format", "json", "console"),
        "log format on stderr: one JSON object a line, or aligned text for people",
    )
    log_level: str = option(
        "info",
        "--log-level LEVEL",
        "CANARYD_LOG_LEVEL",
        _choice("log level", *LOG_LEVELS, warn="warning"),
        f"least severe level logged: {', '.join(LOG_LEVELS)} (or warn), any case",
    )
    leader_elect: bool = option(
        False,
        "--leader-elect",
        "CANARYD_LEADER_ELECT",
        parse_bool,
        "run replicated: only the holder of a coordination.k8s.io/v1 Lease bumps, the "
        "others keep their registry warm",
        "off",
    )
    lease_name: str = option(
        "canaryd",
        "--lease-name NAME",
        "CANARYD_LEASE_NAME",
        _dns_name("lease name"),
        "the Lease",
    )
    lease_namespace: str | None = option(
        None,
        "--lease-namespace NS",
        "CANARYD_LEASE_NAMESPACE",
        _dns_name("lease namespace"),
        "the Lease's namespace",
        "the service account's namespace in a pod, else default",
    )
    identity: str | None = option(
        None,
        "--identity ID",
        "CANARYD_IDENTITY",
        _matching("identity", ".+", ": empty"),
        "this replica's holder identity",
        "the host name and a random suffix",
    )
    lease_duration: float = option(
        15.0,
        "--lease-duration DURATION",
        "CANARYD_LEASE_DURATION",
        duration(1.0),
        "followers wait this long after the lease last changed before they take it",
        "15 s",
    )
    renew_deadline: float = option(
        10.0,
        "--renew-deadline DURATION",
        "CANARYD_RENEW_DEADLINE",
        duration(0.5),
        "a leader that cannot renew for this long stops bumping",
        "10 s",
    )
    retry_period: float = option(
        2.0,
        "--retry-period DURATION",
        "CANARYD_RETRY_PERIOD",
        duration(0.1),
        "how often the lease is renewed or looked at",
        "2 s",
    )

    # Set by no flag: the operator config file's, and the tests'.
    from_file: frozenset[str] = frozenset()
    """The settings the operator config file decides (neither a flag nor the
    environment gives them): a re-read may change them."""
    dynamic_namespaces: bool = False
    """``kubernetes.operator.dynamic.namespaces.enabled``, read with the namespaces."""
    watch_timeout: float = 300.0
    """Base server-side watch timeout; each watch asks for 1 to 2 times this
    (client-go: 5 to 10 min)."""
    watch_idle_timeout: float = 180.0
    """A watch that delivers nothing (not even a bookmark) for this long is replaced.
    Not derived from the cycle: it must outlast the API server's bookmark interval
    (kube-apiserver's watch cache sends one about every minute)."""
    list_timeout: float = 60.0
    """One list: its cost grows with the number of canaries, not the cycle
    (kube-apiserver's own default request timeout is 60 s)."""
    max_conflict_retries: int = 3
    """How many times a bump is retried on a fresh copy after 409 Conflict."""
    max_bumps_in_flight: int = 256
    """Bumps writing at once, at most (each holds a connection). 10,000 canaries on a
    60 s cycle with 1 s writes (an admission webhook in the path) need about 170."""

    # Timings derived from the cycle: client-go's value (or kube's), capped by a fraction
    # of the cycle, so that no delay of canaryd's own outlasts the window it works in
    # (DESIGN: no watch or list backoff exceeds a quarter of the cycle). Tests shorten
    # the cycle and get these exactly as a user would.

    @property
    def request_timeout(self) -> float:
        """One bump or re-read: 10 s, at most half the cycle (the bump's retry window)."""
        return min(10.0, self.timeout / 2)

    @property
    def write_timeout(self) -> float:
        """One bump's PATCH: the request timeout; under --leader-elect at most the renew
        deadline less two retry periods (6 s at the defaults), so that every write is
        answered or abandoned before any follower may take the lease (canaryd.leader)."""
        if not self.leader_elect:
            return self.request_timeout
        return min(self.request_timeout, self.renew_deadline - 2 * self.retry_period)

    @property
    def keepalive_timeout(self) -> float:
        """How long an idle pooled connection is reused: aiohttp's 15 s, at most a
        quarter of the cycle, so a bump seldom goes over a connection that went silent
        between bumps (half-open: a crashed replica behind a load balancer)."""
        return min(15.0, self.timeout / 4)

    @property
    def connect_timeout(self) -> float:
        """Establishing a connection, a watch's too (a black-holed address fails here,
        not after the OS's two minutes): 5 s, at most the request timeout."""
        return min(5.0, self.request_timeout)

    @property
    def backoff_initial(self) -> float:
        """First delay after a failure: client-go's 800 ms, at most 1/20 of the cycle."""
        return min(0.8, self.timeout / 20)

    @property
    def backoff_max(self) -> float:
        """Cap of every watch, list and write backoff: client-go's 30 s, at most a
        quarter of the cycle."""
        return min(30.0, self.timeout / 4)

    @property
    def namespaces_from_file(self) -> bool:
        """The namespaces come from the operator config file (and may follow it)."""
        return "namespaces" in self.from_file

    @property
    def forbidden_retry(self) -> float:
        """Retry delay of a watch answered 403 (not ours, perhaps for now): once a cycle,
        at most a minute."""
        return min(60.0, self.timeout)

    @property
    def short_watch(self) -> float:
        """A watch that ends sooner than this with no event failed (client-go: 1 s):
        it backs off instead of reopening at once."""
        return min(1.0, self.timeout / 4)

    @property
    def judge_slack(self) -> float:
        """A judge later than this after its deadline ran late because canaryd stalled
        (GC, CPU starvation), with watch events perhaps unread in its sockets: an
        unhealthy verdict is re-checked once this much later. A tenth of the cycle, at
        most a second."""
        return min(1.0, self.timeout / 10)

    @property
    def scheduler_tick(self) -> float:
        """The scheduler wakes at most once per tick and takes every deadline due within
        it together (a wake per canary was a third of canaryd's CPU): an eighth of the
        judge's slack, at most 25 ms (a longer tick's bursts held /healthz back:
        docs/PERFORMANCE.md)."""
        return min(0.025, self.judge_slack / 8)

    @property
    def resume_grace(self) -> float:
        """After a watch resumes, how long a deferred verdict waits for the replayed
        events before it is judged: a quarter of the cycle."""
        return self.timeout / 4

    @property
    def scrape_interval(self) -> float:
        """How often the operator's metrics are read (operator-metrics): 2 s, at most a
        tenth of the cycle. A verdict waits for the first read after its deadline."""
        return min(2.0, self.timeout / 10)

    @property
    def scrape_connect_timeout(self) -> float:
        """Connecting to the operator's metrics: 2.5 s, at most an eighth of the cycle. A
        port held but accepting nothing (a frozen JVM's full listen backlog) fails here;
        an answer, once connected, may take the whole cycle (a slow operator is not a
        frozen one)."""
        return min(2.5, self.timeout / 8)


OPTIONS: dict[str, Option] = {f.name: f.metadata["option"] for f in fields(Settings) if f.metadata}
"""Each ``Settings`` field an option sets, and its row."""

# ------------------------------------------------------------------- resolving them


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
    for name, row in OPTIONS.items():
        flag, _, metavar = row.flag.partition(" ")
        key = f" [{row.key}]" if row.key else ""
        if metavar:
            kind: dict[str, Any] = {"metavar": metavar, "action": "append" if row.many else "store"}
        else:  # a switch; None when not given: the environment decides
            kind = {"action": "store_true", "default": None}
        text = f"{row.help} [env {row.env}]{key} (default: {row.shown})"
        parser.add_argument(flag, dest=name, help=text, **kind)
    parser.add_argument("--version", action="version", version=f"canaryd {__version__}")
    return parser


def _parsed(parse: Callable[[Any], T], value: Any, source: str) -> T:
    """The value parsed, or a ConfigError that names where it came from."""
    try:
        return parse(value)
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None


def load_settings(
    argv: Sequence[str], environ: Mapping[str, str], prog: str = "canaryd"
) -> Settings:
    """Resolve every setting by precedence; raises ConfigError on any bad value, naming
    its source: ``--timeout: ...``, ``CANARYD_TIMEOUT=30x: ...`` or ``FILE: KEY: ...``."""
    durations = {row.flag.split()[0] for row in OPTIONS.values() if row.flag.endswith("DURATION")}
    joined: list[str] = []  # ``--timeout -5s`` as ``--timeout=-5s``: refused as a duration
    for item in argv:
        if joined and joined[-1] in durations and item.startswith("-"):
            joined[-1] = f"{joined[-1]}={item}"
        else:
            joined.append(item)
    args = vars(build_parser(prog).parse_args(joined))
    given: dict[str, Any] = {}  # field: its flag's value, else its environment variable's
    for name, row in OPTIONS.items():
        value, source = args[name], row.flag.split()[0]
        if value is None and environ.get(row.env, "") != "":
            value, source = environ[row.env], f"{row.env}={environ[row.env]}"
        if value is not None:
            text = ",".join(value) if isinstance(value, list) else value
            given[name] = _parsed(row.parse, text, source)
    if given.get("operator_config") is not None:
        given["from_file"] = frozenset(n for n, r in OPTIONS.items() if r.key and n not in given)
        given.update(operator_config_values(given["operator_config"], given["from_file"]))
    return Settings(**given)  # every field not given: its default


def operator_config_values(path: Path, names: frozenset[str]) -> dict[str, Any]:
    """The settings the operator config file decides (``names``: those neither a flag
    nor the environment gives), as it says now: its value or the default; with the
    namespaces, whether they are dynamic. A bad value names ``FILE: KEY``."""
    file = operator_config_files(path)[0]
    flat = read_operator_config(file)

    def value(key: str, parse: Callable[[Any], T], default: T) -> T:
        if any(name.startswith(f"{key}.") for name in flat):
            raise ConfigError(
                f"{file}: {key}: must be a value (namespaces: a comma-separated string or a "
                "list), not a mapping"
            )
        found = flat.get(key)
        return default if found is None else _parsed(parse, found, f"{file}: {key}")

    said: dict[str, Any] = {}
    for name, row in OPTIONS.items():  # in the rows' order: the first bad value is told
        if name not in names or row.key is None:
            continue
        if name == "operator_metrics_url":  # the port of its Prometheus reporter
            said[name] = reporter_url(flat)
        else:
            said[name] = value(row.key, row.parse, getattr(Settings(), name))
    if "namespaces" in names:
        said["dynamic_namespaces"] = value(KEY_DYNAMIC, parse_bool, False)
    return said


# ---------------------------------------------------- the Lease, for canaryd.leader

MIN_WRITE_TIMEOUT = 1.0
"""The shortest write timeout the lease timings may leave a leader (seconds): a bump
that must be answered sooner than this fails on any ordinary delay."""
SA_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def default_identity() -> str:
    """The host name and a random suffix, as client-go's users make theirs: systemd and
    VM deployments often share a host name, and two replicas of one identity would
    both take themselves for the holder."""
    return f"{socket.gethostname()}_{secrets.token_hex(4)}"


def lease_seconds(lease_duration: float) -> int:
    """leaseDurationSeconds as the Lease stores it: whole seconds, truncated as client-go
    does (int32(LeaseDuration / time.Second)), at least 1."""
    return max(1, int(lease_duration))


def lease_namespace(settings: Settings) -> str:
    """The Lease's namespace: as set, else the pod's service account's, else default."""
    if settings.lease_namespace:
        return settings.lease_namespace
    try:
        return SA_NAMESPACE_FILE.read_text().strip() or "default"
    except OSError:
        return "default"
