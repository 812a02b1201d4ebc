"""JSON merge patch (RFC 7386) and JSON patch (RFC 6902), as kube-apiserver applies them.

kube-apiserver uses evanphx/json-patch for both
(staging/src/k8s.io/apiserver/pkg/endpoints/handlers/patch.go, ``applyJSPatch``).
"""

from __future__ import annotations

import copy
from typing import Any


class PatchError(Exception):
    """A patch that cannot be decoded (HTTP 400 in kube-apiserver)."""


class PatchTestFailed(Exception):
    """A JSON patch whose application failed, e.g. a ``test`` op (HTTP 422 ``Invalid``)."""


def merge_patch(target: Any, patch: Any) -> Any:
    """Apply an RFC 7386 merge patch: objects merge, ``null`` deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result: dict[str, Any] = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _unescape(token: str) -> str:
    return token.replace("~1", "/").replace("~0", "~")


def _split_pointer(pointer: str) -> list[str]:
    if pointer == "":
        return []
    if not pointer.startswith("/"):
        raise PatchTestFailed(f"invalid JSON pointer {pointer!r}")
    return [_unescape(t) for t in pointer[1:].split("/")]


def _parent(doc: Any, tokens: list[str]) -> Any:
    node = doc
    for token in tokens[:-1]:
        node = _child(node, token)
    return node


def _child(node: Any, token: str) -> Any:
    if isinstance(node, dict):
        if token not in node:
            raise PatchTestFailed(f"missing key {token!r}")
        return node[token]
    if isinstance(node, list):
        return node[_index(node, token, allow_end=False)]
    raise PatchTestFailed(f"cannot descend into {type(node).__name__} with {token!r}")


def _index(node: list[Any], token: str, *, allow_end: bool) -> int:
    if token == "-" and allow_end:
        return len(node)
    if not token.isdigit():
        raise PatchTestFailed(f"invalid array index {token!r}")
    index = int(token)
    if index > len(node) or (index == len(node) and not allow_end):
        raise PatchTestFailed(f"array index {index} out of range")
    return index


def _get(doc: Any, pointer: str) -> Any:
    node = doc
    for token in _split_pointer(pointer):
        node = _child(node, token)
    return node


def _add(doc: Any, pointer: str, value: Any) -> Any:
    tokens = _split_pointer(pointer)
    if not tokens:
        return value
    parent = _parent(doc, tokens)
    last = tokens[-1]
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list):
        parent.insert(_index(parent, last, allow_end=True), value)
    else:
        raise PatchTestFailed(f"cannot add to {type(parent).__name__}")
    return doc


def _remove(doc: Any, pointer: str) -> tuple[Any, Any]:
    tokens = _split_pointer(pointer)
    if not tokens:
        raise PatchTestFailed("cannot remove the document root")
    parent = _parent(doc, tokens)
    last = tokens[-1]
    if isinstance(parent, dict):
        if last not in parent:
            raise PatchTestFailed(f"missing key {last!r}")
        return doc, parent.pop(last)
    if isinstance(parent, list):
        return doc, parent.pop(_index(parent, last, allow_end=False))
    raise PatchTestFailed(f"cannot remove from {type(parent).__name__}")


def json_patch(target: Any, operations: Any) -> Any:
    """Apply an RFC 6902 JSON patch; the input is not modified."""
    if not isinstance(operations, list):
        # What Go's decoder says when a merge-patch body is sent as a JSON patch.
        raise PatchError(
            "json: cannot unmarshal object into Go value of type []handlers.jsonPatchOp"
        )
    doc = copy.deepcopy(target)
    for op in operations:
        if not isinstance(op, dict) or not isinstance(op.get("op"), str):
            raise PatchError(f"invalid JSON patch operation: {op!r}")
        kind = op["op"]
        path = op.get("path")
        if not isinstance(path, str):
            raise PatchError(f"JSON patch operation {kind!r} has no path")
        if kind == "add":
            doc = _add(doc, path, copy.deepcopy(op.get("value")))
        elif kind == "remove":
            doc, _ = _remove(doc, path)
        elif kind == "replace":
            doc, _ = _remove(doc, path)
            doc = _add(doc, path, copy.deepcopy(op.get("value")))
        elif kind in ("move", "copy"):
            source = op.get("from")
            if not isinstance(source, str):
                raise PatchError(f"JSON patch operation {kind!r} has no from")
            if kind == "move":
                doc, value = _remove(doc, source)
            else:
                value = copy.deepcopy(_get(doc, source))
            doc = _add(doc, path, value)
        elif kind == "test":
            if _get(doc, path) != op.get("value"):
                raise PatchTestFailed(f"testing value {path} failed")
        else:
            raise PatchError(f"unexpected kind of JSON patch operation: {kind!r}")
    return doc
