"""FasterMoE, the real package (laekov/fastmoe, `fmoe`): its smart schedule fed the harness routing.

fmoe.fastermoe.schedule._fmoe_general_global_forward runs FasterMoE's pipelined group-step
exchange (FMOE_FASTER_GROUP_SIZE = g) with our experts as expert_fn and shadowing off (its
default), then the gate-weighted sum of each token's k rows, as FMoE's layer does. Timed, from
x [T, K] and the routing: count exchange, dispatch steps, expert GEMMs, return steps, gather and
weighted sum -> out [T, N]. fmoe reads FMOE_FASTER_GROUP_SIZE ONCE per process (a static in
smart_schedule.cpp): a cell asking another group size than the run's first is skipped.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from harness.experts import activation
from harness.system import CellInputs, Step, System
from harness.workload import WorkloadSpec

#: the group size fmoe fixed in this process at its first call (empty before it)
_PROCESS_GROUP_SIZE: list[int] = []


def _group_size(spec: WorkloadSpec, params: dict[str, Any]) -> int:
    return min(int(params["group_size"]), spec.world_size)


class SmartScheduleStep(Step):
    """fmoe's schedule `fwd` (module doc) on x [T, K], expert_ids, gate [T, k] -> out [T, N]."""

    def __init__(self, fwd: Any, inputs: CellInputs) -> None:
        spec = inputs.spec
        self.fwd, self.spec, self.x = fwd, spec, inputs.x
        self.expert_fn = expert_fn(inputs.weights, inputs.w1)
        self.gate = inputs.expert_ids  # [T, k] global expert ids
        self.gw = inputs.gate  # [T, k] float32
        self.stored = torch.zeros(spec.n_experts, dtype=torch.bool)  # no shadowing
        # fmoe's schedule always calls pop_fn(0) on `experts` (to restore shadowed parameters):
        # parameter-less stand-ins, one per local expert, as FMoE's layer passes its experts
        self.experts = torch.nn.ModuleList(
            torch.nn.Identity() for _ in range(spec.experts_per_rank)
        )

    def timed(self) -> torch.Tensor:
        spec = self.spec
        with torch.no_grad():
            E, W = spec.experts_per_rank, spec.world_size
            kw = dict(experts=self.experts, stored_models=self.stored)
            rows = self.fwd(self.x, self.gate, self.expert_fn, E, W, **kw)  # [T*k, N]: t*k + j
        T, k, N = spec.tokens_per_rank, spec.top_k, spec.out
        out = (rows.view(T, k, N).float() * self.gw[..., None]).sum(1)
        return out.to(self.x.dtype)

    def capture_blocker(self) -> str | None:
        return "fastermoe: its step is not declared capturable"


class FasterMoESystem(System):
    name = "fastermoe"
    scope = "layer"
    layer_scope = True
    PARAMS: ClassVar[dict[str, Any]] = {"group_size": 1}

    @classmethod
    def validate(cls, spec: WorkloadSpec, params: dict[str, Any], sm_count: int) -> None:
        g = int(params["group_size"])
        if g < 1 or spec.world_size % min(g, spec.world_size):
            raise ValueError(
                f"fastermoe: group_size {g} must be >= 1 and divide the world size "
                f"{spec.world_size}"
            )

    @classmethod
    def unsupported(cls, spec: WorkloadSpec, params: dict[str, Any]) -> str | None:
        if spec.hidden != spec.out:
            return (
                f"native FasterMoE needs expert output width == input width (K={spec.hidden}, "
                f"N={spec.out}); fastermoe_reimpl runs this cell"
            )
        g = _group_size(spec, params)
        if _PROCESS_GROUP_SIZE and _PROCESS_GROUP_SIZE[0] != g:
            return (
                f"fmoe fixed its group size at {_PROCESS_GROUP_SIZE[0]} in this process (it reads "
                f"FMOE_FASTER_GROUP_SIZE once); run group_size={g} in its own invocation"
            )
        return None

    def build(self, ranks: list[CellInputs]) -> Step:
        """fmoe's schedule at the cell's group size (fixed for the process at its first call)."""
        from fmoe.fastermoe.schedule import _fmoe_general_global_forward
        from fmoe.functions import ensure_comm

        (inputs,) = ranks
        spec = inputs.spec
        g = _group_size(spec, self.params)
        os.environ["FMOE_FASTER_GROUP_SIZE"] = str(g)
        if not _PROCESS_GROUP_SIZE:
            _PROCESS_GROUP_SIZE.append(g)  # fmoe's first call in this process fixes it
        step = SmartScheduleStep(_fmoe_general_global_forward, inputs)
        ensure_comm(step.x, self.ctx.group or dist.group.WORLD)
        experts = "ffn (gelu)" if spec.ffn else "single GEMM"
        self.extra = {"group_size": g, "shadowing": False, "experts": experts}
        return step

    @property
    def impl(self) -> str:
        return "native (fmoe smart schedule)"


def expert_fn(w: torch.Tensor, w1: torch.Tensor | None = None):
    """fmoe's expert_fn(x [m, K], counts, e) -> [m, N] for local expert e: x @ w[e] with
    w [E, K, N]; with fc1 w1 [E, H, F] (w = fc2 [E, F, H]) the FFN gelu(x @ w1[e]) @ w[e]."""
    if w1 is None:
        return lambda x, counts, e: x @ w[e]
    return lambda x, counts, e: activation(x @ w1[e]) @ w[e]
