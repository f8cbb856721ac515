"""Layer rows carry no overlap ratio (harness.measure.LAYER_RATIO_NOTE): the layer table of rev
d965164 was measured before that rule and holds 0.0 there (the formula clipped at 0, since its
bounds leave the dispatch out). This sets those cells to NaN and says why in `extra`; every
measured time is unchanged. Run once from the repository root:
python results/reference/migrations/2026_11_30_layer_overlap_ratio.py"""

import json

import pandas as pd

from harness.measure import LAYER_RATIO_NOTE

PATH = "results/reference/h200x2/layer.parquet"
df = pd.read_parquet(PATH)
layer = (df["ffn"] > 0) & df["compute_ms"].notna()
df.loc[layer, "overlap_ratio"] = float("nan")
df.loc[layer, "extra"] = [
    json.dumps({**json.loads(e or "{}"), "overlap_ratio": LAYER_RATIO_NOTE}, sort_keys=True)
    for e in df.loc[layer, "extra"]
]
df.to_parquet(PATH, index=False)
print(f"{PATH}: {int(layer.sum())} layer rows, overlap_ratio set to NaN")
