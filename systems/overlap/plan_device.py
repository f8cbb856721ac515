"""Stage A on the device with NO host synchronisation: build_plan's plan, worst-case sized.

`build_plan_device` returns the plan systems.overlap.plan.build_plan returns (same inputs, same
semantics: the remote-aligned or the compact layout, remote-first schedule, segments with the
cut rule, local rows) as a DevicePlan: every tensor is sized at its WORST CASE from host ints
alone, the real sizes are int64 device tensors, and entries past them hold the sentinel -1.
Nothing waits for the device, so the plan can be rebuilt inside a timed step from this step's
routing.

Launches: one fill (-1) of the output buffer and three Triton kernels (kernels/plan.py; the
fill kernel also writes the local row map `row_dst` that local=direct reads); the padded GEMM
input is one more kernel (`padded_input_device`), the local copy of stage B one more
(`local_copy_device`). A layer's stage A runs `DevicePlanBuilder` instead: the same launches
into one plan rewritten in place every step, remembered (harness/kernels/relaunch.py).

Worst cases, from R = the inputs' length (a host int: the tensors' shape; with `n_rows` the
inputs can be a worst-case-sized receive buffer whose first n_rows rows are real), E, W, tile_m:
  max_padded        R + min(E*(W-1), R) * (tile_m - 1)      (each remote group pads < tile_m)
  max_bands         (R + min(E*W, R) * (tile_m - 1)) // tile_m
  max_remote_bands  (R + min(E*(W-1), R) * (tile_m - 1)) // tile_m
  max_segments      max_remote_bands                          (a segment holds >= 1 band)
  max_local         R
layout="compact" (plan.py: no padding, the local rows fill the remote rows' last band) builds
with its own group and fill kernels (`_groups_compact_kernel`, `_fill_compact_kernel`) and adds
the pieces [max_pieces] with their count `n_pieces` [1]. Its worst cases:
  max_padded        R                                          (no zero row)
  max_bands         (R + min(E, R) * (tile_m - 1)) // tile_m   (an expert's last band is short)
  max_remote_bands  max_bands
  max_pieces        min(R, max_bands + min(E*(W-1), R))        (a band: one piece per owner)
  max_segments      max_pieces
Input contract (as build_plan's): the rows of one (expert, owner) group occupy consecutive
positions of the owner's receive buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from harness.kernels.ints import cdiv, next_power_of_2
from harness.kernels.relaunch import LaunchMemo
from systems.overlap.kernels import plan as kplan
from systems.overlap.modes import GROUP_CODE
from systems.overlap.plan import DEVICE_LAYOUTS, CombinePlan, check_group_cap

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
    #: "aligned" or "compact" (plan.py); a compact plan also has its pieces, worst-case sized
    #: [max_pieces], -1 past n_pieces (a [1] device tensor)
    layout: str = "aligned"
    max_pieces: int = 0
    n_pieces: torch.Tensor | None = None
    piece_band: torch.Tensor | None = None
    piece_row: torch.Tensor | None = None
    piece_rows: torch.Tensor | None = None
    piece_offset: torch.Tensor | None = None
    piece_dst: torch.Tensor | None = None
    #: [max_padded] plan.local_row_map (each local row's place in the own receive buffer at its
    #: padded row, -1 elsewhere), written by the fill kernel: local=direct needs no extra launch
    row_dst: torch.Tensor | None = None

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
        if self.n_pieces is not None:
            n["piece"] = int(self.n_pieces.item())
        cut = {
            "piece": n.get("piece"),
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
            v = getattr(self, f.name)
            key = next((k for k in cut if f.name.startswith(k)), None)
            kw[f.name] = v[: cut[key]] if key is not None and v is not None else v
        return CombinePlan(**kw)


def plan_bounds(
    n_rows: int, *, world_size: int, experts_per_rank: int, tile_m: int, layout: str = "aligned"
) -> dict:
    """The worst-case sizes of a DevicePlan (host ints; the module docstring's formulas)."""
    R, W, E, tm = n_rows, world_size, experts_per_rank, tile_m
    rg = min(E * (W - 1), R)
    if layout == "compact":
        nb = (R + min(E, R) * (tm - 1)) // tm  # an expert's last band is its only short one
        q = min(R, nb + rg)  # a band holds one piece per owner: <= its first + the group starts
        return {
            "max_rows": R,
            "max_padded": R,
            "max_bands": nb,
            "max_remote_bands": nb,
            "max_segments": q,
            "max_local": R,
            "max_pieces": q,
        }
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
    layout: str = "aligned",
) -> DevicePlan:
    """build_plan's plan of `rank` on the inputs' device without a host synchronisation.

    recv_src, recv_expert, recv_dst_index [R] (any int dtype, contiguous): build_plan's inputs;
    n_rows (optional, 0-dim/1-element int device tensor): only rows [0, n_rows) are real (the
    inputs may be a worst-case-sized receive buffer); send_counts [W] (optional): as in
    build_plan. The valid prefixes of the result equal build_plan's tensors, its counts
    build_plan's ints. layout: "aligned" (the paper's) or "compact" (plan.py; the pieces are
    worst-case sized too). Triton kernels: on the GPU, or the CPU under TRITON_INTERPRET=1.
    A new plan every call (DevicePlanBuilder rewrites one plan in place instead).
    """
    build = DevicePlanBuilder(
        world_size=world_size,
        rank=rank,
        experts_per_rank=experts_per_rank,
        tile_m=tile_m,
        mgb=mgb,
        out_cols=out_cols,
        elem_bytes=elem_bytes,
        layout=layout,
        remember=False,
    )
    return build(recv_src, recv_expert, recv_dst_index, send_counts=send_counts, n_rows=n_rows)


