"""The rank side of a run: process-group set-up, the walk over the cells (rank 0 writes each
cell's rows) and the Reporter that tells the parent which cell runs (heartbeats)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from harness.errors import (
    CommFailure,
    ContextLost,
    is_comm_failure,
    is_sticky_cuda_error,
    looks_like_comm_failure,
)
from harness.preflight import load_experiment, table_path
from harness.records import ResultsTable, Row, provenance
from harness.system import RunContext
from harness.teardown import run_end
from harness.timing import STATE

#: bound on a rank's start (imports, rendezvous) before its first cell, in seconds
STARTUP_S = 120.0
#: prctl(2) option: the signal the kernel sends a process when its parent ends (Linux)
PR_SET_PDEATHSIG = 1


def end_with_parent(parent_pid: int) -> None:
    """Linux: the kernel SIGKILLs this rank the moment its parent ends (PR_SET_PDEATHSIG), also
    one stopped or blocked in a collective, so a parent killed with SIGKILL leaves no rank that
    holds a GPU or writes a row (the Reporter's heartbeat notices it too, later)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # no usable libc: the heartbeat still notices
            pass
    if os.getppid() != parent_pid:  # the parent ended before the signal was asked for
        os._exit(1)


class Reporter:
    """A rank's reports to the parent through its own pipe (one writer per pipe: a rank killed
    mid-write cannot block another's). With a parent, a heartbeat every `beat_s`, ("beat",) or
    in a cell ("beat", *STATE.report()); once the parent is gone (the pipe broke, or
    `parent_pid` is no longer the parent) the rank ends at once, writing nothing. Without a
    parent (torchrun) it only draws rank 0's progress bar."""

    def __init__(
        self, conn: Connection | None, beat_s: float, bar: Any = None, parent_pid: int | None = None
    ):
        self.conn, self.bar, self.parent_pid = conn, bar, parent_pid
        #: indexes of the cells whose rows this rank wrote
        self.written_cells: set[int] = set()
        self._lock = threading.Lock()
        #: a cell started in this process: the beats carry STATE from then on
        self._in_cells = False
        if conn is not None:
            threading.Thread(target=self._beat, args=(beat_s,), daemon=True).start()

    def send(self, *msg: Any) -> None:
        if self.conn is not None:
            with self._lock:
                self.conn.send(msg)

    def check_parent(self) -> None:
        """End this process now if its parent is gone (a no-op without one)."""
        if self.parent_pid is not None and os.getppid() != self.parent_pid:
            os._exit(1)

    def _beat(self, every: float) -> None:
        while True:
            try:
                with self._lock:  # the state and the message of one cell (see cell)
                    self.conn.send(("beat", *(STATE.report() if self._in_cells else ())))
            except OSError:  # the parent's end of the pipe closed: nobody supervises this rank
                os._exit(1)
            self.check_parent()
            time.sleep(every)

    def cell(self, index: int) -> None:
        with self._lock:  # no later beat carries the state of the cell before
            STATE.reset()
            self._in_cells = True
            if self.conn is not None:
                self.conn.send(("cell", index))

    def written(self, index: int, rows: list[Row]) -> None:
        self.written_cells.add(index)
        self.send("written", index, [(r.system, r.status) for r in rows])
        if self.bar is not None:
            self.bar.set_postfix_str(f"{rows[-1].system}:{rows[-1].status}")
            self.bar.update(1)

    def done(self) -> None:
        self.send("done")

    def failed(self, exc: BaseException) -> None:
        comm = is_comm_failure(exc)
        text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:400]
        self.send("failed", text, comm, traceback.format_exc())


def _init_group(cfg: Any, rank: int, world: int, device: torch.device, rendezvous) -> None:
    """The process group, its collectives bounded by hardware.timeout_s. With a rendezvous
    (host, port) every rank first waits on a TCP store until all have started (STARTUP_S), so
    one rank's slow imports do not count against the collectives' time-out."""
    timeout = timedelta(seconds=float(cfg.hardware.timeout_s))
    kw: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    if rendezvous is None:  # torchrun / Slurm: env://
        dist.init_process_group(cfg.hardware.backend, timeout=timeout, **kw)
        return
    host, port = rendezvous
    store = dist.TCPStore(
        host, port, world, is_master=rank == 0, timeout=timedelta(seconds=STARTUP_S)
    )
    if store.add("harness/started", 1) == world:
        store.set("harness/go", "1")
    store.wait(["harness/go"])
    dist.init_process_group(
        cfg.hardware.backend, store=store, rank=rank, world_size=world, timeout=timeout, **kw
    )


