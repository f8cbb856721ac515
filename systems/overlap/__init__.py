"""The paper's method: tile-level computation-communication overlap of the MoE combine.

The public layer is `OverlapMoE` (layer.py) with its knobs `OverlapParams` (params.py);
rank_experts.py is one rank's expert part of it; steps.py and system.py are the harness's
client. Stage A: `plan` (host) and `plan_device` (device) build the CombinePlan. Stage B:
`kernels/` (Triton), `runner` (one rank's host state and launches), `transport`, `modes`,
`errors`. Imports nothing heavy here, so reading the package pulls in no GPU code.
"""

__all__ = ["OverlapMoE", "OverlapParams"]


def __getattr__(name: str):
    """`from systems.overlap import OverlapMoE` (the public layer) imports it on first use."""
    if name == "OverlapMoE":
        from systems.overlap.layer import OverlapMoE

        return OverlapMoE
    if name == "OverlapParams":
        from systems.overlap.params import OverlapParams

        return OverlapParams
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
