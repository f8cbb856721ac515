"""The producer: ONE persistent Triton GEMM per rank over all local experts, with readiness flags.

Operands (the remote-aligned layout of systems/overlap/plan.py):
  x       [P, K]     padded GEMM input X (zero rows where plan.gather_index == -1)
  weights [E, K, N]  this rank's expert weights, contiguous
  y       [P, N]     padded GEMM output Y
Work: the schedule lists bands (tile_m rows of one expert, all N columns). A TILE is a pair
(schedule position s, column tile n); tiles are numbered t = s * tiles_n + n (band-major, so the
tiles of the first band in the schedule finish first), optionally swizzled in groups of
`group_m` consecutive schedule positions (column-major inside a group, for L2 reuse of B strips)
or (TileConfig.expert_groups, EXPERT_GROUPS) in the groups of plan.producer_groups: each run of
one expert's bands in the visiting order, cut into groups of at most group_m; group
[first, first + size) owns tiles first * tiles_n .. (first + size) * tiles_n - 1, so the tile's
group is read from groups[t // tiles_n]. A fixed group that straddles two experts reads both
experts' weight strips; with the expert groups each strip is read from HBM once per group.
Program i of the persistent grid takes tiles i, i + G, i + 2G, ... (G = grid size = SMs - cCTA).
With an `order` array (order="expert", plan.producer_order) the tile numbering runs over the
visiting order order[0], order[1], ... of the schedule positions instead of 0, 1, ...: one
expert's remote and local bands then sit side by side, so a swizzle group's concurrent tiles
share that expert's weight strips in L2 (at W=2 the default order puts an expert's one remote
band and its local band half a schedule apart, and every weight strip is read from HBM twice).
Switching expert is pointer arithmetic: the band's expert e selects rows e*K .. e*K+K-1 of the
weights viewed as [E*K, N]; the band's rows are masked at the store (a band never writes past
band_rows, so a partial local band cannot touch the next expert's rows). Nothing is relaunched.

Readiness signal, per band: a counter band_ready[band] (int32) that grows by `tile_increment`
per finished tile, so a band is complete in run r (1-based) when its counter reaches
r * tiles_n * tile_increment. Counters are never reset between runs (epoch values; the runner
zeroes them only before an int32 overflow). Only remote bands (schedule positions < n_signal)
are signalled; local bands need no flag. The ways to publish (TileConfig.flag):
  "thread" (FLAG=2): after its part of the tile's tl.store, EVERY thread does one
           tl.atomic_add(counter, 1, sem="release", scope="gpu"): each release orders that
           thread's own stores, so tile_increment = 32 * num_warps. No CTA barrier, which keeps
           the flattened (tl.range(flatten=True)) tile loop software-pipelined across tiles:
           a tl.debug_barrier in the loop makes Triton 3.6 drop that pipelining (checked on the
           sm_90 compile).
  "deferred" (FLAG=3): like "thread", but tile t is published right after the main loop of the
           program's NEXT tile (and the last one after the loop). The release waits for the
           thread's own earlier stores; a whole main loop later they are long complete, so the
           flag costs nothing on the critical path, for one tile of extra latency per band.
  "warp"   (FLAG=4, GPU only: inline PTX): deferred like "deferred", but per WARP: bar.warp.sync
           (orders the warp's lanes' stores) and lane 0 adds 32 with release: 32x fewer
           same-address atomics per tile than "thread" (they queue at L2 when tiles are short).
  "mid"    (FLAG=5): like "deferred", but tile t is published in the MIDDLE of the next tile's
           main loop (at K step k_tiles // 2), while that step's MMAs are in flight. A release
           compiles to MEMBAR.ALL.GPU before the atomic (sm_90 SASS); in "deferred" it runs after
           the last MMA has drained, so the warp idles through it; here the tensor cores keep
           working. Half a main loop less extra latency per band than "deferred". Measured on
           one H200 it is 0.5% slower than "deferred" (producer_mid.parquet): a recorded variant.
  "cta"    (FLAG=1): tl.debug_barrier() (all the CTA's stores issued, CTA-scope ordering), then
           ONE scalar release atomic (Triton runs a scalar atomic once per CTA; release is
           cumulative, so the whole tile is visible to whoever acquires); tile_increment = 1.
FLAG=0 (signal=False) is the same kernel without any flag: the compute-only bound and the
reference for the flag cost. The main loop (loads + tl.dot) is identical in all of them.
Epilogue: TileConfig.epi_split (EPI_SPLIT) stores the tile in 1, 2 or 4 column slices; each row's
destination (Y, or the receive buffer at local=direct) is chosen once per row. Neither spills
registers on sm_90; 4 slices convert the accumulator's layout through 16 KB of shared memory
instead of 64 KB (the kernel's total 160 KB instead of 176 KB), and measured faster.

Loads: USE_TMA=True takes host-side TMA descriptors (triton.tools.tensor_descriptor) for X and
the [E*K, N] weight view (needs K % block_k == 0 so a K tile never crosses into the next
expert); USE_TMA=False uses masked pointer loads (any K; also the CPU-interpreter path). The
output is written with a plain masked tl.store, never a TMA store, so the flag cannot overtake
the data.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from harness.kernels.ints import cdiv
from harness.kernels.relaunch import LaunchMemo
from systems.overlap import modes
from systems.overlap.kernels.primitives import count_arg, publish_threads, publish_warps
from systems.overlap.modes import FLAG_CODES, FLAG_NONE
from systems.overlap.operands import check_producer_operands
from systems.overlap.plan import GROUP_CODE, producer_groups

# constexpr globals for the kernel (the FLAG modes, modes.py)
_FLAG_CTA = tl.constexpr(modes.FLAG_CTA)
_FLAG_THREAD = tl.constexpr(modes.FLAG_THREAD)
_FLAG_DEFERRED = tl.constexpr(modes.FLAG_DEFERRED)
_FLAG_WARP = tl.constexpr(modes.FLAG_WARP)
_FLAG_MID = tl.constexpr(modes.FLAG_MID)


@dataclass(frozen=True)
class TileConfig:
    """Tile shape and schedule knobs of the producer. block_m must equal the plan's tile_m."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    group_m: int = 1  # 1 = band-major (the paper's order); >1 = L2 swizzle over schedule entries
    use_tma: bool = True
    flatten: bool = True  # tl.range(flatten=True): one pipelined loop over tiles x K steps
    flag: str = "thread"  # "thread" / "deferred" (per-thread release atomics), "cta" (barrier)
    warp_specialize: bool = False  # tl.range(warp_specialize=True): Triton's Hopper warpspec
    epi_split: int = 1  # the epilogue stores the tile in 1, 2 or 4 column slices
    #: swizzle groups = runs of one expert's bands in the visiting order, at most group_m long
    #: (plan.producer_groups), instead of fixed groups of group_m positions
    expert_groups: bool = False

    def tiles_n(self, n: int) -> int:
        """Column tiles per band."""
        return cdiv(n, self.block_n)

    def tile_increment(self) -> int:
        """What one finished tile adds to its band's ready counter."""
        return 1 if self.flag == "cta" else 32 * self.num_warps

    def band_increment(self, n: int) -> int:
        """What one run adds to a signalled band's ready counter (tiles_n * tile_increment)."""
        return self.tiles_n(n) * self.tile_increment()


