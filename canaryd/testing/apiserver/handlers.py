"""The HTTP API: requests parsed into Kubernetes terms, authenticated, authorized, faulted
and served; lists with selectors and pagination; discovery.

Each request is logged (``requests``, a ``RequestRecord`` each) for tests to assert on.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from canaryd.testing.apiserver.discovery import discovery
from canaryd.testing.apiserver.faults import (
    REASONS,
    SELF_SUBJECT_ACCESS_REVIEWS,
    Fault,
    RbacDeny,
    access_review,
    choose,
    choose_for_discovery,
    forbidden,
    meet,
)
from canaryd.testing.apiserver.resources import (
    LEASES,
    ApiError,
    Request,
    ResourceType,
    not_found,
    path_not_found,
    selector,
)
from canaryd.testing.apiserver.watch import Watches
from canaryd.testing.patches import PatchError, PatchTestFailed, json_patch, merge_patch


@dataclass
class RequestRecord:
    """One entry of the request log that tests count and inspect."""

    method: str
    path: str
    query: dict[str, str]
    verb: str
    resource: str | None
    namespace: str | None
    name: str | None
    subresource: str | None
    content_type: str | None
    body: Any
    status: int = 0
    at: float = 0.0
    """Loop time when the request arrived."""
    user: str = ""
    served_at: float | None = None
    """Loop time when it was served (a write: applied); None when it was not (a fault
    answered it, or its client went away first)."""
    ended_at: float | None = None
    """Loop time when its answer was sent or its client went away."""
    abandoned: bool = False
    """Its client went away before it was answered (a timeout, a cancelled request):
    the handler was cancelled, as kube-apiserver cancels the request's context, so a
    write not served by then is never applied."""


class HttpApi(Watches):
    """The store and its watches served over HTTP, as kube-apiserver serves them."""

    def __init__(self, *, token: str | None, user: str, **watches: Any) -> None:
        super().__init__(**watches)
        self.token = token
        self.user = user
        self.clients: dict[str, str] = {}
        """More bearer tokens and their users (several canaryd processes told apart)."""
        self.refused_certificates: set[str] = set()
        """Common names of client certificates answered 401 (expired, as kube-apiserver's
        x509 authenticator checks on every request, on connections made before too)."""
        self.faults: list[Fault] = []
        self.hooks: list[Callable[[Request], Fault | None]] = []
        """Asked, in order, for a fault when no entry of ``faults`` matches (seeded chaos)."""
        self.unavailable: Fault | None = None
        """Meets every request first, discovery and unknown paths included: a load
        balancer with no API server behind it (``Fault(code=503, page=...)``), or one
        that sheds everything (``Fault(code=429)``)."""
        self.pretty_errors = False
        """Indent Status bodies, as some proxies and older servers do."""
        self.rbac_denies: list[RbacDeny] = []
        self.requests: list[RequestRecord] = []
        self.keep_requests: int | None = None
        """Bound the request log to about this many entries (the oldest half goes)."""

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        record = RequestRecord(
            method=request.method,
            path=request.path,
            query=dict(request.query),
            verb="",
            resource=None,
            namespace=None,
            name=None,
            subresource=None,
            content_type=request.headers.get("Content-Type"),
            body=None,
            at=asyncio.get_running_loop().time(),
        )
        self.requests.append(record)
        if self.keep_requests is not None and len(self.requests) > self.keep_requests:
            del self.requests[: len(self.requests) // 2]
        try:
            raw = await request.read()
            if raw:
                try:
                    record.body = json.loads(raw)
                except ValueError:
                    record.body = raw.decode("utf-8", "replace")
            response = await self._dispatch(request, record, raw)
        except asyncio.CancelledError:
            # The client went away (handler_cancellation): kube-apiserver cancels the
            # request's context, and what has not reached storage is never applied.
            record.abandoned = True
            record.ended_at = asyncio.get_running_loop().time()
            self._notify()
            raise
        except ApiError as err:
            response = (
                web.Response(status=err.code, text=err.page)
                if err.page
                else web.json_response(
                    err.status(),
                    status=err.code,
                    headers=err.headers,
                    dumps=(lambda o: json.dumps(o, indent=2)) if self.pretty_errors else json.dumps,
                )
            )
        record.status = response.status
        record.ended_at = asyncio.get_running_loop().time()
        self._notify()
        return response

    async def _dispatch(
        self, request: web.Request, record: RequestRecord, raw: bytes
    ) -> web.StreamResponse:
        if self.unavailable is not None:
            answer = await meet(self.unavailable, request, Request(verb="", rtype=None))
            if answer is not None:
                return answer
        document = discovery(request.path, self.types)
        if document is not None:
            record.verb = "get"
            # Authenticated like every other path: kube-apiserver's WithAuthentication
            # filter (staging/src/k8s.io/apiserver/pkg/endpoints/filters/authentication.go)
            # answers 401 to a token it cannot authenticate before any handler runs.
            record.user = self._authenticate(request)
            # Fault(verb="discovery"): a discovery answer that fails (one API server
            # replica briefly not serving a group answers 404).
            fault = choose_for_discovery(self.faults, request.path)
            if fault is not None and fault.code:
                raise ApiError(fault.code, REASONS.get(fault.code, "Unknown"), fault.message)
            return web.json_response(document)
        if request.path.rstrip("/") == SELF_SUBJECT_ACCESS_REVIEWS:
            return await self._access_review(request, record, raw)
        req = self._parse(request)
        record.verb, record.namespace, record.name = req.verb, req.namespace, req.name
        record.subresource = req.subresource
        record.resource = req.rtype.plural if req.rtype else None
        req.user = record.user = self._authenticate(request)
        fault = choose(self.faults, self.hooks, req)
        if fault is not None:
            answer = await meet(fault, request, req)
            if answer is not None:
                return answer
        self._authorize(req)
        assert req.rtype is not None
        if req.verb == "watch":
            return await self._watch(request, req)
        result = self._serve(request, req, raw)
        record.served_at = asyncio.get_running_loop().time()
        if fault is not None and fault.delay_answer:
            await asyncio.sleep(fault.delay_answer)
        if fault is not None and fault.drop_answer:
            assert request.transport is not None
            request.transport.close()
            raise ApiError(500, "InternalError", "answer dropped after the request was served")
        created = req.verb == "create" or req.created
        return web.json_response(result, status=201 if created else 200)

    async def _access_review(
        self, request: web.Request, record: RequestRecord, raw: bytes
    ) -> web.StreamResponse:
        """POST a SelfSubjectAccessReview: may this client do what it describes? Any
        authenticated user may ask (the system:basic-user ClusterRole grants it).
        ``Fault(verb="access_review")`` fails it (an API server that does not answer)."""
        record.verb, record.resource = "create", "selfsubjectaccessreviews"
        record.user = self._authenticate(request)
        probe = Request(verb="access_review", rtype=None, user=record.user)
        fault = choose(self.faults, (), probe)
        if fault is not None and (answer := await meet(fault, request, probe)) is not None:
            return answer
        if request.method != "POST":
            raise ApiError(
                405,
                "MethodNotAllowed",
                "the server does not allow this method on the requested resource",
            )
        review = access_review(self.rbac_denies, self._json_body(raw))
        record.served_at = asyncio.get_running_loop().time()
        return web.json_response(review, status=201)

    def _authenticate(self, request: web.Request) -> str:
        """The request's user (the configured one when the fake takes any token)."""
        peer = request.transport.get_extra_info("peercert") if request.transport else None
        if peer and self.refused_certificates:
            names = {v for rdn in peer.get("subject", ()) for k, v in rdn if k == "commonName"}
            if names & self.refused_certificates:
                raise ApiError(401, "Unauthorized", "Unauthorized")
        header = request.headers.get("Authorization", "")
        token = header.removeprefix("Bearer ") if header.startswith("Bearer ") else None
        if token is not None and token in self.clients:
            return self.clients[token]
        if self.token is not None and token != self.token:
            raise ApiError(401, "Unauthorized", "Unauthorized")
        return self.user

    def _authorize(self, req: Request) -> None:
        if any(rule.matches(req) for rule in self.rbac_denies):
            raise forbidden(req, req.user or self.user)

    def _parse(self, request: web.Request) -> Request:
        parts = [p for p in request.path.split("/") if p]
        rest: list[str]
        if parts[:2] == ["api", "v1"]:
            group, rest = "", parts[2:]
        elif len(parts) >= 3 and parts[0] == "apis":
            group, version, rest = parts[1], parts[2], parts[3:]
            if not any(t.group == group and t.version == version for t in self.types.values()):
                raise path_not_found()
        else:
            raise path_not_found()
        namespace = None
        if len(rest) >= 3 and rest[0] == "namespaces":
            namespace, rest = rest[1], rest[2:]
        if not rest:
            raise path_not_found()
        rtype = self.types.get(rest[0])
        if rtype is None or rtype.group != group or len(rest) > 3:
            raise path_not_found()
        if namespace is not None and not rtype.namespaced:
            raise path_not_found()
        name = rest[1] if len(rest) > 1 else None
        subresource = rest[2] if len(rest) > 2 else None
        if subresource is not None and not (subresource == "status" and rtype.status_subresource):
            raise path_not_found()
        watching = request.query.get("watch", "").lower() in ("true", "1")
        method = request.method
        verb = {
            ("GET", False): "list" if name is None else "get",
            ("POST", False): "create",
            ("PUT", False): "update",
            ("PATCH", False): "patch",
            ("DELETE", False): "delete",
        }.get((method, False))
        if method == "GET" and watching and name is None:
            verb = "watch"
        if (
            verb is None
            or (verb == "create" and name is not None)
            or (verb in ("update", "patch", "delete") and name is None)
        ):
            raise ApiError(
                405,
                "MethodNotAllowed",
                "the server does not allow this method on the requested resource",
            )
        return Request(verb, rtype, namespace, name, subresource)

    def _serve(self, request: web.Request, req: Request, raw: bytes) -> dict[str, Any]:
        rtype = req.rtype
        assert rtype is not None
        if req.verb == "list":
            return self._list(req, request.query)
        if req.verb == "get":
            assert req.name is not None
            obj = self.get(rtype.plural, req.namespace, req.name)
            if obj is None:
                raise not_found(rtype, req.name)
            return obj
        body = self._json_body(raw) if req.verb != "delete" or raw else None
        if req.verb == "create":
            if not isinstance(body, dict):
                raise ApiError(400, "BadRequest", "the body of the request must be an object")
            return self.create(rtype, req.namespace, body)
        assert req.name is not None
        status_only = req.subresource == "status"
        if req.verb == "update":
            if not isinstance(body, dict):
                raise ApiError(400, "BadRequest", "the body of the request must be an object")
            if (body.get("metadata") or {}).get("name") not in (None, req.name):
                raise ApiError(
                    400, "BadRequest", "the name of the object does not match the name on the URL"
                )
            if rtype is LEASES and self.get(rtype.plural, req.namespace, req.name) is None:
                # leaseStrategy.AllowCreateOnUpdate: a PUT of a missing Lease creates it.
                req.created = True
                return self.create(rtype, req.namespace, body)
            return self.update(
                rtype,
                req.namespace,
                req.name,
                lambda _old: body,
                status_only=status_only,
                # Neither custom resources nor Leases allow unconditional updates.
                require_rv=rtype.custom or rtype is LEASES,
            )
        if req.verb == "patch":
            apply = self._patcher(rtype, request.headers.get("Content-Type", ""), body)
            return self.update(rtype, req.namespace, req.name, apply, status_only=status_only)
        preconditions = body.get("preconditions") if isinstance(body, dict) else None
        return self.delete(rtype, req.namespace, req.name, preconditions)

    @staticmethod
    def _json_body(raw: bytes) -> Any:
        try:
            return json.loads(raw)
        except ValueError as err:
            raise ApiError(400, "BadRequest", f"error decoding request body: {err}") from err

    @staticmethod
    def _patcher(
        rtype: ResourceType, content_type: str, body: Any
    ) -> Callable[[dict[str, Any]], dict[str, Any]]:
        media = content_type.split(";", 1)[0].strip().lower()
        # Patch type comes from Content-Type
        # (staging/src/k8s.io/apiserver/pkg/endpoints/handlers/patch.go, PatchResource);
        # custom resources do not support strategic merge
        # (apiextensions-apiserver/pkg/apiserver/customresource_handler.go: supportedTypes).
        supported = [
            "application/json-patch+json",
            "application/merge-patch+json",
            "application/apply-patch+yaml",
        ]
        if not rtype.custom:
            supported.append("application/strategic-merge-patch+json")
        if media not in supported or media == "application/apply-patch+yaml":
            raise ApiError(
                415,
                "UnsupportedMediaType",
                f"the body of the request was in an unknown format - accepted "
                f"media types include: {', '.join(supported)}",
            )

        def apply(current: dict[str, Any]) -> dict[str, Any]:
            # The patch is applied to the whole current object, its resourceVersion
            # included (patch.go: patcher.applyPatch), so a JSON patch may test it; the
            # result's resourceVersion is then the precondition (GuaranteedUpdate): the
            # current one unless the patch set another, so a patch without one never
            # conflicts.
            try:
                if media == "application/json-patch+json":
                    patched = json_patch(current, body)
                elif media == "application/merge-patch+json" or not isinstance(body, dict):
                    patched = merge_patch(current, body)
                else:
                    # Strategic merge on built-in types: a merge patch is a fair model
                    # for the fields canaryd and its tests touch (labels, annotations).
                    patched = merge_patch(current, body)
            except PatchError as err:
                raise ApiError(400, "BadRequest", str(err)) from err
            except PatchTestFailed as err:
                raise ApiError(422, "Invalid", str(err)) from err
            if not isinstance(patched, dict):
                raise ApiError(400, "BadRequest", "the patch must produce an object")
            return patched

        return apply

    def _list(self, req: Request, query: Any) -> dict[str, Any]:
        rtype = req.rtype
        assert rtype is not None
        matches = selector(query)
        try:
            limit = int(query.get("limit") or 0)
        except ValueError as err:
            raise ApiError(400, "BadRequest", f"invalid limit: {query.get('limit')}") from err
        token = query.get("continue")
        if token:
            # A continued list reads the first page's snapshot (etcd's revision); once
            # compacted it is 410 Expired (storage/etcd3/store.go, GetList).
            found = self._continues.pop(token, None)
            if found is None:
                raise ApiError(
                    410,
                    "Expired",
                    "The provided continue parameter is too old to display a consistent "
                    "list result. You can start a new list without the continue parameter.",
                )
            rv, items = found
        else:
            rv = self.rv
            items = [
                copy.deepcopy(obj)
                for (ns, _), obj in sorted(self.objects[rtype.plural].items())
                if (req.namespace is None or ns == req.namespace) and matches(obj)
            ]
        metadata: dict[str, Any] = {"resourceVersion": str(rv)}
        if limit > 0 and len(items) > limit:
            items, rest = items[:limit], items[limit:]
            token = f"{rv}-{len(self._continues)}-{id(rest):x}"
            self._continues[token] = (rv, rest)
            metadata["continue"] = token
            metadata["remainingItemCount"] = len(rest)
        return {
            "apiVersion": rtype.api_version,
            "kind": f"{rtype.kind}List",
            "metadata": metadata,
            "items": items,
        }
