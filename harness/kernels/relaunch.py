"""A remembered Triton launch, launched again without Triton's per-call host work.

Triton binds and specialises every argument on every launch, and our launchers check operands
and build TMA descriptors: several times the compiled launcher's own host time
(docs/measurements.md). A runner makes the same launches every step, so a LaunchMemo remembers
one and re-runs the compiled kernel: on the fast path straight through Triton's C launcher, each
tensor resolved to its address and each host TMA descriptor encoded; where the launcher has
another shape (scratch memory, an unknown wrapper) or FAST is False, through CompiledKernel.run.

The caller owns the key: it must differ whenever any argument but the `volatile` ones would. The
memo holds its arguments (their memory stays allocated, their addresses unique) unless released.
A volatile int must be declared do_not_specialize and keep its integer width; a volatile tensor
must keep its dtype, device and 16-byte alignment, all Triton specialises a pointer on (launch()
checks them). While a Triton launch hook is set (a profiler), every launch takes Triton's path.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from triton import knobs
from triton.runtime import driver

_I32 = (-(2**31), 2**31 - 1)

# the fast path (resolved arguments straight to the C launcher); HARNESS_RELAUNCH=bound turns
# it off, so the two paths' host time can be compared on the same build
FAST = os.environ.get("HARNESS_RELAUNCH", "fast") != "bound"


def launch_hooked() -> bool:
    """A Triton launch hook is set (Triton 3.6 keeps them in HookChains, empty by default)."""
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(h is not None and bool(getattr(h, "calls", True)) for h in hooks)


def c_launcher(compiled: Any) -> tuple[Any, dict[int, Any]] | None:
    """(the C launch function, {bound index: TMA descriptor metadata}), or None where the
    launcher is not a shape this fast path knows (Triton 3.6's CudaLauncher: a C `launch`, or
    the wrapper encoding host TMA descriptors; no global or profile scratch memory)."""
    run = compiled.run
    if getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
        return None
    launch = getattr(run, "launch", None)
    code = getattr(launch, "__code__", None)
    if launch is None:
        return None
    if code is None:  # the C function itself: no descriptor arguments
        return launch, {}
    cells = dict(zip(code.co_freevars, launch.__closure__ or ()))
    try:
        raw = cells["launcher"].cell_contents
        indices = sorted(cells["tensordesc_indices"].cell_contents)
        meta = cells["tensordesc_meta"].cell_contents
    except (KeyError, ValueError):  # another wrapper, or an empty cell
        return None
    if getattr(raw, "__code__", None) is not None:  # not the C function: unknown nesting
        return None
    meta = list(meta) if meta else [None] * len(indices)
    return raw, dict(zip(indices, meta))


class _Released:
    """What a released tensor argument leaves in a memo: what Triton bound it on."""

    __slots__ = ("dtype", "device", "aligned")

    def __init__(self, t: torch.Tensor) -> None:
        self.dtype, self.device, self.aligned = t.dtype, t.device, t.data_ptr() % 16 == 0


def _binds_alike(old: Any, value: torch.Tensor) -> bool:
    """A new tensor Triton would bind as the remembered one (dtype, device, 16-byte alignment)."""
    if isinstance(old, torch.Tensor):
        aligned = old.data_ptr() % 16 == 0
    elif isinstance(old, _Released):
        aligned = old.aligned
    else:
        return False
    new = (value.dtype, value.device, value.data_ptr() % 16 == 0)
    return new == (old.dtype, old.device, aligned)


class LaunchMemo:
    """One remembered launch of one Triton kernel (see the module docstring)."""

    def __init__(self) -> None:
        self.key: Any = None
        self.compiled: Any = None
        self.bound: list[Any] = []
        self.grid: tuple[int, int, int] = (1, 1, 1)
        self.index: dict[str, int] = {}
        self.raw: Any = None  # the C launcher (fast path), else None
        self.final: list[Any] = []  # its resolved argument list
        self.at: list[int] = []  # bound index -> position in final
        self.desc_meta: dict[int, Any] = {}  # bound index -> TMA descriptor metadata
        self.head: tuple = ()  # the launcher's flags: cooperative grid, PDL
        self.released = False  # release() dropped the tensors: the fast path only
        self.desc_last: dict[int, tuple] = {}  # bound index -> (descriptor key, its encoding)

    def hit(self, key: Any) -> bool:
        """The remembered launch is the one `key` names (and no launch hook is set)."""
        return self.compiled is not None and key == self.key and not launch_hooked()

    def holds(self, name: str, value: Any) -> bool:
        """The remembered launch already has this very object as argument `name`."""
        return self.bound[self.index[name]] is value

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
        self.raw, self.released = None, False
        found = c_launcher(compiled) if FAST else None
        if found is not None:
            self.raw, self.desc_meta = found
            self.desc_last = {}
            run = compiled.run
            self.head = (bool(run.launch_cooperative_grid), bool(run.launch_pdl))
            self.final, self.at = [], []
            for i, a in enumerate(self.bound):
                self.at.append(len(self.final))
                self.final.extend(self._resolve(i, a))

    def _resolve(self, i: int, a: Any) -> list[Any]:
        """The C launcher's arguments for bound argument i (a list: a descriptor is several)."""
        if i in self.desc_meta:
            # a descriptor is encoded from its base address, shape, strides and block: the same
            # five (e.g. a new x where the old one was freed) reuse the last encoding
            k = (a.base.data_ptr(), *a.shape, *a.strides, *a.block_shape, a.padding)
            last = self.desc_last.get(i)
            if last is not None and last[0] == k:
                return last[1]
            from triton.backends.nvidia.driver import make_tensordesc_arg

            r = [
                v.data_ptr() if isinstance(v, torch.Tensor) else v
                for v in make_tensordesc_arg(a, self.desc_meta[i])
            ]
            self.desc_last[i] = (k, r)
            return r
        return [a.data_ptr() if isinstance(a, torch.Tensor) else a]

    def forget(self) -> None:
        self.key, self.compiled, self.bound, self.raw, self.final = None, None, [], None, []

    def release(self) -> bool:
        """Drop the memo's references to its tensor arguments (their memory may be freed), so
        every later launch must pass each tensor argument as volatile. Only on the fast path
        (the resolved list holds addresses, no tensors): False and nothing dropped otherwise."""
        if self.raw is None:
            return False
        self.bound = [_Released(a) if isinstance(a, torch.Tensor) else a for a in self.bound]
        self.released = True
        return True

    def launch(self, **volatile: Any) -> Any:
        """Re-run the remembered launch on the current stream, with the named volatile ints,
        tensors (or other arguments of the remembered kinds, e.g. a TMA descriptor over a new
        tensor) in place of the remembered ones."""
        for name, value in volatile.items():
            i = self.index[name]
            if isinstance(value, torch.Tensor):
                if not _binds_alike(self.bound[i], value):
                    raise ValueError(f"relaunch: {name} changed dtype, device or alignment")
            elif not isinstance(value, int) or isinstance(value, bool):
                if type(value) is not type(self.bound[i]):  # e.g. a TMA descriptor, or None
                    raise ValueError(f"relaunch: {name} changed its kind of argument")
            elif not _I32[0] <= value <= _I32[1]:
                raise ValueError(f"relaunch: {name}={value} does not fit int32")
            if not (self.released and isinstance(value, torch.Tensor)):  # released: keep none
                self.bound[i] = value
            if self.raw is not None:
                r = self._resolve(i, value)
                self.final[self.at[i] : self.at[i] + len(r)] = r
        c, g = self.compiled, self.grid
        stream = driver.active.get_current_stream(torch.cuda.current_device())
        if self.raw is not None and (FAST or self.released):
            lead = (*g, stream, c.function, *self.head, None, None, c.packed_metadata)
            self.raw(*lead, None, None, None, *self.final)
            return c
        c.run(*g, stream, c.function, c.packed_metadata, None, None, None, *self.bound)
        return c


