"""The one correctness check (docs/method.md, "Correctness"): the whole-tensor relative error and
max_t ||out_t - ref_t|| / ||ref_t|| <= ROW_TOL_FACTOR * tol; bf16 rounding gives per-row errors
of a few 1e-3. A row is measured against at least 0.1 x the median row norm (no division by a
near-zero norm); a train step's gate gradient dgate [T, k] holds inner products over H that
cancel (rounding scales with the operands, not the result), so its rows against at least the
median (ROW_FLOOR; at T=8192, H=4096 in bf16 they reach 8.3e-2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_TOL = 8e-3  # the paper's relative tolerance
ROW_TOL_FACTOR = 10.0  # per-row bound = ROW_TOL_FACTOR * tol
#: the fraction of the median row norm a row is measured against at least, per dict part
ROW_FLOOR = {"dgate": 1.0}


@dataclass(frozen=True)
class CheckResult:
    ok: bool
    max_rel_err: float
    message: str
    max_row_rel_err: float = float("nan")
    ERRORS = ("max_rel_err", "max_row_rel_err")


def row_errors(o: torch.Tensor, r: torch.Tensor, floor: float = 0.1) -> torch.Tensor:
    """Relative error [T] of each row of o, r [T, N] (float32) vs >= floor x the median row norm."""
    norms = r.norm(dim=-1)
    floor = floor * norms.median().clamp_min(1e-30)
    return (o - r).norm(dim=-1) / torch.maximum(norms, floor)


def check(
    out: torch.Tensor, ref: torch.Tensor, tol: float = DEFAULT_TOL, floor: float = 0.1
) -> CheckResult:
    """Compare out [T, N] with ref [T, N] (module doc); a failure gives its reason, the worst row
    where a bound is exceeded. Dicts of named tensors (a train step's output and gradients): each
    checked on its own, the worst errors and every failure."""
    if isinstance(ref, dict):
        if not isinstance(out, dict) or set(out) != set(ref):
            got = sorted(out) if isinstance(out, dict) else type(out).__name__
            return CheckResult(False, float("inf"), f"parts {got} != {sorted(ref)}")
        res = {name: check(out[name], r, tol, ROW_FLOOR.get(name, 0.1)) for name, r in ref.items()}
        bad = "; ".join(f"{name}: {r.message}" for name, r in res.items() if not r.ok)
        whole, row = (max(getattr(r, f) for r in res.values()) for f in CheckResult.ERRORS)
        return CheckResult(not bad, whole, bad, row)
    if tuple(out.shape) != tuple(ref.shape):
        return CheckResult(False, float("inf"), f"shape {tuple(out.shape)} != {tuple(ref.shape)}")
    o, r = out.detach().float(), ref.detach().float().to(out.device)
    if not torch.isfinite(o).all():
        bad = (~torch.isfinite(o)).nonzero()[0].tolist()
        return CheckResult(False, float("inf"), f"non-finite output, first at index {bad}")
    ref_norm = r.norm().item()
    if ref_norm > 0 and o.abs().max().item() == 0:
        return CheckResult(False, 1.0, "output is all zeros", 1.0)
    err = (o - r).norm().item() / max(ref_norm, 1e-30)
    flat = (o.reshape(o.shape[0], -1), r.reshape(r.shape[0], -1)) if o.ndim else None
    rows = row_errors(*flat, floor) if flat else None
    worst = int(rows.argmax()) if rows is not None and rows.numel() else -1
    row_err = float(rows[worst]) if worst >= 0 else 0.0
    row_tol = ROW_TOL_FACTOR * tol
    if err > tol:
        msg = f"rel err {err:.3e} > tol {tol:.1e}; worst row {worst} ({row_err:.3e})"
        return CheckResult(False, err, msg, row_err)
    if row_err > row_tol:
        msg = f"row {worst} rel err {row_err:.3e} > row tol {row_tol:.1e} (whole {err:.3e})"
        return CheckResult(False, err, msg, row_err)
    return CheckResult(True, err, "", row_err)
