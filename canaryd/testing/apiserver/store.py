"""The cluster state: objects by type, one resourceVersion counter, the history of changes.

kube-apiserver's storage as canaryd meets it (etcd behind the generic registry store):
every write goes through ``_commit``, which sets the next resourceVersion, keeps the
change in the history until compaction, and hands it to the watches (``_deliver``,
watch.py). What a write becomes is strategy.py's.
"""

from __future__ import annotations

import abc
import asyncio
import copy
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from canaryd.testing.apiserver.resources import (
    EVENTS,
    LEASES,
    NAMESPACES,
    SERVICE_ACCOUNTS,
    ApiError,
    ResourceType,
    conflict,
    not_found,
    status_details,
)
from canaryd.testing.apiserver.strategy import (
    now,
    prepare_for_create,
    prepare_for_update,
    same_json,
)


@dataclass
class Change:
    """One committed write, as the watch history keeps it."""

    rv: int
    rtype: ResourceType
    type: str  # ADDED, MODIFIED, DELETED
    old: dict[str, Any] | None
    new: dict[str, Any]


class Store(abc.ABC):
    """The objects and their history, written with kube-apiserver's rules (no HTTP).

    Every committed change goes to ``_deliver``, which the watch layer implements."""

    def __init__(
        self,
        *,
        crds: Iterable[ResourceType],
        history_limit: int,
        auto_finalize_namespaces: bool,
    ) -> None:
        self.types: dict[str, ResourceType] = {
            t.plural: t for t in (NAMESPACES, LEASES, SERVICE_ACCOUNTS, EVENTS)
        }
        self.types.update({t.plural: t for t in crds})
        self.history_limit = history_limit
        self.auto_finalize_namespaces = auto_finalize_namespaces
        self.objects: dict[str, dict[tuple[str, str], dict[str, Any]]] = {
            plural: {} for plural in self.types
        }
        self.rv = 0
        self.history: deque[Change] = deque()
        self.compacted_rv = 0
        self._continues: dict[str, tuple[int, list[dict[str, Any]]]] = {}
        """Paginated lists in progress: continue token -> (snapshot rv, items left)."""
        self._background: set[asyncio.Task[None]] = set()
        self._waiters: list[tuple[Callable[[], bool], asyncio.Future[None]]] = []
        self.listeners: list[Callable[[], None]] = []
        """Called after every request, write, and watch start or end."""

    # ------------------------------------------------------ waiting on changes

    async def wait_for(
        self, predicate: Callable[[], bool], *, within: float = 5.0, what: str = ""
    ) -> None:
        """Wait until ``predicate()`` holds; it is re-checked after every request, write
        and watch start or end. Fails with a clear message after ``within`` seconds."""
        if predicate():
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (predicate, future)
        self._waiters.append(entry)
        try:
            async with asyncio.timeout(within):
                await future
        except TimeoutError:
            raise AssertionError(
                f"fake API server: still waiting after {within}s for {what or predicate}"
            ) from None
        finally:
            self._waiters.remove(entry)

    def _notify(self) -> None:
        for listener in list(self.listeners):
            listener()
        for predicate, future in self._waiters:
            if not future.done() and predicate():
                future.set_result(None)

    def compact(self) -> None:
        """Forget the history: a watch from an older resourceVersion gets 410 Expired, and
        so does a list continued from an older snapshot."""
        self.compacted_rv = self.rv
        self.history.clear()
        self._continues.clear()

    # ------------------------------------------- direct state access (no HTTP)

    def create_namespace(self, name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
        body = {"metadata": {"name": name, "labels": labels or {}}}
        return self.create(NAMESPACES, None, body)

    def get(self, plural: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        obj = self.objects[plural].get((namespace or "", name))
        return copy.deepcopy(obj) if obj is not None else None

    def create(
        self, rtype: ResourceType, namespace: str | None, body: dict[str, Any]
    ) -> dict[str, Any]:
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if not isinstance(meta, dict) or not meta.get("name"):
            raise ApiError(
                422, "Invalid", f"{rtype.kind} is invalid: metadata.name: Required value"
            )
        name = meta["name"]
        if rtype.namespaced:
            namespace = namespace or meta.get("namespace") or "default"
            if meta.get("namespace") not in (None, namespace):
                raise ApiError(
                    400,
                    "BadRequest",
                    "the namespace of the provided object does "
                    "not match the namespace sent on the request",
                )
            self._check_namespace_accepts(namespace)
        key = (namespace or "", name)
        if key in self.objects[rtype.plural]:
            raise ApiError(
                409,
                "AlreadyExists",
                f'{rtype.group_resource} "{name}" already exists',
                details=status_details(rtype, name),
            )
        prepare_for_create(rtype, obj, namespace)
        self._commit(rtype, key, "ADDED", None, obj)
        return copy.deepcopy(obj)

    def update(
        self,
        rtype: ResourceType,
        namespace: str | None,
        name: str,
        mutate: Callable[[dict[str, Any]], dict[str, Any]],
        *,
        status_only: bool = False,
        require_rv: bool = False,
    ) -> dict[str, Any]:
        """Apply ``mutate`` to a copy of the stored object with the update strategy's rules."""
        key = (namespace or "", name)
        current = self.objects[rtype.plural].get(key)
        if current is None:
            raise not_found(rtype, name)
        proposed = mutate(copy.deepcopy(current))
        if not isinstance(proposed, dict):
            raise ApiError(400, "BadRequest", "the body must be a JSON object")
        meta = proposed.get("metadata")
        if not isinstance(meta, dict):
            meta = proposed["metadata"] = {}
        sent_rv = meta.get("resourceVersion")
        if require_rv and not sent_rv:
            # Custom resources do not allow unconditional updates
            # (customResourceStrategy.AllowUnconditionalUpdate returns false).
            raise ApiError(
                422,
                "Invalid",
                f'{rtype.kind}.{rtype.group} "{name}" is invalid: '
                "metadata.resourceVersion: Invalid value: 0x0: must be specified "
                "for an update",
            )
        # A sent resourceVersion is a precondition: GuaranteedUpdate refuses a stale one
        # (staging/src/k8s.io/apiserver/pkg/registry/generic/registry/store.go, Update).
        if sent_rv and str(sent_rv) != current["metadata"]["resourceVersion"]:
            raise conflict(rtype, name)
        new = prepare_for_update(rtype, current, proposed, status_only)
        if same_json(new, current):
            # A no-op write stores nothing, keeps the resourceVersion and emits no
            # event (staging/src/k8s.io/apiserver/pkg/storage/etcd3/store.go,
            # GuaranteedUpdate: "if !origState.stale && bytes.Equal(data, origState.data)").
            return copy.deepcopy(current)
        finalizing = new["metadata"].get("deletionTimestamp") and not new["metadata"].get(
            "finalizers"
        )
        if finalizing:
            # Once deletionTimestamp is set, removing the last finalizer deletes the
            # object (store.go, Update → deleteWithoutFinalizers / shouldDeleteDuringUpdate).
            self._commit(rtype, key, "DELETED", current, new)
        else:
            self._commit(rtype, key, "MODIFIED", current, new)
        return copy.deepcopy(new)

    def delete(
        self,
        rtype: ResourceType,
        namespace: str | None,
        name: str,
        preconditions: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        key = (namespace or "", name)
        current = self.objects[rtype.plural].get(key)
        if current is None:
            raise not_found(rtype, name)
        meta = current["metadata"]
        if preconditions:
            for field_name in ("uid", "resourceVersion"):
                expected = preconditions.get(field_name)
                if expected and expected != meta.get(field_name):
                    raise ApiError(
                        409,
                        "Conflict",
                        f"Precondition failed: {field_name}: {expected}, "
                        f"ObjectMeta.{field_name[0].upper() + field_name[1:]}: "
                        f"{meta.get(field_name)}",
                        details=status_details(rtype, name),
                    )
        if rtype is NAMESPACES:
            return self._delete_namespace(current)
        if meta.get("finalizers"):
            # Graceful deletion with finalizers: set deletionTimestamp, keep the object
            # (store.go, Delete → updateForGracefulDeletionAndFinalizers).
            if meta.get("deletionTimestamp"):
                return copy.deepcopy(current)
            new = copy.deepcopy(current)
            new["metadata"].update(deletionTimestamp=now(), deletionGracePeriodSeconds=0)
            self._commit(rtype, key, "MODIFIED", current, new)
            return copy.deepcopy(new)
        self._commit(rtype, key, "DELETED", current, copy.deepcopy(current))
        return copy.deepcopy(current)

    def _delete_namespace(self, current: dict[str, Any]) -> dict[str, Any]:
        # A namespace goes Terminating first; the namespace controller deletes its
        # content and then removes the "kubernetes" finalizer
        # (pkg/registry/core/namespace/storage/storage.go, Delete;
        # pkg/controller/namespace/deletion/namespaced_resources_deleter.go).
        name = current["metadata"]["name"]
        if current["metadata"].get("deletionTimestamp"):
            return copy.deepcopy(current)
        new = copy.deepcopy(current)
        new["metadata"].update(deletionTimestamp=now(), deletionGracePeriodSeconds=0)
        new["status"] = {"phase": "Terminating"}
        self._commit(NAMESPACES, ("", name), "MODIFIED", current, new)
        if self.auto_finalize_namespaces:
            task = asyncio.get_running_loop().create_task(self._finalize_soon(name))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        return copy.deepcopy(new)

    async def _finalize_soon(self, name: str) -> None:
        await asyncio.sleep(0)  # let the Terminating event reach the watches first
        self.finalize_namespace(name)

    def finalize_namespace(self, name: str) -> None:
        """Run the namespace controller once: delete the content of a terminating namespace."""
        ns = self.objects["namespaces"].get(("", name))
        if ns is None or not ns["metadata"].get("deletionTimestamp"):
            return
        for rtype in self.types.values():
            if not rtype.namespaced:
                continue
            for obj_ns, obj_name in sorted(self.objects[rtype.plural]):
                if obj_ns == name:
                    self.delete(rtype, obj_ns, obj_name)
        self._maybe_finish_namespace(NAMESPACES, ns)  # already empty: nothing deleted above

    def _maybe_finish_namespace(self, rtype: ResourceType, obj: dict[str, Any]) -> None:
        """Delete a terminating namespace once nothing is left in it."""
        if rtype is NAMESPACES:
            name = obj["metadata"]["name"]
        elif rtype.namespaced:
            name = obj["metadata"]["namespace"]
        else:
            return
        ns = self.objects["namespaces"].get(("", name))
        if ns is None or not ns["metadata"].get("deletionTimestamp"):
            return
        if any(
            key[0] == name
            for t in self.types.values()
            if t.namespaced
            for key in self.objects[t.plural]
        ):
            return
        final = copy.deepcopy(ns)
        final["spec"] = {"finalizers": []}
        self._commit(NAMESPACES, ("", name), "DELETED", ns, final)

    def _check_namespace_accepts(self, namespace: str) -> None:
        # NamespaceLifecycle admission (plugin/pkg/admission/namespace/lifecycle/admission.go).
        ns = self.objects["namespaces"].get(("", namespace))
        if ns is None:
            raise ApiError(
                404,
                "NotFound",
                f'namespaces "{namespace}" not found',
                details={"name": namespace, "kind": "namespaces"},
            )
        if ns["metadata"].get("deletionTimestamp"):
            raise ApiError(
                403,
                "Forbidden",
                f"unable to create new content in namespace {namespace} because it is "
                "being terminated",
                details={
                    "name": namespace,
                    "kind": "namespaces",
                    "causes": [
                        {
                            "reason": "NamespaceTerminating",
                            "message": f"namespace {namespace} is being terminated",
                            "field": "metadata.namespace",
                        }
                    ],
                },
            )

    def _commit(
        self,
        rtype: ResourceType,
        key: tuple[str, str],
        event: str,
        old: dict[str, Any] | None,
        new: dict[str, Any],
    ) -> None:
        # One global, increasing resourceVersion, set by every write, sent as a string
        # (etcd's revision; staging/src/k8s.io/apiserver/pkg/storage/etcd3/store.go).
        self.rv += 1
        new["metadata"]["resourceVersion"] = str(self.rv)
        if event == "DELETED":
            self.objects[rtype.plural].pop(key, None)
        else:
            self.objects[rtype.plural][key] = new
        change = Change(
            self.rv, rtype, event, copy.deepcopy(old) if old else None, copy.deepcopy(new)
        )
        self.history.append(change)
        while len(self.history) > self.history_limit:
            self.compacted_rv = self.history.popleft().rv
        self._deliver(change)
        if event == "DELETED" and rtype.namespaced:
            self._maybe_finish_namespace(rtype, new)
        self._notify()

    @abc.abstractmethod
    def _deliver(self, change: Change) -> None:
        """Hand a committed change to the watches (the watch layer, watch.py)."""