def _on_gpu(t: torch.Tensor) -> bool:
    return t.is_cuda


#: launch_cached's memos, one per (kernel, grid, argument signature), oldest first
_CACHED: dict[tuple, LaunchMemo] = {}
CACHED_MAX = 64


def launch_cached(kernel: Any, grid: tuple, args: tuple, kwargs: dict, ints: tuple = ()) -> Any:
    """kernel[grid](*args, **kwargs), remembered: the same kernel, grid, non-tensor arguments
    and tensor kinds (dtype, device, 16-byte alignment) relaunch the remembered compile with
    these tensors and the `ints` (declared do_not_specialize) swapped in, holding no tensor
    between calls. CPU tensors (the interpreter) and a set launch hook take Triton's path."""
    sig: list[Any] = []
    volatile: dict[str, Any] = {}
    cuda = False
    for name, a in zip(kernel.arg_names, args):
        if isinstance(a, torch.Tensor):
            cuda = cuda or _on_gpu(a)
            sig.append((a.dtype, a.device, a.data_ptr() % 16 == 0))
            volatile[name] = a
        elif name in ints:
            volatile[name] = a
        else:
            sig.append(a)
    if not cuda:
        return kernel[grid](*args, **kwargs)
    key = (kernel, grid, tuple(sig), tuple(kwargs.items()))
    memo = _CACHED.get(key)
    if memo is not None and memo.hit(key):
        return memo.launch(**volatile)
    compiled = kernel[grid](*args, **kwargs)
    memo = _CACHED.pop(key, None) or LaunchMemo()
    memo.remember(key, kernel, grid, args, kwargs, compiled)
    if memo.release():  # the slow path would hold this call's tensors: not kept then
        _CACHED[key] = memo
        while len(_CACHED) > CACHED_MAX:
            _CACHED.pop(next(iter(_CACHED)))
    return compiled
