"""dispatch_overlap=on (beyond the paper): fc1 starts on the bands whose rows have landed.

One played rank's state and launches (kernels/copy_fc1.py). The dispatch's copy of the
received rows into fc1's padded input and fc1 + GELU run at once, on two streams, both on
every SM: the copy as small CTAs (no shared memory, few registers) beside fc1's tile CTAs,
which wait, bounded, for their band's copies. Both walk the plan's visiting order, so the
bands fc1 takes first are copied first. The copies never wait; before their first run side by
side the host checks that a copy CTA fits on an SM beside as many tile CTAs as the SM holds
(runner.residency_report), so the copies always find room and no tile can wait forever.
On the CPU (Triton's interpreter) the two run one after the other.

  run(src, rows, plan)        -> h [P', F]: gelu(fc1), the phase as a layer step runs it
  put_alone(src, rows, plan)  the copies alone on every SM (its bound: m_dispatch_alone_ms)
  fc1_alone(plan)             fc1 + GELU alone on every SM, no waits, on the copied input
                              (m_fc1_alone_ms)
  check()                     OverlapTimeoutError after an arrival that never came (rank,
                              source, expert, band)
src [S, H]: the played ranks' stacked tokens; rows [R]: received row r is src[rows[r]]; plan:
this step's device plan (a DevicePlanBuilder's, the same object every step). The sync words
(arrival counters, places, tickets) are zeroed before every run (one memset), so a CUDA graph
replays one fixed target.
"""

from __future__ import annotations

import torch

from systems.overlap.errors import new_error_buffer, raise_if_error
from systems.overlap.kernels.copy_fc1 import (
    COPIES,
    TILES,
    WAITING_TILES,
    launch_copy_fc1,
    sync_words,
)
from systems.overlap.tuning import interpreter_config, pick_config

#: columns of one copy item, and the copy CTA's warps (16 rows x 256 columns a step: about 72
#: registers a thread on sm_90, so the CTA fits beside a tile CTA of 128 x 128)
CHUNK = 256
COPY_WARPS = 4
#: fc1's tiles: 128 columns, 8 warps (about 200 registers a thread: room for a copy CTA; a
#: 256-column tile takes every register of the SM)
TILE_N, TILE_WARPS = 128, 8
#: the interpreter's programs (no SMs to count), its copy chunk and its bound on every spin
INTERPRETER_PROGRAMS = 2
INTERPRETER_CHUNK = 8
INTERPRETER_SPINS = 200


