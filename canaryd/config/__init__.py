"""Configuration: flags > environment > the operator's config file > defaults, each
option one row (a ``Settings`` field) that ``--help`` and the readers are made from."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

import structlog

from canaryd import __version__, metrics
from canaryd.config import parse
from canaryd.config.parse import PROM_FACTORY, REPORTERS, nested_keys_why, read_operator_config
from canaryd.config.parse import ConfigError as ConfigError

T = TypeVar("T")
log = structlog.get_logger("canaryd.config")

# ------------------------------------------------------------------------- the rows


@dataclass
class Option:
    """How ``--help``, the environment and the operator config file give its field. Its
    environment variable is CANARYD_ and the flag's name (as click's auto_envvar_prefix)."""

    flag: str  # "--flag METAVAR", or "--flag" for a switch (its variable: true or false)
    parse: Callable[[Any], Any]  # text (or the file's value) to the value, or ConfigError
    help: str
    shown: str  # the default as --help tells it
    key: str | None = None  # the operator config file's, read when no flag or variable is set
    many: bool = False  # repeatable: its values joined with commas, as the environment gives them
    env: str = ""
    metavar: str = field(init=False)  # the flag's, after its name

    def __post_init__(self) -> None:
        self.flag, _, self.metavar = self.flag.partition(" ")
        self.env = self.env or "CANARYD_" + self.flag[2:].upper().replace("-", "_")


def option(
    default: T, flag: str, parse: Callable[[Any], T], help: str, shown: str = "", **row: Any
) -> T:
    """A ``Settings`` field (its ``default``) and its row."""
    shown = shown or ("none" if default is None else str(default))
    return field(default=default, metadata={"option": Option(flag, parse, help, shown, **row)})


@dataclass(frozen=True)
class Cycle:
    """A timing derived from the cycle: ``cap`` seconds, at most 1/``part`` of --timeout."""

    cap: float
    part: float

    def __get__(self, settings: Settings, owner: object = None) -> float:
        return min(self.cap, settings.timeout / self.part)


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
KEY_DYNAMIC = "kubernetes.operator.dynamic.namespaces.enabled"
SA_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


@dataclass(frozen=True)
class Settings:
    """Everything canaryd runs with, typed; durations are float seconds. Each option's
    row is one line of ``--help``; docs/CONFIGURATION.md tells each in full."""

    kubeconfig: str | None = option(
        None,
        "--kubeconfig PATH",
        str,
        "kubeconfig file(s), separated by ':' as in KUBECONFIG",
        "in-cluster when KUBERNETES_SERVICE_HOST is set, else ~/.kube/config",
        env="KUBECONFIG",
    )
    context: str | None = option(
        None, "--context NAME", str, "kubeconfig context", "its current context"
    )
    namespaces: frozenset[str] | None = option(
        None,
        "--namespace NS",
        parse.namespaces,
        "watched namespace, repeatable or comma-separated",
        "all namespaces",
        key="kubernetes.operator.watched.namespaces",
        many=True,
        env="WATCH_NAMESPACES",
    )
    operator_config: Path | None = option(  # noqa: RUF009 -- option() is a field()
        None, "--operator-config PATH", parse.path, "the operator's config file or conf directory"
    )
    label: str = option(
        "flink.apache.org/canary", "--label KEY", parse.label, "canary label, true in any case"
    )
    kinds: tuple[str, ...] = option(
        parse.FLINK_KINDS,
        "--kind PLURAL",
        parse.kinds,
        "canary kinds, repeatable or comma-separated: Flink's, or any as PLURAL.GROUP/VERSION",
        ",".join(parse.FLINK_KINDS),
        many=True,
        env="CANARYD_KINDS",
    )
    reconciled_by: str = option(
        "watch",
        "--reconciled-by watch|observed-generation|operator-metrics",
        parse.choice("reconciled-by", "watch", "observed-generation", "operator-metrics"),
        "a bump is reconciled when seen in the watch, in status, or in the operator's metrics",
    )
    operator_metrics_url: str = option(
        "http://127.0.0.1:9249/metrics",
        "--operator-metrics-url URL",
        parse.metrics_url,
        "the operator's Prometheus reporter, read with --reconciled-by operator-metrics",
        "http://127.0.0.1:PORT/metrics, PORT as the operator config file sets, else 9249",
        key="kubernetes.operator.metrics.reporter.<name>.port",
    )
    operator_account: tuple[str, str] | None = option(
        None,
        "--operator-account NS/NAME",
        parse.account,
        "the operator's service account, whose stale writes the admission policy refuses",
    )
    timeout: float = option(
        60.0,
        "--timeout DURATION",
        parse.duration(0.1, bare_floor=1.0),
        "canary cycle: bump every DURATION, judge each bump one DURATION later",
        "1 min; at least 100 ms",
        key="kubernetes.operator.health.canary.resource.timeout",
    )
    host: str = option(
        "0.0.0.0", "--host ADDR", parse.matching("host", ".+", ": empty"), "health server address"
    )
    port: int = option(
        8085,
        "--port N",
        parse.port,
        "health server port",
        key="kubernetes.operator.health.probe.port",
    )
    config_check_interval: float = option(
        300.0,
        "--config-check-interval DURATION",
        parse.duration(1.0),
        "operator config re-read interval",
        "5 min",
        key="kubernetes.operator.dynamic.config.check.interval",
    )
    log_format: str = option(
        "json",
        "--log-format json|console",
        parse.choice("log format", "json", "console"),
        "log format on stderr: one JSON object a line, or aligned text for people",
    )
    log_level: str = option(
        "info",
        "--log-level LEVEL",
        parse.choice("log level", *LOG_LEVELS, warn="warning"),
        f"least severe level logged: {', '.join(LOG_LEVELS)} (or warn), any case",
    )
    leader_elect: bool = option(
        False, "--leader-elect", parse.parse_bool, "replicas: the Lease's holder bumps", "off"
    )
    lease_name: str = option(
        "canaryd", "--lease-name NAME", parse.dns_name("lease name"), "the Lease"
    )
    lease_namespace: str = option(
        "default",
        "--lease-namespace NS",
        parse.dns_name("lease namespace"),
        "the Lease's namespace",
        "the service account's namespace in a pod, else default",
    )
    identity: str | None = option(
        None,
        "--identity ID",
        parse.matching("identity", ".+", ": empty"),
        "this replica's holder identity",
        "the host name and a random suffix",
    )
    lease_duration: float = option(
        15.0,
        "--lease-duration DURATION",
        parse.duration(1.0),
        "followers take the lease after seeing it unchanged this long",
        "15 s",
    )
    renew_deadline: float = option(
        10.0,
        "--renew-deadline DURATION",
        parse.duration(0.5),
        "a leader that cannot renew for this long stops bumping",
        "10 s",
    )
    retry_period: float = option(
        2.0,
        "--retry-period DURATION",
        parse.duration(0.1),
        "how often the lease is renewed or looked at",
        "2 s",
    )

    # Set by no flag: the operator config file's, and the tests'.
    from_file: frozenset[str] = frozenset()  # those the file decides: a re-read may change them
    dynamic_namespaces: bool = False  # KEY_DYNAMIC, read with the namespaces: they follow it
    watch_timeout: float = 300.0  # each watch asks for 1 to 2 times this (client-go's)
    # Not derived from the cycle (docs/CONFIGURATION.md, "Timings derived from the cycle"):
    watch_idle_timeout: float = 180.0  # outlasts the API server's bookmark interval
    list_timeout: float = 60.0  # grows with the number of canaries
    max_conflict_retries: int = 3  # a bump's retries on a fresh copy after 409 Conflict
    max_bumps_in_flight: int = 256  # each holds a connection: 10,000 canaries need ~170

    # Timings derived from the cycle: client-go's value (or kube's), at most a part of the
    # cycle (docs/CONFIGURATION.md has the table). Tests shorten the cycle and get these
    # exactly as a user would.
    request_timeout = Cycle(10.0, 2)
    connect_timeout = Cycle(5.0, 2)  # at most the request timeout
    keepalive_timeout = Cycle(15.0, 4)  # a connection gone half-open between bumps is not used
    backoff_initial = Cycle(0.8, 20)
    backoff_max = Cycle(30.0, 4)
    forbidden_retry = Cycle(60.0, 1)
    short_watch = Cycle(1.0, 4)
    resume_grace = Cycle(math.inf, 4)
    judge_slack = Cycle(1.0, 10)  # a judge this late (canaryd stalled) re-checks unhealthy
    scheduler_tick = Cycle(0.025, 80)  # 1/8 of the slack: docs/PERFORMANCE.md says why
    scrape_interval = Cycle(2.0, 10)
    scrape_connect_timeout = Cycle(2.5, 8)  # a frozen JVM's full backlog fails here

    @property
    def verdict_ttl(self) -> float:
        """How long an unhealthy verdict stands without a bump to re-test it: two cycles,
        less the judge's slack by which the judge may run late (else it ages a cycle late)."""
        return 2 * self.timeout - self.judge_slack

    @property
    def write_timeout(self) -> float:
        """Under --leader-elect every write is answered or abandoned before any follower
        may take the lease (canaryd.leader)."""
        if not self.leader_elect:
            return self.request_timeout
        return min(self.request_timeout, self.renew_deadline - 2 * self.retry_period)


