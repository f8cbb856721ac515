"""results/REPORT.md from the committed tables only (no GPU, no run): `make report`.

Every number is read from a table under results/reference/ (a row's `caveat` is shown where it
bounds a claim); the text is deterministic (sorted keys, fixed float formats). A speedup is other
/ overlap (higher is better) throughout. Also rewrites README.md's headline block."""

from __future__ import annotations

import argparse
import re
from collections import namedtuple
from pathlib import Path

import numpy as np
import pandas as pd

from plots.all import FIGURES as DRAWN
from plots.all import SHOWS
from plots.common import FIG_DIR, TIMING_KNOBS, graphed, placements
from plots.layer_w1 import modes
from plots.producer import ratios
from plots.projection import PROJECTION, VALIDATION, report_section
from systems.overlap.autotune import DEFAULT, MAX_DISTANCE
from systems.overlap.autotune import TABLE as AUTOTUNE_TABLE

REF = Path("results/reference")
#: scope -> (the rows' scope value, the experiments whose tables hold it)
SCOPES = {"operator": ("gemm+combine", ("operator",)), "layer": ("layer", ("layer_w1", "layer")),
          "model": ("model", ("models",))}  # fmt: skip
#: README.md's block that `make report` rewrites: the headline's tables
README_MARKS = ("<!-- headline: written by make report (plots/report.py) -->", "<!-- /headline -->")
HEADLINE_TEXT = (
    "Other / overlap per workload cell (higher is better), median (min-max) over cells. A cell "
    "pairs rows of one run (`run_id`) and one timing: the median over the runs that hold both, "
    'else the median of each one\'s runs ("across runs"); a graphed overlap row meets a '
    'baseline\'s eager rows only where it cannot be captured ("eager baseline"). serial / '
    "overlap = kernel gain x overlap gain per cell; serialized: the overlap system's kernels one "
    "after the other (`serialized_ms`), in older tables C+M: compute-only + comm-only (eager "
    "bounds, none for graph rows; at layer scope without the dispatch's sync). Ceiling: what "
    "overlap alone can buy, from the same overlap row. W=1: nothing remote, a kernel comparison."
)
CELL = ["world_size", "tokens_per_rank", "hidden", "out", "ffn", "experts_per_rank", "routing",
        "dtype", "model"]  # fmt: skip


def tables(ref: Path = REF) -> dict[str, pd.DataFrame]:
    """Every committed table, keyed 'machine/stem'."""
    return {f"{p.parent.name}/{p.stem}": pd.read_parquet(p) for p in sorted(ref.rglob("*.parquet"))}


def _ok(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["status"] == "ok"] if "status" in df else df


def _join(values) -> str:
    vals = sorted({str(v) for v in values if str(v) not in ("", "nan", "None", "<NA>")})
    return ", ".join(vals) if vals else "?"


def _range(v: pd.Series, fmt: str = ".2f", unit: str = "x") -> str:
    v = v.dropna()
    return "none" if v.empty else f"{v.min():{fmt}}-{v.max():{fmt}}{unit}"


def _med(v: pd.Series) -> str:
    """ "1.41x (1.17-1.72)": median and range."""
    v = v.dropna()
    return "none" if v.empty else f"{v.median():.2f}x ({_range(v, unit='')})"


def fastest(df: pd.DataFrame, scope: str | None = None) -> tuple[pd.DataFrame, list[str]]:
    """Each system variant's fastest ok row (of `scope`) per (cell, run, timing), with `run`,
    `timing` ("graph"/"eager") and `variant` (its knobs but TIMING_KNOBS; one for the overlap
    system, not over nvshmem); and the cell's key columns (NaN -> -1)."""
    o = _ok(df).dropna(subset=["latency_ms"])
    if scope is not None and "scope" in o:
        o = o[o["scope"].fillna("") == scope]
    if "p_transport" in o:
        o = o[(o["system"] != "overlap") | (o["p_transport"].fillna("") != "nvshmem")]
    keys = [c for c in CELL if c in o and o[c].notna().any()]
    o = o.assign(**{k: o[k].fillna(-1) for k in keys},
                 **{c: o.get(c, np.nan) for c in ("compute_ms", "comm_ms", "serialized_ms")},
                 run=o["run_id"].fillna("") if "run_id" in o else "",
                 timing=np.where(graphed(o), "graph", "eager"))  # fmt: skip
    knobs = [c for c in o if c.startswith("p_") and c[-5:] != "_used" and c not in TIMING_KNOBS]
    v = o[knobs].map(str).agg("|".join, axis=1) if knobs and len(o) else ""
    o = o.assign(variant=pd.Series(v, index=o.index).where(o["system"] != "overlap", ""))
    if o.empty:
        return o, keys
    by = keys + ["system", "variant", "run", "timing"]
    return o.loc[o.groupby(by)["latency_ms"].idxmin()], keys


