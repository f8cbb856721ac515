"""DeepEP's low-latency kernels as a layer baseline (deepseek-ai/DeepEP at 567632d, v1 API).

Host-free dispatch and combine (worst-case receive buffers, counts on the device; its C++ joins
its comm stream by events, csrc/deep_ep.cpp:1534-1795), so the step is capturable. One process
per rank (NVSHMEM: one PE per GPU). Timed region (layer cells only):
  1 Buffer.low_latency_dispatch(x [T, H] bf16, ids [T, k], M = T, G = W * E) -> recv_x
    [E, W*M, H] (expert e's rows at recv_x[e, :count[e]]) and count [E] int32;
  2 the FFN experts over ONLY the real rows (`packed_ffn`; the worst case would multiply the
    FLOPs by W*M*E / (T*k));
  3 Buffer.low_latency_combine(y, ids, gate [T, k] f32, handle) -> out [T, H] (gate-weighted).
ONE Buffer per process and run (`ll_buffer`), sized for the run's largest cell (`plan_cell`).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist

from harness.experts import activation, expert_gemm, expert_gemm_impl, grouped_mm_usable
from harness.system import CellInputs, Step, System
from harness.teardown import at_run_end
from harness.workload import WorkloadSpec
from systems import package_version

UPSTREAM = "deepseek-ai/DeepEP@567632d"
#: hidden sizes the low-latency kernels are compiled for (SWITCH_HIDDEN, launch.cuh:114-135)
LL_HIDDEN = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)
#: most experts a token may choose (kNumMaxTopK, internode_ll.cu:494 dispatch, :1167 combine)
LL_MAX_TOPK = 11
#: warp groups per SM of the dispatch's receive: ceil(G / SMs) < 15 (internode_ll.cu:383)
LL_MAX_WARP_GROUPS = 14
#: NVSHMEM's QP depth when unset (deep_ep/buffer.py:113); it must be >= 2 (M + 1) (buffer.py:602)
QP_DEPTH_DEFAULT = 1024
#: csrc/kernels/configs.cuh:7
BUFFER_ALIGNMENT = 128
#: NVSHMEM_CUMEM_GRANULARITY that DeepEP sets (deep_ep/buffer.py:122): the heap's rounding
NVSHMEM_GRANULE = 2**29


def ll_rdma_bytes(max_tokens: int, hidden: int, world: int, n_experts: int) -> int:
    """Buffer.get_low_latency_rdma_size_hint(M, H, W, G) without the package: the bytes of
    LowLatencyLayout (csrc/config.hpp:136-193), two send, receive and signalling buffers each,
    bf16 rows of H with 16 bytes of metadata (dispatch) or H / 128 bf16 pairs (combine)."""
    scales = hidden // 128
    dispatch_msg = 16 + max(hidden * 2, hidden + scales * 4)
    combine_msg = scales * 4 + hidden * 2
    send = max(max_tokens * dispatch_msg, n_experts * max_tokens * combine_msg)
    recv = n_experts * max_tokens * max(dispatch_msg, combine_msg)
    signal = -(-n_experts * 4 // 128) * 128
    total = 2 * (send + recv + signal)
    return (total + BUFFER_ALIGNMENT) // BUFFER_ALIGNMENT * BUFFER_ALIGNMENT


def packed_rows(spec: WorkloadSpec) -> int:
    """P = W * M * min(k, E): the most rows one rank can receive (each source token sends one
    row to each of its k experts that live here)."""
    W, M = spec.world_size, spec.tokens_per_rank
    return W * M * min(spec.top_k, spec.experts_per_rank)


def cell_bytes(spec: WorkloadSpec, rdma_bytes: int = 0) -> int:
    """Device bytes of one rank's cell: the RDMA buffer (the cell's own, or the run's
    rdma_bytes where larger; rounded up to NVSHMEM's granule), recv_x and y [E, W*M, H], the
    packed rows [P, H + F + H], W1 and W2, x and out [T, H] (bf16)."""
    W, M, H = spec.world_size, spec.tokens_per_rank, spec.hidden
    F, E = spec.ffn, spec.experts_per_rank
    rdma = max(ll_rdma_bytes(M, H, W, spec.n_experts), rdma_bytes)
    rdma = -(-rdma // NVSHMEM_GRANULE) * NVSHMEM_GRANULE
    worst = E * W * M
    return rdma + 2 * (2 * worst * H + packed_rows(spec) * (2 * H + F) + 2 * E * H * F + 2 * M * H)


def device_sms() -> int | None:
    """SMs of this process's GPU, None without CUDA."""
    return _device_property("multi_processor_count")


def device_memory() -> int | None:
    """Bytes of this process's GPU, None without CUDA."""
    return _device_property("total_memory")


def _device_property(name: str) -> int | None:
    if not torch.cuda.is_available():
        return None
    return getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), name)


