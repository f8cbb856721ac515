"""The `overlap` system: the paper's method. Stage A (plan), stage B (producer + consumer), scale.

Per rank: the plan (systems/overlap/plan.py) lays the dispatched rows out remote-aligned
(X [P, K], zero rows where gather_index == -1; built in setup, like every system's permute);
forward runs the persistent producer (SMs - cCTA programs) and the consumer (cCTA programs, high
priority stream) concurrently, places the local rows in the own combine receive buffer, waits
until every peer's rows arrived, and scales: out [T, N].

Params (PARAMS): systems/overlap/params.py OverlapParams, its choices, validation and the
reasons a cell cannot run. ccta and mgb also take "auto", order defaults to it: setup picks them
on the host before any GPU work (systems/overlap/autotune.py); rows keep p_ccta / p_mgb /
p_order as asked and carry what ran as p_ccta_used / p_mgb_used / p_order_used, the reason in
extra["auto"] / extra["auto_order"].
Transports (param `transport`; empty = `loopback` with one process, `p2p` with several), each
a small class chosen once in setup:
  loopback  (_Loopback) one process plays all W ranks of the cell on one GPU; destinations are
            regions of one local buffer. forward() (the checked output) runs every played rank
            and returns the W outputs stacked [W*T, N]; the TIMED region is the busiest played
            rank's step (producer + consumer + local copy + scale), which has no peers to wait
            for. A development proxy: never an interconnect number.
  p2p       (_Distributed) one process per GPU, peer pointers from torch symmetric memory
  nvshmem   (_Distributed) one process per GPU, torch symmetric memory on NVSHMEM
compute_only(): everything but the communication: the producer alone on ALL SMs without flags,
the local copy and scale; comm_only(): the consumer alone on cCTA SMs with the flags taken as
set. The harness derives the overlap ratio from these. extra_bounds() adds compute_shared
(operator scope): compute_only on the producer's grid while it overlaps (SMs - cCTA; all SMs with
consumer=shared).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

import torch

from harness import dispatch as ld
from harness.dispatch_device import dispatch_used
from harness.experts import activation, expert_gemm, grouped_mm_usable
from harness.scale import Scaler
from harness.system import CellInputs, System
from harness.timing import time_fn
from harness.workload import WorkloadSpec
from systems.overlap.params import AUTO, OverlapParams
from systems.overlap.plan import padded_input, plan_for_layout
from systems.overlap.tuning import pick_config

#: producer programs in Triton's CPU interpreter (no SMs to count; the programs run in turn)
INTERPRETER_PROGRAMS = 2


def _runner(plan, weights, transport, k: OverlapParams):
    """The runner of one rank's plan for the resolved knobs k (no "auto" left); on the CPU
    (Triton's interpreter) with the interpreter's small tiles, bounded spins and no timer."""
    from systems.overlap.kernels.consumer import interpreter_consumer_config
    from systems.overlap.runner import OverlapRunner
    from systems.overlap.tuning import interpreter_config

    cpu = {}
    if getattr(weights, "device", None) is not None and weights.device.type != "cuda":
        cpu = dict(tile=interpreter_config(k.tile_m), consumer=interpreter_consumer_config(),
                   num_programs=INTERPRETER_PROGRAMS)  # fmt: skip
    return OverlapRunner(
        plan, weights, transport, ccta=k.ccta, order=k.order, consumer_sms=k.consumer, **cpu
    )


def _all_sms(device: torch.device) -> int:
    """The producer's grid on ALL SMs (the compute bound); the interpreter's on the CPU."""
    if device.type != "cuda":
        return INTERPRETER_PROGRAMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _peer_transport(name: str, group, spec: WorkloadSpec, device):
    """This rank's p2p or nvshmem transport: a receive buffer of T*k rows [T*k, N]."""
    from systems.overlap.transport import nvshmem_transport, p2p_transport

    make = p2p_transport if name == "p2p" else nvshmem_transport
    return make(group, spec.tokens_per_rank * spec.top_k, spec.out, spec.torch_dtype, device)


class _Rank:
    """One (possibly simulated) rank's state: layout, plan, padded operands, runner."""

    def __init__(self, spec: WorkloadSpec, lay, x_recv, weights, transport, k: OverlapParams):
        self.lay = lay
        self.plan = plan_for_layout(
            lay,
            world_size=spec.world_size,
            experts_per_rank=spec.experts_per_rank,
            tile_m=k.tile_m,
            mgb=k.mgb,
            out_cols=spec.out,
            elem_bytes=x_recv.element_size(),
            device=x_recv.device,
            layout=k.layout,
            order=k.order,
            group_cap=pick_config(k.tile_m, weights.shape[1], spec.out, weights.dtype).group_cap,
        )
        self.x = padded_input(x_recv, self.plan.gather_index)
        self.y = torch.empty(self.x.shape[0], spec.out, dtype=x_recv.dtype, device=x_recv.device)
        self.runner = _runner(self.plan, weights, transport, k)
        self.tokens = spec.tokens_per_rank
        self.scale = Scaler.for_layout(lay, x_recv.device)  # step 5, indices on the device

    def step(self) -> None:
        """Producer + consumer concurrently (the producer stores the local rows in the own
        receive buffer itself)."""
        self.runner.overlapped(self.x, self.y)


class _Loopback:
    """One process plays every rank: a LoopbackFabric, one _Rank per played rank."""

    name = "loopback"

    def __init__(self, ranks: list[CellInputs], k: OverlapParams) -> None:
        from systems.overlap.transport import LoopbackFabric

        spec = ranks[0].spec
        W = spec.world_size
        self.fabric = LoopbackFabric(
            [spec.tokens_per_rank * spec.top_k] * W, spec.out, spec.torch_dtype, ranks[0].x.device
        )
        self.ranks = [
            _Rank(spec, inp.layout, inp.x_recv, inp.weights, self.fabric.transport(r), k)
            for r, inp in enumerate(ranks)
        ]
        #: the timed rank: the one with the most rows to compute
        self.busy = max(range(W), key=lambda r: self.ranks[r].x.shape[0])

    def forward(self) -> torch.Tensor:
        """Every played rank's step, then each rank's scale: [W*T, N]."""
        for rk in self.ranks:
            rk.step()
        outs = [rk.scale(self.fabric.recv(r)) for r, rk in enumerate(self.ranks)]
        for rk in self.ranks:
            rk.runner.check()
        return torch.cat(outs)

    def timed(self) -> torch.Tensor:
        """The busiest rank's step and scale (it has no peers to wait for)."""
        rk = self.ranks[self.busy]
        rk.step()
        return rk.scale(rk.runner.transport.recv)


class _Distributed:
    """One process per rank over a real transport (p2p or nvshmem symmetric memory)."""

    def __init__(self, inp: CellInputs, group, name: str, k: OverlapParams):
        t = _peer_transport(name, group, inp.spec, inp.x.device)
        self.name = name
        self.group = group
        self.ranks = [_Rank(inp.spec, inp.layout, inp.x_recv, inp.weights, t, k)]
        self.busy = 0
        self.epoch = torch.zeros(1, dtype=torch.int32, device=inp.x.device)
        #: the epoch handshake before every step; False only in the test that shows the race
        self.handshake = True

    def forward(self) -> torch.Tensor:
        out = self.timed()
        self.ranks[0].runner.check()
        return out

    def timed(self) -> torch.Tensor:
        """The epoch handshake, this rank's step, the wait for every peer's rows, the scale.

        The handshake, a one-element NCCL all-reduce on the step's stream, completes only once
        every peer's stream has passed its previous scale, so this step's puts never overwrite
        a receive buffer a peer is still reading (in a real layer the next dispatch all-to-all
        gives the same order, as in the layer scope). It is timed."""
        import torch.distributed as dist

        rk = self.ranks[0]
        if self.handshake:
            dist.all_reduce(self.epoch, group=self.group)
        rk.step()
        rk.runner.wait_received()  # every peer's rows of every step so far
        return rk.scale(rk.runner.transport.recv)


class _LayerRank:
    """One rank's whole layer (FFN cells, scope layer), from x [T, H] and the routing.

    Every step pays: the dispatch (harness/dispatch.py: counts exchange, the split sizes' host
    sync, all_to_all_single), stage A on the device with no host sync (plan_device.py: the
    plan sized at its worst case, built inside the dispatch before its sync, so its launches
    queue behind the previous step; the padded gather in one kernel after it), fc1 + GELU over
    the padded layout (on a GPU one producer launch, GELU in its epilogue; zero rows stay
    zero), then fc2 as the producer overlapped with the consumer's combine, the local copy, the
    wait for every peer's rows and the scale. At W=1 every row is local and there is nothing to
    combine: fc2 is the producer alone on every SM (it stores each row in place), no consumer.
    The dispatch all-to-all also orders the steps across ranks: a peer's next dispatch starts
    only after its scale of this step read its receive buffer, so the next step's puts never
    overwrite rows still being read.

    Every step's plan, padded input and fc2 output go into the same buffers (a
    DevicePlanBuilder and one Y), so the runner's remembered launches hold from step to step:
    the host pays the launchers, not Triton's argument binding (the layer step synchronises
    once, in the dispatch, and every launch after it is on the step's critical path).
    """

    def __init__(
        self, inp: CellInputs, transport, group, k: OverlapParams, first: ld.Dispatched | None
    ):
        """first: this rank's first dispatch by a host-free dispatch of every played rank
        (harness/dispatch_device.py), or None: the rank dispatches itself (LayerDispatch)."""
        from systems.overlap.plan_device import DevicePlanBuilder, plan_bounds

        spec, tile_m, mgb, layout = inp.spec, k.tile_m, k.mgb, k.layout
        self.spec, self.group, self.tile_m, self.mgb = spec, group, tile_m, mgb
        #: fc2 overlapped with the combine; at W=1 (no remote rows) the producer alone
        self.combines = spec.world_size > 1
        self.layout = layout
        self.x, self.ids, self.gate = inp.x, inp.expert_ids, inp.gate
        self.w1, self.w2 = inp.w1, inp.weights
        self.rank = inp.layout.rank
        self.dispatch = None
        if first is None:
            self.dispatch = ld.LayerDispatch(spec.world_size, spec.experts_per_rank, group)
        self.rows = spec.tokens_per_rank * spec.top_k
        self.plan_shape = dict(
            world_size=spec.world_size,
            rank=self.rank,
            experts_per_rank=spec.experts_per_rank,
            tile_m=tile_m,
            mgb=mgb,
            out_cols=spec.out,
            elem_bytes=self.x.element_size(),
            layout=layout,
            order=k.order,
            group_cap=pick_config(tile_m, self.w2.shape[1], spec.out, self.w2.dtype).group_cap,
        )
        self.builder = DevicePlanBuilder(**self.plan_shape)  # every step's plan, in place
        self.y: torch.Tensor | None = None  # every step's fc2 output [P', N]
        # one untimed step's state (bounds, plan facts), in its own plan
        if first is None:
            self.held = self.stage_a(own_plan=True)
        else:
            self.held = (first, *self.plan_for(first, own_plan=True))
        self.plan = self.held[1].trimmed()  # host view of the plan, for the row's facts
        self.runner = _runner(self.held[1], self.w2, transport, k)
        # band counters for the worst case of any step: every row of every rank comes here
        most = plan_bounds(
            spec.world_size * self.rows,
            world_size=spec.world_size,
            experts_per_rank=spec.experts_per_rank,
            tile_m=tile_m,
            layout=layout,
        )["max_bands"]
        self.runner.band_ready = torch.zeros(most, dtype=torch.int32, device=self.x.device)
        #: fc1 on a GPU: the producer's config for [*, H] @ [H, F], every step's h [P', F], and
        #: its remembered launch
        cfg = pick_config(tile_m, spec.hidden, spec.ffn, self.w1.dtype)
        if cfg.expert_groups and cfg.group_m != self.plan_shape["group_cap"]:  # fc2's groups
            cfg = replace(cfg, expert_groups=False, group_m=1)
        self.fc1_tile = cfg
        self.h: torch.Tensor | None = None
        if self.x.is_cuda:
            from harness.kernels.relaunch import LaunchMemo

            self.fc1_memo = LaunchMemo()

    def build(self, r: ld.Received):
        """This step's plan from the received rows' labels (the builder's one plan: the labels
        have one size every step, their real rows counted on the device)."""
        ins = (r.recv_src, r.recv_expert, r.recv_dst_index)
        return self.builder(*ins, send_counts=r.send_counts, n_rows=r.n_rows)

    def plan_for(self, d: ld.Dispatched, own_plan: bool = False):
        """Stage A on one dispatch, on the device with no host sync: (DevicePlan, the padded
        fc1 input x_pad [P', H]), in the builder's buffers (own_plan: in new ones, kept)."""
        from systems.overlap.plan_device import build_plan_device, padded_input_device

        if own_plan:
            ins = (d.recv_src, d.recv_expert, d.recv_dst_index)
            n = None if d.received is None else d.received.n_rows
            plan = build_plan_device(*ins, send_counts=d.send_counts, n_rows=n, **self.plan_shape)
            return plan, padded_input_device(d.x_recv, plan)
        plan = self.build(d.received)
        if d.x_recv is None:  # straight from the tokens into the padded layout
            return plan, self.builder.padded_input(d.tokens, rows=d.token_rows)
        return plan, self.builder.padded_input(d.x_recv)

    def stage_a(self, own_plan: bool = False):
        """Dispatch, plan and the padded fc1 input: (Dispatched, DevicePlan, x_pad [P', H]).
        The builder's plan is built inside the dispatch, before its host sync."""
        if own_plan:
            d = self.dispatch(self.x, self.ids)
            return (d, *self.plan_for(d, own_plan))
        built = []  # a step past the dispatch's bound builds again after the sync: the last
        d = self.dispatch(self.x, self.ids, before_sync=lambda r: built.append(self.build(r)))
        return d, built[-1], self.builder.padded_input(d.x_recv)

    def _y(self, rows: int, like: torch.Tensor) -> torch.Tensor:
        """The fc2 output [rows, N]: one buffer for every step of this shape."""
        y = self.y
        if y is None or y.shape[0] != rows or y.dtype != like.dtype:
            y = self.y = torch.empty(rows, self.spec.out, dtype=like.dtype, device=like.device)
        return y

    def fc1(self, plan, x_pad: torch.Tensor) -> torch.Tensor:
        """gelu(x_pad @ W1_e) per expert over the padded layout: [P', H] -> [P', F] (rows
        past the plan's n_padded are never read). On a GPU the producer's persistent GEMM on
        every SM, GELU in its epilogue (one launch; faster than grouped_mm + GELU at every
        measured shape, docs/measurements.md); elsewhere grouped_mm, then GELU."""
        if x_pad.is_cuda:
            return self._fc1_producer(plan, x_pad)
        offs = plan.expert_row_start[1:]
        counts = None
        if not grouped_mm_usable(x_pad, self.w1):  # the per-expert fallback needs host ints
            counts = plan.expert_row_start.diff().tolist()
            x_pad = x_pad[: int(plan.expert_row_start[-1])]
        return activation(expert_gemm(x_pad, counts, self.w1, offs), plan.n_padded)

    def _fc1_producer(self, plan, x_pad: torch.Tensor) -> torch.Tensor:
        """fc1 + GELU as one producer launch into this rank's h [P', F] (remembered: a step
        pays the compiled launcher only)."""
        F = self.w1.shape[2]
        h = self.h
        if h is None or h.shape[0] != x_pad.shape[0] or h.dtype != x_pad.dtype:
            h = self.h = torch.empty(x_pad.shape[0], F, dtype=x_pad.dtype, device=x_pad.device)
        cfg = self.fc1_tile
        key = (x_pad.data_ptr(), x_pad.shape, h.data_ptr(), id(plan), cfg)
        if self.fc1_memo.hit(key):
            self.fc1_memo.launch()
            return h
        from systems.overlap.kernels.producer import launch_producer

        unused = self.runner.band_ready  # no flags: the counters are not touched
        n = _all_sms(h.device)
        launch_producer(x_pad, self.w1, h, plan, unused, num_programs=n, config=cfg,
                        signal=False, memo=self.fc1_memo, memo_key=key, act=True)  # fmt: skip
        return h

    def _fc2_combine(self, plan, h: torch.Tensor, overlapped: bool = True) -> torch.Tensor:
        bands = plan.schedule.numel()  # a plan at a bound set past W*T*k (a test's) has more
        if bands > self.runner.band_ready.numel():  # a new plan object: no launch holds these
            self.runner.band_ready = torch.zeros(bands, dtype=torch.int32, device=h.device)
        self.runner.use_plan(plan)
        y = self._y(h.shape[0], h)
        if overlapped:
            self.runner.overlapped(h, y)
        else:  # the compute bound: the producer alone on ALL SMs, no flags
            self.runner.compute_only(h, y, num_programs=_all_sms(h.device))
        return y

    def step(self) -> torch.Tensor:
        d, plan, x_pad = self.stage_a()
        self._fc2_combine(plan, self.fc1(plan, x_pad), overlapped=self.combines)
        if self.combines:
            self.runner.wait_received()  # every peer's rows of every step so far
        return self.scale(d)

    def experts(self, d: ld.Dispatched) -> None:
        """After a host-free dispatch: stage A from its labels, fc1 + GELU, fc2 overlapped with
        the combine's puts (at W=1 the producer alone on every SM)."""
        plan, x_pad = self.plan_for(d)
        self._fc2_combine(plan, self.fc1(plan, x_pad), overlapped=self.combines)

    def scale(self, d: ld.Dispatched) -> torch.Tensor:
        """out [T, H] from this rank's combine receive buffer."""
        return Scaler.on_device(d.pos, self.gate, self.rows)(self.runner.transport.recv)

    def compute_only(self) -> torch.Tensor:
        """Everything but the two exchanges, on the held dispatch: stage A's plan and gather,
        fc1, the producer on ALL SMs without flags (storing the local rows), the scale."""
        d = self.held[0]
        plan, x_pad = self.plan_for(d)
        self._fc2_combine(plan, self.fc1(plan, x_pad), overlapped=False)
        return self.scale(d)

    def comm_only(self) -> None:
        """The dispatch all-to-all and the consumer's combine alone (flags taken as set)."""
        d, plan, x_pad = self.held
        if self.dispatch is not None and self.spec.world_size > 1:
            ld.redispatch(d, self.x, self.ids.shape[1], self.group)
        self.runner.use_plan(plan)
        self.runner.comm_only(self._y(x_pad.shape[0], self.x))


class _Layer:
    """The layer scope (FFN cells) on one process per rank (p2p / nvshmem), or W=1 (loopback
    with one rank)."""

    def __init__(self, inp: CellInputs, group, name: str, k: OverlapParams):
        spec = inp.spec
        if name == "loopback":
            from systems.overlap.transport import LoopbackFabric

            rows = [spec.tokens_per_rank * spec.top_k]
            self.fabric = LoopbackFabric(rows, spec.out, spec.torch_dtype, inp.x.device)
            t = self.fabric.transport(0)
        else:
            t = _peer_transport(name, group, spec, inp.x.device)
        self.name = name
        self.layer = _LayerRank(inp, t, group, k, None)
        self.ranks = [self.layer]
        self.busy = 0
        self.dispatch = "nccl"
        self.timed_rank = 0

    def capture_blocker(self) -> str | None:
        return "dispatch=nccl: the split sizes' host sync"

    def forward(self) -> torch.Tensor:
        out = self.layer.step()
        self.layer.runner.check()
        return out

    def timed(self) -> torch.Tensor:
        return self.layer.step()

    def check(self) -> None:
        self.layer.runner.check()


class _PlayedLayer:
    """The layer scope with one process playing every rank (W=1, or loopback at W > 1): the
    host-free dispatch of every rank (harness/dispatch_device.py), then each rank's stage A,
    fc1, fc2 overlapped with its combine puts into the LoopbackFabric, then each rank's scale.
    No host synchronisation: the step captures in a CUDA graph. The timed region is the
    whole step of every played rank in turn (at W > 1 a development proxy, never an
    interconnect number); it returns every rank's output, stacked [W*T, H]."""

    name = "loopback"
    dispatch = "device"

    def __init__(self, ranks: list[CellInputs], k: OverlapParams) -> None:
        from harness.dispatch_device import PlayedDispatch
        from systems.overlap.transport import LoopbackFabric

        spec = ranks[0].spec
        W, T, kk = spec.world_size, spec.tokens_per_rank, spec.top_k
        x0 = ranks[0].x
        self.played = PlayedDispatch(W, spec.experts_per_rank, T, kk, x0)
        self.xs = [inp.x for inp in ranks]
        self.ids = [inp.expert_ids for inp in ranks]
        self.fabric = LoopbackFabric([T * kk] * W, spec.out, spec.torch_dtype, x0.device)
        first = self.played(self.xs, self.ids)
        self.ranks = [
            _LayerRank(inp, self.fabric.transport(r), None, k, first[r])
            for r, inp in enumerate(ranks)
        ]
        self.layer = self.ranks[0] if W == 1 else None  # the bounds: W=1 only
        self.busy = 0
        self.timed_rank = None if W > 1 else 0

    def capture_blocker(self) -> str | None:
        rk = self.ranks[0]
        if not grouped_mm_usable(rk.x, rk.w1):
            return "the per-expert fc1 fallback needs the expert counts on the host"
        return None

    def timed(self) -> torch.Tensor:
        ds = self.played(self.xs, self.ids, gather=False)  # rows gathered into x_pad directly
        for rk, d in zip(self.ranks, ds):
            rk.experts(d)
        outs = [rk.scale(d) for rk, d in zip(self.ranks, ds)]
        return outs[0] if len(outs) == 1 else torch.cat(outs)  # W=1: no copy of the output

    def forward(self) -> torch.Tensor:
        out = self.timed()
        self.check()
        return out

    def check(self) -> None:
        for rk in self.ranks:
            rk.runner.check()


class OverlapSystem(System):
    name = "overlap"
    PARAMS: ClassVar[dict[str, Any]] = OverlapParams().as_dict()
    simulates_ranks = True
    layer_scope = True

    @classmethod
    def validate(cls, spec: WorkloadSpec, params: dict[str, Any], sm_count: int) -> None:
        OverlapParams.from_dict(params).validate(spec, sm_count)

    @classmethod
    def unsupported(cls, spec: WorkloadSpec, params: dict[str, Any]) -> str | None:
        return OverlapParams.from_dict(params).unsupported(spec)

    def _resolved(self, spec: WorkloadSpec, name: str) -> OverlapParams:
        """The knobs with every "auto" picked on the host, before any GPU work (the picks and
        their reasons go to the row: p_*_used, extra["auto"], extra["auto_order"])."""
        k = OverlapParams.from_dict(self.params)
        ccta, mgb, order = k.ccta, k.mgb, k.order
        if AUTO in (ccta, mgb):
            from systems.overlap.autotune import pick

            kw = dict(ccta=ccta, mgb=mgb, consumer=k.consumer)
            ccta, mgb, self.extra["auto"] = pick(
                spec, spec.world_size, name, self.ctx.sm_count, **kw
            )
        if order == AUTO:
            from systems.overlap.autotune import pick_order

            order, self.extra["auto_order"] = pick_order(spec, k.tile_m)
        self.used = {"ccta_used": int(ccta), "mgb_used": int(mgb), "order_used": order}
        return replace(k, ccta=int(ccta), mgb=int(mgb), order=order)

    def setup(self, ranks: list[CellInputs]) -> None:
        ctx = self.ctx
        name = self.params["transport"] or ("loopback" if ctx.world_size == 1 else "p2p")
        k = self._resolved(ranks[0].spec, name)
        spec = ranks[0].spec
        self.layer = bool(spec.ffn)
        plays = len(ranks) == spec.world_size and ctx.world_size == 1
        dispatch = dispatch_used(k.dispatch, spec.world_size, plays) if self.layer else None
        if dispatch is not None:
            self.used["dispatch_used"] = dispatch
        if self.layer:
            if dispatch == "device":
                self.mode = _PlayedLayer(ranks, k)
            else:
                self.mode = _Layer(ranks[0], ctx.group, name, k)
            self.timed_rank = self.mode.timed_rank
            if spec.world_size == 1:  # nothing to combine: no consumer, so no cCTA
                self.used["ccta_used"] = 0
        elif name == "loopback":
            if ctx.world_size != 1:
                raise ValueError("loopback plays every rank in one process: run with 1 process")
            self.mode = _Loopback(ranks, k)
            self.timed_rank = self.mode.busy  # timed() runs the busiest played rank
        else:
            if len(ranks) != 1 or ctx.world_size < 2:
                raise ValueError(f"{name} needs one process per rank and at least 2 ranks")
            self.mode = _Distributed(ranks[0], ctx.group, name, k)
        self._describe(ranks[self.mode.busy])

    def _describe(self, inp: CellInputs) -> None:
        """The plan's facts (extra) and, on a GPU, stage A's cost timed on its own (metric
        plan_ms; in the layer scope it is inside the timed region, in the operator scope it is
        not) and the dispatch's."""
        rk = self.mode.ranks[self.mode.busy]
        plan = rk.plan
        self.extra |= {
            "timed_rank": self.mode.busy,
            "layout": plan.layout,
            "padded_rows": int(plan.n_padded),
            "valid_rows": int(plan.n_rows),
            "bands": int(plan.n_bands),
            "remote_bands": int(plan.n_remote_bands),
            "segments": int(plan.n_segments),
            "producer_programs": rk.runner.num_programs,
            "consumer_sms": rk.runner.consumer_sms,
        }
        if self.layer and not rk.combines:  # the W=1 layer: the producer alone, every SM
            self.extra |= {"producer_programs": _all_sms(inp.x.device), "consumer_sms": "none"}
        dev = inp.x.device
        if dev.type != "cuda":  # Triton's interpreter: its times are no timing
            self.extra["plan_ms_scope"] = "not timed: no GPU (a functional run)"
            return

        def t(fn, group=None):
            return time_fn(fn, device=dev, group=group, warmup=2, iters=10).median_ms

        if self.layer:  # both inside the timed region
            m = self.mode
            if m.dispatch == "device":
                dispatch, group = (lambda: m.played(m.xs, m.ids)), None
                self.metrics["recv_worst_mib"] = m.played.recv_mib
            else:
                dispatch, group = (lambda: rk.dispatch(rk.x, rk.ids)), self.ctx.group
            self.metrics |= {
                "plan_ms": t(lambda: rk.plan_for(rk.held[0])),
                "dispatch_ms": t(dispatch, group),
            }
            self.extra["plan_ms_scope"] = (
                "inside the timed region: device plan + padded gather (plan_ms), after the "
                "dispatch (dispatch_ms)"
            )
            return
        from systems.overlap.plan_device import build_plan_device, padded_input_device

        spec, lay = inp.spec, inp.layout
        src, exp, dst = (t_.to(dev) for t_ in (lay.recv_src, lay.recv_expert, lay.recv_dst_index))
        shape = dict(
            world_size=spec.world_size,
            experts_per_rank=spec.experts_per_rank,
            tile_m=rk.plan.tile_m,
            mgb=rk.plan.mgb,
            out_cols=spec.out,
            elem_bytes=inp.x_recv.element_size(),
        )
        send = lay.send_counts.to(dev)

        def device_stage_a():
            plan = build_plan_device(
                src, exp, dst, rank=lay.rank, send_counts=send, layout=rk.plan.layout, **shape
            )
            return padded_input_device(inp.x_recv, plan)

        def host_stage_a():
            plan = plan_for_layout(lay, device=dev, layout=rk.plan.layout, **shape)
            return padded_input(inp.x_recv, plan.gather_index)

        # outside the timed region: built in setup
        self.metrics = {"plan_ms": t(host_stage_a), "plan_device_ms": t(device_stage_a)}
        self.extra["plan_ms_scope"] = (
            "outside the timed region (built in setup): host-synchronised build_plan + "
            "padded gather (plan_ms), the device plan + gather (plan_device_ms)"
        )

    # -- runs ----------------------------------------------------------------------------
    def forward(self) -> torch.Tensor:
        out = self.mode.forward()
        res = self.mode.ranks[self.mode.busy].runner.residency  # consumer=shared: first run's
        if res is not None:
            self.extra["consumers_beside_producer"] = res["consumers_beside_producer"]
        return out

    def timed(self) -> torch.Tensor:
        return self.mode.timed()

    def capture_blocker(self) -> str | None:
        if not self.layer:
            return "overlap operator step: not declared capturable (only the layer step is)"
        return self.mode.capture_blocker()

    def check_errors(self) -> None:
        if self.layer:
            self.mode.check()
        else:
            for rk in self.mode.ranks:
                rk.runner.check()

    def has_bounds(self) -> bool:
        return not (self.layer and self.mode.layer is None)  # loopback layers at W > 1: none

    def compute_only(self) -> torch.Tensor:
        """Everything timed() does but the communication: producer on ALL SMs without flags
        (storing the local rows) and scale (of the timed rank)."""
        if self.layer:
            return self.mode.layer.compute_only()
        rk = self.mode.ranks[self.mode.busy]
        return self._compute_shared(_all_sms(rk.x.device))

    def extra_bounds(self) -> dict[str, Any]:
        """compute_shared (operator scope): compute_only with the producer on the SMs the
        overlapped step leaves it (SMs - cCTA; all SMs with consumer=shared) and no consumer
        running; the row's m_compute_shared_ms. latency / max(compute_shared, comm) is then
        what the consumer's concurrent run costs the step (L2/HBM contention, scheduling), and
        compute_shared / compute_ms what giving cCTA SMs to the consumer costs."""
        if self.layer:
            return {}
        return {"compute_shared": self._compute_shared}

    def _compute_shared(self, num_programs: int | None = None) -> torch.Tensor:
        """The timed rank's producer alone without flags on num_programs programs (None: its
        overlapped grid, SMs - cCTA; consumer=shared: all SMs), then the scale: [T, N]."""
        rk = self.mode.ranks[self.mode.busy]
        rk.runner.compute_only(rk.x, rk.y, num_programs=num_programs)
        return rk.scale(rk.runner.transport.recv)

    def comm_only(self) -> None:
        """The consumer alone on cCTA SMs, flags taken as set (of the timed rank)."""
        if self.layer:
            return self.mode.layer.comm_only()
        rk = self.mode.ranks[self.mode.busy]
        rk.runner.comm_only(rk.y)

    # -- reporting -----------------------------------------------------------------------
    @property
    def impl(self) -> str:
        return "native (triton producer/consumer)"

    @property
    def transport(self) -> str:
        return self.mode.name

    def resolved_params(self) -> dict[str, Any]:
        tile = self.mode.ranks[self.mode.busy].runner.tile
        return {"tile_n": tile.block_n, "tile_k": tile.block_k, **self.used}
