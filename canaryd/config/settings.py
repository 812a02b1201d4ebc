"""``Settings``: everything canaryd runs with, typed, and the timings derived from them.

Nothing here parses text: flags.py resolves the values, once, at the edge.
"""

from __future__ import annotations

import secrets
import socket
from dataclasses import dataclass
from pathlib import Path

from canaryd.config.values import ConfigError

DEFAULT_LABEL = "flink.apache.org/canary"
DEFAULT_KINDS = ("flinkdeployments", "flinksessionjobs")
SA_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


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
    from_file: frozenset[str] = frozenset()
    """The settings the operator config file decides (neither a flag nor the
    environment gives them): a re-read may change them."""
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
    operator_account: tuple[str, str] | None = None
    """(namespace, name) of the operator's service account, which the admission policy
    judges; None: not said (the sidecar runs as that account)."""
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
    max_bumps_in_flight: int = 256
    """Bumps writing at once, at most (each holds a connection). 10,000 canaries on a
    60 s cycle with 1 s writes (an admission webhook in the path) need about 170."""
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
        deadline less two retry periods (6 s at the defaults). A leader's write is sent
        only while ``MIN_WRITE_TIMEOUT`` of its renew deadline is left after its last
        renew, with what is left (at most this) as its timeout, so every write is
        answered or abandoned before any follower may take the lease."""
        if not self.leader_elect:
            return self.request_timeout
        return min(self.request_timeout, self.renew_deadline - 2 * self.retry_period)

    @property
    def keepalive_timeout(self) -> float:
        """How long a request connection may sit idle in the pool and still be reused:
        aiohttp's 15 s, at most a quarter of the cycle, so a bump seldom goes over a
        connection that went silent between bumps (half-open: a crashed replica behind
        a load balancer) and costs its request timeout."""
        return min(15.0, self.timeout / 4)

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
        """A judge that runs later than this after its deadline ran late because canaryd
        itself stalled (GC, CPU starvation): watch events may sit unread in its sockets,
        so an unhealthy verdict is re-checked once this much later. A tenth of the cycle,
        at most a second."""
        return min(1.0, self.timeout / 10)

    @property
    def scheduler_tick(self) -> float:
        """The scheduler wakes at most once per tick and takes every deadline due within
        it together (a wake per canary was a third of canaryd's CPU), so a deadline is
        met at most a tick late: an eighth of the judge's slack, at most 25 ms (a longer
        tick's bursts held /healthz back: docs/PERFORMANCE.md)."""
        return min(0.025, self.judge_slack / 8)

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


def default_identity() -> str:
    """The host name and a random suffix, as client-go's users make theirs: systemd and
    VM deployments often share a host name, and two replicas of one identity would
    both take themselves for the holder."""
    return f"{socket.gethostname()}_{secrets.token_hex(4)}"


MIN_WRITE_TIMEOUT = 1.0
"""The shortest write timeout the lease timings may leave a leader (seconds): a bump
that must be answered sooner than this fails on any ordinary delay."""


def check_lease_timings(settings: Settings) -> None:
    """Every rule the lease timings keep, in one place; raises ConfigError naming the
    flags. A renewal is sent a retry period after the last one (or sooner: a retry) and
    may be answered until its request timeout or its renew deadline, whichever comes
    first; the fence then lets a write through only while ``MIN_WRITE_TIMEOUT`` of the
    renew deadline is left (or the write timeout, when less: canaryd.leader). Timings
    under which a renewal answered in time leaves less than that would hold every
    write back while the leader renews."""
    lease, renew, retry = settings.lease_duration, settings.renew_deadline, settings.retry_period
    # client-go's NewLeaderElector: LeaseDuration > RenewDeadline > JitterFactor (1.2) x
    # RetryPeriod, or a leader could lose its lease before it notices.
    if not lease > renew:
        raise ConfigError("lease duration must be greater than the renew deadline")
    # What followers see is what the Lease stores: whole seconds (client-go truncates).
    stored = lease_seconds(lease)
    if not stored > renew:
        raise ConfigError(
            f"lease duration {lease:g}s is stored in the Lease as {stored} s (whole seconds), "
            f"which must be greater than the renew deadline {renew:g}s"
        )
    if not renew > 1.2 * retry:
        raise ConfigError("renew deadline must be greater than 1.2 x the retry period")
    if not settings.leader_elect:
        return
    budget = settings.renew_deadline - 2 * settings.retry_period
    if budget < MIN_WRITE_TIMEOUT:
        raise ConfigError(
            f"renew deadline {renew:g}s less twice the retry period {retry:g}s leaves "
            f"{budget:g}s for a write, below {MIN_WRITE_TIMEOUT:g}s: a leader sends a bump "
            "only while that much of its renew deadline is left (raise --renew-deadline or "
            "lower --retry-period)"
        )
    left = max(renew - settings.request_timeout, retry)
    needed = min(settings.write_timeout, MIN_WRITE_TIMEOUT)
    if left < needed:
        raise ConfigError(
            f"--renew-deadline {renew:g}s, --retry-period {retry:g}s and --timeout "
            f"{settings.timeout:g}s: a lease renewal answered within its request timeout "
            f"({settings.request_timeout:g}s) may leave {left:g}s of the renew deadline, "
            f"below the {needed:g}s a write needs, and the leader's fence shut while it "
            "renews (raise --renew-deadline or --retry-period)"
        )


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
