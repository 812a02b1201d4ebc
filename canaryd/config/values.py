"""Typed values from text, and the error every bad value raises.

Durations as Flink writes them (or ISO-8601) and booleans as Flink reads them; a
``ConfigError`` is one line, and canaryd exits with status 2 on it.
"""

from __future__ import annotations

import math
import re
from typing import Any


class ConfigError(Exception):
    """Bad configuration: canaryd exits with status 2 and this message on one line."""


_UNITS: dict[str, float] = {}
for _factor, _labels in (
    (1e-9, ("ns", "nano", "nanos", "nanosecond", "nanoseconds")),
    (1e-6, ("µs", "us", "micro", "micros", "microsecond", "microseconds")),
    (1e-3, ("ms", "milli", "millis", "millisecond", "milliseconds")),
    (1.0, ("s", "sec", "secs", "second", "seconds")),
    (60.0, ("m", "min", "mins", "minute", "minutes")),
    (3600.0, ("h", "hour", "hours")),
    (86400.0, ("d", "day", "days")),
):
    for _label in _labels:
        _UNITS[_label] = _factor

_FLINK_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zµ]*)\s*$", re.IGNORECASE)
_ISO_RE = re.compile(
    r"^P(?:(\d+(?:\.\d+)?)D)?(?:T(?:(\d+(?:\.\d+)?)H)?(?:(\d+(?:\.\d+)?)M)?(?:(\d+(?:\.\d+)?)S)?)?$",
    re.IGNORECASE,
)


def parse_duration(text: str) -> float:
    """Flink's duration syntax (TimeUtils.parseDuration) or ISO-8601, in seconds.

    ``500ms``, ``2 s``, ``1 min``, ``5m``, ``PT1M``; a bare number is milliseconds.
    """
    value = str(text).strip()
    iso = _ISO_RE.match(value)
    if iso and value.upper() not in ("P", "PT") and any(iso.groups()):
        days, hours, minutes, seconds = (float(g) if g else 0.0 for g in iso.groups())
        return days * 86400 + hours * 3600 + minutes * 60 + seconds
    flink = _FLINK_RE.match(value)
    if not flink:
        raise ConfigError(f"invalid duration {text!r}: expected e.g. '500 ms', '1 min', 'PT1M'")
    number, unit = float(flink.group(1)), flink.group(2).lower()
    if unit and unit not in _UNITS:
        raise ConfigError(
            f"invalid duration {text!r}: unknown unit {unit!r} (use ns, us, ms, s, min/m, h or d)"
        )
    seconds = number * _UNITS[unit] if unit else number / 1000.0
    if not math.isfinite(seconds):
        raise ConfigError(f"invalid duration {text!r}: too large")
    return seconds


def parse_bool(value: Any) -> bool:
    """Every boolean canaryd reads, from the environment or the operator config, is
    ``true`` or ``false`` in any case, as Flink reads the operator's own booleans
    (ConfigurationUtils.convertToBoolean); ``yes``, ``1`` or ``on`` are refused."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "false"):
        return text == "true"
    raise ConfigError(f"expected true or false, got {str(value).strip()!r}")
