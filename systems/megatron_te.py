"""Megatron-core with Transformer Engine grouped GEMM experts (TEGroupedMLP's GroupedLinear).

megatron_cutlass with TE experts: operator cells run TEGroupedMLP's linear_fc1 as the single-GEMM
expert, layer cells TEGroupedMLP as Megatron's TE spec builds it. TE's math is never imitated:
without transformer_engine every cell is skipped with the reason (the GPU machine gets TE 2.20.2
from the vendor wheels, `make wheels-gpu`).
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
