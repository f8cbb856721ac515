"""The paper's serial baseline: expert GEMMs, then the combine all-to-all, then scale.

Operator cells: grouped GEMM over rows sorted by expert [R, K] x [E, K, N] -> [R, N], back to the
received order, all_to_all_single to the owners, gate-weighted scale -> [T, N]. Layer cells
(ffn > 0), from x [T, H] and the routing: dispatch, fc1, GELU, fc2, combine, scale -> [T, H].
Param `dispatch` (DISPATCHES; docs/method.md): "device", the overlap system's host-free dispatch,
captures in a CUDA graph; "nccl" (harness/dispatch.py) pays the split sizes' host sync.
"""

from __future__ import annotations

import torch

from harness import dispatch as ld
from harness.dispatch_device import DISPATCHES, PlayedDispatch, dispatch_used, triton_runs
from harness.experts import (
    device_offsets,
    expert_gemm,
    expert_gemm_impl,
    ffn_experts,
    grouped_mm_usable,
)
from harness.reference import combine
from harness.scale import Scaler
from harness.system import CellInputs, Step, System
from harness.workload import WorkloadSpec


class _GemmCombineStep(Step):
    """Operator cell from the dispatched rows x_recv [R, K] (module doc) -> out [T, N]. The
    routing is fixed per cell, so the sort, its inverse and the expert offsets are made here,
    untimed (offsets from host counts would cost a host-to-device copy every forward)."""

    def __init__(self, inputs: CellInputs, group) -> None:
        lay, dev = inputs.layout, inputs.x_recv.device
        self.lay, self.group = lay, group
        self.scale = Scaler.for_layout(lay, dev)  # indices on the device, built untimed
        perm = torch.sort(lay.recv_expert, stable=True).indices.to(dev)
        self.inv_perm = torch.argsort(perm)  # [R] sorted row of each received row
        self.x_sorted = inputs.x_recv.index_select(0, perm).contiguous()  # [R, K] by expert
        self.counts = lay.expert_counts.tolist()  # [E] rows per local expert (host)
        self.offs = device_offsets(self.counts, dev)  # [E] int32
        self.weights = inputs.weights  # [E, K, N]
        self.y_recv = self.gemm()  # [R, N]: one untimed forward's rows, for the bounds
        self.y_back = combine(self.y_recv, lay, group)  # [S, N]
        self.gemm_impl = expert_gemm_impl(self.x_sorted, self.weights)
        self.blocker = None
        if inputs.spec.world_size > 1:
            self.blocker = "serial operator at W > 1: NCCL capture across processes not tried yet"

    def gemm(self) -> torch.Tensor:
        """The grouped GEMM [R, K] x [E, K, N], back in the received order [R, N]."""
        y = expert_gemm(self.x_sorted, self.counts, self.weights, self.offs)
        return y.index_select(0, self.inv_perm)

    def timed(self) -> torch.Tensor:
        return self.scale(combine(self.gemm(), self.lay, self.group))

    def capture_blocker(self) -> str | None:
        return self.blocker

    def compute_only(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The scale of the held combine's rows [T, N], the GEMM [R, N]: all but the all-to-all."""
        return self.scale(self.y_back), self.gemm()

    def comm_only(self) -> torch.Tensor:
        """The combine all-to-all of the held expert rows [R, N] -> [S, N]."""
        return combine(self.y_recv, self.lay, self.group)


class _LayerStep(Step):
    """Layer cell from x [T, H], expert_ids [T, k] and gate [T, k] (module doc; fc1
    W1 [E, H, F], fc2 W2 [E, F, H]) -> out [T, H]; one untimed forward is held for the bounds.
    `dispatch(x, ids)` -> harness.dispatch.Dispatched: by default (dispatch=nccl)
    harness/dispatch.py's all-to-all, whose split sizes the host reads."""

    #: extra's host_syncs: the host synchronisations of one step
    host_syncs = 1

    def __init__(self, inputs: CellInputs, group, dispatch=None) -> None:
        spec = inputs.spec
        if dispatch is None:
            dispatch = ld.LayerDispatch(spec.world_size, spec.experts_per_rank, group)
        self.x, self.ids, self.gate = inputs.x, inputs.expert_ids, inputs.gate
        self.w1, self.w2 = inputs.w1, inputs.weights
        self.dispatch, self.group = dispatch, group
        self.top_k, self.rows = spec.top_k, spec.tokens_per_rank * spec.top_k
        self.d = dispatch(self.x, self.ids)  # held, for the bounds
        self.xs = ld.to_expert_order(self.d, self.d.x_recv)  # [R, H] grouped by expert
        self.y_recv = self._expert_rows(self.d)  # [R, H]
        self.y_back = self.combine(self.d, self.y_recv)  # [S, H]
        self.gemm_impl = expert_gemm_impl(self.xs, self.w1)

    def combine(self, d: ld.Dispatched, y: torch.Tensor) -> torch.Tensor:
        """y [R, H] in d's received order -> [S, H] this rank's rows in its send order."""
        return ld.combine(d, y, self.group)

    def _expert_rows(self, d: ld.Dispatched) -> torch.Tensor:
        """fc1, GELU, fc2 on d's received rows (grouped by expert) -> [R, H], received order."""
        xs = ld.to_expert_order(d, d.x_recv)
        return ld.from_expert_order(d, ffn_experts(xs, d.expert_rows, self.w1, self.w2, d.offs))

    def timed(self) -> torch.Tensor:
        d = self.dispatch(self.x, self.ids)
        back = self.combine(d, self._expert_rows(d))
        return Scaler.on_device(d.pos, self.gate, self.rows)(back)

    def compute_only(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The scale of the held combine's rows [T, H] and the experts on the held dispatch's
        rows [R, H]: all but the all-to-alls."""
        y = self._expert_rows(self.d)
        return Scaler.on_device(self.d.pos, self.gate, self.rows)(self.y_back), y

    def comm_only(self) -> torch.Tensor:
        """The dispatch's row all-to-all and the combine's, with the held dispatch's splits."""
        ld.redispatch(self.d, self.x, self.top_k, self.group)
        return self.combine(self.d, self.y_recv)

    def capture_blocker(self) -> str | None:
        return "dispatch=nccl: the split sizes' host sync"


class _DeviceDispatchLayerStep(_LayerStep):
    """dispatch=device (W=1): every row stays, the dispatch reads nothing on the host
    (harness/dispatch_device.py), so the step captures where the grouped GEMM is
    torch._grouped_mm (its per-expert fallback reads the counts on the host)."""

    def __init__(self, inputs: CellInputs, group, peers=None) -> None:
        spec = inputs.spec
        played = peers or PlayedDispatch(
            1, spec.experts_per_rank, spec.tokens_per_rank, spec.top_k, inputs.x
        )
        self.recv_mib = played.recv_mib
        super().__init__(inputs, group, peers or (lambda x, ids: played([x], [ids])[0]))
        self.grouped_mm = grouped_mm_usable(self.xs, self.w1)
        self.host_syncs = 0 if self.grouped_mm else 1

    def capture_blocker(self) -> str | None:
        if not self.grouped_mm:
            return "the per-expert matmul fallback needs the expert counts on the host"
        return None


class _PeerDispatchLayerStep(_DeviceDispatchLayerStep):
    """dispatch=device with one process per rank (W > 1): harness/dispatch_peer.py's dispatch
    and combine through the peers' memory (transport_here: p2p or nvshmem on GPUs, shm on the
    CPU), no host sync."""

    def __init__(self, inputs: CellInputs, group) -> None:
        import torch.distributed as dist

        from harness.dispatch_peer import PeerCombine, PeerDispatch, transport_here

        s, x, group = inputs.spec, inputs.x, group or dist.group.WORLD
        args = (s.tokens_per_rank, s.top_k, x, group, transport_here(x.device))
        self.peers = PeerDispatch(s.world_size, s.experts_per_rank, *args)
        self.combiner = PeerCombine(s.world_size, *args)
        super().__init__(inputs, group, self.peers)

    def combine(self, d: ld.Dispatched, y: torch.Tensor) -> torch.Tensor:
        return self.combiner(d, y)

    def comm_only(self) -> torch.Tensor:
        """The dispatch (counts and rows) and the combine's puts of the held expert rows."""
        self.peers(self.x, self.ids)
        return self.combine(self.d, self.y_recv)

    def check(self) -> None:
        self.peers.check()
        self.combiner.check()


def _autograd_gemm(x: torch.Tensor, counts: list[int], w: torch.Tensor) -> torch.Tensor:
    """expert_gemm under autograd: torch._grouped_mm on a GPU where it applies, else per-expert
    matmuls joined (the CPU's grouped GEMM has no working backward)."""
    if x.is_cuda and grouped_mm_usable(x, w):
        return torch._grouped_mm(x, w, offs=device_offsets(counts, x.device))
    return torch.cat([xe @ w[e] for e, xe in enumerate(x.split(counts))])


class _TrainLayerStep(Step):
    """Train cell: one forward + backward under torch autograd over serial's own ops: the NCCL
    dispatch's labels (harness/dispatch.py, its host sync), the row gather and NCCL's
    differentiable all-to-all (torch.distributed.nn) both ways, the grouped GEMMs, the scale in
    torch ops. timed() returns {"out", "dx", "dgate", "dw1", "dw2"}, fresh every call."""

    timed_rank = None
    host_syncs = 1  # the dispatch's split sizes

    def __init__(self, inputs: CellInputs, group) -> None:
        spec = inputs.spec
        self.dispatch = ld.LayerDispatch(spec.world_size, spec.experts_per_rank, group)
        self.group, self.k, self.W = group, spec.top_k, spec.world_size
        self.ids, self.dy = inputs.expert_ids, inputs.dy
        leaves = (inputs.x, inputs.gate, inputs.w1, inputs.weights)
        self.leaves = [t.detach().clone().requires_grad_() for t in leaves]
        self.gemm_impl = expert_gemm_impl(inputs.x, inputs.w1)
        self.d = self.dispatch(inputs.x, self.ids)  # the row's facts

    def _a2a(self, rows: torch.Tensor, out_splits, in_splits) -> torch.Tensor:
        if self.W == 1:
            return rows
        from torch.distributed.nn.functional import all_to_all_single

        out = rows.new_empty(sum(out_splits), rows.shape[1])
        return all_to_all_single(out, rows, out_splits, in_splits, group=self.group)

    def timed(self) -> dict:
        x, gate, w1, w2 = self.leaves
        for t in self.leaves:
            t.grad = None
        d = self.dispatch(x.detach(), self.ids)
        rows = self._a2a(x.index_select(0, d.send_order // self.k), d.recv_splits, d.send_splits)
        h = torch.nn.functional.gelu(_autograd_gemm(ld.to_expert_order(d, rows), d.expert_rows, w1))
        y = ld.from_expert_order(d, _autograd_gemm(h, d.expert_rows, w2))
        back = self._a2a(y, d.send_splits, d.recv_splits)
        out = back.index_select(0, d.pos.view(-1)).view(*gate.shape, -1).float()
        out = (out * gate.unsqueeze(-1)).sum(1).to(x.dtype)
        out.backward(self.dy)
        return {"out": out.detach(), "dx": x.grad, "dgate": gate.grad, "dw1": w1.grad,
                "dw2": w2.grad}  # fmt: skip

    def capture_blocker(self) -> str | None:
        return "train scope: autograd's backward is not captured"


class SerialSystem(System):
    name = "serial"
    overlaps = False  # the combine runs after the experts
    layer_scope = True
    train_scope = True
    PARAMS = {"dispatch": "auto"}
    _impl = ""
    _resolved: dict = {}  # replaced, never mutated, by build

    @classmethod
    def refuse(cls, spec: WorkloadSpec, params: dict, processes: int, device: str) -> None:
        """A layer cell's dispatch that this run cannot make, before any process starts (serial
        plays one rank a process: W > 1 is one process per rank)."""
        if spec.ffn and spec.world_size == processes:
            try:
                W, triton = spec.world_size, triton_runs(device)
                dispatch_used(params["dispatch"], W, W == 1, triton)
            except ValueError as exc:
                raise ValueError(f"serial: {exc}") from None

    @classmethod
    def validate(cls, spec: WorkloadSpec, params: dict, sm_count: int) -> None:
        if params["dispatch"] not in DISPATCHES:
            raise ValueError(
                f"serial: dispatch must be one of {DISPATCHES}, got {params['dispatch']!r}"
            )

    def build(self, ranks: list[CellInputs]) -> Step:
        """An operator cell's GEMM + combine step, or a layer cell's (param `dispatch`)."""
        (inputs,) = ranks
        spec = inputs.spec
        if not spec.ffn:
            step = _GemmCombineStep(inputs, self.ctx.group)
            self._impl = step.gemm_impl
            return step
        triton = triton_runs(self.ctx.device.type)
        used = dispatch_used(self.params["dispatch"], spec.world_size, spec.world_size == 1, triton)
        if spec.train:  # autograd: NCCL's dispatch, whatever `dispatch` asks
            step, used = _TrainLayerStep(inputs, self.ctx.group), "nccl"
        elif used == "device" and spec.world_size > 1:
            step = _PeerDispatchLayerStep(inputs, self.ctx.group)
        elif used == "device":
            step = _DeviceDispatchLayerStep(inputs, self.ctx.group)
        else:
            step = _LayerStep(inputs, self.ctx.group)
        self._impl = step.gemm_impl
        self._resolved = {"dispatch_used": used}
        self.extra = {"host_syncs": step.host_syncs, "permute": step.d.expert_pos is not None}
        if used == "device":
            self.metrics["recv_worst_mib"] = step.recv_mib
        return step

    def resolved_params(self) -> dict:
        return dict(self._resolved)

    @property
    def impl(self) -> str:
        return f"native ({self._impl})"
