"""Kubernetes Events on a canary whose verdict changed (canaryd.events), against the fake
API server: what they say, their series, the spam filter, the bounded queue, and that a
failing or hanging Events API changes nothing else."""

from __future__ import annotations

from typing import Any

from canaryd import metrics
from canaryd.config import Settings
from canaryd.events import BURST, Events
from canaryd.judge import Healthy, Unhealthy
from canaryd.registry import CanaryState, Registry
from canaryd.scheduler import Role
from canaryd.testing.apiserver import Fault
from tests.harness import counter, create_canary, running_daemon

CYCLE = 0.3


def events_about(kube: Any, name: str = "canary") -> list[dict[str, Any]]:
    found = [e for e in kube.objects["events"].values() if e["regarding"]["name"] == name]
    return sorted(found, key=lambda e: e["metadata"]["creationTimestamp"] + e["eventTime"])


def results() -> dict[str, float]:
    names = ("created", "updated", "spam_filtered", "dropped", "failed")
    return {name: counter(metrics.VERDICT_EVENTS, name) for name in names}


async def test_a_verdict_change_is_an_event_on_the_canary_and_a_repeat_its_series(kube, kubeconfig):
    create_canary(kube)
    async with running_daemon(kube, kubeconfig) as run:
        canary = await run.until_state(CanaryState.HEALTHY)
        assert events_about(kube) == [], "a first healthy verdict is no change"
        kube.hold_watch_events()
        await run.until_state(CanaryState.UNHEALTHY)
        await run.until(lambda: len(events_about(kube)) == 1, "the Unhealthy Event")
        (unhealthy,) = events_about(kube)
        assert unhealthy["metadata"]["namespace"] == "default"
        assert (unhealthy["type"], unhealthy["reason"]) == ("Warning", "Unhealthy")
        assert unhealthy["note"].startswith("not_observed: generation ")
        assert unhealthy["regarding"] == {
            "apiVersion": "flink.apache.org/v1beta1",
            "kind": "FlinkDeployment",
            "namespace": "default",
            "name": "canary",
            "uid": canary.uid,
        }
        assert unhealthy["reportingController"] == "canaryd" and unhealthy["action"] == "Judged"
        kube.release_watch_events()
        await run.until_state(CanaryState.HEALTHY)
        await run.until(lambda: len(events_about(kube)) == 2, "the Recovered Event")
        recovered = next(e for e in events_about(kube) if e["reason"] == "Recovered")
        assert recovered["type"] == "Normal" and recovered["note"].startswith("in_time: ")
        # The same Event again within 6 minutes: its series, not a new Event.
        kube.hold_watch_events()
        await run.until_state(CanaryState.UNHEALTHY)
        name = unhealthy["metadata"]["name"]
        await run.until(
            lambda: (kube.get("events", "default", name).get("series") or {}).get("count") == 2,
            "the Unhealthy Event's series",
        )
        assert len(events_about(kube)) == 2
        patches = kube.requests_for("patch", resource="events")
        assert [p.status for p in patches] == [200]
        kube.release_watch_events()


async def test_a_canary_turned_unknown_is_a_warning_event_naming_the_class(kube, kubeconfig):
    create_canary(kube)
    async with running_daemon(kube, kubeconfig) as run:
        await run.until_state(CanaryState.HEALTHY)
        kube.deny(verb="patch", resource="flinkdeployments", namespace="default")
        await run.until_state(CanaryState.UNKNOWN)
        await run.until(lambda: len(events_about(kube)) == 1, "the Unknown Event")
    (event,) = events_about(kube)
    assert (event["type"], event["reason"]) == ("Warning", "Unknown")
    assert event["note"].startswith("forbidden: ") and "403" in event["note"]


def test_recovered_follows_a_told_warning_whatever_came_between():
    """Healthy after a told Unhealthy or Unknown is Recovered, even with pending between
    (the operator restarted: a fresh check; a stand-by and the lead again); a first
    healthy verdict, or healthy after a Recovered, is no Event."""
    registry = Registry("flink.apache.org/canary")
    labels = {"flink.apache.org/canary": "true"}
    meta = dict(name="c", namespace="ns", uid="u", generation=1, resourceVersion="1")
    registry.observe("flinkdeployments", {"metadata": {**meta, "labels": labels}})
    (canary,) = registry.canaries()
    events = Events(None, interval=lambda: 1.0)  # type: ignore[arg-type]  # never written
    role = Role(Settings(timeout=10), registry, events, clock=lambda: 0.0)

    def judged(state: CanaryState) -> list[str]:
        if state is CanaryState.UNKNOWN:
            role.no_bump(canary, "bump failed", "failed")
        else:
            healthy = state is CanaryState.HEALTHY
            role.verdict(canary, Healthy("why") if healthy else Unhealthy("why", "cause"), 0.0)
        told = [reason for _, reason, _ in events.queued.values()]
        events.queued.clear()
        return told

    assert judged(CanaryState.HEALTHY) == []
    assert judged(CanaryState.UNHEALTHY) == ["Unhealthy"]
    registry.judged(
        canary, CanaryState.PENDING, "the operator restarted", "operator_restarted", 0.0
    )
    assert judged(CanaryState.HEALTHY) == ["Recovered"]
    assert judged(CanaryState.UNKNOWN) == ["Unknown"]
    role.stand_by("replica-b")
    role.lead()
    assert judged(CanaryState.HEALTHY) == ["Recovered"]
    registry.judged(
        canary, CanaryState.PENDING, "the operator restarted", "operator_restarted", 0.0
    )
    assert judged(CanaryState.HEALTHY) == []


