"""Device code every system shares (Triton kernels and their thin launchers).

relaunch.py    LaunchMemo: a remembered Triton launch, re-run without Triton's per-call host work
ints.py        cdiv and next_power_of_2 for the host (Triton's own cost 3-4 us a call)
scale.py       the fused scale (step 5 of the layer)
dispatch.py    the dispatch's bookkeeping kernels (send metadata, split sizes, received rows)
activation.py  GELU in place over the real rows of a bound-sized activation
"""