class DevicePlanBuilder:
    """build_plan_device for one rank's fixed shape, rebuilt on every call INTO ONE PLAN.

    A layer builds a plan on every forward. This builder allocates the plan's buffers once per
    bound (the inputs' length R, whether send_counts / n_rows are given) and returns the SAME
    DevicePlan object from every call with that bound, its contents rewritten on the current
    stream: one fill (-1) and the three kernels, whose launches are remembered on a GPU
    (harness/kernels/relaunch.py; the inputs, new tensors every call, are swapped in as volatile
    arguments). So the host pays a few launchers instead of Triton's argument binding and the
    plan's ~40 views, and a runner given the same plan object keeps its own remembered launches
    (runner.use_plan). A caller must be done with one call's plan (in stream order) before the
    next call, and must not keep an older plan of the builder for later use.

    padded_input(x_recv) is padded_input_device into one buffer [max_padded, K] kept the same
    way. remember=False: no remembered launches (build_plan_device's one-off builds).
    """

    def __init__(
        self,
        *,
        world_size: int,
        rank: int,
        experts_per_rank: int,
        tile_m: int,
        mgb: int,
        out_cols: int,
        elem_bytes: int,
        layout: str = "aligned",
        remember: bool = True,
    ) -> None:
        W, E, tm = world_size, experts_per_rank, tile_m
        if not 0 <= rank < W:
            raise ValueError(f"rank {rank} not in [0, {W})")
        if E < 1 or tm < 1 or mgb < 1:
            raise ValueError(f"experts_per_rank, tile_m, mgb must be >= 1; got {E}, {tm}, {mgb}")
        if layout not in DEVICE_LAYOUTS:
            raise ValueError(
                f"the device plan builds layout {' or '.join(DEVICE_LAYOUTS)}, not {layout!r}"
            )
        self.W, self.rank, self.E, self.tm, self.mgb = W, rank, E, tm, mgb
        self.out_cols, self.elem_bytes, self.layout = out_cols, elem_bytes, layout
        self.remember = remember
        self.bound_key = None  # (R, device, has_send, has_n) of the buffers below
        self.generation = 0  # moves with every new set of buffers (the launch keys hold it)
        self.plan: DevicePlan | None = None
        self.memos: dict[str, LaunchMemo] = {}
        self.x_pad: torch.Tensor | None = None

    # -- buffers -----------------------------------------------------------------------
    def _allocate(self, R: int, dev: torch.device, has_send: bool, has_n: bool) -> None:
        """The plan's int64 block (filled with -1), the kernels' work space and the plan."""
        W, E, tm, G = self.W, self.E, self.tm, self.E * self.W
        compact = self.layout == "compact"
        bd = plan_bounds(R, world_size=W, experts_per_rank=E, tile_m=tm, layout=self.layout)
        Qm = bd.pop("max_pieces", 0)
        Bm, Sm, Pm = bd["max_bands"], bd["max_segments"], bd["max_padded"]
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
            "row_dst": Pm,
            **{
                k: Qm
                for k in ("piece_band", "piece_row", "piece_rows", "piece_offset", "piece_dst")
            },
            "n_pieces": 1 if compact else 0,
            "_cnt_enc": G,
            "_dmin_enc": G,
        }
        self.buf = torch.full((sum(sizes.values()),), -1, dtype=torch.int64, device=dev)
        out, o = {}, 0
        for k, n in sizes.items():
            out[k] = self.buf[o : o + n]
            o += n
        self.n_blocks = n_blocks = cdiv(R, ROW_BLOCK)
        n_ge = 13 * E  # both group kernels' per-expert work (kernels/plan.py)
        work = torch.empty(8 * G + n_ge + 2 * n_blocks, dtype=torch.int64, device=dev)
        self.gw = work[: 8 * G]
        self.ge = work[8 * G : 8 * G + n_ge]
        self.blk_local = work[8 * G + n_ge : 8 * G + n_ge + n_blocks]
        self.blk_off = work[8 * G + n_ge + n_blocks :]
        self.out = dict(out)  # every view, for the kernels
        plan_fields = {k: v for k, v in out.items() if not k.startswith("_")}
        for k in ("group_rows", "group_padded"):
            plan_fields[k] = out[k].view(E, W)
        if not compact:
            for k in ("n_pieces", "piece_band", "piece_row", "piece_rows", "piece_offset"):
                plan_fields[k] = None
            plan_fields["piece_dst"] = None
        if not has_send:
            plan_fields["recv_rows"] = plan_fields["recv_row_start"] = None
        self.plan = DevicePlan(
            world_size=W,
            rank=self.rank,
            experts_per_rank=E,
            tile_m=tm,
            mgb=self.mgb,
            out_cols=self.out_cols,
            elem_bytes=self.elem_bytes,
            layout=self.layout,
            max_pieces=Qm,
            **bd,
            **plan_fields,
        )
        self.bound_key = (R, dev, has_send, has_n)
        self.generation += 1
        self.x_pad = None

    def _launch(
        self, name: str, kernel, grid: tuple, args: tuple, kw: dict, volatile: dict, extra=()
    ) -> None:
        """kernel[grid](*args, **kw), remembered on a GPU under this generation's buffers (and
        `extra`: whatever else the arguments hold); the `volatile` tensors (named as the
        kernel's arguments) are swapped in on a relaunch."""
        memo = None
        if self.remember and self.buf.device.type == "cuda":
            memo = self.memos.setdefault(name, LaunchMemo())
            key = (self.generation, grid, extra)
            key += tuple((n, t.dtype, t.data_ptr() % 16 == 0) for n, t in volatile.items())
            if memo.hit(key):
                memo.launch(**volatile)
                return
        compiled = kernel[grid](*args, **kw)
        if memo is not None:
            memo.remember(key, kernel, grid, args, kw, compiled)

    # -- one build ---------------------------------------------------------------------
    def __call__(
        self,
        recv_src: torch.Tensor,
        recv_expert: torch.Tensor,
        recv_dst_index: torch.Tensor,
        *,
        send_counts: torch.Tensor | None = None,
        n_rows: torch.Tensor | None = None,
    ) -> DevicePlan:
        """This call's plan (build_plan_device's arguments), in the builder's one plan."""
        W, E, tm, G = self.W, self.E, self.tm, self.E * self.W
        compact = self.layout == "compact"
        dev = recv_src.device
        R = recv_src.numel()
        src, exp, dst = (t.contiguous() for t in (recv_src, recv_expert, recv_dst_index))
        has_send, has_n = send_counts is not None, n_rows is not None
        if self.bound_key != (R, dev, has_send, has_n):
            self._allocate(R, dev, has_send, has_n)  # launch 1: the fill (-1)
        else:
            self.buf.fill_(-1)  # launch 1
        out, n_blocks = self.out, self.n_blocks
        n_ptr = n_rows.reshape(-1) if has_n else out["counts"]  # unused without HAS_N
        sc = send_counts.reshape(-1) if has_send else out["counts"]
        inputs = {"src_ptr": src, "exp_ptr": exp, "dst_ptr": dst, "n_rows_ptr": n_ptr}
        if n_blocks:
            self._launch(
                "rows",
                kplan._rows_kernel,
                (n_blocks,),
                (src, exp, dst, n_ptr, R, out["_cnt_enc"], out["_dmin_enc"], self.blk_local)
                + (self.rank, W),
                dict(HAS_N=has_n, BLOCK=ROW_BLOCK, num_warps=4),
                inputs,
            )
        groups_common = (
            out["counts"],
            *([out["n_pieces"]] if compact else []),
            out["expert_row_start"],
            out["group_rows"],
            out["group_padded"],
            out["sent_rows"],
            out["sent_segments"],
            out["recv_rows"],
            out["recv_row_start"],
            self.rank,
            E,
            W,
            tm,
            self.mgb,
        )
        groups_kw = dict(
            EP=next_power_of_2(E),
            WP=next_power_of_2(W),
            BLK=1024,
            HAS_N=has_n,
            HAS_SEND=has_send,
            num_warps=4,
        )
        head = (out["_cnt_enc"], out["_dmin_enc"], self.blk_local, self.blk_off, n_blocks)
        head += (n_ptr, R, sc, self.gw)
        rows_out = tuple(
            out[k]
            for k in ("row_pos", "gather_index", "local_src_row", "local_dst_index", "row_dst")
        )
        bands_out = tuple(
            out[k]
            for k in ("band_expert", "band_row", "band_rows", "band_dst", "band_valid")
            + ("band_offset", "band_segment", "schedule", "visit")
        )
        segs_out = tuple(
            out[k]
            for k in ("seg_start", "seg_count", "seg_dst", "seg_rows", "seg_bytes")
            + ("seg_src_row", "seg_offset")
        )
        fill_kw = dict(HAS_N=has_n, QB=64, BLOCK=ROW_BLOCK, num_warps=4)
        row_bytes = self.out_cols * self.elem_bytes
        counted = {"n_rows_ptr": n_ptr, "send_counts": sc}
        if compact:
            self._launch(
                "groups",
                kplan._groups_compact_kernel,
                (1,),
                (*head, self.ge, *groups_common),
                groups_kw,
                counted,
            )
            pieces_out = tuple(
                out[k]
                for k in ("piece_band", "piece_row", "piece_rows", "piece_offset", "piece_dst")
            )
            self._launch(
                "fill",
                kplan._fill_compact_kernel,
                (E + G + n_blocks,),
                (src, exp, dst, n_ptr, R, self.gw, self.ge, out["n_pieces"], self.blk_off,
                 *rows_out, *bands_out, *pieces_out, *segs_out,
                 self.rank, E, W, tm, self.mgb, row_bytes),
                fill_kw,
                inputs,
            )  # fmt: skip
        else:
            self._launch(
                "groups",
                kplan._groups_kernel,
                (1,),
                (*head, self.ge, *groups_common),
                groups_kw,
                counted,
            )
            self._launch(
                "fill",
                kplan._fill_kernel,
                (G + n_blocks,),
                (src, exp, dst, n_ptr, R, self.gw, out["counts"], self.blk_off,
                 *rows_out, *bands_out, *segs_out,
                 self.rank, W, G, tm, self.mgb, row_bytes),
                fill_kw,
                inputs,
            )  # fmt: skip
        return self.plan

    def padded_input(self, x_recv: torch.Tensor) -> torch.Tensor:
        """padded_input_device(x_recv, self.plan) into the builder's one buffer
        [max_padded, K] (the same tensor every call with this bound, K and dtype)."""
        plan = self.plan
        if plan is None:
            raise ValueError("padded_input: build a plan first")
        if not x_recv.is_contiguous() or x_recv.dim() != 2:
            raise ValueError("row gather: a contiguous [R, K] x_recv")
        K = x_recv.shape[1]
        x = self.x_pad
        if x is None or x.shape[1] != K or x.dtype != x_recv.dtype or x.device != x_recv.device:
            x = self.x_pad = torch.empty(
                plan.max_padded, K, dtype=x_recv.dtype, device=x_recv.device
            )
        if plan.max_padded == 0:
            return x
        grid, args, kw = _gather_rows_launch(
            x_recv, x, plan.gather_index, None, plan.n_padded, plan.max_padded
        )
        kernel = kplan._gather_rows_kernel
        extra = (x.data_ptr(), K, x.dtype)
        self._launch("gather", kernel, grid, args, kw, {"src": x_recv}, extra=extra)
        return x


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


