"""Stage A on the device with NO host synchronisation (docs/method.md, Stage A).

build_plan_device returns plan.build_plan's plan (same inputs and input contract) with every
array sized at its worst case from host ints alone (plan_bounds), -1 past the counts. Launches:
one fill (-1) of the plan's buffer and kernels/plan.py's row and fill kernels; padded_input_device
one more. DevicePlanBuilder makes the same launches, remembered, into ONE plan rewritten in place.
"""

from __future__ import annotations

import torch

from harness.kernels.ints import cdiv, next_power_of_2
from harness.kernels.relaunch import LaunchMemo
from systems.overlap.kernels import plan as kplan
from systems.overlap.modes import GROUP_CODE
from systems.overlap.plan import CombinePlan, check_plan_args

ROW_BLOCK = 1024  # rows per program of the row kernels
BANDS = ("band_expert", "band_row", "band_rows", "band_dst", "band_valid", "band_offset")
BANDS += ("schedule", "visit")
PIECES = ("piece_band", "piece_row", "piece_rows", "piece_offset")
SEGS = ("seg_start", "seg_count", "seg_dst")


def plan_bounds(
    n_rows: int, *, world_size: int, experts_per_rank: int, tile_m: int, layout: str = "aligned"
) -> dict:
    """The worst-case sizes max_* (host ints) of a device-built plan of n_rows = R input rows;
    aligned: each of at most min(E*(W-1), R) remote groups pads < tile_m rows."""
    R, W, E, tm = n_rows, world_size, experts_per_rank, tile_m
    rg = min(E * (W - 1), R)
    if layout == "compact":
        nb = (R + min(E, R) * (tm - 1)) // tm  # an expert's last band is its only short one
        q = min(R, nb + rg)  # a band holds one piece per owner: <= its first + the group starts
        bd = dict(max_rows=R, max_padded=R, max_bands=nb, max_remote_bands=nb)
        return bd | dict(max_segments=q, max_pieces=q)
    nr = (R + rg * (tm - 1)) // tm
    bd = dict(max_rows=R, max_padded=R + rg * (tm - 1), max_remote_bands=nr, max_segments=nr)
    return bd | dict(max_bands=(R + min(E * W, R) * (tm - 1)) // tm, max_pieces=0)


def build_plan_device(
    *rows: torch.Tensor,
    send_counts: torch.Tensor | None = None,
    n_rows: torch.Tensor | None = None,
    **shape,
) -> CombinePlan:
    """build_plan's plan (its valid prefixes) on the inputs' device with no host sync, in new
    buffers, on the GPU or under TRITON_INTERPRET=1. rows: build_plan's recv_src, recv_expert,
    recv_dst_index [R] (any int dtype); n_rows (a 1-element int device tensor): only rows
    [0, n_rows) are real; shape: DevicePlanBuilder's arguments."""
    build = DevicePlanBuilder(**shape, remember=False)
    return build(*rows, send_counts=send_counts, n_rows=n_rows)


class DevicePlanBuilder:
    """build_plan_device for one rank's fixed shape, rebuilt on every call INTO ONE PLAN.

    Buffers are allocated once per bound (the inputs' length R, whether send_counts / n_rows
    are given); every call with that bound rewrites the SAME CombinePlan on the current stream
    (a caller must be done with one call's plan, in stream order, before the next), its
    launches remembered on a GPU (remember=False: not) with the inputs swapped in.
    padded_input(x_recv) writes one buffer [max_padded, K] the same way."""

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
        order: str = "remote_first",
        group_cap: int = 0,
        remember: bool = True,
    ) -> None:
        check_plan_args(world_size, rank, experts_per_rank, tile_m, mgb, layout, order, group_cap)
        self.shape = dict(world_size=world_size, rank=rank, experts_per_rank=experts_per_rank)
        self.shape |= dict(tile_m=tile_m, mgb=mgb, out_cols=out_cols, elem_bytes=elem_bytes)
        self.shape |= dict(layout=layout, order=order, group_cap=group_cap)
        self.W, self.E = world_size, experts_per_rank
        self.dims = (rank, experts_per_rank, world_size, tile_m, mgb)  # both kernels' last ints
        self.compact = layout == "compact"
        self.remember = remember
        self.bound_key = None  # (R, device, has_send, has_n) of the buffers below
        self.generation = 0  # moves with every new set of buffers (the launch keys hold it)
        self.plan: CombinePlan | None = None
        self.memos: dict[str, LaunchMemo] = {}
        self.x_pad: torch.Tensor | None = None

    def _allocate(self, R: int, dev: torch.device, has_send: bool, has_n: bool) -> None:
        """The plan's int64 block (filled with -1), the kernels' work space and the plan."""
        W, E, G = self.W, self.E, self.E * self.W
        lay, tm = self.shape["layout"], self.shape["tile_m"]
        bd = plan_bounds(R, world_size=W, experts_per_rank=E, tile_m=tm, layout=lay)
        Bm, Sm, Pm, Qm = bd["max_bands"], bd["max_segments"], bd["max_padded"], bd["max_pieces"]
        sizes = dict(counts=7, row_pos=R, gather_index=Pm, row_dst=Pm, expert_row_start=E + 1)
        sizes |= {k: Bm for k in BANDS} | {k: Sm for k in SEGS} | {k: Qm for k in PIECES}
        sizes |= dict(recv_rows=W * has_send, _cnt_enc=G, _dmin_enc=G)
        sizes |= dict(_ticket=2)  # the kernels' last-program tickets: the fill resets them
        self.buf = torch.full((sum(sizes.values()),), -1, dtype=torch.int64, device=dev)
        self.out, o = {}, 0
        for k, n in sizes.items():
            self.out[k] = self.buf[o : o + n]
            o += n
        self.n_blocks = cdiv(R, ROW_BLOCK)
        work = torch.empty(8 * G + 13 * E, dtype=torch.int64, device=dev)
        self.gw, self.ge = work[: 8 * G], work[8 * G :]  # the group kernel's work (kernels/plan.py)
        f = {k: v for k, v in self.out.items() if not k.startswith("_")}
        unused = dict(recv_rows=not has_send, visit=self.shape["order"] != "expert")
        unused |= dict.fromkeys(PIECES, not self.compact)
        f |= {k: None for k, off in unused.items() if off}
        f["groups"] = None
        if self.shape["group_cap"]:
            f["groups"] = torch.full((Bm,), -1, dtype=torch.int32, device=dev)
        self.plan = CombinePlan(**self.shape, **f)
        self.bound_key = (R, dev, has_send, has_n)
        self.generation += 1
        self.x_pad = None

    def _launch(
        self, name: str, kernel, grid: tuple, args: tuple, kw: dict, volatile: dict, extra=()
    ):
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

    def __call__(
        self,
        recv_src: torch.Tensor,
        recv_expert: torch.Tensor,
        recv_dst_index: torch.Tensor,
        *,
        send_counts: torch.Tensor | None = None,
        n_rows: torch.Tensor | None = None,
    ) -> CombinePlan:
        """This call's plan (build_plan_device's arguments), in the builder's one plan: the row
        kernel, then the fill kernel (bands, segments, pieces, rows; its last program the
        producer's swizzle groups [B], plan.producer_groups, where the plan has them, B > 0)."""
        W, E = self.W, self.E
        dev, R = recv_src.device, recv_src.numel()
        src, exp, dst = (t.contiguous() for t in (recv_src, recv_expert, recv_dst_index))
        has_send, has_n = send_counts is not None, n_rows is not None
        if self.bound_key != (R, dev, has_send, has_n):
            self._allocate(R, dev, has_send, has_n)  # launch 1: the fill (-1)
        else:
            self.buf.fill_(-1)  # launch 1
        out, p = self.out, self.plan
        n_ptr = n_rows.reshape(-1) if has_n else out["counts"]  # unused without HAS_N
        sc = send_counts.reshape(-1) if has_send else out["counts"]
        inputs = {"src_ptr": src, "exp_ptr": exp, "dst_ptr": dst, "n_rows_ptr": n_ptr}
        args = (src, exp, dst, n_ptr, R, out["_cnt_enc"], out["_dmin_enc"], out["_ticket"][0:1])
        args += (sc, self.gw, self.ge, out["counts"], out["expert_row_start"], out["recv_rows"])
        common = dict(HAS_N=has_n, BLOCK=ROW_BLOCK, COMPACT=self.compact, num_warps=4)
        kw = common | dict(EP=next_power_of_2(E), WP=next_power_of_2(W), HAS_SEND=has_send)
        grid = (max(self.n_blocks, 1),)  # the groups in the last program (no rows: one program)
        volatile = inputs | {"send_counts": sc}
        self._launch("rows", kplan._rows_kernel, grid, (*args, *self.dims), kw, volatile)
        B = p.schedule.numel()
        grouped = p.groups is not None and B > 0
        args = (src, exp, dst, n_ptr, R, self.gw, self.ge, out["counts"])
        args += tuple(out[k] for k in ("row_pos", "gather_index", "row_dst", *BANDS, *PIECES))
        args += (*(out[k] for k in SEGS), *self.dims, out["_ticket"][1:2])
        args += (p.groups if grouped else out["counts"], B, p.group_cap)
        kw = common | dict(QB=64, GROUPS=grouped, ORDERED=p.visit is not None, CODE=GROUP_CODE)
        kw["GBLOCK"] = min(1024, next_power_of_2(B))
        grid = ((E if self.compact else 0) + E * W + self.n_blocks,)
        self._launch("fill", kplan._fill_kernel, grid, args, kw, inputs)
        return p

    def padded_input(self, x_recv: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """padded_input_device(x_recv, self.plan) into the builder's one buffer
        [max_padded, K] (the same tensor every call with this bound, K and dtype). rows [R]
        (optional): received row r is x_recv[rows[r]] (x_recv: the tokens the rows come from,
        so the dispatch's own gather of the received rows is skipped)."""
        plan = self.plan
        if plan is None:
            raise ValueError("padded_input: build a plan first")
        if not x_recv.is_contiguous() or x_recv.dim() != 2:
            raise ValueError("row gather: a contiguous [R, K] x_recv")
        K = x_recv.shape[1]
        x = self.x_pad
        if x is None or x.shape[1] != K or x.dtype != x_recv.dtype or x.device != x_recv.device:
            x = torch.empty(plan.max_padded, K, dtype=x_recv.dtype, device=x_recv.device)
            self.x_pad = x
        if plan.max_padded == 0:
            return x
        grid, args, kw = _gather_rows_launch(x_recv, x, plan, rows)
        extra = (x.data_ptr(), K, x.dtype, rows is None)
        volatile = {"src": x_recv} if rows is None else {"src": x_recv, "row_of": rows}
        self._launch("gather", kplan._gather_rows_kernel, grid, args, kw, volatile, extra)
        return x


def padded_input_device(
    x_recv: torch.Tensor, plan: CombinePlan, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The padded GEMM input X [max_padded, K] (into `out` where given) from x_recv [R, K] in
    one kernel, no sync: row p < n_padded is x_recv[gather_index[p]] (zeros at a padding row);
    rows >= n_padded are left as they are (the producer never reads them)."""
    if out is None:
        shape = (plan.max_padded, x_recv.shape[1])
        out = torch.empty(shape, dtype=x_recv.dtype, device=x_recv.device)
    if plan.max_padded:
        grid, args, kw = _gather_rows_launch(x_recv, out, plan)
        kplan._gather_rows_kernel[grid](*args, **kw)
    return out


def _gather_rows_launch(src, dst, plan: CombinePlan, rows=None, br: int = 16):
    """(grid, args, kwargs) of the padded gather dst[p] = src[gather_index[p]] (checked);
    rows [R] (optional): dst[p] = src[rows[gather_index[p]]]."""
    if not (src.is_contiguous() and dst.is_contiguous()) or src.shape[1] != dst.shape[1]:
        raise ValueError("row gather: contiguous [*, K] operands with the same K")
    K, index = src.shape[1], plan.gather_index
    args = (src, dst, index, plan.counts[1:2], K, index if rows is None else rows)
    kw = dict(BR=br, BK=min(next_power_of_2(K), 256), HAS_ROWS=rows is not None, num_warps=4)
    return (cdiv(plan.max_padded, br),), args, kw
