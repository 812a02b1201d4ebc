"""canaryd's job done the idiomatic kopf way: ``make bench``'s peer (bench/peer.py).

Every cycle, for every FlinkDeployment labelled ``flink.apache.org/canary: "true"``, a
sharp ``@kopf.timer`` judges the previous bump and writes the next: spec.restartNonce
+ 1 as a JSON merge patch with a resourceVersion precondition (what canaryd sends). An
``@kopf.on.event`` handler notes the generations the watch delivers, and an
``@kopf.on.probe`` handler makes kopf's liveness endpoint (``--liveness``) answer 500
while any canary's last bump was not observed within a cycle of its answer, else 200.

kopf's own patching (a timer's ``patch``) has no precondition and a 409 there ends the
timer, so the bump is a request of its own on one aiohttp session (kopf's HTTP client
library) made at startup from kopf's kubeconfig login. Everything else is kopf as a
user runs it: ``kopf run --standalone --all-namespaces --quiet --liveness URL`` (uvloop
when installed, as kopf's CLI does), its finalizer on each canary (timers require one),
kopf's default settings. It runs in the bench's own venv (kopf is no dependency of
canaryd) and imports nothing of canaryd.

Environment: ``KUBECONFIG``; ``CANARY_PROBER_CYCLE`` (seconds, default 5).
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass
from typing import Any

import aiohttp
import kopf

GROUP, VERSION, PLURAL = "flink.apache.org", "v1beta1", "flinkdeployments"
LABEL, LABEL_VALUE = "flink.apache.org/canary", "true"
CYCLE = float(os.environ.get("CANARY_PROBER_CYCLE", "5"))
MAX_CONFLICTS = 3
MERGE_PATCH = {"Content-Type": "application/merge-patch+json"}


@dataclass(slots=True)
class Track:
    """One canary as the prober knows it."""

    observed: int = 0
    """The latest generation the watch delivered."""
    bumped: int | None = None
    """The generation the last bump wrote (None: no bump to judge)."""
    answered_at: float = 0.0
    observed_at: float | None = None
    """When the watch first delivered ``bumped`` or a later generation."""
    healthy: bool = True


tracks: dict[tuple[str, str], Track] = {}
http: aiohttp.ClientSession | None = None


def now() -> float:
    return asyncio.get_running_loop().time()


@kopf.on.startup()
async def connect(settings: kopf.OperatorSettings, **_: Any) -> None:
    """One HTTP session for the bumps, with the credentials kopf itself logs in with."""
    global http
    info = kopf.login_with_kubeconfig(settings=settings)
    if info is None:
        raise kopf.PermanentError("no kubeconfig (KUBECONFIG)")
    headers = {"Authorization": f"Bearer {info.token}"} if info.token else {}
    http = aiohttp.ClientSession(base_url=info.server, headers=headers)


@kopf.on.cleanup()
async def disconnect(**_: Any) -> None:
    if http is not None:
        await http.close()


@kopf.on.event(GROUP, VERSION, PLURAL)
async def observe(
    event: dict[str, Any], meta: kopf.Meta, namespace: str, name: str, **_: Any
) -> None:
    """Every watch event: the generation it carries; a canary no longer is one once it
    is deleted or loses its label (not filtered here, so that its removal is seen)."""
    key = (namespace, name)
    if event.get("type") == "DELETED" or meta.get("labels", {}).get(LABEL) != LABEL_VALUE:
        tracks.pop(key, None)
        return
    generation = meta.get("generation")
    if not isinstance(generation, int):
        return
    track = tracks.setdefault(key, Track())
    if generation > track.observed:
        track.observed = generation
    if track.bumped is not None and track.observed_at is None and generation >= track.bumped:
        track.observed_at = now()


@kopf.timer(GROUP, VERSION, PLURAL, labels={LABEL: LABEL_VALUE}, interval=CYCLE, sharp=True)
async def bump(
    body: kopf.Body, namespace: str, name: str, stopped: kopf.DaemonStopped, logger: Any, **_: Any
) -> None:
    """Judge the previous bump, then write the next one."""
    key = (namespace, name)
    track = tracks.setdefault(key, Track())
    if track.bumped is not None:
        seen = track.observed_at
        track.healthy = seen is not None and seen <= track.answered_at + CYCLE
        track.bumped = None
    assert http is not None
    path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{name}"
    current: dict[str, Any] = dict(body)  # the latest the watch delivered
    for _attempt in range(MAX_CONFLICTS + 1):
        metadata, spec = current.get("metadata", {}), current.get("spec") or {}
        nonce = spec.get("restartNonce")
        nonce = nonce + 1 if isinstance(nonce, int) and not isinstance(nonce, bool) else 1
        patch = {
            "metadata": {"resourceVersion": metadata.get("resourceVersion")},
            "spec": {"restartNonce": nonce},
        }
        try:
            async with http.patch(path, data=json.dumps(patch), headers=MERGE_PATCH) as answer:
                if answer.status == 409:  # another write came first: re-read, bump again
                    async with http.get(path) as fresh:
                        fresh.raise_for_status()
                        current = await fresh.json()
                    continue
                answer.raise_for_status()
                written = await answer.json()
        except aiohttp.ClientError as err:
            if not stopped:  # the operator stopping closes the session under it
                logger.warning(f"bump failed, no verdict next cycle: {err}")
            return
        generation = written["metadata"]["generation"]
        track.bumped, track.answered_at = generation, now()
        # The watch may deliver the write's own event before its answer arrives.
        track.observed_at = track.answered_at if track.observed >= generation else None
        return
    logger.warning(f"{MAX_CONFLICTS + 1} conflicts in a row; no bump this cycle")


@kopf.on.probe(id="canaries")
async def canaries(**_: Any) -> int:
    """kopf's liveness endpoint: 500 while a canary's last bump was not observed in
    time (kopf caches probe results for 10 s), else 200 with the canaries tracked."""
    unhealthy = sum(not track.healthy for track in tracks.values())
    if unhealthy:
        raise kopf.PermanentError(f"{unhealthy} canaries unhealthy")
    return len(tracks)
