"""The parent side of a run on one node: spawn W ranks, watch their reports and heartbeats, and
end the run within `hardware.timeout_s` when a rank dies, fails or stalls, naming the rank and
the cell. Ranks end a failed cell together themselves (harness.measure.stage); for a cell over
its time-out the heartbeats (each rank's stage, whether it waits in a collective of the harness,
a failure not agreed on yet) let the parent name the rank that failed or is stuck.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp
from omegaconf import OmegaConf

from harness.preflight import Plan, describe
from harness.rank import STARTUP_S, spawn_entry

#: a rank whose heartbeat is older than this when the run stops is named as the stalled one
STALE_BEAT_S = 2.0
#: after the first sign of trouble, how long the parent collects reports before it decides
GRACE_S = 1.0


@dataclass
class _Rank:
    proc: Any
    conn: Connection | None
    phase: str = "start"  # start | cell | done
    cell: int = -1
    since: float = 0.0
    beat: float = 0.0
    written: set[int] = field(default_factory=set)
    failure: tuple[str, bool, str] | None = None  # (message, comm, traceback)
    #: from its heartbeats in the cell (harness.timing.RankState)
    stage: str = ""
    waiting: bool = False
    unsettled: str | None = None


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


#: the scheduler states (/proc/<pid>/stat) a stalled rank is named with
_STATES = {"T": "stopped", "t": "stopped (traced)", "Z": "exited", "D": "in uninterruptible I/O"}


def _proc_state(pid: int) -> str:
    """The process's scheduler state from /proc (Linux), e.g. 'stopped'; '' where unknown."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""
    return _STATES.get(state, "")


def _take(rank: _Rank, msg: tuple, bar: Any) -> None:
    """One report: a heartbeat, a cell started, a cell's rows written, done, failed."""
    t = time.monotonic()
    rank.beat = t
    if msg[0] == "beat":
        state = tuple(msg[1:]) or ("", None, None)
        rank.stage, rank.waiting, rank.unsettled = state[0], state[1] is not None, state[2]
    elif msg[0] == "cell":
        rank.phase, rank.cell, rank.since = "cell", msg[1], t
        rank.stage, rank.waiting, rank.unsettled = "", False, None
    elif msg[0] == "written":
        rank.written.add(msg[1])
        if bar is not None:
            bar.set_postfix_str(f"{msg[2][-1][0]}:{msg[2][-1][1]}")
            bar.update(1)
    elif msg[0] == "done":
        rank.phase, rank.since = "done", t
    elif msg[0] == "failed":
        rank.failure = (msg[1], msg[2], msg[3])


def drain(rank: _Rank, bar: Any) -> None:
    """Take the reports waiting in the rank's pipe, not blocking; at its end conn = None."""
    while rank.conn is not None:
        try:
            if not rank.conn.poll(0):
                return
            msg = rank.conn.recv()
        except (EOFError, OSError):
            rank.conn = None
            return
        _take(rank, msg, bar)


def supervise(ranks: list[_Rank], todo: list[dict], cfg: Any, bar: Any) -> str | None:
    """Watch the ranks until all are done (None) or the run must stop (the reason, one line).
    A rank's reports are all read before its exit code is judged (a lagging parent still finds
    the rows of a rank that finished and exited meanwhile)."""
    timeout = float(cfg.hardware.timeout_s)
    now = time.monotonic()
    for r in ranks:
        r.since = r.beat = now
    trouble_at: float | None = None
    while True:
        conns = [r.conn for r in ranks if r.conn is not None]
        if not conns:
            time.sleep(0.1)
        for conn in wait(conns, timeout=0.1):
            drain(next(r for r in ranks if r.conn is conn), bar)
        for r in ranks:  # an exited rank's last reports may have come after the wait
            if r.proc.exitcode is not None:
                drain(r, bar)
        now = time.monotonic()
        if all(r.phase == "done" and r.proc.exitcode is not None for r in ranks):
            return None
        for r in ranks:
            exited = r.proc.exitcode is not None
            limit = STARTUP_S if r.phase == "start" else timeout
            if r.phase == "done":  # its rows are written; a hang in teardown is not a failure
                if not exited and now - r.since > timeout:
                    r.proc.kill()
            elif trouble_at is None and (
                r.failure or exited or now - r.since > limit or now - r.beat > limit
            ):
                trouble_at = now
        if trouble_at is not None:
            settled = all(r.proc.exitcode is not None or r.failure for r in ranks)
            if settled or now - trouble_at > GRACE_S:
                for r in ranks:  # the last word of every rank, also of one that exits now
                    drain(r, bar)
                return _diagnose(ranks, todo, timeout, now)


