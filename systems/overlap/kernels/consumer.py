"""The consumer: ONE persistent Triton kernel on cCTA SMs that ships ready bands to their owners.

Program j of the cCTA programs takes segments j, j + cCTA, j + 2 cCTA, ... (plan.seg_*). For each
band of a segment (schedule[seg_start .. seg_start + seg_count)), in order:
  1 wait until the producer's ready counter of the band reaches `ready_target` (bounded spin:
    `tl.atomic_add(counter, 0, sem="acquire")` polls; time-out -> error record, see below);
  2 copy the band's VALID rows Y[band_row .. + band_valid) (contiguous, all N columns) to the
    destination's combine receive buffer at row band_offset (contiguous there too).
A compact plan (plan.py) walks PIECES instead of bands (constexpr PIECES): the
entries seg_start .. + seg_count are piece ids, step 1 waits for piece_band's counter, step 2
copies the piece's rows Y[piece_row .. + piece_rows) to piece_offset. Same loop, same signal.
Bands are copied as they become ready (a segment's copy is pipelined with the producer), and once
every band of the segment is copied, the receiver is signalled ONCE per segment:
`tl.atomic_add(signal[dst][rank], rows of the segment, sem="release", scope=SCOPE)` after a CTA
barrier. The receiver's counter from source s therefore grows by the rows s sends it per run:
it has everything from s in run r (1-based) when the counter reaches r * rows_from_s. Nothing is
ever reset between runs (epoch values).

Put modes (modes.py; transport.py says which transport uses which):
  PUT_STORE (0)          Triton vectorised loads/stores to the destination address; the address
                         table holds directly writable pointers (local regions in loopback, peer
                         pointers of symmetric memory in p2p / nvshmem). BLOCK elements a step
                         (default 64K: 128 KiB in flight per CTA); stages > 1 software-pipelines
                         the loads with tl.range(num_stages) (cp.async through shared memory).
  PUT_NVSHMEM (1)        nvshmemx_putmem_block per band to PE dst (symmetric address table), then
                         nvshmem_quiet and the same release atomic on the mapped signal pointer.
  PUT_NVSHMEM_SIGNAL (2) nvshmemx_putmem_block per band, the last band of the segment with
                         nvshmemx_putmem_signal_block (NVSHMEM_SIGNAL_ADD = 10, symmetric signal
                         address). This is the paper's "one put + signal" path.
All three are ONE kernel: PUT_MODE is a constexpr, so a PUT_STORE compile holds no NVSHMEM call
and needs no NVSHMEM device library; the NVSHMEM modes launch the same function wrapped (lazily,
on their first launch) by torch's requires_nvshmem, which links libnvshmem_device.
Why PUT_STORE is the fast path: NVSHMEM's block put on a load/store-reachable peer is
`for (i = tid; i < n16; i += nthreads) dst[i] = src[i]` in 16-byte words
(nvshmemi_memcpy_threadgroup): ONE 16-byte load in flight per thread, so a CTA's bandwidth is
bound by its threads x 16 bytes per memory latency and scales with the warps (the signal is not
the problem: put_signal costs the same as put). The Triton copy keeps BLOCK * elem bytes in
flight per step. So: PUT_STORE wherever the peer is load/store reachable (NVLink: p2p and
nvshmem default), PUT_NVSHMEM_SIGNAL with 32 warps where it is not.

One consumer CTA per SM, never sharing it with a producer CTA nor with another consumer CTA:
the default consumer (1024 threads, a 64K-element block) holds too many of the SM's registers to
sit next to a producer CTA (registers and shared memory) or next to another consumer (registers).
A pipelined config (stages > 1) is exclusive through shared memory instead: (stages - 1) *
BLOCK * elem bytes + the producer's shared memory exceed the SM's. `residency_report`
(runner.py) checks this from the compiled kernels (shared memory, registers, threads against the
device limits); the GPU tests assert it on Hopper.
The other placement (the overlap system's consumer="shared", beyond the paper): cCTA SMALL
consumer CTAs (shared_consumer_config: 4 warps, an 8K-element block, no shared memory) that fit
next to a producer CTA, so the producer keeps ALL SMs and the copies run in the gaps of its
warps. One small CTA leaves room for a producer CTA (the runner checks this from the compiled
kernels on the first run). Two things keep a consumer CTA from taking a producer CTA's SM:
  - the shared-memory carve-out: an SM runs with the L1 / shared-memory split of the kernels
    it holds, and the driver gives a kernel that needs no shared memory a small one; an SM
    that took a consumer CTA first could then not take a producer CTA (165 KiB) until it
    drained. The runner asks for the largest split for the consumer (launch_consumer's
    `prepare` hook, runner.prefer_shared_carveout);
  - the order: the producer is launched first on the higher-priority stream (runner.py).
The producer never waits for the consumer, so a consumer CTA that must queue behind producer
CTAs only delays its copies; were a producer CTA ever kept off its SM by consumer CTAs
spinning for its bands, the spins time out into an error record: never a hang.

Time-outs: every spin is bounded (primitives.spin_until). On the GPU (USE_TIMER) by %globaltimer
nanoseconds: the timer is read through a scalar atomic exchange on a per-program scratch word,
because Triton runs a scalar atomic once per CTA and broadcasts its result, which keeps the loop
condition uniform across the CTA's threads (a raw per-thread timer read could diverge). In the
CPU interpreter (no inline asm) by an iteration count. A time-out writes an error record
(errors.py: code, segment, band, rank, program, seen, want, source) with a compare-and-swap on
err[0] (first one wins), and the program skips the rest of its work; other programs notice
err[0] != 0 while they spin and stop too. The host raises OverlapTimeoutError after
synchronising (errors.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from harness.kernels.relaunch import LaunchMemo
from systems.overlap import errors, modes
from systems.overlap.kernels.primitives import (
    copy_rows,
    nvshmem_putmem_block,
    nvshmem_putmem_signal_block,
    nvshmem_quiet,
    record_error,
    spin_until,
)
from systems.overlap.modes import PUT_NVSHMEM, PUT_NVSHMEM_SIGNAL, PUT_STORE

ERR_SLOTS = errors.ERR_SLOTS
# constexpr globals for the kernels
_BAND_TIMEOUT = tl.constexpr(errors.CODE_BAND_TIMEOUT)
_SIGNAL_TIMEOUT = tl.constexpr(errors.CODE_SIGNAL_TIMEOUT)
_SIGNAL_ADD = tl.constexpr(modes.NVSHMEM_SIGNAL_ADD)
_PUT_STORE = tl.constexpr(PUT_STORE)
_PUT_NVSHMEM = tl.constexpr(PUT_NVSHMEM)
_PUT_NVSHMEM_SIGNAL = tl.constexpr(PUT_NVSHMEM_SIGNAL)


@dataclass(frozen=True)
class ConsumerConfig:
    """Copy knobs of the consumer. block: elements per copy step; stages: copy pipeline depth."""

    block: int = 65536
    num_warps: int = 32
    stages: int = 1
    timeout_s: float = 5.0  # GPU: %globaltimer bound of every spin
    max_spins: int = 2000  # interpreter: iteration bound of every spin
    use_timer: bool = True  # False in the CPU interpreter
    streaming: bool = False  # evict-first loads, .cs stores

    def shared_bytes(self, elem_bytes: int) -> int:
        """Shared memory the copy pipeline asks for (what keeps other CTAs off the SM)."""
        return self.block * elem_bytes * (self.stages - 1) if self.stages > 1 else 0


def shared_consumer_config() -> ConsumerConfig:
    """A consumer CTA small enough to sit next to a producer CTA on one SM (consumer="shared"):
    128 threads, 16 KiB in flight per step (bf16), no shared memory."""
    return ConsumerConfig(block=8192, num_warps=4, stages=1)


def interpreter_consumer_config() -> ConsumerConfig:
    """Small blocks and an iteration-bounded spin for TRITON_INTERPRET=1."""
    return ConsumerConfig(block=256, num_warps=4, stages=1, max_spins=200, use_timer=False)


@triton.jit(do_not_specialize=["ready_target"])  # an epoch value: one compile for all runs
def _consumer_kernel(
    y_ptr,
    schedule,
    band_row,
    band_valid,
    band_offset,
    piece_band,
    band_ready,
    seg_start,
    seg_count,
    seg_dst,
    counts,
    recv_ptrs,
    signal_ptrs,
    err,
    clock,
    ready_target,
    rank,
    N,
    timeout,
    max_spins,
    n_progs,
    BLOCK: tl.constexpr,
    WAIT: tl.constexpr,
    SCOPE: tl.constexpr,
    USE_TIMER: tl.constexpr,
    VEC: tl.constexpr,
    STAGES: tl.constexpr,
    STREAM: tl.constexpr,
    PUT_MODE: tl.constexpr,
    PIECES: tl.constexpr,
):
    """All put modes in one kernel: PUT_MODE (constexpr) picks the data path at compile time,
    so a PUT_STORE compile holds no NVSHMEM call (and needs no NVSHMEM device library).
    counts: the plan's counts on the device (counts[4]: the segments).
    PIECES (a compact plan): a segment's entries seg_start .. + seg_count are piece ids u
    (band_row / band_valid / band_offset hold the pieces' row / rows / offset), and the ready
    counter waited for is piece_band[u]; otherwise entry i is the band schedule[i]."""
    n_segments = tl.load(counts + 4).to(tl.int32)
    pid = tl.program_id(0)
    clock_p = clock + pid
    elem_ty = y_ptr.dtype.element_ty
    status = tl.zeros((), dtype=tl.int32)
    for seg in range(pid, n_segments, n_progs):
        if status == 0:
            s0 = tl.load(seg_start + seg)
            cnt = tl.load(seg_count + seg).to(tl.int32)
            d = tl.load(seg_dst + seg).to(tl.int32)
            base = tl.load(recv_ptrs + d)
            rows = tl.zeros((), dtype=tl.int64)
            for i in range(cnt):
                if status == 0:
                    if PIECES:
                        u = s0 + i
                        band = tl.load(piece_band + u)
                    else:
                        u = tl.load(schedule + s0 + i)
                        band = u
                    if WAIT:
                        status, seen = spin_until(
                            band_ready + band,
                            ready_target,
                            err,
                            clock_p,
                            timeout,
                            max_spins,
                            "gpu",
                            USE_TIMER,
                        )
                        if status == 1:
                            record_error(
                                err, _BAND_TIMEOUT, seg, band, rank, pid, seen, ready_target, -1
                            )
                    if status == 0:
                        r0 = tl.load(band_row + u).to(tl.int64)
                        nv = tl.load(band_valid + u).to(tl.int64)
                        off = tl.load(band_offset + u).to(tl.int64)
                        src = y_ptr + r0 * N
                        if PUT_MODE == _PUT_STORE:
                            dst = base.to(tl.pointer_type(elem_ty)) + off * N
                            copy_rows(src, dst, (nv * N).to(tl.int32), BLOCK, VEC, STAGES, STREAM)
                        else:
                            esize: tl.constexpr = elem_ty.primitive_bitwidth // 8
                            dst_addr = base + off * N * esize
                            nbytes = nv * N * esize
                            if PUT_MODE == _PUT_NVSHMEM_SIGNAL:
                                if i == cnt - 1:
                                    sig = tl.load(signal_ptrs + d) + rank * 8
                                    nvshmem_putmem_signal_block(
                                        dst_addr,
                                        src.to(tl.int64),
                                        nbytes,
                                        sig,
                                        (rows + nv).to(tl.uint64),
                                        _SIGNAL_ADD,
                                        d,
                                    )
                                else:
                                    nvshmem_putmem_block(dst_addr, src.to(tl.int64), nbytes, d)
                            else:
                                nvshmem_putmem_block(dst_addr, src.to(tl.int64), nbytes, d)
                        rows += nv
            if status == 0:
                if PUT_MODE != _PUT_NVSHMEM_SIGNAL:
                    if PUT_MODE == _PUT_NVSHMEM:
                        nvshmem_quiet()
                    tl.debug_barrier()
                    sig_p = tl.load(signal_ptrs + d).to(tl.pointer_type(tl.int64)) + rank
                    tl.atomic_add(sig_p, rows, sem="release", scope=SCOPE)


@triton.jit
def _wait_signals_kernel(
    signal,
    expected,
    err,
    clock,
    n_src,
    rank,
    timeout,
    max_spins,
    SCOPE: tl.constexpr,
    USE_TIMER: tl.constexpr,
):
    """Receiver side: wait until signal[s] >= expected[s] for every source s (one program)."""
    status = tl.zeros((), dtype=tl.int32)
    for s in range(n_src):
        if status == 0:
            want = tl.load(expected + s)
            st, seen = spin_until(
                signal + s, want, err, clock, timeout, max_spins, SCOPE, USE_TIMER
            )
            status = st
            if st == 1:
                record_error(err, _SIGNAL_TIMEOUT, -1, -1, rank, 0, seen, want, s)


_nvshmem_launcher = None  # _consumer_kernel wrapped by requires_nvshmem, made on first use
_nvshmem_registry = None  # torch's NvshmemKernelRegistry, imported with it


def _nvshmem_kernel():
    """_consumer_kernel wrapped by torch's requires_nvshmem (links the NVSHMEM device library).

    Imported and wrapped lazily: only a launch with an NVSHMEM put mode needs torch's NVSHMEM
    Triton support (and a GPU machine with the device library).
    """
    global _nvshmem_launcher, _nvshmem_registry
    if _nvshmem_launcher is None:
        from torch.distributed._symmetric_memory._nvshmem_triton import (
            NvshmemKernelRegistry,
            requires_nvshmem,
        )

        _nvshmem_launcher = requires_nvshmem(_consumer_kernel)
        _nvshmem_registry = NvshmemKernelRegistry
    return _nvshmem_launcher


def _nvshmem_module_init(on: bool) -> None:
    """Whether kernels compiled by the next launch get torch's NVSHMEM module initialisation.

    torch's post-compile hook initialises NVSHMEM in every newly compiled module of a kernel NAME
    that requires_nvshmem registered, and nvshmemx_cumodule_init fails on a module without the
    NVSHMEM device state. The PUT_STORE and NVSHMEM launches compile the same function (same
    name), so the name is registered for an NVSHMEM launch and deregistered for a PUT_STORE one
    (no-op before the first NVSHMEM launch). The hook runs inside the launch that compiles.
    """
    if _nvshmem_registry is None:
        return
    name = _consumer_kernel.fn.__name__
    if on:
        _nvshmem_registry.register(name)
    else:
        _nvshmem_registry.deregister(name)


def vec_ok(y: torch.Tensor, tables_aligned: bool | None, recv_ptrs: torch.Tensor) -> bool:
    """16-byte vector accesses are legal: row pitch, y and every table address 16-byte aligned.

    tables_aligned: known alignment of recv_ptrs (Transport.aligned); None reads the table
    back from the device (a host synchronisation: keep it out of the timed path).
    """
    pitch = y.shape[1] * y.element_size()
    if tables_aligned is None:
        tables_aligned = bool((recv_ptrs % 16 == 0).all())
    return pitch % 16 == 0 and y.data_ptr() % 16 == 0 and tables_aligned


def launch_consumer(
    y: torch.Tensor,
    plan: Any,
    band_ready: torch.Tensor,
    recv_ptrs: torch.Tensor,
    signal_ptrs: torch.Tensor,
    err: torch.Tensor,
    clock: torch.Tensor,
    *,
    ready_target: int,
    rank: int | None = None,
    ccta: int,
    config: ConsumerConfig,
    wait: bool = True,
    scope: str = "gpu",
    put_mode: int = PUT_STORE,
    vec: bool | None = None,
    prepare: Callable[[Any], None] | None = None,
    memo: LaunchMemo | None = None,
    memo_key: Any = None,
):
    """Launch the consumer on the current stream; returns Triton's compiled kernel.

    y [P, N] producer output; plan: a systems.overlap.plan.CombinePlan on the device (its
    segment count read from plan.counts; segments past it are skipped; a compact plan's
    segments walk its pieces); band_ready [B] int32 producer counters; recv_ptrs [W] int64
    receive-buffer addresses and signal_ptrs [W] int64 receive-counter addresses per
    destination, as the put mode needs them (transport.Transport.tables); err [ERR_SLOTS]
    int64; clock [>= ccta] int64 scratch; ready_target: counter value of a complete band this
    run; rank: the source slot this rank signals in the receivers' counters (None: plan.rank);
    wait=False skips the spins (flags taken as set: the comm-only bound); vec: 16-byte vector
    hints (None: checked, with a host synchronisation; pass vec_ok(y, transport.aligned, ...)
    on a timed path); prepare (PUT_STORE only): called with the compiled kernel before its
    launch (the runner's shared-memory carve-out request); memo (GPU): remember this launch
    under memo_key (harness/kernels/relaunch.py); memo.launch(ready_target=...) relaunches it.
    """
    n_seg = plan.seg_start.numel()
    pieces = plan.layout == "compact"
    if rank is None:
        rank = plan.rank
    if err.numel() < ERR_SLOTS or err.dtype != torch.int64:
        raise ValueError(f"err must be int64 [{ERR_SLOTS}]")
    if clock.numel() < ccta:
        raise ValueError(f"clock scratch needs >= {ccta} slots")
    if ccta < 1:
        raise ValueError("ccta must be >= 1")
    if n_seg == 0:
        return None
    N = y.shape[1]
    if put_mode != PUT_STORE:
        vec = False
    elif vec is None:
        vec = vec_ok(y, None, recv_ptrs)
    cfg = config
    args = (
        y,
        plan.schedule,
        plan.piece_row if pieces else plan.band_row,
        plan.piece_rows if pieces else plan.band_valid,
        plan.piece_offset if pieces else plan.band_offset,
        plan.piece_band if pieces else plan.schedule,  # unused unless PIECES
        band_ready,
        plan.seg_start,
        plan.seg_count,
        plan.seg_dst,
        plan.counts,
        recv_ptrs,
        signal_ptrs,
        err,
        clock,
        ready_target,
        rank,
        N,
        int(cfg.timeout_s * 1e9),
        cfg.max_spins,
        ccta,
    )
    meta = dict(
        BLOCK=cfg.block,
        WAIT=wait,
        SCOPE=scope,
        USE_TIMER=cfg.use_timer,
        VEC=vec,
        STAGES=cfg.stages,
        STREAM=cfg.streaming,
        PIECES=pieces,
        num_warps=cfg.num_warps,
    )
    if put_mode == PUT_STORE:
        kernel = _consumer_kernel
        _nvshmem_module_init(False)
    else:
        if prepare is not None:
            raise ValueError("consumer prepare: the PUT_STORE kernel only")
        kernel = _nvshmem_kernel()
        _nvshmem_module_init(True)
    if prepare is not None:  # compiled (or found) without a launch
        prepare(kernel.warmup(*args, grid=(ccta,), PUT_MODE=put_mode, **meta))
    meta["PUT_MODE"] = put_mode
    compiled = kernel[(ccta,)](*args, **meta)
    if memo is not None and put_mode == PUT_STORE:  # the NVSHMEM launch is torch's wrapper
        memo.remember(memo_key, kernel, (ccta,), args, meta, compiled)
    elif memo is not None:
        memo.forget()
    return compiled


def launch_wait_signals(
    signal: torch.Tensor,
    expected: torch.Tensor,
    err: torch.Tensor,
    clock: torch.Tensor,
    *,
    rank: int,
    config: ConsumerConfig,
    scope: str = "sys",
    memo: LaunchMemo | None = None,
    memo_key: Any = None,
):
    """Receiver side: block the stream until signal[s] >= expected[s] for all s (both int64 [W]).

    Bounded like the consumer's spins; a time-out records CODE_SIGNAL_TIMEOUT with the source.
    memo: remember the launch under memo_key (harness/kernels/relaunch.py).
    """
    args = (
        signal,
        expected,
        err,
        clock,
        signal.numel(),
        rank,
        int(config.timeout_s * 1e9),
        config.max_spins,
    )
    meta = dict(SCOPE=scope, USE_TIMER=config.use_timer, num_warps=1)
    compiled = _wait_signals_kernel[(1,)](*args, **meta)
    if memo is not None:
        memo.remember(memo_key, _wait_signals_kernel, (1,), args, meta, compiled)
    return compiled
