"""What a write becomes before it is stored: kube-apiserver's strategies.

The rules of the registry strategies (``PrepareForCreate``, ``PrepareForUpdate`` and the
metadata validation that goes with them) as pure functions of the objects; the store
applies them and commits the result.
"""

from __future__ import annotations

import copy
import json
import re
import uuid
from datetime import UTC, datetime
from typing import Any

from canaryd.testing.apiserver.resources import EVENTS, NAMESPACES, ApiError, ResourceType


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def same_json(a: Any, b: Any) -> bool:
    """Equal as JSON, as the server compares them: Python's ``True == 1 == 1.0`` is not
    (the stored bytes and apiequality.Semantic.DeepEqual on decoded JSON tell them
    apart)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def _without_metadata(obj: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in ("metadata", "apiVersion", "kind")}


def prepare_for_create(rtype: ResourceType, obj: dict[str, Any], namespace: str | None) -> None:
    """Set what the server owns on a new object ``obj``, in place."""
    meta = obj["metadata"]
    obj["apiVersion"], obj["kind"] = rtype.api_version, rtype.kind
    meta.update(uid=str(uuid.uuid4()), creationTimestamp=now())
    for server_owned in ("deletionTimestamp", "deletionGracePeriodSeconds"):
        meta.pop(server_owned, None)
    if rtype.namespaced:
        meta["namespace"] = namespace
    if rtype.custom:
        # customResourceStrategy.PrepareForCreate: generation starts at 1 and, with
        # the status subresource, status is dropped
        # (staging/src/k8s.io/apiextensions-apiserver/pkg/registry/customresource/strategy.go).
        meta["generation"] = 1
        if rtype.status_subresource:
            obj.pop("status", None)
    if rtype is EVENTS:
        validate_event(obj)
    if rtype is NAMESPACES:
        # pkg/registry/core/namespace/strategy.go PrepareForCreate: phase Active,
        # the "kubernetes" finalizer that the namespace controller removes.
        obj["spec"] = {"finalizers": ["kubernetes"]}
        obj["status"] = {"phase": "Active"}


def prepare_for_update(
    rtype: ResourceType,
    current: dict[str, Any],
    proposed: dict[str, Any],
    status_only: bool,
) -> dict[str, Any]:
    """The object an update of ``current`` to ``proposed`` stores (its resourceVersion
    still the current one: the commit sets the new one)."""
    old_meta = current["metadata"]
    if status_only:
        # statusStrategy.PrepareForUpdate: a /status write changes only status
        # (customresource/status_strategy.go); generation never moves.
        new = copy.deepcopy(current)
        if "status" in proposed:
            new["status"] = proposed["status"]
        else:
            new.pop("status", None)
    else:
        new = proposed
        new["apiVersion"], new["kind"] = rtype.api_version, rtype.kind
        if rtype.status_subresource:
            # With the status subresource the main endpoint cannot set status
            # (customresource/strategy.go, PrepareForUpdate).
            if "status" in current:
                new["status"] = copy.deepcopy(current["status"])
            else:
                new.pop("status", None)
    meta = new["metadata"]
    # Fields the server owns (ObjectMetaUpdateValidation keeps them immutable).
    for owned in (
        "name",
        "namespace",
        "uid",
        "creationTimestamp",
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
    ):
        if owned in old_meta:
            meta[owned] = old_meta[owned]
        else:
            meta.pop(owned, None)
    if old_meta.get("deletionTimestamp") and not status_only:
        # Finalizers can only be removed once deletion started, never added back
        # (ValidateObjectMetaUpdate: "no new finalizers can be added if the object
        # is being deleted").
        added = set(meta.get("finalizers") or []) - set(old_meta.get("finalizers") or [])
        if added:
            raise ApiError(
                422,
                "Invalid",
                f'{rtype.kind} "{meta["name"]}" is invalid: '
                "metadata.finalizers: Forbidden: no new finalizers can be "
                f"added if the object is being deleted, found new finalizers "
                f"{sorted(added)}",
            )
    meta["resourceVersion"] = old_meta["resourceVersion"]
    if rtype is EVENTS:
        validate_event(new, current)
    if rtype.custom:
        # Any change outside metadata bumps generation (strategy.go, PrepareForUpdate:
        # copyNonMetadata + apiequality.Semantic.DeepEqual); metadata-only writes never do.
        meta["generation"] = old_meta.get("generation", 1)
        if not status_only and not same_json(_without_metadata(new), _without_metadata(current)):
            meta["generation"] += 1
    return new


IMMUTABLE_EVENT_FIELDS = (
    "regarding",
    "related",
    "reason",
    "note",
    "type",
    "action",
    "reportingController",
    "reportingInstance",
    "eventTime",
)


def validate_event(event: dict[str, Any], current: dict[str, Any] | None = None) -> None:
    """What kube-apiserver requires of an events.k8s.io/v1 Event on create and, with
    ``current``, on update: all but the series is immutable then
    (pkg/apis/core/validation/events.go: ValidateEventCreate, ValidateEventUpdate,
    legacyValidateEvent, validateV1EventSeries)."""
    errors = [
        f"{name}: Invalid value: field is immutable"
        for name in IMMUTABLE_EVENT_FIELDS
        if current is not None and event.get(name) != current.get(name)
    ]
    errors += [
        f"{name}: Required value"
        for name in ("eventTime", "reportingController", "reportingInstance", "action", "reason")
        if not event.get(name)
    ]
    name = str(event["metadata"].get("name"))  # ValidateObjectMeta: NameIsDNSSubdomain
    if len(name) > 253:
        errors.append(
            f'metadata.name: Invalid value: "{name}": must be no more than 253 characters'
        )
    elif not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*", name):
        errors.append(f'metadata.name: Invalid value: "{name}": a lowercase RFC 1123 subdomain')
    if event.get("type") not in ("Normal", "Warning"):
        errors.append(f'type: Invalid value: "": has invalid value: {event.get("type")}')
    if len(str(event.get("note") or "")) > 1024:
        errors.append("note: Too long: may not be more than 1024 bytes")
    regarding = event.get("regarding") or {}
    namespace = event["metadata"].get("namespace")
    if regarding.get("namespace") and regarding["namespace"] != namespace:
        errors.append(
            f'regarding.namespace: Invalid value: "{regarding["namespace"]}": does not '
            "match event.namespace"
        )
    series = event.get("series")
    if series is not None:
        count = series.get("count") if isinstance(series, dict) else None
        if not isinstance(count, int) or count < 2:
            errors.append(f"series.count: Invalid value: {count}: should be at least 2")
        if not isinstance(series, dict) or not series.get("lastObservedTime"):
            errors.append("series.lastObservedTime: Required value")
    if errors:
        raise ApiError(
            422, "Invalid", f'Event.events.k8s.io "{name}" is invalid: [{", ".join(errors)}]'
        )
