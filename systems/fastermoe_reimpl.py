"""FasterMoE's smart schedule re-implemented (pipelined point-to-point exchange per group step).

FasterMoE (laekov/fastmoe, cuda/fastermoe/smart_schedule.h) replaces the two all-to-alls by
n = W / g steps of point-to-point exchanges between groups of g ranks (param `group_size`): at
step s, group grp = r // g sends to group (grp + s) mod n and receives from (grp - s) mod n.
Stages: 1 the dispatch steps, one NCCL group per (step, local expert); 2 per step, one GEMM per
local expert over the rows from group (grp - s); 3 the return steps. Here one batch_isend_irecv
per (step, expert): HOST-BOUND. Not reproduced (off by default): shadowing, the topology-aware
gate. Param `scope`: "gemm+combine" (default; timed: stages 2-3, the output) or "layer" (1-3).
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from harness.layout import send_order
from harness.system import CellInputs, RunContext, Step, System, int_param
from harness.workload import WorkloadSpec, routing_of
from systems.fastermoe import FasterMoESystem
from systems.tutel_reimpl import PipelinedLayer, PipelinedStep, check_scope, expert_counts


class Plan:
    """Host-side schedule of one rank (no communication to build: all from the routing).

    cnt[s][d*E + e] = rows source s sends to local expert e of rank d.
    local_ptr [G+1]  offsets into the send buffer, index d*E + e (destination-major)
    global_ptr [G+1] offsets into the receive buffer, index e*W + s (expert-major)
    """

    def __init__(self, spec: WorkloadSpec, rank: int, group_size: int) -> None:
        W, E = spec.world_size, spec.experts_per_rank
        g = min(group_size, W)  # W % g == 0: FasterMoEReimplSystem.validate
        self.W, self.E, self.g, self.rank = W, E, g, rank
        self.n = W // g
        self.grp = rank // g
        self.cnt = expert_counts(spec).tolist()
        self.local_ptr = list(accumulate(self.cnt[rank], initial=0))
        recv = [self.cnt[s][rank * E + e] for e in range(E) for s in range(W)]
        self.global_ptr = list(accumulate(recv, initial=0))

    def bases(self, step: int) -> tuple[int, int]:
        """(to_base, from_base): first rank of the group sent to / received from at `step`."""
        return ((self.grp + step) % self.n) * self.g, ((self.grp - step) % self.n) * self.g

    def _sent(self, peer: int, e: int) -> tuple[int, int]:
        """(offset, rows) in the send buffer of this rank's rows for expert e of rank `peer`."""
        return self.local_ptr[peer * self.E + e], self.cnt[self.rank][peer * self.E + e]

    def _received(self, peer: int, e: int) -> tuple[int, int]:
        """(offset, rows) in the receive buffer of rank `peer`'s rows for local expert e."""
        return self.global_ptr[e * self.W + peer], self.cnt[peer][self.rank * self.E + e]

    def _members(self, step: int) -> list[tuple[int, int]]:
        """(rank sent to, rank received from) at `step`, per group member j."""
        to_base, from_base = self.bases(step)
        return [(to_base + j, from_base + j) for j in range(self.g)]

    def dispatch_pairs(self, step: int, e: int) -> list[tuple[int, int, int, int, int, int]]:
        """(peer_send, send_off, send_n, peer_recv, recv_off, recv_n) per group member j."""
        return [(t, *self._sent(t, e), f, *self._received(f, e)) for t, f in self._members(step)]

    def combine_pairs(self, step: int, e: int) -> list[tuple[int, int, int, int, int, int]]:
        """Return path: send expert rows back to group (grp - s), receive from (grp + s)."""
        return [(f, *self._received(f, e), t, *self._sent(t, e)) for t, f in self._members(step)]

    def compute_rows(self, step: int, e: int) -> tuple[int, int]:
        """Rows [lo, hi) of the receive buffer expert e computes at `step`."""
        _, from_base = self.bases(step)
        base = e * self.W + from_base
        return self.global_ptr[base], self.global_ptr[base + self.g]


