"""canaryd/episodes.py on its own: what an episode tells, and what it keeps."""

from __future__ import annotations

import tracemalloc

from structlog.testing import capture_logs

from canaryd.episodes import Episodes


def episodes(clock: list[float]) -> Episodes:
    return Episodes("bump_failures", "canary", lambda: 60.0, "canaries", clock=lambda: clock[0])


def test_an_episode_that_never_ends_keeps_no_memory_per_subject_that_came_and_went():
    """One canary forbidden for good keeps the episode open; thousands of others that
    fail once and recover (created, deleted, over weeks) must not pile up in it."""
    clock = [0.0]
    told = episodes(clock)
    told.failed("forbidden/one", "forbidden", "403")
    for warm in range(100):  # the first allocations of a dict that is reused later
        told.failed(f"warm/{warm}", "failed", "503")
        told.recovered(f"warm/{warm}")
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for number in range(20_000):
        clock[0] += 0.01
        told.failed(f"transient/{number}", "failed", "503")
        told.recovered(f"transient/{number}")
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    own = [tracemalloc.Filter(True, "*/canaryd/episodes.py")]  # not the log's output
    grown = sum(
        stat.size_diff
        for stat in after.filter_traces(own).compare_to(before.filter_traces(own), "filename")
    )
    assert told.cause("forbidden/one") == "forbidden" and told.cause("transient/0") is None
    assert grown < 16_384, f"{grown} bytes kept for 20,000 subjects that came and went"


def test_the_end_counts_the_failures_it_told():
    clock = [0.0]
    told = episodes(clock)
    with capture_logs() as records:
        for name in ("a", "b", "c"):
            told.failed(name, "failed", "503")
        told.failed("a", "failed", "503 again")  # still failing: not a new one
        for name in ("a", "b", "c"):
            clock[0] += 1
            told.recovered(name)
    events = [r["event"] for r in records]
    assert events == ["bump_failures_started", "bump_failures_ended"], events
    assert records[-1]["affected"] == 3 and records[-1]["lasted"] == 3


def test_an_episode_stopped_while_failing_is_told_as_still_failing_never_as_ended():
    clock = [0.0]
    told = episodes(clock)
    with capture_logs() as records:
        told.failed("a", "forbidden", "403")
        told.failed("b", "failed", "503")
        told.recovered("b")
        clock[0] = 5.0
        told.stopped("canaryd stopped")
        told.stopped("again")  # nothing left: nothing told
        told.failed("c", "failed", "503")  # a new episode starts afresh
    events = [r["event"] for r in records]
    assert events == [
        "bump_failures_started",
        "bump_failures_started",
        "bump_failures_still_failing",
        "bump_failures_started",
    ], events
    still = records[2]
    assert still["failing"] == 1 and still["canaries"] == ["a"] and still["lasted"] == 5.0
    assert still["causes"] == {"forbidden": 1} and still["affected"] == 2
    assert still["why"] == "canaryd stopped"
    assert told.cause("a") is None and told.cause("c") == "failed"  # a new episode: only c