OPTIONS: dict[str, Option] = {f.name: f.metadata["option"] for f in fields(Settings) if f.metadata}

# ------------------------------------------------------------------- resolving them


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse exits 2 itself; keep one clear line
        raise ConfigError(message)


CHECK = (
    "checks the configuration and asks the API server whether canaryd may do what it "
    "needs with it (exit 0 when all is granted, 2 naming what is not)"
)
EPILOG = (
    "Precedence: flag > environment > operator config file > default. DURATION: e.g. "
    "'30 s', '1 min', 'PT1M'; a bare number is milliseconds. Each option in full: "
    "docs/CONFIGURATION.md."
)


def build_parser(prog: str = "canaryd") -> argparse.ArgumentParser:
    """The daemon's parser, or ``canaryd check``'s: the same flags, its own usage."""
    parser = _Parser(prog=prog, description=f"canaryd check {CHECK}.", epilog=EPILOG)
    if prog == "canaryd":
        parser.description = "Canary health checks for the Apache Flink Kubernetes Operator."
        parser.epilog = f"{EPILOG} `canaryd check [FLAGS]` {CHECK}."
    for name, row in OPTIONS.items():
        key = f" [{row.key}]" if row.key else ""
        # A switch is None when not given: the environment decides.
        kind: dict[str, Any] = {"action": "store_true", "default": None}
        if row.metavar:
            kind = {"metavar": row.metavar, "action": "append" if row.many else "store"}
        text = f"{row.help} [env {row.env}]{key} (default: {row.shown})"
        parser.add_argument(row.flag, dest=name, help=text, **kind)
    parser.add_argument("--version", action="version", version=f"canaryd {__version__}")
    return parser


