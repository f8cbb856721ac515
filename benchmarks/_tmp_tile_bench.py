"""one-off (not committed): producer tile configs at the W=1 layer's GEMM shapes vs grouped_mm."""
import sys
import torch
from harness.workload import WorkloadSpec
from experiments.producer import problem
from systems.overlap.kernels import launch_producer
from systems.overlap.tuning import TileConfig

dev = torch.device("cuda")
SMS = torch.cuda.get_device_properties(dev).multi_processor_count
C = {
    "n128_g1": TileConfig(128, 128, 64, 8, 4, group_m=1, flag="thread"),
    "n128_s3": TileConfig(128, 128, 64, 8, 3, group_m=1, flag="thread"),
    "n128_eg16": TileConfig(128, 128, 64, 8, 4, 16, flag="thread", expert_groups=True),
    "n128_eg8": TileConfig(128, 128, 64, 8, 4, 8, flag="thread", expert_groups=True),
    "n128_g4": TileConfig(128, 128, 64, 8, 4, 4, flag="thread"),
    "n256_g1": TileConfig(128, 256, 64, 8, 3, 1, flag="deferred", epi_split=4),
}


def tm(fn, n=30):
    for _ in range(5):
        fn()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for a, b in ev:
        a.record(); fn(); b.record()
    torch.cuda.synchronize()
    t = sorted(a.elapsed_time(b) * 1e3 for a, b in ev)
    return t[n // 2]


a_ = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
for _ in range(200):  # clocks up
    a_ @ a_
SHAPES = [tuple(int(v) for v in c.split(",")) for c in sys.argv[1].split(";")]
for K, N, E, T, act, r in SHAPES:
    spec = WorkloadSpec(world_size=1, tokens_per_rank=T, hidden=K, out=N,
                        experts_per_rank=E, top_k=2, routing=("balanced", "stress_skew")[r], dtype="bfloat16")
    order = "expert" if T * 2 / (E * 128) <= 4 else "remote_first"
    pb = problem(spec, 128, "aligned", dev, order=order)
    ref = torch._grouped_mm(pb.x_valid, pb.w, offs=pb.offsets).float()
    if act:
        ref = torch.nn.functional.gelu(ref)
    fns = {"grouped_mm": lambda: torch._grouped_mm(pb.x_valid, pb.w, offs=pb.offsets)}
    if act:
        fns["grouped_mm"] = lambda: torch.nn.functional.gelu(torch._grouped_mm(pb.x_valid, pb.w, offs=pb.offsets))
    for name, cfg in C.items():
        p = problem(spec, 128, "aligned", dev, order=order, group_cap=cfg.group_m) if cfg.expert_groups else pb
        y = torch.zeros(p.x.shape[0], N, dtype=p.x.dtype, device=dev)
        ready = torch.zeros(p.plan.max_bands, dtype=torch.int32, device=dev)
        go = (lambda p=p, y=y, ready=ready, cfg=cfg: launch_producer(
            p.x, p.w, y, p.plan, ready, num_programs=SMS, config=cfg, signal=False, act=bool(act)))
        go(); torch.cuda.synchronize()
        err = ((y[p.valid].float() - ref).norm() / ref.norm()).item()
        if err < 2e-2:
            fns[name] = go
        else:
            print(f"  {name} err {err:.3g}")
    res = {k: [] for k in fns}
    for _ in range(5):
        for k, f in fns.items():
            res[k].append(tm(f, 20))
    med = {k: sorted(v)[2] for k, v in res.items()}
    g = med["grouped_mm"]
    print(f"K={K} N={N} E={E} T={T} {('bal', 'skew')[r]} act={act}: " + "  ".join(
        f"{k} {v:.1f}({v / g:.3f}, spread {(max(res[k]) - min(res[k])) / v:.2f})" for k, v in med.items()), flush=True)