def _gather_rows(src, dst, src_index, dst_index, n, bound) -> None:
    """dst[dst_index[i]] = src[src_index[i]] (zeros where src_index < 0) for i < n (device)."""
    if bound == 0:
        return
    grid, args, kw = _gather_rows_launch(src, dst, src_index, dst_index, n, bound)
    kplan._gather_rows_kernel[grid](*args, **kw)


def _gather_rows_launch(src, dst, src_index, dst_index, n, bound, br: int = 16):
    """(grid, args, kwargs) of _gather_rows's kernel launch (checked operands)."""
    if not (src.is_contiguous() and dst.is_contiguous()) or src.shape[1] != dst.shape[1]:
        raise ValueError("row gather: contiguous [*, K] operands with the same K")
    K = src.shape[1]
    args = (src, dst, src_index, dst_index if dst_index is not None else src_index)
    args += (n.reshape(1), K)
    kw = dict(
        HAS_DST_INDEX=dst_index is not None,
        BR=br,
        BK=min(next_power_of_2(K), 256),
        num_warps=4,
    )
    return (cdiv(bound, br),), args, kw


def producer_groups_device(
    plan,
    visit: torch.Tensor | None,
    cap: int,
    block: int = 1024,
    out: torch.Tensor | None = None,
    memo: LaunchMemo | None = None,
    memo_key=None,
) -> torch.Tensor:
    """plan.producer_groups in ONE kernel launch (no host synchronisation): groups [B] int32,
    first * GROUP_CODE + size per visiting position. plan: a DevicePlan (its n_bands read on
    the device) or a CombinePlan on the device; visit [B] or None (the schedule's order);
    block: positions per step of the kernel's two passes (a power of two); out: an int32 [B]
    buffer to write; memo (GPU): the launch remembered under memo_key, which must name the
    plan's tensors, visit, out and cap (harness/kernels/relaunch.py)."""
    check_group_cap(cap)
    sched = plan.schedule
    B = sched.numel()
    if out is None:
        out = torch.empty(B, dtype=torch.int32, device=sched.device)
    elif out.shape != (B,) or out.dtype != torch.int32:
        raise ValueError(f"producer groups: out must be int32 [{B}], got {tuple(out.shape)}")
    groups = out
    if B == 0:
        return groups
    if memo is not None and memo.hit(memo_key):
        memo.launch()
        return groups
    dev_count = getattr(plan, "counts_on_device", False)
    args = (
        sched if visit is None else visit,
        sched,
        plan.band_expert,
        plan.n_bands.reshape(1) if dev_count else B,
        groups,
        B,
        cap,
    )
    kw = dict(
        CODE=GROUP_CODE,
        ORDERED=visit is not None,
        DEV_COUNT=dev_count,
        BLOCK=min(block, next_power_of_2(B)),
        num_warps=4,
    )
    compiled = kplan._producer_groups_kernel[(1,)](*args, **kw)
    if memo is not None:
        memo.remember(memo_key, kplan._producer_groups_kernel, (1,), args, kw, compiled)
    return groups
