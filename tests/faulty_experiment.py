"""A test-only experiment: the systems_sweep cells, with one fault injected on one rank.

HARNESS_TEST_FAULT=<kind>:<rank>:<n> makes rank <rank> misbehave when it starts its n-th cell
(0-based) of the run; without it the experiment is exactly systems_sweep. Kinds:
  kill     the rank kills itself with SIGKILL (a dead rank)
  stop     the rank stops itself with SIGSTOP (a stalled rank: alive, silent)
  raise    the cell raises on that rank (`*`: on every rank), so it is recorded as `error`
  cuda     the cell raises a sticky CUDA error's text (an illegal memory access) on that rank
  corrupt  the rank overwrites the table with garbage, then the cell runs as usual (a table
           damaged during the run: rank 0's next write must fail and not overwrite it)
The kinds below act through the fake system `faulty` (FaultySystem: every rank's exact output,
no communication of its own), run with `+experiment.systems.faulty={}` and
`experiment.select=[faulty]`; on the other ranks, and in the other cells, it is right:
  setup    its setup raises on that rank
  step     its timed() raises on that rank, mid-way through the first timed loop
  wrong    its output is wrong on that rank (the first check fails there only)
  hang     its timed() sleeps an hour on that rank, mid-way through the first timed loop (a
           wait that never completes)
  orphan   its setup raises on that rank before a collective of the system's own, which the
           other ranks then wait in
HARNESS_TEST_FAULT_ONCE=<folder>: the fault fires once per run (a file there says it fired), so
fresh ranks (hardware.restarts) run the remaining cells without it.
Use with `experiment.module=tests.faulty_experiment`.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from experiments import systems_sweep
from harness.preflight import table_path
from harness.reference import reference_local
from harness.system import REGISTRY, CellInputs, RunContext, Step, System, SystemInfo, register

cells = systems_sweep.cells
validate = systems_sweep.validate
_started = 0
#: the fault FaultySystem injects in this process's cell in flight (None: it is right)
_armed: str | None = None
SYSTEM_KINDS = ("setup", "step", "wrong", "hang", "orphan")


class _FaultyStep(Step):
    """Every call returns this rank's reference output; the `step` and `hang` faults act on
    the 4th call of timed() (the 1st is the check before timing, the 2nd the warm-up)."""

    timed_rank = 0

    def __init__(self, out: torch.Tensor, fault: str | None) -> None:
        self.out, self.fault, self.calls = out, fault, 0

    def timed(self) -> torch.Tensor:
        self.calls += 1
        if self.calls == 4 and self.fault == "step":
            raise RuntimeError("injected fault mid-step")
        if self.calls == 4 and self.fault == "hang":
            time.sleep(3600)
        return self.out.clone()

    def outputs(self) -> torch.Tensor:
        return self.out + 1.0 if self.fault == "wrong" else self.out.clone()

    def capture_blocker(self) -> str | None:
        return "faulty: a test system"


class FaultySystem(System):
    """A fake system for the fail-together tests: exact on every rank but the one armed."""

    name = "faulty"

    def build(self, ranks: list[CellInputs]) -> Step:
        fault = _armed
        if self.ctx.world_size > 1:  # the system's own collective
            if fault == "orphan":
                raise RuntimeError("injected fault before a collective")
            dist.barrier(group=self.ctx.group)
        if fault == "setup":
            raise RuntimeError("injected fault in setup")
        spec = ranks[0].spec
        return _FaultyStep(reference_local(spec, self.ctx.rank, self.ctx.device), fault)


if "faulty" not in REGISTRY:
    register(
        SystemInfo(
            name="faulty",
            label="Faulty (test)",
            target="tests.faulty_experiment:FaultySystem",
        )
    )


def _fires_once() -> bool:
    """False where HARNESS_TEST_FAULT_ONCE names a folder in which the fault already fired."""
    folder = os.environ.get("HARNESS_TEST_FAULT_ONCE")
    if not folder:
        return True
    try:
        os.close(os.open(Path(folder) / "fired", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def run_cell(ctx: RunContext, cfg: Any, cell: dict):
    global _started, _armed
    n, _started = _started, _started + 1
    _armed = None
    fault = os.environ.get("HARNESS_TEST_FAULT", "")
    if fault:
        kind, rank, at = fault.split(":")
        if rank in ("*", str(ctx.rank)) and n == int(at) and _fires_once():
            if kind in SYSTEM_KINDS:
                _armed = kind
            elif kind == "kill":
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
