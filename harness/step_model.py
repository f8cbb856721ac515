"""A calibrated model of one step of serial and of the overlap system, a discrete-event walk per
simulated rank (docs/method.md, The step model): every number it gives is a PREDICTION, never a
measurement. Node presets: conf/node/<name>.yaml."""

from __future__ import annotations

import heapq
import json
import math
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import yaml

from harness.routing import owner_expert_counts
from harness.workload import WorkloadSpec, routing_of
from systems.overlap.autotune import auto_order
from systems.overlap.plan import plan_from_rows

NODES = Path(__file__).resolve().parents[1] / "conf" / "node"
MAX_RANKS = 8  # ranks simulated per cell: the busiest ones (the step is the max over ranks)
TILE_N, K_REF = 256, 2048
PRED = ("m_pred_ms", "m_pred_compute_ms", "m_pred_comm_ms", "m_pred_overlap_ratio")


@dataclass(frozen=True)
class Node:
    """A node preset (conf/node/<name>.yaml says what each number is); us, GB/s, TB/s."""

    name: str
    sms: int
    tile_us: float
    strip_us: float
    gmm_tile_us: float
    gmm_strip_us: float
    hbm_tbps: float
    scale_gap_us: float
    lead_us: float
    handshake_us: float
    topology: str  # switch | pairwise
    seg_lat_us: float
    cta_gbps: float
    link_gbps: float
    loop_seg_lat_us: float
    loop_cta_gbps: float
    loop_link_gbps: float
    nccl_lat_us: float
    serial_eager_us: float
    serial_graph_us: float
    overlap_eager_us: float
    overlap_graph_us: float


def load_node(name: str) -> Node:
    path = NODES / f"{name}.yaml"
    if not path.exists():
        have = ", ".join(sorted(p.stem for p in NODES.glob("*.yaml")))
        raise ValueError(f"no node preset {name!r} (conf/node/); choices: {have}")
    return Node(**yaml.safe_load(path.read_text()))


def spec_of(cell: dict) -> WorkloadSpec:
    keys = ("tokens_per_rank", "hidden", "out", "experts_per_rank", "top_k", "world_size")
    run = dict(routing=str(cell["routing"]), dtype=str(cell.get("dtype") or "bfloat16"))
    return WorkloadSpec(**{k: int(cell[k]) for k in keys}, **run, ffn=int(cell.get("ffn") or 0))


def routing_key(spec: WorkloadSpec) -> WorkloadSpec:
    """The cell's routing alone (hidden = out = 1, float32, no FFN): the caches' key."""
    return replace(spec, hidden=1, out=1, dtype="float32", ffn=0)


@lru_cache(maxsize=64)
def counts(key: WorkloadSpec) -> np.ndarray:
    """[W, W, E]: rows owner s sends to local expert e of rank r (key: routing_key)."""
    W, E = key.world_size, key.experts_per_rank
    return owner_expert_counts(routing_of(key).expert_ids, E).view(W, W, E).numpy()


@lru_cache(maxsize=1024)
def rank_plan(key: WorkloadSpec, rank: int, tile_m: int, mgb: int, layout: str, order: str) -> dict:
    """plan_arrays of a rank's combine plan, from its group sizes (key: routing_key)."""
    rows = counts(key)[:, rank, :].T.tolist()  # rows[e][s]
    plan = plan_from_rows(rows, rank=rank, tile_m=tile_m, mgb=mgb, layout=layout, order=order)
    return plan_arrays(plan)


def plan_arrays(p) -> dict:
    """A CombinePlan's walk as numpy: band ids in visiting order (seq), band_expert, per
    segment unit (a remote band, or a compact plan's piece) its segment, band and valid rows,
    seg_dst, padded rows."""
    seq = p.schedule if p.visit is None else p.schedule[p.visit]
    aligned = p.piece_band is None
    unit_band = p.schedule if aligned else p.piece_band
    unit_rows = p.band_valid[p.schedule] if aligned else p.piece_rows
    seg = torch.repeat_interleave(torch.arange(len(p.seg_start)), p.seg_count)
    n = seg.numel()
    arrays = dict(seq=seq, expert=p.band_expert, seg=seg, unit_band=unit_band[:n])
    arrays |= dict(unit_rows=unit_rows[:n], seg_dst=p.seg_dst)
    return {k: v.numpy() for k, v in arrays.items()} | {"padded": int(p.n_padded)}


