"""Megatron-core with CUTLASS grouped GEMM experts (megatron-core 0.16.1; needs CUDA);
megatron_te.py subclasses it with Transformer Engine experts.

The real MoELayer with the all-to-all token dispatcher (systems/megatron_common.py): serial in
structure (the combine waits for the expert GEMMs), with Megatron's own permutations (TE's fused
kernels where TE is installed: permute_fusion=auto). Experts: GroupedMLP's fc1 (operator cells)
or legacy GroupedMLP (layer cells, bf16 only), on grouped_gemm.ops.gmm or torch._grouped_mm
(`impl` says which). Param `capacity` (layer cells): CAPACITIES (megatron_common.py explains
both); on "padded" a (token, expert) pair dropped anyway fails setup (a dropped low-gate pair
can pass the output check).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from harness.system import CellInputs, Step, System

CAPACITIES = ("dropless", "padded")


class MegatronStep(Step):
    """A step on megatron_common's MegatronOperator or dropless MegatronLayer `op`."""

    def __init__(self, op: Any, name: str) -> None:
        self.op, self.name = op, name

    def timed(self) -> torch.Tensor:
        return self.op.forward()

    def capture_blocker(self) -> str | None:
        return (
            f"{self.name} capacity=dropless: Megatron's all-to-all dispatcher copies "
            "tokens_per_expert and the split sizes to the host and waits for them "
            "(token_dispatcher.py _maybe_dtoh_and_synchronize: d2h_event.synchronize())"
        )

    def compute_only(self) -> Any:
        return self.op.compute_only()

    def comm_only(self) -> Any:
        return self.op.comm_only()


class PaddedLayerStep(MegatronStep):
    """capacity=padded (Megatron's drop-and-pad): host-constant counts, equal splits."""

    def capture_blocker(self) -> str | None:
        if self.op.spec.world_size > 1:
            return (
                f"{self.name} capacity=padded at W > 1: no host read, but the equal-split NCCL "
                "all-to-all's capture across processes is not tried yet"
            )
        if self.op.real_grouped_gemm:
            return (
                f"{self.name}: the grouped_gemm package's gmm is not verified under capture "
                "(not installed where this was checked)"
            )
        return None


class MegatronCutlassSystem(System):
    name = "megatron_cutlass"
    overlaps = False  # the combine runs after the experts
    layer_scope = True
    #: Megatron's experts: "grouped" (GroupedMLP; operator cells: its fc1) or "te" (below)
    layer_experts = "grouped"
    #: permute_fusion: Megatron's moe_permute_fusion ("auto": on where TE provides it)
    PARAMS: ClassVar[dict[str, Any]] = {"permute_fusion": "auto", "capacity": "dropless"}

    @classmethod
    def validate(cls, spec, params: dict[str, Any], sm_count: int) -> None:
        if params["permute_fusion"] not in ("auto", True, False):
            raise ValueError(
                f"{cls.name}: permute_fusion must be 'auto', true or false, "
                f"got {params['permute_fusion']!r}"
            )
        capacity = params.get("capacity", "dropless")  # a subclass may not have the knob
        if capacity not in CAPACITIES:
            raise ValueError(
                f"{cls.name}: capacity must be one of {', '.join(CAPACITIES)}, got {capacity!r}"
            )

    @classmethod
    def unsupported(cls, spec, params: dict[str, Any]) -> str | None:
        if not spec.ffn and params.get("capacity") == "padded":
            return (
                f"{cls.name}: capacity=padded is Megatron's layer route; the operator scope "
                "starts from the harness's dropless dispatched rows (x_recv)"
            )
        if spec.ffn and cls.layer_experts == "grouped" and spec.dtype != "bfloat16":
            return f"{cls.name}: Megatron's legacy GroupedMLP runs bf16 only, cell is {spec.dtype}"
        return None  # TEGroupedMLP asserts no dtype

    def build(self, ranks: list[CellInputs]) -> Step:
        """A MegatronStep, or a padded layer cell's PaddedLayerStep (the `capacity` param)."""
        from systems import megatron_common as mc

        mc.pin_cudnn_to_torch()  # before megatron imports Transformer Engine
        (inputs,) = ranks
        self.fusion = mc.resolve_permute_fusion(self.params["permute_fusion"])
        return self._build(mc, inputs)

    def _build(self, mc, inputs: CellInputs) -> Step:
        if not inputs.spec.ffn:
            return self._operator_step(mc, inputs)
        if self.params.get("capacity") == "padded":
            return self._padded_step(mc, inputs)
        op = mc.MegatronLayer(inputs, self.layer_experts, permute_fusion=self.fusion)
        self._layer_facts(mc, op, "alltoall")
        return MegatronStep(op, self.name)

    def _operator_step(self, mc, inputs: CellInputs) -> Step:
        """The real MoELayer run from the harness's dispatched rows x_recv [R, K]."""
        te = self.layer_experts == "te"
        op = mc.MegatronOperator(inputs, self.ctx.rank, te, self.fusion)
        gemm = mc.te_gemm_name() if te else mc.gemm_backend(inputs.x_recv, inputs.weights)
        self._impl = f"native (mcore {mc.mcore_version()} MoELayer+alltoall; experts {gemm})"
        self.extra = {"megatron_core": mc.mcore_version(), "dispatcher": "alltoall"}
        return MegatronStep(op, self.name)

    def _padded_step(self, mc, inputs: CellInputs) -> Step:
        """The real MoELayer padded to the cell's no-drop capacity (module doc)."""
        factor = mc.no_drop_capacity(inputs.spec)[1]
        op = mc.MegatronLayer(
            inputs, self.layer_experts, permute_fusion=self.fusion, capacity_factor=factor
        )
        self._layer_facts(mc, op, "alltoall, drop-and-pad")
        self.extra.update(
            capacity=op.capacity,
            expert_rows=op.capacity * inputs.spec.world_size,
            capacity_factor=factor,
            dropped_tokens=op.dropped,
        )
        if op.dropped:
            raise RuntimeError(
                f"{self.name} capacity=padded: Megatron dropped {op.dropped} (token, "
                f"expert) pairs at capacity {op.capacity} (factor {factor:.6g})"
            )
        return PaddedLayerStep(op, self.name)

    def _layer_facts(self, mc, op: Any, route: str, dispatcher: str | None = None) -> None:
        """impl and extra of a layer cell on MegatronLayer `op` through `route` (extra's
        dispatcher: `dispatcher`, else route)."""
        self._impl = (
            f"native (mcore {mc.mcore_version()} MoELayer+{route}; "
            f"experts {op.experts_name}, {op.gemm})"
        )
        self.extra = dict(megatron_core=mc.mcore_version(), dispatcher=dispatcher or route)
        self.extra |= dict(experts=op.experts_name, gemm=op.gemm)

    def resolved_params(self) -> dict[str, Any]:
        return {"permute_fusion_used": self.fusion}

    @property
    def impl(self) -> str:
        return self._impl
