"""Run a Python script under Triton's CPU interpreter in a fresh process.

TRITON_INTERPRET must be set before triton is imported, so a test process that has imported it
cannot switch: the script runs in a subprocess with CPU tensors, whatever GPU this process has.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_interpreted(script: str, timeout: int = 120, fast: bool = True) -> str:
    """The script's stdout; fails the test with its output's tail if it exits non-zero. fast:
    with tests/fast_interpreter.py's xor_sum path."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    if fast:
        script = "from tests.fast_interpreter import install\ninstall()\n" + script
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout
