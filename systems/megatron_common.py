"""Shared glue for the Megatron-core baselines (megatron-core 0.16.1), imported only at setup.

Megatron's real MoELayer and MoEAlltoAllTokenDispatcher run unchanged, fed the harness routing by
the router stub `FixedRouter` (so the dispatched rows equal x_recv). Operator cells
(`MegatronOperator`; experts `single_gemm_experts_cls`: ONE GEMM Y_e = X_e @ B_e, then x probs)
are timed from the dispatched rows: experts, combine all-to-all, unpermute -> [T, N]. Layer cells
(ffn = F > 0, `MegatronLayer`): Megatron's experts as its specs build them, timed as
layer(x [T, 1, H]) -> [T, H]; probs apply after the activation (F.gelu, erf form).

Capacity (layer cells): "dropless" reads the counts on the host (token_dispatcher.py
_maybe_dtoh_and_synchronize), so its step cannot be captured. "padded" is Megatron's drop-and-pad
route at the smallest capacity factor that drops nothing (`no_drop_capacity`): counts become host
constants, every expert computes W * capacity rows.
"""

from __future__ import annotations

import contextlib
import glob
import os
import warnings
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from harness.experts import device_offsets, expert_gemm, expert_gemm_impl
from harness.routing import owner_expert_counts
from harness.workload import WorkloadSpec, routing_of
from systems import package_version


def mcore_version() -> str:
    return package_version("megatron-core", "unknown")


def loaded_library_dir(prefix: str, maps: str | None = None) -> str | None:
    """The folder of the first shared object mapped into this process whose file name starts
    with `prefix` (e.g. "libcudnn.so"), read from /proc/self/maps (or the text `maps`)."""
    if maps is None:
        try:
            with open("/proc/self/maps") as f:
                maps = f.read()
        except OSError:
            return None
    for line in maps.splitlines():
        path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
        if path.startswith("/") and os.path.basename(path).startswith(prefix):
            return os.path.dirname(path)
    return None


#: cuDNN 9's libraries in load order (each may need those before it)
CUDNN_LIBS = (
    "libcudnn.so",
    "libcudnn_graph.so",
    "libcudnn_engines_precompiled.so",
    "libcudnn_engines_runtime_compiled.so",
    "libcudnn_heuristic.so",
    "libcudnn_ops.so",
    "libcudnn_cnn.so",
    "libcudnn_adv.so",
)


def pin_cudnn_to_torch() -> str | None:
    """Load every cuDNN library from the folder of the one torch loaded, before Transformer
    Engine looks for cuDNN, and point TE's loader there (CUDNN_HOME; one already set, or
    CUDNN_PATH, wins). Returns the folder, or None. Why: with two cuDNN copies (the H200 image:
    /lib/x86_64-linux-gnu and torch's wheel) a later load by name picks the other copy's
    libcudnn_heuristic.so.9 beside torch's libcudnn_graph: "undefined symbol ..., version
    libcudnn_graph.so.9"."""
    import ctypes

    env = os.environ.get("CUDNN_HOME") or os.environ.get("CUDNN_PATH")
    if env or not torch.backends.cudnn.is_available():
        return None
    torch.backends.cudnn.version()  # maps torch's libcudnn into the process
    folder = loaded_library_dir("libcudnn_graph.so") or loaded_library_dir("libcudnn.so")
    if not folder:
        return None
    for name in CUDNN_LIBS:
        for path in sorted(glob.glob(os.path.join(folder, name + ".[0-9]*")))[:1]:
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError as e:  # a library this cuDNN build lacks or cannot load here
                warnings.warn(f"pin_cudnn_to_torch: {path}: {e}", stacklevel=2)
    os.environ["CUDNN_HOME"] = folder
    return folder


