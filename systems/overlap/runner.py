"""Stage B's runner (docs/method.md, Stage B): OverlapRunner holds one rank's plan, ready
counters, error buffer, two streams and run counters, and runs the producer + consumer pair
overlapped, serially (the reference) or each alone (the bounds). The plan's counts stay on the
device, so a worst-case-sized plan runs with no host sync. GPU launches are remembered
(LaunchMemo) keyed on their arguments and plan_version, which a new plan object moves.

Placement (consumer_sms). "own": a consumer CTA's registers leave no room beside it, so the
producer gets SMs - cCTA. "shared": an SM runs with the L1 / shared split of the kernels it
holds, and the driver gives a kernel without shared memory a small one, so an SM that took a
consumer CTA first could not take a producer CTA (165 KiB) until it drained: hence
prefer_shared_carveout, and the producer launched first on the higher-priority stream.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from harness.kernels.relaunch import LaunchMemo
from systems.overlap.errors import ERR_SLOTS, new_clock, new_error_buffer, raise_if_error
from systems.overlap.kernels.consumer import _consumer_kernel, launch_wait_signals
from systems.overlap.kernels.producer import launch_producer, producer_grid, producer_input_args
from systems.overlap.params import CONSUMER_SMS
from systems.overlap.plan import CombinePlan
from systems.overlap.tuning import ConsumerConfig, TileConfig, pick_config, shared_consumer_config

#: cuFuncSetAttribute's CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT (CUDA driver API)
_CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 9
_carveout_done: dict[int, int] = {}  # CUfunction handle -> percent set


def prefer_shared_carveout(compiled: Any) -> None:
    """Ask the driver to run SMs holding this compiled Triton kernel with all of the unified L1 /
    shared memory as shared memory, once per CUfunction."""
    import ctypes

    percent = 100
    compiled._init_handles()  # loads the module (what the first launch would do)
    fn = int(compiled.function)
    if _carveout_done.get(fn) == percent:
        return
    lib = ctypes.CDLL("libcuda.so.1")
    rc = lib.cuFuncSetAttribute(
        ctypes.c_void_p(fn),
        ctypes.c_int(_CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT),
        ctypes.c_int(percent),
    )
    if rc != 0:
        raise RuntimeError(f"cuFuncSetAttribute(shared-memory carve-out {percent}%): CUresult {rc}")
    _carveout_done[fn] = percent


def run_consumer(
    y: torch.Tensor,
    plan: CombinePlan,
    band_ready: torch.Tensor,
    transport: Any,
    err: torch.Tensor,
    clock: torch.Tensor,
    *,
    ready_target: int,
    ccta: int,
    config: ConsumerConfig,
    rank: int | None = None,
    wait: bool = True,
    prepare: Callable[[Any], None] | None = None,
    memo: LaunchMemo | None = None,
    memo_key: Any = None,
):
    """Launch the consumer of `plan` through `transport` on ccta programs of the current stream;
    returns Triton's compiled kernel (None for a plan without segments).

    y [P, N] producer output; plan: a CombinePlan on the device (segments past plan.counts are
    skipped); band_ready [B] int32 producer counters; err [ERR_SLOTS] int64; clock [>= ccta]
    int64 scratch; ready_target: counter value of a complete band this run; rank: the source
    slot this rank signals in the receivers' counters (None: plan.rank); wait=False skips the
    spins (the comm-only bound); prepare: called with the compiled kernel before its launch;
    memo (GPU): relaunched where its key (memo_key and every other argument) holds, else
    launched and remembered.
    """
    recv_tab, sig_tab = transport.recv_ptrs, transport.signal_ptrs
    if rank is None:
        rank = plan.rank
    key = (y.data_ptr(), y.shape, band_ready.data_ptr(), memo_key, rank, wait, prepare)
    key = (key, recv_tab.data_ptr(), sig_tab.data_ptr(), transport.scope)
    key = (key, err.data_ptr(), clock.data_ptr(), ccta, config)
    if memo is not None and memo.hit(key):
        return memo.launch(ready_target=ready_target)
    if err.numel() < ERR_SLOTS or err.dtype != torch.int64:
        raise ValueError(f"err must be int64 [{ERR_SLOTS}]")
    if clock.numel() < ccta:
        raise ValueError(f"clock scratch needs >= {ccta} slots")
    if ccta < 1:
        raise ValueError("ccta must be >= 1")
    if plan.seg_start.numel() == 0:
        return None
    # 16-byte vectors where the row pitch, y and every table address are aligned
    vec = (y.shape[1] * y.element_size()) % 16 == 0 and y.data_ptr() % 16 == 0
    vec = vec and transport.aligned
    args = _consumer_args(y, plan, band_ready, recv_tab, sig_tab, err, clock, ready_target, rank)
    args += (int(config.timeout_s * 1e9), ccta)
    meta = dict(BLOCK=config.block, WAIT=wait, SCOPE=transport.scope, USE_TIMER=config.use_timer)
    meta |= dict(VEC=vec, PIECES=plan.layout == "compact", num_warps=config.num_warps)
    if prepare is not None:  # compiled (or found) without a launch
        prepare(_consumer_kernel.warmup(*args, grid=(ccta,), **meta))
    compiled = _consumer_kernel[(ccta,)](*args, **meta)
    if memo is not None:
        memo.remember(key, _consumer_kernel, (ccta,), args, meta, compiled)
    return compiled


def _consumer_args(y, p: CombinePlan, band_ready, recv_tab, sig_tab, err, clock, target, rank):
    """_consumer_kernel's arguments up to N (a compact plan's pieces in place of the bands)."""
    if p.layout == "compact":  # the last is unused unless PIECES
        tabs = (p.piece_row, p.piece_rows, p.piece_offset, p.piece_band)
    else:
        tabs = (p.band_row, p.band_valid, p.band_offset, p.schedule)
    args = (y, p.schedule, *tabs, band_ready, p.seg_start, p.seg_count, p.seg_dst, p.counts)
    return (*args, recv_tab, sig_tab, err, clock, target, rank, y.shape[1])


class OverlapRunner:
    """Producer + consumer of ONE rank's plan on one device.

    plan: a CombinePlan on the device for this runner's `order` and its tile's group_cap;
    weights [E, K, N]; ccta: consumer programs; num_programs: the producer's grid (None: SMs -
    ccta, or all SMs with consumer_sms="shared"); tile: None is tuning.pick_config; consumer:
    None is the placement's default ConsumerConfig; consumer_sms: "own" or "shared" (module doc).
    """

    def __init__(
        self,
        plan: CombinePlan,
        weights: torch.Tensor,
        transport: Any,
        *,
        ccta: int,
        tile: TileConfig | None = None,
        consumer: ConsumerConfig | None = None,
        num_programs: int | None = None,
        order: str = "remote_first",
        consumer_sms: str = "own",
    ) -> None:
        self.plan = plan
        self.weights = weights
        self.transport = transport
        self.ccta = ccta
        self.device = dev = weights.device
        _, K, self.n = weights.shape
        self.tile = tile or pick_config(plan.tile_m, K, self.n, weights.dtype)
        if self.tile.block_m != plan.tile_m:
            raise ValueError(f"tile block_m {self.tile.block_m} != plan tile_m {plan.tile_m}")
        if order != plan.order:
            raise ValueError(f"order {order!r}: the plan was built for order={plan.order!r}")
        if self.tile.group_cap != plan.group_cap:
            raise ValueError(
                f"the tile's group_cap {self.tile.group_cap} != the plan's {plan.group_cap}"
            )
        if consumer_sms not in CONSUMER_SMS:
            raise ValueError(
                f"consumer_sms must be one of {', '.join(CONSUMER_SMS)}, got {consumer_sms!r}"
            )
        self.consumer_sms = consumer_sms
        shared = consumer_sms == "shared"
        #: the carve-out request needs the CUDA driver (the interpreter runs the same kernels)
        self.shared_on_gpu = shared and dev.type == "cuda"
        self.consumer = consumer or (shared_consumer_config() if shared else ConsumerConfig())
        if num_programs is None:
            sms = torch.cuda.get_device_properties(dev).multi_processor_count
            if shared and not 1 <= ccta <= sms:
                raise ValueError(f"consumer_sms=shared: ccta={ccta} must be in [1, {sms}]")
            num_programs = sms if shared else producer_grid(sms, ccta)
        self.num_programs = num_programs
        #: consumer_sms="shared": residency_report of the first overlapped run's kernels
        self.residency: dict | None = None
        self.band_ready = torch.zeros(max(plan.schedule.numel(), 1), dtype=torch.int32, device=dev)
        self.err = new_error_buffer(dev)
        self.clock = new_clock(ccta, dev)  # CPU: the host clock that bounds the spins
        # int64 [W]: rows every source has sent this rank over all runs (each run's recv_rows)
        self.recv_expected = torch.zeros(plan.world_size, dtype=torch.int64, device=dev)
        self.remote = torch.ones(plan.world_size, dtype=torch.int64, device=dev)
        self.remote[plan.rank] = 0  # own rows arrive through the producer's epilogue
        self.recv_step = self._recv_step(plan)
        if dev.type == "cuda":
            # own: the consumer's stream has the higher priority; shared: the producer's, so the
            # block scheduler prefers the producer's CTAs (one per SM)
            hi, lo = -3, 0
            self.prod_stream = torch.cuda.Stream(dev, priority=hi if shared else lo)
            self.cons_stream = torch.cuda.Stream(dev, priority=lo if shared else hi)
            #: overlapped()'s fork and joins (recorded again every run)
            self.events = tuple(torch.cuda.Event() for _ in range(3))
        self.last_kernels: dict[str, Any] = {}
        names = ("produce", "bound", "consume", "comm", "wait")
        self.memos = {k: LaunchMemo() for k in names} if dev.type == "cuda" else {}  # GPU only
        self.plan_version = 0

    def _recv_step(self, plan: CombinePlan) -> torch.Tensor | None:
        """int64 [W]: what one run of `plan` adds to recv_expected (None without recv_rows)."""
        if plan.recv_rows is None:
            return None
        return plan.recv_rows.to(device=self.device, dtype=torch.int64) * self.remote

    def use_plan(self, plan: CombinePlan) -> None:
        """Run `plan` (same rank, tile_m, order and group_cap) from now on; the receive counters
        keep their epochs. The same plan object again (a DevicePlanBuilder's, rewritten in place)
        keeps every remembered launch; a new one expires them."""
        same = ("rank", "tile_m", "order", "group_cap")
        if any(getattr(plan, a) != getattr(self.plan, a) for a in same):
            raise ValueError("use_plan: another rank, tile_m, order or group_cap")
        if plan is self.plan:
            if self.recv_step is not None:
                torch.mul(plan.recv_rows, self.remote, out=self.recv_step)
        else:
            self.plan = plan
            self.plan_version += 1
            self.recv_step = self._recv_step(plan)
        B = plan.schedule.numel()
        if B > self.band_ready.numel():  # zeroed by every signalling run
            self.band_ready = torch.zeros(B, dtype=torch.int32, device=self.device)

    def _next_target(self) -> int:
        """Ready-counter value of a complete band in the next producer run, after zeroing the
        counters (a stream-ordered memset; the previous run is joined; why: docs/method.md,
        Flags)."""
        self.band_ready.zero_()
        return self.tile.band_increment(self.n)

    def _produce(self, x: torch.Tensor, y: torch.Tensor, signal: bool, num_programs: int):
        memo = self.memos.get("produce" if signal else "bound")
        key = None
        if memo is not None:
            # everything the launch reads but the plan (plan_version) and the fixed weights;
            # x is volatile (swapped in): its shape, strides, dtype and alignment
            xk = (x.shape, x.stride(), x.dtype, x.data_ptr() % 16 == 0)
            key = (xk, y.data_ptr(), y.shape, num_programs, self.plan_version)
            key = (key, self.band_ready.data_ptr(), self.tile, self.transport.recv.data_ptr())
            if memo.hit(key):
                if memo.holds("x_ptr", x):  # the very x of the last launch (operator scope)
                    return memo.launch()
                return memo.launch(**producer_input_args(x, self.tile))
        return launch_producer(
            x,
            self.weights,
            y,
            self.plan,
            self.band_ready,
            num_programs=num_programs,
            config=self.tile,
            signal=signal,
            recv=self.transport.recv,
            memo=memo,
            memo_key=key,
        )

    def _consume(self, y: torch.Tensor, target: int, wait: bool):
        return run_consumer(
            y,
            self.plan,
            self.band_ready,
            self.transport,
            self.err,
            self.clock,
            ready_target=target,
            ccta=self.ccta,
            config=self.consumer,
            wait=wait,
            prepare=prefer_shared_carveout if self.shared_on_gpu and wait else None,
            memo=self.memos.get("consume" if wait else "comm"),
            memo_key=self.plan_version,
        )

    def overlapped(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Producer and consumer concurrently: x [P, K] -> y [P, N], remote rows sent; both
        join the current stream before this returns (asynchronously)."""
        if self.device.type != "cuda":
            return self.sequential(x, y)
        target = self._next_target()
        # fork and join through events made once (fewer host calls than wait_stream and the
        # stream context); no record_stream: the current stream waits for both side streams
        # before anything the caller enqueues after this, so x and y can only be freed and
        # reused (on the current stream, their allocation stream) after both kernels
        cur = torch.cuda.current_stream(self.device)
        fork, prod_done, cons_done = self.events
        fork.record(cur)
        self.prod_stream.wait_event(fork)
        self.cons_stream.wait_event(fork)
        try:
            torch.cuda.set_stream(self.prod_stream)
            kp = self._produce(x, y, True, self.num_programs)
            prod_done.record(self.prod_stream)
            torch.cuda.set_stream(self.cons_stream)
            kc = self._consume(y, target, True)
            cons_done.record(self.cons_stream)
        finally:
            torch.cuda.set_stream(cur)
        cur.wait_event(prod_done)
        cur.wait_event(cons_done)
        self._count_run()
        self.last_kernels = {"producer": kp, "consumer": kc}
        if self.consumer_sms == "shared" and self.residency is None and None not in (kp, kc):
            self._check_shared(kp, kc)
        return y

    def _check_shared(self, kp: Any, kc: Any) -> None:
        """consumer_sms="shared" needs a consumer CTA to fit next to a producer CTA: a one-line
        error otherwise (then the consumer could only run after the producer, serially)."""
        r = self.residency = residency_report(kp, kc, self.device)
        if not r["consumer_with_producer"]:
            raise ValueError(
                "consumer_sms=shared: a consumer CTA does not fit next to a producer CTA "
                f"(producer {r['producer']}, consumer {r['consumer']}, SM: "
                f"{r['sm_smem']} B shared memory, {r['sm_regs']} registers)"
            )

    def sequential(self, x: torch.Tensor, y: torch.Tensor):
        """The same kernels one after the other on the current stream (no overlap)."""
        target = self._next_target()
        kp = self._produce(x, y, True, self.num_programs)
        kc = self._consume(y, target, True)
        self._count_run()
        self.last_kernels = {"producer": kp, "consumer": kc}
        return y

    def compute_only(self, x: torch.Tensor, y: torch.Tensor, num_programs: int | None = None):
        """Producer without flags (FLAG=0) on the current stream: the compute-only bound."""
        self._produce(x, y, False, num_programs or self.num_programs)
        return y

    def comm_only(self, y: torch.Tensor) -> None:
        """Consumer alone, flags taken as set (no waits): the communication-only bound."""
        self._consume(y, 0, False)
        self._count_run()

    def _count_run(self) -> None:
        """One consumer run: the peers run theirs in lockstep, sending this rank plan.recv_rows."""
        if self.recv_step is not None:
            self.recv_expected.add_(self.recv_step)

    def expected_signal(self) -> torch.Tensor:
        """int64 [W]: receive-counter values meaning 'all rows of every run so far arrived'
        (recv_expected, so the routing may change between runs). Assumes every rank ran the
        consumer as often as this one (true in lockstep runs)."""
        if self.plan.recv_rows is None:
            raise ValueError("expected_signal: a plan without recv_rows (a synthetic one)")
        return self.recv_expected

    def wait_received(self) -> None:
        """Block the current stream until every source's rows of every run so far arrived."""
        t, expected = self.transport, self.expected_signal()
        memo = self.memos.get("wait")
        key = (t.signal.data_ptr(), t.scope, self.plan.rank, self.consumer, self.err.data_ptr())
        if memo is not None and memo.hit(key):  # expected: recv_expected, the same every run
            memo.launch()
            return
        launch_wait_signals(
            t.signal,
            expected,
            self.err,
            self.clock,
            rank=self.plan.rank,
            config=self.consumer,
            scope=t.scope,
            memo=memo,
            memo_key=key,
        )

    def check(self) -> None:
        """Raise OverlapTimeoutError if any wait timed out (synchronises with the device)."""
        raise_if_error(self.err)


def residency_report(producer_kernel: Any, consumer_kernel: Any, device=None) -> dict:
    """Can a consumer CTA share an SM with a producer CTA or another consumer CTA? From the
    compiled kernels (Triton CompiledKernel: metadata.shared, n_regs, num_warps) and the device
    limits; consumers_beside_producer: how many consumer CTAs fit next to one producer CTA."""
    props = torch.cuda.get_device_properties(device)
    smem = getattr(props, "shared_memory_per_multiprocessor", 233472)
    regs = getattr(props, "regs_per_multiprocessor", 65536)
    threads = getattr(props, "max_threads_per_multi_processor", 2048)

    def usage(k):
        warps = k.metadata.num_warps
        return {
            "smem": k.metadata.shared + 1024,  # + the 1 KiB the driver reserves per CTA
            "regs": int(getattr(k, "n_regs", 0)) * 32 * warps,
            "threads": 32 * warps,
        }

    up, uc = usage(producer_kernel), usage(consumer_kernel)

    limits = {"smem": smem, "regs": regs, "threads": threads}

    def fits(a, b, n=1):
        return all(a[k] + n * b[k] <= limit for k, limit in limits.items())

    beside = 0  # consumer CTAs that fit next to one producer CTA (at most 32 CTAs an SM)
    while beside < 31 and fits(up, uc, beside + 1):
        beside += 1

    return {
        "producer": up,
        "consumer": uc,
        "sm_smem": smem,
        "sm_regs": regs,
        "consumer_with_producer": fits(up, uc),
        "consumers_beside_producer": beside,
        "consumer_with_consumer": fits(uc, uc),
        "exclusive": not fits(up, uc) and not fits(uc, uc),
    }
