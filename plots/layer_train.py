"""One training step (forward + backward) of the MoE layer (experiment layer_train): latency per
system and routing, W=1 and one GPU playing W=2 (loopback: a proxy). Lower is better."""

from __future__ import annotations

from pathlib import Path

from plots import common as pc


def plot(table: str | Path, out_dir: str | Path, name: str) -> list[Path]:
    ok = pc.need(pc.load(table), table, "ok rows to plot")
    fig, ((ax,),) = pc.grid(1, 1, w=5.0, h=3.2)
    ok = ok.assign(where=ok["world_size"].map(lambda w: "W=1" if w == 1 else f"W={w} loopback"))
    cells = sorted(set(zip(ok["where"], ok["routing"])))
    systems = sorted(ok["system"].unique())
    colors, width = pc.palette(systems), 0.8 / len(systems)
    for i, s in enumerate(systems):
        mine = ok[ok["system"] == s].groupby(["where", "routing"])["latency_ms"].median()
        xs = [j + i * width for j, c in enumerate(cells) if c in mine.index]
        ax.bar(xs, [mine[c] for c in cells if c in mine.index], width, color=colors[s], label=s)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cells))],
                  [f"{w}\n{r}" for w, r in cells], fontsize=7)  # fmt: skip
    ax.set_ylabel("forward + backward (ms, lower is better)", fontsize=7)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=7)
    shape = ok.iloc[0]
    title = (f"One training step of the MoE layer (T={shape['tokens_per_rank']}, "
             f"H={shape['hidden']}, F={shape['ffn']}, E={shape['experts_per_rank']}), "
             f"{pc.machine(ok)}, eager")  # fmt: skip
    return pc.save(fig, out_dir, name, title)


if __name__ == "__main__":
    pc.main(plot, "results/layer_train.parquet", "layer_train")
