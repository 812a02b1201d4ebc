"""--leader-elect: replicas behind a coordination.k8s.io/v1 Lease, with client-go's
timings as shipped (lease 15 s, renew deadline 10 s, retry 2 s) and a short cycle.

Several canaryd processes run against one fake API server, each as a user of its own
(its bearer token), so the request log says who wrote what: exactly one writer per
canary per cycle, and never two writers across a hand-over.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from canaryd.config import Settings
from canaryd.leader import MIN_WRITE_TIMEOUT
from canaryd.registry import CanaryState
from canaryd.testing.apiserver import LEASES, FakeKube, Fault
from canaryd.testing.process import canaryd_argv, free_port
from tests.harness import counter, create_canary, running_daemon

pytestmark = pytest.mark.timeout(120)

CYCLE = 0.5  # a cycle several processes can keep side by side; the lease timings are the defaults
DEFAULTS = Settings()
LEASE_DURATION, RENEW_DEADLINE, RETRY = (
    DEFAULTS.lease_duration,
    DEFAULTS.renew_deadline,
    DEFAULTS.retry_period,
)
SLACK = 1.0
SOLO = {"leader_elect": True, "identity": "solo", "lease_namespace": "default"}
"""One replica under --leader-elect, its Lease in the canaries' namespace."""
"""Process and event-loop latency allowed on top of a protocol bound."""


def user(identity: str) -> str:
    return f"system:serviceaccount:canaryd:{identity}"


@dataclass
class Replica:
    identity: str
    proc: asyncio.subprocess.Process
    url: str

    async def unscheduled(self, http: aiohttp.ClientSession) -> float:
        """canaryd_canaries_unscheduled: tracked canaries not due or in flight exactly
        once (the scheduler's invariant; 0 on a follower, which schedules nothing)."""
        async with http.get(f"{self.url}/metrics") as response:
            for line in (await response.text()).splitlines():
                if line.startswith("canaryd_canaries_unscheduled "):
                    return float(line.split()[-1])
        raise AssertionError(f"{self.identity}: no canaryd_canaries_unscheduled in /metrics")

    async def health(self, http: aiohttp.ClientSession) -> dict[str, Any] | None:
        try:
            async with http.get(
                f"{self.url}/healthz", headers={"Accept": "application/json"}
            ) as response:
                body: dict[str, Any] = await response.json()
                body["status"] = response.status
                return body
        except (aiohttp.ClientError, ValueError):
            return None


