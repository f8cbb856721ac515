"""Tutel's strategy re-implemented: capacity-padded all-to-all, pipelined along the capacity.

Tutel lays the dispatched tokens out dense, [E_global, C, K] padded to capacity C (here the
busiest (source rank, global expert) pair's rows: nothing dropped), so both all-to-alls are
EQUAL-size, and splits them along C into d chunks (tutel/impls/overlap.py): the d dispatch
all-to-alls first on a comm stream, then per chunk the expert and that chunk's combine. The
fastest candidate d is kept; the CPU (gloo) runs the same order without streams.
Param `scope`: "gemm+combine" (default; the dispatch runs once at setup; timed: per chunk expert
GEMM + combine, then decode -> [T, N]) or "layer" (also the encode of x and the dispatch).
PipelinedStep / PipelinedLayer also run fastermoe_reimpl.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from harness.layout import send_order
from harness.system import CellInputs, RunContext, Step, System
from harness.workload import WorkloadSpec, routing_of
from systems.tutel import DEFAULT_DEGREES, candidates, check_tuning, expert_counts, tune_degree

SCOPES = ("gemm+combine", "layer")


def check_scope(owner: str, params: dict[str, Any]) -> None:
    """The `scope` param of a re-implementation (this one and fastermoe_reimpl): one of SCOPES."""
    scope = params.get("scope", "gemm+combine")
    if scope not in SCOPES:
        raise ValueError(f"{owner}: scope must be one of {SCOPES}, got {scope!r}")


def padded_slots(spec: WorkloadSpec, rank: int, chunk_rows: int, degree: int) -> torch.Tensor:
    """Flat row [S] of each of rank's send rows (send order) in the chunk-major padded layout:
    a row for global expert g at slot p (its rank among rank's rows for g, in token order) goes
    to (p // Cc) * G * Cc + g * Cc + p % Cc. The combine brings its output back there."""
    G = spec.n_experts
    _, gid = send_order(spec, rank)  # sorted by global expert, then token
    count = torch.bincount(gid, minlength=G)
    start = torch.cumsum(count, 0) - count
    slot = torch.arange(gid.numel()) - start[gid]
    if gid.numel() and int(slot.max()) >= chunk_rows * degree:
        raise ValueError("capacity too small for the routing")
    chunk, within = slot // chunk_rows, slot % chunk_rows
    return chunk * G * chunk_rows + gid * chunk_rows + within


class PipelinedStep(Step):
    """Scope gemm+combine of a pipeline of `stages` stages (Tutel's capacity chunks, FasterMoE's
    group steps): the dispatch runs once at setup (setup_dispatch); timed: per stage the expert
    compute and the combine (on the comm stream `comm`; None on the CPU), then the output step
    -> out [T, N]. COMBINE_EACH: each stage's combine right after its compute (Tutel), else
    every combine after the last compute. A subclass sets `system` and `stages`, calls
    _prepare() and defines _encode() (x into the send buffer), per stage i _dispatch_stage(i),
    _compute(i), _combine(i), and _output() -> [T, N], _combined() (the combine's buffer)."""

    system = ""
    COMBINE_EACH = True

    def __init__(self, inputs: CellInputs, rank: int) -> None:
        self.spec, self.lay, self.rank = inputs.spec, inputs.layout, rank
        self.x, self.weights = inputs.x, inputs.weights  # [T, K], [E, K, N]
        dev = inputs.x.device
        self.comm = torch.cuda.Stream(device=dev) if dev.type == "cuda" else None

    def _prepare(self) -> None:
        """ev_in / ev_out per stage (rows received / compute done; GPU), then setup_dispatch."""
        cuda = self.comm is not None
        self.ev_in = [torch.cuda.Event() if cuda else None for _ in range(self.stages)]
        self.ev_out = [torch.cuda.Event() if cuda else None for _ in range(self.stages)]
        self.setup_dispatch()

    def setup_dispatch(self) -> None:
        """Every stage's dispatch, once and untimed."""
        self._encode()
        for i in range(self.stages):
            self._dispatch_stage(i)

    def _dispatch(self, cur) -> None:
        """Before the stages' compute, on stream `cur` (None on the CPU): the comm stream
        follows (the previous iteration's output step has read the combine's buffer)."""
        if cur is not None:
            self.comm.wait_stream(cur)

    def _wait_rows(self, cur, i: int) -> None:
        """Make stream `cur` wait for stage i's received rows (here: there since setup)."""

    def timed(self) -> torch.Tensor:
        comm, n = self.comm, self.stages
        cur = torch.cuda.current_stream() if comm is not None else None
        self._dispatch(cur)
        groups = [[i] for i in range(n)] if self.COMBINE_EACH else [list(range(n))]
        for group in groups:
            for i in group:
                if cur is not None:
                    self._wait_rows(cur, i)
                self._compute(i)
                if cur is not None:
                    self.ev_out[i].record(cur)
            if cur is None:  # CPU / gloo: the same order, no streams
                for i in group:
                    self._combine(i)
                continue
            with torch.cuda.stream(comm):
                for i in group:
                    comm.wait_event(self.ev_out[i])
                    self._combine(i)
        if cur is not None:
            cur.wait_stream(comm)
        return self._output()

    def capture_blocker(self) -> str | None:
        return f"{self.system}: its step is not declared capturable"

    def compute_only(self) -> torch.Tensor:
        """Every stage's expert compute on the held rows, then the output step -> [T, N]."""
        for i in range(self.stages):
            self._compute(i)
        return self._output()

    def comm_only(self) -> torch.Tensor:
        """Every stage's combine of the held expert rows -> the combine's buffer."""
        for i in range(self.stages):
            self._combine(i)
        return self._combined()


class PipelinedLayer(PipelinedStep):
    """Scope layer: the timed region also encodes x and runs every stage's dispatch on the comm
    stream (recording ev_in[i]), each stage's compute waiting for its rows."""

    def setup_dispatch(self) -> None:
        """Nothing: the timed region dispatches."""

    def _dispatch(self, cur) -> None:
        self._encode()
        if cur is None:
            for i in range(self.stages):
                self._dispatch_stage(i)
            return
        self.comm.wait_stream(cur)  # encode done; the previous output step has read its rows
        with torch.cuda.stream(self.comm):
            for i in range(self.stages):
                self._dispatch_stage(i)
                self.ev_in[i].record(self.comm)

    def _wait_rows(self, cur, i: int) -> None:
        cur.wait_event(self.ev_in[i])

    def compute_only(self) -> torch.Tensor:
        """The encode, every stage's expert compute on the held rows, the output -> [T, N]."""
        self._encode()
        return super().compute_only()

    def comm_only(self) -> torch.Tensor:
        """Per stage the dispatch and the combine -> the combine's buffer."""
        for i in range(self.stages):
            self._dispatch_stage(i)
            self._combine(i)
        return self._combined()


@dataclass
class _State:
    """Buffers and indices of one degree d (G = W * E global experts)."""

    degree: int
    chunk_rows: int  # Cc = ceil(C / d)
    idx: torch.Tensor  # [S] flat padded row of each send row, in send order (device)
    idx_tk: torch.Tensor  # [T*k] flat padded row of each (token, slot) pair t*k + j (device)
    xs: torch.Tensor  # [d, G*Cc, K] padded send buffer of this rank's tokens (chunk-major)
    xr: torch.Tensor  # [d, W*E*Cc, K] received chunks, rows (source, local expert, slot)
    ys: torch.Tensor  # [d, W*E*Cc, N] expert output in the same layout
    yr: torch.Tensor  # [d, G*Cc, N] combine result at the owner, rows (global expert, slot)


class ChunkedCombineStep(PipelinedStep):
    """Scope gemm+combine (module doc): the dispatch runs once per degree, its buffers in `st`."""

    system = "tutel_reimpl"

    def __init__(self, inputs: CellInputs, rank: int, group, cap_max: int) -> None:
        super().__init__(inputs, rank)
        self.group = group
        self.gates = routing_of(self.spec).gate_weights[rank].to(inputs.x.device)  # [T, k]
        self.cap_max = cap_max  # the busiest (source rank, global expert) pair's rows
        self.st: _State | None = None

    @property
    def stages(self) -> int:
        return self.st.degree

    def set_degree(self, d: int) -> None:
        """Buffers for degree d; an out-of-memory on any rank raises on every rank."""
        self.st = None  # free the previous degree's buffers first
        spec, dev = self.spec, self.x.device
        G, K, N = spec.n_experts, spec.hidden, spec.out  # G = W * E
        cc = -(-self.cap_max // d)  # ceil: capacity padded to a multiple of d
        idx = padded_slots(spec, self.rank, cc, d)
        order, _ = send_order(spec, self.rank)  # pair index t*k + j of each send row
        idx_tk = idx[torch.argsort(order)]

        def alloc() -> _State:
            kw = dict(dtype=self.x.dtype, device=dev)
            xs, xr = torch.zeros(d, G * cc, K, **kw), torch.empty(d, G * cc, K, **kw)
            ys, yr = torch.empty(d, G * cc, N, **kw), torch.empty(d, G * cc, N, **kw)
            st = _State(d, cc, idx.to(dev), idx_tk.to(dev), xs, xr, ys, yr)
            # the per-chunk temporaries of _compute, so that forward finds their memory
            scratch = st.xr.new_empty(G * cc, K + N)
            del scratch
            return st

        self.st = self._agreed(alloc)
        self._prepare()

    def _agreed(self, alloc):
        """Run alloc() on every rank; if it runs out of memory on any rank, raise on all (a
        failure on one rank alone would leave the others waiting in the next collective)."""
        out, ok = None, 1.0
        try:
            out = alloc()
        except torch.cuda.OutOfMemoryError:
            ok = 0.0
        flag = torch.tensor([ok], device=self.x.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        if flag.item() == 0.0:
            out = None  # the traceback holds this frame: free its buffers now
            raise torch.cuda.OutOfMemoryError(
                f"tutel padded buffers (capacity {self.cap_max}) do not fit on some rank"
            )
        return out

    def _encode(self) -> None:
        """fast_encode: this rank's rows x[send_token] -> their padded slots of xs."""
        st = self.st
        rows = self.x.index_select(0, self.lay.send_token.to(self.x.device))
        st.xs.view(-1, self.spec.hidden).index_copy_(0, st.idx, rows)

    def _dispatch_stage(self, c: int) -> None:
        """Chunk c's dispatch all-to-all: xs[c] -> xr[c]."""
        dist.all_to_all_single(self.st.xr[c], self.st.xs[c], group=self.group)

    def _compute(self, c: int) -> None:
        """Chunk c: xr[c] [W, E, Cc, K] -> [E, W*Cc, K] @ B [E, K, N] -> ys[c] [W, E, Cc, N]."""
        st, spec = self.st, self.spec
        W, E, cc = spec.world_size, spec.experts_per_rank, st.chunk_rows
        K, N = spec.hidden, spec.out
        x = st.xr[c].view(W, E, cc, K).transpose(0, 1).reshape(E, W * cc, K)  # pre_expert_permute
        y = torch.bmm(x, self.weights)
        st.ys[c].view(W, E, cc, N).copy_(y.view(E, W, cc, N).transpose(0, 1))  # post_expert_permute

    def _combine(self, c: int) -> None:
        """Chunk c's combine all-to-all: ys[c] -> yr[c]."""
        dist.all_to_all_single(self.st.yr[c], self.st.ys[c], group=self.group)

    def _output(self) -> torch.Tensor:
        """fast_decode: per token, gather its k rows from yr [T, k, N] (as Tutel's decode
        kernel); gate-weighted sum in float32 -> [T, N]."""
        T, k, N = self.spec.tokens_per_rank, self.spec.top_k, self.spec.out
        rows = self.st.yr.view(-1, N).index_select(0, self.st.idx_tk).view(T, k, N)
        return (rows.float() * self.gates[:, :, None]).sum(1).to(rows.dtype)

    def _combined(self) -> torch.Tensor:
        return self.st.yr  # [d, G*Cc, N]


class ChunkedLayerStep(PipelinedLayer, ChunkedCombineStep):
    """Scope layer: Tutel's full pipeline (encode, d dispatch all-to-alls, chunks, decode)."""


class TutelReimplSystem(System):
    name = "tutel_reimpl"
    PARAMS: ClassVar[dict[str, Any]] = dict(
        scope="gemm+combine", degrees=list(DEFAULT_DEGREES), degree=0, tune_iters=3
    )

    def __init__(self, ctx: RunContext, params: dict[str, Any]) -> None:
        super().__init__(ctx, params)
        self.scope = str(self.params["scope"])

    @classmethod
    def validate(cls, spec: WorkloadSpec, params: dict[str, Any], sm_count: int) -> None:
        check_scope("tutel", params)
        check_tuning(params)

    def build(self, ranks: list[CellInputs]) -> Step:
        """The step of the `scope` param at the degree tuned on the cell."""
        (inputs,) = ranks
        cap_max = max(int(expert_counts(inputs.spec).max()), 1)
        self.extra = {"scope": self.scope, "capacity_max": cap_max}
        step_cls = ChunkedLayerStep if self.scope == "layer" else ChunkedCombineStep
        step = step_cls(inputs, self.ctx.rank, self.ctx.group, cap_max)
        tune_degree(self, step, candidates(self.params))
        capacity = step.st.degree * step.st.chunk_rows
        self.extra |= dict(capacity=capacity, rows_computed=step.spec.n_experts * capacity)
        self.extra["rows_real"] = int(step.lay.recv_counts.sum())
        return step

    def resolved_params(self) -> dict[str, Any]:
        return {"degree_tuned": self.extra.get("degree", 0)}

    @property
    def impl(self) -> str:
        return "reimpl (capacity-padded a2a, capacity-chunk pipeline)"
