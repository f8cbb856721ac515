"""LaunchMemo (harness/kernels/relaunch.py) with a fake kernel: what it remembers, when it
hits, and the argument list it hands the compiled kernel's launcher. The real launches are in
tests/test_kernels_gpu.py (test_remembered_launches_equal_triton_launches)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from harness.kernels import relaunch as rl


class _Compiled:
    function, packed_metadata = "fn", "meta"

    def __init__(self):
        self.calls = []

    def run(self, *args):
        self.calls.append(args)


class _Kernel:
    """A JIT function's surface: arg_names and the binder in device_caches[dev][4]."""

    arg_names = ["x", "target", "N", "BLOCK"]

    def __init__(self):
        def binder(x, target, N=7, BLOCK=16, **options):
            return {"x": x, "target": target, "N": N, "BLOCK": BLOCK}, None, options

        self.device_caches = {0: (None, None, None, None, binder)}


@pytest.fixture
def fake_device(monkeypatch):
    active = SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda d: 99)
    monkeypatch.setattr(rl, "driver", SimpleNamespace(active=active))
    monkeypatch.setattr(rl.torch.cuda, "current_device", lambda: 0)


def test_memo_relaunches_the_bound_arguments_with_the_volatile_ones(fake_device):
    memo, c = rl.LaunchMemo(), _Compiled()
    assert not memo.hit("k")  # nothing remembered
    memo.remember("k", _Kernel(), (4,), ("X", 32), {"BLOCK": 64, "num_warps": 4}, c)
    assert memo.hit("k") and not memo.hit("other")
    assert memo.launch(target=48) is c
    # grid padded to 3-D, the stream, no launch metadata or hooks, every argument in order
    assert c.calls[-1] == (4, 1, 1, 99, "fn", "meta", None, None, None, "X", 48, 7, 64)
    memo.launch()
    assert c.calls[-1][-3] == 48  # a volatile value stays until the next one is given
    with pytest.raises(ValueError, match="int32"):
        memo.launch(target=2**31)
    memo.forget()
    assert not memo.hit("k")


def test_memo_never_hits_with_a_launch_hook_or_without_a_compiled_kernel(fake_device, monkeypatch):
    memo = rl.LaunchMemo()
    memo.remember("k", _Kernel(), (2, 3), ("X", 1), {}, _Compiled())
    assert memo.grid == (2, 3, 1) and memo.hit("k")
    hooks = rl.knobs.runtime.launch_enter_hook
    if hasattr(hooks, "calls"):  # Triton 3.6: a HookChain, empty unless a profiler adds one
        monkeypatch.setattr(hooks, "calls", [lambda *a: None])
    else:
        monkeypatch.setattr(rl.knobs.runtime, "launch_enter_hook", lambda *a: None)
    assert rl.launch_hooked() and not memo.hit("k")
    monkeypatch.undo()
    memo.remember("k2", _Kernel(), (1,), ("X", 1), {}, None)  # e.g. the CPU interpreter
    assert not memo.hit("k2") and not memo.hit("k")


def test_the_consumer_target_is_not_specialised():
    """The memo swaps ready_target between runs: it must never pick another compile."""
    from systems.overlap.kernels.consumer import _consumer_kernel

    params = getattr(_consumer_kernel, "params", None)
    if params is None:  # the CPU interpreter's wrapper keeps the decorator's arguments
        assert "ready_target" in _consumer_kernel.kwargs["do_not_specialize"]
    else:
        assert {p.name: p for p in params}["ready_target"].do_not_specialize


def test_a_volatile_tensor_replaces_the_remembered_one_if_triton_would_bind_it_alike(fake_device):
    """Inputs made anew every step (a layer's dispatch) relaunch with their new tensors; a
    tensor Triton would specialise differently (dtype, 16-byte alignment) is refused."""
    import torch

    memo, c = rl.LaunchMemo(), _Compiled()
    base = torch.zeros(64, dtype=torch.int64)
    memo.remember("k", _Kernel(), (1,), (base[:8], 5), {}, c)
    new = torch.ones(8, dtype=torch.int64)
    memo.launch(x=new)
    assert c.calls[-1][9] is new
    with pytest.raises(ValueError, match="dtype, device or alignment"):
        memo.launch(x=new.to(torch.int32))
    with pytest.raises(ValueError, match="dtype, device or alignment"):
        memo.launch(x=base[1:9])  # 8-byte offset: another pointer specialisation