# Tile configurations per shape for Hopper (H200), bf16/fp16. Keyed by (tile_m, N class):
# N class 0 = narrow (N < 4096), 1 = wide (4096 <= N < 8192), 2 = widest (N >= 8192).
# Chosen on one H200 by benchmarks/kernels_h200.py and experiment=producer (TFLOP/s per variant
# against torch._grouped_mm and dense cuBLAS on the same rows: results/reference/h200/README.md,
# "Kernel design notes and measurements", producer_variants.parquet, producer_mid.parquet and
# producer_split.parquet). A shape not in the table falls back to the generic entry of its
# tile_m; the CPU interpreter gets `interpreter_config`.
#   tile_m  narrow N                  wide N                      widest N
#   128     128x128x64, 8 warps,      128x256x64, 8 warps,        as wide
#           4 stages, group 1,        3 stages, expert groups
#           thread flags              of <= 16 bands, deferred
#                                     flags, epilogue in 4 slices
#   64      64x128x64, 4 warps,       64x256x64, 4 warps,         as wide
#           4 stages, group 1         4 stages, group 4,
#                                     epilogue in 4 slices
# all with TMA loads and the flattened tile loop. The 4-slice epilogue (epi_split=4) of the
# 256-wide tiles: +1.5% median against 1 slice at local=direct, and the flags' cost drops
# from about 1.3% to 0 (producer_mid.parquet, producer_split.parquet). The expert groups
# (before them: fixed groups of 4 at wide N, 8 at widest N): Nsight Compute showed the fixed
# groups reading 2.1-2.5x grouped_mm's HBM bytes (E=8: 923 MB against 375 MB) at the same SM
# cycles; groups of <= 32 read what grouped_mm reads (371 MB). Caps 16 and 32 tie on the
# producer alone; on the loopback overlap step 16 is faster than the fixed groups in every
# N=8192 cell (median 1.7%) and 32 loses two stress_skew cells (producer_groups.parquet,
# producer_ncu_c17c39e.parquet, operator_swizzle_loopback_n8192.parquet).
TILE_TABLE: dict[tuple[int, int], TileConfig] = {
    (128, 0): TileConfig(128, 128, 64, 8, 4, group_m=1, flag="thread"),
    (128, 1): TileConfig(128, 256, 64, 8, 3, 16, flag="deferred", epi_split=4, expert_groups=True),
    (128, 2): TileConfig(128, 256, 64, 8, 3, 16, flag="deferred", epi_split=4, expert_groups=True),
    (64, 0): TileConfig(64, 128, 64, 4, 4, group_m=1, flag="thread"),
    (64, 1): TileConfig(64, 256, 64, 4, 4, group_m=4, flag="deferred", epi_split=4),
    (64, 2): TileConfig(64, 256, 64, 4, 4, group_m=4, flag="deferred", epi_split=4),
}


