"""The values of configuration, from text: durations as Flink writes them, booleans as
Flink reads them, names, kinds, URLs, ports; each parser raises ``ConfigError``."""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from canaryd.config.operator_config import ConfigError

_UNITS = {
    **dict.fromkeys(["ns", "nano", "nanos", "nanosecond", "nanoseconds"], 1e-9),
    **dict.fromkeys(["µs", "us", "micro", "micros", "microsecond", "microseconds"], 1e-6),
    **dict.fromkeys(["ms", "milli", "millis", "millisecond", "milliseconds"], 1e-3),
    **dict.fromkeys(["s", "sec", "secs", "second", "seconds"], 1.0),
    **dict.fromkeys(["m", "min", "mins", "minute", "minutes"], 60.0),
    **dict.fromkeys(["h", "hour", "hours"], 3600.0),
    **dict.fromkeys(["d", "day", "days"], 86400.0),
}
_FLINK_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zµ]*)\s*$", re.IGNORECASE)
_ISO_RE = re.compile(
    r"^P(?:(\d+(?:\.\d+)?)D)?(?:T(?:(\d+(?:\.\d+)?)H)?(?:(\d+(?:\.\d+)?)M)?(?:(\d+(?:\.\d+)?)S)?)?$",
    re.IGNORECASE,
)


def parse_duration(text: Any, floor: float = 0.0, bare_floor: float = 0.0) -> float:
    """Flink's duration syntax (TimeUtils.parseDuration: a bare number is milliseconds)
    or ISO-8601 (``PT1M``), in seconds. With a ``floor``, at least that, and a bare
    number (``CANARYD_LEASE_DURATION=15`` is 15 ms) at least ``bare_floor``."""
    value = str(text).strip()
    iso, flink = _ISO_RE.match(value), _FLINK_RE.match(value)
    if iso and any(iso.groups()):
        days, hours, minutes, seconds = (float(g) if g else 0.0 for g in iso.groups())
        seconds += days * 86400 + hours * 3600 + minutes * 60
    elif not flink:
        raise ConfigError(f"invalid duration {value!r}: expected e.g. '500 ms', '1 min', 'PT1M'")
    elif (unit := flink.group(2).lower()) and unit not in _UNITS:
        raise ConfigError(
            f"invalid duration {value!r}: unknown unit {unit!r} (use ns, us, ms, s, min/m, h or d)"
        )
    else:
        seconds = float(flink.group(1)) * _UNITS[unit] if unit else float(flink.group(1)) / 1000
    bare = value.replace(".", "", 1).isdigit()
    if not math.isfinite(seconds):
        raise ConfigError(f"invalid duration {value!r}: too large")
    if floor and seconds <= 0:
        raise ConfigError(f"duration must be greater than zero, got {value!r}")
    if seconds < floor:
        hint = f" (a bare number is milliseconds: write '{value}s')" if bare else ""
        raise ConfigError(
            f"{value!r} is {seconds * 1000:g} ms, below its floor of {floor:g} s{hint}"
        )
    if bare and seconds < bare_floor:
        raise ConfigError(
            f"{value!r} is {seconds * 1000:g} ms: a bare number is milliseconds; give a "
            f"unit, e.g. '{value}s' (or '{value}ms' for a cycle below a second)"
        )
    return seconds


def duration(floor: float, bare_floor: float = 0.0) -> Callable[[Any], float]:
    """The parser of a duration of at least ``floor`` seconds."""
    return functools.partial(parse_duration, floor=floor, bare_floor=bare_floor)


def parse_bool(value: Any) -> bool:
    """As Flink reads the operator's own booleans (ConfigurationUtils.convertToBoolean)."""
    text = str(value).strip().lower()
    if text not in ("true", "false"):
        raise ConfigError(f"expected true or false, got {str(value).strip()!r}")
    return text == "true"


