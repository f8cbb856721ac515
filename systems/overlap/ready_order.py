"""Host tables of the ready scale (kernels/ready_scale.py, a prototype): which band writes each
row of the receive buffer, and the tokens sorted by when their last row is expected.

Built once per plan outside any timed region (a few torch ops; benchmarks/ready_scale.py).
Only the rows the rank's own producer writes (its local rows at local=direct) have a band here:
at W=1 that is every row; rows from peers need the receiver's arrival signals, which the
prototype does not have yet.
"""

from __future__ import annotations

from typing import Any

import torch


def band_of_recv_rows(plan: Any, row_dst: torch.Tensor, n_recv: int) -> torch.Tensor:
    """int64 [n_recv]: for each receive-buffer row, the band whose producer tiles store it there
    (row_dst [P]: plan.local_row_map, the receive row of each padded row or -1), -1 for a row no
    band of this plan stores. A compact plan only: with every band signalled, only its producer
    stores a signalled band's local rows in the receive buffer (other layouts leave them in y)."""
    if plan.layout != "compact":
        raise ValueError(
            f"band_of_recv_rows: a compact plan needed (got {plan.layout!r}): the producer "
            "stores a signalled band's local rows in the receive buffer only there"
        )
    B = plan.n_bands
    start = plan.band_row[:B].long().cpu()
    rows = plan.band_rows[:B].long().cpu()
    first = torch.cumsum(rows, 0) - rows
    band = torch.repeat_interleave(torch.arange(B), rows)
    p = start[band] + torch.arange(int(rows.sum())) - first[band]
    dst = row_dst.long().cpu()[p]
    keep = dst >= 0
    out = torch.full((n_recv,), -1, dtype=torch.int64)
    out[dst[keep]] = band[keep]
    return out


def ready_order(
    pos: torch.Tensor, gate: torch.Tensor, band_of_row: torch.Tensor, band_time: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tok [T], pos [T, k], band [T, k], gate [T, k]): the tokens sorted by the expected time
    of their latest band (band_time [B], any model, e.g. benchmarks.token_ready's), ties by
    token, with their rows, bands and gate weights in that order. pos [T, k] rows of the
    receive buffer; every row must have a band (ValueError otherwise)."""
    pos = pos.long().cpu()
    band = band_of_row[pos]
    if bool((band < 0).any()):
        t, j = (int(v) for v in (band < 0).nonzero()[0])
        raise ValueError(
            f"ready_order: row {int(pos[t, j])} of token {t} has no band of this plan "
            "(a peer's row: the ready scale covers only rows the own producer writes)"
        )
    latest = band_time.double().cpu()[band].amax(1)
    tok = torch.sort(latest, stable=True).indices
    return tok, pos[tok], band[tok], gate.float().cpu()[tok]
