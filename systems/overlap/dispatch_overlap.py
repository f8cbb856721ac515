"""dispatch_overlap=on (beyond the paper): fc1 starts on the bands whose rows have landed.

One played rank's state and launches. The dispatch's copy of the received rows into fc1's
padded input and fc1 + GELU run as ONE queue on every SM (kernels/copy_fc1.py): programs draw
copy items (a column chunk of a band) and fc1 tiles from one ticket, each band's copies a few
bands ahead of its tiles, both in the plan's visiting order; a tile waits, bounded, for its
band's copies. Nothing is set aside for the copy and no two kernels must share the GPU.

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
from systems.overlap.kernels.copy_fc1 import COPIES, QUEUE, TILES, launch_copy_fc1, sync_words
from systems.overlap.tuning import interpreter_config, pick_config

#: columns of one copy item: 64 KB of bf16 rows per item at tile_m 128
CHUNK = 256
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
            self.chunk = CHUNK
        else:
            cfg = interpreter_config(plan.tile_m)
            self.programs, self.chunk = INTERPRETER_PROGRAMS, INTERPRETER_CHUNK
        self.tile = dict(block_n=cfg.block_n, block_k=cfg.block_k, num_warps=cfg.num_warps,
                         num_stages=cfg.num_stages, use_tma=cfg.use_tma)  # fmt: skip
        self.bands = max(plan.schedule.numel(), 1)
        #: the bands' arrival counters, their places, the work ticket, the place ticket
        self.sync = torch.zeros(sync_words(self.bands), dtype=torch.int32, device=dev)
        self.err = new_error_buffer(dev)
        self.wait = dict(err=self.err, rank=rank, timeout_ns=2_000_000_000, max_spins=2000,
                         clock=torch.zeros(self.programs, dtype=torch.int64, device=dev),
                         use_timer=self.gpu)  # fmt: skip
        if not self.gpu:
            self.wait["max_spins"] = INTERPRETER_SPINS
        rows = plan.gather_index.numel()
        self.x_pad = torch.empty(rows, H, dtype=w1.dtype, device=dev)
        self.h = torch.empty(rows, F, dtype=w1.dtype, device=dev)
        self._src = self._rows = None

    def _launch(self, plan, mode: int, programs: int | None = None) -> None:
        self.sync.zero_()
        src, rows = (self._src, self._rows) if self._src is not None else (self.x_pad, None)
        rows = plan.gather_index if rows is None else rows  # MODE 2 reads neither
        launch_copy_fc1(
            src, rows, self.x_pad, self.w1, self.h, plan, self.sync, self.wait,
            mode=mode, programs=programs or self.programs, chunk=self.chunk, **self.tile,
        )  # fmt: skip

    def run(self, src: torch.Tensor, rows: torch.Tensor, plan) -> torch.Tensor:
        """The copies and fc1 + GELU as one queue: h [P', F] (rows past n_padded unread)."""
        self._src, self._rows = src, rows
        self._launch(plan, QUEUE)
        return self.h

    def put_alone(self, src: torch.Tensor, rows: torch.Tensor, plan) -> torch.Tensor:
        self._src, self._rows = src, rows
        self._launch(plan, COPIES)
        return self.x_pad

    def fc1_alone(self, plan) -> torch.Tensor:
        self._launch(plan, TILES)
        return self.h

    def check(self) -> None:
        raise_if_error(self.err)

    def places(self, plan) -> torch.Tensor:
        """[B] each band's place in the last run's arrival order (1 = first)."""
        n = plan.schedule.numel()
        return self.sync[n : 2 * n]
