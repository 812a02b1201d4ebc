"""One canary: its identity, the record canaryd keeps of it (the registry is its only
writer), and the readings of an object's copy that every layer above shares."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

INT64_MAX = 2**63 - 1


def is_canary(obj: Mapping[str, Any], label: str) -> bool:
    """The upstream test: the label's value equals ``true``, ignoring case."""
    metadata = obj.get("metadata")
    labels = metadata.get("labels") if isinstance(metadata, Mapping) else None
    value = labels.get(label) if isinstance(labels, Mapping) else None
    return isinstance(value, str) and value.lower() == "true"


def one_line(text: str) -> str:
    """A reason as one line (an API error's message may hold newlines)."""
    return " ".join(text.split())


class CanaryState(enum.Enum):
    PENDING = "pending"  # tracked, no bump judged yet
    HEALTHY = "healthy"  # the last bump was observed in time
    UNHEALTHY = "unhealthy"  # the last bump was written but not observed in time
    UNKNOWN = "unknown"  # the last bump could not be written: nothing to judge


class CanaryKey(NamedTuple):
    """A canary's identity. A tuple: hashed in C, several times per bump."""

    kind: str
    namespace: str
    name: str

    def __str__(self) -> str:
        return f"{self.kind}/{self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True)
class Verdict:
    """The last unhealthy verdict: when (monotonic and wall clock) and why."""

    at: float
    wall_time: float
    reason: str


@dataclass(slots=True, eq=False)
class Canary:
    """One tracked canary: identity, the latest copy's few fields, and its health."""

    key: CanaryKey
    uid: str
    resource_version: str
    generation: int  # the latest seen through the watch: what "reconciled" is judged on
    nonce: int  # spec.restartNonce of the latest copy (0: absent or not a valid integer)
    nonce_problem: str | None = None  # why spec.restartNonce is not usable (a bump repairs it)
    state: CanaryState = CanaryState.PENDING
    reason: str = "waiting for the first bump to be judged"
    cause: str = "first_bump"  # the reason's class: a metric label (docs/OPERATIONS.md)
    bumped_generation: int | None = None  # what our last bump produced, until judged
    last_bumped_generation: int | None = None  # the same, judged or not (for display)
    judged_generation: int | None = None  # what the last verdict (the reason) was about
    bump_deadline: float | None = None  # monotonic time at which that bump is judged
    last_bump_at: float | None = None  # wall-clock time of the last successful bump
    deferred_until: float | None = None  # the verdict waits for the watch to resume until
    late_recheck: bool = False  # an unhealthy verdict by a late judge waits for a re-check
    status_observed: int | None = None  # status.observedGeneration as the watch delivered it
    generation_seen_at: float = 0.0  # monotonic time the watch delivered a higher generation
    bump_sent_at: float | None = None  # monotonic time the last bump's PATCH was sent
    bump_answered_at: float | None = None
    """Scheduler-clock time that bump was answered: its scope's stream must deliver
    something after it, or canaryd suspects its own connection (canaryd.sync)."""
    stages: dict[str, float] = field(default_factory=dict)  # that bump's seconds to each stage
    verdict: Verdict | None = None  # the last unhealthy one, while it may stand (no_verdict)
    reconcile_baseline: tuple[int, float | None] | None = None
    """--reconciled-by operator-metrics: (operator instance, its count of finished
    reconciles of this canary or None) read before the pending bump was sent."""
    warned: bool = False  # a Warning Event told, no Recovered since (scheduler.Role)


def read_nonce(obj: Mapping[str, Any]) -> tuple[int, str | None]:
    """spec.restartNonce as the bump base, and what is wrong with it if anything."""
    spec = obj.get("spec")
    if spec is None:
        return 0, None
    if not isinstance(spec, Mapping):
        return 0, f"spec is a {type(spec).__name__}, not an object"
    value = spec.get("restartNonce")
    if value is None:
        return 0, None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        return 0, f"spec.restartNonce is {value!r}, not an integer"
    if value == INT64_MAX:
        return 0, f"spec.restartNonce {value} is the largest 64-bit integer; it cannot grow"
    if not -INT64_MAX - 1 <= value < INT64_MAX:
        return 0, f"spec.restartNonce {value} does not fit in a 64-bit integer"
    return value, None


def status_observed_generation(obj: Mapping[str, Any]) -> int | None:
    """``status.observedGeneration``, when the object reports one."""
    status = obj.get("status")
    value = status.get("observedGeneration") if isinstance(status, Mapping) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def generation_of(metadata: Mapping[str, Any]) -> int:
    """metadata.generation, 0 when absent or not an integer."""
    value = metadata.get("generation")
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
