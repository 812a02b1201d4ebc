"""config/systemd/kubeconfig.sh (`make kubeconfig`) without a cluster: bad input is one
line and exit 2, before kubectl runs and nothing written. Its result on a real API
server, with the kubectl of `make controlplane`: tests/test_e2e.py."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "config" / "systemd" / "kubeconfig.sh"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ([], "usage: "),
        (["--namespace"], "usage: "),
        (["--bogus", "OUT"], "usage: "),
        (["OUT", "another"], "usage: "),
        (["--duration", "5m", "OUT"], "--duration 5m is below the API's 10 minute minimum"),
        (["--duration", "1 year", "OUT"], "--duration 1 year: give hours, minutes or seconds"),
        (["--rbac", "/nonexistent", "OUT"], "no kustomization.yaml in /nonexistent"),
        (["--namespace", "Team_A", "OUT"], "--namespace Team_A is not a namespace name"),
        (["--name-suffix", "/x", "OUT"], "--name-suffix /x: lower-case letters"),
    ],
)
def test_bad_input_is_one_line_and_status_2(tmp_path, args, says):
    output = tmp_path / "out"
    # No kubectl on PATH: were the input accepted, it would fail on that instead.
    result = subprocess.run(
        [str(SCRIPT), *(str(output) if a == "OUT" else a for a in args)],
        env={**os.environ, "PATH": "/usr/bin:/bin", "KUBECONFIG": str(tmp_path / "none")},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    lines = result.stderr.splitlines()
    assert (result.returncode, result.stdout, len(lines)) == (2, "", 1), result
    assert says in lines[0], lines
    assert list(tmp_path.iterdir()) == []


def test_input_accepted_needs_kubectl(tmp_path):
    bin_dir = tmp_path / "bin"  # bash and dirname, no kubectl
    bin_dir.mkdir()
    for tool in ("bash", "dirname"):
        (bin_dir / tool).symlink_to(shutil.which(tool) or tool)
    result = subprocess.run(
        [str(SCRIPT), "--duration", "1h30m", str(tmp_path / "out")],
        env={**os.environ, "PATH": str(bin_dir)},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert (result.returncode, result.stderr) == (2, "kubeconfig.sh: kubectl is not on PATH\n")
    assert not (tmp_path / "out").exists()
