"""One rank's expert part of the overlap layer: stage A, fc1 + GELU, fc2 overlapped with the
tile-level combine, the scale. OverlapMoE holds one; PlayedLayerStep one per played rank.
Every step's plan, padded input, fc1 and fc2 outputs go into the same buffers (a
DevicePlanBuilder, one h, one y), so the runner's remembered launches hold from step to step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from harness import dispatch as ld
from harness.experts import activation, expert_gemm, grouped_mm_usable
from harness.scale import Scaler
from systems.overlap.params import OverlapParams
from systems.overlap.tuning import pick_config

#: producer programs in Triton's CPU interpreter (no SMs to count; the programs run in turn)
INTERPRETER_PROGRAMS = 2


def all_sms(device: torch.device) -> int:
    """The producer's grid on ALL SMs; the interpreter's on the CPU."""
    if device.type != "cuda":
        return INTERPRETER_PROGRAMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def make_runner(plan, weights: torch.Tensor, transport, params: OverlapParams):
    """The runner of one rank's plan for resolved knobs (small tiles in the CPU interpreter)."""
    from systems.overlap.runner import OverlapRunner
    from systems.overlap.tuning import interpreter_config, interpreter_consumer_config

    if transport.world != plan.world_size:  # a table entry past the fabric: an OOB write
        raise ValueError(f"a plan of W={plan.world_size} on a transport of {transport.world}")
    cpu = {}
    if weights.device.type != "cuda":
        cpu = dict(
            tile=interpreter_config(params.tile_m),
            consumer=interpreter_consumer_config(),
            num_programs=INTERPRETER_PROGRAMS,
        )
    return OverlapRunner(
        plan,
        weights,
        transport,
        ccta=params.ccta,
        order=params.order,
        consumer_sms=params.consumer,
        **cpu,
    )


@dataclass
class Held:
    """One dispatch kept with its own plan (for the bounds, the row's plan facts, the backward):
    plan: its CombinePlan on the device; x_pad [P', H] the padded fc1 input."""

    dispatch: ld.Dispatched
    plan: object
    x_pad: torch.Tensor


