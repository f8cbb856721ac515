"""A remembered Triton launch, launched again without Triton's per-call host work.

Triton binds and specialises every argument on every launch, then our launchers check their
operands and build TMA descriptors: 35-70 us of host time per launch on the H200 machine, where
the compiled kernel's own launcher takes 9-12 us (benchmarks/host_profile.py --launches). A
runner launches the same kernels with the same arguments on every step (only the consumer's
epoch target changes), so it remembers each launch once and then re-runs the compiled kernel
(CompiledKernel.run) with the remembered argument list.

The caller owns the key: it must differ whenever any argument but the `volatile` ones would
differ (another tensor or shape, another plan, another flag). The memo holds the remembered
arguments, so their memory stays allocated (and their addresses unique) while it is remembered.
A volatile int must be declared do_not_specialize in its kernel (so its value never picks
another compiled variant) and must keep its integer width. A volatile tensor (an input made anew
on every step) must keep its dtype, device and 16-byte alignment, the only things Triton
specialises a pointer on: the caller's key should hold them, launch() checks them. While a
Triton launch hook is set (a profiler), every launch takes Triton's own path.
"""

from __future__ import annotations

from typing import Any

import torch
from triton import knobs
from triton.runtime import driver

_I32 = (-(2**31), 2**31 - 1)


def launch_hooked() -> bool:
    """A Triton launch hook is set (Triton 3.6 keeps them in HookChains, empty by default)."""
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(h is not None and bool(getattr(h, "calls", True)) for h in hooks)


class LaunchMemo:
    """One remembered launch of one Triton kernel (see the module docstring)."""

    def __init__(self) -> None:
        self.key: Any = None
        self.compiled: Any = None
        self.bound: list[Any] = []
        self.grid: tuple[int, int, int] = (1, 1, 1)
        self.index: dict[str, int] = {}

    def hit(self, key: Any) -> bool:
        """The remembered launch is the one `key` names (and no launch hook is set)."""
        return self.compiled is not None and key == self.key and not launch_hooked()

    def remember(
        self, key: Any, kernel: Any, grid: tuple, args: tuple, kwargs: dict, compiled: Any
    ) -> None:
        """Keep the launch kernel[grid](*args, **kwargs) that returned `compiled` under `key`."""
        if compiled is None or not hasattr(compiled, "run"):
            self.forget()
            return
        dev = driver.active.get_current_device()
        binder = kernel.device_caches[dev][4]
        self.bound = list(binder(*args, **kwargs)[0].values())
        self.index = {name: i for i, name in enumerate(kernel.arg_names)}
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.key, self.compiled = key, compiled

    def forget(self) -> None:
        self.key, self.compiled, self.bound = None, None, []

    def launch(self, **volatile: Any) -> Any:
        """Re-run the remembered launch on the current stream, with the named volatile ints,
        tensors (or other arguments of the remembered kinds, e.g. a TMA descriptor over a new
        tensor) in place of the remembered ones."""
        for name, value in volatile.items():
            i = self.index[name]
            if isinstance(value, torch.Tensor):
                old = self.bound[i]
                if not (
                    isinstance(old, torch.Tensor)
                    and value.dtype == old.dtype
                    and value.device == old.device
                    and (value.data_ptr() % 16 == 0) == (old.data_ptr() % 16 == 0)
                ):
                    raise ValueError(f"relaunch: {name} changed dtype, device or alignment")
            elif not isinstance(value, int) or isinstance(value, bool):
                if type(value) is not type(self.bound[i]):  # e.g. a TMA descriptor, or None
                    raise ValueError(f"relaunch: {name} changed its kind of argument")
            elif not _I32[0] <= value <= _I32[1]:
                raise ValueError(f"relaunch: {name}={value} does not fit int32")
            self.bound[i] = value
        c, g = self.compiled, self.grid
        stream = driver.active.get_current_stream(torch.cuda.current_device())
        c.run(
            g[0], g[1], g[2], stream, c.function, c.packed_metadata, None, None, None, *self.bound
        )
        return c
