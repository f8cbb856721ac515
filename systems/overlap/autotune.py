"""ccta="auto" / mgb="auto" / order="auto" for the overlap system, on the host (no GPU, no timing).

ccta / mgb: `pick`, the rule of docs/method.md ("ccta=auto") with the constants below, over
autotune_table.csv (written by autotune_fit.py); ccta is then clamped to the SMs. order:
pick_order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import pandas as pd

from harness.workload import WorkloadSpec, imbalance_of
from systems.overlap.params import AUTO, CONSUMER_SMS

TABLE = Path(__file__).with_name("autotune_table.csv")
#: (ccta, mgb) when no calibrated workload is near: the system's PARAMS defaults
DEFAULT = (16, 1)
#: farthest calibrated workload still used (feature units: doublings)
MAX_DISTANCE = 1.5
#: calibrated workloads whose measured surfaces are averaged (the nearest within MAX_DISTANCE)
K_NEAREST = 4
#: consumer="shared" with no calibrated workload near: cCTA = every SM (None), mgb 1
SHARED_DEFAULT = (None, 1)
#: distance added when the calibrated transport class differs from the cell's
TRANSPORT_PENALTY = 1.0
#: the features' columns of the table (T, K, N, E, W, the rank imbalance; compared as log2)
FEATURES = ("tokens_per_rank", "hidden", "out", "experts_per_rank", "world_size", "imbalance_rank")
#: columns of the table (one row per calibrated workload and measured (ccta, mgb))
COLUMNS = [*FEATURES, "transport", "routing", "sm_count", "ccta", "mgb", "rel_latency"]


def transport_class(transport: str, world_size: int) -> str:
    """`loopback` (one GPU plays every rank) or `nvlink` (p2p / nvshmem, one process a GPU);
    the empty transport is taken as loopback at W=1, else as nvlink."""
    if transport == "loopback" or (not transport and world_size == 1):
        return "loopback"
    return "nvlink"


@dataclass(frozen=True)
class Pick:
    ccta: int
    mgb: int
    why: str


@lru_cache(maxsize=4)
def load_table(path: str | Path = TABLE) -> pd.DataFrame:
    """The calibration table (checked for its columns)."""
    df = pd.read_csv(path)
    missing = [c for c in COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(f"calibration table {path} lacks columns {missing}")
    return with_consumer(df)


def with_consumer(table: pd.DataFrame, source: str = "consumer") -> pd.DataFrame:
    """`table` with its `consumer` column: the `source` column's, "own" where none or empty."""
    table = table.copy()
    col = table[source] if source in table else pd.Series("own", index=table.index)
    table["consumer"] = col.astype(object).where(col.notna(), "own").astype(str)
    return table


def default_pick(consumer: str, sm_count: int) -> tuple[int, int, str]:
    """(ccta, mgb, what it is) where no calibrated workload is near."""
    if consumer == "shared":
        c = sm_count or DEFAULT[0]
        return c, SHARED_DEFAULT[1], f"shared default: every SM ({c}), mgb {SHARED_DEFAULT[1]}"
    return DEFAULT[0], DEFAULT[1], "default"


def distance(a: dict, b: dict, transport_a: str, transport_b: str) -> float:
    """Euclidean distance of two workloads' log2 features plus the transport penalty."""
    log2 = lambda v: math.log2(max(float(v), 1e-9))  # noqa: E731
    d = math.sqrt(sum((log2(a[col]) - log2(b[col])) ** 2 for col in FEATURES))
    return d + (TRANSPORT_PENALTY if transport_a != transport_b else 0.0)


def spec_values(spec: WorkloadSpec) -> dict:
    """The feature values of a spec (imbalance from its seeded routing, computed on the host)."""
    v = {col: getattr(spec, col) for col in FEATURES if col != "imbalance_rank"}
    v["imbalance_rank"] = imbalance_of(spec)["imbalance_rank"]
    return v


def _nearest_value(values, want: int) -> int:
    return min(values, key=lambda v: (abs(math.log2(v) - math.log2(want)), v))


