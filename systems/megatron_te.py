"""Megatron-core with Transformer Engine grouped GEMM experts (TEGroupedMLP's GroupedLinear).

megatron_cutlass's layer and router stub (systems/megatron_common.py) with TE experts: operator
cells run TEGroupedMLP's linear_fc1 (weight{e} [N, K] = B_e^T) as the single-GEMM expert; layer
cells run TEGroupedMLP as Megatron's TE spec builds it (fc1 weight{e} [F, H] = W1_e^T, gelu x
probs, fc2 weight{e} [H, F] = W2_e^T), param `capacity` as megatron_cutlass. TE's math is never
imitated: without transformer_engine every cell is a `skipped` row with the reason (the GPU
machine gets TE 2.20.2 from the vendor wheels, `make wheels-gpu`).
"""

from __future__ import annotations

from harness.system import CellInputs
from systems.megatron_cutlass import MegatronCutlassSystem


class MegatronTESystem(MegatronCutlassSystem):
    name = "megatron_te"
    layer_experts = "te"

    @classmethod
    def experts_unsupported(cls, spec) -> str | None:
        return None  # unlike GroupedMLP, TEGroupedMLP asserts no dtype

    def experts_cls(self, mc):
        return mc.single_gemm_te_grouped_mlp_cls()

    def impl_name(self, mc, inputs: CellInputs) -> str:
        import transformer_engine

        te = getattr(transformer_engine, "__version__", "?")
        return (
            f"native (mcore {mc.mcore_version()} MoELayer+alltoall; experts TE {te} GroupedLinear)"
        )
