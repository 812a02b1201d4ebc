"""`make demo` keeps working: its scenario, on a short cycle, end to end — the seed's
three steps (health stays 200), then the two failures the check exists to tell apart:
a stuck watch delivery (unhealthy, 500, then healthy again) and a write outage
(unknown: no verdict, /healthz stays 200)."""

from __future__ import annotations

import re
import subprocess
import sys


def test_demo_scenario_shows_the_happy_path_and_both_failures():
    result = subprocess.run(
        [sys.executable, "-m", "canaryd.testing.demo", "--once", "--timeout", "500ms"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "applied config/samples/flinkdeployment-canary.yaml in default, team-a" in out
    assert "'repro': '409'" in out and "<- kept" in out
    assert "labels={}  <- not re-added" in out
    assert "steps 1-3 done: /healthz stayed 200 throughout" in out

    step4 = out[out.index("step 4:") : out.index("step 5:")]
    assert "withholds watch events" in step4
    assert re.search(r"GET /healthz\?verbose ->\n\s+500 .*\n(.*\n)*?.*unhealthy", step4), step4
    assert "/healthz 500 while the delivery was stuck" in step4
    assert "recovered: /healthz 200" in step4

    step5 = out[out.index("step 5:") :]
    assert "answers 503 to every write" in step5
    assert "unknown" in step5 and "bump failed" in step5
    assert "/healthz stayed 200 during the write outage" in step5
    assert "recovered: every canary healthy" in step5
    assert "canaryd exited with 0" in out


def test_the_demo_default_cycle_keeps_it_under_a_minute():
    result = subprocess.run(
        [sys.executable, "-m", "canaryd.testing.demo", "--help"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert "canary cycle (default 3s)" in result.stdout, result.stdout
