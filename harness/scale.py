"""The scale every system shares (docs/method.md, "The scale"): out [T, N] = sum_j gate[t, j] *
y_back[pos[t, j]] in y_back's dtype; on CUDA harness/kernels/scale.py, elsewhere torch.
"""

from __future__ import annotations

import torch

from harness.layout import RankLayout


class Scaler:
    """Step 5 of the layer for one rank, called on its receive buffer y_back. pos [T, k] int64:
    the row of (token t, slot j) in y_back; gate [T, k] float32."""

    def __init__(
        self,
        pos: torch.Tensor,
        gate: torch.Tensor,
        device: torch.device,
        rows_needed: int | None = None,
    ) -> None:
        if pos.ndim != 2 or tuple(gate.shape) != tuple(pos.shape):
            raise ValueError(
                f"scale: pos and gate must both be [T, k], got {tuple(pos.shape)} and "
                f"{tuple(gate.shape)}"
            )
        self.pos = pos.to(device=device, dtype=torch.int64).contiguous()
        self.gate = gate.to(device=device, dtype=torch.float32).contiguous()
        self.device = torch.device(device)
        if rows_needed is None:  # reads the device: set-up time only
            rows_needed = int(pos.max()) + 1 if pos.numel() else 0
        self.rows_needed = rows_needed
        self.fused = self.device.type == "cuda"

    @classmethod
    def for_layout(cls, lay: RankLayout, device: torch.device) -> Scaler:
        return cls(lay.send_pos, lay.gate, device)

    @classmethod
    def on_device(cls, pos: torch.Tensor, gate: torch.Tensor, rows: int) -> Scaler:
        """From device tensors made in the timed region (pos [T, k] a permutation of the rows
        [0, rows) of y_back): no copy, no host synchronisation."""
        return cls(pos, gate, pos.device, rows_needed=rows)

    def __call__(self, y_back: torch.Tensor) -> torch.Tensor:
        """out [T, N] in y_back's dtype from y_back [S, N] (S >= every position)."""
        if y_back.ndim != 2 or y_back.shape[0] < self.rows_needed:
            raise ValueError(
                f"scale: y_back must be [S >= {self.rows_needed}, N], got {tuple(y_back.shape)}"
            )
        if y_back.device.type != self.device.type:
            raise ValueError(f"scale: y_back on {y_back.device}, indices on {self.device}")
        T, k = self.pos.shape
        if self.fused:
            from harness.kernels.scale import launch_scale

            out = torch.empty(T, y_back.shape[1], dtype=y_back.dtype, device=y_back.device)
            return launch_scale(y_back.contiguous(), self.pos, self.gate, out)
        rows = y_back.index_select(0, self.pos.view(-1)).view(T, k, -1).float()
        return (rows * self.gate.unsqueeze(-1)).sum(1).to(y_back.dtype)
