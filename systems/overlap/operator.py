"""The paper's operator on one rank: the expert GEMM feeding the tile-level combine, then the
scale (scope gemm+combine). Stage A runs on the host once (the routing is fixed per cell);
step() runs the producer and the consumer concurrently, scaled() reads the receive buffer.
"""

from __future__ import annotations

import torch

from harness.scale import Scaler
from systems.overlap.params import OverlapParams
from systems.overlap.plan import padded_input, plan_for_layout
from systems.overlap.rank_experts import make_runner
from systems.overlap.tuning import pick_config


class OperatorRank:
    """One rank's operator: the plan of its received rows, padded X [P, K], the runner.

    inp: harness.system.CellInputs (spec, layout, weights [E, K, N], x_recv [R, K]);
    transport: this rank's Transport; params: resolved OverlapParams."""

    def __init__(self, inp, transport, params: OverlapParams) -> None:
        spec, w, x_recv = inp.spec, inp.weights, inp.x_recv
        cap = pick_config(params.tile_m, w.shape[1], spec.out, w.dtype).group_cap
        shape = dict(world_size=spec.world_size, experts_per_rank=spec.experts_per_rank)
        shape |= dict(tile_m=params.tile_m, mgb=params.mgb, out_cols=spec.out, group_cap=cap)
        shape |= dict(elem_bytes=x_recv.element_size(), layout=params.layout, order=params.order)
        self.plan = plan_for_layout(inp.layout, device=x_recv.device, **shape)
        self.x = padded_input(x_recv, self.plan.gather_index)
        self.y = torch.empty(self.x.shape[0], spec.out, dtype=x_recv.dtype, device=x_recv.device)
        self.runner = make_runner(self.plan, w, transport, params)
        self.scale = Scaler.for_layout(inp.layout, x_recv.device)

    def step(self) -> None:
        """Producer + consumer concurrently (the producer stores the local rows itself)."""
        self.runner.overlapped(self.x, self.y)

    def scaled(self) -> torch.Tensor:
        """out [T, N] from this rank's combine receive buffer."""
        return self.scale(self.runner.transport.recv)
