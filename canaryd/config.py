"""Configuration: flags > environment > the operator's config file > defaults.

Parsed once, at the edge, into a typed ``Settings``; nothing else sees strings.
"""

from __future__ import annotations

import argparse
import math
import re
import secrets
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from canaryd import __version__

DEFAULT_LABEL = "flink.apache.org/canary"
DEFAULT_KINDS = ("flinkdeployments", "flinksessionjobs")
KNOWN_KINDS = frozenset(DEFAULT_KINDS)
# PLURAL.GROUP/VERSION: a DNS label, a DNS subdomain with a dot, a version.
CUSTOM_KIND = re.compile(
    r"[a-z0-9]([-a-z0-9]*[a-z0-9])?\.[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)+"
    r"/v[0-9]+((alpha|beta)[0-9]+)?"
)
RECONCILED_BY = ("watch", "observed-generation", "operator-metrics")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
MIN_TIMEOUT = 0.1
MIN_WRITE_TIMEOUT = 1.0
"""The shortest write timeout the lease timings may leave a leader (seconds): a bump
that must be answered sooner than this fails on any ordinary delay."""
"""The shortest cycle canaryd keeps (seconds): below it bumps, watches and judging
cannot keep pace and verdicts flap. Below a second is for tests."""
DURATION_FLAGS = (
    "--timeout",
    "--config-check-interval",
    "--lease-duration",
    "--renew-deadline",
    "--retry-period",
)
SA_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")

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


class ConfigError(Exception):
    """Bad configuration: canaryd exits with status 2 and this message on one line."""


