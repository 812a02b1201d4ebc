"""Structured logs (structlog; JSON by default) that never carry credentials: redaction runs
last, on every field and traceback, other libraries' records too; masked in any string are
bearer tokens, JWTs, PEM private keys and each secret registered at start."""

import logging
import re
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import structlog

REDACTED = "[REDACTED]"
SENSITIVE_FIELDS = frozenset(
    "token authorization password secret api_key bearer client_key client-key-data key_data "
    "headers".split()
)
_MASKS = (
    (re.compile(r"(?i)(bearer\s+)[^\s'\",}]+"), rf"\1{REDACTED}"),
    (re.compile(r"eyJ[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]*"), REDACTED),
    (
        re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----.*?-----END [A-Z ]*PRIVATE KEY-----", re.S),
        REDACTED,
    ),
)
_secrets: dict[str, None] = {}  # an ordered set: the newest 2 * MAX_SECRETS are kept
MAX_SECRETS = 8


def register_secret(value: str | None) -> None:
    """Mask this exact value in every log line (a bearer token: with or without ``Bearer``)."""
    if not value:
        return
    for candidate in (value, value.removeprefix("Bearer ").strip()):
        if len(candidate) >= 6:
            _secrets.pop(candidate, None)
            _secrets[candidate] = None
    while len(_secrets) > 2 * MAX_SECRETS:
        del _secrets[next(iter(_secrets))]


def scrub(text: str) -> str:
    for secret in _secrets:
        text = text.replace(secret, REDACTED)
    for pattern, mask in _MASKS:
        text = pattern.sub(mask, text)
    return text


def redact(_logger: Any, _method: str, fields: Mapping[str, Any]) -> dict[str, Any]:
    """The structlog processor: a field named like a credential goes, the others are scrubbed."""
    return {
        k: REDACTED if str(k).lower() in SENSITIVE_FIELDS else _clean(v) for k, v in fields.items()
    }


def _clean(value: Any) -> Any:
    if value is None or isinstance(value, int | float | bool):
        return value
    if isinstance(value, Mapping):
        return redact(None, "", value)
    if isinstance(value, list | tuple | set | frozenset):
        return [_clean(v) for v in value]
    return scrub(str(value))


def configure(log_format: str = "json", level: str = "info") -> None:
    numeric = logging.getLevelNamesMapping()[level.upper()]
    shared: list[Any] = [
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Any = structlog.dev.ConsoleRenderer(colors=False)
    if log_format == "json":
        renderer = structlog.processors.JSONRenderer()
    tail: list[Any] = [structlog.processors.format_exc_info, redact, renderer]
    structlog.configure(
        processors=[*shared, *tail],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        # Whatever sys.stderr is at the time of writing (test capture swaps it).
        logger_factory=lambda *_: structlog.PrintLogger(sys.stderr),
    )
    # Other libraries' records, rendered the same way: warnings and worse.
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *tail],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    logging.basicConfig(handlers=[handler], level=max(numeric, logging.WARNING), force=True)


def wall_time(timestamp: float, fraction: bool = False) -> str:
    """A Unix time as RFC 3339 in UTC; a value that is no date is shown as it is."""
    try:
        moment = datetime.fromtimestamp(timestamp, UTC)
    except (ValueError, OverflowError, OSError):
        return repr(timestamp)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ" if fraction else "%Y-%m-%dT%H:%M:%SZ")
