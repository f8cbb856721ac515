"""The paper's serial baseline: expert GEMMs, then the combine all-to-all, then scale.

Timed region (forward): grouped GEMM over rows sorted by expert [R, K] x [E, K, N] -> [R, N],
un-permute to source order, all_to_all_single back to the owners, gate-weighted scale -> [T, N].
The GEMM is torch._grouped_mm where it applies (Hopper, bf16), a per-expert matmul elsewhere.
"""

from __future__ import annotations

import torch

from harness.experts import expert_gemm, expert_gemm_impl
from harness.reference import combine
from harness.scale import Scaler
from harness.system import CellInputs, System


class SerialSystem(System):
    name = "serial"

    def setup(self, ranks: list[CellInputs]) -> None:
        (inputs,) = ranks
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
        self.weights = inputs.weights
        self.y_recv = expert_gemm(self.x_sorted, self.counts, self.weights).index_select(
            0, self.inv_perm
        )
        self.y_back = combine(self.y_recv, self.lay, self.ctx.group)
        self._impl = expert_gemm_impl(self.x_sorted, self.weights)

    def forward(self) -> torch.Tensor:
        y = expert_gemm(self.x_sorted, self.counts, self.weights).index_select(0, self.inv_perm)
        return self.scale(combine(y, self.lay, self.ctx.group))

    def compute_only(self) -> torch.Tensor:
        """Everything forward does except the all-to-all (scale reads the last combine's rows)."""
        y = expert_gemm(self.x_sorted, self.counts, self.weights).index_select(0, self.inv_perm)
        return self.scale(self.y_back), y

    def comm_only(self) -> torch.Tensor:
        return combine(self.y_recv, self.lay, self.ctx.group)

    @property
    def impl(self) -> str:
        return f"native ({self._impl})"