@dataclass(frozen=True)
class Settings:
    """Everything canaryd runs with, typed. Durations are float seconds."""

    kubeconfig: str | None = None
    """Path of a kubeconfig; None: in-cluster when KUBERNETES_SERVICE_HOST is set, else
    ~/.kube/config."""
    context: str | None = None
    """kubeconfig context; None: its current context."""
    namespaces: frozenset[str] | None = None
    """Watched namespaces; None: all namespaces (one cluster-wide watch per kind)."""
    namespaces_from_file: bool = False
    """True when the namespaces came from the operator config file (they may then follow
    it at runtime)."""
    dynamic_namespaces: bool = False
    """kubernetes.operator.dynamic.namespaces.enabled from the operator config file."""
    operator_config: Path | None = None
    """The operator's flink-conf.yaml / config.yaml; None: not read."""
    label: str = DEFAULT_LABEL
    """Label whose value ``true`` (any case) marks a canary."""
    kinds: tuple[str, ...] = DEFAULT_KINDS
    """Canary kinds: plurals in flink.apache.org/v1beta1, or PLURAL.GROUP/VERSION."""
    reconciled_by: str = "watch"
    """When a bump counts as reconciled: ``watch`` (its generation seen through the
    watch), ``observed-generation`` (the canary's status.observedGeneration reaches
    it) or ``operator-metrics`` (the operator's own count of finished reconciles of the
    canary rose after the bump was written: canaryd.opmetrics)."""
    operator_metrics_url: str = "http://127.0.0.1:9249/metrics"
    """The operator's Prometheus reporter (``--reconciled-by operator-metrics``): by
    default the port the operator config file gives its Prometheus reporter, else
    Flink's default 9249, on this host (the sidecar shares the operator's network)."""
    timeout: float = 60.0
    """Canary cycle: bump every ``timeout``, judge the bump one ``timeout`` later."""
    host: str = "0.0.0.0"
    """Address the health server binds."""
    port: int = 8085
    """Port of /healthz, /readyz and /metrics; 0 picks a free one."""
    config_check_interval: float = 300.0
    """How often the operator config file is re-read for dynamic namespaces."""
    log_format: str = "json"
    """``json`` or ``console``."""
    log_level: str = "info"
    """debug, info, warning, error or critical."""
    watch_timeout: float = 300.0
    """Base server-side watch timeout; each watch asks for 1 to 2 times this
    (client-go: 5 to 10 min)."""
    watch_idle_timeout: float = 180.0
    """A watch that delivers nothing (not even a bookmark) for this long is replaced.
    Not derived from the cycle: it must outlast the API server's bookmark interval
    (kube-apiserver's watch cache sends one about every minute)."""
    list_timeout: float = 60.0
    """Timeout of one list: its cost grows with the number of canaries, not the cycle
    (kube-apiserver's own default request timeout is 60 s)."""
    max_conflict_retries: int = 3
    """How many times a bump is retried on a fresh copy after 409 Conflict."""
    max_concurrent_bumps: int = 16
    """Bumps in flight at once, at least: the scheduler adds workers (up to
    ``MAX_BUMP_WORKERS``) when the canary count and the observed write latency need
    more (Little's law: bumps per second times seconds per bump, twice over)."""
    leader_elect: bool = False
    """Run replicated: only the holder of the Lease bumps (client-go's leader election)."""
    lease_name: str = "canaryd"
    lease_namespace: str | None = None
    """None: the service account's namespace in a pod, else ``default``."""
    identity: str | None = None
    """This replica's holder identity; None: the host name (a pod's name)."""
    lease_duration: float = 15.0
    """How long followers wait, after they last saw the lease change, before taking it."""
    renew_deadline: float = 10.0
    """A leader that could not renew for this long stops bumping and steps down."""
    retry_period: float = 2.0
    """How often a leader renews and a follower looks at the lease."""

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
        deadline less two retry periods (6 s at the defaults). A leader sends a write
        only while it has that much of its renew deadline left after its last renew,
        so every write it sends is answered or abandoned by its renew deadline, before
        any follower may take the lease; and a leader that renews every retry period
        (plus the renew's own round trip, with one retry period to spare) is never
        without that window."""
        if not self.leader_elect:
            return self.request_timeout
        return min(self.request_timeout, lease_write_budget(self))

    @property
    def connect_timeout(self) -> float:
        """Establishing a connection, a watch's too (a black-holed address fails here,
        not after the OS's two minutes): 5 s, at most the request timeout."""
        return min(5.0, self.request_timeout)

    @property
    def backoff_initial(self) -> float:
        """First delay after a failure in a row: client-go's 800 ms, at most a
        twentieth of the cycle."""
        return min(0.8, self.timeout / 20)

    @property
    def backoff_max(self) -> float:
        """Cap of every watch, list and write backoff: client-go's 30 s, at most a
        quarter of the cycle."""
        return min(30.0, self.timeout / 4)

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
        """A judge that runs later than this after its deadline ran late because canaryd
        itself stalled (GC, CPU starvation): watch events may sit unread in its sockets,
        so an unhealthy verdict is re-checked once this much later. A tenth of the cycle,
        at most a second."""
        return min(1.0, self.timeout / 10)

    @property
    def resume_grace(self) -> float:
        """After a watch resumes, how long a deferred verdict waits for the replayed
        events before it is judged: a quarter of the cycle."""
        return self.timeout / 4

    @property
    def scrape_interval(self) -> float:
        """How often the operator's metrics are read (operator-metrics): 2 s, at most a
        tenth of the cycle. A verdict waits for the first read after its deadline, and
        an operator that was restarted is seen within this (the kubelet probes every
        10 s)."""
        return min(2.0, self.timeout / 10)

    @property
    def scrape_connect_timeout(self) -> float:
        """Connecting to the operator's metrics: 2.5 s, at most an eighth of the cycle. A
        port that is held but accepts nothing (a frozen JVM's full listen backlog) fails
        here and is tried again; an answer, once connected, may take the whole cycle
        (a slow operator is not a frozen one). A verdict counts an endpoint that
        answered nothing against the operator once a whole cycle past its deadline."""
        return min(2.5, self.timeout / 8)

    @property
    def all_namespaces(self) -> bool:
        return self.namespaces is None


# ------------------------------------------------------------------ durations

_UNITS: dict[str, float] = {}
for _factor, _labels in (
    (1e-9, ("ns", "nano", "nanos", "nanosecond", "nanoseconds")),
    (1e-6, ("µs", "us", "micro", "micros", "microsecond", "microseconds")),
    (1e-3, ("ms", "milli", "millis", "millisecond", "milliseconds")),
    (1.0, ("s", "sec", "secs", "second", "seconds")),
    (60.0, ("m", "min", "mins", "minute", "minutes")),
    (3600.0, ("h", "hour", "hours")),
    (86400.0, ("d", "day", "days")),
):
    for _label in _labels:
        _UNITS[_label] = _factor

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
    if iso and value.upper() not in ("P", "PT") and any(iso.groups()):
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


# --------------------------------------------------------- operator config file


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


def read_operator_config(path: Path) -> dict[str, Any]:
    """Read flink-conf.yaml (flat keys) or config.yaml (nested keys) into flat keys."""
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
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"operator config {path} must be a mapping of keys to values")
    flat = flatten(data)
    for key in (KEY_NAMESPACES, KEY_DYNAMIC, KEY_TIMEOUT, KEY_PORT, KEY_CHECK_INTERVAL):
        if any(name.startswith(f"{key}.") for name in flat):
            raise ConfigError(
                f"operator config {path}: {key} must be a value (namespaces: a "
                "comma-separated string or a list), not a mapping"
            )
    return flat


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


