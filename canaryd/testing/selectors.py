"""Label and field selectors, parsed and matched as kube-apiserver does.

Grammar from staging/src/k8s.io/apimachinery/pkg/labels/selector.go (``Parse``):
``k=v``, ``k==v``, ``k!=v``, ``k``, ``!k``, ``k in (a,b)``, ``k notin (a,b)``;
a comma means AND. ``k!=v`` and ``notin`` also match objects without the key.
Field selectors (fields/selector.go) support ``=``, ``==`` and ``!=``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

Requirement = Callable[[Mapping[str, str]], bool]


class SelectorError(ValueError):
    """An unparsable selector (kube-apiserver answers 400 BadRequest)."""


_SET_RE = re.compile(r"^\s*(\S+)\s+(in|notin)\s+\(([^)]*)\)\s*$")
_KEY_RE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_./]*[A-Za-z0-9])?$")


def _split_terms(selector: str) -> list[str]:
    """Split on commas that are not inside a parenthesised value set."""
    terms: list[str] = []
    current: list[str] = []
    depth = 0
    for char in selector:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 0:
            terms.append("".join(current))
            current = []
        else:
            current.append(char)
    terms.append("".join(current))
    return [t.strip() for t in terms if t.strip()]


def _key(text: str) -> str:
    key = text.strip()
    if not _KEY_RE.match(key):
        raise SelectorError(f"invalid label key {key!r}")
    return key


def _parse_term(term: str) -> Requirement:
    set_match = _SET_RE.match(term)
    if set_match:
        key = _key(set_match.group(1))
        values = {v.strip() for v in set_match.group(3).split(",") if v.strip()}
        if set_match.group(2) == "in":
            return lambda labels: labels.get(key) in values
        return lambda labels: labels.get(key) not in values
    for operator in ("!=", "==", "="):
        if operator in term:
            raw_key, _, raw_value = term.partition(operator)
            key, value = _key(raw_key), raw_value.strip()
            if operator == "!=":
                return lambda labels: labels.get(key) != value
            return lambda labels: labels.get(key) == value
    if term.startswith("!"):
        key = _key(term[1:])
        return lambda labels: key not in labels
    key = _key(term)
    return lambda labels: key in labels


def parse_label_selector(selector: str | None) -> Requirement:
    """Return a predicate over a label mapping; an empty selector matches everything."""
    requirements = [_parse_term(t) for t in _split_terms(selector or "")]
    return lambda labels: all(req(labels) for req in requirements)


def parse_field_selector(selector: str | None) -> Callable[[Mapping[str, Any]], bool]:
    """Field selectors on ``metadata.name`` and ``metadata.namespace``."""
    checks: list[Callable[[Mapping[str, Any]], bool]] = []
    for term in _split_terms(selector or ""):
        for operator in ("!=", "==", "="):
            if operator in term:
                field, _, value = (part.strip() for part in term.partition(operator))
                break
        else:
            raise SelectorError(f"invalid field selector term {term!r}")
        if field not in ("metadata.name", "metadata.namespace"):
            raise SelectorError(f'field label not supported: "{field}"')
        checks.append(_field_check(field.split(".", 1)[1], value, negate=operator == "!="))
    return lambda metadata: all(check(metadata) for check in checks)


def _field_check(attr: str, value: str, *, negate: bool) -> Callable[[Mapping[str, Any]], bool]:
    def check(metadata: Mapping[str, Any]) -> bool:
        return bool(metadata.get(attr, "") == value) != negate

    return check