def worker(
    rank: int,
    world: int,
    local_rank: int,
    cfg_dict: dict,
    cells: list[dict],
    report: Reporter,
    rendezvous: tuple[str, int] | None,
) -> None:
    """One rank: init the process group once, walk the cells, rank 0 writes."""
    cfg = OmegaConf.create(cfg_dict)
    if cfg.hardware.device == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    _init_group(cfg, rank, world, device, rendezvous)
    from harness.measure import close_agreement, open_agreement

    open_agreement(timedelta(seconds=float(cfg.hardware.timeout_s)))  # ranks fail together
    ctx = RunContext(rank, world, device, None, cfg.hardware.backend)
    if rendezvous is None:  # torchrun: rank 0 read the table; every rank runs its choice
        todo = [[c["cell_hash"] for c in cells] if rank == 0 else None]
        dist.broadcast_object_list(todo, src=0)
        cells = [c for c in cells if c["cell_hash"] in set(todo[0])]
    _walk(ctx, cfg, cells, report)
    report.done()
    run_end()  # what systems keep for the run (deepep's Buffer) goes before the group does
    close_agreement()
    dist.destroy_process_group()


def _stamp(rows: list[Row], cfg: Any, ctx: RunContext) -> list[Row]:
    """Every row says how it was run; `tol` is measure.tol unless the experiment set it."""
    for r in rows:
        r.hardware, r.backend = cfg.hardware.name, ctx.backend
        r.warmup, r.iters = cfg.measure.warmup, cfg.measure.iters
        if r.tol != r.tol:  # NaN: not set by the experiment
            r.tol = cfg.measure.tol
    return rows


def _batches(todo: list[dict], grouped: bool) -> list[list[int]]:
    """Indexes of the cells run together: each alone, or (grouped) a workload's consecutive ones."""
    from harness.measure import workload_key

    out: list[list[int]] = []
    for i, cell in enumerate(todo):
        if grouped and out and workload_key(todo[out[-1][0]]) == workload_key(cell):
            out[-1].append(i)
        else:
            out.append([i])
    return out


def _error_row(cfg: Any, cell: dict, exc: BaseException) -> Row:
    kw = dict(experiment=cfg.experiment.name, system=cell.get("system", ""), status="error")
    kw |= dict(cell_hash=cell["cell_hash"], reason=f"{type(exc).__name__}: {exc}"[:500])
    return Row(**kw, **provenance())


def _walk(ctx: RunContext, cfg: Any, todo: list[dict], report: Reporter) -> None:
    exp = load_experiment(cfg)
    table = ResultsTable(table_path(cfg))
    grouped = int(cfg.measure.get("rounds", 1)) > 1 and hasattr(exp, "run_workload")
    for batch in _batches(todo, grouped):
        report.cell(batch[0])
        cells = [todo[i] for i in batch]
        try:
            if grouped:
                per_cell = [[r] for r in exp.run_workload(ctx, cfg, cells)]
            else:
                per_cell = [exp.run_cell(ctx, cfg, cells[0])]
        except Exception as exc:  # noqa: BLE001 - the sweep survives a failing cell
            if is_comm_failure(exc):
                raise
            per_cell = [[_error_row(cfg, c, exc)] for c in cells]
        lost = []
        for i, rows in zip(batch, per_cell):
            for r in rows:  # an experiment that caught a broken process group itself
                if r.status == "error" and looks_like_comm_failure(r.reason):
                    raise CommFailure(r.reason)
            if ctx.rank == 0:
                report.check_parent()  # an orphaned rank writes no row
                table.append(_stamp(rows, cfg, ctx))
                report.written(i, rows)
            lost += [
                r.reason for r in rows if r.status == "error" and is_sticky_cuda_error(r.reason)
            ]
        if lost:
            raise ContextLost(f"CUDA context lost in cell {cells[0]['cell_hash']}: {lost[0][:200]}")


def spawn_entry(
    rank: int,
    world: int,
    cfg_dict: dict,
    cells: list[dict],
    rendezvous: tuple[str, int],
    conn: Connection,
    parent_pid: int,
) -> None:
    end_with_parent(parent_pid)
    beat_s = min(0.5, float(cfg_dict["hardware"]["timeout_s"]) / 10)
    report = Reporter(conn, beat_s, parent_pid=parent_pid)
    try:
        worker(rank, world, rank, cfg_dict, cells, report, rendezvous)
    except BaseException as exc:  # noqa: BLE001 - reported once to the parent, which decides
        try:
            report.failed(exc)
        finally:
            os._exit(1)  # no teardown: a broken process group can hang in its destructor