class CombineScheduleStep(PipelinedStep):
    """Scope gemm+combine (module doc). Buffers: xs [S, K] send, gin [R, K] / gout [R, N]
    expert-major receive, yout [S, N] returned rows in send order."""

    system = "fastermoe_reimpl"
    COMBINE_EACH = False  # every return step after the last compute step (smart_schedule.h)

    def __init__(self, inputs: CellInputs, plan: Plan) -> None:
        super().__init__(inputs, plan.rank)
        spec, self.plan = inputs.spec, plan
        dev, dt = inputs.x.device, inputs.x.dtype
        S, R = plan.local_ptr[-1], plan.global_ptr[-1]
        self.xs = torch.empty(S, spec.hidden, dtype=dt, device=dev)  # send buffer
        self.gin = torch.empty(R, spec.hidden, dtype=dt, device=dev)  # global_input_buf
        self.gout = torch.empty(R, spec.out, dtype=dt, device=dev)  # global_output_buf
        self.yout = torch.empty(S, spec.out, dtype=dt, device=dev)  # output_buf (send order)
        order, _ = send_order(spec, plan.rank)  # pair index t*k + j of each send row
        self.pos_g = torch.argsort(order).to(dev)  # [T*k]: send-order row of pair t*k + j
        gw = routing_of(spec).gate_weights[plan.rank]  # [T, k]
        self.gate_score = gw.view(-1, 1, spec.top_k).to(device=dev, dtype=dt)
        self.stages = plan.n
        self._prepare()

    def _encode(self) -> None:
        """_local_scatter: x [T, K] -> send buffer [S, K] in (destination, expert) order."""
        torch.index_select(self.x, 0, self.lay.send_token.to(self.x.device), out=self.xs)

    def _exchange(self, s: int, pairs, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Step s: per local expert e one NCCL group over pairs(s, e), src rows -> dst rows."""
        for e in range(self.plan.E):
            ops, tag = [], s * self.plan.E + e
            for peer_s, s_off, s_n, peer_r, r_off, r_n in pairs(s, e):
                if peer_s == self.rank:  # own rows: a local copy (peer_r is then rank too)
                    if s_n:
                        dst[r_off : r_off + r_n].copy_(src[s_off : s_off + s_n])
                    continue
                if s_n:
                    ops.append(dist.P2POp(dist.isend, src[s_off : s_off + s_n], peer_s, tag=tag))
                if r_n:
                    ops.append(dist.P2POp(dist.irecv, dst[r_off : r_off + r_n], peer_r, tag=tag))
            if ops:
                for work in dist.batch_isend_irecv(ops):
                    work.wait()

    def _dispatch_stage(self, s: int) -> None:
        self._exchange(s, self.plan.dispatch_pairs, self.xs, self.gin)

    def _compute(self, s: int) -> None:
        for e in range(self.plan.E):
            lo, hi = self.plan.compute_rows(s, e)
            if hi > lo:
                torch.matmul(self.gin[lo:hi], self.weights[e], out=self.gout[lo:hi])

    def _combine(self, s: int) -> None:
        self._exchange(s, self.plan.combine_pairs, self.gout, self.yout)

    def _output(self) -> torch.Tensor:
        """_local_gather to (token, slot) order [T, k, N], then as FMoE's layer
        torch.bmm(gate_score [T, 1, k] in the data dtype, rows) -> [T, N]."""
        T, k, N = self.spec.tokens_per_rank, self.spec.top_k, self.spec.out
        rows = self.yout.index_select(0, self.pos_g).view(T, k, N)
        return torch.bmm(self.gate_score, rows).view(T, N)

    def _combined(self) -> torch.Tensor:
        return self.yout  # [S, N]


class LayerScheduleStep(PipelinedLayer, CombineScheduleStep):
    """Scope layer: the dispatch steps (stage 1) timed too."""


class FasterMoEReimplSystem(System):
    name = "fastermoe_reimpl"

    PARAMS: ClassVar[dict[str, Any]] = {"scope": "gemm+combine", "group_size": 1}

    def __init__(self, ctx: RunContext, params: dict[str, Any]) -> None:
        super().__init__(ctx, params)
        self.scope = str(self.params["scope"])

    @classmethod
    def validate(cls, spec: WorkloadSpec, params: dict[str, Any], sm_count: int) -> None:
        check_scope("fastermoe", params)
        int_param("fastermoe", "group_size", params.get("group_size", 1), least=1)
        FasterMoESystem.validate(spec, params, sm_count)  # g divides W

    def build(self, ranks: list[CellInputs]) -> Step:
        """The schedule's plan and the step of the `scope` param."""
        (inputs,) = ranks
        plan = Plan(inputs.spec, self.ctx.rank, int(self.params["group_size"]))
        self.extra = {"scope": self.scope, "group_size": plan.g, "steps": plan.n}
        self.extra["host_bound"] = "one python batch_isend_irecv per (step, expert)"
        step_cls = LayerScheduleStep if self.scope == "layer" else CombineScheduleStep
        return step_cls(inputs, plan)

    @property
    def impl(self) -> str:
        return "reimpl (smart schedule, p2p per step and expert)"
