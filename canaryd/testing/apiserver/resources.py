"""What the fake serves and how it says no: resource types, ``Status`` errors, requests.

The bottom of the package: it imports nothing from it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from canaryd.testing.selectors import SelectorError, parse_field_selector, parse_label_selector

FLINK_GROUP = "flink.apache.org"
FLINK_VERSION = "v1beta1"


@dataclass(frozen=True)
class ResourceType:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    custom: bool
    status_subresource: bool

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def group_resource(self) -> str:
        """``flinkdeployments.flink.apache.org``: how kube-apiserver names it in messages."""
        return f"{self.plural}.{self.group}" if self.group else self.plural


NAMESPACES = ResourceType("", "v1", "namespaces", "Namespace", False, False, False)
FLINK_DEPLOYMENTS = ResourceType(
    FLINK_GROUP, FLINK_VERSION, "flinkdeployments", "FlinkDeployment", True, True, True
)
FLINK_SESSION_JOBS = ResourceType(
    FLINK_GROUP, FLINK_VERSION, "flinksessionjobs", "FlinkSessionJob", True, True, True
)
FLINK_TYPES = (FLINK_DEPLOYMENTS, FLINK_SESSION_JOBS)
# A built-in type: no generation, no status (pkg/registry/coordination/lease/strategy.go:
# AllowUnconditionalUpdate false, AllowCreateOnUpdate true).
LEASES = ResourceType("coordination.k8s.io", "v1", "leases", "Lease", True, False, False)
# What canaryd reads of them: whether the operator's exists (the admission policy's).
SERVICE_ACCOUNTS = ResourceType("", "v1", "serviceaccounts", "ServiceAccount", True, False, False)
# events.k8s.io/v1 Events: built-in, namespaced, updated unconditionally
# (pkg/registry/core/event/strategy.go: AllowUnconditionalUpdate true).
EVENTS = ResourceType("events.k8s.io", "v1", "events", "Event", True, False, False)


class ApiError(Exception):
    """Becomes a ``Status`` response, the shape of every kube-apiserver error
    (staging/src/k8s.io/apimachinery/pkg/api/errors/errors.go)."""

    def __init__(
        self,
        code: int,
        reason: str,
        message: str,
        *,
        details: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        page: str | None = None,
    ) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message
        self.details = details
        self.headers = headers or {}
        self.page = page
        """Answered as this plain text instead of a Status."""

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details is not None:
            body["details"] = self.details
        return body


def status_details(rtype: ResourceType, name: str | None) -> dict[str, Any]:
    details: dict[str, Any] = {"group": rtype.group, "kind": rtype.plural}
    if name:
        details["name"] = name
    return details


def not_found(rtype: ResourceType, name: str) -> ApiError:
    return ApiError(
        404,
        "NotFound",
        f'{rtype.group_resource} "{name}" not found',
        details=status_details(rtype, name),
    )


def conflict(rtype: ResourceType, name: str) -> ApiError:
    # errors.NewConflict with storage.ErrCodeResourceVersionConflicts' message
    # (staging/src/k8s.io/apiserver/pkg/registry/generic/registry/store.go).
    return ApiError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {rtype.group_resource} "{name}": the object has '
        "been modified; please apply your changes to the latest version and try again",
        details=status_details(rtype, name),
    )


def path_not_found() -> ApiError:
    """A group, version or resource not served: kube-apiserver's mux answers Go's
    http.NotFound, not a Status (v1.35.4: discovery of /apis/GROUP/VERSION, a list)."""
    return ApiError(404, "NotFound", "404 page not found", page="404 page not found\n")


@dataclass
class Request:
    """What a request means in Kubernetes terms, parsed once from its path."""

    verb: str
    rtype: ResourceType | None
    namespace: str | None = None
    name: str | None = None
    subresource: str | None = None
    user: str = ""
    """Who sent it (by its bearer token); empty when the fake takes any."""
    created: bool = False
    """The request created an object (a POST, or a PUT that creates: 201)."""


def selector(query: Any) -> Callable[[dict[str, Any]], bool]:
    """The objects a list or watch selects by its ``labelSelector`` and ``fieldSelector``."""
    try:
        labels = parse_label_selector(query.get("labelSelector"))
        fields = parse_field_selector(query.get("fieldSelector"))
    except SelectorError as err:
        raise ApiError(400, "BadRequest", f"unable to parse requirement: {err}") from err

    def matches(obj: dict[str, Any]) -> bool:
        return labels(_labels(obj)) and fields(obj.get("metadata") or {})

    return matches


def _labels(obj: dict[str, Any]) -> dict[str, str]:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return labels if isinstance(labels, dict) else {}
