"""Fig 3a: consumer bandwidth against segment size, one line per cCTA, one panel per transport,
with the all_to_all_single reference (dashed) where measured. Higher is better. GB/s count only
the bytes that leave the sending GPU; loopback is a copy on one GPU, not an interconnect figure."""

from __future__ import annotations

from pathlib import Path

from plots.common import grid, load, main, need, save

REFERENCE = "nccl_all_to_all"


def plot(table: str | Path, out_dir: str | Path, name: str) -> list[Path]:
    df = load(table)
    cons = need(df[df["system"] != REFERENCE], table, "ok consumer rows")
    ref = df[df["system"] == REFERENCE]
    panels = list(dict.fromkeys(zip(cons["transport"], cons["world_size"])))
    fig, axes = grid(1, len(panels), 4.5, 3.8)
    for ax, (tr, w) in zip(axes[0], panels):
        sub = cons[(cons["transport"] == tr) & (cons["world_size"] == w)]
        for ccta, s in sub.groupby("p_ccta"):
            s = s.sort_values("m_segment_bytes")
            ax.plot(s["m_segment_bytes"] / 1024, s["m_gbps"], "o-", ms=3, label=f"cCTA={ccta:g}")
        r = ref[ref["world_size"] == w].sort_values("m_segment_bytes")
        if tr != "loopback" and not r.empty:
            ax.plot(r["m_segment_bytes"] / 1024, r["m_gbps"], "k--", label="all_to_all_single")
        ax.set_xscale("log", base=2)
        local = tr == "loopback" or w == 1
        moved = "copied on the GPU" if local else "leaving the GPU"
        ax.set(xlabel="segment size (KiB)", ylabel=f"GB/s {moved} (higher is better)")
        ax.set_title(f"{tr}{' (local copy)' if local else ''}, W={w:g}", fontsize=9)
        ax.legend(fontsize=7)
    gpu = ", ".join(sorted(set(df["gpu_name"].astype(str))))
    return save(fig, out_dir, name, f"Consumer bandwidth vs transfer size (Fig 3a); {gpu}")


if __name__ == "__main__":
    main(plot, "results/bandwidth.parquet", "bandwidth")
