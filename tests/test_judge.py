"""canaryd.judge: the judgements as values, from a canary, its watch's sync model and
(operator-metrics) a read of the operator's metrics. Pure: nothing is changed."""

from __future__ import annotations

import math

import pytest

from canaryd import judge
from canaryd.config import Settings
from canaryd.judge import Defer, Healthy, NoVerdict, Recheck, Suspect, Unhealthy, Wait
from canaryd.opmetrics import ScrapeFailed, parse
from canaryd.registry import Canary, CanaryKey
from canaryd.sync import ScopeSync

SETTINGS = Settings(timeout=60.0)
KEY = CanaryKey("flinkdeployments", "ns", "c")
RESOURCE = ("FlinkDeployment", "ns", "c")


def canary(generation: int = 2, bumped: int | None = 3, **fields: object) -> Canary:
    found = Canary(KEY, "u1", "1", generation, 1)
    found.bumped_generation = bumped
    found.bump_deadline = 100.0
    found.bump_answered_at = 40.0
    for name, value in fields.items():
        setattr(found, name, value)
    return found


def in_sync(last_delivery: float = 50.0) -> ScopeSync:
    sync = ScopeSync(None, state="listed")
    sync.last_delivery = last_delivery
    return sync


def watch(c: Canary, sync: ScopeSync | None, now: float = 100.0, **kw: object) -> object:
    options: dict[str, object] = {"late": False, "api_last_answer": math.inf, **kw}
    return judge.by_watch(c, sync, now, SETTINGS, **options)  # type: ignore[arg-type]


def test_nothing_pending_is_nothing_to_judge():
    assert watch(canary(bumped=None), in_sync()) is None


def test_the_generation_seen_in_time_is_healthy_and_not_seen_unhealthy():
    assert isinstance(watch(canary(generation=3), in_sync()), Healthy)
    verdict = watch(canary(generation=2), in_sync())
    assert isinstance(verdict, Unhealthy) and "generation 3 not observed" in verdict.reason


def test_a_late_judge_rechecks_once():
    assert watch(canary(), in_sync(), late=True) == Recheck(100.0 + SETTINGS.judge_slack)
    assert isinstance(watch(canary(late_recheck=True), in_sync(), late=True), Unhealthy)


def test_a_watch_silent_since_the_bump_was_answered_is_the_suspect():
    assert isinstance(watch(canary(), in_sync(last_delivery=30.0)), Suspect)


def test_older_events_read_right_after_the_answer_do_not_clear_a_dead_stream():
    """The bump's answer may be read before events written ahead of it: a stream cut
    right after those (half-open) delivered something after the answer, yet is dead. What
    came within the judge's slack of the answer proves nothing (the soak saw a false
    unhealthy verdict from it); a delivery after that does."""
    slack = SETTINGS.judge_slack
    assert isinstance(watch(canary(), in_sync(last_delivery=40.0 + slack / 2)), Suspect)
    verdict = watch(canary(), in_sync(last_delivery=40.0 + 2 * slack))
    assert isinstance(verdict, Unhealthy), verdict


def test_a_watch_out_of_sync_defers_then_judges_on_the_watch():
    sync = in_sync()
    sync.dropped(90.0, "it dropped")
    first = watch(canary(), sync)
    assert first == Defer(
        160.0, "the watch of flinkdeployments@ns is not in sync: it dropped", True
    )
    later = watch(canary(deferred_until=160.0), sync, now=120.0)
    assert isinstance(later, Defer) and not later.first
    verdict = watch(canary(deferred_until=160.0), sync, now=161.0, api_last_answer=95.0)
    assert isinstance(verdict, Unhealthy) and "has not resumed" in verdict.reason
    away = watch(canary(deferred_until=160.0), sync, now=161.0, api_last_answer=80.0)
    assert isinstance(away, NoVerdict) and away.counted == "unreachable"