def _parsed(parse: Callable[[Any], T], value: Any, source: str) -> T:
    try:
        return parse(value)
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None


def load_settings(
    argv: Sequence[str], environ: Mapping[str, str], prog: str = "canaryd"
) -> Settings:
    """Every setting by precedence; a bad value is a ConfigError naming its source:
    ``--timeout: ...``, ``CANARYD_TIMEOUT=30x: ...`` or ``FILE: KEY: ...``."""
    durations = {row.flag for row in OPTIONS.values() if row.metavar == "DURATION"}
    joined: list[str] = []  # ``--timeout -5s`` as ``--timeout=-5s``: refused as a duration
    for item in argv:
        if joined and joined[-1] in durations and item.startswith("-"):
            joined[-1] = f"{joined[-1]}={item}"
        else:
            joined.append(item)
    args = vars(build_parser(prog).parse_args(joined))
    given: dict[str, Any] = {}  # field: its flag's value, else its environment variable's
    for name, row in OPTIONS.items():
        value, source = args[name], row.flag
        if value is None and environ.get(row.env, "") != "":
            value, source = environ[row.env], f"{row.env}={environ[row.env]}"
        if value is not None:
            text = ",".join(value) if isinstance(value, list) else value
            given[name] = _parsed(row.parse, text, source)
    if given.get("leader_elect") and "lease_namespace" not in given:
        with contextlib.suppress(OSError):  # in a pod: its service account's
            given["lease_namespace"] = SA_NAMESPACE_FILE.read_text().strip() or "default"
    if given.get("operator_config") is not None:
        given["from_file"] = frozenset(n for n, r in OPTIONS.items() if r.key and n not in given)
        given.update(operator_config_values(given["operator_config"], given["from_file"]))
    return Settings(**given)  # every field not given: its default