def ensure_parallel_state(world_size: int) -> None:
    """Initialise Megatron's parallel state once: EP = world_size, TP = PP = CP = 1."""
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialised before Megatron")
    if dist.get_world_size() != world_size:
        raise ValueError(f"Megatron EP size {world_size} != process world {dist.get_world_size()}")
    if ps.model_parallel_is_initialized():
        have = ps.get_expert_model_parallel_world_size()
        if have != world_size:
            raise RuntimeError(
                f"Megatron parallel state has EP={have}, this cell needs {world_size}"
            )
        return
    ps.initialize_model_parallel(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        expert_model_parallel_size=world_size,
        create_gloo_process_groups=False,
    )


def fused_permute_available() -> bool:
    """Does megatron-core find TE's fused permute / unpermute (moe_permute_fusion; TE >= 2.1)?"""
    try:
        from megatron.core.transformer.moe import moe_utils
    except Exception:  # noqa: BLE001 - megatron missing or broken: no fusion
        return False
    names = ("fused_permute", "fused_permute_with_probs", "fused_unpermute")
    return all(getattr(moe_utils, n, None) is not None for n in names)


def resolve_permute_fusion(value: Any) -> bool:
    """The `permute_fusion` param: "auto" (fused where TE provides it, as Megatron users run
    it), or a bool; True without TE's kernels is an error."""
    if value == "auto":
        return fused_permute_available()
    if not isinstance(value, bool):
        raise ValueError(f"permute_fusion must be 'auto', true or false, got {value!r}")
    if value and not fused_permute_available():
        raise ValueError("permute_fusion=true needs Transformer Engine's fused permute (TE >= 2.1)")
    return value


def transformer_config(spec: WorkloadSpec, **overrides: Any):
    """Megatron's TransformerConfig for one cell (`overrides` win): moe_ffn_hidden_size N, or F
    in layer cells; dropless all-to-all dispatcher; weights on the CPU without init (copied in)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    dt, width = spec.torch_dtype, spec.ffn or spec.out
    kw: dict[str, Any] = dict(num_layers=1, hidden_size=spec.hidden, num_attention_heads=1)
    kw |= dict(ffn_hidden_size=width, moe_ffn_hidden_size=width)
    kw |= dict(activation_func=torch.nn.functional.gelu, num_moe_experts=spec.n_experts)
    kw |= dict(moe_router_topk=spec.top_k, expert_model_parallel_size=spec.world_size)
    kw |= dict(moe_token_dispatcher_type="alltoall", moe_expert_capacity_factor=None)
    kw |= dict(moe_pad_expert_input_to_capacity=False, moe_permute_fusion=False)
    kw |= dict(moe_grouped_gemm=True, moe_router_dtype="fp32")
    kw |= dict(add_bias_linear=False, gated_linear_unit=False, params_dtype=dt)
    kw |= dict(bf16=dt == torch.bfloat16, fp16=dt == torch.float16)
    kw |= dict(use_cpu_initialization=True, perform_initialization=False)
    return TransformerConfig(**(kw | overrides))


def megatron_capacity(spec: WorkloadSpec, factor: float) -> int:
    """Megatron's expert capacity for a cell (moe_utils.get_capacity, as its router and its
    dispatcher compute it): rows each rank sends each expert, ceil(T*k/G * factor)."""
    from megatron.core.transformer.moe.moe_utils import get_capacity

    return get_capacity(spec.tokens_per_rank * spec.top_k, spec.n_experts, factor)


def capacity_factor_for(spec: WorkloadSpec, capacity: int) -> float:
    """A capacity factor f with megatron_capacity(spec, f) == capacity (capacity >= 1): the
    quotient capacity / (T*k/G), moved by a few ulps where the float product rounds across
    an integer."""
    import math

    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    f = capacity * spec.n_experts / (spec.tokens_per_rank * spec.top_k)
    for _ in range(64):
        got = megatron_capacity(spec, f)
        if got == capacity:
            return f
        f = math.nextafter(f, math.inf if got < capacity else 0.0)
    raise RuntimeError(f"no capacity factor gives capacity {capacity} (T*k/G rounding)")


def no_drop_capacity(spec: WorkloadSpec) -> tuple[int, float]:
    """(capacity, factor): the smallest capacity that drops no token of the cell's routing
    (the most tokens any rank routes to any one expert; Megatron's capacity is per source
    rank and expert) and a factor that gives it. Host work on the seeded routing [W, T, k]."""
    capacity = int(owner_expert_counts(routing_of(spec).expert_ids, spec.experts_per_rank).max())
    return capacity, capacity_factor_for(spec, capacity)


def grouped_fc1_layout(weights: torch.Tensor) -> torch.Tensor:
    """Our weights [E, K, N] -> GroupedMLP weight1 [K, E*N], the flat [E, K, N] data: GroupedMLP
    reads weight1.view(E, K, N), a reinterpretation of the same memory."""
    return weights.contiguous().view(weights.shape[1], -1)


def copy_te_weights(linear: torch.nn.Module, weights: torch.Tensor) -> None:
    """Copy B [E, K, N] into a TE GroupedLinear's weight{e} [N, K] = B_e^T (y = x W^T), checked."""
    for e, w in enumerate(weights.transpose(1, 2)):
        p = getattr(linear, f"weight{e}")
        if tuple(p.shape) != tuple(w.shape):
            raise ValueError(f"weight{e} has shape {tuple(p.shape)}, expected {tuple(w.shape)}")
        with torch.no_grad():
            p.copy_(w)


