"""Injected failures: Status codes, dropped connections, latency, empty watches, 403s
(and SelfSubjectAccessReviews answered as those 403s decide).

Tests and the soak inject them (``FakeKube.inject``, ``FakeKube.deny``, ``FakeKube.hooks``);
the HTTP layer (handlers.py) asks here what each request meets before it is served.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from canaryd.testing.apiserver.resources import ApiError, Request, status_details

# Reasons of the statuses fault injection can return (errors.go, reasonForCode).
REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    409: "Conflict",
    410: "Expired",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


@dataclass
class Fault:
    """Makes the next ``times`` matching requests fail (``times=-1``: until removed).

    ``code`` answers with that Status code (``retry_after`` adds the header);
    ``drop`` closes the connection without an answer; ``latency`` delays the
    request, then it fails with ``code`` or, with ``code=0``, is served normally (a
    client that gives up meanwhile cancels it: it is never served, as in
    kube-apiserver a write whose client went away before it reached storage);
    ``empty_watch`` answers a watch 200 and ends the stream at once, with no event
    (a proxy or load balancer in front of the API server that does so);
    ``delay_answer`` serves the request, then holds its answer that long (the write's
    watch event reaches watchers first, as it often does on a real server);
    ``drop_answer`` serves the request (a write: applied), then closes the connection
    before any byte of the answer (a proxy or load balancer reset between the two): the
    client cannot tell whether it was applied.
    ``page`` answers ``code`` with this text instead of a Status: a gateway or load
    balancer in front of the API server (Envoy's 503 ``no healthy upstream``).
    ``action`` runs first: a concurrent writer that wins the race against this request
    (e.g. ``lambda: kube.update(...)``), so a stale precondition gets a real 409.
    """

    verb: str | None = None
    resource: str | None = None
    namespace: str | None = None
    name: str | None = None
    user: str | None = None
    """Only this client's requests (its user, by bearer token: ``FakeKube.add_client``)."""
    code: int = 500
    times: int = 1
    retry_after: int | None = None
    drop: bool = False
    empty_watch: bool = False
    delay_answer: float = 0.0
    drop_answer: bool = False
    page: str | None = None
    latency: float = 0.0
    message: str = "fault injected by the fake API server"
    action: Callable[[], object] | None = None
    path: str | None = None
    """Only requests to this path (``verb="discovery"``: one group version's, e.g.
    ``/apis/example.com/v1``)."""
    hits: int = 0

    def matches(self, req: Request) -> bool:
        return (
            self.times != 0
            and (self.verb is None or self.verb == req.verb)
            and (
                self.resource is None
                or (req.rtype is not None and req.rtype.plural == self.resource)
            )
            and (self.namespace is None or self.namespace == req.namespace)
            and (self.name is None or self.name == req.name)
            and (self.user is None or self.user == req.user)
        )

    def count_hit(self) -> None:
        self.hits += 1
        if self.times > 0:
            self.times -= 1


@dataclass
class RbacDeny:
    """A missing permission: requests matching every set field get 403 Forbidden."""

    verb: str | None = None
    resource: str | None = None
    namespace: str | None = None

    def matches(self, req: Request) -> bool:
        return self.denies(req.verb, req.rtype.plural if req.rtype else None, req.namespace)

    def denies(self, verb: str, resource: str | None, namespace: str | None) -> bool:
        """Does this rule deny ``verb`` on ``resource`` in ``namespace`` (None: at the
        cluster scope)? The same answer for a request and for an access review of it."""
        return (
            (self.verb is None or self.verb == verb)
            and (self.resource is None or (resource is not None and resource == self.resource))
            and (self.namespace is None or self.namespace == namespace)
        )


SELF_SUBJECT_ACCESS_REVIEWS = "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"


def access_review(denies: Iterable[RbacDeny], body: Any) -> dict[str, Any]:
    """kube-apiserver's answer to a SelfSubjectAccessReview (authorization.k8s.io/v1,
    pkg/registry/authorization/selfsubjectaccessreview/rest.go): the spec echoed, and
    ``status.allowed`` as the authorizer would decide the request it describes; here,
    false when an ``RbacDeny`` denies it (the RBAC authorizer gives no reason for a
    denial: it has no opinion, and the union of authorizers denies)."""
    spec = body.get("spec") if isinstance(body, dict) else None
    attributes = spec.get("resourceAttributes") if isinstance(spec, dict) else None
    if not isinstance(attributes, dict):
        # validation.ValidateSelfSubjectAccessReview: exactly one of the two attribute sets.
        raise ApiError(
            422,
            "Invalid",
            'SelfSubjectAccessReview.authorization.k8s.io "" is invalid: '
            "spec.resourceAttributes: Invalid value: null: exactly one of "
            "nonResourceAttributes or resourceAttributes must be specified",
        )
    verb = str(attributes.get("verb") or "")
    resource = str(attributes.get("resource") or "") or None
    namespace = str(attributes.get("namespace") or "") or None
    denied = any(rule.denies(verb, resource, namespace) for rule in denies)
    status: dict[str, Any] = {"allowed": not denied}
    if not denied:
        status["reason"] = "allowed: no RbacDeny of the fake API server matches"
    return {
        "kind": "SelfSubjectAccessReview",
        "apiVersion": "authorization.k8s.io/v1",
        "metadata": {"creationTimestamp": None},
        "spec": spec,
        "status": status,
    }


def choose(
    faults: Iterable[Fault], hooks: Iterable[Callable[[Request], Fault | None]], req: Request
) -> Fault | None:
    """The fault ``req`` meets, counted: the first of ``faults`` that matches, else the
    first a hook returns."""
    fault = next((f for f in faults if f.matches(req)), None)
    for hook in hooks:
        if fault is not None:
            break
        fault = hook(req)
    if fault is not None:
        fault.count_hit()
    return fault


def choose_for_discovery(faults: Iterable[Fault], path: str) -> Fault | None:
    """The ``Fault(verb="discovery")`` a discovery answer meets, counted."""
    probe = Request(verb="discovery", rtype=None)
    fault = next(
        (
            f
            for f in faults
            if f.verb == "discovery" and f.matches(probe) and f.path in (None, path.rstrip("/"))
        ),
        None,
    )
    if fault is not None:
        fault.count_hit()
    return fault


async def meet(fault: Fault, request: web.Request, req: Request) -> web.StreamResponse | None:
    """Do what ``fault`` says before ``req`` is served: raise its Status, or return the
    answer that ends the request; None: serve it (after the latency)."""
    if fault.action is not None:
        fault.action()
    if fault.latency:
        await asyncio.sleep(fault.latency)
    if fault.drop:
        assert request.transport is not None
        request.transport.close()
        raise ApiError(500, "InternalError", "connection dropped")
    if fault.empty_watch and req.verb == "watch":
        empty = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        empty.enable_chunked_encoding()
        await empty.prepare(request)
        await empty.write_eof()
        return empty
    headers = {"Retry-After": str(fault.retry_after)} if fault.retry_after is not None else {}
    if fault.page is not None:
        return web.Response(status=fault.code, text=fault.page, headers=headers)
    if fault.code:
        raise ApiError(
            fault.code, REASONS.get(fault.code, "Unknown"), fault.message, headers=headers
        )
    return None


def forbidden(req: Request, user: str) -> ApiError:
    """The RBAC authorizer's denial
    (staging/src/k8s.io/apiserver/pkg/endpoints/handlers/responsewriters/errors.go,
    forbiddenMessage)."""
    assert req.rtype is not None
    resource = req.rtype.group_resource
    if req.name:
        resource = f'{resource} "{req.name}"'
    scope = f'in the namespace "{req.namespace}"' if req.namespace else "at the cluster scope"
    return ApiError(
        403,
        "Forbidden",
        f'{resource} is forbidden: User "{user}" cannot {req.verb} resource '
        f'"{req.rtype.plural}" in API group "{req.rtype.group}" {scope}',
        details=status_details(req.rtype, req.name),
    )