def _diagnose(ranks: list[_Rank], todo: list[dict], timeout: float, now: float) -> str:
    """The root cause, in order: a rank's own failure, a rank that died, a rank that stopped
    (no heartbeat), a rank that failed in its cell and whose peers could not end it with it, a
    rank stuck while its peers waited for it, a broken collective, a cell over the time-out."""

    def where(r: _Rank) -> str:
        if r.phase == "cell":
            return f"in cell {describe(todo[r.cell])}"
        return "before its first cell" if r.phase == "start" else "after its last cell"

    for r in ranks:
        if r.failure and not r.failure[1]:
            full = f"\n{r.failure[2]}" if os.environ.get("HYDRA_FULL_ERROR") == "1" else ""
            return f"rank {ranks.index(r)} failed {where(r)}: {r.failure[0]}{full}"
    for i, r in enumerate(ranks):
        code = r.proc.exitcode
        if code is not None and code != 0 and not r.failure:
            how = f"killed by {_signal_name(code)}" if code < 0 else f"exit code {code}"
            return f"rank {i} died ({how}) {where(r)}"
        if code == 0 and r.phase != "done":
            return f"rank {i} exited early {where(r)}"
    stale_s = min(STALE_BEAT_S, timeout / 2)
    stale = [
        (i, r) for i, r in enumerate(ranks) if r.proc.exitcode is None and now - r.beat > stale_s
    ]
    if stale:
        i, r = max(stale, key=lambda ir: now - ir[1].beat)
        state = _proc_state(r.proc.pid)
        return (
            f"rank {i} stopped responding (no heartbeat for {now - r.beat:.0f} s"
            f"{', process ' + state if state else ''}) {where(r)}"
        )
    in_cell = [(i, r) for i, r in enumerate(ranks) if r.phase == "cell"]
    for i, r in in_cell:
        if r.unsettled:
            return (
                f"rank {i} failed {where(r)}: {r.unsettled}; the other ranks did not end the "
                f"cell with it within {timeout:g} s (hardware.timeout_s)"
            )
    waited = [i for i, r in in_cell if r.waiting]
    stuck = [(i, r) for i, r in in_cell if not r.waiting]
    if waited and stuck:
        i, r = stuck[0]
        names = ", ".join(str(j) for j, _ in stuck)
        at = f" in {r.stage}" if r.stage else ""
        return (
            f"rank{'s' if len(stuck) > 1 else ''} {names} made no progress for {timeout:g} s "
            f"(hardware.timeout_s) {where(r)}{at}; rank(s) {', '.join(map(str, waited))} "
            "waited for it in a collective"
        )
    for i, r in enumerate(ranks):
        if r.failure:
            return f"rank {i}: the process group broke {where(r)}: {r.failure[0]}"
    waiting = [r for r in ranks if r.phase != "done"] or ranks
    behind = min(waiting, key=lambda r: (r.phase == "cell", r.cell))
    late = [i for i, r in enumerate(ranks) if r.phase == behind.phase and r.cell == behind.cell]
    return (
        f"rank(s) {', '.join(map(str, late))} made no progress for {timeout:g} s "
        f"(hardware.timeout_s) {where(behind)}"
    )


@contextmanager
def _ctrl_c_ignored():
    """SIGINT ignored while a rank is spawned: the rank inherits it, so a terminal's Ctrl-C (sent
    to the whole process group) leaves the ranks to the parent, which ends them and says what
    was written, instead of every rank printing a trace."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old if old is not None else signal.SIG_DFL)


def progress_bar(cfg: Any, total: int):
    if not (cfg.progress and total):
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=cfg.experiment.name, file=sys.stderr, unit="cell")


def run_ranks(cfg: Any, plan: Plan) -> tuple[str | None, set[int], int | None]:
    """Spawn one process per rank and supervise them: the reason the run stopped (or None), the
    indexes of the cells whose rows rank 0 wrote, and the unwritten cell in flight (or None). A
    rank ends as soon as this process does (harness.rank.end_with_parent: on Linux when the
    calling thread ends, so call it from a thread that lives as long as the run)."""
    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    ctx = mp.get_context("spawn")
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        rendezvous = ("127.0.0.1", s.getsockname()[1])
    ranks: list[_Rank] = []
    bar = None
    try:  # a signal while the ranks start ends those started too
        for rank in range(plan.world):
            recv, send = ctx.Pipe(duplex=False)
            args = (rank, plan.world, cfg_dict, plan.todo, rendezvous, send, os.getpid())
            proc = ctx.Process(target=spawn_entry, args=args, name=f"harness-rank{rank}")
            with _ctrl_c_ignored():
                proc.start()
            send.close()
            ranks.append(_Rank(proc, recv))
        bar = progress_bar(cfg, len(plan.todo))
        reason = supervise(ranks, plan.todo, cfg, bar)
    finally:
        if bar is not None:
            bar.close()
        for r in ranks:
            if r.proc.exitcode is None:
                r.proc.kill()  # SIGKILL: also ends a stopped process
        for r in ranks:
            r.proc.join(10)
    # the earliest cell a rank started and rank 0 did not write: where the run broke (a rank
    # that finished it may already wait in the next one)
    in_flight = {r.cell for r in ranks if r.phase == "cell"} - ranks[0].written
    cell = min(in_flight) if reason is not None and in_flight else None
    return reason, ranks[0].written, cell
