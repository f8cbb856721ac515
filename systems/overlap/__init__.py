"""The paper's method: tile-level computation-communication overlap of the MoE combine.

The public layer is `OverlapMoE` (layer.py) with its knobs `OverlapParams` (params.py); steps.py
and system.py are the harness's client. Stage A: `plan` (host) and `plan_device` (device) build
the CombinePlan; stage B: `kernels/` (Triton), `runner`, `transport`. Imports nothing heavy
here, so reading the package pulls in no GPU code.
"""

__all__ = ["OverlapMoE", "OverlapParams"]
#: the public names, imported on first use
_HOMES = {"OverlapMoE": "systems.overlap.layer", "OverlapParams": "systems.overlap.params"}


def __getattr__(name: str):
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