def matching(what: str, pattern: str, why: str = "") -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        text = str(value).strip()
        if not re.fullmatch(pattern, text):
            raise ConfigError(f"invalid {what} {text!r}{why}")
        return text

    return parse


def choice(what: str, *choices: str, **aliases: str) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        chosen = str(value).strip().lower()
        chosen = aliases.get(chosen, chosen)
        if chosen not in choices:
            raise ConfigError(f"invalid {what} {value!r}: expected {' or '.join(choices)}")
        return chosen

    return parse


def dns_name(what: str) -> Callable[[Any], str]:
    return matching(what, r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", ": not a DNS name")


def path(value: Any) -> Path | None:
    return Path(value) if value else None  # empty: none


namespace = matching("namespace name", r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
label = matching(
    "label key", r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
)
FLINK_KINDS = ("flinkdeployments", "flinksessionjobs")
_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
# PLURAL.GROUP/VERSION: a DNS label, a DNS subdomain with a dot, a version.
CUSTOM_KIND = re.compile(rf"{_LABEL}(\.{_LABEL}){{2,}}/v[0-9]+((alpha|beta)[0-9]+)?")


def namespaces(value: Any) -> frozenset[str] | None:
    """Comma-separated (or the file's list); empty, null or JOSDK_ALL_NAMESPACES (JOSDK's
    Constants.WATCH_ALL_NAMESPACES) mean all (None), as in the operator."""
    items = value if isinstance(value, list | tuple) else str(value or "").split(",")
    names = {str(item).strip() for item in items} - {""}
    if not names or "JOSDK_ALL_NAMESPACES" in names:
        return None
    return frozenset(namespace(name) for name in names)


def kinds(value: str) -> tuple[str, ...]:
    full = {k: f"{k}.flink.apache.org/v1beta1" for k in FLINK_KINDS}
    short = {name: k for k, name in full.items()}
    given = (item.strip().lower() for item in value.split(","))
    kinds = tuple(dict.fromkeys(short.get(k, k) for k in given if k))
    unknown = sorted(k for k in kinds if k not in FLINK_KINDS and not CUSTOM_KIND.fullmatch(k))
    if unknown or not kinds:
        raise ConfigError(
            f"invalid kind {', '.join(unknown) or '(empty)'}: expected "
            f"{' and/or '.join(FLINK_KINDS)}, or any namespaced custom resource as "
            "PLURAL.GROUP/VERSION (e.g. widgets.example.com/v1)"
        )
    versions: dict[str, list[str]] = {}
    for kind in kinds:
        resource, _, version = full.get(kind, kind).partition("/")
        versions.setdefault(resource, []).append(version)
    for resource, found in sorted(versions.items()):
        if len(found) > 1:
            raise ConfigError(
                f"kind {resource} given twice, as {' and '.join(found)}: give one version "
                "(every version serves the same objects, which would be bumped twice a cycle)"
            )
    return kinds


def metrics_url(value: str) -> str:
    url = value.strip()
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 -- raises on a bad port
    except ValueError as err:
        raise ConfigError(f"invalid operator metrics URL {url!r}: {err}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"invalid operator metrics URL {url!r}: expected http(s)://HOST:PORT/PATH"
        )
    return url


def port(value: Any) -> int:
    text = str(value).strip()
    if text.startswith("tcp://"):  # the kubelet's, for a Service named canaryd
        raise ConfigError(
            "looks like a Kubernetes service link (a Service named canaryd in this "
            "namespace): set enableServiceLinks: false on the pod, or --port"
        )
    if not text.isdecimal() or int(text) > 65535:
        raise ConfigError(f"invalid port {text}: expected 0-65535")
    return int(text)


def account(value: str) -> tuple[str, str]:
    namespace, slash, name = value.strip().partition("/")
    if not slash:
        raise ConfigError(f"invalid operator account {value!r}: expected NAMESPACE/NAME")
    namespace = dns_name("operator account namespace")(namespace)
    return namespace, dns_name("operator account name")(name)