def _bool(value: Any, what: str) -> bool:
    """Every boolean canaryd reads, from the environment or the operator config, is
    ``true`` or ``false`` in any case, as Flink reads the operator's own booleans
    (ConfigurationUtils.convertToBoolean); ``yes``, ``1`` or ``on`` are refused."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "false"):
        return text == "true"
    raise ConfigError(f"invalid {what} {str(value).strip()!r}: expected true or false")


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


def default_identity() -> str:
    """The host name and a random suffix, as client-go's users make theirs: systemd and
    VM deployments often share a host name, and two replicas of one identity would
    both take themselves for the holder."""
    return f"{socket.gethostname()}_{secrets.token_hex(4)}"


def _positive_duration(value: Any, what: str) -> float:
    try:
        seconds = parse_duration(str(value))
    except ConfigError as err:
        raise ConfigError(f"{what}: {err}") from None
    if seconds <= 0:
        raise ConfigError(f"{what}: duration must be greater than zero, got {value!r}")
    return seconds


def namespaces_from_operator_config(flat: Mapping[str, Any]) -> tuple[frozenset[str] | None, bool]:
    """The watched namespaces and the dynamic flag as the operator config file says."""
    namespaces = parse_namespaces(flat[KEY_NAMESPACES]) if KEY_NAMESPACES in flat else None
    dynamic = _bool(flat.get(KEY_DYNAMIC, False), KEY_DYNAMIC)
    return namespaces, dynamic


# ------------------------------------------------------------------------ CLI


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse exits 2 itself; keep one clear line
        raise ConfigError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="canaryd",
        description="Canary health checks for the Apache Flink Kubernetes Operator.",
        epilog="Precedence: flag > environment > operator config file > default.",
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
        "e.g. '30 s', '1 min', 'PT1M', a bare number is milliseconds "
        f"[env CANARYD_TIMEOUT] [{KEY_TIMEOUT}] (default: 1 min; at least 100 ms)",
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
        help=f"least severe level logged: {', '.join(LOG_LEVELS)} "
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
        if seconds < MIN_TIMEOUT:
            bare = (
                " (a bare number is milliseconds: write e.g. '5 s')"
                if str(timeout).strip().replace(".", "", 1).isdigit()
                else ""
            )
            raise ConfigError(
                f"timeout {str(timeout).strip()!r} is {seconds * 1000:g} ms, below the "
                f"{MIN_TIMEOUT * 1000:g} ms cycle canaryd can keep{bare}"
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
        if log_level.lower() not in LOG_LEVELS:
            raise ConfigError(
                f"invalid log level {log_level!r}: expected one of {', '.join(LOG_LEVELS)}"
            )
        changes["log_level"] = log_level.lower()

    changes.update(_leader_election(args, pick, environ))

    # Every value left out of ``changes`` (or None in it) is the default.
    return replace(settings, **changes)


def _leader_election(
    args: argparse.Namespace, pick: Any, environ: Mapping[str, str]
) -> dict[str, Any]:
    changes: dict[str, Any] = {}
    elect = args.leader_elect
    if elect is None and environ.get("CANARYD_LEADER_ELECT", "") != "":
        elect = _bool(environ["CANARYD_LEADER_ELECT"], "CANARYD_LEADER_ELECT")
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


def lease_write_budget(settings: Settings) -> float:
    """What the lease timings leave for one write: the renew deadline less two retry
    periods (the next renew, its round trip and one retry to spare)."""
    return settings.renew_deadline - 2 * settings.retry_period


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
