"""The paper's serial baseline: expert GEMMs, then the combine all-to-all, then scale.

Operator cells (scope gemm+combine), timed region: grouped GEMM over rows sorted by expert
[R, K] x [E, K, N] -> [R, N], un-permute to source order, all_to_all_single back to the owners,
gate-weighted scale -> [T, N].
Layer cells (ffn > 0, scope layer), timed region from x [T, H] and the routing: sort by expert,
counts exchange, dispatch, rows grouped by expert (skipped where the received (source, expert)
order already is), fc1, GELU, fc2, back to the received order, combine, scale -> [T, H].
Param `dispatch` (harness/dispatch_device.py DISPATCHES): at W=1 "device" (the default, auto)
needs no host sync (harness/dispatch_device.py), so the step captures in a CUDA graph; "nccl"
is harness/dispatch.py's all-to-all dispatch with the split sizes' host sync (what W > 1 runs,
one process per rank).
The GEMM is torch._grouped_mm where it applies (Hopper, bf16), a per-expert matmul elsewhere.
"""

from __future__ import annotations

import torch

from harness import dispatch as ld
from harness.dispatch_device import DISPATCHES, PlayedDispatch, dispatch_used
from harness.experts import (
    device_offsets,
    expert_gemm,
    expert_gemm_impl,
    ffn_experts,
    grouped_mm_usable,
)
from harness.reference import combine
from harness.scale import Scaler
from harness.system import CellInputs, System
from harness.workload import WorkloadSpec


class SerialSystem(System):
    name = "serial"
    overlaps = False  # the combine runs after the experts
    layer_scope = True
    PARAMS = {"dispatch": "auto"}

    @classmethod
    def unsupported(cls, spec: WorkloadSpec, params: dict) -> str | None:
        if params["dispatch"] not in DISPATCHES:
            return None  # validate's error
        try:  # serial plays one rank a process: W > 1 is one process per rank
            dispatch_used(params["dispatch"], spec.world_size, spec.world_size == 1)
        except ValueError as exc:
            return str(exc)
        return None

    @classmethod
    def validate(cls, spec: WorkloadSpec, params: dict, sm_count: int) -> None:
        if params["dispatch"] not in DISPATCHES:
            raise ValueError(
                f"serial: dispatch must be one of {DISPATCHES}, got {params['dispatch']!r}"
            )

    def setup(self, ranks: list[CellInputs]) -> None:
        (inputs,) = ranks
        if inputs.spec.ffn:
            self._setup_layer(inputs)
            return
        self.layer = False
        self.W = inputs.spec.world_size
        lay = inputs.layout
        dev = inputs.x_recv.device
        self.lay = lay
        self.tokens = inputs.spec.tokens_per_rank
        self.scale = Scaler.for_layout(lay, dev)  # indices on the device, built untimed
        perm = torch.sort(lay.recv_expert, stable=True).indices.to(dev)
        self.inv_perm = torch.empty_like(perm)
        self.inv_perm[perm] = torch.arange(perm.numel(), device=dev)
        self.x_sorted = inputs.x_recv.index_select(0, perm).contiguous()
        self.counts = lay.expert_counts.tolist()
        # the routing is fixed per cell, so the expert offsets live on the device from setup
        # (as the overlap system's plan, built untimed): built from host counts they would cost
        # a host-to-device copy every forward (until 9dfcb31 a blocking one, a stream sync)
        self.offs = device_offsets(self.counts, dev)
        self.weights = inputs.weights
        self.y_recv = self._gemm()
        self.y_back = combine(self.y_recv, self.lay, self.ctx.group)
        self._impl = expert_gemm_impl(self.x_sorted, self.weights)

    def _setup_layer(self, inputs: CellInputs) -> None:
        spec = inputs.spec
        self.layer = True
        self.W = spec.world_size
        self.x, self.ids, self.gate = inputs.x, inputs.expert_ids, inputs.gate
        self.w1, self.w2 = inputs.w1, inputs.weights
        self.used = dispatch_used(self.params["dispatch"], spec.world_size, spec.world_size == 1)
        if self.used == "device":  # W=1: every row stays, no host sync
            T, k = spec.tokens_per_rank, spec.top_k
            played = PlayedDispatch(1, spec.experts_per_rank, T, k, self.x)
            self.dispatch = lambda x, ids: played([x], [ids])[0]
        else:
            self.dispatch = ld.LayerDispatch(spec.world_size, spec.experts_per_rank, self.ctx.group)
        self.rows = spec.tokens_per_rank * spec.top_k
        # one untimed forward's state, for the bounds
        self.d = self.dispatch(self.x, self.ids)
        self.xs = ld.to_expert_order(self.d, self.d.x_recv)
        self.y_recv = ld.from_expert_order(self.d, self._experts(self.d, self.xs))
        self.y_back = ld.combine(self.d, self.y_recv, self.ctx.group)
        self._impl = expert_gemm_impl(self.xs, self.w1)
        host_free = self.used == "device" and grouped_mm_usable(self.xs, self.w1)
        self.extra = {"host_syncs": 0 if host_free else 1, "permute": self.d.expert_pos is not None}

    def _gemm(self) -> torch.Tensor:
        """Operator cells: the grouped GEMM, back in the received order [R, N]."""
        y = expert_gemm(self.x_sorted, self.counts, self.weights, self.offs)
        return y.index_select(0, self.inv_perm)

    def _experts(self, d: ld.Dispatched, xs: torch.Tensor) -> torch.Tensor:
        return ffn_experts(xs, d.expert_rows, self.w1, self.w2, d.offs)

    def _layer(self) -> torch.Tensor:
        d = self.dispatch(self.x, self.ids)
        y = self._experts(d, ld.to_expert_order(d, d.x_recv))
        back = ld.combine(d, ld.from_expert_order(d, y), self.ctx.group)
        return Scaler.on_device(d.pos, self.gate, self.rows)(back)

    def forward(self) -> torch.Tensor:
        if self.layer:
            return self._layer()
        return self.scale(combine(self._gemm(), self.lay, self.ctx.group))

    def capture_blocker(self) -> str | None:
        if not self.layer:
            if self.W == 1:
                return None
            return "serial operator at W > 1: NCCL capture across processes not tried yet"
        if self.used != "device":
            return "dispatch=nccl: the split sizes' host sync"
        if not grouped_mm_usable(self.xs, self.w1):
            return "the per-expert matmul fallback needs the expert counts on the host"
        return None

    def resolved_params(self) -> dict:
        return {"dispatch_used": self.used} if self.layer else {}

    def compute_only(self) -> torch.Tensor:
        """Everything forward does except the all-to-all(s) (scale reads the last combine's
        rows; a layer cell's experts read the last dispatch's rows)."""
        if self.layer:
            d = self.d
            y = ld.from_expert_order(d, self._experts(d, ld.to_expert_order(d, d.x_recv)))
            return Scaler.on_device(d.pos, self.gate, self.rows)(self.y_back), y
        return self.scale(self.y_back), self._gemm()

    def comm_only(self) -> torch.Tensor:
        """The combine all-to-all (layer cells: the dispatch's too, same splits)."""
        if self.layer:
            d, g = self.d, self.ctx.group
            ld.redispatch(d, self.x, self.ids.shape[1], g)
            return ld.combine(d, self.y_recv, g)
        return combine(self.y_recv, self.lay, self.ctx.group)

    @property
    def impl(self) -> str:
        return f"native ({self._impl})"
