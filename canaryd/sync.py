"""Where each watch scope stands: the one model that ``/readyz`` and the judge read.

A scope is *in sync* when the registry holds everything the API server has sent for
it (when it is not: docs/CONFIGURATION.md), so that a bump not yet seen there was not
delivered by the cluster; while it is not, what it did not deliver is canaryd's own
delay, not the cluster's. Only the watcher changes it; the judge marks it suspected.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import Protocol

ScopeKey = tuple[str, str | None]
"""(kind plural, namespace) of one canary watch; namespace None: cluster-wide."""


@dataclass(slots=True, eq=False)
class ScopeSync:
    unsynced_since: float | None  # since when the registry may be behind; None: in sync
    behind_because: str = "its first list is not done"  # for a verdict's reason
    state: str = "waiting"  # listed (a list done, a stream open), forbidden, kind_not_served
    last_delivery: float = -math.inf  # monotonic time of the last list, event or bookmark
    resynced_at: float = -math.inf
    """Monotonic time it last came back in sync (its first list, or the first delivery
    of a resumed stream). A resumed stream replays what was missed over several reads:
    a bump answered before that may still be on its way."""
    suspected: str | None = None  # why canaryd suspects the open stream, until replaced
    suspects: asyncio.Event = field(default_factory=asyncio.Event)  # Scopes.suspects

    @property
    def ready(self) -> bool:
        """/readyz: listed and connected, or answered with a denial (nothing is ours)."""
        return self.state != "waiting"

    @property
    def in_sync(self) -> bool:
        return self.unsynced_since is None

    def listed_at(self, now: float) -> bool:
        """A full list is in the registry. True when that ends a time out of sync."""
        self.state, self.last_delivery = "listed", now
        return self._resync()

    def opened(self) -> None:
        """A watch was answered 200."""
        self.state = "listed"

    def delivered(self, now: float) -> bool:
        """An event or a bookmark arrived. True when that ends a time out of sync."""
        self.last_delivery = now
        return self._resync()

    def silent_since(self, answered_at: float) -> bool:
        """Half-open, as far as canaryd can tell: not one event or bookmark since a bump
        of this scope was answered. A live stream delivers that bump's event (a stuck
        server still sends bookmarks); a dead connection sends nothing at all. For a
        bump answered before the stream resumed, its event is in the replay: nothing
        since the replay's first event is as silent (the replay stalled)."""
        if answered_at < self.resynced_at:
            return self.last_delivery <= self.resynced_at
        return self.last_delivery < answered_at

    def dropped(self, now: float, why: str = "it dropped") -> None:
        """The stream or the list failed: from now on the registry may be behind."""
        if self.state == "listed":
            self.state = "waiting"
        if self.unsynced_since is None:
            self.unsynced_since, self.behind_because = now, why

    def deny(self, state: str) -> None:
        """403 or 404: nothing in this scope is ours, so no verdict waits for it."""
        self.state, self.unsynced_since = state, None

    def suspect(self, now: float, why: str) -> None:
        """canaryd suspects its own connection: out of sync until a new stream delivers."""
        self.dropped(now, f"canaryd replaced it ({why})")
        self.suspected = why
        self.suspects.set()

    def _resync(self) -> bool:
        if self.unsynced_since is None:
            return False
        self.unsynced_since, self.resynced_at = None, self.last_delivery
        return True


class _Located(Protocol):
    @property
    def kind(self) -> str: ...
    @property
    def namespace(self) -> str: ...


class Scopes:
    """The sync model of every canary watch scope."""

    def __init__(self) -> None:
        self._scopes: dict[ScopeKey, ScopeSync] = {}
        self.suspects = asyncio.Event()  # set when a scope is suspected: the watcher waits

    def add(self, scope: ScopeKey, now: float) -> ScopeSync:
        """A new watch of this scope starts: out of sync until its first list."""
        self._scopes[scope] = ScopeSync(now, suspects=self.suspects)
        return self._scopes[scope]

    def remove(self, scope: ScopeKey) -> None:
        """The scope is no longer watched: nothing of it waits any more."""
        self._scopes.pop(scope, None)

    def covering(self, key: _Located) -> ScopeSync | None:
        """The model of the watch that covers this canary (its namespace's or all's)."""
        found = self._scopes.get((key.kind, key.namespace))
        return found if found is not None else self._scopes.get((key.kind, None))