def compare(r: pd.DataFrame, keys: list[str], others, timing: str) -> pd.DataFrame:
    """Per (cell, other system) of fastest()'s rows `r`: `ratio` = other / overlap for overlap
    rows timed `timing` and each variant's rows timed alike (else its eager rows: `eager`), run
    by run where both have a run (median over those), else the medians over each side's runs
    (`across`); the fastest variant counts. Also `kernel` = other / serialized, `gain` =
    serialized / overlap and `ceiling` = (C + M) / max(C, M); serialized is serialized_ms, else
    C + M of an eager row (`cm`: the bounds are timed eager, so a graph row has none)."""
    ours = r[(r["system"] == "overlap") & (r["timing"] == timing)]
    x = r[r["system"].isin(list(others))]
    g = keys + ["system", "variant"]
    has = (x["timing"] == timing).groupby([x[k] for k in g]).transform("any")
    x = x[(x["timing"] == timing) | (~has & (x["timing"] == "eager"))]
    x = x.assign(eager=x["timing"] != timing)
    c, m = ours["compute_ms"], ours["comm_ms"]
    cm = ours["serialized_ms"].isna() & (ours["timing"] == "eager") & (c + m).notna()
    ours = ours.assign(ser=ours["serialized_ms"].where(~cm, c + m), cm=cm,
                       ceiling=(c + m) / np.maximum(c, m))  # fmt: skip
    vals = ["ratio", "kernel", "gain", "ceiling"]
    flags = {"cm": ("cm", "any"), "eager": ("eager", "any")}
    p = x.merge(ours[keys + ["run", "latency_ms", "ser", "cm", "ceiling"]], on=keys + ["run"],
                suffixes=("", "_o"))  # fmt: skip
    p = p.assign(ratio=p["latency_ms"] / p["latency_ms_o"], kernel=p["latency_ms"] / p["ser"],
                 gain=p["ser"] / p["latency_ms_o"])  # fmt: skip
    same = p.groupby(g, as_index=False).agg(**{v: (v, "median") for v in vals}, **flags,
                                             lat=("latency_ms", "median"))  # fmt: skip
    xa = x.groupby(g, as_index=False).agg(lat=("latency_ms", "median"), eager=("eager", "any"))
    oa = ours.groupby(keys, as_index=False).agg(lat_o=("latency_ms", "median"),
                                                ser=("ser", "median"), cm=("cm", "any"),
                                                ceiling=("ceiling", "median"))  # fmt: skip
    a = xa.merge(oa, on=keys)
    a = a.assign(ratio=a["lat"] / a["lat_o"], kernel=a["lat"] / a["ser"],
                 gain=a["ser"] / a["lat_o"])  # fmt: skip
    out = pd.concat([same.assign(across=False), a[same.columns].assign(across=True)])
    out = out.drop_duplicates(g).reset_index(drop=True)  # across: only cells without a same run
    return out.loc[out.groupby(keys + ["system"])["ratio"].idxmin()] if len(out) else out


