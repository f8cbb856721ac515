"""A test-only experiment: the systems_sweep cells, with one fault injected on one rank.

HARNESS_TEST_FAULT=<kind>:<rank>:<n> makes rank <rank> misbehave when it starts its n-th cell
(0-based) of the run; without it the experiment is exactly systems_sweep. Kinds:
  kill     the rank kills itself with SIGKILL (a dead rank)
  stop     the rank stops itself with SIGSTOP (a stalled rank: alive, silent)
  raise    the cell raises on that rank (`*`: on every rank), so it is recorded as `error`
  cuda     the cell raises a sticky CUDA error's text (an illegal memory access) on that rank
  corrupt  the rank overwrites the table with garbage, then the cell runs as usual (a table
           damaged during the run: rank 0's next write must fail and not overwrite it)
Use with `experiment.module=tests.faulty_experiment`.
"""

from __future__ import annotations

import os
import signal
from typing import Any

from experiments import systems_sweep
from harness.run import table_path
from harness.system import RunContext

cells = systems_sweep.cells
validate = systems_sweep.validate
_started = 0


def run_cell(ctx: RunContext, cfg: Any, cell: dict):
    global _started
    n, _started = _started, _started + 1
    fault = os.environ.get("HARNESS_TEST_FAULT", "")
    if fault:
        kind, rank, at = fault.split(":")
        if rank in ("*", str(ctx.rank)) and n == int(at):
            if kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif kind == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif kind == "raise":
                raise RuntimeError("injected fault")
            elif kind == "cuda":
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            elif kind == "corrupt":
                table_path(cfg).write_bytes(b"not a parquet file")
            else:
                raise ValueError(f"unknown fault {kind!r}")
    return systems_sweep.run_cell(ctx, cfg, cell)
