"""dispatch_overlap=on (beyond the paper): fc1 starts on the bands whose rows have landed.

One played rank's state and launches. The dispatch's copy of the received rows into fc1's
padded input (kernels/put.py) and fc1's producer in its waiting mode (kernels/producer.py
ArrivalWait) run concurrently: the copy on PUT_PROGRAMS programs of a high-priority stream,
launched first so that its CTAs are resident before any fc1 tile waits, fc1 on the other SMs;
both walk the plan's visiting order, so the bands fc1 takes first are copied first. Then GELU
over the real rows. On the CPU (Triton's interpreter) the two run one after the other.

  run(src, rows, plan)        -> h [P', F]: the phase as a layer step runs it
  put_alone(src, rows, plan)  the copy alone (its bound: m_dispatch_alone_ms)
  fc1_alone(plan)             fc1's producer alone on every SM, no waits, on the copied input
                              (m_fc1_alone_ms)
  check()                     OverlapTimeoutError after an arrival that never came (rank,
                              source, expert, band)
src [S, H]: the played ranks' stacked tokens; rows [R]: received row r is src[rows[r]]; plan:
this step's device plan (a DevicePlanBuilder's, the same object every step). The arrival
counters are zeroed before every run (one memset), so a CUDA graph replays one fixed target.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from harness.experts import activation
from systems.overlap.errors import new_error_buffer, raise_if_error
from systems.overlap.kernels.producer import ArrivalWait, launch_producer
from systems.overlap.kernels.put import launch_put_bands
from systems.overlap.tuning import interpreter_config, pick_config

#: programs of the copy: each moves one band (tile_m rows x H) at a time
PUT_PROGRAMS = 16
#: the interpreter's programs (no SMs to count) and its bound on every spin
INTERPRETER_PROGRAMS = 2
INTERPRETER_SPINS = 200


class DispatchOverlap:
    """The copy + fc1 phase of one played rank. w1 [E, H, F]; plan: the rank's plan (its
    tile_m, group_cap and worst-case sizes fix the buffers); rank: for the error record."""

    def __init__(self, w1: torch.Tensor, plan, rank: int) -> None:
        dev = w1.device
        self.w1, self.device = w1, dev
        _, H, F = w1.shape
        self.gpu = dev.type == "cuda"
        cap = plan.group_cap  # the plan's swizzle groups were built for it
        if self.gpu:
            cfg = pick_config(plan.tile_m, H, F, w1.dtype)
            sms = torch.cuda.get_device_properties(dev).multi_processor_count
            self.programs = sms - PUT_PROGRAMS
            self.all_sms = sms
        else:
            cfg = interpreter_config(plan.tile_m)
            self.programs = self.all_sms = INTERPRETER_PROGRAMS
        group_m = cap if cap > 0 else (1 if cfg.expert_groups else cfg.group_m)
        self.tile = replace(cfg, expert_groups=cap > 0, group_m=group_m)
        bands = max(plan.schedule.numel(), 1)
        #: each band's place in the arrival order (0: not arrived), then the copy's ticket
        self.arrived = torch.zeros(bands + 1, dtype=torch.int32, device=dev)
        self.unused = torch.zeros(bands, dtype=torch.int32, device=dev)  # no ready flags
        self.err = new_error_buffer(dev)
        clock = torch.zeros(self.all_sms, dtype=torch.int64, device=dev)
        spins = dict(use_timer=False, max_spins=INTERPRETER_SPINS) if not self.gpu else {}
        self.wait = ArrivalWait(self.arrived, self.err, clock, rank, **spins)
        rows = plan.gather_index.numel()
        self.x_pad = torch.empty(rows, H, dtype=w1.dtype, device=dev)
        self.h = torch.empty(rows, F, dtype=w1.dtype, device=dev)
        if self.gpu:
            self.put_stream = torch.cuda.Stream(dev, priority=-3)
            self.fc1_stream = torch.cuda.Stream(dev, priority=0)
            self.events = tuple(torch.cuda.Event() for _ in range(3))

    def _put(self, src: torch.Tensor, rows: torch.Tensor, plan) -> None:
        n = PUT_PROGRAMS if self.gpu else INTERPRETER_PROGRAMS
        launch_put_bands(src, rows, self.x_pad, plan, self.arrived, num_programs=n)

    def _fc1(self, plan, wait: bool, programs: int) -> None:
        launch_producer(
            self.x_pad, self.w1, self.h, plan, self.unused, num_programs=programs,
            config=self.tile, signal=False, wait=self.wait if wait else None,
        )  # fmt: skip

    def run(self, src: torch.Tensor, rows: torch.Tensor, plan) -> torch.Tensor:
        """The copy and fc1 concurrently, then GELU: h [P', F] (rows past n_padded unread)."""
        self.arrived.zero_()
        if not self.gpu:
            self._put(src, rows, plan)
            self._fc1(plan, True, self.programs)
            return activation(self.h, plan.n_padded)
        cur = torch.cuda.current_stream(self.device)
        fork, put_done, fc1_done = self.events
        fork.record(cur)
        self.put_stream.wait_event(fork)
        self.fc1_stream.wait_event(fork)
        try:
            torch.cuda.set_stream(self.put_stream)
            self._put(src, rows, plan)
            put_done.record(self.put_stream)
            torch.cuda.set_stream(self.fc1_stream)
            self._fc1(plan, True, self.programs)
            fc1_done.record(self.fc1_stream)
        finally:
            torch.cuda.set_stream(cur)
        cur.wait_event(put_done)
        cur.wait_event(fc1_done)
        return activation(self.h, plan.n_padded)

    def put_alone(self, src: torch.Tensor, rows: torch.Tensor, plan) -> torch.Tensor:
        self.arrived.zero_()
        self._put(src, rows, plan)
        return self.x_pad

    def fc1_alone(self, plan) -> torch.Tensor:
        self._fc1(plan, False, self.all_sms)
        return self.h

    def check(self) -> None:
        raise_if_error(self.err)