def best_of(c: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Per cell, compare()'s row of the fastest other system (the smallest other / overlap)."""
    return c.loc[c.groupby(keys)["ratio"].idxmin()] if len(c) else c


def baselines(r: pd.DataFrame) -> list[str]:
    return sorted(set(r["system"]) - {"overlap", "serial"})


def _flags(c: pd.DataFrame, what: str) -> str:
    """ ", eager baseline, across runs": how compare()'s rows `c` pair (in how many cells)."""
    out = []
    for col, text in (("eager", f"eager {what}"), ("across", "across runs")):
        n = int(c[col].sum())
        out += [text + ("" if n == len(c) else f" in {n} of {len(c)}")] if n else []
    return "".join(f", {t}" for t in out)


def _gain(v: pd.Series, cm: pd.Series) -> str:
    return "not measured" if v.isna().all() else _med(v) + (" (C+M)" if cm.any() else "")


def _above(c: pd.DataFrame) -> str:
    if c["ceiling"].isna().all():
        return "-"
    over = (c["ratio"] > c["ceiling"]).sum(), (c["gain"] > c["ceiling"]).sum()
    return "speedup {}, overlap gain {}".format(*over)


def timings(r: pd.DataFrame) -> list[str]:
    """The timings of the overlap system's rows, graph first."""
    ours = r[r["system"] == "overlap"]
    return [t for t in ("graph", "eager") if (ours["timing"] == t).any()]


def serial_caveat(df: pd.DataFrame) -> str:
    """The `caveat` every ok serial row carries (e.g. measured before a fix of serial: speedups
    over it are upper bounds), or "" where any has none."""
    s = _ok(df)
    s = s[s["system"] == "serial"] if "system" in s else s.iloc[:0]
    c = s["caveat"].fillna("").astype(str) if "caveat" in s else pd.Series("", index=s.index)
    return "; ".join(sorted(set(c))) if len(c) and (c != "").all() else ""


def _machine(key: str, df: pd.DataFrame) -> str:
    w = _join(df["world_size"].dropna().astype(int)) if "world_size" in df else "?"
    tr = sorted(set(df.get("transport", pd.Series(dtype=str)).dropna().astype(str)) - {""})
    m = re.fullmatch(r"(h[0-9]+)(?:x(\d+))?", key)  # h200, h200x2, h100x8: GPU model, count
    gpu = m.group(1).upper() if m else key
    where = f"{m.group(2)} {gpu}s, NVLink" if m and m.group(2) else f"1 {gpu}" if m else key
    lb = ", loopback" if tr == ["loopback"] else ", nothing remote" if w == "1" else ""
    return f"{where} (W={w}{lb})"


def headline(d: dict[str, pd.DataFrame]) -> list[str]:
    """Per scope, machine and timing: serial / overlap split into the kernel gain and the
    overlap gain with its ceiling; then the fastest baseline / overlap."""
    one = ["| scope | machine | table | timing | cells | serial / overlap | kernel gain: serial "
           "/ serialized | overlap gain: serialized / overlap | ceiling (C+M) / max(C,M) | "
           "over the ceiling |", "| --- " * 10 + "|"]  # fmt: skip
    two = ["| scope | machine | table | timing | cells | fastest baseline / overlap | fastest "
           "baseline (cells) |", "| --- " * 7 + "|"]  # fmt: skip
    caveats: dict[str, list[str]] = {}
    above: list[str] = []  # cells whose overlap gain passes its ceiling
    for scope, (value, stems) in SCOPES.items():
        for key in sorted(k for k in d if k.split("/")[1] in stems):
            r, keys = fastest(d[key], value)
            where = f"{scope} | {_machine(key.split('/')[0], d[key])} | `{key}`"
            for t in timings(r):
                s = compare(r, keys, ["serial"], t)
                star = "\\*" if (cav := serial_caveat(d[key])) else ""
                if len(s):
                    if cav:
                        caveats.setdefault(cav, []).append(f"`{key}`")
                    for _, c in s[s["gain"] > s["ceiling"]].iterrows():
                        above.append(f"`{key}` {t} " + " ".join(f"{k}={c[k]}" for k in keys
                                     if c[k] != -1 and s[k].nunique() > 1))  # fmt: skip
                    one.append(f"| {where} | {t} | {len(s)} | {_med(s['ratio'])}{star}"
                               f"{_flags(s, 'serial')} | {_gain(s['kernel'], s['cm'])} | "
                               f"{_gain(s['gain'], s['cm'])} | {_range(s['ceiling'])} | "
                               f"{_above(s)} |")  # fmt: skip
                b = best_of(compare(r, keys, baselines(r), t), keys)
                if len(b):
                    who = ", ".join(f"{n} {k}" for n, k in b["system"].value_counts().sort_index()
                                    .items())  # fmt: skip
                    two.append(f"| {where} | {t} | {len(b)} | {_med(b['ratio'])}"
                               f"{_flags(b, 'baseline')} | {who} |")  # fmt: skip
    notes = [f"\\* {', '.join(sorted(set(k)))}: {c}." for c, k in sorted(caveats.items())]
    if above:
        notes.append("Overlap gain above its ceiling (the step beat its slower part run alone: "
                     "noise, or a part slower alone than inside the step): "
                     f"{'; '.join(above)}.")  # fmt: skip
    return (["## Headline", "", HEADLINE_TEXT, "", *one, "", *(notes and [*notes, ""]),
             "Against the fastest baseline of each cell (each baseline's fastest row):", "",
             *two, ""])  # fmt: skip


#: the host-free layer's table: every system's layer at W=1 on one H200
HOST_FREE = "h200/layer_w1"
HOST_FREE_COLS = ("serial graph", "overlap graph", "overlap eager", "overlap nccl")


def host_free_section(d: dict[str, pd.DataFrame]) -> list[str]:
    """The host-free layer at W=1 (HOST_FREE) per cell (H, F, E, routing) of the ok rows (its
    columns: the table's header below), and the loopback correctness line; [] without the table."""
    if HOST_FREE not in d:
        return []
    df = d[HOST_FREE]
    keys = ["hidden", "ffn", "experts_per_rank", "routing"]
    ours = _ok(df).loc[lambda x: x["system"].isin(["serial", "overlap"])]
    ours = ours.assign(col=ours["system"] + " " + modes(ours))
    c = ours.pivot_table(index=keys, columns="col", values="latency_ms", aggfunc="median")
    c = c.reindex(columns=list(HOST_FREE_COLS) + ["serial eager"])
    r, rk = fastest(df, "layer")
    b = best_of(compare(r, rk, baselines(r), "graph"), rk).set_index(keys)
    c["best"] = b["system"] + " " + b["lat"].map("{:.3f}".format)
    c["best"] += np.where(b["eager"], " eager", " graph") + np.where(b["across"], "\\*", "")
    shape = f"T={_join(df['tokens_per_rank'])}, top-{_join(df['top_k'])}, {_join(df['dtype'])}"
    out = ["## Host-free layer (one H200, W=1)", "",
           f"`{HOST_FREE}`, {shape}; median ms; serial and overlap of one run per timing. graph: "
           "CUDA-graph replay; eager: the step eager; nccl: the NCCL dispatch (host sync). "
           "Fastest baseline: graph where captured; \\* another run than overlap's.", "",
           "| H, F | E | routing | " + " | ".join(HOST_FREE_COLS) + " | fastest baseline | "
           "serial / overlap, graph | eager / graph: overlap, serial |",
           "| --- " * 10 + "|"]  # fmt: skip
    for (h, f, e, routing), row in c.iterrows():
        lat = " | ".join(f"{row[k]:.3f}" for k in HOST_FREE_COLS)
        out.append(f"| {h}, {f} | {e} | {routing} | {lat} | {row['best']} | "
                   f"{row['serial graph'] / row['overlap graph']:.2f}x | "
                   f"{row['overlap eager'] / row['overlap graph']:.2f}x, "
                   f"{row['serial eager'] / row['serial graph']:.2f}x |")  # fmt: skip
    if (lb := d.get("h200/layer_loopback")) is not None:
        o = lb[lb["system"] == "overlap"]
        ok, ws = _ok(o), _join(o["world_size"].astype(int))
        out += ["", f"Loopback (`h200/layer_loopback`, one H200 as W={ws}; "
                f"{_join(o['p_layout'])}): {len(ok)} of {len(o)} cells pass both checks (max "
                f"rel. error {o['max_rel_err'].max():.2e}, worst row "
                f"{o['max_row_rel_err'].max():.2e}); worst-case receive buffers "
                f"{_range(ok['m_recv_worst_mib'], '.0f', ' MiB')}; latency a proxy."]  # fmt: skip
    return out + [""]


#: a claim of the paper: `ours` -> (status, our text), None where no table holds it; `missing`:
#: how to measure it then. With a `stem`, `ours`(machine, GPUs, table) gets _widest's table of
#: it, else `ours`(tables)
Claim = namedtuple("Claim", "what paper ours missing stem", defaults=(None,))


def _widest(d: dict[str, pd.DataFrame], stem: str) -> tuple[str, int, pd.DataFrame] | None:
    """(machine, GPUs, table) of `stem` from the h200x<n> folder with the most GPUs (the
    closest to the paper's four); None where no such folder holds it."""
    found = [(int(m.group(1)), k.split("/")[0]) for k in d
             if (m := re.fullmatch(r"h200x(\d+)/" + re.escape(stem), k))]  # fmt: skip
    if not found:
        return None
    n, machine = max(found)
    return machine, n, d[f"{machine}/{stem}"]


def _fig3a(_machine: str, n: int, df: pd.DataFrame):
    ok = _ok(df)
    p = ok[(ok["system"] == "overlap") & (ok["transport"] == "p2p")]
    top = p.groupby("p_ccta")["m_gbps"].max()
    ref = ok[ok["system"] == "nccl_all_to_all"]["m_gbps"]
    return "differs", (
        f"{n} H200s over NVLink (p2p): {top.get(4.0, float('nan')):.0f} GB/s with 4 CTAs, "
        f"{top.get(8.0, float('nan')):.0f} with 8, at most {top.max():.0f}; all_to_all_single "
        f"{_range(ref, '.0f', ' GB/s')} (the shape agrees: saturation near 1-2 MiB; the level "
        "is NVLink4's)"
    )


def _padding(d):
    if (df := d.get("cpu/padding")) is None:
        return None
    p = _ok(df)
    p = p[(p["world_size"] == 4) & (p["p_tile_m"] == 128)]
    share = {e: _range(100 * p[p["experts_per_rank"] == e]["m_pad_share"], ".1f", "%")
             for e in (4, 16)}  # fmt: skip
    return "differs", (
        f"W=4, tile_m=128: {share[4]} of GEMM rows at E=4, {share[16]} at the paper's E=16; "
        "the bound (W-1)(tile_m-1) per rank is exceeded (the true bound is E(W-1)(tile_m-1))"
    )


def _correctness(d):
    """The overlap system's errors over every committed table: a cell's max_rel_err, or for
    model rows (the whole model's output) the worst of its MoE calls (m_moe_max_rel_err); and
    how many distinct (workload, error) results they are."""
    errs, distinct = [], 0  # (error, dtype)
    for _, df in sorted(d.items()):
        if "system" in df and "max_rel_err" in df:
            o = _ok(df[df["system"] == "overlap"])
            model = o["scope"].eq("model") if "scope" in o else pd.Series(False, index=o.index)
            per_call = o["m_moe_max_rel_err"] if "m_moe_max_rel_err" in o else float("nan")
            o = o.assign(err=o["max_rel_err"].where(~model, per_call)).dropna(subset=["err"])
            errs += [(e, str(t)) for e, t in zip(o["err"], o.get("dtype", "?"))]
            distinct += len(o[[c for c in [*CELL, "err"] if c in o]].drop_duplicates())
    if not errs:
        return None
    worst, dtype = max(errs)
    over = sum(e > 8e-3 for e, _ in errs)
    short = {"bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype)
    within = "all within 8e-3" if not over else f"{over} above 8e-3"
    return "agrees" if not over else "differs", (
        f"{len(errs)} committed overlap rows (model rows: each MoE call) {within}, max "
        f"{worst:.2e} ({short}); {distinct} distinct (workload, error) results"
    )


def _pairs(df: pd.DataFrame, scope: str, others=("serial",)) -> tuple[pd.DataFrame, list, str]:
    """compare() at the overlap rows' first timing (graph where they have it): (rows, keys,
    timing)."""
    r, keys = fastest(df, scope)
    t = (timings(r) or ["eager"])[0]
    return compare(r, keys, others if others else baselines(r), t), keys, t


def _operator(machine: str, n: int, df: pd.DataFrame):
    """The operator table: speedup over serial per routing, the 1.35x count, serial's own
    ceiling and the cells where overlap is ahead of every baseline."""
    s, keys, t = _pairs(df, "gemm+combine")
    if s.empty:
        return None
    b = best_of(_pairs(df, "gemm+combine", ())[0], keys)
    r = fastest(df, "gemm+combine")[0]
    r = r[(r["system"] == "serial") & (r["timing"] == t)]
    own = (r["compute_ms"] + r["comm_ms"]) / r[["compute_ms", "comm_ms"]].max(axis=1)
    own = own.groupby([r[k] for k in keys]).median().reindex(s.set_index(keys).index)
    sp = s.set_index(keys)["ratio"]
    out = (
        f"{n} H200s over NVLink (`{machine}/operator`, rev {_join(df['git_rev'])}, {t}): "
        + ", ".join(f"{k} {_range(g)}" for k, g in sp.groupby(level="routing"))
        + f"; >= 1.35x in {int((sp >= 1.35).sum())} of {len(sp)} cells; serial's own C and M "
        f"give a ceiling (C + M) / max(C, M) of {_range(own)}, exceeded in "
        f"{int((sp > own).sum())} of {len(sp)} (kernel gain); ahead of every baseline in "
        f"{int((b['ratio'] > 1).sum())} of {len(b)}{_flags(b, 'baseline')}"
    )
    return "differs", out + (" \\*" if serial_caveat(df) else "")


def _ccta(machine: str, n: int, df: pd.DataFrame):
    """cCTA=2 and the best cCTA against serial, from the ccta_mgb table."""
    o = _ok(df).assign(ccta=lambda x: pd.to_numeric(x.get("p_ccta"), errors="coerce"))
    cell = [c for c in CELL if c in o and o[c].notna().all()]
    ser = o[o["system"] == "serial"].groupby(cell)["latency_ms"].min()
    sw = o[(o["system"] == "overlap") & o["ccta"].notna()]
    two = ser / sw[sw["ccta"] == 2].groupby(cell)["latency_ms"].min()
    # per cell, the cCTA whose fastest row is fastest, and whether it is apart from the
    # runner-up (the fastest row of any other cCTA) beyond their 95% CIs
    best, apart = [], 0
    for _, g in sw.groupby(cell):
        f = g.loc[g.groupby("ccta")["latency_ms"].idxmin()].sort_values("latency_ms")
        best.append(f["ccta"].iloc[0])
        apart += bool(f["latency_ci_hi_ms"].iloc[0] < f["latency_ci_lo_ms"].iloc[1])
    return "partly", (
        f"{n} H200s over NVLink (`{machine}/ccta_mgb`, one run): serial / overlap at cCTA=2 "
        f"{_range(two)} (slower than serial in {int((two < 1).sum())} of {len(two)} cells); best "
        f"cCTA {_range(pd.Series(best), 'g', '')}, apart from the runner-up "
        f"cCTA beyond their 95% CIs in {apart} of {len(best)} cells"
        + (" \\*" if serial_caveat(df) else "")
    )


def _bound(machine: str, n: int, df: pd.DataFrame):
    """serial / overlap = kernel gain x overlap gain on the operator table, and the overlap
    gain's ceiling."""
    s, _, t = _pairs(df, "gemm+combine")
    if s["ceiling"].isna().all():
        return None
    cm = " (serialized: C+M)" if s["cm"].any() else ""
    return "explains", (
        f"{n} H200s (`{machine}/operator`, {t}): serial / overlap {_med(s['ratio'])} = kernel gain "
        f"{_med(s['kernel'])} x overlap gain {_med(s['gain'])}{cm}; the overlap gain's ceiling "
        f"(C + M) / max(C, M) {_range(s['ceiling'])}, passed in "
        f"{int((s['gain'] > s['ceiling']).sum())} of {len(s)} cells: above 2, only a kernel gain"
    )


def _vs_systems(n: int, df: pd.DataFrame, scope: str, what: str):
    c, _, t = _pairs(df, scope, ())
    c = pd.concat([c, _pairs(df, scope)[0]])
    parts = [f"vs {s} {_range(g['ratio'])}{_flags(g, 'baseline')}"
             for s, g in c.groupby("system") if g["ratio"].notna().any()]  # fmt: skip
    star = " \\*" if serial_caveat(df) else ""
    return "partly", f"{n} H200s over NVLink, {what} ({t}): " + ", ".join(parts) + star


CLAIMS = [
    Claim("Fig 3a: consumer bandwidth vs transfer size",
          "saturates near 1 MiB; 87 GB/s with 8 SMs, 67 with 4 (A100, NVLink3)", _fig3a,
          "`python -m harness.run experiment=bandwidth` with one process per GPU", "bandwidth"),
    Claim("Padding of the remote-aligned layout",
          "at most (W-1)(tb_M-1) rows per rank; a few percent at W=4", _padding,
          "`python -m harness.run experiment=padding hardware.world_size=1`"),
    Claim("Correctness", "1440 checks within 8e-3 of serial; max 1.913e-3 (fp16)",
          _correctness, "`make test-gpu`"),
    Claim("Operator speedup vs serial", "2.97x balanced, 2.94x moderate, 3.01x stress (4x A100)",
          _operator, "`python -m harness.run experiment=operator hardware=h200` on 2+ GPUs",
          "operator"),
    Claim("cCTA sweep", "cCTA=2 slower than serial everywhere, up to 1.91x; best cCTA in [10, 20]",
          _ccta, "`python -m harness.run experiment=ccta_mgb` with one process per GPU",
          "ccta_mgb"),
    Claim("What overlap alone can buy", "(the paper reports 2.9-3.0x vs serial)", _bound,
          "`python -m harness.run experiment=operator hardware=h200` on 2+ GPUs", "operator"),
    Claim("Fig 4: model end-to-end speedups",
          "vs FasterMoE 1.57-2.64x; vs Tutel 1.35x (M-GPT), 1.15x (M-BERT); slower on M-Trans-xl",
          lambda _, n, df: _vs_systems(n, df, "model", "end to end over the three models"),
          "`python -m harness.run experiment=models` with one process per GPU", "models"),
    Claim("Fig 5: experts 4-64", "vs FasterMoE 1.30-5.33x, vs Tutel 1.77-2.16x",
          lambda _, n, df: _vs_systems(n, df, "layer", "whole layer, E 4-64"),
          "`python -m harness.run experiment=experts`, then `experiment=experts_operator`",
          "experts"),
]  # fmt: skip


def claims_section(d: dict[str, pd.DataFrame]) -> list[str]:
    out = ["## The paper's claims and ours", "", "| claim | paper (4x A100) | ours | status |",
           "| --- | --- | --- | --- |"]  # fmt: skip
    for c in CLAIMS:
        args = _widest(d, c.stem) if c.stem else (d,)
        got = c.ours(*args) if args else None
        text, status = (f"not measured: {c.missing}", "not measured") if got is None else got[::-1]
        out.append(f"| {c.what} | {c.paper} | {text} | {status} |")
    return out + ["", "\\* serial rows: upper bounds (the tables below).", ""]


#: kept study -> the knob it compares (a column of plots.common.placements' rows)
KNOBS = {"operator_order": "p_order", "operator_layouts_loopback": "p_layout",
         "operator_consumer_loopback": "placement"}  # fmt: skip


def knob_ratios(df: pd.DataFrame, col: str) -> str:
    """Per value of `col` but the first: the first value's overlap latency / this value's, per
    cell ("compact vs aligned": above 1, compact is faster)."""
    o = placements(df)
    keys = [c for c in CELL if c in o and o[c].notna().all()]
    lat = o.pivot_table(index=keys, columns=col, values="latency_ms", aggfunc="min")
    first = lat.columns[0]
    return ", ".join(f"{c} vs {first} {_med(lat[first] / lat[c])}" for c in lat.columns[1:])


def summary(key: str, df: pd.DataFrame) -> str:
    """One line on a table: its rows by status and revisions, then what it shows."""
    stem = key.split("/")[1]
    rows = ", ".join(f"{n} {s}" for s, n in sorted(df["status"].value_counts().items())) if (
        "status" in df) else f"{len(df)} benchmark rows"  # fmt: skip
    rev = _join(df["git_rev"].astype(str).str[:7]) if "git_rev" in df else "see the README"
    n = df["run_id"].nunique() if "run_id" in df else 0
    runs = f"; {n} run{'s' if n > 1 else ''}" if n else ""
    s = f"{rows}; rev {rev}{runs}"
    if stem in KNOBS:
        s += "; " + knob_ratios(df, KNOBS[stem])
    elif stem == "producer":
        s += f"; the producer vs torch._grouped_mm {_med(ratios(_ok(df))['vs_grouped_mm'])}"
    elif "system" in df and "overlap" in set(df["system"]) and stem in DRAWN.keys() - {"bandwidth"}:
        if any(stem in stems for _, stems in SCOPES.values()):
            s += "; in the headline"
        elif len(set(_ok(df)["system"])) > 1:
            for others, what in ((["serial"], "serial"), ((), "fastest baseline")):
                c, keys, t = _pairs(df, None, others)
                c = c if others else best_of(c, keys)
                if len(c):
                    when = " (graph)" if t == "graph" else ""
                    s += f"; {what} / overlap {_med(c['ratio'])}{_flags(c, 'baseline')}{when}"
    if serial_caveat(df):
        s += " \\*"
    if stem.startswith("correctness"):
        o = df[df["system"] == "overlap"]
        ok, err = int((o["status"] == "ok").sum()), o["max_rel_err"].max()
        w = len(o[[c for c in CELL if c in o]].drop_duplicates())
        s += (f"; {ok} of {len(o)} checks pass ({w} workloads), max rel. error "
              f"{err:.2e}")  # fmt: skip
    if stem == "autotune_heldout":
        r = df["pick_ratio"].dropna()
        s += (f"; the pick within 3% of the best in {int((r <= 1.03).sum())} of {len(r)} "
              "workloads (no CIs recorded)")  # fmt: skip
    return f"- `{key}`: {s}{'' if stem in DRAWN else '; no figure'}"


def tables_section(d: dict[str, pd.DataFrame]) -> list[str]:
    cav: dict[str, list[str]] = {}
    for k in sorted(d):
        if "system" in d[k] and (c := serial_caveat(d[k])):
            cav.setdefault(c, []).append(f"`{k}`")
    return ["## The tables", "",
            "Commands: `results/reference/<machine>/README.md`, each row's `command`; a run "
            "is one `harness.run` (`run_id`). Ratios as in the headline.", "",
            *(summary(k, d[k]) for k in sorted(d)), "",
            *(f"\\* serial rows of {', '.join(k)}: {c}." for c, k in sorted(cav.items())),
            ""]  # fmt: skip


def figures_section(d: dict[str, pd.DataFrame], figures: Path = FIG_DIR) -> list[str]:
    """The figure index: per figure script, what it shows and the committed tables it draws."""
    out = ["## Figures", "",
           f"`make figures` draws every figure into `{figures}/` from its table alone (no GPU), "
           "named `reference_<machine>_<experiment>` (a suffix per part where a script draws "
           "several); `python -m <script> --table results/reference/<table>.parquet` redraws "
           "one. Each draws one measurement setting (the table's newest).", "",
           "| script | what it shows | tables |", "| --- | --- | --- |"]  # fmt: skip
    drawn: dict[str, list[str]] = {}
    for key in sorted(k for k in d if k.split("/")[1] in DRAWN):
        drawn.setdefault(DRAWN[key.split("/")[1]], []).append(f"`{key}`")
    for module, keys in sorted(drawn.items()):
        out.append(f"| `{module}` | {SHOWS[module.removeprefix('plots.')]} | {', '.join(keys)} |")
    return out + [""]


def autotune_coverage(path: Path = AUTOTUNE_TABLE) -> str:
    """The auto rule's calibrated workloads per transport, W and SM count: "nvlink W=2 132 SMs:
    T 8192, K 2048, N 4096/8192, E 4/16/32/64"."""
    df = pd.read_csv(path)
    axes = (("T", "tokens_per_rank"), ("K", "hidden"), ("N", "out"), ("E", "experts_per_rank"))
    parts = []
    for (tr, w, sm), g in df.groupby(["transport", "world_size", "sm_count"]):
        shape = ", ".join(f"{a} {'/'.join(map(str, sorted(g[c].unique())))}" for a, c in axes)
        parts.append(f"{tr} W={w} {sm} SMs: {shape}")
    return "; ".join(parts)


def unmeasured_section(d: dict[str, pd.DataFrame]) -> list[str]:
    """What no table holds yet; the GPU counts named are those without a h200x<n> folder."""
    have = {int(m.group(1)) for k in d if (m := re.match(r"h200x(\d+)/", k))}
    absent = [n for n in (4, 8) if n not in have]
    gpus = [f"- {' and '.join(map(str, absent))} GPUs ({', '.join(f'W={n}' for n in absent)}): "
            "no such machine was lent; the same commands run there unchanged."]  # fmt: skip
    return ["## Not measured yet", "", *(gpus if absent else []),
            f"- The `auto` cCTA/mgb rule knows its calibrated workloads ({autotune_coverage()}); "
            f"farther than {MAX_DISTANCE:g} (log2 distance) from all of them it takes {DEFAULT}.",
            ""]  # fmt: skip


def render(ref: Path = REF, figures: Path = FIG_DIR) -> str:
    d = tables(ref)
    lines = ["# Report: tile-level overlap for MoE, reproduced", "",
             "Generated by `make report` from the committed tables under `results/reference/` "
             f"only (figures under `{figures}/`); edit nothing here by hand. Loopback rows (one "
             "GPU playing W ranks) are a development proxy, never an interconnect result. Retired "
             "variants have no rows here; `docs/measurements.md` keeps what they measured.",
             ""]  # fmt: skip
    lines += headline(d) + host_free_section(d) + claims_section(d) + tables_section(d)
    if VALIDATION.exists() and PROJECTION.exists():  # the step model's (every number predicted)
        lines += [report_section(), ""]
    lines += figures_section(d, figures) + unmeasured_section(d)
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/REPORT.md")
    ap.add_argument("--readme", default="README.md", help="its headline block is rewritten")
    args = ap.parse_args()
    Path(args.out).write_text(render())
    readme, (start, end) = Path(args.readme), README_MARKS
    text = readme.read_text()
    if start not in text or end not in text:
        raise ValueError(f"README.md has no block {start} ... {end}")
    head, rest = text.split(start, 1)
    block = "\n".join(headline(tables())[2:]).strip()  # the headline section without its heading
    readme.write_text(f"{head}{start}\n{block}\n{end}{rest.split(end, 1)[1]}")
    print(args.out, readme)


if __name__ == "__main__":
    main()
