"""Discovery: ``/version``, ``/api``, ``/apis`` and each group version's resource list.

What kubernetes-asyncio and kubectl read before they call a resource's path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from canaryd.testing.apiserver.resources import NAMESPACES, ResourceType


def discovery(path: str, types: Mapping[str, ResourceType]) -> dict[str, Any] | None:
    """The discovery document at ``path`` for the served ``types``; None: not a
    discovery path."""
    path = path.rstrip("/") or "/"
    if path == "/version":
        # The fields of version.Info (staging/src/k8s.io/apimachinery/pkg/version/types.go).
        return {
            "major": "1",
            "minor": "34",
            "gitVersion": "v1.34.0-fake",
            "gitCommit": "0000000000000000000000000000000000000000",
            "gitTreeState": "clean",
            "buildDate": "2026-01-01T00:00:00Z",
            "goVersion": "go1.24.0",
            "compiler": "gc",
            "platform": "linux/amd64",
        }
    if path == "/api":
        return {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []}
    custom = [t for t in types.values() if t.custom]
    groups = sorted({t.group for t in custom})
    if path == "/apis":
        return {
            "kind": "APIGroupList",
            "apiVersion": "v1",
            "groups": [_group(g, types) for g in groups],
        }
    for group in groups:
        if path == f"/apis/{group}":
            return {"kind": "APIGroup", "apiVersion": "v1", **_group(group, types)}
    if path == "/api/v1":
        return _resource_list("v1", [NAMESPACES])
    for group in groups:
        version = next(t.version for t in custom if t.group == group)
        if path == f"/apis/{group}/{version}":
            return _resource_list(f"{group}/{version}", [t for t in custom if t.group == group])
    return None


def _group(group: str, types: Mapping[str, ResourceType]) -> dict[str, Any]:
    version = next(t.version for t in types.values() if t.group == group)
    gv = {"groupVersion": f"{group}/{version}", "version": version}
    return {"name": group, "versions": [gv], "preferredVersion": gv}


def _resource_list(group_version: str, types: list[ResourceType]) -> dict[str, Any]:
    verbs = ["delete", "deletecollection", "get", "list", "patch", "create", "update", "watch"]
    resources: list[dict[str, Any]] = []
    for t in types:
        resources.append(
            {
                "name": t.plural,
                "singularName": t.kind.lower(),
                "namespaced": t.namespaced,
                "kind": t.kind,
                "verbs": verbs,
            }
        )
        if t.status_subresource:
            resources.append(
                {
                    "name": f"{t.plural}/status",
                    "singularName": "",
                    "namespaced": t.namespaced,
                    "kind": t.kind,
                    "verbs": ["get", "patch", "update"],
                }
            )
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": group_version,
        "resources": resources,
    }
