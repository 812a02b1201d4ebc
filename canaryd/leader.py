"""Leader election over a ``coordination.k8s.io/v1`` Lease, with client-go's rules
(tools/leaderelection): a candidate takes the lease only once it has seen the holder's
record unchanged for its lease duration on its own monotonic clock (or released); every
write carries the resourceVersion it read, so two candidates cannot both win. Kubernetes
has no fencing token: the writer awaits ``write_permit()`` before each write (the bound:
docs/CONFIGURATION.md, "Replicas behind a Lease").
"""

from __future__ import annotations

import asyncio
import random
import secrets
import socket
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import structlog

from canaryd import metrics
from canaryd.config import Settings
from canaryd.episodes import Episodes
from canaryd.kube import ErrorKind, KubeClient, KubeError, segment
from canaryd.logs import wall_time

log = structlog.get_logger("canaryd.leader")

MIN_WRITE_TIMEOUT = 1.0  # seconds: a bump to be answered sooner fails on any delay


def spec_of(lease: Mapping[str, Any]) -> Mapping[str, Any]:
    spec = lease.get("spec")
    return spec if isinstance(spec, Mapping) else {}


class LeaderElector:
    def __init__(
        self, settings: Settings, kube: KubeClient, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.settings, self.kube = settings, kube
        # By default as client-go's users make theirs: two replicas on hosts of one name
        # would both take themselves for the holder.
        self.identity = settings.identity or f"{socket.gethostname()}_{secrets.token_hex(4)}"
        self.namespace, self.name = settings.lease_namespace, settings.lease_name
        base = f"/apis/coordination.k8s.io/v1/namespaces/{segment(self.namespace)}/leases"
        self._collection, self._path = base, f"{base}/{segment(self.name)}"
        self._clock = clock
        self.leading = False
        self.leader: str | None = None  # the holder this replica last saw
        # The record as last seen (None: none yet, so the first holder is no transition),
        # and when (our clock) it last changed.
        self._observed_spec: Mapping[str, Any] | None = None
        self._observed_at = 0.0
        self._expires_at = float("inf")  # when the other holder's lease runs out
        self._renewed_at = float("-inf")  # when the last acquire or renew was sent
        # Set (and replaced) at every renewal, role change, and other holder seen.
        self._changed = asyncio.Event()
        self._written: Mapping[str, Any] | None = None  # the optimistic update's base
        self.problem: str | None = None  # why the last round could not read or write it
        self.failures = Episodes("lease_failures", "lease", lambda: settings.timeout, clock=clock)
        metrics.LEADER.set(0)

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"

    async def write_permit(self, within: float) -> float | None:
        """The client timeout of a write sent now, once the fence lets it through (a
        write it holds back waits for the next successful renewal, at most ``within``
        seconds: then TimeoutError); None once this replica no longer leads: the write
        is not sent."""
        until = None
        while self.leading:
            timeout, left = self.settings.write_timeout, self._renew_left()
            if left >= min(timeout, MIN_WRITE_TIMEOUT):
                return min(timeout, left)
            until = until or asyncio.get_running_loop().time() + within
            async with asyncio.timeout_at(until):
                await self._changed.wait()
        return None

    async def roles(self) -> AsyncIterator[tuple[bool, str | None]]:
        """This replica's role, now and after every change (and renewal): whether it
        leads, and the other holder it saw (None: none, or itself). The scheduler,
        given this elector, follows it; nothing here calls the scheduler."""
        while True:
            changed = self._changed
            yield self.leading, self.leader if self.leader != self.identity else None
            await changed.wait()

    def _role_changed(self) -> None:
        """Wake the writes waiting for the fence and whoever follows the role."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def run(self) -> None:
        """Acquire, then renew every retry period, in one loop; a leader whose renew
        deadline passed without a renewal stops leading and is a candidate again."""
        log.info("leader_election_started", lease=str(self), identity=self.identity)
        try:
            while True:
                left = self._renew_left()
                if left <= 0:
                    self._stop_leading("it could not renew the lease within the renew deadline")
                    continue
                try:
                    async with asyncio.timeout(left if self.leading else None):
                        held = await self._attempt(min(left, self.settings.request_timeout))
                except TimeoutError:
                    if not self.leading:
                        raise
                    held = False
                if held and not self.leading:
                    self.leading = True
                    metrics.LEADER.set(1)
                    log.info("leading", lease=str(self), identity=self.identity)
                    self._role_changed()
                pause = self.settings.retry_period
                if not held:
                    # Jittered below the retry period (a released lease is taken in under
                    # one); a candidate's ends when the holder's lease runs out, if sooner.
                    until = self._renew_left() if self.leading else self._expires_at - self._clock()
                    pause = min(pause * random.uniform(0.75, 1.0), until)
                await asyncio.sleep(max(0.0, pause))
        except asyncio.CancelledError:
            if self.leading:
                self._stop_leading("canaryd is stopping")
                await self._release()
            log.info("leader_election_stopped", why="cancelled")
            raise
        except Exception:
            # A bug: the supervisor logs it and restarts the election; never lead blind.
            if self.leading:
                self._stop_leading("leader election failed unexpectedly")
            raise

    def _renew_left(self) -> float:
        """What is left of a leader's renew deadline (a candidate has none)."""
        if not self.leading:
            return float("inf")
        return self._renewed_at + self.settings.renew_deadline - self._clock()

    def _stop_leading(self, why: str) -> None:
        self.leading = False
        metrics.LEADER.set(0)
        log.warning("stopped_leading", lease=str(self), identity=self.identity, why=why)
        self._role_changed()

    async def _attempt(self, time_limit: float) -> bool:
        """One round, and what it says about canaryd's access to the lease."""
        try:
            held = await self._try(time_limit)
        except KubeError as err:
            if err.kind is not ErrorKind.CONFLICT:  # a 409 is another replica writing first
                self.problem = str(err)
                self.failures.failed(str(self), err.kind.value, str(err))
                return False
            held = False
        self.problem = None
        self.failures.recovered(str(self))
        return held

    async def _try(self, time_limit: float) -> bool:
        """client-go's tryAcquireOrRenew: True when this replica holds the lease now;
        raises KubeError. Acquiring and renewing are one update of the Lease read, but a
        leader first tries one from the copy it last wrote (one request)."""
        started = self._clock()
        self._expires_at = float("inf")  # known again only if the lease is held
        if self.leading and self._written is not None:
            try:
                await self._write(self._written, time_limit, started, "optimistic_")
                return True
            except KubeError:
                time_limit -= self._clock() - started
                if time_limit <= 0:
                    raise  # no time to read and write again: this round failed with it
        try:
            current = await self.kube.request("get", "GET", self._path, time_limit=time_limit)
        except KubeError as err:
            if err.kind is not ErrorKind.GONE:
                raise
            current = None
        if current is not None:
            # Seen when the answer came back, not when the read was sent: a renew the
            # holder wrote meanwhile is in it; its lease duration runs from no earlier.
            spec = self._observe(current)
            holder = spec.get("holderIdentity") or ""
            duration = spec.get("leaseDurationSeconds")
            if not isinstance(duration, int) or isinstance(duration, bool) or duration <= 0:
                duration = self.settings.lease_duration
            if holder and holder != self.identity and self._observed_at + duration > started:
                # Held, and not yet seen unchanged for its lease duration.
                self._expires_at = self._observed_at + duration
                return False
        await self._write(current, time_limit, started)
        return True

    def _observe(self, lease: Mapping[str, Any]) -> Mapping[str, Any]:
        """Note the record read or written, as of now (its answer's arrival)."""
        spec = spec_of(lease)
        seen_before = self._observed_spec is not None
        if spec != self._observed_spec:
            self._observed_spec, self._observed_at = dict(spec), self._clock()
        holder = str(spec.get("holderIdentity") or "") or None
        if holder != self.leader:
            if holder is not None and seen_before:
                # A passing this replica saw; the holder found at start is none.
                metrics.LEADER_TRANSITIONS.inc()
            log.info("leader_observed", lease=str(self), leader=holder, was=self.leader)
            self.leader = holder
            self._role_changed()
        return spec

    def _lease(self, current: Mapping[str, Any] | None) -> dict[str, Any]:
        """The Lease held by this replica, renewed now: a new one (``current`` None),
        ``current`` renewed (this replica's: read, or as it last wrote it), or taken
        over (a new acquire time, one more transition). Its resourceVersion, if any, is
        the write's precondition."""
        spec = spec_of(current or {})
        transitions = spec.get("leaseTransitions")
        transitions = transitions if isinstance(transitions, int) else 0
        acquired = str(spec.get("acquireTime") or wall_time(time.time(), fraction=True))
        if current is None:
            current = {"metadata": {"name": self.name, "namespace": self.namespace}}
        elif spec.get("holderIdentity") != self.identity:
            transitions, acquired = transitions + 1, wall_time(time.time(), fraction=True)
        metadata = current.get("metadata")
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": dict(metadata) if isinstance(metadata, Mapping) else {},
            "spec": {
                "holderIdentity": self.identity,
                "leaseDurationSeconds": lease_seconds(self.settings.lease_duration),
                "acquireTime": acquired,
                "renewTime": wall_time(time.time(), fraction=True),
                "leaseTransitions": transitions,
            },
        }

    async def _write(
        self, current: Mapping[str, Any] | None, time_limit: float, started: float, how: str = ""
    ) -> None:
        """Create (POST, ``current`` None) or update (PUT) the Lease, this replica's as
        of ``started``; raises KubeError."""
        verb, method, path = ("update", "PUT", self._path)
        if current is None:
            verb, method, path = ("create", "POST", self._collection)
        body = self._lease(current)
        try:
            written = await self.kube.request(verb, method, path, body=body, time_limit=time_limit)
        except KubeError as err:
            self._written = None
            log.debug(f"lease_{how}{verb}_failed", lease=str(self), error=str(err))
            raise
        self._observe(written)
        self._renewed_at = started  # the deadline runs from the write's start: early, safe
        self._written = written
        self._role_changed()

    async def _release(self) -> None:
        """client-go's ReleaseOnCancel, once the daemon has finished or cancelled every
        bump. Bounded by one write timeout in all (so that a stop takes at most two: the
        bumps in flight, then this); a failure is only logged."""
        deadline = self._clock() + self.settings.write_timeout
        try:
            current = await self.kube.request(
                "get", "GET", self._path, time_limit=self.settings.write_timeout
            )
            if spec_of(current).get("holderIdentity") != self.identity:
                return
            released = self._lease(current)  # as client-go's: no holder, one second left
            spec = released["spec"]
            del spec["holderIdentity"]
            spec.update(leaseDurationSeconds=1, acquireTime=spec["renewTime"])
            left = deadline - self._clock()
            if left <= 0:
                raise KubeError(ErrorKind.TRANSIENT, "no time left to release it", reason="Timeout")
            await self.kube.request("update", "PUT", self._path, body=released, time_limit=left)
            log.info("lease_released", lease=str(self), identity=self.identity)
        except KubeError as err:
            log.warning("lease_release_failed", lease=str(self), error=str(err))


