"""`python -m harness.run` as a user runs it, and the /proc look-ups of the tests that watch its
ranks (tests/test_failing_ranks.py, tests/test_orphans.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the smoke cells with one fault injected on one rank (tests/faulty_experiment.py)
FAULTY = "experiment.module=tests.faulty_experiment"


def run(
    *overrides: str, env: dict | None = None, timeout: float = 60
) -> subprocess.CompletedProcess:
    """`python -m harness.run` as a user runs it (progress off unless asked)."""
    return subprocess.run(
        [sys.executable, "-m", "harness.run", "progress=false", *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def out(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout + proc.stderr


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


def children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:  # field 4 of stat: the parent pid
            kids.append(int(stat.parent.name))
    return kids


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""