def test_a_bump_answered_before_the_watch_resumed_waits_for_the_replay():
    """A resumed stream replays what it missed over several reads: the first delivery
    puts the scope back in sync before the bump's own event is read. Judged then, a
    healthy canary was called unhealthy (the soak saw it after a half-open watch was
    replaced); it is judged ``resume_grace`` after the resume."""
    sync = in_sync()
    sync.dropped(90.0, "it dropped")
    sync.delivered(95.0)  # the resumed stream's first event
    grace = 95.0 + SETTINGS.resume_grace
    assert watch(canary(), sync) == Defer(
        160.0, "the watch of flinkdeployments@ns resumed 5.00s ago", True, at=grace
    )
    sync.delivered(96.0)  # the replay goes on
    assert isinstance(watch(canary(generation=3, deferred_until=160.0), sync, now=grace), Healthy)
    verdict = watch(canary(deferred_until=160.0), sync, now=grace)
    assert isinstance(verdict, Unhealthy) and "not observed within 60s" in verdict.reason
    # Past the grace, or for a bump answered after the resume: judged at once.
    assert isinstance(watch(canary(), sync, now=grace), Unhealthy)
    sync.delivered(97.0)
    assert isinstance(watch(canary(bump_answered_at=96.0), sync), Unhealthy)


def test_a_replay_that_stalls_after_its_first_event_is_the_suspect():
    """Nothing since the resumed stream's first event, while a bump answered before the
    resume is still unseen: its replay stalled (half-open again), canaryd's own delay,
    not the cluster's. Deferred or not, and also for a judge that ran late."""
    sync = in_sync()
    sync.dropped(90.0, "it dropped")
    sync.delivered(95.0)
    grace = 95.0 + SETTINGS.resume_grace
    stalled = watch(canary(deferred_until=160.0), sync, now=grace)
    assert stalled == Suspect("nothing delivered in the 15.0s since the watch resumed")
    assert isinstance(watch(canary(), sync, now=grace + 1.0), Suspect)
    # A late judge after the deferral re-checks once, as any late judge does.
    late = watch(canary(deferred_until=160.0), sync, now=grace + 2.0, late=True)
    assert late == Recheck(grace + 2.0 + SETTINGS.judge_slack)


def test_observed_generation_reads_the_status():
    settings = Settings(timeout=60.0, reconciled_by="observed-generation")
    c = canary(generation=3, status_observed=2)
    opts = {"late": False, "api_last_answer": math.inf}
    assert isinstance(judge.by_watch(c, in_sync(), 100.0, settings, **opts), Unhealthy)
    c.status_observed = 3
    assert isinstance(judge.by_watch(c, in_sync(), 100.0, settings, **opts), Healthy)


SCRAPE = parse(
    'x_JOSDK_Reconciliation_finished_Count{resourcetype="FlinkDeployment",resourcens="ns",'
    'resourcename="c"} 5.0\nx_KubeClient_HttpRequest_Count{} 9\n'
)


def operator(
    c: Canary,
    scrape: object = SCRAPE,
    failed: ScrapeFailed | None = None,
    now: float = 100.0,
    **kw: object,
) -> object:
    options: dict[str, object] = {"instance": 0, "last_answer_at": 90.0, "api_away": None, **kw}
    return judge.by_operator(c, RESOURCE, scrape, failed, now, SETTINGS, **options)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("baseline", "expected"),
    [
        ((0, 4.0), Healthy),
        ((0, 5.0), Unhealthy),
        ((0, None), Healthy),
        (None, NoVerdict),
        ((1, 4.0), NoVerdict),
    ],
    ids=["rose", "stayed", "new-series", "no-baseline", "other-instance"],
)
def test_the_operators_count_judges_the_bump(baseline, expected):
    assert isinstance(operator(canary(reconcile_baseline=baseline)), expected)


def test_what_a_failed_read_means():
    c = canary(reconcile_baseline=(0, 4.0))
    unanswered = ScrapeFailed("unanswered", "nothing")
    assert operator(c, None, unanswered, now=150.0) == Wait()
    frozen = operator(c, None, unanswered, now=161.0)
    assert isinstance(frozen, Unhealthy) and "frozen" in frozen.reason
    gone = operator(c, None, ScrapeFailed("refused", "refused"))
    assert isinstance(gone, NoVerdict) and gone.fresh
    broken = operator(c, None, ScrapeFailed("bad_answer", "HTTP 500"))
    assert isinstance(broken, NoVerdict) and not broken.fresh


def test_a_missing_series_and_the_api_server_away_are_no_verdict():
    missing = operator(
        canary(reconcile_baseline=(0, 4.0)), parse("x_KubeClient_HttpRequest_Count{} 9\n")
    )
    assert isinstance(missing, NoVerdict) and missing.missing_series is not None
    away = operator(canary(reconcile_baseline=(0, 5.0)), api_away="the API server is away")
    assert isinstance(away, NoVerdict) and away.counted == "unreachable"