def lease_seconds(lease_duration: float) -> int:
    """leaseDurationSeconds: whole seconds, truncated as client-go does, at least 1."""
    return max(1, int(lease_duration))


def lease_timings_problem(settings: Settings) -> str | None:
    """What is wrong with the lease timings, checked together at start (the entry points
    exit 2 with it), or None. A renewal answered within its request timeout must leave
    the fence (``MIN_WRITE_TIMEOUT`` of the renew deadline) open, or every write would
    be held back while the leader renews."""
    lease, renew, retry = settings.lease_duration, settings.renew_deadline, settings.retry_period
    # client-go's NewLeaderElector: LeaseDuration > RenewDeadline > JitterFactor (1.2) x
    # RetryPeriod, or a leader could lose its lease before it notices.
    if not lease > renew:
        return "lease duration must be greater than the renew deadline"
    # What followers see is what the Lease stores: whole seconds (client-go truncates).
    if not lease_seconds(lease) > renew:
        return (
            f"lease duration {lease:g}s is stored in the Lease as {lease_seconds(lease)} s "
            f"(whole seconds), which must be greater than the renew deadline {renew:g}s"
        )
    if not renew > 1.2 * retry:
        return "renew deadline must be greater than 1.2 x the retry period"
    budget = renew - 2 * retry
    if settings.leader_elect and budget < MIN_WRITE_TIMEOUT:
        return (
            f"renew deadline {renew:g}s less twice the retry period {retry:g}s leaves "
            f"{budget:g}s for a write, below {MIN_WRITE_TIMEOUT:g}s: a leader sends a bump "
            "only while that much of its renew deadline is left (raise --renew-deadline or "
            "lower --retry-period)"
        )
    left = max(renew - settings.request_timeout, retry)
    needed = min(settings.write_timeout, MIN_WRITE_TIMEOUT)
    if settings.leader_elect and left < needed:
        return (
            f"--renew-deadline {renew:g}s, --retry-period {retry:g}s and --timeout "
            f"{settings.timeout:g}s: a lease renewal answered within its request timeout "
            f"({settings.request_timeout:g}s) may leave {left:g}s of the renew deadline, "
            f"below the {needed:g}s a write needs, and the leader's fence shut while it "
            "renews (raise --renew-deadline or --retry-period)"
        )
    return None