def n_class(n: int) -> int:
    """TILE_TABLE's N class: 0 (N < 4096), 1 (N < 8192), 2 (N >= 8192)."""
    return 0 if n < 4096 else 1 if n < 8192 else 2


def pick_config(tile_m: int, k: int, n: int, dtype: torch.dtype) -> TileConfig:
    """The table's tile configuration for a (tile_m, K, N) problem in fp16/bf16."""
    cfg = TILE_TABLE.get((tile_m, n_class(n)))
    if cfg is None:
        cfg = TileConfig(tile_m, 128, 64, 4, 3, group_m=4, flag="deferred")
    if k % cfg.block_k != 0:  # no TMA: pointer loads pipeline best without flattening
        cfg = replace(cfg, use_tma=False, flatten=False, flag="cta")
    if dtype == torch.float32:
        cfg = replace(cfg, block_k=32, num_stages=2)
    return cfg


def with_swizzle(cfg: TileConfig, swizzle: str) -> TileConfig:
    """cfg with the producer's swizzle groups named by `swizzle` (modes.parse_swizzle): "table"
    (cfg's own), "fixed<m>" (groups of m visiting positions), "expert<cap>" (runs of one
    expert's bands, at most cap long)."""
    parsed = modes.parse_swizzle(swizzle)
    if parsed is None:
        return cfg
    return replace(cfg, expert_groups=parsed[0], group_m=parsed[1])


