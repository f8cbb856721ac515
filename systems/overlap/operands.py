"""The producer's operand contract (kernels/producer.py checks it before a launch); importable
without Triton."""

from __future__ import annotations

import torch


def check_producer_operands(
    who: str, x: torch.Tensor, weights: torch.Tensor, y: torch.Tensor, band_ready: torch.Tensor
) -> tuple[int, int, int, int]:
    """(P, K, E, N) of x [P, K], weights [E, K, N], y [P, N]: one dtype, contiguous, int32
    band_ready; else a one-line ValueError naming `who`."""
    P, K = x.shape
    E, K2, N = weights.shape
    if K2 != K or y.shape != (P, N) or x.dtype != weights.dtype or y.dtype != x.dtype:
        raise ValueError(
            f"{who} shapes: x {tuple(x.shape)} {x.dtype}, weights {tuple(weights.shape)} "
            f"{weights.dtype}, y {tuple(y.shape)} {y.dtype}"
        )
    if not (x.is_contiguous() and weights.is_contiguous() and y.is_contiguous()):
        raise ValueError(f"{who} operands must be contiguous")
    if band_ready.dtype != torch.int32:
        raise ValueError("band_ready must be int32")
    return P, K, E, N