class RankExperts:
    """Stage A + fc1 + fc2/combine + scale of one rank, sized once for its worst case.

    w1 [E, H, F], w2 [E, F, H] (this rank's experts); rows = T*k of the largest step (the receive
    buffer's rows); params: resolved OverlapParams; first: one dispatch of this rank (its plan
    starts the runner)."""

    def __init__(
        self,
        w1,
        w2,
        world_size: int,
        rank: int,
        rows: int,
        transport,
        params: OverlapParams,
        first: ld.Dispatched,
    ) -> None:
        from systems.overlap.plan_device import DevicePlanBuilder, plan_bounds

        E, H, F = w1.shape
        self.w1, self.w2, self.world_size, self.rank = w1, w2, world_size, rank
        self.params = params
        #: keep: a training forward holds its own plan and padded input (kept) for backward.py;
        #: back: its systems.overlap.backward.RankBackward, made by the first backward
        self.keep, self.kept, self.back = False, None, None
        #: fc2 overlapped with the combine; at W=1 (no remote rows) the producer alone
        self.combines = world_size > 1
        group_cap = pick_config(params.tile_m, F, H, w2.dtype).group_cap
        self.plan_shape = dict(
            world_size=world_size,
            rank=rank,
            experts_per_rank=E,
            tile_m=params.tile_m,
            mgb=params.mgb,
            out_cols=H,
            elem_bytes=w2.element_size(),
            layout=params.layout,
            order=params.order,
            group_cap=group_cap,
        )
        self.builder = DevicePlanBuilder(**self.plan_shape)  # every step's plan, in place
        self.first = self.hold(first)
        self.runner = make_runner(self.first.plan, w2, transport, params)
        # band counters for the worst case of any step: every row of every rank comes here
        most = plan_bounds(
            world_size * rows,
            world_size=world_size,
            experts_per_rank=E,
            tile_m=params.tile_m,
            layout=params.layout,
        )["max_bands"]
        self.runner.band_ready = torch.zeros(most, dtype=torch.int32, device=w2.device)
        cfg = pick_config(params.tile_m, H, F, w1.dtype)  # fc1 [*, H] @ [H, F]
        if cfg.expert_groups and cfg.group_m != group_cap:  # fc2's groups
            cfg = replace(cfg, expert_groups=False, group_m=1)
        self.fc1_tile = cfg
        self.h: torch.Tensor | None = None  # every step's fc1 output [P', F]
        self.y: torch.Tensor | None = None  # every step's fc2 output [P', H]
        if w1.is_cuda:
            from harness.kernels.relaunch import LaunchMemo

            self.fc1_memo = LaunchMemo()

    def hold(self, d: ld.Dispatched) -> Held:
        """Stage A on one dispatch in new buffers (kept, not the builder's)."""
        from systems.overlap.plan_device import build_plan_device, padded_input_device

        n = None if d.received is None else d.received.n_rows
        ins = (d.recv_src, d.recv_expert, d.recv_dst_index)
        plan = build_plan_device(*ins, send_counts=d.send_counts, n_rows=n, **self.plan_shape)
        x_recv = d.x_recv if d.x_recv is not None else d.tokens.index_select(0, d.token_rows)
        return Held(d, plan, padded_input_device(x_recv, plan))

    def plan_of(self, r: ld.Received):
        """This step's plan from the received rows' labels, in the builder's one plan."""
        return self.builder(
            r.recv_src, r.recv_expert, r.recv_dst_index, send_counts=r.send_counts, n_rows=r.n_rows
        )

    def stage_a(self, d: ld.Dispatched, plan=None):
        """(plan, the padded fc1 input x_pad [P', H]) of one dispatch, in the builder's buffers,
        on the device with no host sync; plan: already built from its labels (plan_of)."""
        plan = self.plan_of(d.received) if plan is None else plan
        if d.x_recv is None:  # straight from the tokens into the padded layout
            return plan, self.builder.padded_input(d.tokens, rows=d.token_rows)
        return plan, self.builder.padded_input(d.x_recv)

    def experts(self, d: ld.Dispatched, plan=None) -> None:
        """Stage A, fc1 + GELU, fc2 overlapped with the combine's puts (at W=1 the producer
        alone on every SM, storing each row in place)."""
        if self.keep:  # a plan and padded input of its own, for the backward
            self.kept = self.hold(d)
            plan, x_pad = self.kept.plan, self.kept.x_pad
        else:
            plan, x_pad = self.stage_a(d, plan)
        self.fc2_combine(plan, self.fc1(plan, x_pad), overlapped=self.combines)

    def scale(self, d: ld.Dispatched, gate: torch.Tensor) -> torch.Tensor:
        """out [T, H] from this rank's combine receive buffer; gate [T, k] float32."""
        T, k = gate.shape
        return Scaler.on_device(d.pos, gate, T * k)(self.runner.transport.recv)

    def fc1(self, plan, x_pad: torch.Tensor) -> torch.Tensor:
        """gelu(x_pad @ W1_e) per expert over the padded layout: [P', H] -> [P', F] (rows past
        the plan's n_padded are never read). On a GPU one producer launch on every SM with GELU
        in its epilogue; elsewhere grouped_mm (or a per-expert matmul), then GELU."""
        if x_pad.is_cuda:
            return self._fc1_producer(plan, x_pad)
        offs = plan.expert_row_start[1:]
        counts = None
        if not grouped_mm_usable(x_pad, self.w1):  # the per-expert fallback needs host ints
            counts = plan.expert_row_start.diff().tolist()
            x_pad = x_pad[: int(plan.expert_row_start[-1])]
        return activation(expert_gemm(x_pad, counts, self.w1, offs), plan.n_padded)

    def _fc1_producer(self, plan, x_pad: torch.Tensor) -> torch.Tensor:
        """fc1 + GELU as one remembered producer launch into h [P', F]."""
        from systems.overlap.kernels.producer import launch_producer

        h = self.h = self._buffer(self.h, x_pad, self.w1.shape[2])
        key = (x_pad.data_ptr(), x_pad.shape, h.data_ptr(), id(plan), self.fc1_tile)
        if self.fc1_memo.hit(key):
            self.fc1_memo.launch()
            return h
        launch_producer(
            x_pad,
            self.w1,
            h,
            plan,
            self.runner.band_ready,  # no flags: the counters are not touched
            num_programs=all_sms(h.device),
            config=self.fc1_tile,
            signal=False,
            memo=self.fc1_memo,
            memo_key=key,
            act=True,
        )
        return h

    @staticmethod
    def _buffer(buf, like: torch.Tensor, cols: int) -> torch.Tensor:
        """[like rows, cols] in like's dtype: the same tensor every step of this shape."""
        if buf is None or buf.shape != (like.shape[0], cols) or buf.dtype != like.dtype:
            buf = torch.empty(like.shape[0], cols, dtype=like.dtype, device=like.device)
        return buf

    def fc2_combine(self, plan, h: torch.Tensor, overlapped: bool = True) -> torch.Tensor:
        """fc2 [P', F] @ W2 -> y [P', H]: the producer with the consumer's puts (overlapped), or
        the producer alone on ALL SMs without flags (the compute bound)."""
        self.runner.use_plan(plan)  # grows band_ready for a plan past the worst case (a test's)
        y = self.y = self._buffer(self.y, h, self.w2.shape[2])
        if overlapped:
            self.runner.overlapped(h, y)
        else:
            self.runner.compute_only(h, y, num_programs=all_sms(h.device))
        return y

    def buffers(self) -> list[torch.Tensor]:
        """What a step writes and keeps: the receive buffer, fc2's y, fc1's h, the padded x."""
        kept = (self.y, self.h, self.builder.x_pad)
        return [self.runner.transport.recv, *(t for t in kept if t is not None)]

    def compute_only(self, held: Held, gate: torch.Tensor) -> torch.Tensor:
        """Everything but the two exchanges on a held dispatch: stage A, fc1, the producer on
        ALL SMs without flags (storing the local rows), the scale: out [T, H]."""
        plan, x_pad = self.stage_a(held.dispatch)
        self.fc2_combine(plan, self.fc1(plan, x_pad), overlapped=False)
        return self.scale(held.dispatch, gate)

    def comm_only(self, held: Held) -> None:
        """The consumer's combine alone on the held plan (flags taken as set)."""
        self.runner.use_plan(held.plan)
        self.runner.comm_only(self._buffer(self.y, held.x_pad, self.w2.shape[2]))
