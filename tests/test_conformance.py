"""A conformance diff of the fake API server: one script of plain-HTTP steps over the
Kubernetes behaviours canaryd relies on, run against the fake and against the real
kube-apiserver of ``make e2e``. Each step reduces an answer to the facts that matter
(status, reason, whether generation or resourceVersion moved, which watch events came);
any difference not listed in KNOWN_DIFFERENCES, with why it does not matter to
canaryd, fails the test. Skipped in ``make test`` (it needs the real server).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from canaryd.testing.apiserver import FakeKube
from tests.harness import event_body

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        os.environ.get("CANARYD_E2E") != "controlplane", reason="make e2e runs the diff"
    ),
    pytest.mark.timeout(300),
]

NS = "conformance"
LABEL = "flink.apache.org/canary"
BASE = f"/apis/flink.apache.org/v1beta1/namespaces/{NS}/flinkdeployments"
MERGE = "application/merge-patch+json"
RESTRICTED_USER = "system:serviceaccount:canaryd-own:canaryd"

KNOWN_DIFFERENCES: dict[str, str] = {}
"""Step -> why a difference there does not matter to canaryd. Empty: on the last run
(kube-apiserver v1.35.4) the fake matched every step. Not compared here, by design:
bookmark timing (kube-apiserver's watch cache sends about one a minute, the fake at
its bookmark_interval) and 410 Expired (tests/test_e2e.py pins it on the real server
through an API server restart)."""


class Api:
    """Plain HTTP to one API server, as the admin or as the restricted user."""

    def __init__(self, http: aiohttp.ClientSession, url: str, token: str, restricted: str):
        self.http, self.url, self.token, self.restricted = http, url, token, restricted

    async def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        content_type: str = "application/json",
        restricted: bool = False,
    ) -> tuple[int, Any]:
        headers = {
            "Authorization": f"Bearer {self.restricted if restricted else self.token}",
            "Accept": "application/json",
        }
        data = None
        if body is not None:
            data = json.dumps(body)
            headers["Content-Type"] = content_type
        async with self.http.request(
            method, self.url + path, data=data, headers=headers
        ) as response:
            raw = await response.read()
        try:
            return response.status, json.loads(raw) if raw else None
        except ValueError:
            return response.status, raw.decode(errors="replace")[:200]

    async def watch(self, path: str, query: dict[str, str], count: int) -> list[str]:
        """The types of the first ``count`` events (or until the stream ends)."""
        headers = {"Authorization": f"Bearer {self.token}"}
        seen: list[str] = []
        params = {**query, "watch": "true"}
        async with self.http.get(self.url + path, params=params, headers=headers) as response:
            if response.status != 200:
                return [f"HTTP {response.status}"]
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(10):
                    async for line in response.content:
                        if line.strip():
                            event = json.loads(line)
                            seen.append(event_fact(event))
                            if len(seen) >= count:
                                break
        return seen


def event_fact(event: dict[str, Any]) -> str:
    if event["type"] == "ERROR":
        return f"ERROR {event['object'].get('code')} {event['object'].get('reason')}"
    if event["type"] == "DELETED":
        # Which copy a DELETED carries: for an object that left a label selector, the
        # previous one (the label still set), with the change's resourceVersion.
        labels = (event["object"].get("metadata") or {}).get("labels") or {}
        return f"DELETED with {LABEL}={labels.get(LABEL)}"
    return str(event["type"])


def status_fact(status: int, body: Any) -> dict[str, Any]:
    if isinstance(body, dict) and body.get("kind") == "Status":
        return {"code": status, "kind": "Status", "reason": body.get("reason")}
    return {"code": status}


def canary(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "flink.apache.org/v1beta1",
        "kind": "FlinkDeployment",
        "metadata": {"name": name, "labels": {LABEL: "true"}},
        "spec": {"restartNonce": 0},
    }


Step = Callable[[Api], Awaitable[Any]]


async def script(api: Api, forbid: Callable[[], None]) -> dict[str, Any]:
    """The steps, in order; each returns its facts."""
    facts: dict[str, Any] = {}

    async def meta(name: str = "c") -> dict[str, Any]:
        _, obj = await api.call("GET", f"{BASE}/{name}")
        return obj["metadata"]  # type: ignore[no-any-return]

    status, body = await api.call("POST", "/api/v1/namespaces", {"metadata": {"name": NS}})
    facts["create a namespace"] = {"code": status, "phase": (body.get("status") or {}).get("phase")}
    status, body = await api.call("GET", "/apis/flink.apache.org/v1beta1")
    resources = {r["name"]: r for r in body.get("resources", [])}
    facts["discovery of the Flink group"] = {
        "code": status,
        "flinkdeployments namespaced": resources["flinkdeployments"]["namespaced"],
        "verbs": sorted(
            v
            for v in resources["flinkdeployments"]["verbs"]
            if v in ("get", "list", "watch", "patch")
        ),
        "status subresource": "flinkdeployments/status" in resources,
    }
    status, body = await api.call("POST", BASE, canary("c"))
    rv0 = body["metadata"]["resourceVersion"]
    facts["create a canary"] = {
        "code": status,
        "generation": body["metadata"]["generation"],
        "resourceVersion is a string": isinstance(rv0, str),
    }
    status, body = await api.call("GET", f"{BASE}/missing")
    facts["get a missing object"] = status_fact(status, body)

    status, body = await api.call(
        "PATCH",
        f"{BASE}/c",
        {"metadata": {"resourceVersion": "1"}, "spec": {"restartNonce": 1}},
        content_type=MERGE,
    )
    facts["merge patch with a stale resourceVersion"] = status_fact(status, body)
    status, body = await api.call(
        "PATCH",
        f"{BASE}/c",
        {"metadata": {"resourceVersion": rv0}, "spec": {"restartNonce": 1}},
        content_type=MERGE,
    )
    rv1 = body["metadata"]["resourceVersion"]
    facts["merge patch of spec with the current resourceVersion"] = {
        "code": status,
        "generation": body["metadata"]["generation"],
        "resourceVersion moved": rv1 != rv0,
    }
    status, body = await api.call(
        "PATCH", f"{BASE}/c", {"spec": {"restartNonce": 2}}, content_type=MERGE
    )
    facts["merge patch without a resourceVersion never conflicts"] = {
        "code": status,
        "generation": body["metadata"]["generation"],
    }
    rv2 = body["metadata"]["resourceVersion"]
    status, body = await api.call(
        "PATCH", f"{BASE}/c", {"metadata": {"labels": {"user": "x"}}}, content_type=MERGE
    )
    facts["metadata-only patch"] = {
        "code": status,
        "generation": body["metadata"]["generation"],
        "resourceVersion moved": body["metadata"]["resourceVersion"] != rv2,
    }
    rv3 = body["metadata"]["resourceVersion"]
    status, body = await api.call(
        "PATCH", f"{BASE}/c", {"spec": {"restartNonce": 2}}, content_type=MERGE
    )
    facts["no-op patch"] = {
        "code": status,
        "generation": body["metadata"]["generation"],
        "resourceVersion moved": body["metadata"]["resourceVersion"] != rv3,
    }
    status, body = await api.call(
        "PATCH", f"{BASE}/c", {"status": {"x": "main"}}, content_type=MERGE
    )
    facts["status sent to the main endpoint"] = {
        "code": status,
        "generation": body["metadata"]["generation"],
        "status kept": "x" in (body.get("status") or {}),
    }
    status, body = await api.call(
        "PATCH", f"{BASE}/c/status", {"status": {"x": "sub"}}, content_type=MERGE
    )
    facts["status subresource write"] = {
        "code": status,
        "generation": body["metadata"]["generation"],
        "status": (body.get("status") or {}).get("x"),
    }
    status, body = await api.call(
        "PATCH",
        f"{BASE}/c",
        {"spec": {"restartNonce": 3}},
        content_type="application/strategic-merge-patch+json",
    )
    facts["strategic merge patch on a custom resource"] = status_fact(status, body)
    status, body = await api.call(
        "PATCH",
        f"{BASE}/c",
        [
            {"op": "test", "path": "/spec/restartNonce", "value": 99},
            {"op": "replace", "path": "/spec/restartNonce", "value": 100},
        ],
        content_type="application/json-patch+json",
    )
    facts["json patch whose test fails"] = status_fact(status, body)
    current_rv = (await api.call("GET", f"{BASE}/c", None))[1]["metadata"]["resourceVersion"]
    for which, rv in (("current", current_rv), ("stale", "1")):
        status, body = await api.call(
            "PATCH",
            f"{BASE}/c",
            [
                {"op": "test", "path": "/metadata/resourceVersion", "value": rv},
                {"op": "add", "path": "/metadata/finalizers", "value": ["example.com/f"]},
            ],
            content_type="application/json-patch+json",
        )
        facts[f"json patch testing the {which} resourceVersion (kopf's finalizer)"] = (
            status_fact(status, body)
            if status != 200
            else {"code": status, "finalizers": body["metadata"].get("finalizers")}
        )
    await api.call("PATCH", f"{BASE}/c", {"metadata": {"finalizers": None}}, content_type=MERGE)
    status, body = await api.call(
        "PATCH",
        f"{BASE}/c",
        {"spec": {"restartNonce": 3}},
        content_type="application/json-patch+json",
    )
    facts["a dict sent as a json patch (the kubernetes-asyncio quirk)"] = status_fact(status, body)

    # Watches with a label selector: leaving and entering the selector.
    current = (await meta())["resourceVersion"]
    selector = {"labelSelector": f"{LABEL}=true", "resourceVersion": current}
    watching = asyncio.ensure_future(api.watch(BASE, selector, 3))
    await asyncio.sleep(1)
    await api.call("PATCH", f"{BASE}/c", {"spec": {"restartNonce": 4}}, content_type=MERGE)
    await api.call(
        "PATCH", f"{BASE}/c", {"metadata": {"labels": {LABEL: None}}}, content_type=MERGE
    )
    await api.call(
        "PATCH", f"{BASE}/c", {"metadata": {"labels": {LABEL: "true"}}}, content_type=MERGE
    )
    facts["a selector watch: modified, leaves, enters"] = await watching
    status, body = await api.call("GET", BASE, None)
    list_rv = body["metadata"]["resourceVersion"]
    facts["a watch from a resourceVersion not reached yet"] = await api.watch(
        BASE, {"resourceVersion": str(int(list_rv) + 1000), "timeoutSeconds": "5"}, 1
    )

    # Finalizers.
    await api.call("POST", BASE, canary("f"))
    await api.call(
        "PATCH", f"{BASE}/f", {"metadata": {"finalizers": ["e2e/hold"]}}, content_type=MERGE
    )
    status, body = await api.call("DELETE", f"{BASE}/f")
    facts["delete with a finalizer"] = {
        "code": status,
        "deletionTimestamp set": bool((body.get("metadata") or {}).get("deletionTimestamp")),
        "still there": (await api.call("GET", f"{BASE}/f"))[0] == 200,
    }
    await api.call("PATCH", f"{BASE}/f", {"metadata": {"finalizers": None}}, content_type=MERGE)
    facts["the last finalizer removed"] = {"code": (await api.call("GET", f"{BASE}/f"))[0]}

    # RBAC.
    forbid()
    status, body = await api.call(
        "GET", "/apis/flink.apache.org/v1beta1/namespaces/default/flinkdeployments", restricted=True
    )
    facts["a list the user may not make"] = {
        **status_fact(status, body),
        "message": (body or {}).get("message"),
    }

    # Leases (leader election): create, a stale update, an update without a
    # resourceVersion, a PUT that creates.
    leases = f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases"
    spec = {"holderIdentity": "a", "leaseDurationSeconds": 15, "leaseTransitions": 0}
    status, body = await api.call("POST", leases, {"metadata": {"name": "l"}, "spec": spec})
    created = body if status == 201 else {}
    facts["create a lease"] = {
        **status_fact(status, body),
        "generation": (created.get("metadata") or {}).get("generation"),
        "spec": created.get("spec"),
    }
    status, body = await api.call("POST", leases, {"metadata": {"name": "l"}, "spec": spec})
    facts["create it again"] = status_fact(status, body)
    held = {**created, "spec": {**spec, "holderIdentity": "b"}}
    status, body = await api.call("PUT", f"{leases}/l", held)
    moved = (
        status == 200
        and body["metadata"]["resourceVersion"] != created["metadata"]["resourceVersion"]
    )
    facts["update a lease with its resourceVersion"] = {
        **status_fact(status, body),
        "rv moved": moved,
    }
    status, body = await api.call("PUT", f"{leases}/l", held)  # the same, now stale
    facts["update a lease with a stale resourceVersion"] = status_fact(status, body)
    unconditional = {"metadata": {"name": "l"}, "spec": spec}
    status, body = await api.call("PUT", f"{leases}/l", unconditional)
    facts["update a lease without a resourceVersion"] = status_fact(status, body)
    status, body = await api.call("PUT", f"{leases}/m", {"metadata": {"name": "m"}, "spec": spec})
    facts["PUT a lease that does not exist"] = status_fact(status, body)

    # events.k8s.io/v1 Events (canaryd.events): create, a series PATCH, an immutable
    # field, one kube-apiserver's validation refuses.
    events = f"/apis/events.k8s.io/v1/namespaces/{NS}/events"
    event = event_body(NS, metadata={"name": "c.1"})
    event["regarding"]["name"] = "c"
    status, body = await api.call("POST", events, event)
    facts["create an event"] = {**status_fact(status, body), "reason": body.get("reason")}
    series = {"series": {"count": 2, "lastObservedTime": "2026-12-07T03:01:00.000000Z"}}
    status, body = await api.call("PATCH", f"{events}/c.1", series, content_type=MERGE)
    facts["patch an event's series"] = {
        **status_fact(status, body),
        "series": body.get("series"),
        "note": body.get("note"),
    }
    status, body = await api.call("PATCH", f"{events}/c.1", {"note": "x"}, content_type=MERGE)
    facts["patch an event's note"] = status_fact(status, body)
    status, body = await api.call(
        "POST", events, {**event, "metadata": {"name": "c.2"}, "action": ""}
    )
    facts["create an event without an action"] = status_fact(status, body)
    long_name = {"name": "c" * 251 + ".1f"}  # ValidateObjectMeta: at most 253 characters
    status, body = await api.call("POST", events, {**event, "metadata": long_name})
    facts["create an event named with 254 characters"] = status_fact(status, body)

    # Namespace lifecycle.
    status, body = await api.call("DELETE", f"/api/v1/namespaces/{NS}")
    facts["delete a namespace"] = {"code": status, "phase": (body.get("status") or {}).get("phase")}
    loop = asyncio.get_running_loop()
    end = loop.time() + 60
    # Polling another server (no event to await) until the namespace controller is done.
    while (await api.call("GET", f"/api/v1/namespaces/{NS}"))[0] == 200 and loop.time() < end:  # noqa: ASYNC110
        await asyncio.sleep(0.2)
    facts["the namespace once emptied"] = {
        "code": (await api.call("GET", f"/api/v1/namespaces/{NS}"))[0]
    }
    return facts


@contextlib.asynccontextmanager
async def fake_server() -> AsyncIterator[tuple[FakeKube, str]]:
    fake = FakeKube(token="conformance-token", user=RESTRICTED_USER)
    async with fake.running():
        yield fake, fake.url


@pytest.fixture(scope="module")
def real_plane() -> Any:
    from tests.controlplane.launcher import ControlPlane

    plane = ControlPlane()
    plane.start()
    try:
        yield plane
    finally:
        plane.stop()


async def test_the_fake_behaves_as_kube_apiserver_where_canaryd_relies_on_it(real_plane):
    async with aiohttp.ClientSession() as http:
        async with fake_server() as (fake, url):

            def forbid() -> None:
                fake.deny(verb="list", namespace="default")

            fake_facts = await script(
                Api(http, url, "conformance-token", "conformance-token"), forbid
            )
        context = ssl.create_default_context(cafile=str(real_plane.ca_file))
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context)) as tls:
            restricted = real_plane.service_account_token("canaryd-own")
            real_facts = await script(
                Api(tls, real_plane.url, real_plane.admin_token, restricted), lambda: None
            )
    differences = {
        step: {"fake": fake_facts.get(step), "kube-apiserver": real}
        for step, real in real_facts.items()
        if fake_facts.get(step) != real
    }
    report = json.dumps(differences, indent=2, sort_keys=True)
    print(f"\nconformance: {len(real_facts)} steps, {len(differences)} differences\n{report}")
    print("kube-apiserver's facts: " + json.dumps(real_facts, indent=1, sort_keys=True))
    unexplained = {k: v for k, v in differences.items() if k not in KNOWN_DIFFERENCES}
    assert not unexplained, f"differences of the fake from kube-apiserver:\n{report}"
