"""The one correctness check: relative Frobenius error against the reference."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_TOL = 8e-3  # the paper's relative tolerance


@dataclass(frozen=True)
class CheckResult:
    ok: bool
    max_rel_err: float
    message: str


def check(out: torch.Tensor, ref: torch.Tensor, tol: float = DEFAULT_TOL) -> CheckResult:
    """Compare out [T, N] with ref [T, N]: ||out - ref||_F / ||ref||_F <= tol.

    Fails with a reason on a shape mismatch, NaN/inf, an all-zero output where the reference is
    not zero, and names the first row whose error exceeds the tolerance.
    """
    if tuple(out.shape) != tuple(ref.shape):
        return CheckResult(False, float("inf"), f"shape {tuple(out.shape)} != {tuple(ref.shape)}")
    o, r = out.detach().float(), ref.detach().float().to(out.device)
    if not torch.isfinite(o).all():
        bad = (~torch.isfinite(o)).nonzero()[0].tolist()
        return CheckResult(False, float("inf"), f"non-finite output, first at index {bad}")
    ref_norm = r.norm().item()
    if ref_norm > 0 and o.abs().max().item() == 0:
        return CheckResult(False, 1.0, "output is all zeros")
    err = (o - r).norm().item() / max(ref_norm, 1e-30)
    if err <= tol:
        return CheckResult(True, err, "")
    row_err = (o - r).norm(dim=-1) / r.norm(dim=-1).clamp_min(1e-30)
    first = int((row_err > tol).nonzero()[0, 0]) if (row_err > tol).any() else -1
    return CheckResult(False, err, f"rel err {err:.3e} > tol {tol:.1e}; first bad row {first}")
