"""The registry's incremental counts stay exact under any sequence of changes."""

from __future__ import annotations

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from canaryd.registry import CanaryKey, CanaryState, Registry

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
                registry.set_state(canary, op[3], "test")
        else:
            registry.forget_namespace(op[1], "namespace_closed")
        recount = Counter(c.state.value for c in registry.canaries())
        assert registry.counts() == {s.value: recount[s.value] for s in CanaryState}
        assert registry.healthy == (recount["unhealthy"] == 0)
        assert len(registry) == sum(recount.values())
