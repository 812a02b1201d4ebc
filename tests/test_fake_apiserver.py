"""The fake API server, pinned behaviour by behaviour, through kubernetes-asyncio over HTTP.

Each test names the kube-apiserver source that the behaviour comes from; the
fake's own comments carry the same citations.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio import client, config, watch
from kubernetes_asyncio.client.exceptions import ApiException

from canaryd.testing.apiserver import FakeKube, Fault
from tests.conftest import TOKEN
from tests.harness import event_body

G, V, FD, SJ = "flink.apache.org", "v1beta1", "flinkdeployments", "flinksessionjobs"
MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"


def canary(name: str = "canary", **labels: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{G}/{V}",
        "kind": "FlinkDeployment",
        "metadata": {"name": name, "labels": {"flink.apache.org/canary": "true", **labels}},
    }


@pytest.fixture
def crd(api: client.ApiClient) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(api)


async def create(
    crd: client.CustomObjectsApi, body: dict[str, Any], ns: str = "default", plural: str = FD
) -> dict[str, Any]:
    result: dict[str, Any] = await crd.create_namespaced_custom_object(G, V, ns, plural, body)
    return result


async def patch(
    crd: client.CustomObjectsApi,
    body: Any,
    name: str = "canary",
    content_type: str = MERGE,
    ns: str = "default",
) -> dict[str, Any]:
    result: dict[str, Any] = await crd.patch_namespaced_custom_object(
        G, V, ns, FD, name, body, _content_type=content_type
    )
    return result


def status_of(err: ApiException) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(err.body)
    return body


async def next_events(stream: AsyncIterator[Any], count: int) -> list[tuple[str, Any]]:
    """Read ``count`` events, failing clearly if they do not come within 5 s."""
    events: list[tuple[str, Any]] = []
    async with asyncio.timeout(5):
        async for event in stream:
            events.append((event["type"], event["object"]))
            if len(events) == count:
                break
    return events


# ------------------------------------------------------------ resourceVersion


async def test_resource_version_is_one_global_increasing_string(kube, crd, api):
    core = client.CoreV1Api(api)
    ns = await core.create_namespace({"metadata": {"name": "other"}})
    first = await create(crd, canary("a"))
    second = await create(crd, canary("b"), ns="other")
    patched = await patch(crd, {"metadata": {"labels": {"x": "1"}}}, name="a")
    versions = [
        ns.metadata.resource_version,
        first["metadata"]["resourceVersion"],
        second["metadata"]["resourceVersion"],
        patched["metadata"]["resourceVersion"],
    ]
    assert all(isinstance(v, str) for v in versions)
    assert [int(v) for v in versions] == sorted(int(v) for v in versions)
    assert len(set(versions)) == 4


async def test_noop_patch_keeps_resource_version_and_emits_nothing(kube, crd):
    created = await create(crd, canary())
    same = await patch(crd, {"metadata": {"labels": {"flink.apache.org/canary": "true"}}})
    assert same["metadata"]["resourceVersion"] == created["metadata"]["resourceVersion"]
    assert kube.history[-1].rv == int(created["metadata"]["resourceVersion"])


# ---------------------------------------------------------------- generation


async def test_generation_starts_at_one_and_only_non_metadata_changes_bump_it(kube, crd):
    created = await create(crd, canary())
    assert created["metadata"]["generation"] == 1
    labelled = await patch(
        crd, {"metadata": {"labels": {"repro": "409"}, "annotations": {"repro/note": "keep-me"}}}
    )
    assert labelled["metadata"]["generation"] == 1
    finalized = await patch(
        crd, {"metadata": {"finalizers": ["flinkdeployments.flink.apache.org/finalizer"]}}
    )
    assert finalized["metadata"]["generation"] == 1
    bumped = await patch(crd, {"spec": {"restartNonce": 1}})
    assert bumped["metadata"]["generation"] == 2
    assert bumped["metadata"]["labels"]["repro"] == "409"


async def test_status_on_main_endpoint_is_discarded_and_status_writes_keep_generation(kube, crd):
    created = await create(crd, {**canary(), "status": {"lifecycleState": "STABLE"}})
    assert "status" not in created
    ignored = await patch(crd, {"status": {"lifecycleState": "FAILED"}})
    assert "status" not in ignored
    assert ignored["metadata"]["resourceVersion"] == created["metadata"]["resourceVersion"]
    written = await crd.patch_namespaced_custom_object_status(
        G,
        V,
        "default",
        FD,
        "canary",
        {"status": {"observedGeneration": 1}, "spec": {"restartNonce": 9}},
        _content_type=MERGE,
    )
    assert written["status"] == {"observedGeneration": 1}
    assert written["metadata"]["generation"] == 1
    assert "spec" not in written  # a /status write changes only status


# --------------------------------------------------------------- patch types


async def test_merge_patch_merges_and_null_deletes(kube, crd):
    await create(crd, canary(team="a"))
    result = await patch(
        crd, {"metadata": {"labels": {"team": None, "new": "x"}}, "spec": {"restartNonce": 3}}
    )
    assert result["metadata"]["labels"] == {"flink.apache.org/canary": "true", "new": "x"}
    assert result["spec"] == {"restartNonce": 3}


async def test_json_patch_applies_rfc6902_ops(kube, crd):
    await create(crd, canary())
    result = await patch(
        crd,
        [
            {"op": "add", "path": "/spec", "value": {"restartNonce": 1}},
            {"op": "replace", "path": "/spec/restartNonce", "value": 2},
            {"op": "add", "path": "/metadata/labels/a~1b", "value": "v"},
        ],
        content_type=JSON_PATCH,
    )
    assert result["spec"] == {"restartNonce": 2}
    assert result["metadata"]["labels"]["a/b"] == "v"


async def test_json_patch_failed_test_op_is_422_invalid(kube, crd):
    await create(crd, canary())
    with pytest.raises(ApiException) as err:
        await patch(
            crd,
            [{"op": "test", "path": "/metadata/name", "value": "other"}],
            content_type=JSON_PATCH,
        )
    assert err.value.status == 422
    assert status_of(err.value)["reason"] == "Invalid"


async def test_strategic_merge_on_a_custom_resource_is_415(kube, crd):
    await create(crd, canary())
    with pytest.raises(ApiException) as err:
        await patch(
            crd,
            {"spec": {"restartNonce": 1}},
            content_type="application/strategic-merge-patch+json",
        )
    assert err.value.status == 415
    assert status_of(err.value)["reason"] == "UnsupportedMediaType"


async def test_kubernetes_asyncio_sends_a_dict_patch_as_json_patch(kube, crd):
    """The client quirk DESIGN.md names: without _content_type a dict goes as json-patch,
    which the server cannot decode (400)."""
    await create(crd, canary())
    with pytest.raises(ApiException) as err:
        await crd.patch_namespaced_custom_object(
            G, V, "default", FD, "canary", {"spec": {"restartNonce": 1}}
        )
    assert err.value.status == 400
    assert kube.requests_for("patch")[-1].content_type == JSON_PATCH


# --------------------------------------------------------- optimistic locking


async def test_merge_patch_with_stale_resource_version_is_409_conflict(kube, crd):
    created = await create(crd, canary())
    stale = created["metadata"]["resourceVersion"]
    await patch(crd, {"metadata": {"labels": {"x": "1"}}})
    with pytest.raises(ApiException) as err:
        await patch(crd, {"metadata": {"resourceVersion": stale}, "spec": {"restartNonce": 1}})
    assert err.value.status == 409
    body = status_of(err.value)
    assert body["kind"] == "Status" and body["reason"] == "Conflict"
    assert "the object has been modified" in body["message"]
    assert kube.get(FD, "default", "canary")["metadata"]["generation"] == 1


async def test_merge_patch_with_current_or_no_resource_version_succeeds(kube, crd):
    created = await create(crd, canary())
    current = created["metadata"]["resourceVersion"]
    first = await patch(
        crd, {"metadata": {"resourceVersion": current}, "spec": {"restartNonce": 1}}
    )
    assert first["spec"]["restartNonce"] == 1
    # No resourceVersion in the patch: never a conflict, however stale the caller is.
    second = await patch(crd, {"spec": {"restartNonce": 2}})
    assert second["metadata"]["generation"] == 3


async def test_update_needs_a_current_resource_version(kube, crd):
    created = await create(crd, canary())
    body = {**created, "spec": {"restartNonce": 1}}
    no_rv = {
        **body,
        "metadata": {k: v for k, v in created["metadata"].items() if k != "resourceVersion"},
    }
    with pytest.raises(ApiException) as err:
        await crd.replace_namespaced_custom_object(G, V, "default", FD, "canary", no_rv)
    assert err.value.status == 422
    replaced = await crd.replace_namespaced_custom_object(G, V, "default", FD, "canary", body)
    assert replaced["metadata"]["generation"] == 2
    with pytest.raises(ApiException) as err:
        await crd.replace_namespaced_custom_object(G, V, "default", FD, "canary", body)
    assert err.value.status == 409


# --------------------------------------------------------------------- watch


def watch_fd(
    crd: client.CustomObjectsApi, w: watch.Watch, ns: str | None = "default", **kwargs: Any
) -> Any:
    if ns is None:
        return w.stream(crd.list_cluster_custom_object, G, V, FD, **kwargs)
    return w.stream(crd.list_namespaced_custom_object, G, V, ns, FD, **kwargs)


async def test_watch_streams_added_modified_deleted(kube, crd):
    created = await create(crd, canary())
    w = watch.Watch()
    stream = watch_fd(
        crd, w, resource_version=created["metadata"]["resourceVersion"], timeout_seconds=5
    )
    await patch(crd, {"spec": {"restartNonce": 1}})
    await crd.delete_namespaced_custom_object(G, V, "default", FD, "canary")
    events = await next_events(stream, 2)
    w.stop()
    assert [t for t, _ in events] == ["MODIFIED", "DELETED"]
    assert events[0][1]["metadata"]["generation"] == 2


async def test_watch_without_resource_version_starts_with_current_objects(kube, crd):
    await create(crd, canary("a"))
    await create(crd, canary("b"))
    w = watch.Watch()
    events = await next_events(watch_fd(crd, w, timeout_seconds=5), 2)
    w.stop()
    assert [(t, o["metadata"]["name"]) for t, o in events] == [("ADDED", "a"), ("ADDED", "b")]


async def test_watch_from_compacted_resource_version_is_one_410_error_event(kube, kubeconfig):
    kube.create_namespace("x")
    old = kube.rv
    kube.create_namespace("y")
    kube.compact()
    url = f"{kube.url}/apis/{G}/{V}/namespaces/default/{FD}?watch=true&resourceVersion={old}"
    async with (
        aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as s,
        s.get(url) as resp,
    ):
        assert resp.status == 200
        lines = (await resp.read()).decode().splitlines()
    assert len(lines) == 1
    event = json.loads(lines[0])
    assert event["type"] == "ERROR"
    assert event["object"]["code"] == 410 and event["object"]["reason"] == "Expired"


async def test_kubernetes_asyncio_watch_does_not_relist_on_410(kube, crd):
    """Why canaryd owns its list/watch loop: watching "forever" (no timeout_seconds), the
    client retries a 410 once with the same stale resourceVersion, then raises."""
    old = kube.rv
    await create(crd, canary())
    kube.compact()
    w = watch.Watch()
    with pytest.raises(ApiException) as err:
        await next_events(watch_fd(crd, w, resource_version=str(old)), 1)
    assert err.value.status == 410
    watches = kube.requests_for("watch")
    assert len(watches) == 2
    assert {r.query["resourceVersion"] for r in watches} == {str(old)}


async def test_label_selector_watch_turns_edges_into_added_and_deleted(kube, crd):
    created = await create(crd, canary())
    w = watch.Watch()
    stream = watch_fd(
        crd,
        w,
        label_selector="flink.apache.org/canary=true",
        resource_version=created["metadata"]["resourceVersion"],
        timeout_seconds=5,
    )
    await patch(crd, {"metadata": {"labels": {"flink.apache.org/canary": None}}})
    await patch(crd, {"spec": {"restartNonce": 5}})  # not matching: nothing
    await patch(crd, {"metadata": {"labels": {"flink.apache.org/canary": "true"}}})
    await patch(crd, {"spec": {"restartNonce": 6}})
    events = await next_events(stream, 3)
    w.stop()
    assert [t for t, _ in events] == ["DELETED", "ADDED", "MODIFIED"]
    # kube-apiserver sends the previous copy (the label still set) with the change's
    # resourceVersion (tests/test_conformance.py pins it against the real server).
    deleted = events[0][1]["metadata"]
    assert deleted["labels"]["flink.apache.org/canary"] == "true"
    assert int(deleted["resourceVersion"]) > int(created["metadata"]["resourceVersion"])
    assert events[2][1]["spec"]["restartNonce"] == 6


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ("team=a", ["a1"]),
        ("team==a", ["a1"]),
        ("team!=a", ["b1", "none"]),
        ("team", ["a1", "b1"]),
        ("!team", ["none"]),
        ("team in (a, b)", ["a1", "b1"]),
        ("team notin (a)", ["b1", "none"]),
        ("team=a,tier=gold", ["a1"]),
        ("team=b,tier=gold", []),
    ],
)
async def test_label_selectors_on_list(kube, crd, selector, expected):
    for name, labels in (
        ("a1", {"team": "a", "tier": "gold"}),
        ("b1", {"team": "b"}),
        ("none", {}),
    ):
        await create(crd, {"metadata": {"name": name, "labels": labels}})
    listed = await crd.list_namespaced_custom_object(G, V, "default", FD, label_selector=selector)
    assert [i["metadata"]["name"] for i in listed["items"]] == expected


async def test_field_selectors_on_list_and_watch(kube, crd, api):
    client.CoreV1Api(api)
    kube.create_namespace("other")
    await create(crd, canary("a"))
    await create(crd, canary("b"))
    await create(crd, canary("a"), ns="other")
    listed = await crd.list_cluster_custom_object(G, V, FD, field_selector="metadata.name=a")
    assert [(i["metadata"]["namespace"]) for i in listed["items"]] == ["default", "other"]
    listed = await crd.list_cluster_custom_object(
        G, V, FD, field_selector="metadata.namespace!=default"
    )
    assert [i["metadata"]["name"] for i in listed["items"]] == ["a"]
    w = watch.Watch()
    events = await next_events(
        watch_fd(crd, w, ns=None, field_selector="metadata.name=b", timeout_seconds=5), 1
    )
    w.stop()
    assert events[0][1]["metadata"]["name"] == "b"
    with pytest.raises(ApiException) as err:
        await crd.list_cluster_custom_object(G, V, FD, field_selector="spec.x=1")
    assert err.value.status == 400


async def test_server_timeout_seconds_ends_the_stream(kube, crd):
    w = watch.Watch()
    events = []
    async with asyncio.timeout(5):
        async for event in watch_fd(crd, w, timeout_seconds=1):
            events.append(event)
    assert events == []  # the stream ended by itself, with nothing to say


async def test_bookmarks_only_with_allow_watch_bookmarks(kube, crd):
    created = await create(crd, canary())
    rv = created["metadata"]["resourceVersion"]
    w = watch.Watch()
    events = await next_events(
        watch_fd(crd, w, resource_version=rv, allow_watch_bookmarks=True, timeout_seconds=5), 1
    )
    w.stop()
    assert events[0][0] == "BOOKMARK"
    assert events[0][1]["metadata"]["resourceVersion"] == str(kube.rv)
    w = watch.Watch()
    async with asyncio.timeout(5):
        plain = [e async for e in watch_fd(crd, w, resource_version=rv, timeout_seconds=1)]
    assert plain == []  # a second past several bookmark intervals: none without the flag


# ---------------------------------------------------------- deletion semantics


async def test_delete_with_finalizer_sets_deletion_timestamp_until_it_is_removed(kube, crd):
    created = await create(
        crd,
        {
            **canary(),
            "metadata": {
                **canary()["metadata"],
                "finalizers": ["flinkdeployments.flink.apache.org/finalizer"],
            },
        },
    )
    w = watch.Watch()
    stream = watch_fd(
        crd, w, resource_version=created["metadata"]["resourceVersion"], timeout_seconds=5
    )
    deleting = await crd.delete_namespaced_custom_object(G, V, "default", FD, "canary")
    assert deleting["metadata"]["deletionTimestamp"]
    with pytest.raises(ApiException) as err:
        await patch(crd, {"metadata": {"finalizers": ["a", "b"]}})
    assert err.value.status == 422  # no new finalizers once deletion started
    await patch(crd, [{"op": "remove", "path": "/metadata/finalizers"}], content_type=JSON_PATCH)
    events = await next_events(stream, 2)
    w.stop()
    assert [t for t, _ in events] == ["MODIFIED", "DELETED"]
    assert events[0][1]["metadata"]["deletionTimestamp"]
    with pytest.raises(ApiException) as err:
        await crd.get_namespaced_custom_object(G, V, "default", FD, "canary")
    assert err.value.status == 404
    assert status_of(err.value)["reason"] == "NotFound"


async def test_namespace_goes_terminating_then_takes_its_content_with_it(api, crd):
    kube_cfg = api.configuration
    assert kube_cfg is not None
    core = client.CoreV1Api(api)
    await core.create_namespace({"metadata": {"name": "canary"}})
    created = await create(crd, canary(), ns="canary")
    w = watch.Watch()
    ns_stream = w.stream(
        core.list_namespace,
        resource_version=created["metadata"]["resourceVersion"],
        timeout_seconds=5,
    )
    await core.delete_namespace("canary")
    events = await next_events(ns_stream, 2)
    w.stop()
    assert events[0][0] == "MODIFIED"
    assert events[0][1].status.phase == "Terminating"
    assert events[1][0] == "DELETED"
    listed = await crd.list_cluster_custom_object(G, V, FD)
    assert listed["items"] == []


async def test_create_in_a_terminating_or_missing_namespace_fails(kube, crd):
    kube.auto_finalize_namespaces = False
    kube.create_namespace("going")
    await create(crd, canary(), ns="going")
    kube.delete(kube.types["namespaces"], None, "going")
    with pytest.raises(ApiException) as err:
        await create(crd, canary("new"), ns="going")
    assert err.value.status == 403
    assert "being terminated" in status_of(err.value)["message"]
    with pytest.raises(ApiException) as err:
        await create(crd, canary(), ns="nowhere")
    assert err.value.status == 404
    kube.finalize_namespace("going")
    assert kube.get("namespaces", None, "going") is None


# ----------------------------------------------------- errors, RBAC, discovery


async def test_rbac_denial_is_403_with_kubernetes_message(kube, crd):
    kube.create_namespace("canary")
    await create(crd, canary(), ns="canary")
    kube.deny(verb="patch", resource=FD, namespace="canary")
    with pytest.raises(ApiException) as err:
        await patch(crd, {"spec": {"restartNonce": 1}}, ns="canary")
    body = status_of(err.value)
    assert err.value.status == 403 and body["reason"] == "Forbidden"
    assert body["message"] == (
        'flinkdeployments.flink.apache.org "canary" is forbidden: User '
        '"system:serviceaccount:default:canaryd" cannot patch resource "flinkdeployments" '
        'in API group "flink.apache.org" in the namespace "canary"'
    )
    got = await crd.get_namespaced_custom_object(G, V, "canary", FD, "canary")
    assert got["metadata"]["name"] == "canary"  # only the denied verb is denied


async def test_missing_token_is_401(kube):
    async with aiohttp.ClientSession() as s, s.get(f"{kube.url}/api/v1/namespaces") as resp:
        assert resp.status == 401
        assert (await resp.json())["kind"] == "Status"


async def test_a_wrong_token_is_401_on_discovery_too(kube):
    """kube-apiserver authenticates before any handler runs (WithAuthentication)."""
    headers = {"Authorization": "Bearer not-the-token"}
    async with aiohttp.ClientSession(headers=headers) as s:
        for path in ("/apis", f"/apis/{G}/{V}", "/api/v1/namespaces"):
            async with s.get(f"{kube.url}{path}") as resp:
                assert resp.status == 401, path
                assert (await resp.json())["reason"] == "Unauthorized"


async def test_discovery_lists_flink_group_and_version(kube, api):
    groups = await client.ApisApi(api).get_api_versions()
    assert [g.name for g in groups.groups] == [G]
    resources = await client.CustomObjectsApi(api).get_api_resources(G, V)
    names = {r.name for r in resources.resources}
    assert {FD, SJ, f"{FD}/status"} <= names
    version = await client.VersionApi(api).get_code()
    assert version.major == "1"


async def test_a_missing_crd_is_absent_from_discovery_and_404(tmp_path):
    from canaryd.testing.apiserver import FLINK_DEPLOYMENTS

    fake = FakeKube(crds=[FLINK_DEPLOYMENTS])
    async with fake.running():
        fake.create_namespace("default")
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{fake.url}/apis/{G}/{V}") as resp:
                names = {r["name"] for r in (await resp.json())["resources"]}
            assert SJ not in names and FD in names
            async with s.get(f"{fake.url}/apis/{G}/{V}/namespaces/default/{SJ}") as resp:
                # kube-apiserver v1.35.4's answer: its mux's, not a Status
                assert (resp.status, await resp.read()) == (404, b"404 page not found\n")


# ------------------------------------------------------------ fault injection


async def test_fault_fails_the_next_n_matching_requests(kube, crd):
    await create(crd, canary())
    kube.inject(Fault(verb="patch", resource=FD, code=500, times=2))
    for _ in range(2):
        with pytest.raises(ApiException) as err:
            await patch(crd, {"spec": {"restartNonce": 1}})
        assert err.value.status == 500
        assert status_of(err.value)["reason"] == "InternalError"
    assert (await patch(crd, {"spec": {"restartNonce": 1}}))["spec"]["restartNonce"] == 1
    await crd.get_namespaced_custom_object(G, V, "default", FD, "canary")


async def test_fault_429_carries_retry_after(kube, crd):
    await create(crd, canary())
    kube.inject(Fault(verb="patch", code=429, retry_after=3))
    with pytest.raises(ApiException) as err:
        await patch(crd, {"spec": {"restartNonce": 1}})
    assert err.value.status == 429
    assert err.value.headers["Retry-After"] == "3"


async def test_fault_drops_the_connection(kube, crd):
    await create(crd, canary())
    kube.inject(Fault(verb="patch", drop=True))
    with pytest.raises(aiohttp.ClientError):
        await patch(crd, {"spec": {"restartNonce": 1}})
    assert kube.get(FD, "default", "canary")["metadata"]["generation"] == 1


async def test_fault_latency_delays_then_serves(kube, crd):
    await create(crd, canary())
    fault = kube.inject(Fault(verb="get", code=0, latency=0.05))
    got = await crd.get_namespaced_custom_object(G, V, "default", FD, "canary")
    assert got["metadata"]["name"] == "canary" and fault.hits == 1


async def test_held_watch_events_arrive_only_after_release(kube, crd):
    created = await create(crd, canary())
    w = watch.Watch()
    stream = watch_fd(
        crd, w, resource_version=created["metadata"]["resourceVersion"], timeout_seconds=10
    ).__aiter__()
    kube.hold_watch_events()
    await patch(crd, {"spec": {"restartNonce": 1}})
    pending = asyncio.ensure_future(stream.__anext__())
    done, _ = await asyncio.wait({pending}, timeout=0.3)
    assert not done, "a held event was delivered"
    kube.release_watch_events()
    async with asyncio.timeout(5):
        event = await pending
    w.stop()
    assert event["type"] == "MODIFIED"


async def test_every_event_held_behind_bookmarks_arrives_after_release(kube, crd):
    """Queued changes are delivered before any bookmark, even when bookmarks are overdue."""
    kube.bookmark_interval = 0.0  # a bookmark is always due
    created = await create(crd, canary())
    w = watch.Watch()
    stream = watch_fd(
        crd,
        w,
        resource_version=created["metadata"]["resourceVersion"],
        allow_watch_bookmarks=True,
        timeout_seconds=10,
    )
    consumer = asyncio.ensure_future(
        next_events((e async for e in stream if e["type"] == "MODIFIED"), 5)
    )
    await kube.wait_for(lambda: len(kube.watchers) == 1, what="the watch to start")
    kube.hold_watch_events()
    for nonce in range(1, 6):
        await patch(crd, {"spec": {"restartNonce": nonce}})
    kube.release_watch_events()
    events = await consumer
    w.stop()
    assert [o["spec"]["restartNonce"] for _, o in events] == [1, 2, 3, 4, 5]


async def test_close_watches_ends_every_stream(kube, crd):
    w = watch.Watch()
    stream = watch_fd(crd, w, timeout_seconds=60)
    consumer = asyncio.ensure_future(next_events(stream, 1))
    await kube.wait_for(lambda: len(kube.watchers) == 1, what="the watch to start")
    kube.close_watches()
    async with asyncio.timeout(5):
        assert await consumer == []


async def test_an_empty_watch_fault_answers_200_and_ends_at_once(kube, crd):
    kube.inject(Fault(verb="watch", empty_watch=True))
    w = watch.Watch()
    stream = watch_fd(crd, w, timeout_seconds=60)
    async with asyncio.timeout(5):
        assert await next_events(stream, 1) == []
    assert kube.requests_for("watch", FD)[-1].status == 200


async def test_refused_connections_then_the_same_server_back(kube, crd):
    await create(crd, canary())
    await kube.refuse_connections()
    async with aiohttp.ClientSession() as http:
        with pytest.raises(aiohttp.ClientConnectorError):
            await http.get(kube.url + "/version")
        await kube.accept_connections()
        async with http.get(
            kube.url + f"/apis/flink.apache.org/v1beta1/namespaces/default/{FD}/canary",
            headers={"Authorization": f"Bearer {TOKEN}"},
        ) as response:
            assert response.status == 200  # same address, same state


async def test_request_log_records_what_the_client_sent(kube, crd):
    await create(crd, canary())
    await patch(
        crd,
        {
            "metadata": {
                "resourceVersion": kube.get(FD, "default", "canary")["metadata"]["resourceVersion"]
            },
            "spec": {"restartNonce": 1},
        },
    )
    record = kube.requests_for("patch", FD, "canary")[-1]
    assert record.content_type == MERGE
    assert record.body["spec"] == {"restartNonce": 1}
    assert record.status == 200 and record.namespace == "default"
    assert [r.verb for r in kube.requests] == ["create", "patch"]


# ---------------------------------------------------------------------- leases
# coordination.k8s.io/v1 Leases as kube-apiserver serves them
# (pkg/registry/coordination/lease/strategy.go; compared in tests/test_conformance.py).


def lease_body(holder: str, rv: str | None = None) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": "canaryd"}
    if rv is not None:
        metadata["resourceVersion"] = rv
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": metadata,
        "spec": {"holderIdentity": holder, "leaseDurationSeconds": 15, "leaseTransitions": 0},
    }


async def test_a_lease_is_created_read_and_updated_with_its_resource_version(kube, api):
    leases = client.CoordinationV1Api(api)
    created = await leases.create_namespaced_lease("default", lease_body("a"))
    assert created.spec.holder_identity == "a" and created.metadata.generation is None
    got = await leases.read_namespaced_lease("canaryd", "default")
    assert got.metadata.resource_version == created.metadata.resource_version
    updated = await leases.replace_namespaced_lease(
        "canaryd", "default", lease_body("b", created.metadata.resource_version)
    )
    assert updated.spec.holder_identity == "b"
    assert updated.metadata.resource_version != created.metadata.resource_version
    with pytest.raises(ApiException) as again:
        await leases.create_namespaced_lease("default", lease_body("c"))
    assert again.value.status == 409 and json.loads(again.value.body)["reason"] == "AlreadyExists"


async def test_a_stale_lease_update_is_409_and_changes_nothing(kube, api):
    leases = client.CoordinationV1Api(api)
    created = await leases.create_namespaced_lease("default", lease_body("a"))
    rv = created.metadata.resource_version
    await leases.replace_namespaced_lease("canaryd", "default", lease_body("b", rv))
    with pytest.raises(ApiException) as stale:
        await leases.replace_namespaced_lease("canaryd", "default", lease_body("c", rv))
    assert stale.value.status == 409 and json.loads(stale.value.body)["reason"] == "Conflict"
    assert kube.get("leases", "default", "canaryd")["spec"]["holderIdentity"] == "b"
    with pytest.raises(ApiException) as unconditional:
        await leases.replace_namespaced_lease("canaryd", "default", lease_body("c"))
    assert unconditional.value.status == 422  # AllowUnconditionalUpdate: false


async def test_a_put_of_a_missing_lease_creates_it(kube, api):
    created = await client.CoordinationV1Api(api).replace_namespaced_lease(
        "canaryd", "default", lease_body("a")
    )
    assert created.spec.holder_identity == "a"
    assert kube.requests[-1].status == 201  # leaseStrategy.AllowCreateOnUpdate


# ---------------------------------------------------------------------- events
# events.k8s.io/v1 Events as kube-apiserver serves them (pkg/registry/core/event,
# pkg/apis/core/validation/events.go: ValidateEventCreate, validateV1EventSeries).


async def test_an_event_is_created_and_its_series_patched_or_replaced(kube, api):
    events = client.EventsV1Api(api)
    created = await events.create_namespaced_event("default", event_body())
    assert created.reason == "Unhealthy" and created.metadata.namespace == "default"
    assert kube.requests[-1].status == 201
    series = {"series": {"count": 2, "lastObservedTime": "2026-12-07T03:01:00.000000Z"}}
    patched = await events.patch_namespaced_event("canary.1", "default", series)
    assert patched.series.count == 2 and patched.note == created.note
    replaced = await events.replace_namespaced_event(  # unconditional: no resourceVersion
        "canary.1", "default", event_body(series={**series["series"], "count": 3})
    )
    assert replaced.series.count == 3
    with pytest.raises(ApiException) as gone:
        await events.patch_namespaced_event("canary.2", "default", series)
    assert gone.value.status == 404
    with pytest.raises(ApiException) as immutable:  # all but the series (ValidateEventUpdate)
        await events.patch_namespaced_event("canary.1", "default", {"note": "another"})
    assert (
        immutable.value.status == 422
        and "note: Invalid value: field is immutable"
        in (json.loads(immutable.value.body)["message"])
    )


@pytest.mark.parametrize(
    "fields, error",
    [
        ({"action": ""}, "action: Required value"),
        ({"reportingController": None}, "reportingController: Required value"),
        ({"eventTime": None}, "eventTime: Required value"),
        ({"type": "Bad"}, "type: Invalid value"),
        ({"note": "x" * 1025}, "note: Too long"),
        ({"regarding": {"kind": "FlinkDeployment", "namespace": "other", "name": "c"}}, "match"),
        ({"series": {"count": 1, "lastObservedTime": "2026-12-07T03:00:00Z"}}, "series.count"),
        ({"metadata": {"name": "a" * 251 + ".1f"}}, "must be no more than 253 characters"),
        ({"metadata": {"name": "Canary.1"}}, "metadata.name: Invalid value"),
    ],
)
async def test_an_event_kube_apiserver_would_refuse_is_422(kube, api, fields, error):
    with pytest.raises(ApiException) as refused:
        await client.EventsV1Api(api).create_namespaced_event("default", event_body(**fields))
    assert refused.value.status == 422 and error in json.loads(refused.value.body)["message"]


async def test_clients_are_told_apart_by_token_and_faults_can_target_one(kube, tmp_path):
    a = kube.add_client("system:serviceaccount:canaryd:a")
    b = kube.add_client("system:serviceaccount:canaryd:b")
    kube.inject(Fault(user="system:serviceaccount:canaryd:b", code=503, times=-1))
    path = f"{kube.url}/apis/flink.apache.org/v1beta1/namespaces/default/{FD}"
    async with aiohttp.ClientSession() as http:
        for token, expected in ((a, 200), (b, 503), (TOKEN, 200)):
            async with http.get(path, headers={"Authorization": f"Bearer {token}"}) as response:
                assert response.status == expected, token
    assert [r.user for r in kube.requests] == [
        "system:serviceaccount:canaryd:a",
        "system:serviceaccount:canaryd:b",
        kube.user,
    ]


# ------------------------------------------------------------------ standalone


async def test_standalone_process_writes_kubeconfig_and_stops_on_sigterm(tmp_path: Path):
    path = tmp_path / "kubeconfig"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "canaryd.testing.apiserver",
        "--kubeconfig",
        str(path),
        "--namespace",
        "default",
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(20):
            line = await proc.stdout.readline()
        assert b"listening on http://127.0.0.1:" in line
        configuration = client.Configuration()
        await config.load_kube_config(config_file=str(path), client_configuration=configuration)
        async with client.ApiClient(configuration) as api_client:
            namespaces = await client.CoreV1Api(api_client).list_namespace()
        assert [n.metadata.name for n in namespaces.items] == ["default"]
    finally:
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(10):
            code = await proc.wait()
    assert code == 0


async def test_a_bookmark_never_passes_a_change_not_yet_sent(kube, monkeypatch):
    """A change queued in the very turn the bookmark wait times out (asyncio.wait_for's
    race on 3.11) must go out before any bookmark: a bookmark at the resourceVersion
    past it would make a client that resumes from it (after a reset, a half-open
    connection) miss the change for good. A real cacher bookmarks only what it sent.
    This race cost the soak its false verdicts."""
    import types

    from canaryd.testing.apiserver import FLINK_DEPLOYMENTS, watch

    kube.bookmark_interval = 0.0  # a bookmark is always due
    created = kube.create(
        FLINK_DEPLOYMENTS,
        "default",
        {"metadata": {"name": "c", "labels": {"flink.apache.org/canary": "true"}}},
    )
    armed = [True]
    real_wait_for = asyncio.wait_for

    async def racing_wait_for(aw: Any, delay: float | None) -> Any:
        if armed[0]:
            armed[0] = False
            aw.close()  # the queue.get() coroutine: never started, nothing consumed

            def bump(obj: dict[str, Any]) -> dict[str, Any]:
                obj["spec"] = {"restartNonce": 7}
                return obj

            kube.update(FLINK_DEPLOYMENTS, "default", "c", bump)  # queued just now
            raise TimeoutError
        return await real_wait_for(aw, delay)

    shim = types.SimpleNamespace(**{k: getattr(asyncio, k) for k in dir(asyncio) if k[0] != "_"})
    shim.wait_for = racing_wait_for
    monkeypatch.setattr(watch, "asyncio", shim)
    rv = created["metadata"]["resourceVersion"]
    url = f"{kube.url}/apis/flink.apache.org/v1beta1/namespaces/default/flinkdeployments"
    query = {"watch": "true", "resourceVersion": rv, "allowWatchBookmarks": "true"}
    headers = {"Authorization": f"Bearer {TOKEN}"}
    seen: list[tuple[str, int]] = []
    async with aiohttp.ClientSession() as http, http.get(url, params=query, headers=headers) as r:
        async with asyncio.timeout(5):
            async for line in r.content:
                event = json.loads(line)
                seen.append((event["type"], int(event["object"]["metadata"]["resourceVersion"])))
                if event["type"] == "MODIFIED":
                    break
    modified_rv = seen[-1][1]
    ahead = [(t, v) for t, v in seen[:-1] if t == "BOOKMARK" and v >= modified_rv]
    assert not ahead, f"a bookmark passed the unsent change: {seen}"