def grouped_mlp_layout(w1: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W1 [E, H, F], W2 [E, F, H] -> GroupedMLP weight1 [H, E*F], weight2 [E*F, H]: flat copies
    (as grouped_fc1_layout; weight1 is NOT [W1_0 | W1_1 | ...] side by side)."""
    E, H, F = w1.shape
    if tuple(w2.shape) != (E, F, H):
        raise ValueError(f"W2 has shape {tuple(w2.shape)}, expected {(E, F, H)}")
    return w1.contiguous().view(H, E * F), w2.contiguous().view(E * F, H)


def copy_mlp_weights(experts: torch.nn.Module, w1: torch.Tensor, w2: torch.Tensor) -> None:
    """Copy W1 [E, H, F] and W2 [E, F, H] into Megatron's GroupedMLP (weight1, weight2) or
    TEGroupedMLP (linear_fc1 weight{e} [F, H] = W1_e^T, linear_fc2 weight{e} [H, F] = W2_e^T),
    on the parameters' device."""
    if hasattr(experts, "weight1"):
        for p, w in zip((experts.weight1, experts.weight2), grouped_mlp_layout(w1, w2)):
            if tuple(p.shape) != tuple(w.shape):
                raise ValueError(f"GroupedMLP weight {tuple(p.shape)}, expected {tuple(w.shape)}")
            with torch.no_grad():
                p.copy_(w)
        return
    copy_te_weights(experts.linear_fc1, w1)
    copy_te_weights(experts.linear_fc2, w2)


def apply_probs(y: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Megatron's activation_func_with_probs with the identity: (y * probs[:, None]).to(y)."""
    return (y * probs.unsqueeze(-1)).to(y.dtype)


def gemm_backend(x: torch.Tensor, w: torch.Tensor) -> str:
    """Which grouped GEMM single_gemm_experts_cls() runs for these operands."""
    from megatron.core.transformer.moe import grouped_gemm_util as gg

    if gg.grouped_gemm_is_available() and x.is_cuda and x.dtype == torch.bfloat16:
        return "grouped_gemm.gmm"
    return expert_gemm_impl(x, w)


def topk_to_dense(
    expert_ids: torch.Tensor, gate: torch.Tensor, n_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """expert_ids [T, k], gate [T, k] -> Megatron's router output: probs [T, G] f32 (the gate
    weight at each chosen expert, 0 elsewhere) and routing_map [T, G] bool (TopKRouter's scatter
    after its top-k)."""
    T, dev = expert_ids.shape[0], expert_ids.device
    probs = torch.zeros(T, n_experts, dtype=torch.float32, device=dev)
    probs.scatter_(1, expert_ids, gate.float())
    rmap = torch.zeros(T, n_experts, dtype=torch.bool, device=dev).scatter_(1, expert_ids, True)
    return probs, rmap


class FixedRouter(torch.nn.Module):
    """Router stub: forward(hidden, padding_mask) -> probs [T, G] f32, routing_map [T, G] bool of
    the routing set by set_topk. Where the config sets moe_expert_capacity_factor, they then go
    through Megatron's apply_router_token_dropping as TopKRouter.routing sends its top-k
    (probs zero where dropped or padded, `capacity` map entries per expert when padded)."""

    def __init__(self, config: Any = None, pg_collection: Any = None) -> None:
        super().__init__()
        self.config = config
        self.topk: tuple[torch.Tensor, torch.Tensor, int] | None = None

    def set_topk(self, expert_ids: torch.Tensor, gate: torch.Tensor, n_experts: int) -> None:
        """Route from expert_ids [T, k] and gate [T, k] f32 on every forward."""
        self.topk = (expert_ids, gate.float(), n_experts)

    def forward(self, hidden: torch.Tensor, padding_mask: Any = None):
        tokens = hidden.numel() // hidden.shape[-1]
        if self.topk is None or self.topk[0].shape[0] != tokens:
            raise RuntimeError("FixedRouter: set_topk() for this input first")
        return self.token_dropping(*topk_to_dense(*self.topk))

    def token_dropping(
        self, probs: torch.Tensor, routing_map: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """TopKRouter.routing's capacity step (a no-op without a capacity factor)."""
        cfg = self.config
        if cfg is None or cfg.moe_expert_capacity_factor is None:
            return probs, routing_map
        from megatron.core.transformer.moe.moe_utils import apply_router_token_dropping

        return apply_router_token_dropping(
            probs, routing_map, router_topk=cfg.moe_router_topk,
            capacity_factor=cfg.moe_expert_capacity_factor,
            drop_policy=cfg.moe_token_drop_policy,
            pad_to_capacity=cfg.moe_pad_expert_input_to_capacity,
        )  # fmt: skip

    def set_layer_number(self, layer_number: int) -> None:
        """Called by MoELayer.set_layer_number."""


def single_gemm_experts_cls(te: bool = False) -> type:
    """The operator cells' experts class: one GEMM per expert, then x probs, rows by expert
    [R, K] -> [R, N]. GroupedMLP's fc1 (weight1 [K, E*N], read as [E, K, N]), or with `te`
    TEGroupedMLP's linear_fc1, a TE GroupedLinear (weight{e} [N, K] = B_e^T; needs
    transformer_engine at construction). Built lazily: this module imports without megatron."""
    from megatron.core.transformer.module import MegatronModule

    class SingleGemmExperts(MegatronModule):
        def __init__(self, num_local_experts: int, config: Any, pg_collection: Any = None):
            super().__init__(config=config)
            self.num_local_experts = num_local_experts
            K, N = config.hidden_size, config.moe_ffn_hidden_size
            if te:
                from megatron.core.extensions.transformer_engine import (
                    TEColumnParallelGroupedLinear,
                )

                self.linear_fc1 = TEColumnParallelGroupedLinear(
                    num_local_experts, K, N, config=config, init_method=config.init_method,
                    bias=False, skip_bias_add=False, is_expert=True, tp_comm_buffer_name="fc1",
                    pg_collection=pg_collection,
                )  # fmt: skip
                return
            self.weight1 = torch.nn.Parameter(
                torch.zeros(K, num_local_experts * N, dtype=config.params_dtype),
                requires_grad=False,
            )

        def load_weights(self, weights: torch.Tensor) -> None:
            if te:
                copy_te_weights(self.linear_fc1, weights)
            else:  # weight1 needs no grad
                self.weight1.copy_(grouped_fc1_layout(weights))

        def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
            x = permuted_local_hidden_states
            if te:
                y, _ = self.linear_fc1(x, tokens_per_expert.tolist())
                return apply_probs(y, permuted_probs), None
            w1 = self.weight1.view(self.num_local_experts, self.config.hidden_size, -1)
            if gemm_backend(x, w1) == "grouped_gemm.gmm":
                from megatron.core.transformer.moe import grouped_gemm_util as gg

                y = gg.ops.gmm(x, w1, tokens_per_expert.cpu(), trans_b=False)
            else:
                y = expert_gemm(x, tokens_per_expert.tolist(), w1)
            return apply_probs(y, permuted_probs), None

    return SingleGemmExperts


def te_gemm_name() -> str:
    """The TE experts' grouped GEMM (for `impl`)."""
    import transformer_engine

    return f"TE {getattr(transformer_engine, '__version__', '?')} GroupedLinear"


class _HeldDispatch:
    """A real MoELayer (`layer`, its `dispatcher`) with one dispatch held for the bounds: the
    dispatched rows disp [R, K] and probs disp_probs [R]."""

    def _make_layer(self, spec: WorkloadSpec, submodules: Any, fallback: bool, **config: Any):
        """The MoELayer of this cell's config (inside grouped_gemm_fallback where `fallback`)
        and its parallel state; returns whether the real grouped_gemm package is there."""
        from megatron.core.transformer.moe.moe_layer import MoELayer

        ensure_parallel_state(spec.world_size)
        self.spec = spec
        self.config = transformer_config(spec, **config)
        with grouped_gemm_fallback() if fallback else contextlib.nullcontext() as real_gg:
            layer = MoELayer(self.config, submodules)
        self.layer, self.dispatcher = layer, layer.token_dispatcher
        return real_gg

    def _dispatch_once(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """route, preprocess and dispatch x, the dispatch held -> (preprocessed rows, their
        probs, routing_map [T, G])."""
        with torch.no_grad():
            probs, rmap = self.layer.route(x)
            hidden, probs = self.layer.preprocess(x, probs, rmap)
            self.disp, self.disp_probs = self.layer.dispatch(hidden, probs)
        # the flex dispatcher keeps its counts in its comm manager, set by every dispatch
        self.tokens_per_expert = getattr(self.dispatcher, "tokens_per_expert", None)
        return hidden, probs, rmap

    def experts(self) -> torch.Tensor:
        """routed_experts_compute (dispatch_postprocess + experts + combine_preprocess) on the
        held rows [R, K] -> [R, N] (x probs)."""
        if self.tokens_per_expert is not None:
            self.dispatcher.tokens_per_expert = self.tokens_per_expert
        with torch.no_grad():
            out, _ = self.layer.routed_experts_compute(self.disp, self.disp_probs)
        return out


class MegatronOperator(_HeldDispatch):
    """An operator cell on the real MoELayer (all-to-all dispatcher), run from the dispatched
    rows (module doc), which must equal the harness's x_recv [R, K]. te: TE GroupedLinear
    experts, else GroupedMLP's fc1 (single_gemm_experts_cls)."""

    def __init__(self, inputs: Any, rank: int, te: bool, permute_fusion: bool) -> None:
        from megatron.core.transformer.moe.moe_layer import MoESubmodules

        spec, x = inputs.spec, inputs.x
        submodules = MoESubmodules(experts=single_gemm_experts_cls(te), router=FixedRouter)
        self._make_layer(spec, submodules, False, moe_permute_fusion=permute_fusion)
        self.layer.experts.load_weights(inputs.weights.cpu())
        self.layer = self.layer.to(x.device).eval()
        routing = routing_of(spec)
        ids, gate = routing.expert_ids[rank], routing.gate_weights[rank]
        self.layer.router.set_topk(ids.to(x.device), gate.to(x.device), spec.n_experts)
        self._dispatch_once(x)
        if not torch.equal(self.disp, inputs.x_recv):
            raise RuntimeError("Megatron's dispatched rows differ from the harness's x_recv")
        T, N = spec.tokens_per_rank, spec.out
        self.dispatcher.hidden_shape = torch.Size([T, N])
        self.dispatcher.hidden_shape_before_permute = torch.Size([T, N])
        self.y_expert = self.experts()

    def forward(self) -> torch.Tensor:
        """The timed region: experts, combine, unpermute -> out [T, N]."""
        with torch.no_grad():
            return self.layer.postprocess(self.layer.combine(self.experts()), None)

    def compute_only(self) -> torch.Tensor:
        """The experts on the held dispatched rows -> [R, N] (x probs)."""
        return self.experts()

    def comm_only(self) -> torch.Tensor:
        """The combine all-to-all (EP) of the held expert rows [R, N] -> [S, N]."""
        with torch.no_grad():
            return self.layer.combine(self.y_expert)


# layer scope: the real MoELayer with Megatron's real experts -------------------------------


#: torch._grouped_mm offsets of padded layers, (host counts, device) -> int32 [E] on the device.
#: gmm's signature carries host counts only; a padded layer's counts are fixed per cell, so its
#: offsets are copied once at setup: a copy made inside a captured step would be replayed from
#: a pinned host buffer that may hold other data by then.
_FIXED_OFFS: dict[tuple[tuple[int, ...], str], torch.Tensor] = {}


def fix_gmm_offsets(counts: list[int], device: torch.device) -> None:
    """Make the stand-in gmm use offsets made now for these host counts (padded layers)."""
    key = (tuple(counts), str(device))
    if key not in _FIXED_OFFS:
        _FIXED_OFFS[key] = device_offsets(counts, device)


def _torch_gmm(
    a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool = False
) -> torch.Tensor:
    """grouped_gemm.ops.gmm's contract over torch: a [R, K] rows by expert, b [E, K, N] (or
    [E, N, K] with trans_b), batch_sizes [E] rows per expert (host) -> [R, N]."""
    if trans_b:
        b = b.transpose(1, 2)
    counts = [int(c) for c in batch_sizes.tolist()]
    return expert_gemm(a, counts, b, _FIXED_OFFS.get((tuple(counts), str(a.device))))


#: stands in for the `grouped_gemm` package (its `ops.gmm`) where it is not installed
TORCH_GMM = SimpleNamespace(ops=SimpleNamespace(gmm=_torch_gmm))


@contextlib.contextmanager
def grouped_gemm_fallback() -> Iterator[bool]:
    """Build Megatron's GroupedMLP where the `grouped_gemm` package is absent: install
    TORCH_GMM.ops as grouped_gemm_util.ops (what GroupedMLP.forward calls; left in place, it was
    None) and, while the block runs, as the package its constructor asserts. Yields True where
    the real grouped_gemm package is there (nothing is changed then)."""
    from megatron.core.transformer.moe import grouped_gemm_util as gg

    if gg.grouped_gemm_is_available():
        yield True
        return
    if gg.ops is None:
        gg.ops = TORCH_GMM.ops
    saved = gg.grouped_gemm
    gg.grouped_gemm = TORCH_GMM
    try:
        yield False
    finally:
        gg.grouped_gemm = saved


def layer_experts_spec(experts: str, n_experts: int):
    """The experts of Megatron's own MoE spec (get_moe_module_spec, moe_grouped_gemm=True):
    "grouped" -> legacy GroupedMLP (local spec), "te" -> TEGroupedMLP with
    TEColumnParallelGroupedLinear / TERowParallelGroupedLinear (TE spec; needs TE)."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe.experts import GroupedMLP, TEGroupedMLP

    if experts not in ("grouped", "te"):
        raise ValueError(f"experts must be 'grouped' or 'te', got {experts!r}")
    with warnings.catch_warnings():  # "legacy GroupedMLP will be deprecated"
        warnings.simplefilter("ignore")
        moe = get_moe_module_spec(
            use_te=experts == "te", num_experts=n_experts, moe_grouped_gemm=True
        )
    spec = moe.submodules.experts
    want = TEGroupedMLP if experts == "te" else GroupedMLP
    if spec.module is not want:
        raise RuntimeError(
            f"Megatron's MoE spec gives {spec.module.__name__}, not {want.__name__} "
            "(TEGroupedMLP needs transformer_engine >= 1.7)"
        )
    return spec


class MegatronLayer(_HeldDispatch):
    """A layer cell on one rank (module doc) with W1 [E, H, F] / W2 [E, F, H], timed as layer(x
    [T, 1, H]) -> [T, H]; one forward held for the bounds. capacity_factor (None: dropless) sets
    the drop-and-pad route: `capacity` is then Megatron's rows per (source rank, expert) and
    `dropped` the (token, expert) pairs of the whole cell its map left out (None where dropless).
    config: further TransformerConfig fields (megatron_deepep: the flex dispatcher)."""

    def __init__(
        self,
        inputs: Any,
        experts: str = "grouped",
        permute_fusion: bool = False,
        config: dict[str, Any] | None = None,
        capacity_factor: float | None = None,
    ) -> None:
        from megatron.core.transformer.moe.moe_layer import MoESubmodules

        spec = inputs.spec
        if not spec.ffn:
            raise ValueError("MegatronLayer needs a layer cell (ffn > 0)")
        dev = inputs.x.device
        kw = dict(moe_permute_fusion=permute_fusion, use_cpu_initialization=dev.type != "cuda")
        if capacity_factor is not None:
            kw |= dict(moe_expert_capacity_factor=capacity_factor)
            kw |= dict(moe_pad_expert_input_to_capacity=True)
        submodules = MoESubmodules(
            experts=layer_experts_spec(experts, spec.n_experts), router=FixedRouter
        )
        real_gg = self._make_layer(spec, submodules, experts == "grouped", **(kw | (config or {})))
        layer = self.layer = self.layer.to(dev).eval()
        copy_mlp_weights(layer.experts, inputs.w1, inputs.weights)
        layer.router.set_topk(inputs.expert_ids, inputs.gate, spec.n_experts)
        T, H = spec.tokens_per_rank, spec.hidden
        self.x = inputs.x.view(T, 1, H)  # Megatron's [sequence, batch, hidden]
        self.hidden, self.probs, rmap = self._dispatch_once(self.x)
        self.capacity: int | None = getattr(self.dispatcher, "capacity", None)
        self.dropped = None if capacity_factor is None else self._dropped(rmap)
        if capacity_factor is not None and experts == "grouped" and not real_gg:
            fix_gmm_offsets([int(c) for c in self.tokens_per_expert.tolist()], dev)
        self.y = self.experts()
        with torch.no_grad():
            self.back = layer.combine(self.y)
        self.gemm = self._gemm_name(experts, real_gg)
        self.real_grouped_gemm = bool(real_gg) and experts == "grouped"
        self.experts_name = type(layer.experts).__name__

    def _dropped(self, routing_map: torch.Tensor) -> int:
        """(token, expert) pairs of the harness routing missing from Megatron's routing_map
        [T, G] after its capacity step, summed over the ranks (setup only: reads the device)."""
        wanted = topk_to_dense(*self.layer.router.topk)[1]
        n = (wanted & ~routing_map).sum().reshape(1)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(n)
        return int(n.item())

    def _gemm_name(self, experts: str, real_gg: bool) -> str:
        """Which grouped GEMM the experts run (for `impl`)."""
        if experts == "te":
            return te_gemm_name()
        if real_gg:
            return "grouped_gemm.gmm"
        w1 = self.layer.experts.weight1.view(self.spec.experts_per_rank, self.spec.hidden, -1)
        return f"{expert_gemm_impl(self.disp, w1)} (gmm stand-in: no grouped_gemm)"

    def forward(self) -> torch.Tensor:
        """The timed region: the whole MoELayer forward, x [T, 1, H] -> out [T, H]."""
        with torch.no_grad():
            out, bias = self.layer(self.x)
        if bias is not None:
            raise RuntimeError("MoELayer returned an MLP bias; the cell has no bias")
        return out.view(self.spec.tokens_per_rank, self.spec.hidden)

    def compute_only(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts on the held rows [R, H] (sort by expert, fc1, gelu x probs, fc2, unsort)
        and the unpermute of the held combine output -> [T, 1, H]."""
        y = self.experts()
        with torch.no_grad():
            return y, self.layer.postprocess(self.back, None)

    def comm_only(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The dispatch all-to-alls (rows, probs) and the combine's, on held rows."""
        with torch.no_grad():
            disp, _ = self.layer.dispatch(self.hidden, self.probs)
            return disp, self.layer.combine(self.y)
