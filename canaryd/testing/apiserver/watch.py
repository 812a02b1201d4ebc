"""Watch streams: changes dispatched to open watches, bookmarks, timeouts, 410 Expired.

kube-apiserver's watch cache (staging/src/k8s.io/apiserver/pkg/storage/cacher/) over the
store: a watch starts from the current objects or from the history, then gets every
change the store commits (``_deliver``), turned into events by its selector.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from canaryd.testing.apiserver.resources import ApiError, Request, ResourceType, selector
from canaryd.testing.apiserver.store import Change, Store


@dataclass(eq=False)
class Watcher:
    """One open watch stream: what it watches, and the changes queued for it."""

    rtype: ResourceType
    namespace: str | None
    transport: asyncio.BaseTransport | None = None
    queue: asyncio.Queue[Change | bytes | None] = field(default_factory=asyncio.Queue)
    silent: bool = False
    """Half-open: the stream stays open and sends nothing more (silence_watches)."""


class Watches(Store):
    """The store with the watches open on it."""

    def __init__(
        self, *, bookmark_interval: float, default_watch_timeout: float, **store: Any
    ) -> None:
        super().__init__(**store)
        self.bookmark_interval = bookmark_interval
        self.default_watch_timeout = default_watch_timeout
        self.watchers: set[Watcher] = set()
        self._held: list[Change] | None = None
        """Changes not yet dispatched to watches while delivery is held."""
        self._dispatched_rv = 0
        """The resourceVersion up to which changes went to the watches."""
        self._replay_gate: asyncio.Event | None = None
        self.replays_paused = 0
        """Resumed watches that sent the first change of their replay and wait."""

    def _deliver(self, change: Change) -> None:
        if self._held is not None:
            self._held.append(change)
        else:
            self._send_to_watches(change)

    def _send_to_watches(self, change: Change) -> None:
        self._dispatched_rv = change.rv
        for watcher in self.watchers:
            if watcher.rtype is change.rtype:
                watcher.queue.put_nowait(change)

    # ------------------------------------------------------- controls for tests

    def hold_watch_events(self) -> None:
        """A stuck delivery path, as when kube-apiserver's watch cache is no longer fed by
        etcd: changes reach no watch, open or new, until released; bookmarks keep coming
        at the last dispatched resourceVersion, as the cacher's dispatch loop sends them
        (staging/src/k8s.io/apiserver/pkg/storage/cacher/cacher.go, dispatchEvents)."""
        if self._held is None:
            self._held = []

    def release_watch_events(self) -> None:
        held, self._held = self._held or [], None
        for change in held:
            self._send_to_watches(change)

    def silence_watches(self) -> None:
        """Half-open connections: every open watch stream stays open and never sends
        another byte (a crashed replica behind a load balancer, a lost conntrack entry);
        watches opened after this work."""
        for watcher in self.watchers:
            watcher.silent = True

    def pause_replays(self) -> None:
        """A watch resumed from a resourceVersion sends the first change it replays,
        then the others only after ``resume_replays``: a replay that reaches the client
        over several reads (kube-apiserver writes each event as it goes)."""
        if self._replay_gate is None:
            self._replay_gate = asyncio.Event()

    def resume_replays(self) -> None:
        gate, self._replay_gate = self._replay_gate, None
        if gate is not None:
            gate.set()

    def close_watches(self) -> None:
        """End every open watch stream, as an API server restart does."""
        for watcher in list(self.watchers):
            watcher.queue.put_nowait(None)

    def inject_watch_line(self, raw: bytes) -> None:
        """Send these bytes as-is on every open watch stream (malformed input)."""
        for watcher in list(self.watchers):
            watcher.queue.put_nowait(raw)

    def abort_watches(self) -> None:
        """Cut every watch connection at once (a crashed API server or a broken link)."""
        for watcher in list(self.watchers):
            if watcher.transport is not None:
                watcher.transport.close()

    # ----------------------------------------------------------------- serving

    async def _watch(self, request: web.Request, req: Request) -> web.StreamResponse:
        rtype = req.rtype
        assert rtype is not None
        matches = selector(request.query)
        raw_rv = request.query.get("resourceVersion", "")
        try:
            since = int(raw_rv) if raw_rv not in ("", "0") else None
        except ValueError as err:
            raise ApiError(400, "BadRequest", f"invalid resource version: {raw_rv}") from err
        timeout = float(request.query.get("timeoutSeconds") or self.default_watch_timeout)
        bookmarks = request.query.get("allowWatchBookmarks", "").lower() in ("true", "1")

        response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)

        def in_scope(obj: dict[str, Any]) -> bool:
            return req.namespace is None or obj["metadata"].get("namespace") == req.namespace

        watcher: Watcher | None = None

        async def send(event: str, obj: dict[str, Any]) -> None:
            if watcher is not None and watcher.silent:
                return
            line = json.dumps({"type": event, "object": obj}, separators=(",", ":"))
            await response.write(line.encode() + b"\n")

        backlog: list[Change] = []
        if since is not None and since < self.compacted_rv:
            # A watch from a compacted resourceVersion is a 200 stream with one ERROR
            # event (staging/src/k8s.io/apiserver/pkg/storage/cacher/cacher.go, Watch →
            # errors.NewResourceExpired / NewGone, code 410, reason Expired).
            await send(
                "ERROR",
                {
                    "kind": "Status",
                    "apiVersion": "v1",
                    "metadata": {},
                    "status": "Failure",
                    "message": f"too old resource version: {since} ({self.compacted_rv + 1})",
                    "reason": "Expired",
                    "code": 410,
                },
            )
            await response.write_eof()
            return response
        watcher = Watcher(rtype, req.namespace, request.transport)
        initial: list[dict[str, Any]] = []
        if since is None:
            # resourceVersion unset or "0": start with a synthetic ADDED for every
            # current object ("Get State and Start at Most Recent", API concepts doc).
            initial = [
                copy.deepcopy(o)
                for _, o in sorted(self.objects[rtype.plural].items())
                if in_scope(o) and matches(o)
            ]
        else:
            backlog = [
                c for c in self.history if c.rtype is rtype and since < c.rv <= self._dispatched_rv
            ]
        self.watchers.add(watcher)  # no await since the snapshot: nothing is missed
        self._notify()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        next_bookmark = loop.time() + self.bookmark_interval
        try:
            for obj in initial:
                await send("ADDED", obj)
            for n, change in enumerate(backlog):
                if n == 1 and (gate := self._replay_gate) is not None:
                    self.replays_paused += 1
                    self._notify()
                    await gate.wait()
                await self._send_change(send, change, in_scope, matches)
            while True:
                now = loop.time()
                # Server-side timeoutSeconds ends the stream (endpoints/handlers/watch.go).
                if now >= deadline:
                    break
                item: Change | bytes | None
                if not watcher.queue.empty():
                    item = watcher.queue.get_nowait()
                else:
                    due = min(deadline, next_bookmark) if bookmarks else deadline
                    try:
                        item = await asyncio.wait_for(watcher.queue.get(), max(due - now, 0))
                    except TimeoutError:
                        # A change can be queued in the very turn the wait times out
                        # (asyncio.wait_for on 3.11 then still raises): a bookmark now
                        # would carry a resourceVersion past that unsent change, and a
                        # client resuming from it would never see the change. A real
                        # cacher bookmarks only what it has sent: the change goes first.
                        if not watcher.queue.empty():
                            continue
                        if bookmarks and loop.time() >= next_bookmark:
                            # Bookmarks only with allowWatchBookmarks; the object carries
                            # only kind, apiVersion and metadata.resourceVersion
                            # (cacher/cache_watcher.go, the bookmark event).
                            bookmark = {
                                "kind": rtype.kind,
                                "apiVersion": rtype.api_version,
                                "metadata": {
                                    "resourceVersion": str(max(since or 0, self._dispatched_rv))
                                },
                            }
                            await send("BOOKMARK", bookmark)
                            next_bookmark = loop.time() + self.bookmark_interval
                        continue
                if item is None:
                    break
                if isinstance(item, bytes):
                    if not watcher.silent:
                        await response.write(item)
                    continue
                if since is not None and item.rv <= since:
                    continue  # released after a hold: this watch started past it
                await self._send_change(send, item, in_scope, matches)
            await response.write_eof()
        except ConnectionResetError:
            pass  # the client went away; nothing to tell it
        finally:
            self.watchers.discard(watcher)
            self._notify()
        return response

    @staticmethod
    async def _send_change(
        send: Callable[[str, dict[str, Any]], Any],
        change: Change,
        in_scope: Callable[[dict[str, Any]], bool],
        matches: Callable[[dict[str, Any]], bool],
    ) -> None:
        if not in_scope(change.new):
            return
        # A selector watch turns a change across the selector's edge into ADDED or
        # DELETED (cacher/cache_watcher.go, convertToWatchEvent).
        now_matches = matches(change.new)
        was_matching = change.old is not None and matches(change.old)
        if change.type == "ADDED":
            event = "ADDED" if now_matches else None
        elif change.type == "DELETED":
            event = "DELETED" if was_matching or now_matches else None
        elif now_matches and was_matching:
            event = "MODIFIED"
        elif now_matches:
            event = "ADDED"
        elif was_matching:
            # The previous copy, with the change's resourceVersion: a client cannot tell
            # from the event whether the object was deleted or left the selector
            # (cacher/cache_watcher.go, convertToWatchEvent).
            assert change.old is not None
            old = copy.deepcopy(change.old)
            old["metadata"]["resourceVersion"] = str(change.rv)
            await send("DELETED", old)
            return
        else:
            event = None
        if event is not None:
            await send(event, change.new)