def pick_from(
    table: pd.DataFrame,
    values: dict,
    transport: str,
    sm_count: int = 0,
    ccta: int | str = AUTO,
    mgb: int | str = AUTO,
    k: int = K_NEAREST,
    consumer: str = "own",
) -> Pick:
    """The rule on feature `values` (FEATURES columns) and a transport class; a fixed ccta or
    mgb (int) is kept and only the other is picked; k: calibrated workloads averaged; only the
    table's rows of the `consumer` placement count."""
    if consumer not in CONSUMER_SMS:
        raise ValueError(f"autotune: consumer must be one of {CONSUMER_SMS}, got {consumer!r}")
    fixed_c = None if ccta == AUTO else int(ccta)
    fixed_m = None if mgb == AUTO else int(mgb)
    table = with_consumer(table)
    table = table[table["consumer"] == consumer]
    other_gpu = ""
    if sm_count and len(table):
        same = table[table["sm_count"] == sm_count]
        if len(same):
            table = same
        else:
            counts = "/".join(str(int(n)) for n in sorted(table["sm_count"].unique()))
            other_gpu = (
                f"; calibrated on {counts}-SM GPUs, this one has {sm_count}: calibrate it with "
                "experiment=ccta_auto and python -m systems.overlap.autotune_fit"
            )
    keys = [*FEATURES, "transport", "routing"]
    near = []  # (distance, calibrated workload, its rows)
    for key, rows in table.groupby(keys, sort=True):
        cal = dict(zip(keys, key))
        near.append((distance(values, cal, transport, cal["transport"]), cal, rows))
    near.sort(key=lambda x: x[0])
    used = [n for n in near if n[0] <= MAX_DISTANCE][: max(1, k)]
    if not used:
        dc, dm, what = default_pick(consumer, sm_count)
        c, m = fixed_c or dc, fixed_m or dm
        far = f"no {consumer} rows" if not near else f"nearest at distance {near[0][0]:.2f}"
        why = f"{what} ({c}, {m}): no calibrated {consumer} cell within {MAX_DISTANCE} ({far})"
    else:
        rows = pd.concat([r for _, _, r in used], ignore_index=True)
        g = rows.groupby(["ccta", "mgb"])["rel_latency"]
        score = g.mean()[g.count() * 2 >= len(used)].reset_index()
        for col, fixed in (("ccta", fixed_c), ("mgb", fixed_m)):  # the scored value nearest it
            if fixed is not None:
                score = score[score[col] == _nearest_value(score[col].unique(), fixed)]
        top = score.sort_values(["rel_latency", "ccta", "mgb"]).iloc[0]
        c, m = fixed_c or int(top["ccta"]), fixed_m or int(top["mgb"])
        b = used[0][1]
        why = (
            f"mean of the {len(used)} nearest calibrated cells (nearest: T={b['tokens_per_rank']} "
            f"K={b['hidden']} N={b['out']} E={b['experts_per_rank']} W={b['world_size']} "
            f"{b['routing']} {b['transport']}, distances {used[0][0]:.2f}-{used[-1][0]:.2f}): "
            f"best ccta={int(top['ccta'])} mgb={int(top['mgb'])} at {top['rel_latency']:.3f}x "
            "their best"
        )
    why += other_gpu if used else ""
    limit = sm_count if consumer == "shared" else sm_count - 1  # own: the producer keeps one
    if sm_count and c > limit:
        c = max(1, limit)
        why += f"; ccta clamped to {c} (sm_count {sm_count}, consumer {consumer})"
    return Pick(int(c), int(m), why)


def pick(
    spec: WorkloadSpec,
    transport: str,
    sm_count: int = 0,
    ccta: int | str = AUTO,
    mgb: int | str = AUTO,
    consumer: str = "own",
) -> tuple[int, int, str]:
    """(ccta, mgb, why) for a cell of `spec` over `transport` (the overlap system's param) on a
    GPU of `sm_count` SMs (0: unknown), consumer placement `consumer`."""
    cls = transport_class(transport, spec.world_size)
    p = pick_from(load_table(), spec_values(spec), cls, sm_count, ccta, mgb, consumer=consumer)
    return p.ccta, p.mgb, p.why


#: order="auto"'s threshold (docs/method.md, Order), fitted on the W=2 operator sweep of both
#: orders (h200x2/operator_order.parquet): "expert" won or tied at 2-4 bands an expert,
#: "remote_first" at 8+
ORDER_EXPERT_BANDS = 4.0


def _bands(tokens_per_rank: int, top_k: int, experts_per_rank: int, tile_m: int) -> float:
    """Mean tile_m bands a local expert holds: T * top_k / (E * tile_m)."""
    return tokens_per_rank * top_k / (experts_per_rank * tile_m)


def auto_order(tokens_per_rank: int, top_k: int, experts_per_rank: int, tile_m: int) -> str:
    """The order "auto" runs: "expert" at <= ORDER_EXPERT_BANDS bands an expert."""
    bands = _bands(tokens_per_rank, top_k, experts_per_rank, tile_m)
    return "expert" if bands <= ORDER_EXPERT_BANDS else "remote_first"


def pick_order(spec: WorkloadSpec, tile_m: int) -> tuple[str, str]:
    """(order, why) for order="auto" (auto_order; why: docs/method.md, Order)."""
    shape = (spec.tokens_per_rank, spec.top_k, spec.experts_per_rank, tile_m)
    bands, order = _bands(*shape), auto_order(*shape)
    rel = "<=" if order == "expert" else ">"
    why = f"order {order}: {bands:.3g} bands of {tile_m} rows per expert {rel} "
    why += f"{ORDER_EXPERT_BANDS:g}"
    return order, why