class DispatchOverlap:
    """The copy + fc1 phase of one played rank. w1 [E, H, F]; plan: the rank's plan (its
    tile_m and worst-case sizes fix the buffers); rank: for the error record."""

    def __init__(self, w1: torch.Tensor, plan, rank: int) -> None:
        dev = w1.device
        self.w1, self.device = w1, dev
        _, H, F = w1.shape
        self.gpu = dev.type == "cuda"
        if self.gpu:
            cfg = pick_config(plan.tile_m, H, F, w1.dtype)
            self.programs = torch.cuda.get_device_properties(dev).multi_processor_count
            self.chunk, block_n, warps = CHUNK, TILE_N, TILE_WARPS
        else:
            cfg = interpreter_config(plan.tile_m)
            self.programs, self.chunk = INTERPRETER_PROGRAMS, INTERPRETER_CHUNK
            block_n, warps = cfg.block_n, cfg.num_warps
        self.tile = dict(block_n=block_n, block_k=cfg.block_k, num_warps=warps,
                         num_stages=cfg.num_stages, use_tma=cfg.use_tma)  # fmt: skip
        self.copy = {**self.tile, "num_warps": COPY_WARPS if self.gpu else warps, "num_stages": 1}
        #: the bands' arrival counters, their places, the two tickets and the place ticket
        self.sync = torch.zeros(sync_words(plan.schedule.numel()), dtype=torch.int32, device=dev)
        self.err = new_error_buffer(dev)
        clock = torch.zeros(self.programs, dtype=torch.int64, device=dev)  # the tiles' scratch
        spins = 2000 if self.gpu else INTERPRETER_SPINS
        self.wait = dict(err=self.err, rank=rank, timeout_ns=2_000_000_000, clock=clock,
                         max_spins=spins, use_timer=self.gpu)  # fmt: skip
        rows = plan.gather_index.numel()
        self.x_pad = torch.empty(rows, H, dtype=w1.dtype, device=dev)
        self.h = torch.empty(rows, F, dtype=w1.dtype, device=dev)
        self.residency: dict | None = None  # checked before the first run side by side
        if self.gpu:
            self.put_stream = torch.cuda.Stream(dev, priority=-3)
            self.fc1_stream = torch.cuda.Stream(dev, priority=0)
            self.events = tuple(torch.cuda.Event() for _ in range(3))

    def _launch(self, src, rows, plan, mode: int, compile_only: bool = False):
        cfg = self.copy if mode == COPIES else self.tile
        return launch_copy_fc1(
            src, rows, self.x_pad, self.w1, self.h, plan, self.sync, self.wait, mode=mode,
            programs=self.programs, chunk=self.chunk, compile_only=compile_only, **cfg,
        )  # fmt: skip

    def check_residency(self, src: torch.Tensor, rows: torch.Tensor, plan) -> dict:
        """The compiled copies and waiting tiles (not launched) -> runner.residency_report;
        ValueError where a copy CTA may find no room beside the tile CTAs."""
        from systems.overlap.runner import residency_report

        tiles, copies = (self._launch(src, rows, plan, m, True) for m in (WAITING_TILES, COPIES))
        for k in (tiles, copies):
            k._init_handles()  # n_regs
        rep = residency_report(tiles, copies, self.device)
        if not rep["consumer_beside_full_sm"]:
            raise ValueError(
                f"dispatch_overlap: a copy CTA ({rep['consumer']}) does not fit on an SM beside "
                f"{rep['producers_per_sm']} fc1 tile CTA(s) ({rep['producer']}): fc1 could wait "
                "for copies that never start"
            )
        return rep

    def run(self, src: torch.Tensor, rows: torch.Tensor, plan) -> torch.Tensor:
        """The copies and fc1 + GELU side by side: h [P', F] (rows past n_padded unread)."""
        self.sync.zero_()
        if not self.gpu:
            self._launch(src, rows, plan, COPIES)
            self._launch(src, rows, plan, WAITING_TILES)
            return self.h
        if self.residency is None:
            self.residency = self.check_residency(src, rows, plan)
        cur = torch.cuda.current_stream(self.device)
        fork, put_done, fc1_done = self.events
        fork.record(cur)
        self.put_stream.wait_event(fork)
        self.fc1_stream.wait_event(fork)
        try:
            torch.cuda.set_stream(self.put_stream)
            self._launch(src, rows, plan, COPIES)
            put_done.record(self.put_stream)
            torch.cuda.set_stream(self.fc1_stream)
            self._launch(src, rows, plan, WAITING_TILES)
            fc1_done.record(self.fc1_stream)
        finally:
            torch.cuda.set_stream(cur)
        cur.wait_event(put_done)
        cur.wait_event(fc1_done)
        return self.h

    def put_alone(self, src: torch.Tensor, rows: torch.Tensor, plan) -> torch.Tensor:
        self.sync.zero_()
        self._launch(src, rows, plan, COPIES)
        return self.x_pad

    def fc1_alone(self, plan) -> torch.Tensor:
        self.sync.zero_()
        self._launch(self.x_pad, plan.gather_index, plan, TILES)  # src, rows: unread
        return self.h

    def check(self) -> None:
        raise_if_error(self.err)

    def places(self, plan) -> torch.Tensor:
        """[B'] each band's place in the last run's arrival order (1 = first)."""
        n = plan.schedule.numel()
        return self.sync[n : 2 * n]
