"""The registry's incremental counts stay exact under any sequence of changes."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from canaryd.registry import Added, Canary, CanaryKey, CanaryState, Forgotten, Registry, Resumed

LABEL = "flink.apache.org/canary"
NAMES = st.sampled_from(["a", "b", "c", "d"])
NAMESPACES = st.sampled_from(["ns1", "ns2"])


def obj(namespace: str, name: str, value: str, uid: str) -> dict[str, object]:
    return {
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": uid,
            "resourceVersion": "1",
            "generation": 1,
            "labels": {LABEL: value},
        }
    }


operation = st.one_of(
    st.tuples(
        st.just("observe"),
        NAMESPACES,
        NAMES,
        st.sampled_from(["true", "TRUE", "no"]),
        st.sampled_from(["u1", "u2"]),
    ),
    st.tuples(st.just("forget"), NAMESPACES, NAMES),
    st.tuples(st.just("state"), NAMESPACES, NAMES, st.sampled_from(list(CanaryState))),
    st.tuples(st.just("namespace"), NAMESPACES),
)


@given(st.lists(operation, max_size=60))
def test_counts_match_a_recount_after_any_sequence(operations):
    registry = Registry(LABEL)
    for op in operations:
        if op[0] == "observe":
            registry.observe("flinkdeployments", obj(op[1], op[2], op[3], op[4]))
        elif op[0] == "forget":
            registry.forget(CanaryKey("flinkdeployments", op[1], op[2]), "deleted")
        elif op[0] == "state":
            canary = registry.get(CanaryKey("flinkdeployments", op[1], op[2]))
            if canary is not None:
                registry.set_state(canary, op[3], "test", "test")
        else:
            registry.forget_where(lambda key, ns=op[1]: key.namespace == ns, "namespace_closed")
        recount = Counter(c.state.value for c in registry.canaries())
        assert registry.counts() == {s.value: recount[s.value] for s in CanaryState}
        assert registry.healthy == (recount["unhealthy"] == 0)
        assert len(registry) == sum(recount.values())


# ------------------------------------------- the registry's transitions, one by one


def tracked(registry: Registry, name: str = "a") -> Canary:
    registry.observe("flinkdeployments", obj("ns1", name, "true", "u1"))
    found = registry.get(CanaryKey("flinkdeployments", "ns1", name))
    assert found is not None
    return found


def test_added_forgotten_and_resumed_are_news_in_order():
    """What the scheduler acts on is read from the registry's news (nothing calls it
    back): canaries added and forgotten, scopes resumed, in order, each taken once."""
    registry = Registry(LABEL)
    assert not registry.news.is_set()
    canary = tracked(registry)
    registry.forget(canary.key, "deleted")
    registry.scope_resumed(("flinkdeployments", "ns1"))
    assert registry.news.is_set()
    assert registry.take_news() == [
        Added(canary),
        Forgotten(CanaryKey("flinkdeployments", "ns1", "a")),
        Resumed(("flinkdeployments", "ns1")),
    ]
    assert not registry.news.is_set() and registry.take_news() == []


def test_bumped_then_judged_healthy_or_unhealthy():
    registry = Registry(LABEL)
    canary = tracked(registry)
    registry.bumped(canary, 2, 10.0, 10.1, 70.1, 1_700_000_000.0)
    assert (canary.bumped_generation, canary.last_bumped_generation) == (2, 2)
    assert canary.bump_deadline == 70.1 and canary.stages["answered"] == pytest.approx(0.1)
    registry.judged(canary, CanaryState.UNHEALTHY, "not observed", "not_observed", 70.1)
    assert canary.state is CanaryState.UNHEALTHY and canary.verdict is not None
    assert (canary.bumped_generation, canary.judged_generation) == (None, 2)
    registry.bumped(canary, 3, 71.0, 71.1, 131.1, 1_700_000_060.0)
    registry.judged(canary, CanaryState.HEALTHY, "observed", "in_time", 131.1)
    assert canary.state is CanaryState.HEALTHY and canary.verdict is None
    assert registry.counts()["unhealthy"] == 0 and registry.healthy


def test_deferred_and_rechecking_wait_and_a_verdict_clears_them():
    registry = Registry(LABEL)
    canary = tracked(registry)
    registry.bumped(canary, 2, 10.0, 10.1, 70.1, 0.0)
    registry.update(canary, deferred_until=130.1, late_recheck=True)
    assert canary.deferred_until == 130.1 and canary.late_recheck
    assert canary.state is CanaryState.PENDING  # waiting is no verdict
    registry.judged(canary, CanaryState.HEALTHY, "observed", "in_time", 100.0)
    assert canary.deferred_until is None and not canary.late_recheck


def test_no_verdict_keeps_an_unhealthy_verdict_for_two_cycles_then_ages_it():
    registry = Registry(LABEL)
    canary = tracked(registry)
    registry.no_verdict(canary, "bump failed: 503", "failed", 1.0, 120.0)
    assert (canary.state, canary.cause) == (CanaryState.UNKNOWN, "failed")  # replaces pending
    registry.bumped(canary, 2, 10.0, 10.1, 70.1, 0.0)
    registry.judged(
        canary, CanaryState.UNHEALTHY, "generation 2 not observed", "not_observed", 70.1
    )
    registry.no_verdict(canary, "bump failed: 503", "failed", 100.0, 120.0)
    assert canary.state is CanaryState.UNHEALTHY and "since then: bump failed" in canary.reason
    assert canary.cause == "not_observed"  # the verdict's class, while it stands
    registry.no_verdict(canary, "forbidden", "forbidden", 200.0, 120.0)
    assert (canary.state, canary.cause) == (CanaryState.UNKNOWN, "verdict_expired")
    assert "unhealthy at" in canary.reason and "no bump written since: forbidden" in canary.reason


def test_fresh_check_forgets_the_verdict_and_what_was_pending():
    registry = Registry(LABEL)
    canary = tracked(registry)
    registry.bumped(canary, 2, 10.0, 10.1, 70.1, 0.0)
    registry.judged(canary, CanaryState.UNHEALTHY, "no reconcile", "not_reconciled", 70.1)
    registry.bumped(canary, 3, 71.0, 71.1, 131.1, 0.0)
    registry.update(canary, reconcile_baseline=(0, 4.0))
    registry.judged(
        canary,
        CanaryState.PENDING,
        "operator restarted at T: re-checking",
        "operator_restarted",
        0.0,
    )
    assert canary.state is CanaryState.PENDING and canary.verdict is None
    assert canary.bumped_generation is None and canary.reconcile_baseline is None
    assert canary.judged_generation == 3


@pytest.mark.parametrize("keep", [True, False])
def test_standing_by_keeps_or_resets_the_verdict_and_judges_nothing(keep):
    registry = Registry(LABEL)
    canary = tracked(registry)
    registry.bumped(canary, 2, 10.0, 10.1, 70.1, 0.0)
    registry.judged(canary, CanaryState.UNHEALTHY, "not observed", "not_observed", 70.1)
    registry.bumped(canary, 3, 71.0, 71.1, 131.1, 0.0)
    registry.standing_by(canary, None if keep else "standby: b holds the lease")
    assert canary.bumped_generation is None and canary.judged_generation == 2
    assert canary.state is (CanaryState.UNHEALTHY if keep else CanaryState.PENDING)


def test_a_reread_says_why_the_record_is_no_longer_the_tracked_one():
    registry = Registry(LABEL)
    canary = tracked(registry)
    assert registry.reread(canary, obj("ns1", "a", "true", "u1")) is None
    assert registry.reread(canary, obj("ns1", "a", "true", "u2")) == "replaced"
    new = registry.get(canary.key)
    assert new is not None and new.uid == "u2"  # tracked at once
    assert registry.reread(new, obj("ns1", "a", "false", "u2")) == "not_canary"
    assert registry.get(canary.key) is None