def operator_config_values(path: Path, names: frozenset[str]) -> dict[str, Any]:
    """The settings ``names`` (those no flag or variable gives) as the operator config
    file says now, its value or the default; with the namespaces, whether dynamic."""
    file, flat, _, _ = read_operator_config(path)
    reporter = str(OPTIONS["operator_metrics_url"].key)  # read from its reporter's port
    flat = {**flat, reporter: parse.reporter_url(flat)}  # None without one: the default
    wanted = [(n, r.key, r.parse) for n, r in OPTIONS.items() if n in names and r.key]
    if "namespaces" in names:
        wanted.append(("dynamic_namespaces", KEY_DYNAMIC, parse.parse_bool))
    said: dict[str, Any] = {}
    for name, key, parser in wanted:  # in the rows' order: the first bad value is told
        if any(other.startswith(f"{key}.") for other in flat):
            raise ConfigError(
                f"{file}: {key}: must be a value (namespaces: a comma-separated string or a "
                "list), not a mapping"
            )
        said[name] = getattr(Settings(), name)  # the default, unless the file says
        if flat.get(key) is not None:
            said[name] = _parsed(parser, flat[key], f"{file}: {key}")
    return said


async def follow_operator_config(
    settings: Settings, reload: asyncio.Event, watched: frozenset[str] | None
) -> AsyncIterator[frozenset[str] | None]:
    """Re-read the operator config at each ``reload`` (SIGHUP), and every check interval
    when the ``watched`` namespaces follow it, yielding them (docs/CONFIGURATION.md,
    "Dynamic namespaces", says what is logged and applied)."""
    path, follows = settings.operator_config, settings.dynamic_namespaces
    every = settings.config_check_interval if follows else None
    problem: str | None = None
    last = dict(vars(settings))  # each setting as last read (before the first: as started)
    try:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(reload.wait(), every)
            reload.clear()
            if path is None or not settings.from_file:
                log.info("sighup_ignored", why="no setting comes from an operator config")
                continue
            try:
                said = operator_config_values(path, settings.from_file)
            except ConfigError as err:
                metrics.CONFIG_RELOADS.labels("failed").inc()
                if str(err) != problem:  # once per problem, not per check
                    keeping = sorted(watched or ()) or "all"
                    log.error("operator_config_reload_failed", error=str(err), keeping=keeping)
                problem = str(err)
                continue
            if problem is not None:
                log.info("operator_config_readable_again", was=problem)
            problem = None
            changed = {name: now for name, now in said.items() if now != last[name]}
            for name, now in changed.items():
                log.info(
                    "operator_config_changed",
                    setting=name,
                    was=sorted(was) if isinstance(was := last[name], frozenset) else was,
                    now=sorted(now) if isinstance(now, frozenset) else now,
                    applied="now" if follows and name == "namespaces" else "at a restart",
                )
            last.update(said)
            metrics.CONFIG_RELOADS.labels("changed" if changed else "unchanged").inc()
            if follows:
                watched = said["namespaces"]
                yield watched
    except asyncio.CancelledError:
        log.info("config_follower_stopped", why="cancelled")
        raise


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
        configured = parse.reporter_url(flat) is not None
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