class Cluster:
    def __init__(
        self, kube: FakeKube, tmp: Path, http: aiohttp.ClientSession, cycle: float = CYCLE
    ) -> None:
        self.kube, self.tmp, self.http, self.cycle = kube, tmp, http, cycle
        self.replicas: dict[str, Replica] = {}

    async def start(self, identity: str) -> Replica:
        kubeconfig = self.kube.client_kubeconfig(
            self.tmp / f"{identity}.kubeconfig", user(identity)
        )
        port = free_port()
        proc = await asyncio.create_subprocess_exec(
            *canaryd_argv(
                kubeconfig,
                port,
                self.cycle,
                "--leader-elect",
                "--identity",
                identity,
                "--lease-namespace",
                "default",
                "--kind",
                "flinkdeployments",
            ),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        replica = Replica(identity, proc, f"http://127.0.0.1:{port}")
        self.replicas[identity] = replica
        return replica

    def holder(self) -> str | None:
        lease = self.kube.get(LEASES.plural, "default", "canaryd")
        return (lease or {}).get("spec", {}).get("holderIdentity") or None

    async def until(self, predicate: Any, what: str, within: float) -> float:
        """Poll (the replicas are other processes: no event to await) until ``predicate``
        holds; returns the loop time it did."""
        loop = asyncio.get_running_loop()
        end = loop.time() + within
        while True:
            if await predicate():
                return loop.time()
            if loop.time() > end:
                raise AssertionError(f"timed out after {within}s waiting for {what}")
            await asyncio.sleep(0.05)

    async def leader(self, within: float) -> Replica:
        async def one_leads() -> bool:
            holder = self.holder()
            if holder not in self.replicas:
                return False
            body = await self.replicas[holder].health(self.http)
            return body is not None and body["role"] == "leader"

        await self.until(one_leads, "a replica to lead", within)
        holder = self.holder()
        assert holder is not None
        return self.replicas[holder]

    def writers(self, since: float = 0.0) -> list[tuple[float, str]]:
        """(time, user) of every bump the fake accepted."""
        return [
            (r.at, r.user)
            for r in self.kube.requests
            if r.verb == "patch" and r.status == 200 and r.at >= since
        ]

    async def stop(self) -> None:
        for replica in self.replicas.values():
            if replica.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    replica.proc.send_signal(signal.SIGTERM)
        for replica in self.replicas.values():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(10):
                    await replica.proc.wait()
            if replica.proc.returncode is None:
                replica.proc.kill()
                await replica.proc.wait()


@contextlib.asynccontextmanager
async def cluster(
    kube: FakeKube,
    tmp: Path,
    *identities: str,
    cycle: float = CYCLE,
    canaries: tuple[str, ...] = ("one", "two"),
) -> AsyncIterator[Cluster]:
    for name in canaries:
        create_canary(kube, name)
    async with aiohttp.ClientSession() as http:
        group = Cluster(kube, tmp, http, cycle)
        try:
            for identity in identities:
                await group.start(identity)
            yield group
        finally:
            await group.stop()


def assert_one_writer_at_a_time(writes: list[tuple[float, str]]) -> None:
    """Once another replica wrote, the one before never writes again."""
    order = [who for _, who in writes]
    runs = [who for i, who in enumerate(order) if i == 0 or order[i - 1] != who]
    assert len(runs) == len(set(runs)), f"writers interleaved: {runs}"


@pytest.mark.slow
async def test_of_three_replicas_exactly_one_bumps_and_followers_answer_200(kube, tmp_path):
    async with cluster(kube, tmp_path, "a", "b", "c") as group:
        leader = await group.leader(within=10)
        start = asyncio.get_running_loop().time()

        async def cycles_pass() -> bool:
            return len(group.writers(start)) >= 2 * 6  # two canaries, six cycles

        await group.until(cycles_pass, "six cycles of bumps", within=20 * CYCLE + 5)
        writers = {who for _, who in group.writers(start)}
        assert writers == {user(leader.identity)}, writers
        # One writer per canary per cycle: about one bump per canary per cycle.
        per_canary = [
            r for r in kube.requests_for("patch", name="one") if r.status == 200 and r.at >= start
        ]
        gaps = [b.at - a.at for a, b in itertools.pairwise(per_canary)]
        assert min(gaps) > CYCLE / 2, gaps
        body = await leader.health(group.http)
        assert body is not None and body["role"] == "leader" and body["leader"] == leader.identity
        for identity, replica in group.replicas.items():
            if identity == leader.identity:
                continue
            answer = await replica.health(group.http)
            assert answer is not None and answer["status"] == 200, answer
            assert answer["role"] == "follower" and answer["leader"] == leader.identity
            assert {c["state"] for c in answer["canaries"]} == {"pending"}
            assert all("standby" in c["reason"] for c in answer["canaries"])
            assert {c["name"] for c in answer["canaries"]} == {"one", "two"}  # warm
        for replica in group.replicas.values():
            assert await replica.unscheduled(group.http) == 0, replica.identity


@pytest.mark.slow
async def test_a_killed_leader_is_replaced_within_lease_duration_plus_retry(kube, tmp_path):
    async with cluster(kube, tmp_path, "a", "b") as group:
        old = await group.leader(within=10)
        loop = asyncio.get_running_loop()
        old.proc.send_signal(signal.SIGKILL)
        await old.proc.wait()
        killed = loop.time()
        new = await group.leader(within=LEASE_DURATION + RETRY + 10)
        took = loop.time() - killed
        assert new.identity != old.identity
        print(f"SIGKILL hand-over: {took:.2f}s")
        assert took <= LEASE_DURATION + RETRY + SLACK, took
        led = loop.time()

        async def judged_healthy() -> bool:
            body = await new.health(group.http)
            return body is not None and all(c["state"] == "healthy" for c in body["canaries"])

        # It judges from its first cycle: its first bumps within a cycle, judged a cycle on.
        judged = await group.until(judged_healthy, "the new leader's verdicts", 2 * CYCLE + SLACK)
        print(f"first verdicts {judged - led:.2f}s after it led")
        assert {who for _, who in group.writers(led)} == {user(new.identity)}
        assert await new.unscheduled(group.http) == 0


@pytest.mark.slow
@pytest.mark.parametrize("cut_off", ["leases", None], ids=["from-the-lease", "from-everything"])
async def test_a_leader_cut_off_stops_bumping_before_its_lease_can_expire(kube, tmp_path, cut_off):
    """The fake drops the leader's requests: its Lease requests only (its bumps still
    reach the server, the hard case), or all of them. It must stop writing at its renew
    deadline, before the follower may take over (a lease duration after it last saw
    the lease change) — never two writers across the hand-over."""
    async with cluster(kube, tmp_path, "a", "b") as group:
        old = await group.leader(within=10)
        follower = next(r for r in group.replicas.values() if r is not old)
        loop = asyncio.get_running_loop()

        async def it_bumps() -> bool:
            return any(who == user(old.identity) for _, who in group.writers())

        await group.until(it_bumps, "the leader's first bumps", within=4 * CYCLE)
        kube.inject(Fault(user=user(old.identity), resource=cut_off, drop=True, times=-1))
        cut = loop.time()

        async def stepped_down() -> bool:
            body = await old.health(group.http)
            return body is not None and body["role"] == "follower"

        down = await group.until(stepped_down, "the cut-off leader to step down", 20)
        new = await group.leader(within=LEASE_DURATION + RETRY + 10)
        assert new is follower
        taken = loop.time()

        async def new_bumps() -> bool:
            return any(who == user(new.identity) for _, who in group.writers())

        # Its first bumps come within a cycle of taking the lease, not with it.
        await group.until(new_bumps, "the new leader's first bump", within=CYCLE + SLACK)
        writes = group.writers()
        last_old = max(at for at, who in writes if who == user(old.identity))
        first_new = min(at for at, who in writes if who == user(new.identity))
        print(
            f"partition ({cut_off or 'all'}): stepped down {down - cut:.2f}s after the cut, "
            f"last bump {last_old - cut:.2f}s, new leader's first bump {first_new - cut:.2f}s "
            f"(lease taken {taken - cut:.2f}s)"
        )
        assert last_old - cut <= RENEW_DEADLINE + SLACK
        assert last_old < first_new
        assert first_new - last_old >= LEASE_DURATION - RENEW_DEADLINE - SLACK
        assert_one_writer_at_a_time(writes)
        assert await new.unscheduled(group.http) == 0


@pytest.mark.slow
async def test_a_deposed_leaders_slow_writes_are_abandoned_before_the_follower_takes_over(
    kube, tmp_path
):
    """Kubernetes has no fencing token: one writer comes from time. The fake slows every
    answer to the leader past its deadlines (9 s: its renews fail, its bumps hang),
    while the follower takes over as soon as client-go's rule lets it. At a 20 s cycle
    the request timeout is the shipped 10 s, so before the fix a bump sent just before
    the renew deadline was still awaited (and then applied) after the follower held the
    Lease. Now a bump is sent only while 1 s of the renew deadline is left, with what is
    left (at most the 6 s write timeout) as its timeout: the fake applies none of the
    leader's writes after the follower took the Lease (a client that went away cancels
    its request, as in kube-apiserver)."""
    cycle, slow = 20.0, 9.0
    names = tuple(f"c{i}" for i in range(30))  # 1.5 bumps a second: some near any moment
    async with cluster(kube, tmp_path, "a", "b", cycle=cycle, canaries=names) as group:
        old = await group.leader(within=10)
        follower = next(r for r in group.replicas.values() if r is not old)
        loop = asyncio.get_running_loop()

        async def it_bumps() -> bool:
            return any(who == user(old.identity) for _, who in group.writers())

        await group.until(it_bumps, "the leader's first bumps", within=cycle)
        kube.inject(Fault(user=user(old.identity), code=0, latency=slow, times=-1))
        slowed = loop.time()

        async def follower_leads() -> bool:
            body = await follower.health(group.http)
            return group.holder() == follower.identity and bool(body and body["role"] == "leader")

        await group.until(follower_leads, "the follower to lead", LEASE_DURATION + RETRY + 10)
        new = follower
        taken = min(
            r.served_at
            for r in kube.requests
            if r.resource == "leases"
            and r.verb == "update"
            and r.user == user(new.identity)
            and r.served_at is not None
            and r.body["spec"]["holderIdentity"] == new.identity
        )

        def old_patches() -> list[Any]:
            return [r for r in kube.requests if r.verb == "patch" and r.user == user(old.identity)]

        async def all_ended() -> bool:
            return all(r.ended_at is not None for r in old_patches())

        await group.until(all_ended, "the deposed leader's writes to end", within=slow + SLACK)
        renewed = max(
            r.served_at
            for r in kube.requests
            if r.resource == "leases" and r.user == user(old.identity) and r.served_at is not None
        )
        late = [r for r in old_patches() if r.served_at is not None and r.served_at >= taken]
        slowed_writes = [r for r in old_patches() if r.at >= slowed]
        last_sent = max(r.at for r in slowed_writes)
        print(
            f"slowed {slow:g}s: last renew {renewed - slowed:+.2f}s, last write sent "
            f"{last_sent - renewed:.2f}s after it, lease taken {taken - renewed:.2f}s after "
            f"it; {len(slowed_writes)} slowed writes, "
            f"{sum(r.abandoned for r in slowed_writes)} abandoned, {len(late)} applied late"
        )
        assert slowed_writes, "no write was in flight while the answers were slow"
        assert not late, [(r.name, r.at - renewed, r.served_at - renewed) for r in late]
        assert last_sent - renewed <= RENEW_DEADLINE - MIN_WRITE_TIMEOUT + SLACK
        assert all(r.abandoned for r in slowed_writes), "a write slower than 6 s was answered"


@pytest.mark.slow
async def test_sigterm_releases_the_lease_and_a_follower_takes_it_within_a_retry_period(
    kube, tmp_path
):
    async with cluster(kube, tmp_path, "a", "b") as group:
        old = await group.leader(within=10)
        old.proc.send_signal(signal.SIGTERM)
        assert await old.proc.wait() == 0
        new = await group.leader(within=RETRY + 5)
        assert new is not old
        puts = [
            r
            for r in kube.requests
            if r.resource == "leases" and r.verb == "update" and r.status == 200
        ]
        released = next(
            r
            for r in puts
            if r.user == user(old.identity) and not r.body["spec"].get("holderIdentity")
        )
        taken = next(r for r in puts if r.at > released.at and r.user == user(new.identity))
        print(f"SIGTERM hand-over: {taken.at - released.at:.2f}s after the release")
        assert taken.body["spec"]["holderIdentity"] == new.identity
        assert taken.at - released.at < RETRY
        assert_one_writer_at_a_time(group.writers())


# ------------------------------------------------- one replica, in-process


def lease(holder: str, *, renewed: str = "2026-01-01T00:00:00.000000Z") -> dict[str, Any]:
    return {
        "metadata": {"name": "canaryd"},
        "spec": {
            "holderIdentity": holder,
            "leaseDurationSeconds": 15,
            "acquireTime": renewed,
            "renewTime": renewed,
            "leaseTransitions": 3,
        },
    }


async def test_a_lone_replica_creates_the_lease_leads_and_releases_it_on_stop(kube, kubeconfig):
    from canaryd import metrics

    create_canary(kube)
    async with running_daemon(kube, kubeconfig, **SOLO) as run:
        await run.until_state(CanaryState.HEALTHY)
        held = kube.get(LEASES.plural, "default", "canaryd")
        assert held is not None and held["spec"]["holderIdentity"] == "solo"
        assert held["spec"]["leaseDurationSeconds"] == 15
        status, text = await run.get("/healthz", Accept="application/json")
        body = json.loads(text)
        assert status == 200 and body["role"] == "leader" and body["leader"] == "solo"
        assert counter(metrics.LEADER) == 1
    released = kube.get(LEASES.plural, "default", "canaryd")
    assert released is not None and not released["spec"].get("holderIdentity")
    assert released["spec"]["leaseDurationSeconds"] == 1
    assert counter(metrics.LEADER) == 0


@pytest.mark.slow
async def test_sigterm_finishes_the_bumps_in_flight_before_it_releases_the_lease(kube, kubeconfig):
    """A stop while a bump is on its way: the bump is answered (or abandoned at its time
    limit) before the Lease is released, since a follower takes a released lease at its
    next look. Before, stopping cancelled the bump as it released the lease: the
    release could reach the API server while the bump was still being served."""
    create_canary(kube)
    armed: list[Any] = []
    # A 2 s cycle: the bump's time limit is 1 s, and its answer takes 0.3 s.
    async with running_daemon(kube, kubeconfig, timeout=2.0, **SOLO) as run:
        await run.until_bumps(1, within=2 * 2.0)
        assert run.daemon.settings.write_timeout == 1.0

        def stop_while_bumping(req: Any) -> Fault | None:
            if req.verb == "patch" and not armed:
                armed.append(req)
                return Fault(code=0, latency=0.3, action=run.daemon.stop)
            return None

        kube.hooks.append(stop_while_bumping)
        await run.until(lambda: bool(armed), "a bump to be in flight at the stop", 2 * 2.0)
    bump = kube.requests_for("patch")[-1]  # the one in flight: none was sent after the stop
    release = next(
        r
        for r in kube.requests
        if r.resource == "leases"
        and r.verb == "update"
        and r.status == 200
        and not r.body["spec"].get("holderIdentity")
    )
    assert bump.status == 200 and not bump.abandoned, "the bump in flight was cancelled"
    assert bump.ended_at is not None and bump.ended_at <= release.at


@pytest.mark.slow
async def test_a_leader_renews_with_one_request_and_falls_back_to_a_read_on_409(kube, kubeconfig):
    """client-go's optimistic update: a leader renews from the Lease it last wrote, one
    PUT per retry period instead of a GET and a PUT. When someone else changed the Lease
    meanwhile (here a label: a new resourceVersion), the PUT meets 409 and the same
    round reads the Lease and updates it: still the leader, no step down."""
    create_canary(kube)
    async with running_daemon(kube, kubeconfig, **SOLO) as run:
        elector = run.daemon.elector
        await run.until(lambda: elector.leading, "the replica to lead")

        def lease_requests(since: int) -> list[tuple[str, int]]:
            return [(r.verb, r.status) for r in kube.requests[since:] if r.resource == "leases"]

        start = len(kube.requests)
        await run.until(
            lambda: len(lease_requests(start)) >= 3, "three renews", within=3 * RETRY + SLACK
        )
        assert lease_requests(start)[:3] == [("update", 200)] * 3, lease_requests(start)

        def labelled(old: dict[str, Any]) -> dict[str, Any]:
            return {**old, "metadata": {**old["metadata"], "labels": {"team": "ops"}}}

        kube.update(LEASES, "default", "canaryd", labelled)
        changed = len(kube.requests)
        await run.until(
            lambda: ("update", 200) in lease_requests(changed), "a renew", within=RETRY + SLACK
        )
        assert lease_requests(changed)[:3] == [("update", 409), ("get", 200), ("update", 200)]
        assert elector.leading
        held = kube.get(LEASES.plural, "default", "canaryd")
        assert held is not None and held["spec"]["holderIdentity"] == "solo"
        assert held["metadata"]["labels"] == {"team": "ops"}  # kept: the read came first


@pytest.mark.slow
async def test_a_renewal_that_runs_out_of_time_is_a_lease_failure_said(kube, kubeconfig, capsys):
    """The optimistic renewal is not answered within its request timeout, which leaves
    the round no time to read and write again: the round failed, and says so (an
    episode; /readyz names it while it lasts). It was taken for a lost race, which is
    no problem at all, and said nothing."""
    create_canary(kube)
    async with running_daemon(kube, kubeconfig, **SOLO) as run:
        elector = run.daemon.elector
        await run.until(lambda: elector.leading, "the replica to lead")
        slow = kube.inject(
            Fault(verb="update", resource=LEASES.plural, code=0, latency=1.0, times=1)
        )
        await run.until(lambda: slow.hits == 1, "a renewal held", within=2 * RETRY + SLACK)
        said: list[str] = []

        def told() -> bool:
            said.append(capsys.readouterr().err)
            return "lease_failures_ended" in "".join(said)

        await run.until(told, "the failed renewal's episode to end", within=2 * RETRY + SLACK)
        started = [line for line in "".join(said).splitlines() if "lease_failures_started" in line]
        assert len(started) == 1 and "Timeout" in started[0], started
        assert elector.leading


async def test_leader_transitions_count_a_new_holder_not_the_one_seen_at_start(kube, kubeconfig):
    """canaryd_leader_transitions_total: times this replica saw the Lease pass to a new
    holder. The holder it finds at start passed to nobody in its sight (a rollout
    restarting every replica must not look like a flapping election)."""
    from canaryd import metrics

    create_canary(kube)
    kube.create(LEASES, "default", lease("other"))
    before = counter(metrics.LEADER_TRANSITIONS)
    async with running_daemon(
        kube, kubeconfig, leader_elect=True, identity="me", lease_namespace="default"
    ) as run:
        elector = run.daemon.elector
        await run.until(lambda: elector.leader == "other", "the holder seen at start")
        assert counter(metrics.LEADER_TRANSITIONS) == before
        kube.update(LEASES, "default", "canaryd", lambda old: {**old, **lease("")})  # released
        await run.until(lambda: elector.leading, "the lease taken", within=2 * RETRY + SLACK)
        assert counter(metrics.LEADER_TRANSITIONS) == before + 1


@pytest.mark.slow
async def test_a_candidate_whose_lease_update_meets_409_reads_again_and_does_not_steal(
    kube, kubeconfig
):
    """The lease is free (released); as the candidate writes, another replica takes it
    first: the candidate's update carries the old resourceVersion and gets a real 409.
    It must not retry blind: it reads the new holder and waits a whole lease duration."""
    create_canary(kube)
    kube.create(LEASES, "default", lease(""))

    def other_takes_it() -> None:
        kube.update(LEASES, "default", "canaryd", lambda old: {**old, **lease("other")})

    race = kube.inject(Fault(verb="update", resource="leases", code=0, action=other_takes_it))
    async with running_daemon(
        kube, kubeconfig, leader_elect=True, identity="me", lease_namespace="default"
    ) as run:
        await run.until(lambda: race.hits == 1, "the candidate's update")
        updates = [r for r in kube.requests if r.resource == "leases" and r.verb == "update"]
        await run.until(
            lambda: (
                len([r for r in kube.requests if r.resource == "leases" and r.verb == "get"]) >= 3
            ),
            "the candidate to read the lease again",
            within=4 * RETRY,
        )
        assert updates[0].status == 409
        held = kube.get(LEASES.plural, "default", "canaryd")
        assert held is not None and held["spec"]["holderIdentity"] == "other"
        later = [r for r in kube.requests if r.resource == "leases" and r.verb == "update"]
        assert len(later) == 1, "it tried to take a lease that is held"
        status, text = await run.get("/healthz", Accept="application/json")
        assert status == 200
        body = json.loads(text)
        assert body["role"] == "follower" and body["leader"] == "other"
        assert not kube.requests_for("patch")  # a follower never bumps
        canary = run.canary()
        assert canary is not None and canary.state is CanaryState.PENDING
        assert "standby: other holds the lease" in canary.reason


@pytest.mark.slow
async def test_a_lease_canaryd_may_not_read_is_said_and_fails_readiness(kube, kubeconfig, capsys):
    """Leader election on without the Lease Role: no replica can lead, so nothing is
    checked and no follower alert would fire. It must be loud: a warning naming the
    403, and /readyz 503 naming the lease (CanarydNotReady)."""
    create_canary(kube)
    kube.deny(verb="get", resource="leases")
    async with running_daemon(
        kube, kubeconfig, leader_elect=True, identity="me", lease_namespace="default"
    ) as run:
        await run.until(
            lambda: len([r for r in kube.requests if r.resource == "leases"]) >= 2,
            "two looks at the lease",
            within=3 * RETRY,
        )
        status, text = await run.get("/readyz")
        assert status == 503 and "lease default/canaryd" in text and "403" in text, text
        assert not kube.requests_for("patch")
        kube.rbac_denies.clear()
        await run.until_state(CanaryState.HEALTHY, within=2 * RETRY + 4 * CYCLE)
        status, text = await run.get("/readyz")
        assert status == 200, text
    err = capsys.readouterr().err
    started = [line for line in err.splitlines() if "lease_failures_started" in line]
    assert len(started) == 1 and "Forbidden" in started[0], started
    assert any("lease_failures_ended" in line for line in err.splitlines())


@pytest.mark.slow
async def test_a_candidate_counts_the_lease_duration_from_when_its_read_came_back(kube, kubeconfig):
    """The holder renews while the candidate's read of the Lease is on its way (a slow
    answer: 4 s). The candidate saw that renew only when the answer came back, so that is
    where its lease duration starts (client-go: observedTime is set after the Get). Before,
    it counted from when it sent the read: 2 s early, so it took the lease 13 s after the
    holder's last renew, while the holder may write until 10 s (its renew deadline) after
    sending that renew, plus a request's time: two writers."""
    create_canary(kube)
    kube.create(LEASES, "default", lease("other"))
    loop = asyncio.get_running_loop()
    renewed_at: list[float] = []

    def renew() -> None:
        stamp = "2026-01-01T00:00:01.000000Z"
        kube.update(
            LEASES, "default", "canaryd", lambda old: {**old, **lease("other", renewed=stamp)}
        )
        renewed_at.append(loop.time())

    def slow_first_read(req: Any) -> Fault | None:
        if req.verb == "get" and req.rtype is LEASES and not renewed_at and not slow:
            slow.append(loop.call_later(2.0, renew))
            return Fault(code=0, latency=4.0)  # answered, late
        return None

    slow: list[asyncio.TimerHandle] = []
    kube.hooks.append(slow_first_read)
    # A 10 s cycle: requests may take 5 s (half a cycle), so the slow read is answered.
    async with running_daemon(
        kube, kubeconfig, timeout=10.0, leader_elect=True, identity="me", lease_namespace="default"
    ) as run:
        assert run.daemon.settings.request_timeout > 4.0

        def mine() -> bool:
            held = kube.get(LEASES.plural, "default", "canaryd")
            return held is not None and held["spec"].get("holderIdentity") == "me"

        await run.until(mine, "the candidate to take the lease", within=4 + 15 + 2 * RETRY + 2)
        took = loop.time() - renewed_at[0]
        print(f"taken {took:.2f}s after the holder's last renew")
        assert took >= DEFAULTS.lease_duration, took


@pytest.mark.slow
async def test_a_lease_hiccup_keeps_the_verdicts_and_retaking_the_lease_goes_on_with_them(
    kube, kubeconfig
):
    """Lease requests fail past the renew deadline: the leader stops bumping at once, but
    it has seen no other holder, so its unhealthy verdict (a stuck watch) stands, and
    /healthz stays 500: a liveness probe's failure count does not start over. Like any
    verdict no bump re-tests, it turns unknown two cycles after it was reached. Retaking
    its own lease, the replica goes on with its canaries."""
    create_canary(kube)
    async with running_daemon(kube, kubeconfig, **SOLO) as run:
        await run.until_state(CanaryState.HEALTHY)
        elector = run.daemon.elector
        kube.hold_watch_events()
        canary = await run.until_state(CanaryState.UNHEALTHY)
        failing = kube.inject(Fault(resource=LEASES.plural, code=500, times=-1))
        await run.until(lambda: not elector.leading, "the leader to step down", RENEW_DEADLINE + 5)
        assert canary.state is CanaryState.UNHEALTHY, canary.reason  # kept
        assert await run.get("/healthz") == (500, "ERROR")
        # A kept verdict ages as any other: nobody re-tests it while the lease is away,
        # so two cycles after it was reached it is unknown, and /healthz 200.
        await run.until_state(CanaryState.UNKNOWN, within=3 * CYCLE + 1.0)
        assert "no bump written since" in canary.reason, canary.reason
        assert "standby" in canary.reason, canary.reason
        assert await run.get("/healthz") == (200, "OK")
        writes = len(kube.requests_for("patch"))
        kube.faults.remove(failing)
        await run.until(lambda: elector.leading, "the lease retaken", LEASE_DURATION + 5)
        # It goes on with its own canaries (not reset to a fresh pending), bumps again
        # and, the watch still stuck, finds the verdict again.
        await run.until_state(CanaryState.UNHEALTHY, within=3 * CYCLE + 1.0)
        kube.release_watch_events()
        await run.until_state(CanaryState.HEALTHY)
        assert len(kube.requests_for("patch")) > writes
        assert not run.daemon.scheduler.unscheduled()


async def test_a_replica_that_takes_over_from_another_starts_fresh(kube, kubeconfig):
    """Another holder's verdicts are the ones that count once it is seen: this replica's
    canaries are pending standby, and leading later it judges from scratch."""
    from canaryd.registry import Registry
    from canaryd.scheduler import Scheduler

    registry = Registry("flink.apache.org/canary")
    scheduler = Scheduler(Settings(timeout=CYCLE), registry, kube=None)  # type: ignore[arg-type]
    registry.observe(
        "flinkdeployments",
        {
            "metadata": {
                "name": "c",
                "namespace": "ns",
                "uid": "u",
                "generation": 1,
                "resourceVersion": "1",
                "labels": {"flink.apache.org/canary": "true"},
            }
        },
    )
    (canary,) = registry.canaries()
    registry.judged(
        canary,
        CanaryState.UNHEALTHY,
        "generation 2 not observed",
        "not_observed",
        scheduler._clock(),
    )
    scheduler.standby(None)  # a hiccup: kept
    assert canary.state is CanaryState.UNHEALTHY
    scheduler.standby("replica-b")  # another holder: fresh
    assert canary.state is CanaryState.PENDING and "replica-b" in canary.reason
    scheduler.activate()
    assert canary.state is CanaryState.PENDING and "first bump" in canary.reason


@pytest.mark.slow
async def test_slow_lease_renewals_never_take_a_canary_out_of_the_schedule(kube, kubeconfig):
    """Lease renewals answered 1.5 s late, well inside the renew deadline, at a 12 s
    cycle (a 6 s write timeout: a write may be sent up to 4 s after a renewal started,
    and renewals start 3.5 s apart and land 1.5 s later): bumps that fall due while the
    fence holds them back wait for the next renewal. Every canary is bumped every cycle,
    and each is due or in flight exactly once."""
    cycle, names = 12.0, [f"c{n:02}" for n in range(30)]
    for name in names:
        create_canary(kube, name)
    kube.inject(Fault(verb="update", resource=LEASES.plural, code=0, latency=1.5, times=-1))
    async with running_daemon(
        kube,
        kubeconfig,
        **SOLO,
        timeout=cycle,
        kinds=("flinkdeployments",),
    ) as run:
        scheduler = run.daemon.scheduler
        await run.until(
            lambda: all(len(run.bumps(name)) >= 3 for name in names),
            "every canary bumped in each of three cycles",
            within=3 * cycle + 6,
        )
        assert run.daemon.elector.leading
        assert not scheduler.unscheduled(), scheduler.unscheduled()
        assert await run.get("/healthz") == (200, "OK")


async def test_a_fenced_write_waits_for_the_next_renewal_and_ends_with_the_leadership(
    kube, kubeconfig
):
    """write_permit: within the fence, the write timeout at once, or what is left of the
    renew deadline when that is less; past it (under MIN_WRITE_TIMEOUT left), the next
    successful renewal; held longer than it may wait, TimeoutError; once leading ends,
    None (the write is not sent)."""
    from canaryd.leader import LeaderElector

    now = [100.0]
    settings = Settings(timeout=12.0, leader_elect=True, lease_namespace="default", identity="solo")
    elector = LeaderElector(
        settings,
        kube=None,  # type: ignore[arg-type]
        clock=lambda: now[0],
    )
    elector.leading, elector._renewed_at = True, now[0]
    assert await elector.write_permit(60) == settings.write_timeout
    now[0] += settings.renew_deadline - settings.write_timeout + 0.5  # what is left
    assert await elector.write_permit(60) == settings.write_timeout - 0.5
    now[0] += settings.write_timeout - MIN_WRITE_TIMEOUT  # past the fence
    waiting = asyncio.create_task(elector.write_permit(60))
    await asyncio.sleep(0)
    assert not waiting.done(), "a fenced write was sent (or dropped) instead of waiting"
    elector._renewed_at = now[0]
    elector._role_changed()
    assert await asyncio.wait_for(waiting, 1) == settings.write_timeout
    now[0] += settings.renew_deadline  # past the fence again
    with pytest.raises(TimeoutError):
        await elector.write_permit(0.01)  # held longer than it may wait
    waiting = asyncio.create_task(elector.write_permit(60))
    await asyncio.sleep(0)
    assert not waiting.done()
    elector._stop_leading("test")  # then leading ends
    assert await asyncio.wait_for(waiting, 1) is None


FENCE_SHUT = {"renew_deadline": 1.5, "retry_period": 0.1, "lease_duration": 2.0}
"""Lease timings the start refuses at a 2 s cycle (a renewal answered within its 1 s
request timeout may leave 0.5 s of the renew deadline, under a write's 1 s), though
client-go's rules and the write budget pass them."""


@pytest.mark.slow
async def test_a_bump_held_at_a_shut_fence_ends_not_written_counted_aged_and_told_once(
    kube, kubeconfig, capsys
):
    """Renewals answered 0.6 s late under FENCE_SHUT, run anyway: every renewal succeeds,
    the replica leads, and its fence never opens. The bump held there ends as not
    written when its retry window (half a cycle) ends: counted as ``fenced``, no
    verdict (``healthy`` turns ``unknown`` naming the fence; an ``unhealthy`` one would
    age to unknown two cycles after it was reached, as for any bump not written), told
    once as a bump_failures episode. It waited at the fence for good: no count, nothing
    said, the canary healthy on a stale verdict. About 8 s of real time (a 2 s cycle)."""
    from canaryd import metrics

    cycle = 2.0
    create_canary(kube)
    fenced = counter(metrics.BUMPS, "fenced")
    async with running_daemon(
        kube,
        kubeconfig,
        **SOLO,
        timeout=cycle,
        **FENCE_SHUT,
    ) as run:
        canary = await run.until_state(CanaryState.HEALTHY, within=3 * cycle + 1)
        capsys.readouterr()
        kube.inject(Fault(verb="update", resource=LEASES.plural, code=0, latency=0.6, times=-1))
        await run.until(
            lambda: counter(metrics.BUMPS, "fenced") > fenced, "a fenced bump", 2 * cycle + 1
        )
        assert canary.state is CanaryState.UNKNOWN and "fence" in canary.reason, canary.reason
        assert run.daemon.elector is not None and run.daemon.elector.leading
        assert await run.get("/healthz") == (200, "OK")
    started = [
        line for line in capsys.readouterr().err.splitlines() if "bump_failures_started" in line
    ]
    assert len(started) == 1 and "fenced" in started[0], started