def gemm_work(expert_seq: np.ndarray, n_cols: int, k: int, node: Node) -> np.ndarray:
    """SM-us of each band in visiting order: its tiles, and a strip read where its expert is new."""
    new = np.ones(len(expert_seq), bool)
    new[1:] = expert_seq[1:] != expert_seq[:-1]
    return math.ceil(n_cols / TILE_N) * k / K_REF * (node.tile_us + node.strip_us * new)


def consume(ready, nbytes, dst, ccta: int, seg_lat: float, cta: float, link: float, pairwise):
    """Done time (us) of each segment: program j takes segments j, j + ccta, ..."""
    done, end, cur = np.zeros(len(ready)), [0.0] * ccta, [-1] * ccta
    heap = [(ready[j], j, j) for j in range(min(ccta, len(ready)))]
    while heap:
        t, j, s = heapq.heappop(heap)
        busy = [i for i in range(ccta) if i != j and end[i] > t]
        share = sum(cur[i] == dst[s] for i in busy) if pairwise else len(busy)
        end[j] = done[s] = t + seg_lat + nbytes[s] / (1e3 * min(cta, link / (1 + share)))
        cur[j] = dst[s]
        if s + ccta < len(ready):
            heapq.heappush(heap, (max(ready[s + ccta], end[j]), j, s + ccta))
    return done


def overlap_rank(
    pl: dict, n_cols: int, k: int, node: Node, ccta: int, loop: bool, t0=0.0, shared=False
):
    """(end of the overlapped GEMM + puts, producer alone on all SMs, consumer alone) of one
    rank, from t0; shared: the consumer's programs share the producer's SMs."""
    work = gemm_work(pl["expert"][pl["seq"]], n_cols, k, node)
    cum = np.cumsum(work)
    band_done = np.empty(len(cum))
    progs = node.sms - ccta if len(pl["seg"]) and not shared else node.sms
    band_done[pl["seq"]] = t0 + cum / progs
    if not len(pl["seg"]):
        return band_done.max(initial=t0), cum[-1] / node.sms, 0.0
    S = len(pl["seg_dst"])
    ready = np.zeros(S)
    np.maximum.at(ready, pl["seg"], band_done[pl["unit_band"]])
    nbytes = np.bincount(pl["seg"], pl["unit_rows"] * n_cols * 2.0, S)
    if loop:
        curve = (node.loop_seg_lat_us, node.loop_cta_gbps, node.loop_link_gbps)
    else:
        curve = (node.seg_lat_us, node.cta_gbps, node.link_gbps)
    pair = node.topology == "pairwise" and not loop
    puts = consume(ready, nbytes, pl["seg_dst"], ccta, *curve, pair)
    alone = consume(np.zeros(S), nbytes, pl["seg_dst"], ccta, *curve, pair)
    return max(band_done.max(), puts.max()), cum[-1] / node.sms, alone.max()


def all_to_all_us(spec: WorkloadSpec, cols: int, node: Node) -> float:
    """An all-to-all of rows `cols` wide (bf16) with the cell's routing: the busiest link."""
    C = counts(routing_key(spec)).sum(2) * (1 - np.eye(spec.world_size))  # [s, d] rows of s at d
    if spec.world_size == 1:
        return 0.0
    rows = C.max() if node.topology == "pairwise" else np.maximum(C.sum(0), C.sum(1)).max()
    return node.nccl_lat_us + float(rows) * cols * 2 / (1e3 * node.link_gbps)


def after_us(spec: WorkloadSpec, node: Node) -> float:
    nbytes = (spec.top_k + 1) * spec.tokens_per_rank * (spec.hidden if spec.ffn else spec.out) * 2
    return node.scale_gap_us + nbytes / (1e6 * node.hbm_tbps)


def ranks_of(spec: WorkloadSpec, every: bool) -> list[int]:
    rows = counts(routing_key(spec)).sum((0, 2))
    order = sorted(range(spec.world_size), key=lambda r: -int(rows[r]))
    return order if every else order[:MAX_RANKS]


