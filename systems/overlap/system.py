"""The `overlap` system: the harness's client of the paper's method (systems/overlap/layer.py).

setup resolves the knobs (params.py; "auto" ones picked on the host by autotune.py: rows keep
p_ccta / p_mgb / p_order as asked, what ran as p_*_used and the reasons in extra["auto"] /
extra["auto_order"]) and builds one step (steps.py, backward.py for the train scope) for the
cell's scope and way of running its ranks. Stage A's cost alone: benchmarks/plan_time.py.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any, ClassVar

from harness.dispatch_device import dispatch_used
from harness.system import CellInputs, Step, System
from harness.workload import WorkloadSpec
from systems.overlap import steps
from systems.overlap.layer import resolve
from systems.overlap.params import OverlapParams


class OverlapSystem(System):
    name = "overlap"
    PARAMS: ClassVar[dict[str, Any]] = asdict(OverlapParams())
    simulates_ranks = True
    layer_scope = True
    train_scope = True

    @classmethod
    def validate(cls, spec: WorkloadSpec, params: dict[str, Any], sm_count: int) -> None:
        OverlapParams.from_dict(params).validate(spec, sm_count)

    @classmethod
    def refuse(cls, spec: WorkloadSpec, params: dict[str, Any], processes: int, device: str):
        OverlapParams.from_dict(params).refuse(spec, processes, device)

    def build(self, ranks: list[CellInputs]) -> Step:
        ctx, spec = self.ctx, ranks[0].spec
        asked = OverlapParams.from_dict(self.params)
        self._transport = asked.transport_for(ctx.world_size, ctx.device.type)
        params, why = resolve(asked, spec, self._transport, ctx.sm_count)  # "auto" picked
        self.extra |= why
        self.used = {"ccta_used": params.ccta, "mgb_used": params.mgb, "order_used": params.order}
        plays = len(ranks) == spec.world_size and ctx.world_size == 1
        group = None  # one process: the layer is this process alone, whatever group it is in
        if ctx.world_size > 1:  # the default group: the layer needs it named
            import torch.distributed as dist

            group = dist.group.WORLD if ctx.group is None else ctx.group
        if spec.ffn:
            dispatch = dispatch_used(params.dispatch, spec.world_size, plays)
            self.used["dispatch_used"] = dispatch
            params = replace(params, dispatch=dispatch)
            if spec.world_size == 1:  # nothing to combine: no consumer, so no cCTA
                self.used["ccta_used"] = 0
            one, every = steps.LayerStep, steps.PlayedLayerStep
            if spec.train:  # one forward + backward
                from systems.overlap.backward import LayerTrainStep as one
                from systems.overlap.backward import PlayedTrainStep as every
            if plays and spec.world_size > 1:
                step = every(ranks, params)
            else:
                step = one(ranks[0], group, params)
            self.metrics |= step.metrics
        elif self._transport == "loopback":
            if ctx.world_size != 1:
                raise ValueError("loopback plays every rank in one process: run with 1 process")
            step = steps.PlayedOperatorStep(ranks, params)
        else:
            if len(ranks) != 1 or ctx.world_size < 2:
                raise ValueError(f"{self._transport} needs one process per rank and >= 2 ranks")
            step = steps.PerProcessOperatorStep(ranks[0], group, self._transport, params)
        self.extra |= {"timed_rank": step.timed_rank or 0, **step.facts}
        return step

    def forward(self):
        out = super().forward()
        res = self.step.runner.residency  # consumer=shared: the first run's
        if res is not None:
            self.extra["consumers_beside_producer"] = res["consumers_beside_producer"]
        return out

    @property
    def impl(self) -> str:
        return "native (triton producer/consumer)"

    @property
    def transport(self) -> str:
        return self._transport

    def resolved_params(self) -> dict[str, Any]:
        tile = self.step.runner.tile
        return {"tile_n": tile.block_n, "tile_k": tile.block_k, **self.used}