def interpreter_config(tile_m: int) -> TileConfig:
    """Small tiles for the CPU interpreter (TRITON_INTERPRET=1)."""
    return TileConfig(tile_m, 32, 16, 4, 1, 1, use_tma=False, flatten=False)


@triton.jit
def _tile_coords(t, n_sched, tiles_n, GROUP_M: tl.constexpr):
    """Tile id t -> (schedule position s, column tile pn); grouped by GROUP_M positions."""
    if GROUP_M == 1:
        s = t // tiles_n
        pn = t % tiles_n
    else:
        per_group = GROUP_M * tiles_n
        first = (t // per_group) * GROUP_M
        size = tl.minimum(n_sched - first, GROUP_M)
        local = t % per_group
        s = first + local % size
        pn = local // size
    return s, pn


@triton.jit
def _group_coords(t, tiles_n, groups, CODE: tl.constexpr):
    """Tile id t -> (visiting position s, column tile pn) with the swizzle groups of
    plan.producer_groups: group [first, first + size) owns tiles first * tiles_n ..
    (first + size) * tiles_n - 1, walked column-major."""
    g = tl.load(groups + t // tiles_n)
    first = g // CODE
    size = g % CODE
    local = t - first * tiles_n
    return first + local % size, local // size


@triton.jit
def _store_cols(vals, row_ptr, row_ok, c0, N, W: tl.constexpr):
    """vals [BM, W] to row_ptr[i] + c0 + j for the rows with row_ok [BM] and columns < N."""
    cols = c0 + tl.arange(0, W)
    tl.store(row_ptr[:, None] + cols[None, :], vals, mask=row_ok[:, None] & (cols[None, :] < N))


@triton.jit
def _producer_kernel(
    x_desc,
    w_desc,
    x_ptr,
    w_ptr,
    y_ptr,
    recv_ptr,
    row_dst,
    schedule,
    order,
    groups,
    band_expert,
    band_row,
    band_rows,
    band_ready,
    n_sched_arg,
    n_signal_arg,
    N,
    K,
    num_progs,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    FLAG: tl.constexpr,
    NT: tl.constexpr,
    USE_TMA: tl.constexpr,
    FLATTEN: tl.constexpr,
    DEV_COUNTS: tl.constexpr,
    LOCAL_DIRECT: tl.constexpr,
    MIXED: tl.constexpr,
    ORDERED: tl.constexpr,
    WS: tl.constexpr,
    EPI_SPLIT: tl.constexpr,
    EXPERT_GROUPS: tl.constexpr,
    GROUP_CODE: tl.constexpr,
):
    # the schedule length and the signalled prefix: host ints, or (DEV_COUNTS) device counts
    n_sched = count_arg(n_sched_arg, DEV_COUNTS)
    n_signal = count_arg(n_signal_arg, DEV_COUNTS)
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BN)
    num_tiles = n_sched * tiles_n
    k_tiles = tl.cdiv(K, BK)
    rm = tl.arange(0, BM)
    rn = tl.arange(0, BN)
    rk = tl.arange(0, BK)
    lane = tl.arange(0, NT)
    pending = tl.full((), -1, tl.int32)  # FLAG 3: band of the previous tile still to publish
    for t in tl.range(pid, num_tiles, num_progs, flatten=FLATTEN, warp_specialize=WS):
        if EXPERT_GROUPS:
            s, pn = _group_coords(t, tiles_n, groups, GROUP_CODE)
        else:
            s, pn = _tile_coords(t, n_sched, tiles_n, GROUP_M)
        if ORDERED:  # the producer's visiting order of the schedule (plan.producer_order)
            s = tl.load(order + s).to(tl.int32)  # int32 or int64 arrays
        band = tl.load(schedule + s)
        e = tl.load(band_expert + band)
        row0 = tl.load(band_row + band).to(tl.int32)
        nrows = tl.load(band_rows + band).to(tl.int32)
        col0 = pn * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kk in range(k_tiles):
            k0 = kk * BK
            if USE_TMA:
                a = x_desc.load([row0, k0])
                b = w_desc.load([(e * K + k0).to(tl.int32), col0])
            else:
                rows = row0 + rm
                ks = k0 + rk
                a = tl.load(
                    x_ptr + rows.to(tl.int64)[:, None] * K + ks[None, :],
                    mask=(rm[:, None] < nrows) & (ks[None, :] < K),
                    other=0.0,
                )
                cols = col0 + rn
                b = tl.load(
                    w_ptr + (e * K + ks).to(tl.int64)[:, None] * N + cols[None, :],
                    mask=(ks[:, None] < K) & (cols[None, :] < N),
                    other=0.0,
                )
            acc = tl.dot(a, b, acc)
            if FLAG == _FLAG_MID:
                if kk == k_tiles // 2:  # the MMAs in flight hide the release's fence
                    publish_threads(band_ready, pending, lane)
                    pending = -1
        if FLAG == _FLAG_DEFERRED:
            # publish the PREVIOUS tile: its stores were issued a whole main loop ago, so the
            # release (which waits for this thread's earlier stores) costs next to nothing
            publish_threads(band_ready, pending, lane)
        elif FLAG == _FLAG_WARP:
            publish_warps(band_ready, pending, lane)
        rows = row0 + rm
        # per row: where it goes (a pointer to its first column) and whether it is stored
        row_ptr = y_ptr + rows.to(tl.int64) * N
        row_ok = rm < nrows
        if LOCAL_DIRECT:
            # local rows go straight to their places in this rank's own receive buffer
            # (row_dst >= 0): every row of a local band, and (MIXED: a compact plan) the
            # local rows of a mixed band (signalled, its remote rows go to Y); a local band's
            # rows with row_dst = -1 are not stored at all
            if MIXED:
                dst = tl.load(row_dst + rows, mask=row_ok, other=-1)
            else:
                dst = tl.load(row_dst + rows, mask=row_ok & (s >= n_signal), other=-1)
            mine = dst >= 0
            row_ptr = tl.where(mine, recv_ptr + dst.to(tl.int64) * N, row_ptr)
            row_ok = row_ok & (mine | (s < n_signal))
        out = acc.to(y_ptr.dtype.element_ty)
        if EPI_SPLIT == 1:
            _store_cols(out, row_ptr, row_ok, col0, N, BN)
        else:  # the store in column halves (or quarters): fewer live pointers per thread
            h0, h1 = out.reshape(BM, 2, BN // 2).permute(0, 2, 1).split()
            if EPI_SPLIT == 2:
                _store_cols(h0, row_ptr, row_ok, col0, N, BN // 2)
                _store_cols(h1, row_ptr, row_ok, col0 + BN // 2, N, BN // 2)
            else:
                q0, q1 = h0.reshape(BM, 2, BN // 4).permute(0, 2, 1).split()
                _store_cols(q0, row_ptr, row_ok, col0, N, BN // 4)
                _store_cols(q1, row_ptr, row_ok, col0 + BN // 4, N, BN // 4)
                q2, q3 = h1.reshape(BM, 2, BN // 4).permute(0, 2, 1).split()
                _store_cols(q2, row_ptr, row_ok, col0 + BN // 2, N, BN // 4)
                _store_cols(q3, row_ptr, row_ok, col0 + 3 * (BN // 4), N, BN // 4)
        if FLAG == _FLAG_CTA:
            # one release per CTA: the barrier orders every thread's stores before it
            if s < n_signal:
                tl.debug_barrier()
                tl.atomic_add(band_ready + band, 1, sem="release", scope="gpu")
        elif FLAG == _FLAG_THREAD:
            # one release per thread (each orders its own stores): NT increments per tile
            tl.atomic_add(
                band_ready + band + lane * 0,
                lane * 0 + 1,
                mask=(lane * 0 + s) < n_signal,
                sem="release",
                scope="gpu",
            )
        elif FLAG >= _FLAG_DEFERRED:
            pending = tl.where(s < n_signal, band.to(tl.int32), -1)
    if FLAG == _FLAG_DEFERRED or FLAG == _FLAG_MID:
        publish_threads(band_ready, pending, lane)
    elif FLAG == _FLAG_WARP:
        publish_warps(band_ready, pending, lane)


def producer_grid(sm_count: int, ccta: int) -> int:
    """Persistent grid of the producer: every SM but the consumer's cCTA."""
    if not 0 <= ccta < sm_count:
        raise ValueError(f"ccta={ccta} must be in [0, {sm_count})")
    return sm_count - ccta


def producer_input_args(x: torch.Tensor, config: TileConfig) -> dict:
    """The producer's arguments that carry its input x [P, K]: x_ptr, and x_desc where the
    tiles load through TMA (else None). A remembered launch (harness/kernels/relaunch.py)
    swaps these in for another x of the same shape, dtype and 16-byte alignment."""
    P, K = x.shape
    tma = config.use_tma and K % config.block_k == 0
    desc = TensorDescriptor(x, [P, K], [K, 1], [config.block_m, config.block_k]) if tma else None
    return {"x_ptr": x, "x_desc": desc}


def launch_producer(
    x: torch.Tensor,
    weights: torch.Tensor,
    y: torch.Tensor,
    plan: Any,
    band_ready: torch.Tensor,
    *,
    n_signal: int | None = None,
    num_programs: int,
    config: TileConfig,
    signal: bool = True,
    local_to: tuple[torch.Tensor, torch.Tensor] | None = None,
    order: torch.Tensor | None = None,
    groups: torch.Tensor | None = None,
    memo: LaunchMemo | None = None,
    memo_key: Any = None,
):
    """Launch the persistent producer on the current stream; returns Triton's compiled kernel.


    x [P, K], weights [E, K, N], y [P, N] (same dtype; fp16/bf16 on GPU, fp16/fp32 in the
    interpreter); plan: a systems.overlap.plan.CombinePlan on the device, or anything with its
    schedule, band_expert, band_row, band_rows [B] (int32 or int64) and n_remote_bands;
    or a systems.overlap.plan_device.DevicePlan (counts_on_device: the arrays are worst-case
    sized [B'], the kernel reads n_bands / n_remote_bands from the device and the grid is sized
    for B' bands; tiles past the real count are skipped);
    band_ready [B] int32 counters (grown by config.band_increment(N) per signalled band per run);
    n_signal: schedule positions [0, n_signal) are signalled (None: plan.n_remote_bands; an int
    or, with a DevicePlan, a device tensor);
    num_programs: persistent grid (producer_grid: SMs - cCTA); signal=False: no flags (FLAG=0);
    local_to = (recv [S, N], row_dst [P] int32/int64): every row p of a local band (schedule
    position >= n_signal) with row_dst[p] >= 0 is stored at recv[row_dst[p]] instead of y[p],
    and so is every such row of a signalled band where the plan's layout is "compact" (the
    local rows of a mixed band); a local band's other rows (row_dst -1) are not stored: the
    local copy happens in the epilogue (systems/overlap/plan.py local_row_map builds row_dst);
    order [B] int32 or int64 (optional): the visiting order of the schedule positions
    (systems/overlap/plan.py producer_order, or a DevicePlan's `visit`); tiles are swizzled
    over the visiting order, and a band is signalled iff its schedule position is < n_signal,
    as without it;
    groups [B] int32 (config.expert_groups): the swizzle groups of the visiting positions, built
    once per plan by the caller (plan.producer_groups, or plan_device.producer_groups_device on
    a GPU, as the runner does); None: built here by plan.producer_groups on every launch (a few
    device ops: for tests, not for timed loops);
    memo (GPU): remember this launch under memo_key (harness/kernels/relaunch.py), so the caller can
    launch it again with memo.launch() while its key holds.
    """
    P, K, E, N = check_producer_operands("producer", x, weights, y, band_ready)
    if config.epi_split not in (1, 2, 4) or config.block_n % (2 * config.epi_split):
        raise ValueError(
            f"producer: epi_split must be 1, 2 or 4 and split block_n={config.block_n} "
            f"into even slices, got {config.epi_split}"
        )
    if n_signal is None:
        n_signal = plan.n_remote_bands
    n_sched = plan.schedule.numel()  # B, or the bound B' of a DevicePlan
    if n_sched == 0:
        return None
    dev_counts = getattr(plan, "counts_on_device", False)
    n_sched_arg = plan.n_bands.reshape(1) if dev_counts else n_sched
    if dev_counts and not isinstance(n_signal, torch.Tensor):
        n_signal = torch.full((1,), n_signal, dtype=torch.int64, device=x.device)
    cfg = config
    use_tma = cfg.use_tma and K % cfg.block_k == 0
    x_desc = producer_input_args(x, cfg)["x_desc"]
    if use_tma:
        w2 = weights.view(E * K, N)
        w_desc = TensorDescriptor(w2, [E * K, N], [N, 1], [cfg.block_k, cfg.block_n])
    else:
        w_desc = None
    if local_to is not None:
        recv, row_dst = local_to
        if recv.dtype != y.dtype or recv.shape[1] != N or not recv.is_contiguous():
            raise ValueError(f"producer local_to: recv {tuple(recv.shape)} {recv.dtype}")
        if row_dst.numel() < P:
            raise ValueError(f"producer local_to: row_dst has {row_dst.numel()} < {P} rows")
    else:
        recv, row_dst = y, plan.schedule  # unused (LOCAL_DIRECT=False)
    if order is not None and (
        order.numel() < n_sched or order.dtype not in (torch.int32, torch.int64)
    ):
        raise ValueError(f"producer order: {order.numel()} {order.dtype}, need >= {n_sched} ints")
    if cfg.expert_groups:
        if groups is None:
            groups = producer_groups(plan, order, cfg.group_m)
        if groups.numel() < n_sched or groups.dtype != torch.int32:
            raise ValueError(
                f"producer groups: {groups.numel()} {groups.dtype}, need >= {n_sched} int32"
            )
    grid = (max(1, min(num_programs, n_sched * cfg.tiles_n(N))),)
    args = (
        x_desc,
        w_desc,
        x,
        weights,
        y,
        recv,
        row_dst,
        plan.schedule,
        plan.schedule if order is None else order,  # unused unless ORDERED
        groups if cfg.expert_groups else plan.schedule,  # unused unless EXPERT_GROUPS
        plan.band_expert,
        plan.band_row,
        plan.band_rows,
        band_ready,
        n_sched_arg,
        n_signal.reshape(1) if dev_counts else n_signal,
        N,
        K,
        grid[0],
    )
    meta = dict(
        BM=cfg.block_m,
        BN=cfg.block_n,
        BK=cfg.block_k,
        GROUP_M=cfg.group_m,
        FLAG=FLAG_CODES[cfg.flag] if signal else FLAG_NONE,
        NT=32 * cfg.num_warps,
        USE_TMA=use_tma,
        FLATTEN=cfg.flatten,
        DEV_COUNTS=dev_counts,
        LOCAL_DIRECT=local_to is not None,
        MIXED=getattr(plan, "layout", "aligned") == "compact",
        ORDERED=order is not None,
        WS=cfg.warp_specialize,
        EPI_SPLIT=cfg.epi_split,
        EXPERT_GROUPS=cfg.expert_groups,
        GROUP_CODE=GROUP_CODE,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    compiled = _producer_kernel[grid](*args, **meta)
    if memo is not None:
        memo.remember(memo_key, _producer_kernel, grid, args, meta, compiled)
    return compiled