def ll_limits(spec: WorkloadSpec, run_rdma: int = 0) -> list[str]:
    """Every limit of the low-latency kernels the cell exceeds, one phrase each (empty: none);
    run_rdma: the RDMA bytes of the run's Buffer, which the cell's memory must fit beside."""
    why = []
    if spec.dtype != "bfloat16":
        why.append(
            f"dtype {spec.dtype}: the low-latency dispatch takes bf16 only (csrc/deep_ep.cpp:1550)"
        )
    if spec.hidden not in LL_HIDDEN:
        why.append(
            f"hidden {spec.hidden} is not one its kernels are compiled for {list(LL_HIDDEN)} "
            "(SWITCH_HIDDEN, csrc/kernels/launch.cuh:114-135)"
        )
    if spec.top_k > LL_MAX_TOPK:
        why.append(
            f"top_k {spec.top_k} > {LL_MAX_TOPK} (kNumMaxTopK, csrc/kernels/internode_ll.cu:494)"
        )
    if spec.n_experts < 2:
        why.append(
            "1 expert in all: the dispatch runs one SM per expert group and asserts more than "
            "one (csrc/kernels/internode_ll.cu:282)"
        )
    if (spec.world_size * spec.tokens_per_rank) % 4:
        why.append(
            f"W * M = {spec.world_size * spec.tokens_per_rank} is not a multiple of 4 (TMA, "
            "csrc/deep_ep.cpp:1598)"
        )
    sms = device_sms()
    if sms and -(-spec.n_experts // sms) > LL_MAX_WARP_GROUPS:
        why.append(
            f"{spec.n_experts} experts need {-(-spec.n_experts // sms)} warp groups per SM on "
            f"{sms} SMs, at most {LL_MAX_WARP_GROUPS} (csrc/kernels/internode_ll.cu:383)"
        )
    have, need = device_memory(), cell_bytes(spec, run_rdma)
    if have and need > have:
        M, H, W, G = spec.tokens_per_rank, spec.hidden, spec.world_size, spec.n_experts
        own = ll_rdma_bytes(M, H, W, G)
        rdma = (
            f"the run's RDMA buffer {run_rdma / 2**30:.1f} GiB (sized once for its largest "
            f"deepep cell; this cell's own: {own / 2**30:.1f} GiB)"
            if run_rdma > own
            else f"the RDMA buffer {own / 2**30:.1f} GiB"
        )
        why.append(
            f"its buffers need {need / 2**30:.1f} GiB ({rdma}, csrc/config.hpp:136-193, and "
            f"the worst-case [E, W*M, H] rows), more than the GPU's {have / 2**30:.1f} GiB"
        )
    return why


def pack_index(
    count: torch.Tensor, slots: int, rows: torch.Tensor, spare: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The packing of the real rows of a [E, slots, H] receive buffer, on the device: count [E]
    int real rows of each expert (its first count[e] slots); rows = arange(P) int64.
    Returns src [P] (the row of recv.view(-1, H) that packed row p holds; 0 past the real rows),
    dst [P] (the same, `spare` past the real rows: their outputs dropped there), offs [E] int32
    (inclusive cumulative counts: torch._grouped_mm's offsets) and n [1] (real rows)."""
    ends = torch.cumsum(count.long(), 0)
    expert = torch.searchsorted(ends, rows, right=True).clamp_(max=count.numel() - 1)
    row = expert * slots + rows - (ends - count.long())[expert]
    real = rows < ends[-1]
    src = torch.where(real, row, torch.zeros_like(row))
    dst = torch.where(real, row, torch.full_like(row, spare))
    return src, dst, ends.to(torch.int32), ends[-1:]


def packed_ffn(
    recv: torch.Tensor, count: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, rows, y
) -> torch.Tensor:
    """The FFN experts over the real rows of recv [E, S, H] (expert e's first count[e] rows),
    packed by a device-computed index into [P, H], fc1 and fc2 as grouped GEMMs with device
    offsets: y[e, s] = gelu(recv[e, s] @ W1_e) @ W2_e for s < count[e], written into
    y [E * S + 1, H] (its last row takes the padding rows' outputs; rows past a count keep
    what they held). w1 [E, H, F], w2 [E, F, H], rows = arange(P). Returns y[:-1] [E, S, H]."""
    E, S, H = recv.shape
    src, dst, offs, n = pack_index(count, S, rows, E * S)
    xs = recv.view(E * S, H).index_select(0, src)
    h = activation(expert_gemm(xs, None, w1, offs), n)
    y.index_copy_(0, dst, expert_gemm(h, None, w2, offs))
    return y[:-1].view(E, S, H)


#: the environment variable that carries the run's Buffer sizes from validate() to the ranks
#: (spawned ranks inherit it): {"pid": the validating process, "sizes": {W: [rdma_bytes, qps,
#: qp_depth]}}; a process that never validated (a test) grows its Buffer where a cell needs more
PLAN_ENV = "HARNESS_DEEPEP_BUFFER"


def cell_needs(spec: WorkloadSpec) -> tuple[int, int, int]:
    """(RDMA bytes, QPs per rank, NVSHMEM QP depth) a cell's low-latency Buffer needs: one QP
    per local expert (internode_ll.cu:285), depth >= 2 (M + 1) (buffer.py:602)."""
    M = spec.tokens_per_rank
    rdma = ll_rdma_bytes(M, spec.hidden, spec.world_size, spec.n_experts)
    return rdma, spec.experts_per_rank, 2 * (M + 1)


def _read_plan() -> dict:
    """The plan in the environment if this process made it (torchrun: every rank validates) or
    its parent did (a spawned rank); else empty (another process's run)."""
    try:
        plan = json.loads(os.environ.get(PLAN_ENV, "") or "{}")
    except ValueError:
        return {}
    if not isinstance(plan, dict) or plan.get("pid") not in (os.getpid(), os.getppid()):
        return {}
    return plan


def plan_cell(spec: WorkloadSpec) -> None:
    """Take a cell into the run's Buffer sizes (the largest of each, per world size)."""
    plan = _read_plan()
    if plan.get("pid") != os.getpid():  # a run of this process starts a plan of its own
        plan = {"pid": os.getpid(), "sizes": {}}
    key = str(spec.world_size)
    held = plan["sizes"].get(key, [0, 0, 0])
    plan["sizes"][key] = [max(a, b) for a, b in zip(held, cell_needs(spec))]
    os.environ[PLAN_ENV] = json.dumps(plan)


def planned(world: int) -> tuple[int, int, int]:
    """The run's Buffer sizes at W = world ((0, 0, 0) where no plan is known)."""
    sizes = _read_plan().get("sizes", {}).get(str(world), [0, 0, 0])
    return (int(sizes[0]), int(sizes[1]), int(sizes[2]))


class _Held:
    """The process's low-latency Buffer, made once per run and reused by every cell (DeepEP's
    get_buffer pattern, README "Example use in inference decoding")."""

    buffer: Any = None
    qps: int = 0


def release() -> None:
    """Destroy the held Buffer (a barrier over its ranks, then NVSHMEM's finalize: every rank
    calls it, while the process group lives). Registered with harness.teardown.at_run_end."""
    held, _Held.buffer, _Held.qps = _Held.buffer, None, 0
    if held is not None:
        held.destroy()


def ll_buffer(
    deep_ep: Any, group: Any, world: int, rdma_bytes: int, qps: int, qp_depth: int
) -> Any:
    """The held Buffer if it fits (same group, enough bytes, QPs and QP depth), else a new one
    of the largest of the asked sizes, the run's planned ones at this world size and the held
    one's (a held one destroyed first: every rank walks the same cells, so all do it at the same
    cell). In a harness run the first cell makes it at the planned sizes, which fit every cell."""
    held = _Held.buffer
    if held is not None:
        fits = (
            held.group is group
            and held.num_rdma_bytes >= rdma_bytes
            and _Held.qps >= qps
            and held.nvshmem_qp_depth >= qp_depth
        )
        if fits:
            return held
        if held.group is group:
            rdma_bytes = max(rdma_bytes, held.num_rdma_bytes)
            qps, qp_depth = max(qps, _Held.qps), max(qp_depth, held.nvshmem_qp_depth)
        release()
    plan = planned(world)
    rdma_bytes, qps, qp_depth = max(rdma_bytes, plan[0]), max(qps, plan[1]), max(qp_depth, plan[2])
    depth = max(qp_depth, int(os.environ.get("NVSHMEM_QP_DEPTH", QP_DEPTH_DEFAULT)))
    os.environ["NVSHMEM_QP_DEPTH"] = str(depth)  # read by Buffer() and NVSHMEM's init
    _Held.buffer = deep_ep.Buffer(
        group, 0, rdma_bytes, low_latency_mode=True, num_qps_per_rank=qps, explicitly_destroy=True
    )
    _Held.qps = qps
    at_run_end(release)
    return _Held.buffer


class LowLatencyStep(Step):
    """One layer step on DeepEP's low-latency kernels (module doc) -> out [T, H]. Holds one
    untimed step's receive buffer, counts and expert rows for the bounds."""

    def __init__(self, buffer: Any, idx_t: torch.dtype, inputs: CellInputs) -> None:
        spec = inputs.spec
        self.buffer, self.idx_t = buffer, idx_t
        self.M, self.G = spec.tokens_per_rank, spec.n_experts
        self.S = spec.world_size * self.M  # slots per expert in the receive buffer
        self.x, self.ids, self.gate = inputs.x, inputs.expert_ids, inputs.gate
        self.w1, self.w2 = inputs.w1, inputs.weights  # [E, H, F], [E, F, H]
        dev, E, H = self.x.device, spec.experts_per_rank, spec.hidden
        self.rows = torch.arange(packed_rows(spec), device=dev)  # [P]
        self.y_rows = torch.zeros(E * self.S + 1, H, dtype=self.x.dtype, device=dev)
        self.recv, self.count, handle = self._dispatch()
        self.y = packed_ffn(self.recv, self.count, self.w1, self.w2, self.rows, self.y_rows)
        self._combine(self.y, handle)
        self.host_free = grouped_mm_usable(self.recv.view(-1, H), self.w1)

    def _topk(self) -> torch.Tensor:
        return self.ids.to(self.idx_t).contiguous()  # no copy where already idx_t

    def _dispatch(self) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        """x [T, H] -> recv [E, W*M, H], count [E] int32, the combine's handle."""
        recv, count, handle, _, _ = self.buffer.low_latency_dispatch(
            self.x, self._topk(), self.M, self.G, use_fp8=False
        )
        return recv, count, handle

    def _combine(self, y: torch.Tensor, handle: tuple) -> torch.Tensor:
        """y [E, W*M, H] -> out [T, H]: each token's rows times its gate weights, summed."""
        gate = self.gate.float().contiguous()
        out, _, _ = self.buffer.low_latency_combine(y, self._topk(), gate, handle)
        return out

    def timed(self) -> torch.Tensor:
        recv, count, handle = self._dispatch()
        y = packed_ffn(recv, count, self.w1, self.w2, self.rows, self.y_rows)
        return self._combine(y, handle)

    def capture_blocker(self) -> str | None:
        if not self.host_free:
            return "no torch._grouped_mm here: the per-expert matmul reads the counts on the host"
        return None

    def compute_only(self) -> torch.Tensor:
        """The packed FFN on the held receive buffer and counts -> [E, W*M, H]."""
        return packed_ffn(self.recv, self.count, self.w1, self.w2, self.rows, self.y_rows)

    def comm_only(self) -> torch.Tensor:
        """The dispatch and the combine of the held expert outputs -> [T, H] (for its time
        only: a new dispatch may fill the slots in another order, DeepEP's atomics)."""
        _, _, handle = self._dispatch()
        return self._combine(self.y, handle)


class DeepEPSystem(System):
    name = "deepep"
    scope = "layer"
    layer_scope = True

    @classmethod
    def validate(cls, spec: WorkloadSpec, params: dict[str, Any], sm_count: int) -> None:
        """Every cell passes here before any rank starts: those the kernels take enter plan_cell."""
        if spec.ffn and not ll_limits(spec):
            plan_cell(spec)

    @classmethod
    def unsupported(cls, spec: WorkloadSpec, params: dict[str, Any]) -> str | None:
        if not spec.ffn:
            return (
                "deepep times the whole layer (dispatch, FFN experts, combine): operator cells "
                "(ffn=0) start from dispatched rows it does not take"
            )
        why = ll_limits(spec, planned(spec.world_size)[0])
        if why:
            return f"deepep ({UPSTREAM}) low-latency kernels: " + "; ".join(why)
        return None

    def build(self, ranks: list[CellInputs]) -> Step:
        """The process's low-latency Buffer, sized and cleaned for the cell, and its step."""
        import deep_ep

        (inputs,) = ranks
        spec = inputs.spec
        M, G = spec.tokens_per_rank, spec.n_experts
        group = self.ctx.group if self.ctx.group is not None else dist.group.WORLD
        rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(M, spec.hidden, spec.world_size, G)
        W, E = spec.world_size, spec.experts_per_rank
        buffer = ll_buffer(deep_ep, group, W, rdma, E, 2 * (M + 1))
        buffer.clean_low_latency_buffer(M, spec.hidden, G)
        step = LowLatencyStep(buffer, deep_ep.topk_idx_t, inputs)
        recv_rows = step.recv.view(-1, spec.hidden)
        self._impl = (
            f"native (deep_ep {deepep_version()} low-latency bf16; experts "
            f"{expert_gemm_impl(recv_rows, step.w1)} over packed rows)"
        )
        self.extra = dict(deep_ep=UPSTREAM, host_syncs=0 if step.host_free else 1, max_tokens=M)
        rdma_run = int(buffer.num_rdma_bytes)
        self.extra |= dict(packed_rows=int(step.rows.numel()), rdma_bytes=rdma_run)
        self.extra |= dict(rdma_bytes_cell=int(rdma), qp_depth=int(buffer.nvshmem_qp_depth))
        return step

    @property
    def impl(self) -> str:
        return self._impl

    @property
    def transport(self) -> str:
        return "nvshmem"


def deepep_version() -> str:
    return package_version("deep_ep")
