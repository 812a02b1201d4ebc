"""`make demo` keeps working: its scenario, on a short cycle, end to end."""

from __future__ import annotations

import subprocess
import sys


def test_demo_scenario_runs_and_health_stays_200():
    result = subprocess.run(
        [sys.executable, "-m", "canaryd.testing.demo", "--once", "--timeout", "500ms"],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "applied config/samples/flinkdeployment-canary.yaml in default, team-a" in out
    assert "'repro': '409'" in out and "<- kept" in out
    assert "labels={}  <- not re-added" in out
    assert "/healthz stayed 200 throughout" in out
    assert "canaryd exited with 0" in out