async def test_the_spam_filter_and_one_queued_event_per_canary(kube, kubeconfig):
    create_canary(kube)
    async with running_daemon(kube, kubeconfig) as run:
        canary = await run.until_tracked()
        before = results()
        # One canary, many Events: a burst of 25 is written (1 Event and its series),
        # the rest dropped by its token bucket (one more every 5 minutes).
        idle = Events(run.daemon.scheduler.events.kube, interval=lambda: CYCLE)
        event = (canary.key, canary.uid, "Unknown", "x: y")
        written = [await idle._write(*event) for _ in range(BURST + 5)]
        assert written == ["created"] + ["updated"] * (BURST - 1) + ["spam_filtered"] * 5
        (written_event,) = events_about(kube)
        assert written_event["series"]["count"] == BURST
        # A queue nobody drains: one Event per canary, the newest (a canary's older one
        # is dropped where it waits), so the queue never holds more than the canaries.
        for index, reason in enumerate(["Unhealthy", "Unknown", "Recovered", "Unhealthy"]):
            idle.record(
                ("flinkdeployments", "default", f"c{index % 2}"), f"u{index % 2}", reason, ""
            )
        assert [(key[2], reason) for key, reason, _ in idle.queued.values()] == [
            ("c0", "Recovered"),
            ("c1", "Unhealthy"),
        ]
        assert results()["dropped"] - before["dropped"] == 2


async def test_a_long_named_canary_gets_its_events(kube, kubeconfig):
    """A 250-character name (valid) makes NAME.<hex> too long for an Event's name (253):
    such an Event is named with a UUID, as client-go's GenerateEventName does."""
    name = ("a" * 62 + ".") * 3 + "a" * 61
    create_canary(kube, name)
    async with running_daemon(kube, kubeconfig) as run:
        await run.until_state(CanaryState.HEALTHY, name)
        kube.deny(verb="patch", resource="flinkdeployments", namespace="default")
        await run.until_state(CanaryState.UNKNOWN, name)
        await run.until(lambda: len(events_about(kube, name)) == 1, "the Unknown Event")
    (event,) = events_about(kube, name)
    assert event["reason"] == "Unknown" and len(event["metadata"]["name"]) == 36


async def test_a_failing_or_hanging_events_api_changes_nothing_else(kube, kubeconfig, capsys):
    """Every Event write refused (403), then hanging past the request timeout: counted
    and logged, the verdicts and the bumps go on as before: an Event never delays a
    bump (the queue drains in its own task)."""
    names = [f"c{index:02d}" for index in range(20)]
    for name in names:
        create_canary(kube, name)
    async with running_daemon(kube, kubeconfig) as run:
        for name in names:
            await run.until_state(CanaryState.HEALTHY, name)
        before = results()
        errors = counter(metrics.ERRORS, "task_events")
        kube.deny(verb="create", resource="events", namespace="default")
        kube.hold_watch_events()
        await run.until_state(CanaryState.UNHEALTHY, "c00", within=3)
        await run.until(lambda: results()["failed"] > before["failed"], "a refused Event")
        kube.rbac_denies.clear()
        kube.release_watch_events()
        for name in names:
            await run.until_state(CanaryState.HEALTHY, name)
        await run.until(
            lambda: any(e["reason"] == "Recovered" for e in kube.objects["events"].values()),
            "an Event written again, ending the episode",
        )
        # Now every Event write hangs: each is abandoned at the request timeout.
        kube.inject(Fault(resource="events", latency=60, code=0, times=-1))
        kube.hold_watch_events()
        for name in names:
            await run.until_state(CanaryState.UNHEALTHY, name, within=3)
        failed = results()["failed"]
        counts = {name: len(run.bumps(name)) for name in names}
        await run.until(
            lambda: all(len(run.bumps(n)) >= counts[n] + 2 for n in names),
            "two more bumps of every canary",
            within=3,
        )
        hung = results()["failed"] - failed
        assert hung < len(names) / 2, f"the bumps waited for {hung} Event writes"
        assert counter(metrics.ERRORS, "task_events") == errors
        kube.release_watch_events()
    # Not a line per canary: an episode per cause, ended by the next Event written.
    logged = capsys.readouterr().err
    assert logged.count("events_not_written_started") == 2, logged
    assert logged.count("events_not_written_ended") == 1
    assert logged.count("events_not_written_still_failing") == 1