class _Recorder:
    """Stands for Triton's C launch function (a builtin: no __code__); records its calls."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


class _CudaLauncher:
    """Triton 3.6's CudaLauncher surface: `launch` (its wrapper that encodes host TMA
    descriptors, around the C function) called with the scratch and flag arguments."""

    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid, launch_pdl = False, True

    def __init__(self, signature):
        from triton.backends.nvidia.driver import wrap_handle_tensordesc

        self.raw = _Recorder()
        self.launch = wrap_handle_tensordesc(self.raw, signature, None)

    def __call__(self, gx, gy, gz, stream, function, *args):
        self.launch(gx, gy, gz, stream, function, False, True, None, None, *args)


class _DescKernel:
    arg_names = ["x", "x_desc", "target", "BLOCK"]

    def __init__(self):
        def binder(x, x_desc, target, BLOCK=16, **options):
            return {"x": x, "x_desc": x_desc, "target": target, "BLOCK": BLOCK}, None, options

        self.device_caches = {0: (None, None, None, None, binder)}


def _addresses(args):
    import torch

    return tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)


def test_the_fast_path_hands_the_c_launcher_what_triton_would(fake_device, monkeypatch):
    """Resolved once (addresses, encoded descriptors), then re-run straight through the C
    launcher: the same argument list Triton's own launcher path builds, call after call, with
    volatile tensors and descriptors swapped in."""
    import torch
    from triton.tools.tensor_descriptor import TensorDescriptor

    sig = {0: "*bf16", 1: "tensordesc<bf16[16, 16]>", 2: "i32", 3: "constexpr"}
    c = _Compiled()
    c.run = _CudaLauncher(sig)
    raw = c.run.raw
    x = torch.zeros(64, 32, dtype=torch.bfloat16)

    def desc(t):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), [16, 16])

    memo = rl.LaunchMemo()
    memo.remember("k", _DescKernel(), (3,), (x, desc(x), 5), {"BLOCK": 64}, c)
    assert memo.raw is raw and memo.holds("x", x)

    def both(**volatile):
        memo.launch(**volatile)
        fast = raw.calls[-1]
        monkeypatch.setattr(rl, "FAST", False)
        memo.launch()
        monkeypatch.setattr(rl, "FAST", True)
        slow = _addresses(raw.calls[-1])
        assert fast == slow and all(not isinstance(a, torch.Tensor) for a in fast)
        return fast

    first = both()
    assert first[:9] == (3, 1, 1, 99, "fn", False, True, None, None)
    assert first[13] == x.data_ptr() and first[14] == x.data_ptr()  # x, then the descriptor
    x2 = torch.ones(128, 32, dtype=torch.bfloat16)
    second = both(x=x2, x_desc=desc(x2), target=7)
    assert second[13] == x2.data_ptr() and second[15:17] == (128, 32) and second[-2] == 7
    assert len(second) == len(first)
    assert both(x_desc=desc(x2)) == second  # the same five: the last encoding again


def test_the_fast_path_steps_aside_where_the_launcher_is_not_the_known_shape(fake_device):
    """Scratch memory to allocate per launch, or a launcher this code does not know: the
    memo re-runs through CompiledKernel.run with the bound arguments."""
    sig = {0: "*bf16", 1: "i32", 2: "i32", 3: "constexpr"}
    scratch = _CudaLauncher(sig)
    scratch.global_scratch_size = 256
    assert rl.c_launcher(SimpleNamespace(run=scratch)) is None
    other = _CudaLauncher(sig)
    other.launch = lambda *a: None  # a Python wrapper with no known closure
    assert rl.c_launcher(SimpleNamespace(run=other)) is None
    plain = _CudaLauncher(sig)
    plain.launch = plain.raw  # no descriptors: Triton keeps the C function itself
    assert rl.c_launcher(SimpleNamespace(run=plain)) == (plain.raw, {})


class _CachedKernel(_Kernel):
    """A JIT function launched as kernel[grid](...): counts Triton-path launches."""

    arg_names = ["x", "out", "R", "N", "BLOCK"]

    def __init__(self, compiled):
        def binder(x, out, R, N, BLOCK=16, **options):
            return {"x": x, "out": out, "R": R, "N": N, "BLOCK": BLOCK}, None, options

        self.device_caches = {0: (None, None, None, None, binder)}
        self.compiled, self.triton_launches = compiled, 0

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.triton_launches += 1
            return self.compiled

        return run


def test_launch_cached_relaunches_new_tensors_and_holds_none(fake_device, monkeypatch):
    """The dispatch's and the scale's launches: new tensors every step, relaunched through the
    fast path when they bind alike; the cache keeps no tensor alive; another kind, another
    non-volatile int or CPU tensors go through Triton."""
    import gc
    import weakref

    import torch

    rl._CACHED.clear()
    c = _Compiled()
    c.run = _CudaLauncher({0: "*i64", 1: "*i64", 2: "i32", 3: "i32", 4: "constexpr"})
    k = _CachedKernel(c)
    x, out = torch.zeros(32, dtype=torch.int64), torch.zeros(32, dtype=torch.int64)
    assert rl.launch_cached(k, (2,), (x, out, 5, 8), {"BLOCK": 64}, ints=("R",)) is c
    assert k.triton_launches == 1 and not rl._CACHED  # CPU tensors: Triton's path, not kept
    monkeypatch.setattr(rl, "_on_gpu", lambda t: True)
    rl.launch_cached(k, (2,), (x, out, 5, 8), {"BLOCK": 64}, ints=("R",))
    assert k.triton_launches == 2 and len(rl._CACHED) == 1
    x2, out2 = torch.ones(32, dtype=torch.int64), torch.ones(32, dtype=torch.int64)
    rl.launch_cached(k, (2,), (x2, out2, 9, 8), {"BLOCK": 64}, ints=("R",))
    assert k.triton_launches == 2  # remembered: straight to the C launcher
    assert c.run.raw.calls[-1][13:] == (x2.data_ptr(), out2.data_ptr(), 9, 8, 64)
    gone = weakref.ref(x2)
    del x2
    gc.collect()
    assert gone() is None  # the memo holds no tensor between calls
    rl.launch_cached(k, (2,), (x, out, 9, 16), {"BLOCK": 64}, ints=("R",))  # N: not volatile
    rl.launch_cached(k, (2,), (x[1:], out, 9, 8), {"BLOCK": 64}, ints=("R",))  # 8-byte offset
    rl.launch_cached(k, (2,), (x, out, 9, 8), {"BLOCK": 32}, ints=("R",))  # another constexpr
    assert k.triton_launches == 5 and len(rl._CACHED) == 4
    rl._CACHED.clear()


def test_host_int_helpers_equal_tritons():
    """harness/kernels/ints.py stands in for triton.cdiv / next_power_of_2 on the host."""
    import triton

    from harness.kernels.ints import cdiv, next_power_of_2

    for n in [*range(0, 1100), 4095, 4096, 4097, 2**20 + 1]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        assert all(cdiv(n, b) == triton.cdiv(n, b) for b in (1, 3, 16, 128, 1024)), n