def serial_rank(spec: WorkloadSpec, rank: int, node: Node) -> float:
    """Serial's compute on one rank (us): torch._grouped_mm over its experts' rows, the
    un-permute of its output; in a layer fc1, GELU and the permute of x as well."""
    rows = counts(routing_key(spec))[:, rank, :].sum(0)  # [E]
    R, hbm = rows.sum(), 1e6 * node.hbm_tbps

    def gemm(k: int, n: int) -> float:
        strips = ((rows + 127) // 128 * node.gmm_tile_us + (rows > 0) * node.gmm_strip_us).sum()
        return math.ceil(n / TILE_N) * k / K_REF * strips / node.sms

    if not spec.ffn:
        return gemm(spec.hidden, spec.out) + 4 * R * spec.out / hbm
    H, F = spec.hidden, spec.ffn
    return gemm(H, F) + gemm(F, H) + 4 * R * (F + 2 * H) / hbm


def predict(cell: dict, node: Node) -> dict:
    """m_pred_ms, m_pred_compute_ms, m_pred_comm_ms, m_pred_overlap_ratio of one serial or
    overlap row (its workload columns and p_ parameters; ms)."""
    spec = spec_of(cell)
    W, layer = spec.world_size, spec.ffn > 0
    k_gemm, n_gemm = (spec.ffn, spec.hidden) if layer else (spec.hidden, spec.out)
    after = after_us(spec, node)
    played = str(cell.get("transport")) == "loopback" and W > 1
    mode = "graph" if str(cell.get("graph")) == "True" else "eager"
    const = getattr(node, f"{cell['system']}_{mode}_us") if layer else 0.0
    dispatch = all_to_all_us(spec, spec.hidden, node) if layer and not played else 0.0
    if cell["system"] == "serial":
        comm = all_to_all_us(spec, n_gemm, node)
        comp = max(serial_rank(spec, r, node) for r in ranks_of(spec, False))
        return _out(const + dispatch + comp + comm + after, comp + after, dispatch + comm, layer)
    ccta = int(_knob(cell, "ccta", 16)) if W > 1 else 0
    mgb = int(_knob(cell, "mgb", 1))
    tm, layout = int(_knob(cell, "tile_m", 128)), str(_knob(cell, "layout", "aligned"))
    auto = auto_order(spec.tokens_per_rank, spec.top_k, spec.experts_per_rank, tm)
    order = str(_knob(cell, "order", auto))
    ranks = ranks_of(spec, played and layer)
    if played and not layer:  # the played operator times the busiest rank alone
        ranks = ranks[:1]
    shared = cell.get("p_consumer") == "shared"
    res = []  # per rank: (end, compute alone, comm alone)
    for r in ranks:
        pl = rank_plan(routing_key(spec), r, tm, mgb, layout, order)
        t0 = 0.0
        if layer:  # the padded gather, fc1 (+ GELU) on every SM
            w1 = gemm_work(pl["expert"][pl["seq"]], spec.ffn, spec.hidden, node)
            t0 = 4 * pl["padded"] * spec.hidden / (1e6 * node.hbm_tbps) + w1.sum() / node.sms
        end, c, m = overlap_rank(pl, n_gemm, k_gemm, node, ccta, played, t0, shared)
        res.append((end, t0 + c, m))
    ends, comps, comms = zip(*res)
    lead = node.lead_us + (node.handshake_us if W > 1 and not played else 0.0)
    if played and layer:  # one GPU runs every rank's experts and scale in turn
        lat = W * const + sum(ends) + W * after
        return _out(lat, sum(comps) + W * after, sum(comms), layer)
    lat = const + dispatch + lead + max(ends) + after
    return _out(lat, lead + max(comps) + after, dispatch + max(comms), layer)


def _knob(cell: dict, name: str, default):
    """A row's p_<name>_used, else p_<name>, else the default (missing, NaN or "auto")."""
    for v in (cell.get(f"p_{name}_used"), cell.get(f"p_{name}")):
        if v is not None and not pd.isna(v) and str(v) not in ("", "auto"):
            return float(v) if isinstance(v, (int, float)) else v
    return default


def _out(lat: float, comp: float, comm: float, layer: bool = False) -> dict:
    """The prediction's columns (PRED); the overlap ratio of the operator scope only (the
    harness's definition, undefined in the layer scope)."""
    ok = comm > 0 and not layer
    ratio = min(max((comp + comm - lat) / comm, 0.0), 1.0) if ok else float("nan")
    return dict(zip(PRED, (lat / 1e3, comp / 1e3, comm / 1e3, ratio)))


def _lstsq_rel(A: np.ndarray, y: np.ndarray) -> np.ndarray:
    """x minimising the relative error of A x against y."""
    return np.linalg.lstsq(A / y[:, None], np.ones_like(y), rcond=None)[0]


def _curve(bw: pd.DataFrame, caps: np.ndarray, pre: str) -> dict[str, float]:
    """<pre>seg_lat_us, <pre>cta_gbps, <pre>link_gbps from consumer rows with every segment
    ready: each of c programs ships ceil(n / c) segments of b bytes at min(cta, link / c)."""
    c, b = bw["p_ccta"].to_numpy(), bw["m_segment_bytes"].to_numpy()
    k, y = np.ceil(bw["m_n_segments"].to_numpy() / c), bw["latency_ms"].to_numpy() * 1e3
    best = (np.inf,)
    for cta in np.arange(20.0, 80.0, 0.5):
        for link in caps:
            xfer = k * b / (1e3 * np.minimum(cta, link / c))
            lat = max(float(np.sum(k / y * (1 - xfer / y)) / np.sum((k / y) ** 2)), 0.0)
            err = np.abs((k * lat + xfer) / y - 1).mean()
            best = min(best, (err, lat, cta, link))
    return dict(zip((f"{pre}seg_lat_us", f"{pre}cta_gbps", f"{pre}link_gbps"), best[1:]))


def fit(ref: Path = Path("results/reference")) -> dict:
    """The H200 preset's fitted numbers, from single-GPU rows (h200/producer, scale_bound,
    step_profile, bandwidth, layer_w1) and h200x2/bandwidth only: no table the model predicts."""
    out = {}
    prod = pd.read_parquet(ref / "h200/producer.parquet")
    for name, pre in (("overlap", ""), ("torch_grouped_mm", "gmm_")):
        rows = prod[(prod["system"] == name) & (prod["status"] == "ok")]
        A = []
        for _, r in rows.iterrows():
            per = np.array(json.loads(r["extra"])["per_expert_rows"])
            nt = math.ceil(r["out"] / TILE_N) * r["hidden"] / K_REF / 132
            A.append([((per + 127) // 128).sum() * nt, (per > 0).sum() * nt])
        tile, strip = _lstsq_rel(np.array(A), rows["latency_ms"].to_numpy() * 1e3)
        out |= {f"{pre}tile_us": tile, f"{pre}strip_us": strip}
    sb = pd.read_parquet(ref / "h200/scale_bound.parquet")
    sb = sb[sb["default"]]
    nbytes = ((sb["top_k"] + 1) * sb["tokens"] * sb["cols"] * 2).to_numpy()
    out["hbm_tbps"] = 1 / _lstsq_rel(nbytes[:, None] / 1e6, sb["scale_ms"].to_numpy() * 1e3)[0]
    sp = pd.read_parquet(ref / "h200/step_profile.parquet")
    scale = sp[sp["part"] == "scale"]
    out["scale_gap_us"] = float((scale["after_us"] - scale["busy_us"]).median())
    out["lead_us"] = float(scale["lead_us"].median())
    bw2 = pd.read_parquet(ref / "h200x2/bandwidth.parquet")
    bw2 = bw2[bw2["status"] == "ok"]
    out |= _curve(bw2[bw2["p_transport"] == "p2p"], np.arange(250.0, 500.0, 2.5), "")
    bw1 = pd.read_parquet(ref / "h200/bandwidth.parquet")
    loop = bw1[(bw1["status"] == "ok") & (bw1["p_transport"] == "loopback")]
    out |= _curve(loop, np.arange(300.0, 3000.0, 20.0), "loop_")
    nccl = bw2[bw2["system"] == "nccl_all_to_all"]
    left = nccl["latency_ms"] * 1e3 - nccl["m_bytes_sent"] / (1e3 * out["link_gbps"])
    out["nccl_lat_us"] = float(left.median())
    zero = {f"{s}_{m}_us": 0.0 for s in ("serial", "overlap") for m in ("eager", "graph")}
    node = replace(load_node("h200"), **out, **zero)
    w1 = pd.read_parquet(ref / "h200/layer_w1.parquet")
    w1 = w1[w1["system"].isin(["serial", "overlap"]) & (w1["status"] == "ok")]
    for (system, graph), g in w1.groupby(["system", "graph"]):
        if not graph:
            g = g[g["p_dispatch_used"] == "nccl"]
        left = [r["latency_ms"] - predict(r.to_dict(), node)["m_pred_ms"] for _, r in g.iterrows()]
        out[f"{system}_{'graph' if graph else 'eager'}_us"] = 1e3 * float(np.median(left))
    return {k: round(float(v), 3) for k, v in out.items()}
