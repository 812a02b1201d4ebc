"""`make demo` keeps working: its scenario, on a short cycle, end to end — the bug report's
three steps (health stays 200), then the two failures the check exists to tell apart:
a stuck watch delivery (unhealthy, 500, then healthy again) and a write outage
(unknown: no verdict, /healthz stays 200)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys

import pytest


async def start_demo(**options: bool) -> asyncio.subprocess.Process:
    """The demo as `make demo` runs it, on a 500 ms cycle, its output piped."""
    return await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "canaryd.testing.demo", "--timeout", "500ms"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        **options,
    )


@pytest.mark.slow
async def test_demo_scenario_shows_the_happy_path_and_both_failures():
    """As `make demo` runs it (no --once): the scenario, then a Ctrl-C hint; Ctrl-C
    (SIGINT) stops everything with status 0."""
    process = await start_demo()
    assert process.stdout is not None and process.stderr is not None
    lines: list[str] = []
    try:
        async with asyncio.timeout(50):
            while not lines or "press Ctrl-C to stop" not in lines[-1]:
                line = (await process.stdout.readline()).decode()
                assert line, f"the demo ended without a Ctrl-C hint: {''.join(lines)}"
                lines.append(line)
    except TimeoutError:
        raise AssertionError(f"no Ctrl-C hint after 50 s: {''.join(lines)}") from None
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGINT)
    async with asyncio.timeout(30):
        rest, err = await process.communicate()
    out = "".join(lines) + rest.decode()
    assert process.returncode == 0, out + err.decode()
    assert "the scenario is done; canaryd keeps checking: press Ctrl-C to stop" in out, out
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


@pytest.mark.parametrize("when", ["canaryd started", "step 4:"])
async def test_ctrl_c_stops_the_demo_with_status_0_whenever_it_comes(when):
    """Ctrl-C in a terminal signals the whole process group (make, the demo, and canaryd
    as the demo started it): canaryd got SIGINT, then the demo's SIGTERM after its own
    handlers were gone (-15), or SIGINT before it had any (-2), and `make demo` failed."""
    process = await start_demo(start_new_session=True)  # a terminal's foreground job
    assert process.stdout is not None
    lines: list[str] = []
    try:
        async with asyncio.timeout(50):
            while not lines or when not in lines[-1]:
                line = (await process.stdout.readline()).decode()
                assert line, f"the demo ended before {when!r}: {''.join(lines)}"
                lines.append(line)
    finally:
        if process.returncode is None:
            os.killpg(process.pid, signal.SIGINT)
    async with asyncio.timeout(30):
        rest, err = await process.communicate()
    out = "".join(lines) + rest.decode()
    assert process.returncode == 0, out + err.decode()
    assert "Traceback" not in out + err.decode(), err.decode()
