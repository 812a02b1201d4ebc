"""The seed's reproductions against a real cluster, with canaryd as its own process.

Skipped unless CANARYD_E2E_KUBECONFIG names a kubeconfig for a cluster that has the
Flink CRDs installed. The tests create and delete their own namespace
(CANARYD_E2E_NAMESPACE, default ``canaryd-e2e``) and use a 5 s cycle. Without the
Flink operator running, nothing else writes to the canaries; with it, it bumps them
too (canaryd tolerates that).

    CANARYD_E2E_KUBECONFIG=~/.kube/config .venv/bin/python -m pytest tests/test_e2e.py
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException

from canaryd.testing.process import canaryd_argv, free_port

KUBECONFIG = os.path.expanduser(os.environ.get("CANARYD_E2E_KUBECONFIG") or "") or None
NAMESPACE = os.environ.get("CANARYD_E2E_NAMESPACE", "canaryd-e2e")
LABEL = "flink.apache.org/canary"
G, V, FD = "flink.apache.org", "v1beta1", "flinkdeployments"
CYCLE = 5.0

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not KUBECONFIG, reason="CANARYD_E2E_KUBECONFIG is not set"),
    pytest.mark.timeout(300),
]


@pytest.fixture
async def api() -> AsyncIterator[client.ApiClient]:
    assert KUBECONFIG is not None
    configuration = client.Configuration()
    await config.load_kube_config(config_file=KUBECONFIG, client_configuration=configuration)
    async with client.ApiClient(configuration) as api_client:
        core = client.CoreV1Api(api_client)
        with contextlib.suppress(ApiException):
            await core.create_namespace({"metadata": {"name": NAMESPACE}})
        try:
            yield api_client
        finally:
            with contextlib.suppress(ApiException):
                await core.delete_namespace(NAMESPACE)


@contextlib.asynccontextmanager
async def canaryd() -> AsyncIterator[str]:
    assert KUBECONFIG is not None
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        *canaryd_argv(
            Path(KUBECONFIG),
            port,
            CYCLE,
            "--namespace",
            NAMESPACE,
            "--log-format",
            "console",
        ),
        stderr=sys.stderr,
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(10):
            assert await process.wait() == 0


async def create_canary(crd: client.CustomObjectsApi, name: str) -> None:
    await crd.create_namespaced_custom_object(
        G,
        V,
        NAMESPACE,
        FD,
        {
            "apiVersion": f"{G}/{V}",
            "kind": "FlinkDeployment",
            "metadata": {"name": name, "labels": {LABEL: "true"}},
        },
    )


async def health(url: str) -> tuple[int, dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as http,
        http.get(url + "/healthz", headers={"Accept": "application/json"}) as response,
    ):
        return response.status, await response.json()


async def eventually(check: Any, what: str, within: float = 6 * CYCLE) -> Any:
    """Poll a real cluster (no events to wait on from here), bounded, with a message."""
    loop = asyncio.get_running_loop()
    end = loop.time() + within
    while True:
        with contextlib.suppress(aiohttp.ClientError):
            result = await check()
            if result:
                return result
        if loop.time() > end:
            raise AssertionError(f"still waiting after {within}s for {what}")
        await asyncio.sleep(0.5)


async def test_metadata_is_kept_and_a_removed_label_stops_the_checks(api):
    crd = client.CustomObjectsApi(api)
    await create_canary(crd, "canary")
    async with canaryd() as url:

        async def healthy() -> bool:
            status, body = await health(url)
            return status == 200 and any(c["state"] == "healthy" for c in body["canaries"])

        await eventually(healthy, "a healthy verdict")
        await crd.patch_namespaced_custom_object(
            G,
            V,
            NAMESPACE,
            FD,
            "canary",
            {"metadata": {"labels": {"repro": "409"}, "annotations": {"repro/note": "keep-me"}}},
            _content_type="application/merge-patch+json",
        )
        before = (await crd.get_namespaced_custom_object(G, V, NAMESPACE, FD, "canary"))[
            "spec"
        ].get("restartNonce", 0)

        async def bumped_twice() -> dict[str, Any] | None:
            obj: dict[str, Any] = await crd.get_namespaced_custom_object(
                G, V, NAMESPACE, FD, "canary"
            )
            return obj if obj["spec"].get("restartNonce", 0) >= before + 2 else None

        obj = await eventually(bumped_twice, "two more bumps")
        assert obj["metadata"]["labels"]["repro"] == "409"
        assert obj["metadata"]["annotations"]["repro/note"] == "keep-me"

        await crd.patch_namespaced_custom_object(
            G,
            V,
            NAMESPACE,
            FD,
            "canary",
            {"metadata": {"labels": {LABEL: None}}},
            _content_type="application/merge-patch+json",
        )

        async def dropped() -> bool:
            _, body = await health(url)
            return not body["canaries"]

        await eventually(dropped, "the canary to be dropped")
        obj = await crd.get_namespaced_custom_object(G, V, NAMESPACE, FD, "canary")
        assert LABEL not in (obj["metadata"].get("labels") or {})
        assert (await health(url))[0] == 200


async def test_a_canary_deleted_without_cleanup_is_dropped_and_health_stays_200(api):
    crd = client.CustomObjectsApi(api)
    await create_canary(crd, "gone")
    async with canaryd() as url:

        async def tracked() -> bool:
            _, body = await health(url)
            return any(c["name"] == "gone" for c in body["canaries"])

        await eventually(tracked, "the canary to be tracked")
        with contextlib.suppress(ApiException):
            await crd.patch_namespaced_custom_object(
                G,
                V,
                NAMESPACE,
                FD,
                "gone",
                [{"op": "remove", "path": "/metadata/finalizers"}],
                _content_type="application/json-patch+json",
            )
        await crd.delete_namespaced_custom_object(G, V, NAMESPACE, FD, "gone")

        async def dropped() -> bool:
            status, body = await health(url)
            return status == 200 and not any(c["name"] == "gone" for c in body["canaries"])

        await eventually(dropped, "the deleted canary to be dropped")
        await asyncio.sleep(2 * CYCLE)  # two more cycles on a real cluster: still 200
        assert (await health(url))[0] == 200
