"""A sampling profile of a running process with py-spy: its functions by own time.

``py-spy record --format raw`` writes one line per distinct stack ("outer;...;inner
COUNT", each frame "function (file)"); a function's own samples are those where it is
the innermost frame, its total samples those where it is on the stack at all.

Only samples where the process holds the GIL are kept (``--gil``): on uvloop the loop
waits in epoll inside ``Runner.run`` without the GIL, and py-spy's idle detection does
not always tell that wait from work (the wait then tops the table as Runner.run's own
time). The shares are thus of the time canaryd ran Python, or C called from Python
(json, the transports' writes); libuv's own reads and writes without the GIL are not
in them.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Profile:
    samples: int
    seconds: float
    rate: int
    own: Counter[str]
    total: Counter[str]
    cpu_share: float | None = None
    """The process's CPU (user + system) while sampled, as a share of one core."""

    def top(self, entries: int = 15) -> str:
        """A markdown table of the functions with the most own samples."""
        lines = [
            "| function (file) | own | total |",
            "| --- | --- | --- |",
        ]
        for function, count in self.own.most_common(entries):
            own = count / max(self.samples, 1)
            total = self.total[function] / max(self.samples, 1)
            lines.append(f"| `{function}` | {own:.1%} | {total:.1%} |")
        return "\n".join(lines)


def parse(raw: str, seconds: float, rate: int) -> Profile:
    own: Counter[str] = Counter()
    total: Counter[str] = Counter()
    samples = 0
    for line in raw.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        samples += count
        own[frames[-1]] += count
        for frame in set(frames):
            total[frame] += count
    return Profile(samples, seconds, rate, own, total)


def read(output: Path) -> str | None:
    return output.read_text() if output.exists() else None


async def record(
    py_spy: Path, pid: int, seconds: float, output: Path, rate: int = 500, attempts: int = 3
) -> Profile:
    """Sample ``pid`` for ``seconds``. py-spy sometimes fails to attach at once ("Failed
    to find python version"): it is tried again."""
    error = ""
    for _ in range(attempts):
        process = await asyncio.create_subprocess_exec(
            str(py_spy),
            "record",
            "--pid",
            str(pid),
            "--duration",
            f"{seconds:g}",
            "--rate",
            str(rate),
            "--format",
            "raw",
            "--nolineno",
            "--gil",
            "--output",
            str(output),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        _, stderr = await process.communicate()
        recorded = read(output) if process.returncode == 0 else None
        if recorded is not None:
            return parse(recorded, seconds, rate)
        said = stderr.decode(errors="replace").strip().splitlines()
        error = said[0] if said else f"exit {process.returncode}"
        await asyncio.sleep(0.5)
    raise RuntimeError(f"py-spy failed: {error}")
