"""The bench's own venv for the peer and the profiler (.cache/bench-peer-venv): kopf and
py-spy are tools of the benchmark, not dependencies of canaryd (pyproject.toml).

uvloop is pinned to the version canaryd runs on here: kopf's CLI uses uvloop when it is
installed, so both sides run on the same event loop."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

from measure import ROOT

VENV = ROOT / ".cache" / "bench-peer-venv"
KOPF_VERSION = "1.45.2"
PY_SPY_VERSION = "0.4.3"


def requirements() -> list[str]:
    try:
        uvloop = f"uvloop=={metadata.version('uvloop')}"
    except metadata.PackageNotFoundError:
        uvloop = "uvloop"
    return [f"kopf=={KOPF_VERSION}", f"py-spy=={PY_SPY_VERSION}", uvloop]


def ensure() -> Path:
    """The venv with the pinned requirements (created or updated when they change);
    returns its bin directory."""
    wanted = "\n".join(requirements()) + "\n"
    stamp = VENV / ".installed"
    if stamp.exists() and stamp.read_text() == wanted:
        return VENV / "bin"
    print(f"installing {', '.join(requirements())} into {VENV}", flush=True)
    if not (VENV / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    subprocess.run(
        [str(VENV / "bin" / "python"), "-m", "pip", "install", "--quiet", *requirements()],
        check=True,
    )
    stamp.write_text(wanted)
    return VENV / "bin"


def version(bin_dir: Path, package: str) -> str:
    """The installed version of a package of the venv."""
    code = f"from importlib.metadata import version; print(version({package!r}))"
    found = subprocess.run(
        [str(bin_dir / "python"), "-c", code], check=True, capture_output=True, text=True
    )
    return found.stdout.strip()
