"""The expert computation shared by the reference and the torch-based systems."""

from __future__ import annotations

import torch


def grouped_mm_usable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """True where torch._grouped_mm (CUTLASS grouped GEMM on Hopper) takes these operands."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    K, N = w.shape[1], w.shape[2]
    aligned = (K * x.element_size()) % 16 == 0 and (N * w.element_size()) % 16 == 0
    if not x.is_cuda:
        return aligned and x.dtype == torch.float32
    hopper = torch.cuda.get_device_capability(x.device) >= (9, 0)
    return aligned and x.dtype == torch.bfloat16 and hopper


def device_offsets(counts: list[int], device: torch.device) -> torch.Tensor:
    """int32 cumulative sums [E] of host counts (rows per expert) on `device`: torch._grouped_mm's
    offs. On a GPU the copy goes from pinned memory without blocking, so it does not synchronise
    the stream (torch.tensor(counts, device=cuda) would: a pageable, blocking copy)."""
    host = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def expert_gemm(
    x: torch.Tensor, counts: list[int], w: torch.Tensor, offs: torch.Tensor | None = None
) -> torch.Tensor:
    """y [R, N] in x.dtype = per-expert X_e @ B_e over x [R, K] rows sorted by local expert,
    w [E, K, N]. counts: rows per expert (host ints [E]; None: read from offs, a host sync where
    the per-expert loop runs); offs: the same as int32 cumulative sums on the device, if at hand
    (else device_offsets copies them on every call: one more launch)."""
    if x.shape[0] == 0:
        return x.new_empty(0, w.shape[2])
    if grouped_mm_usable(x, w):
        if offs is None:
            offs = device_offsets(counts, x.device)
        return torch._grouped_mm(x, w, offs=offs.to(torch.int32))
    if counts is None:  # the per-expert loop needs host ints (a host sync)
        counts = torch.diff(offs.long(), prepend=offs.new_zeros(1).long()).tolist()
    y = x.new_empty(x.shape[0], w.shape[2])
    start = 0
    for e, c in enumerate(counts):
        if c:
            torch.matmul(x[start : start + c], w[e], out=y[start : start + c])
        start += c
    return y


def activation(h: torch.Tensor, n_rows: torch.Tensor | None = None) -> torch.Tensor:
    """The FFN experts' activation: GELU, erf form (torch.nn.functional.gelu's default). n_rows
    (a 1-element int device tensor): only h's first n_rows rows are real; on a GPU they are
    activated in place (harness/kernels/activation.py) and the rest are left as they are."""
    if n_rows is not None and h.is_cuda:
        from harness.kernels.activation import gelu_rows_

        return gelu_rows_(h, n_rows)
    return torch.nn.functional.gelu(h)


def ffn_experts(
    x: torch.Tensor,
    counts: list[int],
    w1: torch.Tensor,
    w2: torch.Tensor,
    offs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Y = gelu(X_e @ W1_e) @ W2_e over rows grouped by expert. x [R, H], w1 [E, H, F],
    w2 [E, F, H] -> [R, H] (fc1's output is rounded to x.dtype before the activation)."""
    return expert_gemm(activation(expert_gemm(x, counts, w1, offs)), counts, w2, offs)


def expert_gemm_impl(x: torch.Tensor, w: torch.Tensor) -> str:
    """Name of the path expert_gemm takes for these operands (for the `impl` column)."""
    return "torch._grouped_mm" if grouped_mm_usable(x, w) else "per-expert matmul"
