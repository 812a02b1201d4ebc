"""Any namespaced custom resource as a canary (`--kind PLURAL.GROUP/VERSION`), and
`--reconciled-by observed-generation`: a bump is reconciled when the canary's
status.observedGeneration (seen through the watch) reaches the bumped generation,
the signal most controllers write."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from canaryd.config import ConfigError, load_settings
from canaryd.registry import CanaryState
from canaryd.testing.apiserver import FLINK_TYPES, FakeKube, ResourceType
from tests.conftest import TOKEN
from tests.harness import CYCLE, canary_body, running_daemon

WIDGETS = ResourceType("example.com", "v1", "widgets", "Widget", True, True, True)
GADGETS = ResourceType("example.com", "v1", "gadgets", "Gadget", False, True, True)
WIDGET_KIND = "widgets.example.com/v1"


@contextlib.asynccontextmanager
async def cluster(tmp_path: Path) -> AsyncIterator[tuple[FakeKube, Path]]:
    kube = FakeKube(crds=(*FLINK_TYPES, WIDGETS, GADGETS), token=TOKEN, bookmark_interval=0.1)
    async with kube.running():
        kube.create_namespace("default")
        yield kube, kube.write_kubeconfig(tmp_path / "kubeconfig")


async def controller(kube: FakeKube, jumps: dict[str, int], ignored: set[str]) -> None:
    """A controller that reports status.observedGeneration for every widget it
    reconciles (``jumps`` adds to it; ``ignored`` it never reports)."""
    changed = asyncio.Event()
    kube.listeners.append(changed.set)
    while True:
        await changed.wait()
        changed.clear()
        for (namespace, name), obj in list(kube.objects[WIDGETS.plural].items()):
            if name in ignored:
                continue
            target = obj["metadata"]["generation"] + jumps.get(name, 0)
            if (obj.get("status") or {}).get("observedGeneration") != target:
                kube.update(
                    WIDGETS,
                    namespace,
                    name,
                    lambda o, t=target: {**o, "status": {"observedGeneration": t}},
                    status_only=True,
                )


async def test_observed_generation_judges_by_the_status_a_controller_writes(tmp_path):
    async with cluster(tmp_path) as (kube, kubeconfig):
        for name in ("reconciled", "jumps", "ignored"):
            kube.create(WIDGETS, "default", canary_body(name))
        reconciler = asyncio.create_task(controller(kube, {"jumps": 3}, {"ignored"}))
        try:
            async with running_daemon(
                kube, kubeconfig, kinds=(WIDGET_KIND,), reconciled_by="observed-generation"
            ) as run:
                ok = await run.until_state(CanaryState.HEALTHY, "reconciled", kind=WIDGET_KIND)
                assert "status.observedGeneration" in ok.reason
                jumped = await run.until_state(CanaryState.HEALTHY, "jumps", kind=WIDGET_KIND)
                assert jumped.status_observed is not None
                assert jumped.status_observed > jumped.generation  # past it: reconciled
                stuck = await run.until_state(
                    CanaryState.UNHEALTHY, "ignored", kind=WIDGET_KIND, within=6 * CYCLE
                )
                assert "status.observedGeneration did not reach" in stuck.reason
                assert stuck.generation >= 2  # the watch saw the bump; the status did not
                status, text = await run.get("/healthz", Accept="application/json")
                assert status == 500
                body = json.loads(text)
                kinds = {c["kind"] for c in body["canaries"]}
                assert kinds == {"Widget"}
                by_name = {c["name"]: c for c in body["canaries"]}
                assert by_name["ignored"]["statusObservedGeneration"] is None
                # Bumps are the same merge patch as for Flink: spec.restartNonce only.
                patches = [r for r in kube.requests_for("patch", WIDGETS.plural) if r.body]
                assert patches and all(
                    set(r.body) == {"metadata", "spec"}
                    and set(r.body["spec"]) == {"restartNonce"}
                    and set(r.body["metadata"]) == {"resourceVersion"}
                    for r in patches
                )
        finally:
            reconciler.cancel()


async def test_watch_mode_checks_a_custom_kind_without_any_status(tmp_path):
    async with cluster(tmp_path) as (kube, kubeconfig):
        kube.create(WIDGETS, "default", canary_body("plain"))
        async with running_daemon(kube, kubeconfig, kinds=(WIDGET_KIND,)) as run:
            canary = await run.until_state(CanaryState.HEALTHY, "plain", kind=WIDGET_KIND)
            assert "observed in time" in canary.reason


async def test_a_kind_not_served_or_cluster_scoped_is_skipped_and_said(tmp_path, capsys):
    async with cluster(tmp_path) as (kube, kubeconfig):
        kube.create(WIDGETS, "default", canary_body("w"))
        async with running_daemon(
            kube,
            kubeconfig,
            namespaces=frozenset({"default"}),  # a cluster-scoped kind's path there: 404
            kinds=(WIDGET_KIND, "gadgets.example.com/v1", "things.nowhere.example/v1"),
        ) as run:
            await run.until_state(CanaryState.HEALTHY, "w", kind=WIDGET_KIND)
            await run.until(
                lambda: [k.key for k in run.daemon.watcher.kinds] == [WIDGET_KIND],
                "both 404s confirmed",
            )
    err = capsys.readouterr().err
    assert "gadgets.example.com is cluster-scoped" in err
    assert "things.nowhere.example is not served" in err


def test_kinds_are_parsed_and_a_bad_one_is_refused():
    settings = load_settings(
        ["--kind", "widgets.example.com/v1,flinkdeployments.flink.apache.org/v1beta1"], {}
    )
    assert settings.kinds == (WIDGET_KIND, "flinkdeployments")
    assert load_settings(["--reconciled-by", "observed-generation"], {}).reconciled_by == (
        "observed-generation"
    )
    for bad in ("widgets", "widgets.example.com", "widgets/v1", "widgets.example.com/1"):
        with pytest.raises(ConfigError, match=r"PLURAL\.GROUP/VERSION"):
            load_settings(["--kind", bad], {})
    with pytest.raises(ConfigError, match="watch or observed-generation"):
        load_settings(["--reconciled-by", "status"], {})


async def test_a_list_error_for_one_kind_does_not_hold_up_the_others(tmp_path):
    """An aggregated API or a flaky group answers a kind's list 503 (not 404: not known
    to be gone): Flink's kinds are watched and bumped meanwhile, the failing kind is
    named in /readyz (503) and retried with backoff, and watched once it answers."""
    from canaryd.testing.apiserver import Fault

    async with cluster(tmp_path) as (kube, kubeconfig):
        kube.create(FLINK_TYPES[0], "default", canary_body("flink"))
        kube.create(WIDGETS, "default", canary_body("w"))
        failing = kube.inject(Fault(verb="list", resource="widgets", code=503, times=-1))
        async with running_daemon(kube, kubeconfig, kinds=("flinkdeployments", WIDGET_KIND)) as run:
            await run.until_state(CanaryState.HEALTHY, "flink")
            assert run.canary("w", kind=WIDGET_KIND) is None
            status, text = await run.get("/readyz")
            assert status == 503, text
            assert "not listed or not connected: widgets (server_error: 503" in text, text
            await run.until(lambda: failing.hits >= 3, "the failing group to be retried")
            kube.faults.remove(failing)
            await run.until_state(CanaryState.HEALTHY, "w", kind=WIDGET_KIND)
            status, text = await run.get("/readyz")
            assert status == 200, text
