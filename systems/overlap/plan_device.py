"""Stage A on the device with NO host synchronisation: build_plan's plan, worst-case sized.

`build_plan_device` returns the plan systems.overlap.plan.build_plan returns (same inputs, same
semantics: remote-aligned layout, remote-first schedule, segments with the cut rule, local rows)
as a DevicePlan: every tensor is sized at its WORST CASE from host ints alone, the real sizes
are int64 device tensors, and entries past them hold the sentinel -1. Nothing waits for the
device, so the plan can be rebuilt inside a timed step from this step's routing.

Launches: one fill (-1) of the output buffer and three Triton kernels (kernels/plan.py); the
padded GEMM input is one more kernel (`padded_input_device`), the local copy of stage B one
more (`local_copy_device`).

Worst cases, from R = the inputs' length (a host int: the tensors' shape; with `n_rows` the
inputs can be a worst-case-sized receive buffer whose first n_rows rows are real), E, W, tile_m:
  max_padded        R + min(E*(W-1), R) * (tile_m - 1)      (each remote group pads < tile_m)
  max_bands         (R + min(E*W, R) * (tile_m - 1)) // tile_m
  max_remote_bands  (R + min(E*(W-1), R) * (tile_m - 1)) // tile_m
  max_segments      max_remote_bands                          (a segment holds >= 1 band)
  max_local         R
Input contract (as build_plan's): the rows of one (expert, owner) group occupy consecutive
positions of the owner's receive buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import triton

from systems.overlap.kernels import plan as kplan
from systems.overlap.plan import CombinePlan

ROW_BLOCK = 1024  # rows per program of the row kernels
COUNT_NAMES = ("n_rows", "n_padded", "n_bands", "n_remote_bands", "n_segments", "n_local")


@dataclass
class DevicePlan:
    """CombinePlan's tensors (same names, same meaning, int64), worst-case sized, plus counts.

    Host ints: world_size W, rank, experts_per_rank E, tile_m, mgb, out_cols, elem_bytes and the
    bounds max_rows R, max_padded P', max_bands B', max_remote_bands, max_segments S',
    max_local L' (module docstring).
    counts [6] int64 on the device: n_rows, n_padded, n_bands, n_remote_bands, n_segments,
    n_local (the properties of those names are 0-dim views of it: device tensors, no sync).
    Sizes: row_pos [R]; gather_index [P']; band_* and schedule [B']; seg_* [S'];
    local_src_row, local_dst_index [L']; expert_row_start [E+1]; group_rows, group_padded
    [E, W]; sent_rows, sent_segments [W]; recv_rows, recv_row_start [W] or None.
    Entries past the real counts are -1 (row_pos past n_rows too; gather_index is also -1 at
    every padding row, band_segment at local bands, as in CombinePlan).
    """

    world_size: int
    rank: int
    experts_per_rank: int
    tile_m: int
    mgb: int
    out_cols: int
    elem_bytes: int
    max_rows: int
    max_padded: int
    max_bands: int
    max_remote_bands: int
    max_segments: int
    max_local: int
    counts: torch.Tensor
    row_pos: torch.Tensor
    gather_index: torch.Tensor
    expert_row_start: torch.Tensor
    group_rows: torch.Tensor
    group_padded: torch.Tensor
    band_expert: torch.Tensor
    band_row: torch.Tensor
    band_rows: torch.Tensor
    band_dst: torch.Tensor
    band_valid: torch.Tensor
    band_offset: torch.Tensor
    band_segment: torch.Tensor
    schedule: torch.Tensor
    #: [B'] the schedule positions in order="expert"'s visiting order (plan.producer_order's
    #: valid prefix, built by the fill kernel: no extra launch); -1 past n_bands
    visit: torch.Tensor
    seg_start: torch.Tensor
    seg_count: torch.Tensor
    seg_dst: torch.Tensor
    seg_rows: torch.Tensor
    seg_bytes: torch.Tensor
    seg_src_row: torch.Tensor
    seg_offset: torch.Tensor
    sent_rows: torch.Tensor
    sent_segments: torch.Tensor
    recv_rows: torch.Tensor | None
    recv_row_start: torch.Tensor | None
    local_src_row: torch.Tensor
    local_dst_index: torch.Tensor

    counts_on_device = True  # the kernels' launchers read the counts from `counts`

    @property
    def n_rows(self) -> torch.Tensor:
        return self.counts[0]

    @property
    def n_padded(self) -> torch.Tensor:
        return self.counts[1]

    @property
    def n_bands(self) -> torch.Tensor:
        return self.counts[2]

    @property
    def n_remote_bands(self) -> torch.Tensor:
        return self.counts[3]

    @property
    def n_segments(self) -> torch.Tensor:
        return self.counts[4]

    @property
    def n_local(self) -> torch.Tensor:
        return self.counts[5]

    def to_host_plan(self) -> CombinePlan:
        """The CombinePlan of the valid prefixes (synchronises: tests and reports only)."""
        n = dict(zip(COUNT_NAMES, self.counts.tolist()))
        cut = {
            "row_pos": n["n_rows"],
            "gather_index": n["n_padded"],
            "seg": n["n_segments"],
            "band": n["n_bands"],
            "schedule": n["n_bands"],
            "local": n["n_local"],
        }
        kw = {}
        for f in fields(CombinePlan):
            if f.name in COUNT_NAMES:
                kw[f.name] = n[f.name]
                continue
            if not hasattr(self, f.name):  # layout, piece_*: a DevicePlan is always aligned
                continue
            v = getattr(self, f.name)
            key = next((k for k in cut if f.name.startswith(k)), None)
            kw[f.name] = v[: cut[key]] if key is not None else v
        return CombinePlan(**kw)


def plan_bounds(n_rows: int, *, world_size: int, experts_per_rank: int, tile_m: int) -> dict:
    """The worst-case sizes of a DevicePlan (host ints; the module docstring's formulas)."""
    R, W, E, tm = n_rows, world_size, experts_per_rank, tile_m
    rg = min(E * (W - 1), R)
    nr = (R + rg * (tm - 1)) // tm
    return {
        "max_rows": R,
        "max_padded": R + rg * (tm - 1),
        "max_bands": (R + min(E * W, R) * (tm - 1)) // tm,
        "max_remote_bands": nr,
        "max_segments": nr,
        "max_local": R,
    }


def build_plan_device(
    recv_src: torch.Tensor,
    recv_expert: torch.Tensor,
    recv_dst_index: torch.Tensor,
    *,
    world_size: int,
    rank: int,
    experts_per_rank: int,
    tile_m: int,
    mgb: int,
    out_cols: int,
    elem_bytes: int,
    send_counts: torch.Tensor | None = None,
    n_rows: torch.Tensor | None = None,
) -> DevicePlan:
    """build_plan's plan of `rank` on the inputs' device without a host synchronisation.

    recv_src, recv_expert, recv_dst_index [R] (any int dtype, contiguous): build_plan's inputs;
    n_rows (optional, 0-dim/1-element int device tensor): only rows [0, n_rows) are real (the
    inputs may be a worst-case-sized receive buffer); send_counts [W] (optional): as in
    build_plan. The valid prefixes of the result equal build_plan's tensors, its counts
    build_plan's ints. Triton kernels: on the GPU, or the CPU under TRITON_INTERPRET=1.
    """
    W, E, tm = world_size, experts_per_rank, tile_m
    if not 0 <= rank < W:
        raise ValueError(f"rank {rank} not in [0, {W})")
    if E < 1 or tm < 1 or mgb < 1:
        raise ValueError(f"experts_per_rank, tile_m, mgb must be >= 1; got {E}, {tm}, {mgb}")
    dev = recv_src.device
    R, G = recv_src.numel(), E * W
    src, exp, dst = (t.contiguous() for t in (recv_src, recv_expert, recv_dst_index))
    bd = plan_bounds(R, world_size=W, experts_per_rank=E, tile_m=tm)
    Bm, Sm, Pm = bd["max_bands"], bd["max_segments"], bd["max_padded"]
    has_send = send_counts is not None
    sizes = {
        "counts": 6,
        "row_pos": R,
        "gather_index": Pm,
        "expert_row_start": E + 1,
        "group_rows": G,
        "group_padded": G,
        **{k: Bm for k in ("band_expert", "band_row", "band_rows", "band_dst", "band_valid")},
        **{k: Bm for k in ("band_offset", "band_segment", "schedule", "visit")},
        **{k: Sm for k in ("seg_start", "seg_count", "seg_dst", "seg_rows", "seg_bytes")},
        **{k: Sm for k in ("seg_src_row", "seg_offset")},
        "sent_rows": W,
        "sent_segments": W,
        "recv_rows": W if has_send else 0,
        "recv_row_start": W if has_send else 0,
        "local_src_row": R,
        "local_dst_index": R,
        "_cnt_enc": G,
        "_dmin_enc": G,
    }
    buf = torch.full((sum(sizes.values()),), -1, dtype=torch.int64, device=dev)  # launch 1
    out, o = {}, 0
    for k, n in sizes.items():
        out[k] = buf[o : o + n]
        o += n
    n_blocks = triton.cdiv(R, ROW_BLOCK)
    work = torch.empty(8 * G + 2 * n_blocks, dtype=torch.int64, device=dev)
    gw = work[: 8 * G]
    blk_local = work[8 * G : 8 * G + n_blocks]
    blk_off = work[8 * G + n_blocks :]
    has_n = n_rows is not None
    n_ptr = n_rows.reshape(-1) if has_n else out["counts"]  # unused without HAS_N
    if n_blocks:
        kplan._rows_kernel[(n_blocks,)](
            src,
            exp,
            dst,
            n_ptr,
            R,
            out["_cnt_enc"],
            out["_dmin_enc"],
            blk_local,
            rank,
            W,
            HAS_N=has_n,
            BLOCK=ROW_BLOCK,
            num_warps=4,
        )
    sc = send_counts.reshape(-1) if has_send else out["counts"]
    kplan._groups_kernel[(1,)](
        out["_cnt_enc"],
        out["_dmin_enc"],
        blk_local,
        blk_off,
        n_blocks,
        n_ptr,
        R,
        sc,
        gw,
        out["counts"],
        out["expert_row_start"],
        out["group_rows"],
        out["group_padded"],
        out["sent_rows"],
        out["sent_segments"],
        out["recv_rows"],
        out["recv_row_start"],
        rank,
        E,
        W,
        tm,
        mgb,
        EP=triton.next_power_of_2(E),
        WP=triton.next_power_of_2(W),
        BLK=1024,
        HAS_N=has_n,
        HAS_SEND=has_send,
        num_warps=4,
    )
    kplan._fill_kernel[(G + n_blocks,)](
        src,
        exp,
        dst,
        n_ptr,
        R,
        gw,
        out["counts"],
        blk_off,
        out["row_pos"],
        out["gather_index"],
        out["local_src_row"],
        out["local_dst_index"],
        *(out[k] for k in ("band_expert", "band_row", "band_rows", "band_dst", "band_valid")),
        out["band_offset"],
        out["band_segment"],
        out["schedule"],
        out["visit"],
        *(out[k] for k in ("seg_start", "seg_count", "seg_dst", "seg_rows", "seg_bytes")),
        out["seg_src_row"],
        out["seg_offset"],
        rank,
        W,
        G,
        tm,
        mgb,
        out_cols * elem_bytes,
        HAS_N=has_n,
        QB=64,
        BLOCK=ROW_BLOCK,
        num_warps=4,
    )
    for k in ("group_rows", "group_padded"):
        out[k] = out[k].view(E, W)
    if not has_send:
        out["recv_rows"] = out["recv_row_start"] = None
    del out["_cnt_enc"], out["_dmin_enc"]
    return DevicePlan(
        world_size=W,
        rank=rank,
        experts_per_rank=E,
        tile_m=tm,
        mgb=mgb,
        out_cols=out_cols,
        elem_bytes=elem_bytes,
        **bd,
        **out,
    )


def padded_input_device(
    x_recv: torch.Tensor, plan: DevicePlan, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The padded GEMM input X [max_padded, K] from x_recv [R, K] in one kernel, no sync.

    Row p < n_padded: x_recv[gather_index[p]], zeros at a padding row; rows >= n_padded are
    left as they are (uninitialised with out=None: the producer never reads them).
    """
    K = x_recv.shape[1]
    if out is None:
        out = torch.empty(plan.max_padded, K, dtype=x_recv.dtype, device=x_recv.device)
    _gather_rows(x_recv, out, plan.gather_index, None, plan.n_padded, plan.max_padded)
    return out


def local_copy_device(y: torch.Tensor, recv: torch.Tensor, plan: DevicePlan) -> torch.Tensor:
    """recv[local_dst_index[i]] = y[local_src_row[i]] for i < n_local (one kernel, no sync)."""
    _gather_rows(y, recv, plan.local_src_row, plan.local_dst_index, plan.n_local, plan.max_local)
    return recv


def _gather_rows(src, dst, src_index, dst_index, n, bound, br: int = 16) -> None:
    """dst[dst_index[i]] = src[src_index[i]] (zeros where src_index < 0) for i < n (device)."""
    if bound == 0:
        return
    if not (src.is_contiguous() and dst.is_contiguous()) or src.shape[1] != dst.shape[1]:
        raise ValueError("row gather: contiguous [*, K] operands with the same K")
    K = src.shape[1]
    bk = min(triton.next_power_of_2(K), 256)
    kplan._gather_rows_kernel[(triton.cdiv(bound, br),)](
        src,
        dst,
        src_index,
        dst_index if dst_index is not None else src_index,
        n.reshape(1),
        K,
        HAS_DST_INDEX=dst_index is not None,
        BR=br,
        BK=bk,
        num_warps=4,
    )
